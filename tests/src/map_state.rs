//! The entries of a loaded object's pinned maps, saved and put back: the tests of one process
//! share one load of the programs (the verifier takes about 2 s a load here, and tens of
//! seconds in the emulated VMs), yet each test starts from the maps as the load left them.
use std::{
    io,
    os::fd::{AsFd as _, AsRawFd as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use aya::maps::{MapData, MapType};

/// Every pinned map under a pin directory (`bpf::pin_dir`), with what it held when saved.
pub struct MapState(Vec<Saved>);

struct Saved {
    path: PathBuf,
    map: MapData,
    kind: Kind,
    key_size: usize,
    /// A value as the syscalls read and write it (per CPU: one 8-byte-aligned slot each).
    value_size: usize,
    entries: Vec<(Vec<u8>, Vec<u8>)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Every index has a value: each is written back.
    Array,
    /// Keys come and go: all are deleted, then the saved ones written back.
    Keyed,
    /// A ring buffer: what nobody read is read away.
    Ring,
    /// Not state a program keeps (program arrays, filled by the loader).
    Other,
}

impl MapState {
    /// Save what every map pinned in `dir` holds now.
    pub fn save(dir: &Path) -> Result<Self> {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?.get() as usize;
        let mut saved = Vec::new();
        let mut paths: Vec<_> = std::fs::read_dir(dir)?.map(|e| e.map(|e| e.path())).collect::<io::Result<_>>()?;
        paths.sort();
        for path in paths {
            let Ok(map) = MapData::from_pin(&path) else { continue }; // a pinned program or link
            let info = map.info().with_context(|| format!("map {}", path.display()))?;
            let per_cpu = |size: u32| (size as usize).next_multiple_of(8) * cpus;
            let (kind, value_size) = match info.map_type()? {
                MapType::Array => (Kind::Array, info.value_size() as usize),
                MapType::PerCpuArray => (Kind::Array, per_cpu(info.value_size())),
                MapType::Hash | MapType::LruHash | MapType::LpmTrie => (Kind::Keyed, info.value_size() as usize),
                MapType::PerCpuHash | MapType::LruPerCpuHash => (Kind::Keyed, per_cpu(info.value_size())),
                MapType::RingBuf => (Kind::Ring, 0),
                _ => (Kind::Other, 0),
            };
            let mut s = Saved { path, map, kind, key_size: info.key_size() as usize, value_size, entries: Vec::new() };
            s.entries = match kind {
                Kind::Array => (0..info.max_entries())
                    .map(|i| {
                        let key = i.to_ne_bytes().to_vec();
                        let value = s.lookup(&key)?.context("an array index without a value")?;
                        Ok((key, value))
                    })
                    .collect::<Result<_>>()?,
                // A key gone between the walk and its lookup is not saved.
                Kind::Keyed => s
                    .keys()?
                    .into_iter()
                    .filter_map(|key| s.lookup(&key).transpose().map(|value| value.map(|value| (key, value))))
                    .collect::<io::Result<_>>()?,
                Kind::Ring | Kind::Other => Vec::new(),
            };
            saved.push(s);
        }
        Ok(Self(saved))
    }

    /// Put every map back as it was saved.
    pub fn restore(&self) -> Result<()> {
        for s in &self.0 {
            let what = || format!("failed to restore map {}", s.path.display());
            match s.kind {
                Kind::Keyed => {
                    // The first key again after each delete: a walk would skip keys it moved.
                    while let Some(key) = s.next_key(None).with_context(what)? {
                        s.delete(&key).with_context(what)?;
                    }
                }
                Kind::Ring => {
                    let map = aya::maps::Map::RingBuf(MapData::from_pin(&s.path)?);
                    let mut ring = aya::maps::RingBuf::try_from(map).with_context(what)?;
                    while ring.next().is_some() {}
                }
                Kind::Array | Kind::Other => {}
            }
            for (key, value) in &s.entries {
                s.update(key, value).with_context(what)?;
            }
        }
        Ok(())
    }
}

/// `union bpf_attr` as the element commands read it.
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value_or_next_key: u64,
    flags: u64,
}

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;

impl Saved {
    /// One element command; `Ok(false)`: no such element (ENOENT).
    fn command(&self, cmd: libc::c_long, key: Option<&[u8]>, out: Option<*mut u8>, flags: u64) -> io::Result<bool> {
        let mut attr = ElemAttr {
            map_fd: self.map.fd().as_fd().as_raw_fd() as u32,
            _pad: 0,
            key: key.map_or(0, |k| k.as_ptr() as u64),
            value_or_next_key: out.map_or(0, |p| p as u64),
            flags,
        };
        // SAFETY: the attribute's pointers are to buffers of the map's key and value sizes.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(&mut attr), size_of::<ElemAttr>()) };
        match rc {
            0 => Ok(true),
            _ if io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT) => Ok(false),
            _ => Err(io::Error::last_os_error()),
        }
    }

    fn lookup(&self, key: &[u8]) -> io::Result<Option<Vec<u8>>> {
        let mut value = vec![0u8; self.value_size];
        Ok(self.command(BPF_MAP_LOOKUP_ELEM, Some(key), Some(value.as_mut_ptr()), 0)?.then_some(value))
    }

    fn update(&self, key: &[u8], value: &[u8]) -> io::Result<()> {
        self.command(BPF_MAP_UPDATE_ELEM, Some(key), Some(value.as_ptr().cast_mut()), 0).map(drop)
    }

    fn delete(&self, key: &[u8]) -> io::Result<()> {
        self.command(BPF_MAP_DELETE_ELEM, Some(key), None, 0).map(drop)
    }

    fn next_key(&self, after: Option<&[u8]>) -> io::Result<Option<Vec<u8>>> {
        let mut next = vec![0u8; self.key_size];
        Ok(self.command(BPF_MAP_GET_NEXT_KEY, after, Some(next.as_mut_ptr()), 0)?.then_some(next))
    }

    fn keys(&self) -> io::Result<Vec<Vec<u8>>> {
        let mut keys: Vec<Vec<u8>> = Vec::new();
        while let Some(key) = self.next_key(keys.last().map(Vec::as_slice))? {
            keys.push(key);
        }
        Ok(keys)
    }
}
