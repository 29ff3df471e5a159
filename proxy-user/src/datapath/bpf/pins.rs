//! The pin directory and its layout versions: one agent per pin root, the maps an upgrade
//! carries from an older layout, and retiring other layouts.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use aya::maps::MapData;
use proxy_common::PIN_LAYOUT_VERSION;

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
