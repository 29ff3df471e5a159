//! The socket hooks' cgroup: finding cgroup2, the agent's own cgroup, and attaching (or
//! swapping programs into) the pinned cgroup links.
use std::{
    fs::{self, File},
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf,
    programs::{
        CgroupAttachMode, CgroupSockAddr,
        cgroup_sock_addr::CgroupSockAddrLink,
        links::{FdLink, PinnedLink},
    },
};
use proxy_common::program_names;

/// The socket hooks of both families (an IPv6 socket's hooks also see its IPv4-mapped peers).
pub(super) const HOOKS: [&str; 8] = [
    program_names::CONNECT4,
    program_names::SENDMSG4,
    program_names::RECVMSG4,
    program_names::GETPEERNAME4,
    program_names::CONNECT6,
    program_names::SENDMSG6,
    program_names::RECVMSG6,
    program_names::GETPEERNAME6,
];

/// The cgroup2 mount point, from /proc/self/mounts (hybrid hierarchies put it elsewhere than
/// /sys/fs/cgroup).
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[2] == "cgroup2")
        .map(|f| PathBuf::from(f[1]))
        .context("no cgroup2 file system is mounted")
}

/// The cgroup2 directory `--cgroup` names: the directory itself, or, when it is a hybrid host's
/// `/sys/fs/cgroup` (a tmpfs of cgroup v1 hierarchies, as a DaemonSet mounts the host's), the
/// cgroup2 hierarchy systemd puts in its `unified` directory.
pub fn cgroup2_dir(path: &Path) -> Result<PathBuf> {
    // f_type is signed in glibc and unsigned in musl (the image's build).
    #[allow(clippy::unnecessary_cast, reason = "the cast is needed in one of the two libcs")]
    let is_cgroup2 = |dir: &Path| -> bool {
        let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return false };
        // SAFETY: a valid C string and a zeroed statfs for the kernel to fill.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
            return false;
        }
        st.f_type as u64 == libc::CGROUP2_SUPER_MAGIC as u64
    };
    if is_cgroup2(path) {
        return Ok(path.to_owned());
    }
    let unified = path.join("unified");
    if is_cgroup2(&unified) {
        return Ok(unified);
    }
    bail!("{} is not a cgroup2 directory (nor a hybrid cgroup mount with one in `unified`)", path.display())
}

/// This process's cgroup2 directory.
pub fn own_cgroup() -> Result<PathBuf> {
    let text = fs::read_to_string("/proc/self/cgroup")?;
    let rel = text.lines().find_map(|l| l.strip_prefix("0::")).context("no cgroup2 entry in /proc/self/cgroup")?;
    Ok(cgroup2_root()?.join(rel.trim_start_matches('/')))
}

/// The id of this process's cgroup when the process is alone in it (a DaemonSet's container),
/// so that exempting the cgroup from translation exempts the agent and nothing else.
/// `Ok(None)` when other processes share it (a shell's session on a dev node).
pub fn agent_cgroup_id() -> Result<Option<u64>> {
    let dir = own_cgroup()?;
    let procs = fs::read_to_string(dir.join("cgroup.procs"))
        .with_context(|| format!("failed to read {}", dir.join("cgroup.procs").display()))?;
    let me = std::process::id().to_string();
    if procs.lines().any(|pid| pid != me) {
        return Ok(None);
    }
    // A cgroup's id, as bpf_get_current_cgroup_id returns it, is its directory's inode number.
    let id = std::os::unix::fs::MetadataExt::ino(&fs::metadata(&dir)?);
    Ok(Some(id))
}

/// The cookie of this process's network namespace (SO_NETNS_COOKIE, 5.14+): sockets in it are
/// the node's. `None` when the kernel cannot tell.
pub fn netns_cookie() -> Option<u64> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").ok()?;
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
    let rc = unsafe {
        libc::getsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, 71, (&mut cookie as *mut u64).cast(), &mut len)
    };
    (rc == 0 && cookie != 0).then_some(cookie)
}

/// Swap `prog` into the cgroup link pinned at `path`, if that link is attached to the cgroup
/// `cgroup_id` (the inode of the cgroup2 directory).
pub(super) fn reuse_cgroup_link(prog: &mut CgroupSockAddr, path: &Path, cgroup_id: Option<u64>) -> Result<()> {
    let attached_to = pinned_link_cgroup_id(path);
    let link: FdLink =
        PinnedLink::from_pin(path).with_context(|| format!("failed to open pinned link {}", path.display()))?.into();
    if cgroup_id.is_some() && attached_to != cgroup_id {
        bail!("it is attached to another cgroup (id {attached_to:?}, want {cgroup_id:?})");
    }
    prog.attach_to_link(CgroupSockAddrLink::try_from(link)?).context("failed to update the link")?;
    Ok(())
}

/// The cgroup the link pinned at `path` is attached to (BPF_OBJ_GET, then
/// BPF_OBJ_GET_INFO_BY_FD); None when it is not a live cgroup link.
pub(super) fn pinned_link_cgroup_id(path: &Path) -> Option<u64> {
    #[repr(C)]
    struct GetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    const BPF_OBJ_GET: libc::c_long = 7;
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    let mut attr = GetAttr { pathname: c_path.as_ptr() as u64, bpf_fd: 0, file_flags: 0 };
    // SAFETY: the kernel reads the path and returns a new fd (or -1).
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, &raw mut attr, size_of::<GetAttr>()) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh fd we own.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    link_cgroup_id(fd.as_fd())
}

pub(super) fn link_cgroup_id(fd: BorrowedFd<'_>) -> Option<u64> {
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    // struct bpf_link_info: type, id, prog_id, then (8-aligned) the cgroup union member.
    #[repr(C)]
    #[derive(Default)]
    struct LinkInfoCgroup {
        kind: u32,
        id: u32,
        prog_id: u32,
        _pad: u32,
        cgroup_id: u64,
        attach_type: u32,
        _rest: [u32; 9],
    }
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    const BPF_LINK_TYPE_CGROUP: u32 = 3;
    let mut info = LinkInfoCgroup::default();
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of::<LinkInfoCgroup>() as u32,
        info: (&raw mut info) as u64,
    };
    // SAFETY: the kernel writes at most info_len bytes into `info`.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET_INFO_BY_FD, &raw mut attr, size_of::<InfoAttr>()) };
    (rc == 0 && info.kind == BPF_LINK_TYPE_CGROUP && info.cgroup_id != 0).then_some(info.cgroup_id)
}

/// Load the cgroup program `$name` (of aya's type `$kind`), attach it to `$cgroup` anew and pin
/// its link in place of a previous agent's (which detaches with it). A macro: aya's program
/// types share these methods but no trait.
macro_rules! attach_anew {
    ($kind:ty, $ebpf:expr, $name:expr, $cgroup:expr, $dir:expr) => {{
        let name = $name;
        let prog: &mut $kind = $ebpf
            .program_mut(name)
            .with_context(|| format!("program `{name}` missing from the eBPF object"))?
            .try_into()?;
        prog.load().with_context(|| format!("the verifier rejected `{name}`"))?;
        let id = prog.attach($cgroup, CgroupAttachMode::Single)?;
        pin_replacing(prog.take_link(id)?.try_into()?, &$dir.join(format!("link_{name}")))
    }};
}

/// The socket release hook (cleans up after sockets). Its link cannot take a new program in
/// place: a previous agent's is replaced by a new one.
pub(super) fn attach_sock_release(ebpf: &mut Ebpf, cgroup: &File, dir: &Path) -> Result<()> {
    attach_anew!(aya::programs::CgroupSock, ebpf, program_names::SOCK_RELEASE, cgroup, dir)
}

/// The `sock_ops` program counting how endpoints answer the socket path's TCP connects (outlier
/// detection). Attached anew at each start, as the release hook is: during a restart both
/// agents' programs run a moment, and the first to count a connection marks it counted in
/// their shared `KPR_SOCK_TCP` entry, so the other does not count it again.
pub(super) fn attach_sock_ops(ebpf: &mut Ebpf, cgroup: &File, dir: &Path) -> Result<()> {
    attach_anew!(aya::programs::SockOps, ebpf, program_names::SOCK_OPS, cgroup, dir)
}

/// Pin `link` at `path`, in place of a previous agent's link there (which detaches with it).
pub(super) fn pin_replacing(link: FdLink, path: &Path) -> Result<()> {
    if path.exists() {
        fs::remove_file(path).with_context(|| format!("failed to remove {}", path.display()))?;
    }
    link.pin(path).with_context(|| format!("failed to pin {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod cgroup_tests {
    use super::*;

    #[test]
    fn cgroup_flag_takes_a_cgroup2_directory_or_a_hybrid_hosts_unified_one() {
        let root = cgroup2_root().expect("a cgroup2 mount");
        assert_eq!(cgroup2_dir(&root).unwrap(), root);
        // On a hybrid host (this machine), its parent is the v1 tmpfs a DaemonSet mounts.
        if root.ends_with("unified") {
            assert_eq!(cgroup2_dir(root.parent().unwrap()).unwrap(), root);
        }
        let err = cgroup2_dir(Path::new("/proc")).unwrap_err().to_string();
        assert!(err.contains("/proc is not a cgroup2 directory"), "{err}");
    }
}
