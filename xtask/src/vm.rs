//! The privileged tests on other kernels: Debian's kernel packages booted under qemu/KVM, with
//! this machine's root file system shared read-only over 9p (KVM where it works, else
//! software emulation) (the test binaries, `ip`, the
//! control-plane binaries are the host's), tmpfs where the tests write, and the tests run
//! inside. Nothing here touches the host's network: the VM has no network card.
//!
//! The kernel package is downloaded and unpacked (never installed) into the cache; a tiny
//! initramfs (busybox from Debian's `busybox-static`, the modules the tests need) mounts the
//! shared root and runs the test script in a chroot, printing to the serial console.
use std::{
    fs,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// The kernels `cargo xtask test` boots: (short name, apt package pattern, what runs there).
/// The newest matching package of the Debian release configured here is used.
///
/// 6.1 has every path this machine's kernel (6.18) lacks: netlink filters (no TCX before 6.6),
/// no kept routes (before 6.3), the old checksum helper (before 6.2). 6.12 takes the host's
/// paths, so beyond its own verifier it runs a sample (`Suite::sample`): the demo whole, and
/// a test per program, stage, family, protocol and hook.
pub const KERNELS: [(&str, &str, Lane); 2] = [
    ("6.1", r"^linux-image-6\.1\.0-[0-9]+-amd64$", Lane::Full),
    ("6.12", r"^linux-image-6\.12\.[0-9]+\+deb[0-9]+-amd64-unsigned$", Lane::Sample),
];

/// How much of each suite a kernel's VM runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Lane {
    /// What each suite's [`OnFull`] says.
    Full,
    /// Each suite's sample (all of it when it has none).
    Sample,
}

/// A privileged test suite as the VMs run it.
pub struct Suite {
    pub name: &'static str,
    /// Tests that exercise nothing that differs by kernel and that the host already runs (the
    /// agent's own logic, the CLI): skipped in the VMs, where under software emulation an agent
    /// start takes seconds.
    pub host_only: &'static [&'static str],
    /// What a [`Lane::Sample`] kernel runs; `None`: the suite less `host_only`.
    pub sample: Option<&'static [&'static str]>,
    /// What a [`Lane::Full`] kernel runs.
    pub on_full: OnFull,
}

/// What a [`Lane::Full`] kernel runs of a suite.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum OnFull {
    /// The suite less its `host_only` tests.
    AllButHostOnly,
    /// Its sample and these: what else takes a path of its own on the older kernel. Under
    /// software emulation a test that starts two agents takes about a minute, so a suite of
    /// them runs where the kernel makes a difference, not whole.
    SamplePlus(&'static [&'static str]),
}

impl OnFull {
    /// The tests a full lane runs beyond the sample.
    pub fn extra(self) -> &'static [&'static str] {
        match self {
            OnFull::SamplePlus(more) => more,
            OnFull::AllButHostOnly => &[],
        }
    }
}

/// The privileged test suites run in a VM, for what differs by kernel: the verifier's verdict
/// on every program, helpers and attach modes (netlink filters before 6.6, kept routes from
/// 6.3, the checksum helper before 6.2, `EPERM` before 5.18), the VMs' own modules (SCTP).
/// The operator surface, the image, the API-server suite and the kube-proxy differential
/// suites run on the host only.
pub const SUITES: [Suite; 5] = [
    // Every program through the verifier (each datapath setting a test asks for loads them
    // all, once per test process) and every datapath table:
    // all of it on 6.1; on 6.12 each program and stage of both families, each protocol, the
    // flow cache, eviction, ICMP errors, fragments and the redirects with their kept routes.
    Suite {
        name: "tc_testrun",
        host_only: &[],
        on_full: OnFull::AllButHostOnly,
        sample: Some(&[
            "cluster_ip_tcp_is_translated_both_ways_with_exact_checksums",
            "a_new_flow_takes_the_slow_program_and_without_it_passes_counted",
            "egress_leaves_packets_that_came_in_through_kprs_ingress_alone",
            "udp_translation_keeps_a_zero_checksum_zero",
            "node_port_with_cluster_policy_is_masqueraded_and_reversed",
            "no_endpoints_rejects_tcp_with_a_reset_and_local_policy_drops",
            "no_endpoints_rejects_udp_with_icmp_port_unreachable",
            "sctp_is_translated_both_ways_with_its_crc32c_updated",
            "icmp_errors_about_a_translated_flow_are_translated_back",
            "a_large_reply_in_fragments_is_translated_whole",
            "an_established_flows_packets_are_served_from_the_flow_cache_until_its_entry_changes",
            "a_connection_whose_entries_were_evicted_is_recreated_as_it_was",
            "translated_packets_go_straight_out_of_the_link_their_route_takes",
            "a_new_flow_keeps_the_routes_its_first_packet_and_its_answer_took",
            "ipv6_udp_is_translated_both_ways_with_exact_checksums",
            "ipv6_node_port_is_masqueraded_to_the_node_ipv6_address",
            "ipv6_without_endpoints_tcp_gets_a_reset_and_udp_icmpv6_port_unreachable",
            "ipv6_icmp_errors_about_a_translated_flow_are_translated_back",
            // The Maglev table's map (4,000-byte chunks, allocated as written) and its lookup, and
            // `kpr verify`'s probes of it.
            "a_maglev_frontend_sends_each_tuple_to_its_tables_endpoint",
        ]),
    },
    Suite {
        name: "socket_lb",
        host_only: &[
            "new_connections_spread_uniformly_over_three_backends",
            "endpoint_changes_steer_new_connections_and_keep_established_ones",
            "a_deleted_service_is_no_longer_translated_and_other_traffic_is_untouched",
            "malformed_manifests_are_skipped_and_good_services_keep_working",
            "an_agent_sharing_its_cgroup_exempts_nobody",
            "session_affinity_keeps_a_client_on_its_endpoint_until_it_leaves_or_times_out",
            // Which entries the model writes; the hooks it relies on run in the tests above.
            "host_external_ips_local_keeps_the_nodes_connections_to_other_machines",
            // Which maps an upgrade carries: the agent's; the hooks' relinking runs above.
            "an_older_layouts_maps_are_carried_and_a_changed_map_made_anew",
        ],
        // Each socket hook (connect, sendmsg/recvmsg, getpeername; both families, mapped
        // addresses), and the UDP socket abort (udp_diag). On 6.1 too: the hooks take the
        // host's paths there (`bpf_set_retval` from 5.18, cgroup links, socket lookups), and
        // every test loads every program, so 6.1's verifier still sees them all.
        on_full: OnFull::SamplePlus(&[]),
        sample: Some(&[
            "tcp_and_udp_reach_a_backend_and_the_app_sees_the_cluster_ip",
            "a_dual_stack_service_is_reached_over_both_families_and_through_mapped_addresses",
            "node_ports_are_served_per_family_and_not_on_ipv6_localhost",
            "a_connected_udp_socket_whose_endpoint_leaves_is_aborted_and_reconnects_elsewhere",
        ]),
    },
    // The agent loading and attaching every program.
    Suite { name: "demo", host_only: &[], sample: None, on_full: OnFull::AllButHostOnly },
    // The socket path's answers (`kpr_sock_ops`): which callbacks come, and when, is the
    // kernel's (RTO_CB, the state change, `segs_in`, the release hook before the close). The
    // sidelining itself is the agent's, on the host.
    Suite {
        name: "outliers",
        host_only: &[
            "an_endpoint_that_stops_answering_is_sidelined_and_comes_back_with_its_network",
            "an_endpoint_the_socket_path_finds_unanswering_is_sidelined_and_comes_back",
        ],
        sample: None,
        on_full: OnFull::AllButHostOnly,
    },
    Suite {
        name: "multinode",
        host_only: &[
            "kpr_conntrack_lists_a_node_port_flow_and_flushing_it_keeps_the_connection",
            "kpr_trace_explains_each_source_class_from_the_live_maps",
            "cleanup_waits_for_the_agent_and_undoes_what_kpr_changed_on_the_node",
            "local_traffic_policy_keeps_the_client_address_and_drops_without_local_endpoints",
            "udp_flows_move_off_a_removed_endpoint",
            // The operator's view and the upgrade's map carrying are the agent's; the host runs
            // the upgrade over both attach modes (TCX, and netlink filters as before 6.6).
            "kpr_status_tells_the_agent_its_links_maps_and_a_node_without_kpr",
            "an_upgrade_to_a_new_pin_layout_keeps_flows_affinity_and_new_connections",
            // The agent's tables and flags; their map and lookup run in tc_testrun on every kernel.
            "maglev_sends_a_tuple_to_the_same_pod_through_either_node",
        ],
        // On 6.1 besides the sample: what has a path of its own before 6.6 or in its helpers —
        // the tunnel DSR puts on and takes off in BPF (`bpf_skb_adjust_room`), the MTU check
        // (`bpf_check_mtu`), XDP on veth, a program after kpr's among netlink filters (their
        // order and `TC_ACT_UNSPEC`, where TCX has its own) and netlink filters on links made
        // after the start. The rest is the agent's logic, which the host runs (the upgrade and
        // restarts also with netlink filters).
        on_full: OnFull::SamplePlus(&[
            "dsr_lets_a_pod_on_another_node_see_the_client_and_answer_it_directly",
            "dsr_takes_a_tunnel_off_only_for_an_endpoint_of_its_frontend",
            "a_masqueraded_packet_too_big_for_its_link_gets_fragmentation_needed",
            "xdp_carries_established_node_port_flows_and_yields_to_a_forward_policy",
            "a_program_attached_after_kpr_still_sees_what_kpr_does_not_translate",
            // Netlink filters put on links made after the agent started (the host's tests of
            // that take TCX).
            "links_created_after_the_agent_started_are_covered",
        ]),
        // The per-packet path of each family through real links (redirects, FIB lookups,
        // checksums completed by the device or not), the FORWARD chain it must not skip
        // (nf_tables), SCTP, VLAN and IP-in-IP links (modules this machine's kernel lacks; 6.3+
        // is where a redirect to an IP-in-IP tunnel without a remote was lost).
        sample: Some(&[
            "node_port_reaches_a_pod_on_another_node_masqueraded",
            "ipv6_node_port_reaches_a_pod_on_another_node_masqueraded",
            "a_network_policy_in_the_forward_chain_holds_for_service_traffic",
            "node_port_checksums_verify_whoever_completes_them",
            "sctp_services_are_translated_for_pods_and_outside_clients",
            "a_node_port_on_a_vlan_address_is_served",
            "a_node_port_reaches_a_pod_over_ip_in_ip",
            // A RST from the attached program's fast path (its verifier), a TCP socket aborted
            // (tcp_diag).
            "tcp_connections_to_an_endpoint_whose_pod_is_gone_fail_at_once",
        ]),
    },
];

/// Modules loaded before the tests (with their dependencies): the 9p root, and what the tests'
/// topologies use (veth, bridge; clsact and cls_bpf for netlink tc attachments; nf_tables for
/// a node whose FORWARD chain drops, after crc32c_generic, which libcrc32c needs at init but
/// names only as a soft dependency; udp_diag and tcp_diag for aborting sockets; sctp for SCTP Services;
/// 8021q for a node address on a VLAN; ipip and tun for pods behind layer-3 tunnels, tun also
/// for a VM's TAP device).
const MODULES: [&str; 18] = [
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "veth",
    "bridge",
    "8021q",
    "sch_ingress",
    "cls_bpf",
    "crc32c_generic",
    "nf_tables",
    // A mesh sidecar's redirect in a pod (`redirect to :port` in a nat output chain).
    "nft_chain_nat",
    "nft_redir",
    // A VM's pod masquerading its guest (`masquerade` in a nat postrouting chain).
    "nft_masq",
    "udp_diag",
    "tcp_diag",
    "sctp",
    "ipip",
    "tun",
];

/// `KPR_VM_ACCEL` (`kvm`), else software emulation: this machine's `/dev/kvm` (nested) hangs
/// a guest kernel at its first instruction, while emulation boots it in seconds. One host
/// thread per emulated CPU (`thread=multi`): with one thread for both (`thread=single`) the
/// suites that start agents took 1.65 times as long.
fn accelerator() -> String {
    std::env::var("KPR_VM_ACCEL").unwrap_or_else(|_| "tcg,thread=multi".to_owned())
}

/// How long one kernel's run may take (under software emulation a run took 17-29 min on the
/// machines here).
const DEADLINE: Duration = Duration::from_secs(40 * 60);

/// A kernel unpacked in the cache.
struct Kernel {
    release: String,
    vmlinuz: PathBuf,
    modules: PathBuf,
}

fn cache_dir() -> PathBuf {
    std::env::var_os("KPR_KERNEL_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| "/root".into());
        home.join(".cache/kpr/kernels")
    })
}

/// The newest package matching `pattern` that apt knows.
fn newest_package(pattern: &str) -> Result<String> {
    let out = Command::new("apt-cache").args(["search", "--names-only", pattern]).output()?;
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    names.sort_by_key(|n| version_key(n));
    names.pop().with_context(|| format!("no Debian package matches {pattern} (apt-get update?)"))
}

/// Numbers in a package name, for ordering `6.1.0-9` before `6.1.0-10`.
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty()).filter_map(|p| p.parse().ok()).collect()
}

/// Download and unpack `package` (once) into the cache: its root directory.
fn unpacked(package: &str) -> Result<PathBuf> {
    let dir = cache_dir().join(package);
    let done = dir.join(".unpacked");
    if done.exists() {
        return Ok(dir);
    }
    println!("vm: downloading and unpacking {package} (not installed) into {}", dir.display());
    let download = cache_dir().join(".download");
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download)?;
    let ok = Command::new("apt-get").arg("download").arg(package).current_dir(&download).status()?.success()
        || (Command::new("apt-get").args(["update", "-qq"]).status()?.success()
            && Command::new("apt-get").arg("download").arg(package).current_dir(&download).status()?.success());
    if !ok {
        bail!("apt-get download {package} failed");
    }
    let deb = fs::read_dir(&download)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .context("apt-get download left no .deb")?;
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    crate::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&dir))?;
    fs::remove_dir_all(&download)?;
    fs::write(&done, "")?;
    Ok(dir)
}

fn busybox() -> Result<PathBuf> {
    Ok(unpacked("busybox-static")?.join("bin/busybox"))
}

fn kernel(pattern: &str) -> Result<Kernel> {
    let root = unpacked(&newest_package(pattern)?)?;
    let release = fs::read_dir(root.join("lib/modules"))?
        .flatten()
        .find_map(|e| e.file_name().into_string().ok())
        .context("the kernel package has no modules")?;
    let modules = root.join("lib/modules").join(&release);
    if !modules.join("modules.dep").exists() {
        crate::run(Command::new(busybox()?).arg("depmod").arg("-b").arg(&root).arg(&release))?;
    }
    let vmlinuz = root.join("boot").join(format!("vmlinuz-{release}"));
    anyhow::ensure!(vmlinuz.exists(), "no {}", vmlinuz.display());
    Ok(Kernel { release, vmlinuz, modules })
}

/// `wanted` and their dependencies, dependencies first, as paths relative to the modules
/// directory (from `modules.dep`).
fn module_order(modules: &Path, wanted: &[&str]) -> Result<Vec<String>> {
    let dep = fs::read_to_string(modules.join("modules.dep"))?;
    let table: Vec<(String, Vec<String>)> = dep
        .lines()
        .filter_map(|l| {
            let (module, deps) = l.split_once(':')?;
            Some((module.to_owned(), deps.split_whitespace().map(str::to_owned).collect()))
        })
        .collect();
    let find = |name: &str| {
        table.iter().find(|(path, _)| {
            let file = path.rsplit('/').next().unwrap_or(path);
            file.split('.').next() == Some(name) || file.split('.').next() == Some(&name.replace('_', "-"))
        })
    };
    fn visit(path: &str, table: &[(String, Vec<String>)], out: &mut Vec<String>) {
        if out.iter().any(|p| p == path) {
            return;
        }
        if let Some((_, deps)) = table.iter().find(|(p, _)| p == path) {
            for dep in deps {
                visit(dep, table, out);
            }
        }
        out.push(path.to_owned());
    }
    let mut out = Vec::new();
    for name in wanted {
        // Not found: built into this kernel.
        if let Some((path, _)) = find(name) {
            visit(path, &table, &mut out);
        }
    }
    Ok(out)
}

/// A cpio "newc" archive (what the kernel unpacks as its initramfs).
struct Cpio(Vec<u8>, u32);

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.1 += 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.1,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        self.0.extend_from_slice(header.as_bytes());
        self.0.extend_from_slice(name.as_bytes());
        self.0.push(0);
        self.pad();
        self.0.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.0.len().is_multiple_of(4) {
            self.0.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040755, &[]);
    }

    fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.entry(name, 0o100000 | mode, data);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.0
    }
}

/// PID 1 in the VM: modules, the shared root, then the test script (named on the kernel
/// command line) in a chroot; power off when it is done.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# No fallback tunl0 in each network namespace the tests make (the IP-in-IP test makes its own).
echo 1 > /proc/sys/net/core/fb_tunnels_only_for_init_net
for m in $(cat /modules.list); do insmod "/modules/$m" || echo "kpr-vm: insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144 hostroot /host || echo "kpr-vm: no shared root"
script=$(sed -n 's/.*kpr\.script=\([^ ]*\).*/\1/p' /proc/cmdline)
chroot /host /bin/sh "$script"
echo "kpr-vm: script exited $?"
poweroff -f
"#;

fn initramfs(kernel: &Kernel, path: &Path) -> Result<()> {
    let mut cpio = Cpio(Vec::new(), 0);
    for dir in ["bin", "proc", "sys", "dev", "host", "modules"] {
        cpio.dir(dir);
    }
    cpio.file("init", 0o755, INIT.as_bytes());
    cpio.file("bin/busybox", 0o755, &fs::read(busybox()?)?);
    let mut list = Vec::new();
    for (i, module) in module_order(&kernel.modules, &MODULES)?.iter().enumerate() {
        let file = kernel.modules.join(module);
        let data = if module.ends_with(".xz") {
            let out = Command::new("xz").arg("-dc").arg(&file).output()?;
            anyhow::ensure!(out.status.success(), "xz -d {} failed", file.display());
            out.stdout
        } else {
            fs::read(&file)?
        };
        let name = format!("{i:02}.ko");
        cpio.file(&format!("modules/{name}"), 0o644, &data);
        list.push(name);
    }
    cpio.file("modules.list", 0o644, (list.join("\n") + "\n").as_bytes());
    fs::write(path, cpio.finish())?;
    Ok(())
}

/// What runs inside the VM (in the chroot of the shared root): the mounts the tests need, then
/// every suite, one test at a time. The tests write under a tmpfs on /run (TMPDIR): /tmp stays
/// the shared one, where the checkout and this script may live. The tests' waits for the agent
/// are stretched 16 times: emulated and on a loaded machine, an agent once took over 16 s to
/// attach its hooks.
///
/// Before the tests, a memory cgroup is made and kept: the first one switches kernel code on
/// (memcg's static keys, one of them in every `kmem_cache_alloc`), and under qemu's
/// multi-threaded emulation a CPU allocating while another patched ran a stale copy (6.12:
/// "Oops: int3" in `kmem_cache_alloc_noprof` as the first container started). Here nothing
/// else runs yet; kept, the keys are never switched back and forth again.
fn test_script(binaries: &[(PathBuf, &Suite)], lane: Lane, env: &[(&str, String)], filter: Option<&str>) -> String {
    let mut s = String::from(
        "set -u\n\
         mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev\n\
         mount -t tmpfs tmpfs /run; mkdir -p /run/netns /run/tmp /run/home\n\
         mount -t bpf bpf /sys/fs/bpf; mount -t cgroup2 cgroup2 /sys/fs/cgroup\n\
         ip link set lo up\n\
         echo +memory > /sys/fs/cgroup/cgroup.subtree_control; mkdir /sys/fs/cgroup/vm-warm-up\n\
         echo \"kpr-vm: kernel $(uname -r)\"\n\
         export TMPDIR=/run/tmp HOME=/run/home NO_COLOR=1 RUST_BACKTRACE=0 KPR_TEST_TIME_SCALE=16\n",
    );
    for (key, value) in env {
        s.push_str(&format!("export {key}='{value}'\n"));
    }
    let quoted = |tests: &[&str], flag: &str| tests.iter().map(|t| format!(" {flag}'{t}'")).collect::<String>();
    for (binary, suite) in binaries {
        // A filter runs what it names; without one, the lane's part of the suite.
        let select = match (filter, lane, suite.sample, suite.on_full) {
            (Some(f), ..) => format!(" '{f}'"),
            (None, Lane::Sample, Some(sample), _) => format!(" --exact{}", quoted(sample, "")),
            (None, Lane::Full, sample, OnFull::SamplePlus(more)) => {
                format!(" --exact{}{}", quoted(sample.unwrap_or_default(), ""), quoted(more, ""))
            }
            (None, ..) if suite.host_only.is_empty() => String::new(),
            (None, ..) => format!(" --exact{}", quoted(suite.host_only, "--skip ")),
        };
        s.push_str(&format!("'{}' --test-threads=1 --color never{select}\n", binary.display()));
    }
    s
}

/// Boot each of `shorts` (e.g. `6.1`) in turn and run the privileged suites in it: per kernel,
/// in order, (uname -r, passed, failed) or why it gave none.
///
/// A VM whose kernel crashed before every suite reported is booted once more for the suites it
/// did not finish: under emulation a 6.12 guest once died of qemu's, not kpr's, fault (see
/// [`test_script`]). What finished counts as it reported; a second crash, a VM out of time or
/// a suite that never reported (a binary the VM cannot see) is an error.
pub fn run_tests(
    shorts: &[&str],
    binaries: &[(PathBuf, &Suite)],
    env: &[(&str, String)],
    filter: Option<&str>,
) -> Result<Vec<Result<(String, u64, u64)>>> {
    let mut results = Vec::new();
    for &short in shorts {
        let Some(&(_, pattern, lane)) = KERNELS.iter().find(|(k, ..)| *k == short) else {
            bail!("--kernel {short}: one of {}", KERNELS.map(|(k, ..)| k).join(", "));
        };
        let kernel = kernel(pattern)?;
        let work = std::env::temp_dir().join(format!("kpr-vm-{short}-{}", std::process::id()));
        fs::create_dir_all(&work)?;
        initramfs(&kernel, &work.join("initramfs.cpio"))?;
        results.push(run_suites(&kernel, &work, short, lane, binaries, env, filter));
        let _ = fs::remove_dir_all(&work);
    }
    Ok(results)
}

/// Run the test suites in a VM of `kernel`: passed and failed counts, and the kernel's release.
/// A VM whose kernel crashed before every suite reported is booted once more for the rest.
fn run_suites(
    kernel: &Kernel,
    work: &Path,
    short: &str,
    lane: Lane,
    binaries: &[(PathBuf, &Suite)],
    env: &[(&str, String)],
    filter: Option<&str>,
) -> Result<(String, u64, u64)> {
    let (mut passed, mut failed, mut done, mut booted_again) = (0, 0, 0, false);
    loop {
        fs::write(work.join("run.sh"), test_script(&binaries[done..], lane, env, filter))?;
        let run = boot(kernel, work, short)?;
        passed += run.passed;
        failed += run.failed;
        done += run.suites;
        if done >= binaries.len() {
            return Ok((run.release, passed, failed));
        }
        let why = if run.release.is_empty() {
            "never ran the tests".to_owned()
        } else {
            format!("stopped after {done} of {} test suites", binaries.len())
        };
        let why = match &run.crash {
            Some(crash) => format!("{why}: its kernel crashed ({crash})"),
            None => why,
        };
        if booted_again || run.crash.is_none() {
            bail!("the {short} VM {why} (see its console above)");
        }
        println!("xtask: the {short} VM {why}; booting it again for the suites it did not finish");
        booted_again = true;
    }
}

/// What one boot of a VM reported.
struct Run {
    /// `uname -r` (empty: the tests never started).
    release: String,
    passed: u64,
    failed: u64,
    /// Suites that reported, in the script's order.
    suites: usize,
    /// The console's first line of a kernel crash (`Oops: ...`, `Kernel panic ...`).
    crash: Option<String>,
}

/// Boot `kernel` with the initramfs and test script `work` holds and follow its console until
/// it powers off.
fn boot(kernel: &Kernel, work: &Path, short: &str) -> Result<Run> {
    let initrd = work.join("initramfs.cpio");
    let script = work.join("run.sh");
    println!("vm: booting {} ({short}) under qemu ({}); the suites run inside", kernel.release, accelerator());
    let mut qemu = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            &accelerator(),
            // The plain x86-64 model: under emulation the guest's code then avoids the vector
            // and bit-manipulation extensions `max` offers, which qemu emulates slowly (two
            // multinode tests on 6.1: 79 s with `max`, 55 s with `Nehalem`, 51 s with this).
            "-cpu",
            "qemu64",
            "-m",
            "4096",
            "-smp",
            "2",
            "-nographic",
            "-no-reboot",
            "-nic",
            "none",
        ])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .arg("-append")
        .arg(format!("console=ttyS0 panic=-1 quiet kpr.script={}", script.display()))
        .args(["-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("failed to start qemu-system-x86_64")?;
    let stdout = qemu.stdout.take().expect("piped");
    let pid = qemu.id();
    // A hung VM must not hang the run: killed (by its pid) at the deadline.
    let watchdog = std::thread::spawn(move || {
        let started = Instant::now();
        while started.elapsed() < DEADLINE {
            std::thread::sleep(Duration::from_secs(1));
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return;
            }
        }
        let _ = Command::new("kill").arg(pid.to_string()).status();
    });
    let mut run = Run { release: String::new(), passed: 0, failed: 0, suites: 0, crash: None };
    let mut out = std::io::stdout();
    let booted = Instant::now();
    for line in BufReader::new(stdout).lines() {
        let line = line?.replace('\r', "");
        // The minutes and seconds since boot: where a lane's time goes, read from CI's log.
        let at = booted.elapsed().as_secs();
        let _ = writeln!(out, "vm {short} {:02}:{:02}: {line}", at / 60, at % 60);
        // The console's first line carries terminal escapes before the text.
        if let Some((_, r)) = line.split_once("kpr-vm: kernel ") {
            run.release = r.trim().to_owned();
        }
        if let Some((p, f)) = crate::test_result(&line) {
            run.passed += p;
            run.failed += f;
            run.suites += 1;
        }
        if run.crash.is_none() && (line.contains("] Oops: ") || line.contains("] Kernel panic")) {
            run.crash = line.split_once("] ").map(|(_, what)| what.to_owned());
        }
    }
    qemu.wait()?;
    let _ = watchdog.join();
    Ok(run)
}

#[cfg(test)]
mod tests {
    #[test]
    fn package_versions_order_numerically() {
        let mut names = ["linux-image-6.1.0-9-amd64", "linux-image-6.1.0-56-amd64", "linux-image-6.1.0-10-amd64"];
        names.sort_by_key(|n| super::version_key(n));
        assert_eq!(names.last(), Some(&"linux-image-6.1.0-56-amd64"));
    }

    #[test]
    fn a_sample_lane_runs_the_sample_and_a_full_lane_skips_the_host_only_tests() {
        use super::{Lane, SUITES};
        let binaries: Vec<_> = SUITES.iter().map(|s| (std::path::PathBuf::from(format!("/t/{}", s.name)), s)).collect();
        let full = super::test_script(&binaries, Lane::Full, &[], None);
        let sample = super::test_script(&binaries, Lane::Sample, &[], None);
        let line = |script: &str, suite: &str| {
            script.lines().find(|l| l.starts_with(&format!("'/t/{suite}'"))).unwrap().to_owned()
        };
        assert!(line(&full, "tc_testrun").ends_with("--color never"));
        assert!(line(&sample, "demo").ends_with("--color never"));
        assert!(line(&sample, "tc_testrun").contains(" --exact 'cluster_ip_tcp_is_translated_both_ways"));
        let full_multinode = line(&full, "multinode");
        assert!(full_multinode.contains(" 'node_port_reaches_a_pod_on_another_node_masqueraded'"), "the sample");
        assert!(full_multinode.contains(" 'dsr_takes_a_tunnel_off_only_for_an_endpoint_of_its_frontend'"), "and more");
        assert!(!full_multinode.contains("udp_flows_move_off_a_removed_endpoint"));
        assert!(line(&full, "outliers").contains("--skip 'an_endpoint_that_stops_answering"));
        assert_eq!(line(&full, "socket_lb"), line(&sample, "socket_lb"), "socket_lb's sample on every kernel");
        assert!(line(&full, "socket_lb").contains(" --exact 'tcp_and_udp_reach_a_backend"));
        let sampled = line(&sample, "multinode");
        assert!(sampled.contains(" --exact 'node_port_reaches_a_pod_on_another_node_masqueraded'"));
        assert!(!sampled.contains("--skip"));
        // A sample never names a test the VMs skip.
        for suite in &SUITES {
            for test in suite.sample.unwrap_or_default().iter().chain(suite.on_full.extra()) {
                assert!(!suite.host_only.contains(test), "{test}");
            }
            // Without a sample, `SamplePlus(&[])` would be a bare `--exact`: the whole suite.
            if matches!(suite.on_full, super::OnFull::SamplePlus(_)) {
                assert!(suite.sample.is_some(), "{}: SamplePlus needs a sample", suite.name);
            }
        }
        let filtered = super::test_script(&binaries, Lane::Sample, &[], Some("sctp"));
        assert!(line(&filtered, "multinode").ends_with("--color never 'sctp'"));
    }

    #[test]
    fn cpio_entries_are_aligned_and_terminated() {
        let mut cpio = super::Cpio(Vec::new(), 0);
        cpio.file("init", 0o755, b"#!/bin/sh\n");
        let bytes = cpio.finish();
        assert!(bytes.starts_with(b"070701"));
        assert_eq!(bytes.len() % 4, 0);
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("init\0") && text.contains("TRAILER!!!\0"));
    }
}
