//! `cargo xtask e2e`: Kubernetes' own e2e network suite (`test/e2e/network` of the pinned
//! Kubernetes, built offline from `tools/e2e`) against kpr and the real kube-proxy, on the same
//! local cluster (`kpr-e2e` in the tests crate brings it up once per proxy), side by side.
//!
//! Writes `target/e2e/<proxy>/{report.json,junit.xml,logs/}` and `target/e2e/summary.json`
//! (every spec's outcome per proxy) and prints the table: specs run, passed, failed per proxy,
//! and every spec whose outcome differs between kpr and a kube-proxy.
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::{
    cluster::{self, GoBinary},
    image, setup,
};

/// What `tools/e2e` builds: the suite, its runner, and the binaries of its images.
const BINARIES: &[GoBinary] = &[
    GoBinary { name: "e2e.test", package: "kpr.local/tools/e2e", test: true },
    GoBinary::program("ginkgo", "github.com/onsi/ginkgo/v2/ginkgo"),
    GoBinary::program("agnhost", "k8s.io/kubernetes/test/images/agnhost"),
    GoBinary::program("coredns", "kpr.local/tools/e2e/coredns"),
    GoBinary::program("regression-issue-74839", "k8s.io/kubernetes/test/images/regression-issue-74839"),
];

/// The default selection: sig-network's specs.
pub const DEFAULT_FOCUS: &str = r"\[sig-network\]";

/// What the default run leaves out, and why: one place, one reason each.
pub const SKIPS: &[(&str, &str)] = &[
    (r"LoadBalancer", "no cloud load-balancer provider on a local cluster (kpr's LB-IP semantics are in tests/)"),
    (r"NetworkPolicy|Netpol", "policy enforcement is the CNI's, not a Service proxy's; the test CNI (bridge) has none"),
    (r"Disruptive|Serial", "restarts nodes or needs the whole cluster alone; out of a parallel run"),
    (r"SCTP", "this machine's kernel has no sctp module"),
    (r"IPv6|DualStack", "the e2e cluster is IPv4 only (kpr's IPv6 paths are covered by tests/)"),
    (r"Networking-Performance|IPerf2|PerformanceDNS", "throughput benchmarks, not behaviour"),
    (r"Feature:Networking-(DNS|IPv4|IPv6)", "they reach the Internet; nothing here routes off the machine"),
    (r"Feature:(OffByDefault|Example|Federation)|\[Alpha\]", "feature gates off in the pinned control plane"),
];

/// Specs that check kube-proxy's own mode (`/proxyMode`) and skip themselves under any other
/// proxy: a skip there is not kpr falling behind. One reason each.
pub const KUBE_PROXY_MODE_SPECS: &[(&str, &str)] = &[(
    "should update metric for tracking accepted packets destined for localhost nodeports",
    "counts iptables mode's nfacct counter for localhost NodePorts; skips itself unless /proxyMode \
     is iptables (kube-proxy's nftables mode skips it too)",
)];

pub struct Options {
    pub proxies: Vec<String>,
    pub focus: Option<String>,
    pub skip: Option<String>,
    pub procs: u32,
    pub keep: bool,
}

impl Options {
    /// CI's subset: sig-network's `[Conformance]` specs against kpr, judged by pass/fail.
    pub fn conformance() -> Self {
        Self {
            proxies: vec!["kpr".to_owned()],
            focus: Some(CONFORMANCE_FOCUS.to_owned()),
            skip: None,
            // The specs mostly wait (for pods, for timeouts): 47 of them take about 2,000
            // spec-seconds, so six at a time keep CI's share near six minutes.
            procs: 6,
            keep: false,
        }
    }
}

/// sig-network's conformance specs (the tag is in the spec's text).
pub const CONFORMANCE_FOCUS: &str = r"\[sig-network\].*\[Conformance\]";

pub fn run(root: &Path, env: &setup::Env, options: &Options) -> Result<()> {
    let started = Instant::now();
    let k8s_bin = cluster::ensure_k8s_binaries(root)?;
    let e2e_bin = ensure_binaries(root)?;
    let k8s_src = kubernetes_source(root)?;
    let tags = image::e2e_tags(&fs::read_to_string(k8s_src.join("test/utils/image/manifest.go"))?)?;
    let mut images = vec![image::build_testpod(root, env)?];
    if options.proxies.iter().any(|p| p == "kpr") {
        images.push(image::build(root, env, "latest")?);
    }
    let mut images: Vec<PathBuf> =
        images.into_iter().map(|l| PathBuf::from(format!("{}.oci.tar", l.display()))).collect();
    images.extend(image::build_e2e(root, &e2e_bin, &k8s_bin, &k8s_src, &tags)?);
    crate::run(env.cargo(root).args(["build", "--package", "kpr-tests", "--bin", "kpr-e2e"]))?;

    let skip = options.skip.clone().unwrap_or_else(|| SKIPS.iter().map(|(re, _)| *re).collect::<Vec<_>>().join("|"));
    let focus = options.focus.clone().unwrap_or_else(|| DEFAULT_FOCUS.to_owned());
    let out_root = root.join("target/e2e");
    let mut reports = BTreeMap::new();
    for proxy in &options.proxies {
        let out = out_root.join(proxy);
        let _ = fs::remove_dir_all(&out);
        fs::create_dir_all(&out)?;
        println!("xtask: e2e with {proxy}: focus {focus:?}, skip {skip:?}, {} ginkgo processes", options.procs);
        let mut cmd = Command::new(root.join("target/debug/kpr-e2e"));
        cmd.arg("--proxy").arg(proxy).arg("--e2e-bin").arg(&e2e_bin).arg("--out").arg(&out);
        cmd.arg("--agnhost-tag").arg(&tags["Agnhost"]);
        for archive in &images {
            cmd.arg("--image").arg(archive);
        }
        if options.keep {
            cmd.arg("--keep");
        }
        cmd.arg("--")
            .arg(format!("--focus={focus}"))
            .arg(format!("--skip={skip}"))
            .arg(format!("--procs={}", options.procs))
            // Progress while it runs: a line per spec, and where a slow one stands.
            .args(["--succinct", "--poll-progress-after=120s", "--timeout=3h"])
            .env("KPR_K8S_BIN", &k8s_bin);
        let status = cmd.status().context("failed to run kpr-e2e")?;
        if status.code() == Some(2) || !out.join("report.json").is_file() {
            bail!("the e2e run with {proxy} did not complete ({status}); logs in {}", out.display());
        }
        reports.insert(proxy.clone(), outcomes(&fs::read_to_string(out.join("report.json"))?)?);
    }
    let summary = summarize(&reports);
    fs::write(out_root.join("summary.json"), serde_json::to_vec_pretty(&summary.json)?)?;
    println!("{}", summary.table);
    println!("xtask: e2e done in {:.0?}; target/e2e/summary.json", started.elapsed());
    if summary.kpr_behind {
        bail!("kpr failed a spec a kube-proxy passed, or any spec when run alone (listed above)");
    }
    // kpr's datapath self-check on the real cluster: a mismatch is a bug the specs may miss.
    if let Ok(text) = fs::read_to_string(out_root.join("kpr/self-check.json")) {
        let report: serde_json::Value = serde_json::from_str(&text)?;
        let mismatches = report["mismatches"].as_array().map_or(0, Vec::len);
        anyhow::ensure!(
            mismatches == 0,
            "kpr's datapath self-check found {mismatches} mismatches on the cluster: target/e2e/kpr/self-check.json"
        );
    }
    Ok(())
}

/// The directory of the e2e suite's binaries, built first if needed.
pub fn ensure_binaries(root: &Path) -> Result<PathBuf> {
    cluster::ensure_go_binaries(root, "e2e", BINARIES, "Kubernetes' e2e network suite, ginkgo, agnhost and CoreDNS")
}

/// The pinned Kubernetes sources in Go's module cache (the image manifest, agnhost's files).
fn kubernetes_source(root: &Path) -> Result<PathBuf> {
    let out = Command::new("go")
        .args(["list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes"])
        .current_dir(root.join("tools/e2e"))
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-mod=readonly")
        .output()
        .context("go list")?;
    anyhow::ensure!(out.status.success(), "go list -m k8s.io/kubernetes: {}", String::from_utf8_lossy(&out.stderr));
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

/// Each spec's full name and outcome (`passed`, `failed`, `skipped`, ...) in a ginkgo JSON report.
pub fn outcomes(report: &str) -> Result<BTreeMap<String, String>> {
    let suites: Vec<Value> = serde_json::from_str(report).context("ginkgo's report.json")?;
    let mut specs = BTreeMap::new();
    for spec in suites.iter().filter_map(|s| s["SpecReports"].as_array()).flatten() {
        if spec["LeafNodeType"] != "It" {
            continue;
        }
        let mut name: Vec<&str> =
            spec["ContainerHierarchyTexts"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        name.extend(spec["LeafNodeText"].as_str());
        // The text carries the tags ("[Conformance]"); the labels repeat them.
        let full = name.join(" ");
        let state = spec["State"].as_str().unwrap_or("unknown");
        // Interrupted, timed out and panicked count as failed.
        let state = match state {
            "passed" | "skipped" | "pending" => state,
            _ => "failed",
        };
        specs.insert(full, state.to_owned());
    }
    Ok(specs)
}

pub struct Summary {
    pub json: Value,
    pub table: String,
    /// kpr failed or skipped a spec that a kube-proxy passed (or failed any spec, run alone),
    /// [`KUBE_PROXY_MODE_SPECS`]' self-skips aside.
    pub kpr_behind: bool,
}

pub fn summarize(reports: &BTreeMap<String, BTreeMap<String, String>>) -> Summary {
    let mut table = String::from("proxy                  run  passed  failed  skipped\n");
    let mut per_proxy = serde_json::Map::new();
    for (proxy, specs) in reports {
        let count = |s: &str| specs.values().filter(|v| *v == s).count();
        let (passed, failed, skipped) = (count("passed"), count("failed"), count("skipped") + count("pending"));
        table += &format!("{proxy:<20} {:>5} {passed:>7} {failed:>7} {skipped:>8}\n", passed + failed);
        per_proxy.insert(
            proxy.clone(),
            json!({ "run": passed + failed, "passed": passed, "failed": failed, "skipped": skipped }),
        );
    }
    let mut names: Vec<&String> = reports.values().flat_map(BTreeMap::keys).collect();
    names.sort();
    names.dedup();
    let mut specs = Vec::new();
    let mut differ = Vec::new();
    let mut kpr_behind = false;
    for name in names {
        let outcome: BTreeMap<&str, &str> =
            reports.iter().map(|(proxy, s)| (proxy.as_str(), s.get(name).map_or("absent", String::as_str))).collect();
        if let Some(kpr) = outcome.get("kpr") {
            // Alone, kpr is judged by pass/fail.
            kpr_behind |= outcome.len() == 1 && *kpr == "failed";
            for (proxy, theirs) in outcome.iter().filter(|(p, _)| **p != "kpr") {
                if theirs != kpr {
                    differ.push(format!("  kpr {kpr}, {proxy} {theirs}: {name}"));
                    let mode_only = *kpr == "skipped" && KUBE_PROXY_MODE_SPECS.iter().any(|(s, _)| name.contains(s));
                    kpr_behind |= *theirs == "passed" && *kpr != "passed" && !mode_only;
                }
            }
        }
        specs.push(json!({ "name": name, "outcome": outcome }));
    }
    if !differ.is_empty() {
        table += &format!("specs whose outcome differs between kpr and a kube-proxy ({}):\n", differ.len());
        table += &differ.join("\n");
        table += "\n";
    }
    for (proxy, s) in reports {
        let failed: Vec<&String> = s.iter().filter(|(_, v)| *v == "failed").map(|(k, _)| k).collect();
        if !failed.is_empty() {
            table += &format!("failed with {proxy} ({}):\n", failed.len());
            for name in failed {
                table += &format!("  {name}\n");
            }
        }
    }
    Summary { json: json!({ "proxies": per_proxy, "specs": specs }), table, kpr_behind }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(specs: &[(&str, &str)]) -> String {
        let specs: Vec<Value> = specs
            .iter()
            .map(|(name, state)| {
                json!({ "LeafNodeType": "It", "ContainerHierarchyTexts": ["[sig-network] Services"],
                        "LeafNodeText": name, "LeafNodeLabels": ["Conformance"], "State": state })
            })
            .chain([json!({ "LeafNodeType": "SynchronizedBeforeSuite", "State": "passed" })])
            .collect();
        json!([{ "SpecReports": specs }]).to_string()
    }

    #[test]
    fn a_spec_kube_proxy_passes_and_kpr_fails_is_flagged() {
        let kpr = outcomes(&report(&[("a", "passed"), ("b", "failed"), ("c", "skipped"), ("d", "timedout")])).unwrap();
        let kube_proxy =
            outcomes(&report(&[("a", "passed"), ("b", "passed"), ("c", "skipped"), ("d", "failed")])).unwrap();
        assert_eq!(kpr.len(), 4, "only It nodes: {kpr:?}");
        assert_eq!(kpr["[sig-network] Services d"], "failed");
        let reports = BTreeMap::from([("kpr".to_owned(), kpr), ("kube-proxy-iptables".to_owned(), kube_proxy)]);
        let summary = summarize(&reports);
        assert!(summary.kpr_behind);
        assert!(
            summary.table.contains("kpr failed, kube-proxy-iptables passed: [sig-network] Services b"),
            "{}",
            summary.table
        );
        assert_eq!(summary.json["proxies"]["kpr"]["run"], 3);
        assert_eq!(summary.json["proxies"]["kpr"]["skipped"], 1);
    }

    #[test]
    fn a_skip_counts_against_kpr_unless_the_spec_checks_kube_proxys_mode() {
        let mode_spec = KUBE_PROXY_MODE_SPECS[0].0;
        let kpr = outcomes(&report(&[(mode_spec, "skipped"), ("a", "passed")])).unwrap();
        let kube_proxy = outcomes(&report(&[(mode_spec, "passed"), ("a", "passed")])).unwrap();
        let reports = BTreeMap::from([("kpr".to_owned(), kpr), ("kube-proxy-iptables".to_owned(), kube_proxy)]);
        assert!(!summarize(&reports).kpr_behind);
        let kpr = outcomes(&report(&[("a", "skipped")])).unwrap();
        let kube_proxy = outcomes(&report(&[("a", "passed")])).unwrap();
        let reports = BTreeMap::from([("kpr".to_owned(), kpr), ("kube-proxy-iptables".to_owned(), kube_proxy)]);
        assert!(summarize(&reports).kpr_behind);
    }

    #[test]
    fn the_same_outcomes_are_not_flagged() {
        let r = outcomes(&report(&[("a", "passed"), ("b", "failed")])).unwrap();
        let reports = BTreeMap::from([("kpr".to_owned(), r.clone()), ("kube-proxy-nftables".to_owned(), r)]);
        assert!(!summarize(&reports).kpr_behind);
    }

    #[test]
    fn alone_any_failure_of_kprs_counts() {
        let r = outcomes(&report(&[("a", "passed"), ("b", "failed")])).unwrap();
        assert!(summarize(&BTreeMap::from([("kpr".to_owned(), r)])).kpr_behind);
        let r = outcomes(&report(&[("a", "passed"), ("b", "skipped")])).unwrap();
        assert!(!summarize(&BTreeMap::from([("kpr".to_owned(), r)])).kpr_behind);
    }
}
