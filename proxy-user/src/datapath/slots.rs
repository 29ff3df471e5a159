//! Allocation of contiguous ranges in the backend array (first fit, coalescing free list).
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

/// How long a released range stays unused: far longer than any program run that may have
/// read the entry pointing at it an instant before the switch.
pub const QUARANTINE: Duration = Duration::from_secs(1);

pub struct SlotAllocator {
    /// start → length of each free range; ranges never touch (they are merged).
    free: BTreeMap<u32, u32>,
    /// Released ranges not yet reusable, with the time they were released.
    quarantined: Vec<(u32, u32, Instant)>,
    quarantine: Duration,
}

impl SlotAllocator {
    pub fn new(slots: u32) -> Self {
        let mut free = BTreeMap::new();
        if slots > 0 {
            free.insert(0, slots);
        }
        Self { free, quarantined: Vec::new(), quarantine: QUARANTINE }
    }

    pub fn set_quarantine(&mut self, quarantine: Duration) {
        self.quarantine = quarantine;
    }

    pub fn free_slots(&self) -> u64 {
        self.free.values().map(|&l| u64::from(l)).sum()
    }

    pub fn alloc(&mut self, len: u32) -> Option<u32> {
        let (&start, &free_len) = self.free.iter().find(|&(_, &l)| l >= len)?;
        self.free.remove(&start);
        if free_len > len {
            self.free.insert(start + len, free_len - len);
        }
        Some(start)
    }

    /// Mark `[start, start+len)` used (recovering state from the maps). False if any of it is
    /// not free (overlap with an already claimed range).
    pub fn claim(&mut self, start: u32, len: u32) -> bool {
        let Some((&fstart, &flen)) = self.free.range(..=start).next_back() else { return false };
        if u64::from(start) + u64::from(len) > u64::from(fstart) + u64::from(flen) {
            return false;
        }
        self.free.remove(&fstart);
        if start > fstart {
            self.free.insert(fstart, start - fstart);
        }
        let (end, fend) = (start + len, fstart + flen);
        if fend > end {
            self.free.insert(end, fend - end);
        }
        true
    }

    pub fn free(&mut self, mut start: u32, mut len: u32) {
        if let Some((&prev, &plen)) = self.free.range(..start).next_back()
            && prev + plen == start
        {
            self.free.remove(&prev);
            start = prev;
            len += plen;
        }
        if let Some(&nlen) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += nlen;
        }
        self.free.insert(start, len);
    }

    pub fn quarantine(&mut self, start: u32, len: u32, now: Instant) {
        self.quarantined.push((start, len, now));
    }

    /// Free the ranges released at least the quarantine before `now`.
    pub fn end_quarantine(&mut self, now: Instant) {
        for (start, len, since) in std::mem::take(&mut self.quarantined) {
            if now.duration_since(since) >= self.quarantine {
                self.free(start, len);
            } else {
                self.quarantined.push((start, len, since));
            }
        }
    }

    /// When the next quarantined range becomes free.
    pub fn quarantine_ends(&self) -> Option<Instant> {
        self.quarantined.iter().map(|&(_, _, since)| since + self.quarantine).min()
    }

    /// Keep `other`'s quarantine (an allocator rebuilt from the maps sees those ranges free:
    /// nothing refers to them any more).
    pub fn carry_quarantine(&mut self, other: &SlotAllocator) {
        for &(start, len, since) in &other.quarantined {
            if self.claim(start, len) {
                self.quarantined.push((start, len, since));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesce() {
        let mut s = SlotAllocator::new(10);
        assert_eq!(s.alloc(4), Some(0));
        assert_eq!(s.alloc(4), Some(4));
        assert_eq!(s.alloc(4), None);
        s.free(0, 4);
        assert_eq!(s.alloc(3), Some(0));
        s.free(0, 3);
        s.free(4, 4);
        assert_eq!(s.free_slots(), 10);
        assert_eq!(s.alloc(10), Some(0), "free ranges were merged");
    }

    #[test]
    fn claim_rejects_overlap() {
        let mut s = SlotAllocator::new(10);
        assert!(s.claim(2, 3));
        assert!(!s.claim(4, 2));
        assert!(s.claim(5, 5));
        assert!(!s.claim(9, 2));
        assert_eq!(s.free_slots(), 2);
        assert_eq!(s.alloc(2), Some(0));
    }

    #[test]
    fn quarantined_ranges_wait_their_time() {
        let mut s = SlotAllocator::new(4);
        let t0 = Instant::now();
        assert_eq!(s.alloc(4), Some(0));
        s.quarantine(0, 4, t0);
        s.end_quarantine(t0);
        assert_eq!(s.alloc(1), None, "not free right after release");
        assert_eq!(s.quarantine_ends(), Some(t0 + QUARANTINE));
        // A rebuilt allocator keeps the quarantine.
        let mut rebuilt = SlotAllocator::new(4);
        rebuilt.carry_quarantine(&s);
        assert_eq!(rebuilt.alloc(1), None);
        rebuilt.end_quarantine(t0 + QUARANTINE);
        assert_eq!(rebuilt.alloc(4), Some(0));
    }
}
