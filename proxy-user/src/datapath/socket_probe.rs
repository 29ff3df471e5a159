//! `kpr verify`'s probes of the socket path: one `connect()` per frontend of the node's own
//! traffic, made by the socket hooks as for any process of the node, and the peer the kernel
//! then gave the socket read with sock_diag (the hooks show the application the frontend
//! instead, through getpeername).
//!
//! Nothing is sent: UDP's `connect()` sends nothing, and a TCP socket in repair mode
//! (`TCP_REPAIR`, as CRIU restores connections) connects and closes without a packet. The
//! sockets carry `VERIFY_PROBE_PRIORITY`, so the hooks count no connect, event or affinity
//! pick for them.
//!
//! The connects are made by a process of their own (`kpr socket-probe`, this binary), in a
//! cgroup made for it under the hooks' cgroup: the agent's own cgroup may be outside the hooks'
//! (a test's, a development node's), and the agent is exempt from some translations.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs, io,
    io::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail, ensure};
use proxy_common::{IPPROTO_TCP, VERIFY_PROBE_PRIORITY};

use super::sockets::{netlink_socket, sockets};
use crate::verify::SocketSeen;

/// The subcommand of this binary that makes the connects.
pub const SUBCOMMAND: &str = "socket-probe";

/// Sockets open at once in the probe process.
const CHUNK: usize = 256;

/// `TCP_REPAIR` (linux/tcp.h).
const TCP_REPAIR: libc::c_int = 19;

/// The cgroup the probes run in: under the agent's own (`own`) when that is below the hooks'
/// cgroup (a DaemonSet's container, whose processes may move only within their cgroup
/// namespace), else right under the hooks' cgroup.
pub fn cgroup_for_probes(hooks: &Path, own: Option<&Path>) -> PathBuf {
    let own = own.and_then(|dir| fs::metadata(dir).ok()).map(|m| m.ino());
    let parent = own.and_then(|ino| find_cgroup(hooks, ino)).unwrap_or_else(|| hooks.to_path_buf());
    parent.join(format!("kpr-verify-{}", std::process::id()))
}

/// The directory of the cgroup with inode `ino` at or under `root`, looked for breadth first
/// (a node has some thousands of cgroups).
fn find_cgroup(root: &Path, ino: u64) -> Option<PathBuf> {
    let mut level = vec![root.to_path_buf()];
    for _depth in 0..16 {
        let mut next = Vec::new();
        for dir in level {
            if fs::metadata(&dir).is_ok_and(|m| m.ino() == ino) {
                return Some(dir);
            }
            let Ok(entries) = fs::read_dir(&dir) else { continue };
            next.extend(entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
        }
        if next.is_empty() {
            break;
        }
        level = next;
    }
    None
}

/// Connect to each `(frontend, protocol)` from a process in `cgroup` (made for the run and
/// removed after it): what each socket was given.
pub fn run(cgroup: &Path, probes: &[(SocketAddr, u8)]) -> Result<Vec<SocketSeen>> {
    match fs::create_dir(cgroup) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
            return Err(e).with_context(|| format!("failed to make the probes' cgroup {}", cgroup.display()));
        }
        _ => {}
    }
    let result = run_in(cgroup, probes);
    // Empty once the process is gone; a failure leaves an empty cgroup, which costs nothing.
    let _ = fs::remove_dir(cgroup);
    result
}

fn run_in(cgroup: &Path, probes: &[(SocketAddr, u8)]) -> Result<Vec<SocketSeen>> {
    // This binary, also when it was replaced on disk since the agent started.
    let mut child = Command::new("/proc/self/exe")
        .arg(SUBCOMMAND)
        .arg(cgroup)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("failed to start the socket probe process")?;
    let input = serde_json::to_vec(probes)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(&input).context("writing the probes to the socket probe process")?;
    }
    let output = child.wait_with_output().context("waiting for the socket probe process")?;
    ensure!(
        output.status.success(),
        "the socket probe process failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    );
    let seen: Vec<SocketSeen> = serde_json::from_slice(&output.stdout).context("the socket probe process's answer")?;
    ensure!(seen.len() == probes.len(), "the socket probe process answered {} of {} probes", seen.len(), probes.len());
    Ok(seen)
}

/// `kpr socket-probe CGROUP`: move into `cgroup`, read the probes (JSON) from standard input,
/// connect, and write what each socket was given (JSON) to standard output.
pub fn serve(cgroup: &Path) -> Result<()> {
    let procs = cgroup.join("cgroup.procs");
    fs::write(&procs, std::process::id().to_string())
        .with_context(|| format!("failed to move into {}", procs.display()))?;
    let probes: Vec<(SocketAddr, u8)> = serde_json::from_reader(io::stdin().lock()).context("the probes")?;
    let mut seen = Vec::with_capacity(probes.len());
    for chunk in probes.chunks(CHUNK) {
        seen.extend(probe_chunk(chunk)?);
    }
    serde_json::to_writer(io::stdout().lock(), &seen)?;
    Ok(())
}

fn probe_chunk(probes: &[(SocketAddr, u8)]) -> Result<Vec<SocketSeen>> {
    let connected: Vec<Result<(OwnedFd, u64), i32>> =
        probes.iter().map(|(target, proto)| connect(*target, *proto)).collect::<Result<_>>()?;
    let diag = netlink_socket()?;
    let wanted: BTreeSet<(u8, i32)> = probes.iter().map(|(target, proto)| (*proto, family_of(target))).collect();
    let mut peers = BTreeMap::new();
    for (proto, family) in wanted {
        for id in sockets(&diag, proto, family)? {
            let at = |addr: [u32; 4], port: u16| SocketAddr::new(ip_of(family, addr), u16::from_be(port));
            peers.insert(id.cookie(), (at(id.src, id.sport), at(id.dst, id.dport)));
        }
    }
    // The sockets close here: a repaired TCP socket silently.
    Ok(connected
        .into_iter()
        .map(|socket| match socket {
            Ok((_, cookie)) => match peers.get(&cookie) {
                Some((from, to)) => SocketSeen::Connected { from: *from, to: *to },
                None => SocketSeen::Unlisted,
            },
            Err(errno) => SocketSeen::Failed(errno),
        })
        .collect())
}

fn family_of(addr: &SocketAddr) -> i32 {
    if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 }
}

fn ip_of(family: i32, addr: [u32; 4]) -> IpAddr {
    if family == libc::AF_INET {
        Ipv4Addr::from(addr[0].to_ne_bytes()).into()
    } else {
        let mut octets = [0u8; 16];
        for (chunk, word) in octets.chunks_mut(4).zip(addr) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        Ipv6Addr::from(octets).into()
    }
}

/// A probe socket connected to `target`, and its cookie; `Err(errno)`: `connect()` failed.
/// Failing to make the socket is an error of the run, not an answer of the hooks.
fn connect(target: SocketAddr, proto: u8) -> Result<Result<(OwnedFd, u64), i32>> {
    let kind = if proto == IPPROTO_TCP { libc::SOCK_STREAM } else { libc::SOCK_DGRAM };
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe { libc::socket(family_of(&target), kind | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error()).context("socket()");
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    set_option(&socket, libc::SOL_SOCKET, libc::SO_PRIORITY, VERIFY_PROBE_PRIORITY as libc::c_int)
        .context("SO_PRIORITY (CAP_NET_ADMIN)")?;
    if proto == IPPROTO_TCP {
        set_option(&socket, libc::SOL_TCP, TCP_REPAIR, 1).context("TCP_REPAIR (CAP_NET_ADMIN)")?;
    }
    // SAFETY: the sockaddr structures are plain integers, sized as passed.
    let connected = unsafe {
        match target {
            SocketAddr::V4(v4) => {
                let sa = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: v4.port().to_be(),
                    sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(v4.ip().octets()) },
                    sin_zero: [0; 8],
                };
                libc::connect(socket.as_raw_fd(), (&sa as *const libc::sockaddr_in).cast(), size_of_val(&sa) as u32)
            }
            SocketAddr::V6(v6) => {
                let sa = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: v6.port().to_be(),
                    sin6_flowinfo: 0,
                    sin6_addr: libc::in6_addr { s6_addr: v6.ip().octets() },
                    sin6_scope_id: 0,
                };
                libc::connect(socket.as_raw_fd(), (&sa as *const libc::sockaddr_in6).cast(), size_of_val(&sa) as u32)
            }
        }
    };
    if connected != 0 {
        let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
        return Ok(Err(errno));
    }
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
    let got = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if got != 0 {
        bail!("SO_COOKIE: {}", io::Error::last_os_error());
    }
    Ok(Ok((socket, cookie)))
}

fn set_option(socket: &OwnedFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: setsockopt reads an int.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as u32,
        )
    };
    if set == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}
