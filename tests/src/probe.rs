//! Client probes with a comparable outcome: which backends answered, the address the client saw,
//! and the errors (by stage and errno name). Used in-process and by the `kpr-probe` program, which
//! runs the same code inside another namespace and cgroup (the kube-proxy side of the
//! differential tests).
use std::{
    collections::{BTreeMap, BTreeSet},
    io::ErrorKind,
    net::{SocketAddrV4, TcpStream, UdpSocket},
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
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Tcp => "tcp",
            Kind::Udp => "udp",
            Kind::UdpConnected => "udp-connected",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "tcp" => Kind::Tcp,
            "udp" => Kind::Udp,
            "udp-connected" => Kind::UdpConnected,
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

/// Ask `addr` `n` times; every attempt uses a new socket.
pub fn probe(kind: Kind, addr: SocketAddrV4, n: usize, timeout: Duration) -> Outcome {
    let mut out = Outcome::default();
    for _ in 0..n {
        match ask(kind, addr, timeout) {
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

fn ask(kind: Kind, addr: SocketAddrV4, timeout: Duration) -> Attempt {
    use std::io::{BufRead as _, BufReader};
    let mut buf = [0u8; 256];
    match kind {
        Kind::Tcp => {
            let conn = TcpStream::connect_timeout(&addr.into(), timeout).map_err(|e| ("connect", e))?;
            conn.set_read_timeout(Some(timeout)).map_err(|e| ("setsockopt", e))?;
            let peer = conn.peer_addr().map_err(|e| ("getpeername", e))?;
            let mut line = String::new();
            BufReader::new(&conn).read_line(&mut line).map_err(|e| ("recv", e))?;
            if line.is_empty() {
                return Err(("recv", std::io::Error::from(ErrorKind::UnexpectedEof)));
            }
            Ok((line.trim_end().to_owned(), peer.to_string()))
        }
        Kind::Udp => {
            let socket = UdpSocket::bind("0.0.0.0:0").map_err(|e| ("bind", e))?;
            socket.set_read_timeout(Some(timeout)).map_err(|e| ("setsockopt", e))?;
            socket.send_to(b"who", addr).map_err(|e| ("send", e))?;
            let (n, from) = socket.recv_from(&mut buf).map_err(|e| ("recv", e))?;
            Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), from.to_string()))
        }
        Kind::UdpConnected => {
            let socket = UdpSocket::bind("0.0.0.0:0").map_err(|e| ("bind", e))?;
            socket.set_read_timeout(Some(timeout)).map_err(|e| ("setsockopt", e))?;
            socket.connect(addr).map_err(|e| ("connect", e))?;
            socket.send(b"who").map_err(|e| ("send", e))?;
            let n = socket.recv(&mut buf).map_err(|e| ("recv", e))?;
            let peer = socket.peer_addr().map_err(|e| ("getpeername", e))?;
            Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), peer.to_string()))
        }
    }
}

/// Run the `kpr-probe` program `exe` inside network namespace `netns` and cgroup `cgroup`.
pub fn probe_in(
    exe: &Path,
    netns: &str,
    cgroup: &Path,
    kind: Kind,
    addr: SocketAddrV4,
    n: usize,
    timeout: Duration,
) -> Result<Outcome> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", netns])
        .arg(exe)
        .args([kind.as_str(), &addr.to_string(), &n.to_string(), &timeout.as_millis().to_string()]);
    crate::cluster::confine(&mut cmd, cgroup)?;
    let out = cmd.stdin(Stdio::null()).stderr(Stdio::piped()).output().context("failed to run kpr-probe")?;
    if !out.status.success() {
        bail!("kpr-probe failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Outcome::from_json(&String::from_utf8_lossy(&out.stdout))
}
