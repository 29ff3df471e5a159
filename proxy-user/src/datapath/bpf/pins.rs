//! The pin directory and its layout versions: one agent per pin root, the maps an upgrade
//! carries from an older layout, and retiring other layouts.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use aya::maps::MapData;
use proxy_common::PIN_LAYOUT_VERSION;

/// Where `program`'s bpf link on link `ifindex` is pinned (tc's and XDP's per-link links).
pub(super) fn link_pin(dir: &Path, program: &str, ifindex: u32) -> PathBuf {
    dir.join(format!("link_{program}_if{ifindex}"))
}

/// The links holding a pinned bpf link of `program` under `dir`, by ifindex.
pub(super) fn links_pinned(dir: &Path, program: &str) -> std::collections::BTreeSet<u32> {
    let prefix = format!("link_{program}_if");
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix(&prefix)?.parse().ok())
        .collect()
}

/// Release the bpf link pinned at `path` (detaching its program), or remove whatever file is
/// there.
pub(super) fn release_link(path: &Path) {
    match aya::programs::links::PinnedLink::from_pin(path) {
        Ok(pinned) => match pinned.unpin() {
            Ok(link) => drop(link),
            Err(e) => tracing::warn!("failed to unpin {}: {e}", path.display()),
        },
        Err(_) => {
            let _ = fs::remove_file(path);
        }
    }
}

/// A pin root someone else created (or can write) could hand kpr maps and links it does not
/// control: refuse it.
pub(super) fn check_owner(pin_root: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(meta) = fs::metadata(pin_root) else { return Ok(()) }; // created below, by us
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        bail!(
            "the pin root {} belongs to uid {}, not to this agent (uid {me}); remove it or choose another --pin-root",
            pin_root.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o022 != 0 {
        bail!(
            "the pin root {} can be written by others (mode {:o}); remove it or choose another --pin-root",
            pin_root.display(),
            meta.mode() & 0o777
        );
    }
    Ok(())
}

/// Held while an agent runs on a pin root (an abstract unix socket, released with the
/// process): `kpr cleanup` refuses to pull the datapath from under a running agent.
pub struct AgentLock(#[allow(dead_code)] std::os::unix::net::UnixListener);

impl AgentLock {
    fn name(pin_root: &Path) -> Vec<u8> {
        format!("kpr-agent:{}", pin_root.display()).into_bytes()
    }

    pub fn acquire(pin_root: &Path) -> Result<Self> {
        use std::os::linux::net::SocketAddrExt as _;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(Self::name(pin_root))?;
        match std::os::unix::net::UnixListener::bind_addr(&addr) {
            Ok(l) => Ok(Self(l)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                bail!("another kpr agent runs on {} (in this network namespace)", pin_root.display())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// An agent holds the lock of `pin_root`.
    pub fn held(pin_root: &Path) -> bool {
        Self::acquire(pin_root).is_err()
    }
}

/// `<pin-root>/v<layout version>`
pub fn pin_dir(pin_root: &Path) -> PathBuf {
    pin_root.join(format!("v{PIN_LAYOUT_VERSION}"))
}

/// The pinned map `name` under `pin_root` (the versioned pin directory). Without kpr's pins
/// there, the error says what is there instead.
pub fn open_pinned_map(pin_root: &Path, name: &str) -> Result<MapData> {
    if let Some(problem) = pins_missing(pin_root) {
        bail!("{problem}");
    }
    let path = pin_dir(pin_root).join(name);
    MapData::from_pin(&path).with_context(|| format!("no pinned map {}", path.display()))
}

/// Why `pin_root` holds no datapath of this kpr's layout, if it does not: for read commands
/// on a node where kpr does not run (or another version of it does).
pub fn pins_missing(pin_root: &Path) -> Option<String> {
    if !pin_root.exists() {
        return Some(format!(
            "no kpr datapath on this node: {} does not exist (kpr has not run here, or with another --pin-root)",
            pin_root.display()
        ));
    }
    if pin_dir(pin_root).exists() {
        return None;
    }
    let others = other_layout_names(pin_root);
    Some(if others.is_empty() {
        format!("no kpr datapath under {} (no layout directory)", pin_root.display())
    } else {
        format!(
            "no pins of this kpr's layout (v{PIN_LAYOUT_VERSION}) under {}: it holds {} (another kpr version's)",
            pin_root.display(),
            others.join(", ")
        )
    })
}

/// The pin layout directories under `pin_root` other than this kpr's, as `v<N>`.
pub fn other_layout_names(pin_root: &Path) -> Vec<String> {
    let mut names: Vec<(u32, String)> =
        other_layouts(pin_root).into_iter().map(|(v, _)| (v, format!("v{v}"))).collect();
    names.sort();
    names.into_iter().map(|(_, n)| n).collect()
}

/// The pin directories of other layout versions under `pin_root`, with their versions.
pub(super) fn other_layouts(pin_root: &Path) -> Vec<(u32, PathBuf)> {
    let current = pin_dir(pin_root);
    let Ok(entries) = fs::read_dir(pin_root) else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.strip_prefix('v')?.parse().ok()?;
            let path = entry.path();
            (path != current).then_some((version, path))
        })
        .collect()
}

/// The map `name` of layout `version` reads as this layout's (see [`proxy_common::CARRIED_MAPS`]).
pub(super) fn reads_as_ours(version: u32, name: &str) -> bool {
    version == PIN_LAYOUT_VERSION
        || version < PIN_LAYOUT_VERSION
            && proxy_common::CARRIED_MAPS.iter().any(|(carried, since)| *carried == name && version >= *since)
}

/// An upgrade: pin the maps of the newest older layout that this one reads as its own
/// ([`proxy_common::CARRIED_MAPS`]) into this layout's directory, unless it has pins already.
/// They stay the same kernel maps, so flows, affinity and the programmed services carry over
/// while the old programs still run on them. Returns the names of the maps carried.
pub(super) fn carry_over_maps(pin_root: &Path) -> Vec<&'static str> {
    let dir = pin_dir(pin_root);
    if fs::read_dir(&dir).map_or(true, |mut files| files.next().is_some()) {
        return Vec::new();
    }
    let older = other_layouts(pin_root).into_iter().filter(|(v, _)| *v < PIN_LAYOUT_VERSION).max();
    let Some((version, old)) = older else { return Vec::new() };
    let mut carried = Vec::new();
    for (name, _) in proxy_common::CARRIED_MAPS.into_iter().filter(|(name, _)| reads_as_ours(version, name)) {
        let Ok(map) = MapData::from_pin(old.join(name)) else { continue };
        match map.pin(dir.join(name)) {
            Ok(()) => carried.push(name),
            Err(e) => tracing::warn!(map = name, "failed to carry the map over from {}: {e}", old.display()),
        }
    }
    tracing::info!(from = %old.display(), maps = ?carried, "carrying over an older layout's maps");
    carried
}

/// An older layout's established conntrack tables that this layout did not carry (before v14
/// they were LRUs, which this layout does not read as its tables), held open: their entries are
/// copied into this layout's tables, so the flows they hold carry on. The older programs go on
/// writing them until they detach; [`OlderConntrack::sync`] then copies what they added and
/// removes what they removed (a closed flow whose SNAT port a new flow took, an expired one),
/// so no copy outlives its flow to shadow a newer one.
pub(super) struct OlderConntrack {
    version: u32,
    v4: Option<OlderTable<proxy_common::Addr4>>,
    v6: Option<OlderTable<proxy_common::Addr>>,
}

/// One family's older table, this layout's, this layout's new-flow table (carried, shared
/// with the older programs), and what was copied.
struct OlderTable<A> {
    theirs: aya::maps::Map,
    ours: aya::maps::Map,
    new_flows: aya::maps::Map,
    copied: std::collections::HashMap<proxy_common::CtKey<A>, proxy_common::CtValue>,
}

impl OlderConntrack {
    /// The newest older layout's established tables that are other maps than this layout's.
    pub(super) fn open(pin_root: &Path) -> Option<Self> {
        use proxy_common::map_names::{CONNTRACK4, CONNTRACK6, CT_NEW4, CT_NEW6};
        let older = other_layouts(pin_root).into_iter().filter(|(v, _)| *v < PIN_LAYOUT_VERSION).max();
        let (version, old) = older?;
        let (v4, v6) = (
            OlderTable::open(&old, pin_root, CONNTRACK4, CT_NEW4),
            OlderTable::open(&old, pin_root, CONNTRACK6, CT_NEW6),
        );
        (v4.is_some() || v6.is_some()).then_some(Self { version, v4, v6 })
    }

    /// Bring this layout's tables up to the older ones: what they hold that is not here (nor
    /// a newer flow on its tuple among the new flows) copied, a copy whose flow they replaced
    /// or removed replaced or removed. After each but the first, the caller makes the flow
    /// caches stop serving copies of what was here (`Conntrack::changed`).
    pub(super) fn sync(&mut self) {
        let (v4, v6) = (self.v4.as_mut().map(OlderTable::sync), self.v6.as_mut().map(OlderTable::sync));
        for (name, synced) in [("KPR_CONNTRACK4", v4), ("KPR_CONNTRACK6", v6)] {
            match synced {
                Some(Ok((copied, removed))) => {
                    tracing::info!(map = name, from = self.version, copied, removed, "conntrack copied over")
                }
                Some(Err(e)) => {
                    tracing::warn!(map = name, "failed to copy conntrack over from layout {}: {e:#}", self.version)
                }
                None => {}
            }
        }
    }
}

impl<A> OlderTable<A>
where
    proxy_common::CtKey<A>: aya::Pod + std::hash::Hash + Eq,
{
    fn open(old: &Path, pin_root: &Path, name: &str, new_flows: &str) -> Option<Self> {
        use aya::maps::Map;
        let dir = pin_dir(pin_root);
        let (theirs, ours) = (MapData::from_pin(old.join(name)).ok()?, MapData::from_pin(dir.join(name)).ok()?);
        let id = |map: &MapData| map.info().map(|info| info.id()).ok();
        if id(&theirs) == id(&ours) {
            return None;
        }
        let new_flows = MapData::from_pin(dir.join(new_flows)).ok()?;
        // The map's kind does not matter to reading or writing it: both are hashes to the
        // syscalls.
        Some(Self {
            theirs: Map::LruHashMap(theirs),
            ours: Map::HashMap(ours),
            new_flows: Map::LruHashMap(new_flows),
            copied: std::collections::HashMap::new(),
        })
    }

    /// [`OlderConntrack::sync`] in one family's tables: (copied or replaced, removed).
    fn sync(&mut self) -> Result<(usize, usize)> {
        use aya::maps::HashMap;
        use proxy_common::{CtKey, CtValue};
        let theirs: HashMap<_, CtKey<A>, CtValue> = HashMap::try_from(&self.theirs)?;
        let mut ours: HashMap<_, CtKey<A>, CtValue> = HashMap::try_from(&mut self.ours)?;
        let new_flows: HashMap<_, CtKey<A>, CtValue> = HashMap::try_from(&self.new_flows)?;
        let now: std::collections::HashMap<CtKey<A>, CtValue> = theirs.iter().flatten().collect();
        let mut removed = 0;
        self.copied.retain(|key, copy| {
            if now.contains_key(key) {
                return true;
            }
            // Gone from the older table: gone here too, if this is still the copy.
            if ours.get(key, 0).is_ok_and(|here| here.same_translation(copy)) && ours.remove(key).is_ok() {
                removed += 1;
            }
            false
        });
        let mut copied = 0;
        for (key, value) in now {
            let flags = match self.copied.get(&key) {
                // Copied, and the same flow still: what is here is the newer.
                Some(copy) if copy.same_translation(&value) => continue,
                // Another flow on the tuple (a client's port, a SNAT port taken again): it
                // replaces the copy of the old one, if that is still here.
                Some(copy) => match ours.get(&key, 0) {
                    Ok(here) if here.same_translation(copy) => 0,
                    _ => continue,
                },
                // A newer flow on the tuple among the new flows is not shadowed; BPF_NOEXIST: an
                // entry already here is the newer.
                None if new_flows.get(&key, 0).is_ok() => continue,
                None => 1,
            };
            if ours.insert(&key, &value, flags).is_ok() {
                self.copied.insert(key, value);
                copied += 1;
            }
        }
        Ok((copied, removed))
    }
}

/// Unpin the directories of other layout versions (an upgrade or a downgrade): their links
/// detach (once no agent of that version holds them), and their maps go with their last user
/// (a carried map stays, pinned here).
pub(super) fn remove_other_layouts(pin_root: &Path) {
    for (_, path) in other_layouts(pin_root) {
        let removed = fs::read_dir(&path)
            .map(|files| files.flatten().filter(|f| fs::remove_file(f.path()).is_ok()).count())
            .unwrap_or(0);
        let _ = fs::remove_dir(&path);
        tracing::warn!(dir = %path.display(), removed, "removed the pins of another kpr layout version (its programs are detached)");
    }
}
