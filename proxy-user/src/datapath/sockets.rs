//! Sockets the socket path connected to an endpoint that left: aborted through sock_diag
//! (`SOCK_DESTROY`, `CONFIG_INET_DIAG_DESTROY`). UDP, as kube-proxy deletes the conntrack
//! entries of UDP flows whose endpoint went away: the application's next `recv()` fails with
//! `ECONNABORTED` and the socket is unconnected; connecting again picks a live endpoint. TCP
//! (`--abort-dead-tcp`), an endpoint that died: the kernel fails the connection with
//! `ECONNABORTED` (and sends the endpoint a RST) instead of retransmitting into the void.
use std::{
    collections::BTreeSet,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use anyhow::{Context as _, Result};
use proxy_common::Addr;

use crate::netns::{in_namespace, namespaces};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;

/// `struct inet_diag_sockid`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct SockId {
    pub(super) sport: u16,
    pub(super) dport: u16,
    pub(super) src: [u32; 4],
    pub(super) dst: [u32; 4],
    ifindex: u32,
    cookie: [u32; 2],
}

impl SockId {
    pub(super) fn cookie(&self) -> u64 {
        u64::from(self.cookie[0]) | u64::from(self.cookie[1]) << 32
    }
}

/// `struct inet_diag_req_v2`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DiagRequest {
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: SockId,
}

/// `struct inet_diag_msg` (the part read).
#[repr(C)]
#[derive(Clone, Copy)]
struct DiagMessage {
    _family: u8,
    _state: u8,
    _timer: u8,
    _retrans: u8,
    id: SockId,
}

#[repr(C)]
struct Message {
    header: libc::nlmsghdr,
    request: DiagRequest,
}

/// Abort the connected sockets of `proto` (UDP or TCP) whose cookie is in `cookies` and whose
/// peer is one of `to`, in every network namespace of the node (pods' included); how many.
pub fn abort(proto: u8, cookies: &BTreeSet<u64>, to: &[Addr]) -> usize {
    let peers: BTreeSet<Addr> = to.iter().copied().collect();
    std::thread::scope(|s| {
        let workers: Vec<_> = namespaces()
            .into_iter()
            .map(|path| {
                let peers = &peers;
                s.spawn(move || {
                    let aborted = in_namespace(&path, || abort_in_this_namespace(proto, cookies, peers));
                    aborted.unwrap_or_else(|e| {
                        let gone = e.chain().any(|c| {
                            c.downcast_ref::<io::Error>()
                                .is_some_and(|e| matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)))
                        });
                        if gone {
                            // A namespace whose processes just exited: nothing to abort there.
                            tracing::debug!(netns = %path.display(), "sockets not aborted: {e:#}");
                        } else {
                            // Most often no CAP_SYS_ADMIN (setns): such sockets keep sending to
                            // the endpoint until the application reconnects.
                            tracing::warn!(
                                netns = %path.display(),
                                "connected sockets of endpoints that left not aborted: {e:#}"
                            );
                        }
                        0
                    })
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap_or(0)).sum()
    })
}

fn abort_in_this_namespace(proto: u8, cookies: &BTreeSet<u64>, peers: &BTreeSet<Addr>) -> Result<usize> {
    let socket = netlink_socket()?;
    let mut doomed = Vec::new();
    // IPv6 sockets name IPv4 peers mapped, as the maps do.
    for family in [libc::AF_INET, libc::AF_INET6] {
        doomed.extend(
            sockets(&socket, proto, family)?
                .into_iter()
                .filter(|id| {
                    let cookie = id.cookie();
                    let peer = if family == libc::AF_INET { Addr::from_v4(id.dst[0]) } else { Addr(id.dst) };
                    cookies.contains(&cookie) && peers.contains(&peer)
                })
                .map(|id| (family, id)),
        );
    }
    let mut aborted = 0;
    for (family, id) in doomed {
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
        match request(&socket, SOCK_DESTROY, flags, proto, family, id).and_then(|()| ack(&socket)) {
            Ok(()) => aborted += 1,
            // Closed in the meantime.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e).context("SOCK_DESTROY (is the kernel built with CONFIG_INET_DIAG_DESTROY?)"),
        }
    }
    Ok(aborted)
}

pub(super) fn netlink_socket() -> Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return Err(io::Error::last_os_error()).context("socket(NETLINK_SOCK_DIAG)");
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn request(socket: &OwnedFd, kind: u16, flags: u16, proto: u8, family: i32, id: SockId) -> io::Result<()> {
    let message = Message {
        header: libc::nlmsghdr {
            nlmsg_len: size_of::<Message>() as u32,
            nlmsg_type: kind,
            nlmsg_flags: flags,
            nlmsg_seq: 1,
            nlmsg_pid: 0,
        },
        request: DiagRequest { family: family as u8, protocol: proto, states: u32::MAX, id, ..Default::default() },
    };
    // SAFETY: sends the bytes of a repr(C) value that lives across the call.
    let sent = unsafe { libc::send(socket.as_raw_fd(), (&message as *const Message).cast(), size_of::<Message>(), 0) };
    if sent < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// The netlink messages of one `recv`: (type, payload).
fn receive(socket: &OwnedFd, buf: &mut [u8]) -> io::Result<Vec<(u16, Vec<u8>)>> {
    // SAFETY: recv writes at most buf.len() bytes into buf.
    let n = unsafe { libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut at = 0usize;
    let header_len = size_of::<libc::nlmsghdr>();
    while at + header_len <= n as usize {
        // SAFETY: bounds checked; nlmsghdr is plain integers.
        let header: libc::nlmsghdr = unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
        let len = header.nlmsg_len as usize;
        if len < header_len || at + len > n as usize {
            break;
        }
        out.push((header.nlmsg_type, buf[at + header_len..at + len].to_vec()));
        at += (len + 3) & !3;
    }
    Ok(out)
}

/// The error code of an NLMSG_ERROR payload (0: an acknowledgement).
fn error_of(payload: &[u8]) -> io::Result<()> {
    let code = payload.get(..4).map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    if code == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(-code)) }
}

fn ack(socket: &OwnedFd) -> io::Result<()> {
    let mut buf = vec![0u8; 4096];
    loop {
        for (kind, payload) in receive(socket, &mut buf)? {
            if kind == libc::NLMSG_ERROR as u16 {
                return error_of(&payload);
            }
        }
    }
}

/// Every socket of `proto` and `family` in this namespace.
pub(super) fn sockets(socket: &OwnedFd, proto: u8, family: i32) -> Result<Vec<SockId>> {
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    request(socket, SOCK_DIAG_BY_FAMILY, flags, proto, family, SockId::default()).context("sock_diag dump request")?;
    let mut buf = vec![0u8; 32 * 1024];
    let mut sockets = Vec::new();
    loop {
        for (kind, payload) in receive(socket, &mut buf).context("sock_diag dump")? {
            match kind {
                k if k == libc::NLMSG_DONE as u16 => return Ok(sockets),
                k if k == libc::NLMSG_ERROR as u16 => error_of(&payload).context("sock_diag dump")?,
                SOCK_DIAG_BY_FAMILY if payload.len() >= size_of::<DiagMessage>() => {
                    // SAFETY: length checked; DiagMessage is plain integers.
                    let message: DiagMessage = unsafe { std::ptr::read_unaligned(payload.as_ptr().cast()) };
                    sockets.push(message.id);
                }
                _ => {}
            }
        }
    }
}
