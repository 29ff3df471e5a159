//! Maglev consistent hashing (Eisenbud et al., NSDI 2016), as Cilium and Katran build it: a
//! lookup table of a prime size whose slots name endpoints. A new flow's tuple hash picks a
//! slot. The table depends on the endpoints (as a set) and a cluster-wide seed alone, so every
//! node builds the same one and sends the same tuple to the same endpoint: a flow an ECMP
//! router moves to another node keeps its endpoint. When one of N endpoints leaves, about 1/N
//! of the slots change (its own), and few others.
//!
//! The programmer writes a Maglev frontend's table into `KPR_MAGLEV` (`datapath::write_maglev`);
//! the per-packet path takes the slot of the tuple's hash (`proxy_common::tuple_hash`, seeded
//! with `--maglev-seed`) for a new flow from outside (docs/behaviour.md, "Maglev").
use std::{hash::Hasher as _, net::SocketAddr};

use siphasher::sip128::{Hasher128 as _, SipHasher13};

/// Cilium's and Katran's default table size: a prime, over 100 slots per endpoint up to 163
/// endpoints.
pub const DEFAULT_TABLE_SIZE: u32 = proxy_common::MAGLEV_DEFAULT_TABLE_SIZE;
/// Their large table size, for Services of up to 655 endpoints at 100 slots each.
pub const LARGE_TABLE_SIZE: u32 = 65_537;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum MaglevError {
    #[error("a Maglev table's size must be a prime, not {0}")]
    NotPrime(u32),
    #[error("{endpoints} endpoints do not fit a Maglev table of {size} slots")]
    TooManyEndpoints { endpoints: usize, size: u32 },
}

/// The table of `size` slots (a prime) for `endpoints`: each slot's index into `endpoints`.
/// The order of `endpoints` does not matter: the slots name the same endpoint whatever it is
/// (they are placed in address order). Empty for no endpoint.
pub fn table(endpoints: &[SocketAddr], size: u32, seed: u64) -> Result<Vec<u32>, MaglevError> {
    if !is_prime(size) {
        return Err(MaglevError::NotPrime(size));
    }
    if endpoints.len() > size as usize {
        return Err(MaglevError::TooManyEndpoints { endpoints: endpoints.len(), size });
    }
    if endpoints.is_empty() {
        return Ok(Vec::new());
    }
    // Placed in address order, so that every node breaks the ties alike.
    let mut order: Vec<u32> = (0..endpoints.len() as u32).collect();
    order.sort_by_key(|&i| endpoints[i as usize]);
    // Each endpoint's permutation of the slots: offset + j × skip (mod size); skip is non-zero
    // and the size prime, so it visits every slot.
    let (offset, skip): (Vec<u64>, Vec<u64>) = order
        .iter()
        .map(|&i| {
            let (h1, h2) = endpoint_hash(&endpoints[i as usize], seed);
            (h1 % u64::from(size), h2 % u64::from(size - 1) + 1)
        })
        .unzip();
    const EMPTY: u32 = u32::MAX;
    let mut slots = vec![EMPTY; size as usize];
    let mut next = vec![0u64; order.len()];
    let mut filled = 0;
    // Each endpoint in turn takes the next free slot of its permutation, until all are taken.
    while filled < size {
        for (k, &endpoint) in order.iter().enumerate() {
            let slot = loop {
                let slot = ((offset[k] + next[k] * skip[k]) % u64::from(size)) as usize;
                next[k] += 1;
                if slots[slot] == EMPTY {
                    break slot;
                }
            };
            slots[slot] = endpoint;
            filled += 1;
            if filled == size {
                break;
            }
        }
    }
    Ok(slots)
}

/// Two independent 64-bit hashes of an endpoint (its address, as 16 bytes with IPv4 mapped, and
/// its port), keyed by the seed: SipHash-1-3, whose output is fixed by its specification, so
/// nodes running different builds still agree.
fn endpoint_hash(endpoint: &SocketAddr, seed: u64) -> (u64, u64) {
    let mut hasher = SipHasher13::new_with_keys(seed, seed ^ 0x6b70_725f_6d61_676c);
    let addr = match endpoint.ip() {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        std::net::IpAddr::V6(v6) => v6,
    };
    hasher.write(&addr.octets());
    hasher.write(&endpoint.port().to_be_bytes());
    let hash = hasher.finish128();
    (hash.h1, hash.h2)
}

/// A table size `--maglev-table-size` takes: a prime from 251 to 131,071 (Cilium's bounds).
pub fn check_table_size(size: u32) -> Result<u32, String> {
    use proxy_common::{MAGLEV_MAX_TABLE_SIZE as MAX, MAGLEV_MIN_TABLE_SIZE as MIN};
    if !(MIN..=MAX).contains(&size) {
        return Err(format!("a Maglev table has {MIN} to {MAX} slots, not {size}"));
    }
    if !is_prime(size) {
        return Err(format!("a Maglev table's size must be a prime (16381, 65537, ...), not {size}"));
    }
    Ok(size)
}

fn is_prime(n: u32) -> bool {
    n >= 2 && (2..).take_while(|d: &u32| u64::from(*d) * u64::from(*d) <= u64::from(n)).all(|d| !n.is_multiple_of(d))
}

/// The share of `before`'s slots whose endpoint is another in `after` (both naming endpoints by
/// address, as [`table`]'s indices into their own lists).
pub fn remapped_share(before: &[SocketAddr], after: &[SocketAddr]) -> f64 {
    let changed = before.iter().zip(after).filter(|(b, a)| b != a).count();
    changed as f64 / before.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;

    const SEED: u64 = 0x1234_5678_9abc_def0;

    fn endpoints(n: u32) -> Vec<SocketAddr> {
        (0..n).map(|i| SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0af4_0002 + (i << 8))), 8080)).collect()
    }

    /// The table as addresses.
    fn named(endpoints: &[SocketAddr], size: u32) -> Vec<SocketAddr> {
        table(endpoints, size, SEED).unwrap().into_iter().map(|i| endpoints[i as usize]).collect()
    }

    #[test]
    fn the_table_depends_on_the_endpoints_and_the_seed_not_their_order() {
        let mut list = endpoints(10);
        let first = named(&list, DEFAULT_TABLE_SIZE);
        list.reverse();
        assert_eq!(named(&list, DEFAULT_TABLE_SIZE), first, "another order, the same table");
        let other_seed: Vec<SocketAddr> =
            table(&list, DEFAULT_TABLE_SIZE, SEED + 1).unwrap().into_iter().map(|i| list[i as usize]).collect();
        assert_ne!(other_seed, first, "another seed, another table");
        // Fixed by SipHash's specification: this build and the next agree on it (a change of
        // hash, key or permutation shows here).
        assert_eq!(
            first[..4],
            [
                "10.244.5.2:8080".parse().unwrap(),
                "10.244.5.2:8080".parse().unwrap(),
                "10.244.9.2:8080".parse().unwrap(),
                "10.244.6.2:8080".parse().unwrap()
            ],
        );
    }

    #[test]
    fn every_endpoint_gets_its_share_of_the_slots() {
        for n in [1, 3, 100] {
            let list = endpoints(n);
            let slots = table(&list, DEFAULT_TABLE_SIZE, SEED).unwrap();
            assert_eq!(slots.len(), DEFAULT_TABLE_SIZE as usize);
            let mut counts = vec![0u32; n as usize];
            for s in slots {
                counts[s as usize] += 1;
            }
            let fair = DEFAULT_TABLE_SIZE / n;
            // Maglev gives each endpoint its share give or take one slot.
            assert!(counts.iter().all(|&c| c.abs_diff(fair) <= 1), "n = {n}: {counts:?}");
        }
    }

    #[test]
    fn one_endpoint_leaving_or_joining_moves_little_more_than_its_own_slots() {
        // Maglev's disruption grows as the slots per endpoint shrink (the paper's figure 11):
        // at 1,600 a slot it is its own share, at 160 (100 endpoints, the default size) 2.5
        // times that, at 650 (the large size) 1.6 times. A modulo hash would move nearly all.
        for (n, size, bound) in
            [(10u32, DEFAULT_TABLE_SIZE, 1.2), (100, DEFAULT_TABLE_SIZE, 3.0), (100, LARGE_TABLE_SIZE, 2.0)]
        {
            let more = endpoints(n + 1);
            let base = named(&more[..n as usize], size);
            // One of the n leaves: its 1/n of the slots move, and a few more.
            let left = remapped_share(&base, &named(&more[..n as usize - 1], size));
            let own = 1.0 / f64::from(n);
            assert!(left >= own * 0.99 && left <= own * bound, "{n} in {size} slots, one leaves: {left}");
            // A new one joins: it takes 1/(n + 1) of them, and a few more move.
            let joined = remapped_share(&base, &named(&more, size));
            let its = 1.0 / f64::from(n + 1);
            assert!(joined >= its * 0.99 && joined <= its * bound, "{n} in {size} slots, one joins: {joined}");
        }
    }

    #[test]
    fn a_size_that_is_not_prime_or_too_small_is_an_error() {
        assert_eq!(table(&endpoints(2), 16_384, SEED), Err(MaglevError::NotPrime(16_384)));
        assert_eq!(table(&endpoints(8), 7, SEED), Err(MaglevError::TooManyEndpoints { endpoints: 8, size: 7 }));
        assert_eq!(table(&[], 7, SEED), Ok(Vec::new()));
        assert!(is_prime(DEFAULT_TABLE_SIZE) && is_prime(LARGE_TABLE_SIZE));
    }

    #[test]
    fn the_table_size_flag_takes_primes_within_ciliums_bounds() {
        for size in [251, DEFAULT_TABLE_SIZE, LARGE_TABLE_SIZE, 131_071] {
            assert_eq!(check_table_size(size), Ok(size));
        }
        for (size, says) in [(16_384, "a prime"), (241, "251 to 131071"), (131_101, "251 to 131071")] {
            let e = check_table_size(size).unwrap_err();
            assert!(e.contains(says), "{size}: {e}");
        }
    }
}
