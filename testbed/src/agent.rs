//! `kpr agent` as the demo, the tests and the benchmarks start it: one launcher, so each says
//! only what differs (its source, its options) and none forgets what every one needs.
use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use anyhow::{Context as _, Result};

use crate::{Netns, die_with_parent};

/// The `kpr` binary: `$KPR_BIN`, else the one beside this executable.
pub fn kpr_bin() -> PathBuf {
    std::env::var_os("KPR_BIN").map_or_else(|| beside_this("kpr"), PathBuf::from)
}

/// The demo: `$KPR_DEMO_BIN`, else the `kpr-demo` beside this executable.
pub fn demo_bin() -> PathBuf {
    std::env::var_os("KPR_DEMO_BIN").map_or_else(|| beside_this("kpr-demo"), PathBuf::from)
}

/// `name` in this executable's cargo target directory (a test's executable sits one level
/// down, in `target/<profile>/deps`).
fn beside_this(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().unwrap_or(Path::new("."));
    let dir = if dir.ends_with("deps") { dir.parent().unwrap_or(dir) } else { dir };
    dir.join(name)
}

/// A `kpr agent` command line being put together.
pub struct AgentCommand(Command);

impl AgentCommand {
    /// `kpr agent` balancing the sockets of `cgroup`, with its maps under `pins`: uncoloured
    /// output, no stdin, and ended with the process that started it.
    pub fn new(cgroup: &Path, pins: &Path) -> Self {
        let mut cmd = Command::new(kpr_bin());
        die_with_parent(&mut cmd);
        cmd.arg("agent").arg("--cgroup").arg(cgroup).arg("--pin-root").arg(pins);
        cmd.env("NO_COLOR", "1").stdin(Stdio::null());
        Self(cmd)
    }

    /// Services and EndpointSlices from the manifests in `dir`.
    pub fn manifests(self, dir: &Path) -> Self {
        self.arg("--manifests").arg(dir)
    }

    /// A KubeProxyConfiguration file.
    pub fn config(self, file: &Path) -> Self {
        self.arg("--config").arg(file)
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.0.arg(arg);
        self
    }

    pub fn args(mut self, args: impl IntoIterator<Item = impl AsRef<OsStr>>) -> Self {
        self.0.args(args);
        self
    }

    /// Both output streams appended to `log`.
    pub fn log_to(mut self, log: &Path) -> Result<Self> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        self.0.stdout(out.try_clone()?).stderr(out);
        Ok(self)
    }

    /// Inside `netns` (joined before exec: the agent sees that node's links, and bpffs stays
    /// the machine's).
    pub fn in_netns(mut self, netns: &Netns) -> Result<Self> {
        netns.exec_in(&mut self.0)?;
        Ok(self)
    }

    /// The command, for what only one caller needs (`output()`, a container's confinement).
    pub fn command(self) -> Command {
        self.0
    }

    pub fn spawn(mut self) -> Result<Child> {
        self.0.spawn().with_context(|| format!("failed to start {}", kpr_bin().display()))
    }
}
