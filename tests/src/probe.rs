//! Client probes with a comparable outcome: which backends answered, the address the client saw,
//! and the errors (by stage and errno name). Used in-process and by the `kpr-probe` program, which
//! runs the same code inside another namespace and cgroup (the kube-proxy side of the
//! differential tests).
use std::{
    collections::{BTreeMap, BTreeSet},
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// connect, read the name line; peer from getpeername.
    Tcp,
    /// unconnected UDP: sendto, recvfrom; peer = source of the reply.
    Udp,
    /// connected UDP: connect, send, recv; peer from getpeername.
    UdpConnected,
    /// TCP, and the backend tells the client address it saw: answers are `name<-source`.
    TcpSource,
    /// Connected UDP, likewise: answers are `name<-source`.
    UdpSource,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Tcp => "tcp",
            Kind::Udp => "udp",
            Kind::UdpConnected => "udp-connected",
            Kind::TcpSource => "tcp-src",
            Kind::UdpSource => "udp-src",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "tcp" => Kind::Tcp,
            "udp" => Kind::Udp,
            "udp-connected" => Kind::UdpConnected,
            "tcp-src" => Kind::TcpSource,
            "udp-src" => Kind::UdpSource,
            _ => bail!("unknown probe kind {s}"),
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Backend name → number of answers.
    pub answers: BTreeMap<String, usize>,
    /// Peer addresses the client saw.
    pub peers: BTreeSet<String>,
    /// `stage:ERRNO` → count (e.g. `connect:ECONNREFUSED`, `recv:timeout`).
    pub errors: BTreeMap<String, usize>,
}

impl Outcome {
    pub fn backends(&self) -> BTreeSet<String> {
        self.answers.keys().cloned().collect()
    }

    pub fn error_kinds(&self) -> BTreeSet<String> {
        self.errors.keys().cloned().collect()
    }

    pub fn to_json(&self) -> String {
        json!({"answers": self.answers, "peers": self.peers, "errors": self.errors}).to_string()
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text.trim()).with_context(|| format!("probe output {text:?}"))?;
        let map = |k: &str| -> BTreeMap<String, usize> {
            v[k].as_object()
                .map(|o| o.iter().map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0) as usize)).collect())
                .unwrap_or_default()
        };
        let peers = v["peers"]
            .as_array()
            .map(|a| a.iter().filter_map(|p| p.as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        Ok(Self { answers: map("answers"), peers, errors: map("errors") })
    }
}

fn errno_name(e: &std::io::Error) -> String {
    if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
        return "timeout".into();
    }
    match e.raw_os_error() {
        Some(libc::ECONNREFUSED) => "ECONNREFUSED".into(),
        Some(libc::ENETUNREACH) => "ENETUNREACH".into(),
        Some(libc::EHOSTUNREACH) => "EHOSTUNREACH".into(),
        Some(libc::EPERM) => "EPERM".into(),
        Some(libc::ECONNRESET) => "ECONNRESET".into(),
        Some(libc::EINVAL) => "EINVAL".into(),
        Some(n) => format!("errno{n}"),
        None => format!("{:?}", e.kind()),
    }
}

/// Ask `addr` `n` times; every attempt uses a new socket, bound to `source` when given.
pub fn probe(kind: Kind, addr: SocketAddr, n: usize, timeout: Duration, source: Option<IpAddr>) -> Outcome {
    let mut out = Outcome::default();
    for _ in 0..n {
        match ask(kind, addr, timeout, source) {
            Ok((name, peer)) => {
                *out.answers.entry(name).or_default() += 1;
                out.peers.insert(peer);
            }
            Err((stage, e)) => *out.errors.entry(format!("{stage}:{}", errno_name(&e))).or_default() += 1,
        }
    }
    out
}

type Attempt = std::result::Result<(String, String), (&'static str, std::io::Error)>;

fn ask(kind: Kind, addr: SocketAddr, timeout: Duration, source: Option<IpAddr>) -> Attempt {
    use std::io::{BufRead as _, BufReader, Write as _};
    let mut buf = [0u8; 256];
    let any: IpAddr = if addr.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
    let local = SocketAddr::new(source.unwrap_or(any), 0);
    match kind {
        Kind::Tcp | Kind::TcpSource => {
            let domain = if addr.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
            let socket = socket2::Socket::new(domain, socket2::Type::STREAM, None).map_err(|e| ("socket", e))?;
            if source.is_some() {
                socket.bind(&local.into()).map_err(|e| ("bind", e))?;
            }
            socket.connect_timeout(&addr.into(), timeout).map_err(|e| ("connect", e))?;
            let mut conn: TcpStream = socket.into();
            conn.set_read_timeout(Some(timeout)).map_err(|e| ("setsockopt", e))?;
            let peer = conn.peer_addr().map_err(|e| ("getpeername", e))?;
            let mut reader = BufReader::new(conn.try_clone().map_err(|e| ("dup", e))?);
            let mut line = String::new();
            reader.read_line(&mut line).map_err(|e| ("recv", e))?;
            if line.is_empty() {
                return Err(("recv", std::io::Error::from(ErrorKind::UnexpectedEof)));
            }
            let mut name = line.trim_end().to_owned();
            if kind == Kind::TcpSource {
                conn.write_all(b"peer?\n").map_err(|e| ("send", e))?;
                let mut seen = String::new();
                reader.read_line(&mut seen).map_err(|e| ("recv", e))?;
                name = format!("{name}<-{}", seen.trim_end());
            }
            Ok((name, peer.to_string()))
        }
        Kind::Udp => {
            let socket = UdpSocket::bind(local).map_err(|e| ("bind", e))?;
            socket.set_read_timeout(Some(timeout)).map_err(|e| ("setsockopt", e))?;
            socket.send_to(b"who", addr).map_err(|e| ("send", e))?;
            let (n, from) = socket.recv_from(&mut buf).map_err(|e| ("recv", e))?;
            Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), from.to_string()))
        }
        Kind::UdpConnected | Kind::UdpSource => {
            let socket = UdpSocket::bind(local).map_err(|e| ("bind", e))?;
            socket.set_read_timeout(Some(timeout)).map_err(|e| ("setsockopt", e))?;
            socket.connect(addr).map_err(|e| ("connect", e))?;
            socket.send(b"who").map_err(|e| ("send", e))?;
            let n = socket.recv(&mut buf).map_err(|e| ("recv", e))?;
            let peer = socket.peer_addr().map_err(|e| ("getpeername", e))?;
            let mut name = String::from_utf8_lossy(&buf[..n]).into_owned();
            if kind == Kind::UdpSource {
                socket.send(b"peer?").map_err(|e| ("send", e))?;
                let n = socket.recv(&mut buf).map_err(|e| ("recv", e))?;
                name = format!("{name}<-{}", String::from_utf8_lossy(&buf[..n]));
            }
            Ok((name, peer.to_string()))
        }
    }
}

/// Run the `kpr-probe` program `exe` inside network namespace `netns` and cgroup `cgroup`.
pub fn probe_in(
    exe: &Path,
    netns: &str,
    cgroup: &Path,
    kind: Kind,
    addr: impl Into<SocketAddr>,
    n: usize,
    timeout: Duration,
) -> Result<Outcome> {
    probe_from(exe, netns, cgroup, kind, addr, n, timeout, None)
}

/// [`probe_in`], with the client's sockets bound to `source`.
#[expect(clippy::too_many_arguments, reason = "a probe is all of these")]
pub fn probe_from(
    exe: &Path,
    netns: &str,
    cgroup: &Path,
    kind: Kind,
    addr: impl Into<SocketAddr>,
    n: usize,
    timeout: Duration,
    source: Option<IpAddr>,
) -> Result<Outcome> {
    let addr: SocketAddr = addr.into();
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", netns]).arg(exe).args([
        kind.as_str(),
        &addr.to_string(),
        &n.to_string(),
        &timeout.as_millis().to_string(),
    ]);
    if let Some(source) = source {
        cmd.arg(source.to_string());
    }
    crate::cluster::confine(&mut cmd, cgroup)?;
    let out = cmd.stdin(Stdio::null()).stderr(Stdio::piped()).output().context("failed to run kpr-probe")?;
    if !out.status.success() {
        bail!("kpr-probe failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Outcome::from_json(&String::from_utf8_lossy(&out.stdout))
}
