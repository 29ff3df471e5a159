//! `cargo xtask <command>`: everything a developer or CI does with kpr.
//!
//! xtask itself builds with whatever stable Rust the machine has; every other crate builds with
//! the pinned toolchain (`toolchain.pin`), which `setup` installs.
mod cluster;
mod e2e;
mod image;
#[cfg(test)] // a unit test checks the crates (see its docs)
mod imports;
mod setup;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "kpr developer commands")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what kpr needs on this machine (toolchain, bpf-linker, packages, mounts). Idempotent.
    Setup,
    /// Set up, then build the agent (with its embedded eBPF object).
    Build {
        #[arg(long)]
        release: bool,
    },
    /// Run kpr: against a cluster when a kubeconfig is given (flag or KUBECONFIG), otherwise the
    /// built-in demo on network namespaces. Extra arguments after `--` go to the agent.
    Run {
        #[arg(long, env = "KUBECONFIG")]
        kubeconfig: Option<PathBuf>,
        #[arg(long)]
        release: bool,
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Run every test: formatting, lints, unit tests, then the privileged datapath and end-to-end tests
    /// (root) on this machine's kernel, then the privileged suites in VMs of other kernels.
    Test {
        /// Only run tests whose name contains this filter.
        filter: Option<String>,
        /// Only the formatting and lint checks and the unit tests: no root, no kernel (the quick loop).
        #[arg(long, conflicts_with_all = ["host", "kernels"])]
        unit: bool,
        /// The unit tests and the privileged suites on this machine's kernel: no e2e specs, no VMs.
        #[arg(long, conflicts_with = "kernels")]
        host: bool,
        /// Run only the privileged suites, in a VM booting this Debian kernel (`6.1`, `6.12`;
        /// repeatable).
        #[arg(long = "kernel")]
        kernels: Vec<String>,
    },
    /// Start a local control plane (etcd + kube-apiserver on 127.0.0.1, built from tools/k8s),
    /// write its admin kubeconfig, and keep it up until Ctrl-C; everything is removed on exit.
    /// Extra arguments after `--` go to `kpr-cluster` (see its `--help`).
    Cluster {
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build kpr's container image (a static binary in one layer, no base image) into
    /// target/image: an OCI layout and its tar, for `ctr images import` or `docker load`.
    Image {
        #[arg(long, default_value = "latest")]
        tag: String,
        /// Build the tests' pod image (`kpr-testpod`: kpr-probe alone) instead.
        #[arg(long)]
        testpod: bool,
    },
    /// Run Kubernetes' e2e network suite (test/e2e/network, built offline from tools/e2e) on a
    /// local two-node cluster, once per proxy; writes target/e2e/<proxy>/ and
    /// target/e2e/summary.json and prints each spec whose outcome differs between the proxies.
    /// Fails when kpr fails a spec a kube-proxy passes.
    E2e {
        /// The proxy the nodes run (repeatable; default kpr and kube-proxy-iptables).
        #[arg(long = "proxy", value_parser = ["kpr", "kube-proxy-iptables", "kube-proxy-nftables"])]
        proxies: Vec<String>,
        /// Only specs matching this regular expression (default: `\[sig-network\]`).
        #[arg(long)]
        focus: Option<String>,
        /// Leave out specs matching this regular expression (default: xtask/src/e2e.rs's SKIPS).
        #[arg(long)]
        skip: Option<String>,
        /// Ginkgo processes running specs in parallel.
        #[arg(long, default_value_t = 4)]
        nodes: u32,
        /// Keep the cluster's data directories.
        #[arg(long)]
        keep: bool,
        /// Run what CI runs instead: sig-network's [Conformance] specs against kpr.
        #[arg(long, conflicts_with_all = ["proxies", "focus", "skip"])]
        conformance: bool,
    },
    /// Run the benchmarks (release build); prints numbers and writes target/bench/*.json.
    Bench {
        /// Extra arguments for the benchmark program (see `--help` of kpr-bench).
        #[arg(last = true)]
        args: Vec<String>,
    },
}

fn main() -> std::process::ExitCode {
    // The error's chain says what failed; a backtrace of xtask itself would bury it.
    match run_command() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_command() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    match cli.command {
        Cmd::Setup => setup::ensure_all(&root).map(drop),
        Cmd::Build { release } => {
            let env = setup::ensure_all(&root)?;
            build(&root, &env, release)
        }
        Cmd::Run { kubeconfig, release, args } => {
            let env = setup::ensure_all(&root)?;
            build(&root, &env, release)?;
            let mut cmd = match kubeconfig {
                Some(kubeconfig) => {
                    println!("xtask: running the agent against the cluster in {}", kubeconfig.display());
                    let mut cmd = Command::new(target_bin(&root, release, "kpr"));
                    cmd.arg("agent").arg("--kubeconfig").arg(kubeconfig);
                    cmd
                }
                None => {
                    println!("xtask: no kubeconfig given: running the built-in demo");
                    Command::new(target_bin(&root, release, "kpr-demo"))
                }
            };
            run(cmd.args(args))
        }
        Cmd::Test { filter, unit, host, kernels } => {
            let env = setup::ensure_all(&root)?;
            let scope = match (unit, host, kernels.is_empty()) {
                (true, _, _) => TestScope::Unit,
                (_, true, _) => TestScope::Host,
                (_, _, false) => TestScope::Vms(kernels),
                _ => TestScope::All,
            };
            test(&root, &env, filter.as_deref(), &scope)
        }
        Cmd::Cluster { args } => {
            let env = setup::ensure_all(&root)?;
            let k8s_bin = cluster::ensure_k8s_binaries(&root)?;
            run(env
                .cargo(&root)
                .args(["run", "--package", "kpr-tests", "--bin", "kpr-cluster", "--"])
                .env("KPR_K8S_BIN", k8s_bin)
                .args(args))
        }
        Cmd::Image { tag, testpod } => {
            let env = setup::ensure_all(&root)?;
            if testpod { image::build_testpod(&root, &env) } else { image::build(&root, &env, &tag) }.map(drop)
        }
        Cmd::E2e { proxies, focus, skip, nodes, keep, conformance } => {
            let env = setup::ensure_all(&root)?;
            if conformance {
                return e2e::run(&root, &env, &e2e::Options { keep, ..e2e::Options::conformance() });
            }
            let proxies = if proxies.is_empty() { vec!["kpr".into(), "kube-proxy-iptables".into()] } else { proxies };
            e2e::run(&root, &env, &e2e::Options { proxies, focus, skip, procs: nodes, keep })
        }
        Cmd::Bench { args } => {
            let env = setup::ensure_all(&root)?;
            build(&root, &env, true)?;
            // The real kube-proxy and its control plane, the comparison's peers.
            let k8s_bin = cluster::ensure_k8s_binaries(&root)?;
            run(env
                .cargo(&root)
                .args(["run", "--release", "--package", "kpr-tests", "--bin", "kpr-bench", "--"])
                .env("KPR_BIN", target_bin(&root, true, "kpr"))
                .env("KPR_K8S_BIN", k8s_bin)
                .args(args))
        }
    }
}

fn build(root: &Path, env: &setup::Env, release: bool) -> Result<()> {
    let mut cmd = env.cargo(root);
    // The agent and the demo.
    cmd.args(["build", "--package", "proxy-user", "--package", "kpr-testbed"]);
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd)
}

/// How much of the test suite `cargo xtask test` runs.
enum TestScope {
    /// Formatting, lints and unit tests.
    Unit,
    /// And the privileged suites on this machine's kernel.
    Host,
    /// Only the privileged suites in VMs of these kernels.
    Vms(Vec<String>),
    /// Everything: the host's suites, the e2e conformance specs, then every VM kernel.
    All,
}

/// The formatting and lint checks and the unit tests of every crate, then the privileged tests one at a
/// time (they share the kernel), the e2e conformance specs, then the privileged suites on each
/// VM kernel; `scope` stops earlier or runs only VMs.
fn test(root: &Path, env: &setup::Env, filter: Option<&str>, scope: &TestScope) -> Result<()> {
    // Where a run's time goes, in CI's log: each stage's end, in minutes since the start.
    let started = std::time::Instant::now();
    let stage = |what: &str| {
        let at = started.elapsed().as_secs();
        println!("xtask: {what} done at {:02}:{:02}", at / 60, at % 60);
    };
    build(root, env, false)?;
    stage("the build");
    if let TestScope::Vms(kernels) = scope {
        let shorts: Vec<&str> = kernels.iter().map(String::as_str).collect();
        let (_, failed) = test_in_vms(root, env, &shorts, filter)?;
        if failed > 0 {
            bail!("{failed} tests failed in VMs");
        }
        return Ok(());
    }
    let fmt = env.cargo(root).args(["fmt", "--all", "--check"]).status().context("failed to run cargo fmt")?;
    if !fmt.success() {
        bail!("the code is not formatted as rustfmt.toml says: run `cargo fmt --all`");
    }
    // Every host crate and its tests (the eBPF crate builds only for the BPF target).
    let clippy = env
        .cargo(root)
        .args(["clippy", "--workspace", "--exclude", "proxy-ebpf", "--all-targets", "--", "-D", "warnings"])
        .status()
        .context("failed to run cargo clippy")?;
    if !clippy.success() {
        bail!("cargo clippy found warnings (see above)");
    }
    stage("fmt and clippy");
    let mut unit = env.cargo(root);
    unit.args(["test", "--no-fail-fast", "--package", "proxy-common", "--package", "proxy-user", "--package", "xtask"]);
    if let Some(filter) = filter {
        unit.args(["--", filter]);
    }
    let mut tally = run_tests(&mut unit)?;
    stage("the unit tests");
    if matches!(scope, TestScope::Unit) {
        println!("xtask: {} passed, {} failed (unit tests)", tally.0, tally.1);
        if tally.1 > 0 {
            bail!("{} tests failed", tally.1);
        }
        return Ok(());
    }

    if !setup::is_root() {
        bail!("the privileged tests need root (network namespaces, cgroups, BPF)");
    }
    // With a filter, only the suites with a matching test run, and only what they need is built.
    let suites = match filter {
        Some(filter) => suites_matching(root, env, filter)?,
        None => SUITES_NEEDING.iter().map(|(suite, _)| (*suite).to_owned()).collect(),
    };
    let needs = |what: Needs| suites.iter().any(|s| needs_of(s).contains(&what));
    let whole_run = filter.is_none() && matches!(scope, TestScope::All);
    // What the later suites need is built in the background, niced, while the suites that need
    // neither the control plane nor an image run (they mostly wait on packets and agents).
    let background = (needs(Needs::ControlPlane) || needs(Needs::Images))
        .then(|| Background::start(root, env, needs(Needs::ControlPlane), needs(Needs::Images), whole_run));
    let (standalone, dependent): (Vec<&String>, Vec<&String>) =
        suites.iter().partition(|suite| needs_of(suite).is_empty());
    let suite_run = |group: &[&String], with_lib: bool| {
        let mut cmd = env.cargo(root);
        cmd.args(["test", "--no-fail-fast", "--package", "kpr-tests"]);
        if with_lib {
            cmd.args(["--lib", "--bins"]);
        }
        for suite in group {
            cmd.args(["--test", suite.as_str()]);
        }
        cmd.args(["--", "--test-threads=1"]).env("KPR_BIN", target_bin(root, false, "kpr"));
        if let Some(filter) = filter {
            cmd.arg(filter);
        }
        cmd
    };
    let mut groups = vec![run_tests(&mut suite_run(&standalone, true))];
    let mut background_failed = None;
    if !dependent.is_empty() {
        let mut privileged = suite_run(&dependent, false);
        match background.as_ref().map(Background::prepared).unwrap_or_else(|| Ok(Prepared::default())) {
            Ok(Prepared { k8s_bin, images }) => {
                if let Some(k8s_bin) = k8s_bin {
                    // The control plane, kubelet and kube-proxy, built once per pin.
                    privileged.env("KPR_K8S_BIN", k8s_bin);
                }
                // The image its test runs under runc; the DaemonSet test's images: kpr under a
                // second tag (its rolling update) and the test pods'.
                privileged.envs(images.into_iter().flatten());
                groups.push(run_tests(&mut privileged));
            }
            Err(e) => background_failed = Some(e),
        }
    }
    // The e2e suite's build ends before its stage: it would otherwise build the same module.
    if let Some(background) = background {
        background.finish();
    }
    // Every group runs even when one fails; then each counts, and any failure stops the run.
    let mut errors = Vec::new();
    for group in groups {
        match group {
            Ok((passed, failed)) => {
                tally.0 += passed;
                tally.1 += failed;
            }
            Err(e) => errors.push(e),
        }
    }
    errors.extend(background_failed.map(|e| e.context("the control plane or the images could not be built")));
    if !errors.is_empty() {
        let all: Vec<String> = errors.iter().map(|e| format!("{e:#}")).collect();
        bail!("{}", all.join("; "));
    }
    stage("the privileged suites");
    // Kubernetes' own sig-network conformance specs against kpr (`cargo xtask e2e` runs the
    // whole sig-network suite against kpr and kube-proxy side by side).
    if whole_run {
        match e2e::run(root, env, &e2e::Options::conformance()) {
            Ok(()) => tally.0 += 1,
            Err(e) => {
                eprintln!("xtask: the e2e conformance specs failed: {e:#}");
                tally.1 += 1;
            }
        }
        stage("the e2e conformance specs");
    }
    println!("xtask: {} passed, {} failed (this machine's kernel)", tally.0, tally.1);
    if matches!(scope, TestScope::Host) {
        if tally.1 > 0 {
            bail!("{} tests failed", tally.1);
        }
        return Ok(());
    }

    let (passed, failed) = test_in_vms(root, env, &vm::KERNELS.map(|(short, ..)| short), filter)?;
    tally.0 += passed;
    tally.1 += failed;
    stage("the VMs");
    println!("xtask: {} passed, {} failed", tally.0, tally.1);
    if tally.1 > 0 {
        bail!("{} tests failed", tally.1);
    }
    Ok(())
}

/// The privileged suites in VMs booting Debian's `shorts` kernels, one after the other (side by
/// side, the timing-bound tests failed): (passed, failed); a VM that gave no result (crashed
/// twice, timed out) is an error once all have run. Each kernel's `kernel <uname -r>: N passed,
/// M failed` line is printed at the end. The test binaries and the image are built once.
fn test_in_vms(root: &Path, env: &setup::Env, shorts: &[&str], filter: Option<&str>) -> Result<(u64, u64)> {
    let suites: Vec<&str> = vm::SUITES.iter().map(|suite| suite.name).collect();
    let binaries: Vec<(PathBuf, &vm::Suite)> =
        test_binaries(root, env, &suites)?.into_iter().zip(&vm::SUITES).collect();
    let mut any_matching = false;
    for (binary, suite) in &binaries {
        // A misspelt name would skip nothing, or sample nothing and pass.
        let listed = Command::new(binary).args(["--list", "--format", "terse"]).output()?;
        let listed = String::from_utf8_lossy(&listed.stdout);
        let names: Vec<&str> = listed.lines().filter_map(|l| l.strip_suffix(": test")).collect();
        for name in suite.host_only.iter().chain(suite.sample.unwrap_or_default()).chain(suite.on_full.extra()) {
            anyhow::ensure!(names.contains(name), "vm::SUITES names {name}, which {} does not have", suite.name);
        }
        any_matching |= names.iter().any(|name| filter.is_none_or(|f| name.contains(f)));
    }
    if !any_matching {
        println!("xtask: no test of the VM suites matches the filter: no VM booted");
        return Ok((0, 0));
    }
    // The suites run in VMs need no control plane (`vm::SUITES`).
    // The VM kernels have SCTP, VLAN and IP-in-IP links (this machine's may not): their end-to-end tests
    // must run there.
    let image = image::build(root, env, "latest")?;
    let vars = [
        // The agent the image carries (static, release): under emulation a debug build's own
        // work (the object's parsing, the maps' programming) made most of an agent's start.
        ("KPR_BIN", image::static_binary_path(root, "kpr").display().to_string()),
        ("KPR_REQUIRE_SCTP", "1".to_owned()),
        ("KPR_REQUIRE_VLAN", "1".to_owned()),
        ("KPR_REQUIRE_IPIP", "1".to_owned()),
        ("KPR_IMAGE", image.display().to_string()),
    ];
    let (mut passed, mut failed, mut errors) = (0, 0, Vec::new());
    for (short, result) in shorts.iter().zip(vm::run_tests(shorts, &binaries, &vars, filter)?) {
        match result {
            Ok((release, p, f)) => {
                println!("kernel {release}: {p} passed, {f} failed");
                passed += p;
                failed += f;
            }
            Err(e) => {
                println!("kernel {short}: no result: {e:#}");
                errors.push(format!("{e:#}"));
            }
        }
    }
    if !errors.is_empty() {
        bail!("{}", errors.join("; "));
    }
    Ok((passed, failed))
}

/// What the suites that need the control plane or the images are given.
#[derive(Default)]
struct Prepared {
    k8s_bin: Option<PathBuf>,
    images: Option<[(&'static str, PathBuf); 3]>,
}

/// A thread at the least priority building what the later stages need: the control plane's
/// binaries (Go; cold, 5-10 minutes of CPU), the images' static release build (about 6
/// minutes), then the e2e suite's binaries (Go, about 4 more), whose failure is left for the
/// e2e stage to meet and count.
struct Background {
    prepared: std::sync::mpsc::Receiver<Result<Prepared>>,
    thread: std::thread::JoinHandle<()>,
}

impl Background {
    fn start(root: &Path, env: &setup::Env, control_plane: bool, images: bool, e2e: bool) -> Self {
        let (root, env) = (root.to_owned(), env.clone());
        let (tx, prepared) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            nice_this_thread();
            let built = (|| -> Result<Prepared> {
                let k8s_bin = if control_plane { Some(cluster::ensure_k8s_binaries(&root)?) } else { None };
                let images = if images {
                    Some([
                        ("KPR_IMAGE", image::build(&root, &env, "latest")?),
                        ("KPR_IMAGE_NEXT", image::build(&root, &env, "next")?),
                        ("KPR_TESTPOD_IMAGE", image::build_testpod(&root, &env)?),
                    ])
                } else {
                    None
                };
                Ok(Prepared { k8s_bin, images })
            })();
            let _ = tx.send(built);
            if e2e && let Err(e) = e2e::ensure_binaries(&root) {
                eprintln!("xtask: building the e2e suite in the background failed (its stage tries again): {e:#}");
            }
        });
        Self { prepared, thread }
    }

    /// What the thread built, once it has (an error if it panicked).
    fn prepared(&self) -> Result<Prepared> {
        self.prepared.recv().unwrap_or_else(|_| Err(anyhow::anyhow!("the background build panicked")))
    }

    /// Wait for the thread's end (the e2e suite's build).
    fn finish(self) {
        let _ = self.thread.join();
    }
}

/// Lowers the calling thread's priority to the least, and so its children's: Linux keeps a
/// nice value per thread (`setpriority(PRIO_PROCESS, 0)` sets the caller's).
fn nice_this_thread() {
    // SAFETY: setpriority has no memory preconditions; declared here as `setup::is_root` does.
    unsafe extern "C" {
        fn setpriority(which: i32, who: u32, prio: i32) -> i32;
    }
    unsafe { setpriority(0, 0, 19) };
}

/// What a privileged suite needs besides the agent.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Needs {
    /// etcd, kube-apiserver, kubelet, kube-proxy (`tools/k8s`, `KPR_K8S_BIN`).
    ControlPlane,
    /// kpr's image and the test pods' (`KPR_IMAGE`, `KPR_IMAGE_NEXT`, `KPR_TESTPOD_IMAGE`).
    Images,
}

/// Every privileged suite (`tests/tests/*.rs`) and what it needs; a unit test checks the list
/// against the sources.
const SUITES_NEEDING: [(&str, &[Needs]); 13] = [
    ("apiserver", &[Needs::ControlPlane]),
    ("daemonset", &[Needs::ControlPlane, Needs::Images]),
    ("demo", &[]),
    ("firewall", &[]),
    ("image", &[Needs::Images]),
    ("kube_proxy_flows", &[Needs::ControlPlane]),
    ("kube_proxy_peer", &[Needs::ControlPlane]),
    ("multinode", &[]),
    ("operator", &[]),
    ("outliers", &[]),
    ("socket_lb", &[]),
    ("takeover", &[Needs::ControlPlane]),
    ("tc_testrun", &[]),
];

fn needs_of(suite: &str) -> &'static [Needs] {
    SUITES_NEEDING.iter().find(|(s, _)| *s == suite).map_or(&[], |(_, needs)| needs)
}

/// The privileged suites with a test whose name contains `filter` (built first).
fn suites_matching(root: &Path, env: &setup::Env, filter: &str) -> Result<Vec<String>> {
    let names: Vec<&str> = SUITES_NEEDING.iter().map(|(suite, _)| *suite).collect();
    let mut matching = Vec::new();
    for (binary, suite) in test_binaries(root, env, &names)?.iter().zip(names) {
        let listed = Command::new(binary).args(["--list", "--format", "terse", filter]).output()?;
        if String::from_utf8_lossy(&listed.stdout).lines().any(|l| l.ends_with(": test")) {
            matching.push(suite.to_owned());
        }
    }
    println!(
        "xtask: suites with tests matching `{filter}`: {}",
        if matching.is_empty() { "none".to_owned() } else { matching.join(", ") }
    );
    Ok(matching)
}

/// The executables of the privileged test suites named `suites` (built if needed).
fn test_binaries(root: &Path, env: &setup::Env, suites: &[&str]) -> Result<Vec<PathBuf>> {
    let out = env.cargo(root).args(["test", "--no-run", "--package", "kpr-tests"]).output()?;
    anyhow::ensure!(out.status.success(), "building the tests failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stderr);
    let found: Vec<(String, PathBuf)> = text
        .lines()
        .filter_map(|l| {
            // `  Executable tests/socket_lb.rs (target/debug/deps/socket_lb-0123abcd)`
            let rest = l.trim().strip_prefix("Executable tests/")?;
            let (source, path) = rest.split_once(" (")?;
            Some((source.trim_end_matches(".rs").to_owned(), root.join(path.trim_end_matches(')'))))
        })
        .collect();
    suites
        .iter()
        .map(|suite| {
            found
                .iter()
                .find(|(s, _)| s == suite)
                .map(|(_, p)| p.clone())
                .with_context(|| format!("no test binary for {suite}"))
        })
        .collect()
}

/// Run a `cargo test`, echoing its output, and add up its "test result" lines. Every suite
/// runs even when one fails; the failing tests' panic messages are repeated at the end, where
/// a reader of a long log (or of its tail) finds them.
fn run_tests(cmd: &mut Command) -> Result<(u64, u64)> {
    use std::io::BufRead as _;
    // Assertion messages say what went wrong; a backtrace would only push them out of view.
    cmd.env("RUST_BACKTRACE", "0");
    let mut child =
        cmd.stdout(std::process::Stdio::piped()).spawn().with_context(|| format!("failed to start {cmd:?}"))?;
    let (mut passed, mut failed) = (0, 0);
    let mut panics: Vec<String> = Vec::new();
    let mut in_panic = false;
    for line in std::io::BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        println!("{line}");
        if line.starts_with("thread '") && line.contains("panicked at") {
            in_panic = true;
        } else if in_panic && (line.is_empty() || line.starts_with("note: ") || line.starts_with("---- ")) {
            in_panic = false;
        }
        if in_panic && panics.len() < 400 {
            panics.push(line.chars().take(600).collect());
        }
        if let Some((p, f)) = test_result(&line) {
            passed += p;
            failed += f;
        }
    }
    let status = child.wait()?;
    if !status.success() {
        if !panics.is_empty() {
            println!("\nxtask: what the failing tests said:\n{}", panics.join("\n"));
        }
        println!("xtask: {passed} passed, {} failed", failed.max(1));
        bail!("{cmd:?} failed: {status}");
    }
    Ok((passed, failed))
}

/// A libtest `test result: ... N passed; M failed; ...` line (anywhere in `line`): (N, M).
fn test_result(line: &str) -> Option<(u64, u64)> {
    let (_, rest) = line.split_once("test result: ")?;
    let count = |word: &str| -> u64 {
        rest.split(';')
            .find_map(|part| part.trim().strip_suffix(word)?.trim().rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    Some((count("passed"), count("failed")))
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("failed to start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn target_bin(root: &Path, release: bool, name: &str) -> PathBuf {
    root.join("target").join(if release { "release" } else { "debug" }).join(name)
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A suite left out of the list would never run with a filter; one that starts the control
    /// plane or an image without saying so would fail for want of it.
    #[test]
    fn every_privileged_suite_is_listed_with_what_it_needs() {
        let dir = workspace_root().join("tests/tests");
        let mut found: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.unwrap().file_name().to_str()?.strip_suffix(".rs").map(str::to_owned))
            .collect();
        found.sort();
        let listed: Vec<&str> = SUITES_NEEDING.iter().map(|(suite, _)| *suite).collect();
        assert_eq!(found, listed, "tests/tests/*.rs and SUITES_NEEDING");
        for (suite, needs) in SUITES_NEEDING {
            let text = std::fs::read_to_string(dir.join(format!("{suite}.rs"))).unwrap();
            let control_plane = ["cluster::", "nodes::", "k8s_bin"].iter().any(|s| text.contains(s));
            let images = text.contains("KPR_IMAGE") || text.contains("KPR_TESTPOD_IMAGE");
            assert_eq!(needs.contains(&Needs::ControlPlane), control_plane, "{suite}: the control plane");
            assert_eq!(needs.contains(&Needs::Images), images, "{suite}: the images");
        }
    }
}
