//! The bpf(2) batch commands aya has no wrapper for: reading a whole hash map, and writing
//! many elements in one call (kernels 5.6+; callers fall back to one element at a time).
use std::os::fd::{AsFd as _, AsRawFd as _, BorrowedFd};

use aya::maps::{HashMap, IterableMap as _, MapData};

/// Every entry of a hash map: read in batches where the kernel can, else one at a time.
pub(crate) fn read_all_of<K: aya::Pod, V: aya::Pod>(map: &HashMap<MapData, K, V>) -> Vec<(K, V)> {
    lookup_batch(map.map()).unwrap_or_else(|| map.iter().filter_map(Result::ok).collect())
}

/// `union bpf_attr`'s member for the `BPF_MAP_*_BATCH` commands.
#[repr(C)]
#[derive(Default)]
pub(super) struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// The bpf(2) call of batch command `cmd` (aya has no wrapper for batch ops).
///
/// # Safety
/// `attr`'s buffers hold `count` keys and values of the map's sizes (and a token) for the call.
pub(super) unsafe fn batch_op(cmd: libc::c_long, attr: &mut BatchAttr) -> libc::c_long {
    // SAFETY: the caller's.
    unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<BatchAttr>()) }
}

/// Every entry of hash map `map`, read thousands at a time (`BPF_MAP_LOOKUP_BATCH`, 5.6+):
/// a walk one entry at a time takes two system calls per entry, which made a conntrack table
/// of 40,000 entries cost about 100 ms per walk, and the agent walks it for every UDP endpoint
/// that stops serving. `None` where the kernel has no batch reads for the map (walk it one
/// entry at a time then). A concurrent change may be seen or not, as with the other walk.
pub(crate) fn lookup_batch<K: aya::Pod, V: aya::Pod>(map: &MapData) -> Option<Vec<(K, V)>> {
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    // Larger than any bucket of the kernel's hash tables (`ENOSPC` otherwise).
    const CHUNK: usize = 4096;
    let fd = map.fd().as_fd().as_raw_fd() as u32;
    let mut keys: Vec<K> = Vec::with_capacity(CHUNK);
    let mut values: Vec<V> = Vec::with_capacity(CHUNK);
    let mut out = Vec::new();
    // The batch token: the kernel's bucket index (4 bytes for hash maps; room for 8).
    let (mut token_in, mut token_out) = (0u64, 0u64);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { (&raw const token_in) as u64 },
            out_batch: (&raw mut token_out) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd,
            ..BatchAttr::default()
        };
        // SAFETY: the kernel writes at most `count` keys and values into buffers of that
        // capacity, and the token into `token_out`.
        let rc = unsafe { batch_op(BPF_MAP_LOOKUP_BATCH, &mut attr) };
        let errno = if rc < 0 { std::io::Error::last_os_error().raw_os_error() } else { None };
        if rc < 0 && errno != Some(libc::ENOENT) {
            return None;
        }
        // SAFETY: the kernel filled `count` of each (also on ENOENT: the last batch).
        unsafe {
            keys.set_len(attr.count as usize);
            values.set_len(attr.count as usize);
        }
        out.extend(keys.drain(..).zip(values.drain(..)));
        if errno == Some(libc::ENOENT) {
            return Some(out);
        }
        token_in = token_out;
        first = false;
    }
}

/// Slots `start..start + count` of array map `map`, in one call (`BPF_MAP_LOOKUP_BATCH`,
/// 5.6+): a reconcile reads every programmed range back, and one system call per slot took
/// seconds at a million endpoints. `None` where the kernel cannot (read one slot at a time).
pub(crate) fn lookup_array_range<V: aya::Pod>(map: &MapData, start: u32, count: u32) -> Option<Vec<V>> {
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    if count == 0 {
        return Some(Vec::new());
    }
    let mut keys: Vec<u32> = Vec::with_capacity(count as usize);
    let mut values: Vec<V> = Vec::with_capacity(count as usize);
    // The batch token is the key before the first one read.
    let before = start.checked_sub(1);
    let mut token_out = 0u64;
    let mut attr = BatchAttr {
        in_batch: before.as_ref().map_or(0, |k| std::ptr::from_ref(k) as u64),
        out_batch: (&raw mut token_out) as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count,
        map_fd: map.fd().as_fd().as_raw_fd() as u32,
        ..BatchAttr::default()
    };
    // SAFETY: the kernel writes at most `count` keys and values into buffers of that capacity,
    // and a 4-byte key into `token_out`.
    let rc = unsafe { batch_op(BPF_MAP_LOOKUP_BATCH, &mut attr) };
    if rc < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOENT) {
        return None;
    }
    // SAFETY: the kernel filled `attr.count` of each.
    unsafe {
        keys.set_len((attr.count as usize).min(count as usize));
        values.set_len((attr.count as usize).min(count as usize));
    }
    // Exactly the slots asked for, in order; anything else is read one at a time.
    let whole = keys.len() == count as usize && keys.iter().zip(start..).all(|(k, want)| *k == want);
    whole.then_some(values)
}

/// BPF_MAP_UPDATE_BATCH (kernel 5.6+): one syscall for many elements, in order. aya has no
/// wrapper for it. On error, also returns how many elements were written.
pub(super) fn update_batch<K: Copy, V: Copy>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), (std::io::Error, usize)> {
    const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
    if keys.is_empty() {
        return Ok(());
    }
    let mut attr = BatchAttr {
        in_batch: 0,
        out_batch: 0,
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: u32::try_from(keys.len()).expect("batch fits u32"),
        map_fd: fd.as_raw_fd() as u32,
        elem_flags: 0,
        flags: 0,
    };
    // SAFETY: attr points at keys/values arrays of `count` elements of the map's key and value
    // size, which outlive the call.
    let rc = unsafe { batch_op(BPF_MAP_UPDATE_BATCH, &mut attr) };
    if rc < 0 {
        return Err((std::io::Error::last_os_error(), attr.count as usize));
    }
    Ok(())
}

pub(super) fn batch_unsupported(e: &std::io::Error) -> bool {
    // ENOTSUPP (524) from kernels or map types without batch ops; EINVAL from pre-5.6 kernels.
    matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(524) | Some(libc::EOPNOTSUPP))
}
