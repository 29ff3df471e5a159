//! The node's links and addresses, from the kernel of the agent's network namespace: a full
//! snapshot (getifaddrs) at start and again whenever rtnetlink announces a link or address
//! change, so links created later (pods come and go) and addresses added at runtime are
//! followed without a restart.
use std::{
    collections::BTreeMap,
    ffi::CStr,
    net::IpAddr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

use anyhow::{Context as _, Result};
use tokio::{io::unix::AsyncFd, sync::mpsc};

use super::SourceEvent;
use crate::{
    model::node::{HostLink, KernelRoute},
    netlink,
};

/// Every link of this network namespace with its addresses, by index.
pub fn snapshot() -> Result<Vec<HostLink>> {
    let unselectable = v4_unselectable();
    let rp_filter_all = rp_filter("all");
    let mut by_name: BTreeMap<String, HostLink> = BTreeMap::new();
    for mut link in links()? {
        link.v4_unselectable = unselectable.get(&link.index).cloned().unwrap_or_default();
        link.rp_filter = rp_filter_all.max(rp_filter(&link.name));
        by_name.insert(link.name.clone(), link);
    }
    // The addresses, from getifaddrs (which lists a link itself only if it has a hardware
    // address: not a TUN or WireGuard link, hence the dump above).
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free with freeifaddrs; entries are read-only here.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getifaddrs");
    }
    let mut addrs: Vec<(String, IpAddr)> = Vec::new();
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
            libc::AF_INET => {
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                addrs.push((name, IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes())));
            }
            libc::AF_INET6 => {
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                addrs.push((name, IpAddr::from(sin6.sin6_addr.s6_addr)));
            }
            _ => {}
        }
    }
    unsafe { libc::freeifaddrs(list) };
    for (name, addr) in addrs {
        // Labels like `eth0:1` hold addresses of `eth0`.
        let base = name.split(':').next().unwrap_or(&name);
        if let Some(link) = by_name.get_mut(base)
            && !link.addrs.contains(&addr)
        {
            link.addrs.push(addr);
        }
    }
    let mut links: Vec<HostLink> = by_name.into_values().collect();
    links.sort_by_key(|l| l.index);
    Ok(links)
}

/// Every link (RTM_GETLINK), without its addresses: its index, name, and what its kind tells
/// the per-packet path: loopback; one end of a veth pair whose other end is in another network
/// namespace (`IFLA_LINK_NETNSID`: a pod's); an Ethernet header on its packets or not (its
/// hardware type: IP-in-IP, SIT, GRE, WireGuard, TUN and netkit in L3 mode have none).
fn links() -> Result<Vec<HostLink>> {
    const ARPHRD_ETHER: u16 = 1;
    const ARPHRD_LOOPBACK: u16 = 772;
    // An ifinfomsg of zeros: every link of every family.
    let request = netlink::message(libc::RTM_GETLINK, libc::NLM_F_DUMP as u16, &[0; 16]);
    let dump = netlink::dump(libc::NETLINK_ROUTE, &request).context("listing the links (RTM_GETLINK)")?;
    let mut links = Vec::new();
    for link in &dump {
        // struct ifinfomsg: family, pad, type (u16), index (i32), flags (u32), change; then
        // the attributes.
        let (Some(head), Some(attrs)) = (link.get(..16), link.get(16..)) else { continue };
        let hardware = u16::from_ne_bytes([head[2], head[3]]);
        let index = u32::from_ne_bytes([head[4], head[5], head[6], head[7]]);
        let flags = u32::from_ne_bytes([head[8], head[9], head[10], head[11]]);
        let Some(name) = netlink::find(attrs, libc::IFLA_IFNAME) else { continue };
        let name = String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name)).into_owned();
        let kind = netlink::find(attrs, libc::IFLA_LINKINFO).and_then(|info| netlink::find(info, libc::IFLA_INFO_KIND));
        // Not netkit: in its L3 mode a packet has no MAC addresses to write.
        let veth = kind.is_some_and(|k| k.strip_suffix(b"\0").unwrap_or(k) == b"veth");
        links.push(HostLink {
            index,
            name,
            loopback: flags & libc::IFF_LOOPBACK as u32 != 0,
            addrs: Vec::new(),
            v4_unselectable: Vec::new(),
            peer_nsid: netlink::find(attrs, libc::IFLA_LINK_NETNSID)
                .filter(|_| veth)
                .and_then(|v| Some(i32::from_ne_bytes(v.try_into().ok()?))),
            ethernet: hardware == ARPHRD_ETHER || hardware == ARPHRD_LOOPBACK,
            rp_filter: 0,
        });
    }
    Ok(links)
}

/// Per link, the IPv4 addresses the kernel's source selection passes over for a global
/// destination: scoped narrower than global (`scope link`, `scope host`) or secondary
/// (RTM_GETADDR; getifaddrs tells neither). Empty if the dump fails: every address counts.
fn v4_unselectable() -> BTreeMap<u32, Vec<std::net::Ipv4Addr>> {
    const IFA_ADDRESS: u16 = 1;
    const IFA_LOCAL: u16 = 2;
    const IFA_F_SECONDARY: u8 = 0x01;
    // struct ifaddrmsg: family, prefixlen, flags, scope, index.
    let request =
        netlink::message(libc::RTM_GETADDR, libc::NLM_F_DUMP as u16, &[libc::AF_INET as u8, 0, 0, 0, 0, 0, 0, 0]);
    let addrs = match netlink::dump(libc::NETLINK_ROUTE, &request) {
        Ok(addrs) => addrs,
        Err(e) => {
            tracing::warn!("listing the addresses' scopes: {e}");
            return BTreeMap::new();
        }
    };
    let mut out: BTreeMap<u32, Vec<std::net::Ipv4Addr>> = BTreeMap::new();
    for msg in &addrs {
        let Some(head) = msg.get(..8) else { continue };
        let (flags, scope, index) = (head[2], head[3], u32::from_ne_bytes([head[4], head[5], head[6], head[7]]));
        if head[0] != libc::AF_INET as u8 || (scope == libc::RT_SCOPE_UNIVERSE && flags & IFA_F_SECONDARY == 0) {
            continue;
        }
        let attrs = &msg[8..];
        let Some(addr) = netlink::find(attrs, IFA_LOCAL).or_else(|| netlink::find(attrs, IFA_ADDRESS)) else {
            continue;
        };
        if let Ok(octets) = <[u8; 4]>::try_from(addr) {
            out.entry(index).or_default().push(octets.into());
        }
    }
    out
}

/// The source address routing picks for `dst` (RTM_GETROUTE's preferred source), as a
/// connect() from this network namespace would get it.
pub fn route_source(dst: std::net::Ipv4Addr) -> Option<std::net::Ipv4Addr> {
    match route(dst.into())?.source? {
        IpAddr::V4(source) => Some(source),
        IpAddr::V6(_) => None,
    }
}

/// The kernel's route to `dst` from this network namespace (RTM_GETROUTE): the link, the
/// preferred source, whether it is delivered locally. `None`: no route.
pub fn route(dst: IpAddr) -> Option<KernelRoute> {
    route_on(&netlink::Session::open(libc::NETLINK_ROUTE).ok()?, dst)
}

/// [`route`] of each of `dsts`, asked over one netlink socket.
pub fn routes(dsts: impl IntoIterator<Item = IpAddr>) -> Vec<(IpAddr, Option<KernelRoute>)> {
    let session = netlink::Session::open(libc::NETLINK_ROUTE).ok();
    dsts.into_iter().map(|dst| (dst, session.as_ref().and_then(|s| route_on(s, dst)))).collect()
}

fn route_on(session: &netlink::Session, dst: IpAddr) -> Option<KernelRoute> {
    const RTN_LOCAL: u8 = 2;
    let (family, octets): (u8, Vec<u8>) = match dst {
        IpAddr::V4(a) => (libc::AF_INET as u8, a.octets().to_vec()),
        IpAddr::V6(a) => (libc::AF_INET6 as u8, a.octets().to_vec()),
    };
    // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags (u32).
    let mut body = vec![family, octets.len() as u8 * 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    body.extend(netlink::attr(libc::RTA_DST, &octets));
    let reply = session.request(&netlink::message(libc::RTM_GETROUTE, 0, &body)).ok()?;
    let head = reply.get(..12)?;
    let attrs = &reply[12..];
    let link = netlink::find(attrs, libc::RTA_OIF).and_then(|v| Some(u32::from_ne_bytes(v.try_into().ok()?)))?;
    let source = netlink::find(attrs, libc::RTA_PREFSRC).and_then(|v| match v.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(v).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(v).ok()?)),
        _ => None,
    });
    Some(KernelRoute { link, source, local: head[7] == RTN_LOCAL })
}

/// Send a snapshot now and after every change, until the receiver goes away. A failure to
/// open the notification socket falls back to a rescan every few seconds.
pub async fn run(tx: mpsc::Sender<SourceEvent>) -> Result<()> {
    let socket = match rtnetlink_socket() {
        // SAFETY: the AsyncFd owns the socket for as long as it is registered.
        Ok(s) => Some(unsafe { AsyncFd::register(s) }.map_err(|e| anyhow::anyhow!("{e}"))?),
        Err(e) => {
            tracing::warn!("no rtnetlink notifications ({e:#}); rescanning links every 5 s");
            None
        }
    };
    let mut last = None;
    loop {
        match snapshot() {
            Ok(links) if last.as_ref() != Some(&links) => {
                last = Some(links.clone());
                if tx.send(SourceEvent::Host(links)).await.is_err() {
                    return Ok(());
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("failed to read the node's links: {e:#}"),
        }
        match &socket {
            Some(socket) => {
                wait_and_drain(socket).await?;
                // Coalesce a burst (a pod's veth pair, its addresses) into one rescan.
                tokio::time::sleep(Duration::from_millis(20)).await;
                drain(socket.get_ref());
            }
            None => tokio::time::sleep(Duration::from_secs(5)).await,
        }
    }
}

/// IPv4 `rp_filter` of `conf` (`all` or a link's name) in this network namespace; 0 when
/// unreadable.
fn rp_filter(conf: &str) -> u8 {
    let path = format!("/proc/sys/net/ipv4/conf/{conf}/rp_filter");
    std::fs::read_to_string(path).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// A non-blocking rtnetlink socket subscribed to link and address changes.
fn rtnetlink_socket() -> Result<OwnedFd> {
    // SAFETY: plain socket/bind calls; the fd is owned right after creation.
    let fd = unsafe {
        libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE)
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("socket(AF_NETLINK)");
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as u16;
    addr.nl_groups = (libc::RTMGRP_LINK | libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR) as u32;
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
            size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("bind(rtnetlink groups)");
    }
    Ok(fd)
}

async fn wait_and_drain(socket: &AsyncFd<OwnedFd>) -> Result<()> {
    let mut guard = socket.readable().await?;
    drain(socket.get_ref());
    guard.clear_ready();
    Ok(())
}

/// Read and discard every queued notification: the content does not matter, a rescan follows.
/// An overrun (ENOBUFS) means messages were lost, which the rescan covers too.
fn drain(fd: &OwnedFd) {
    let mut buf = [0u8; 16384];
    loop {
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOBUFS) {
            return;
        }
        if n == 0 {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_source_of_a_local_address_is_itself() {
        assert_eq!(route_source("127.0.0.1".parse().unwrap()), Some("127.0.0.1".parse().unwrap()));
        let lo = route("127.0.0.1".parse().unwrap()).expect("a route to 127.0.0.1");
        assert!(lo.local, "{lo:?}");
        assert_eq!(lo.link, 1, "by lo");
        // Several over one socket: each answered, in order.
        let asked: Vec<IpAddr> = ["127.0.0.1", "127.0.0.2", "::1"].map(|a| a.parse().unwrap()).to_vec();
        let answers = routes(asked.clone());
        assert_eq!(answers.iter().map(|(ip, _)| *ip).collect::<Vec<_>>(), asked);
        assert!(answers.iter().all(|(_, r)| r.is_some_and(|r| r.local && r.link == 1)), "{answers:?}");
    }

    #[test]
    fn snapshot_lists_loopback_with_its_address() {
        let links = snapshot().unwrap();
        let lo = links.iter().find(|l| l.loopback).expect("a loopback link");
        assert_eq!(lo.index, 1);
        assert!(lo.addrs.contains(&"127.0.0.1".parse().unwrap()), "{lo:?}");
    }
}
