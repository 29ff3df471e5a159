//! A link's IPv4 settings (`net.ipv4.conf.<link>.*`) written over rtnetlink instead of
//! /proc/sys, which is read-only in an unprivileged container: with CAP_NET_ADMIN alone the
//! DaemonSet can set what the per-packet path needs.
use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

/// `IPV4_DEVCONF_ACCEPT_LOCAL` (linux/ip.h): accept packets whose source is a local address.
const IPV4_DEVCONF_ACCEPT_LOCAL: u16 = 23;
/// `IFLA_INET_CONF` inside `IFLA_AF_SPEC`/`AF_INET` (linux/if_link.h).
const IFLA_INET_CONF: u16 = 1;

/// Set `net.ipv4.conf.<ifindex>.accept_local`.
pub fn set_accept_local(ifindex: u32, on: bool) -> io::Result<()> {
    set_ipv4_conf(ifindex, IPV4_DEVCONF_ACCEPT_LOCAL, u32::from(on))
}

/// RTM_SETLINK with IFLA_AF_SPEC { AF_INET { IFLA_INET_CONF { id: value } } }, acknowledged.
fn set_ipv4_conf(ifindex: u32, id: u16, value: u32) -> io::Result<()> {
    let setting = attr(id, &value.to_ne_bytes());
    let inet = attr(libc::AF_INET as u16 | NLA_F_NESTED, &attr(IFLA_INET_CONF | NLA_F_NESTED, &setting));
    let spec = attr(libc::IFLA_AF_SPEC | NLA_F_NESTED, &inet);
    let mut ifinfo = [0u8; 16]; // struct ifinfomsg: family, pad, type, index, flags, change
    ifinfo[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    let len = 16 + ifinfo.len() + spec.len();
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(&(len as u32).to_ne_bytes());
    msg.extend_from_slice(&libc::RTM_SETLINK.to_ne_bytes());
    msg.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
    msg.extend_from_slice(&ifinfo);
    msg.extend_from_slice(&spec);
    request(&msg)
}

const NLA_F_NESTED: u16 = 1 << 15;

/// A netlink attribute: length, type, payload, padded to 4 bytes.
fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
    let len = 4 + payload.len();
    let mut out = Vec::with_capacity(len.next_multiple_of(4));
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize(len.next_multiple_of(4), 0);
    out
}

/// Send one request on a fresh NETLINK_ROUTE socket and return the kernel's verdict.
fn request(msg: &[u8]) -> io::Result<()> {
    // SAFETY: plain socket calls on an fd owned right after creation; buffers outlive them.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if unsafe { libc::send(fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut reply = [0u8; 1024];
    let n = unsafe { libc::recv(fd.as_raw_fd(), reply.as_mut_ptr().cast(), reply.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // nlmsghdr (16 bytes) of type NLMSG_ERROR, then struct nlmsgerr whose first field is the
    // negated errno (0: done).
    let n = n as usize;
    if n < 20 || u16::from_ne_bytes([reply[4], reply[5]]) != libc::NLMSG_ERROR as u16 {
        return Err(io::Error::other("unexpected rtnetlink reply"));
    }
    match i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]) {
        0 => Ok(()),
        err => Err(io::Error::from_raw_os_error(-err)),
    }
}
