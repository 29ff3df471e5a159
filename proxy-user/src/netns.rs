//! The node's network namespaces: which exist (a process's, or one pinned under `/run/netns`
//! as `ip netns` and CNI plugins pin them), working inside one, and what identifies one to
//! the kernel (its id as this namespace knows it, its cookie as the socket hooks see it).
use std::{
    collections::BTreeMap,
    fs::File,
    io,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};

use crate::netlink;

/// One path per network namespace in use: a process's (`/proc/<pid>/ns/net`) or a named one
/// (`/run/netns/<name>`).
pub fn namespaces() -> Vec<PathBuf> {
    let mut found: BTreeMap<(u64, u64), PathBuf> = BTreeMap::new();
    let processes = std::fs::read_dir("/proc").into_iter().flatten().flatten().filter_map(|entry| {
        let pid = entry.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit());
        pid.then(|| entry.path().join("ns/net"))
    });
    let named = std::fs::read_dir("/run/netns").into_iter().flatten().flatten().map(|entry| entry.path());
    for path in processes.chain(named) {
        if let Ok(meta) = std::fs::metadata(&path) {
            found.entry((meta.dev(), meta.ino())).or_insert(path);
        }
    }
    found.into_values().collect()
}

/// Run `f` on this thread inside the network namespace `path` (the thread stays there: call
/// it on a thread of its own).
pub fn in_namespace<T>(path: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
    // SAFETY: setns on a namespace file we hold open; it affects this thread only.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error()).context("setns");
    }
    f()
}

/// The id this network namespace gives the namespace `path` (RTM_GETNSID, on `session`), as
/// links whose other end is there report it (`IFLA_LINK_NETNSID`). None: no id assigned
/// (nothing links the two), or not a namespace.
pub fn nsid(session: &netlink::Session, path: &Path) -> Option<i32> {
    const NETNSA_NSID: u16 = 1;
    const NETNSA_FD: u16 = 3;
    let file = File::open(path).ok()?;
    // struct rtgenmsg (the family, aligned to 4), then the namespace's fd.
    let mut body = vec![libc::AF_UNSPEC as u8, 0, 0, 0];
    body.extend(netlink::attr(NETNSA_FD, &(file.as_raw_fd() as u32).to_ne_bytes()));
    let reply = session.request(&netlink::message(libc::RTM_GETNSID, 0, &body)).ok()?;
    let id = i32::from_ne_bytes(netlink::find(reply.get(4..)?, NETNSA_NSID)?.try_into().ok()?);
    (id >= 0).then_some(id)
}

/// The cookie of the network namespace this thread is in (`SO_NETNS_COOKIE`, 5.14+), as
/// `bpf_get_netns_cookie` gives it to the socket hooks. None: the kernel does not tell.
pub fn cookie() -> Option<u64> {
    const SO_NETNS_COOKIE: i32 = 71;
    // SAFETY: a plain socket call; the fd is owned right after creation.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a descriptor just created, owned from here on.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let (mut cookie, mut len) = (0u64, size_of::<u64>() as libc::socklen_t);
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
    let rc = unsafe {
        libc::getsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, SO_NETNS_COOKIE, (&raw mut cookie).cast(), &mut len)
    };
    (rc == 0 && cookie != 0).then_some(cookie)
}

/// The cookie of the network namespace `path`, entered on a thread of its own.
pub fn cookie_of(path: &Path) -> Result<Option<u64>> {
    std::thread::scope(|s| s.spawn(|| in_namespace(path, || Ok(cookie()))).join())
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the thread entering {} panicked", path.display())))
}

/// The cookies of the namespaces this one knows by the ids `nsids` (the other ends of its
/// pods' links). Err: no namespace could be entered (no CAP_SYS_ADMIN), so nothing is known.
pub fn cookies_of(nsids: &std::collections::BTreeSet<i32>) -> Result<BTreeMap<i32, u64>> {
    let mut out = BTreeMap::new();
    if nsids.is_empty() {
        return Ok(out);
    }
    let session = netlink::Session::open(libc::NETLINK_ROUTE).context("netlink socket")?;
    let wanted: Vec<(i32, PathBuf)> = namespaces()
        .into_iter()
        .filter_map(|p| Some((nsid(&session, &p)?, p)))
        .filter(|(id, _)| nsids.contains(id))
        .collect();
    let mut entered = false;
    let mut last_error = None;
    for (id, path) in wanted {
        match cookie_of(&path) {
            Ok(Some(cookie)) => {
                entered = true;
                out.insert(id, cookie);
            }
            Ok(None) => entered = true,
            Err(e) => last_error = Some(e),
        }
    }
    match last_error {
        Some(e) if !entered => Err(e),
        _ => Ok(out),
    }
}
