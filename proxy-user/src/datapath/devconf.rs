//! A link's IPv4 settings (`net.ipv4.conf.<link>.*`) written over rtnetlink instead of
//! /proc/sys, which is read-only in an unprivileged container: with CAP_NET_ADMIN alone the
//! DaemonSet can set what the per-packet path needs.
use std::io;

use crate::netlink::{NLA_F_NESTED, attr, message, request_ack};

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
    let mut body = vec![0u8; 16]; // struct ifinfomsg: family, pad, type, index, flags, change
    body[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    body.extend_from_slice(&spec);
    request_ack(libc::NETLINK_ROUTE, &message(libc::RTM_SETLINK, libc::NLM_F_ACK as u16, &body))
}
