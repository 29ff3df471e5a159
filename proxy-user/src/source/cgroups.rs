//! Where this node's pods are in the cgroup2 hierarchy: kubelet gives each pod a cgroup named
//! after its uid, `pod<uid>` (cgroupfs driver: `kubepods/burstable/pod1234-...`) or
//! `kubepods-<class>-pod<uid with underscores>.slice` (systemd driver), and its containers'
//! cgroups are inside it.
use std::{
    collections::{BTreeMap, BTreeSet},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

/// A pod's cgroup: its id (the directory's inode, as `bpf_get_current_ancestor_cgroup_id`
/// gives it) and its level below the hierarchy's root (the root is level 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodCgroup {
    pub id: u64,
    pub level: u32,
}

impl PodCgroup {
    /// The cgroup at `dir`, its level counted by walking up to the hierarchy's root, the one
    /// cgroup without a `cgroup.type` file. None: not in a cgroup2 hierarchy.
    pub fn of(dir: &Path) -> Option<Self> {
        let id = std::fs::metadata(dir).ok()?.ino();
        let mut level = 0;
        let mut at = dir;
        while at.join("cgroup.type").exists() {
            at = at.parent()?;
            level += 1;
        }
        at.join("cgroup.procs").exists().then_some(Self { id, level })
    }
}

/// The threads of the cgroup at `dir` and of the cgroups below it (`cgroup.threads`).
pub fn threads(dir: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let text = std::fs::read_to_string(dir.join("cgroup.threads")).unwrap_or_default();
        out.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        let entries = std::fs::read_dir(&dir).into_iter().flatten().flatten();
        stack.extend(entries.filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
    }
    out
}

/// How deep below `under` a pod's cgroup is looked for (kubelet's are 1 to 3 below its root).
const MAX_DEPTH: usize = 6;

/// The cgroup directories under `under` of the pods `uids`, found by name. A pod whose cgroup
/// does not exist (yet) is absent from the answer.
pub fn pod_cgroups(under: &Path, uids: &BTreeSet<String>) -> BTreeMap<String, PathBuf> {
    let mut found = BTreeMap::new();
    if uids.is_empty() {
        return found;
    }
    let wanted: BTreeMap<String, &String> = uids.iter().map(|uid| (uid.replace('-', "_"), uid)).collect();
    let mut stack = vec![(under.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = entry.file_name();
            if let Some(uid) = pod_uid(&name.to_string_lossy()).and_then(|u| wanted.get(&u.replace('-', "_"))) {
                found.insert((*uid).clone(), entry.path());
                continue; // its containers are inside: nothing more to find there
            }
            if depth + 1 < MAX_DEPTH {
                stack.push((entry.path(), depth + 1));
            }
        }
    }
    found
}

/// The uid in a pod cgroup's name, as written there (dashes, or underscores under systemd).
fn pod_uid(name: &str) -> Option<&str> {
    let name = name.strip_suffix(".slice").unwrap_or(name);
    let at = name.rfind("pod")?;
    let uid = &name[at + 3..];
    (uid.len() == 36).then_some(uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_cgroups_are_found_by_either_drivers_name() {
        let root = std::env::temp_dir().join(format!("kpr-cgroups-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let a = "0a1b2c3d-0000-4000-8000-000000000001";
        let b = "0a1b2c3d-0000-4000-8000-000000000002";
        let cgroupfs = root.join(format!("kubepods/burstable/pod{a}"));
        let systemd = root.join(format!(
            "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice",
            b.replace('-', "_")
        ));
        for dir in [&cgroupfs, &systemd] {
            std::fs::create_dir_all(dir.join("cri-containerd-abc.scope")).unwrap();
        }
        let other = "0a1b2c3d-0000-4000-8000-000000000003";
        let uids = BTreeSet::from([a.to_owned(), b.to_owned(), other.to_owned()]);
        let found = pod_cgroups(&root, &uids);
        assert_eq!(found.get(a), Some(&cgroupfs));
        assert_eq!(found.get(b), Some(&systemd));
        assert_eq!(found.len(), 2, "no cgroup for {other} yet");
        assert_eq!(PodCgroup::of(&cgroupfs), None, "not a cgroup hierarchy");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
