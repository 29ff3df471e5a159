//! Just enough netlink for kpr's few requests (a link setting, a route, a conntrack dump): messages
//! built and attributes read by hand, on a socket per request.
use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

pub const NLA_F_NESTED: u16 = 1 << 15;
/// The type bits of an attribute (without the nested and byte-order flags).
const NLA_TYPE_MASK: u16 = 0x3fff;
const HEADER_LEN: usize = 16;

/// A netlink attribute: length, type, payload, padded to 4 bytes.
pub fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
    let len = 4 + payload.len();
    let mut out = Vec::with_capacity(len.next_multiple_of(4));
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize(len.next_multiple_of(4), 0);
    out
}

/// The attributes in `buf`: (type without flags, payload). Stops at the first malformed one.
pub fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([buf[0], buf[1]]));
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some((kind, payload))
    })
}

/// The payload of attribute `kind` in `buf`.
pub fn find(buf: &[u8], kind: u16) -> Option<&[u8]> {
    attrs(buf).find(|(k, _)| *k == kind).map(|(_, payload)| payload)
}

/// A request message: header (`kind`, `flags` | NLM_F_REQUEST) and `body`.
pub fn message(kind: u16, flags: u16, body: &[u8]) -> Vec<u8> {
    let len = HEADER_LEN + body.len();
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(&(len as u32).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&(flags | libc::NLM_F_REQUEST as u16).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
    msg.extend_from_slice(body);
    msg
}

fn socket(protocol: i32) -> io::Result<OwnedFd> {
    // SAFETY: a plain socket call; the fd is owned right after creation.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn send(fd: &OwnedFd, msg: &[u8]) -> io::Result<()> {
    // SAFETY: the buffer outlives the call.
    if unsafe { libc::send(fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The messages of one datagram: (type, payload after the header).
fn messages(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.len() < HEADER_LEN {
            return None;
        }
        let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        if len < HEADER_LEN || len > rest.len() {
            return None;
        }
        let kind = u16::from_ne_bytes([rest[4], rest[5]]);
        let payload = &rest[HEADER_LEN..len];
        rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        Some((kind, payload))
    })
}

/// An NLMSG_ERROR payload: its (negated) errno as a result.
fn verdict(payload: &[u8]) -> io::Result<()> {
    let Some(code) = payload.get(..4) else { return Err(io::Error::other("short netlink error message")) };
    match i32::from_ne_bytes([code[0], code[1], code[2], code[3]]) {
        0 => Ok(()),
        err => Err(io::Error::from_raw_os_error(-err)),
    }
}

/// Send `msg` (built with NLM_F_ACK) and return the kernel's verdict.
pub fn request_ack(protocol: i32, msg: &[u8]) -> io::Result<()> {
    let fd = socket(protocol)?;
    send(&fd, msg)?;
    let mut buf = vec![0u8; 8192];
    let n = recv(&fd, &mut buf)?;
    match messages(&buf[..n]).next() {
        Some((kind, payload)) if kind == libc::NLMSG_ERROR as u16 => verdict(payload),
        _ => Err(io::Error::other("unexpected netlink reply")),
    }
}

/// Send a request `msg` that the kernel answers with one message, and return its payload
/// (an NLMSG_ERROR answer as its errno).
pub fn request(protocol: i32, msg: &[u8]) -> io::Result<Vec<u8>> {
    Session::open(protocol)?.request(msg)
}

/// One netlink socket for a series of requests (a route lookup per endpoint), instead of a
/// socket each.
pub struct Session(OwnedFd);

impl Session {
    pub fn open(protocol: i32) -> io::Result<Self> {
        socket(protocol).map(Self)
    }

    /// [`request`] on this socket.
    pub fn request(&self, msg: &[u8]) -> io::Result<Vec<u8>> {
        send(&self.0, msg)?;
        let mut buf = vec![0u8; 8192];
        let n = recv(&self.0, &mut buf)?;
        match messages(&buf[..n]).next() {
            Some((kind, payload)) if kind == libc::NLMSG_ERROR as u16 => {
                verdict(payload)?;
                Err(io::Error::other("netlink acknowledged without an answer"))
            }
            Some((_, payload)) => Ok(payload.to_vec()),
            None => Err(io::Error::other("empty netlink reply")),
        }
    }
}

/// Send a dump request `msg` (built with NLM_F_DUMP) and collect every answer's payload.
pub fn dump(protocol: i32, msg: &[u8]) -> io::Result<Vec<Vec<u8>>> {
    let fd = socket(protocol)?;
    send(&fd, msg)?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = recv(&fd, &mut buf)?;
        for (kind, payload) in messages(&buf[..n]) {
            match kind {
                k if k == libc::NLMSG_DONE as u16 => return Ok(out),
                k if k == libc::NLMSG_ERROR as u16 => verdict(payload)?,
                _ => out.push(payload.to_vec()),
            }
        }
    }
}

fn recv(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the kernel writes at most buf.len() bytes.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}
