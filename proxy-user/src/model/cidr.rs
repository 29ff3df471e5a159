//! An IP prefix of either family (`10.244.0.0/16`, `fd00::/64`), as Kubernetes writes them.
use std::{fmt, net::IpAddr, str::FromStr};

/// A CIDR, kept with its host bits cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl Cidr {
    pub fn new(addr: IpAddr, len: u8) -> Option<Self> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        (len <= max).then(|| Self { addr: mask(addr, len), len })
    }

    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.addr.is_ipv4() && mask(ip, self.len) == self.addr
    }
}

fn mask(addr: IpAddr, len: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let m = u32::MAX.checked_shl(32 - u32::from(len.min(32))).unwrap_or(0);
            IpAddr::V4((u32::from(a) & m).into())
        }
        IpAddr::V6(a) => {
            let m = u128::MAX.checked_shl(128 - u32::from(len.min(128))).unwrap_or(0);
            IpAddr::V6((u128::from(a) & m).into())
        }
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (addr, len) = s.split_once('/').ok_or_else(|| format!("`{s}` is not a CIDR (address/length)"))?;
        let addr: IpAddr = addr.parse().map_err(|_| format!("`{s}`: `{addr}` is not an IP address"))?;
        let len: u8 = len.parse().map_err(|_| format!("`{s}`: bad prefix length"))?;
        Self::new(addr, len).ok_or_else(|| format!("`{s}`: prefix length too long for the address family"))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl serde::Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_families_and_checks_membership() {
        let c: Cidr = "10.244.3.7/16".parse().unwrap();
        assert_eq!(c.to_string(), "10.244.0.0/16");
        assert!(c.contains("10.244.200.1".parse().unwrap()));
        assert!(!c.contains("10.245.0.1".parse().unwrap()));
        assert!(!c.contains("::ffff:10.244.0.1".parse().unwrap()));
        let c6: Cidr = "fd00:10::/64".parse().unwrap();
        assert!(c6.contains("fd00:10::5".parse().unwrap()));
        assert!("0.0.0.0/0".parse::<Cidr>().unwrap().contains("8.8.8.8".parse().unwrap()));
        for bad in ["10.0.0.0", "10.0.0.0/33", "x/8", "fd00::/129"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }
}
