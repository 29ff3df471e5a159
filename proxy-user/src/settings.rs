//! The agent's settings: its command line (kpr's flags, and kube-proxy's own as a DaemonSet
//! copied from kube-proxy carries them), the configuration file under them, and the
//! [`AgentConfig`] that follows from both.
use std::{net::IpAddr, path::PathBuf, time::Duration};

use anyhow::{Result, bail};
use proxy_common::defaults;

use crate::{
    agent::{AgentConfig, SourceConfig},
    config::{FlagOverrides, ProxyConfig},
    datapath::bpf::{self, DatapathConfig, ForwardDirect},
    model::{
        ProxyOptions,
        node::{DetectLocal, NodeSettings, TcLinks},
    },
};

/// The agent's first log line, as kube-proxy's "Version info": what runs, on what kernel,
/// attached how, on which pin layout.
pub fn log_startup(tc_netlink: bool, pin_root: &std::path::Path) {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let tcx = !tc_netlink && bpf::kernel_since(6, 6);
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        commit = env!("KPR_GIT_COMMIT"),
        kernel = kernel.trim(),
        per_packet_attach = if tcx { "tcx" } else { "netlink" },
        pin_dir = %bpf::pin_dir(pin_root).display(),
        "kpr agent starting"
    );
}

/// A Go duration (`30s`, `1m30s`), as kube-proxy's flags take them.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    crate::config::go_duration::parse(s)
}

/// `--host-external-ips`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HostExternalIps {
    All,
    Local,
}

/// A feature switched on or off.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
}

/// Whose sockets the socket path translates at `connect()`/`sendmsg()`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SocketLb {
    /// The node's and every pod's.
    All,
    /// The node's only: pods' connections keep the Service's address until their packets
    /// reach the node, where the per-packet path translates them, as kube-proxy does.
    HostOnly,
}

/// How new flows from outside to external frontends pick their endpoint (`--lb-algorithm`).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LbAlgorithm {
    /// As kube-proxy: a random endpoint.
    Random,
    /// By Maglev consistent hashing: the same endpoint for a tuple on every node.
    Maglev,
}

/// How new flows from outside to external frontends with traffic policy Cluster reach an
/// endpoint on another node (`--lb-mode`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum LbMode {
    /// As kube-proxy: masqueraded to the node, the replies back through it.
    Snat,
    /// Direct server return: the client's packets in IP-in-IP to the endpoint's node, which
    /// answers the client itself; the endpoint sees the client's address.
    Dsr,
    /// Direct server return for TCP, masquerade for UDP and SCTP.
    Hybrid,
}

#[derive(clap::Args)]
pub struct AgentArgs {
    /// kube-proxy's configuration file (a `KubeProxyConfiguration`, as in kubeadm's
    /// `kube-system/kube-proxy` ConfigMap). Flags given explicitly override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Read Services, EndpointSlices and this node's Node from this directory of manifests
    /// instead of the API.
    #[arg(long, conflicts_with = "kubeconfig")]
    pub manifests: Option<PathBuf>,
    /// Kubeconfig of the cluster [default: the file's clientConnection.kubeconfig, else the
    /// in-cluster config or KUBECONFIG].
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The API server's address, overriding the kubeconfig's (kube-proxy's --master). In a
    /// pod without a kubeconfig, give this or a kubeconfig: the in-cluster address is the
    /// `kubernetes` Service, which kpr itself has to program first.
    #[arg(long)]
    pub master: Option<String>,
    /// Attach the per-packet programs as netlink tc filters (priority 1000) even where TCX
    /// exists; kernels before 6.6 always do.
    #[arg(long)]
    pub tc_netlink: bool,
    /// When packets the per-packet path translated on their way in are sent straight out of
    /// their link, skipping the host's forwarding path (netfilter's FORWARD chain, routing):
    /// `auto` only while nothing filters forwarded packets there (no rule or drop policy on
    /// the forward hook, checked every second), so that a NetworkPolicy enforced in FORWARD
    /// (Calico iptables, kube-router, kube-network-policies) holds for Service traffic as it
    /// does behind kube-proxy; `always` skips it even then; `never` never does.
    #[arg(long, value_enum, default_value_t = ForwardDirect::Auto)]
    pub forward_direct: ForwardDirect,
    /// XDP in front of the tc programs on the node's external links (those holding its
    /// primary addresses): the packets of established NodePort, externalIP and LoadBalancer
    /// flows whose route leaves by the link they came in on (to an endpoint on another node,
    /// and the replies) are translated and sent back out by the driver, before the kernel
    /// makes an skb of them; everything else goes on to tc. `native`: the driver's XDP (a
    /// link without it stays on tc); `best-effort`: the driver's, else generic XDP. Sends
    /// nothing straight out where `--forward-direct` does not.
    #[arg(long, value_enum, default_value_t = bpf::XdpSetting::Off)]
    pub xdp: bpf::XdpSetting,
    /// Connections the node's own processes make to a Service's externalIP or LoadBalancer IP:
    /// `all` translates them to its endpoints whatever the address, as kube-proxy does (a
    /// Service can then take over the node's traffic to any address, CVE-2020-8554; kpr's own
    /// connections are exempt); `local` only where the address is one of the node's own, as
    /// Cilium's socket load balancer does. Pods and outside clients are served either way.
    #[arg(long, value_enum, default_value_t = HostExternalIps::All)]
    pub host_external_ips: HostExternalIps,
    /// End the TCP connections to an endpoint that died: one that left its Service's
    /// EndpointSlices (its pod is gone), or whose Node is NotReady (unless it is serving
    /// while terminating: a graceful drain). The node's sockets connected to it through the
    /// socket path are aborted (ECONNABORTED), and the next segment of a per-packet flow to it
    /// is answered with a RST (ECONNRESET), instead of the client retransmitting for up to
    /// 15 minutes (`tcp_retries2`). Off: kube-proxy's behaviour, TCP flows are never ended.
    /// On, the agent also watches every Node's readiness.
    #[arg(long)]
    pub abort_dead_tcp: bool,
    /// How new flows from outside to a NodePort, externalIP or LoadBalancer IP pick their
    /// endpoint (per packet): `random`, as kube-proxy; `maglev`, by a Maglev table
    /// (`--maglev-table-size`) and a hash of the tuple seeded alike on every node, so that
    /// every node with the same endpoints sends a tuple to the same one (a flow an ECMP router
    /// moves to another node keeps it, where that node can serve it: see the docs). A Service's `kpr.io/lb-algorithm: maglev|random`
    /// wins. ClusterIPs and the socket path keep random picks.
    #[arg(long, value_enum, default_value_t = LbAlgorithm::Random)]
    pub lb_algorithm: LbAlgorithm,
    /// How a new flow from outside to a NodePort, externalIP or LoadBalancer IP with
    /// externalTrafficPolicy Cluster reaches an endpoint on another node: `snat`, as
    /// kube-proxy (masqueraded, the replies back through this node); `dsr`, direct server
    /// return (the endpoint sees the client's address and its node answers the client, from
    /// the frontend's address; every node runs kpr with the same setting); `hybrid`, DSR for
    /// TCP and SNAT for the rest. A Service's `kpr.io/lb-mode: snat|dsr|hybrid` wins.
    #[arg(long, value_enum, default_value_t = LbMode::Snat)]
    pub lb_mode: LbMode,
    /// The seed of the Maglev tables and tuple hash: the same on every node (the DaemonSet's
    /// arguments).
    #[arg(long, default_value_t = bpf::DEFAULT_MAGLEV_SEED)]
    pub maglev_seed: u32,
    /// Slots of every Maglev table: a prime from 251 to 131,071, the same on every node. The
    /// default, 16,381, gives 100 slots per endpoint up to 163 endpoints; 65,537 up to 655.
    /// A table takes about 2 bytes a slot per frontend and family.
    #[arg(long, default_value_t = proxy_common::MAGLEV_DEFAULT_TABLE_SIZE,
          value_parser = |s: &str| s.parse::<u32>().map_err(|e| e.to_string()).and_then(crate::model::maglev::check_table_size))]
    pub maglev_table_size: u32,
    /// How often the datapath checks itself: a synthetic new connection per frontend and
    /// source class through the live per-packet programs (`BPF_PROG_TEST_RUN`, no flow left
    /// behind), compared with the model; a mismatch is logged, counted
    /// (`kpr_datapath_verify_failures`) and resynced. `0s`: only on demand (`kpr verify`).
    #[arg(long, value_parser = parse_duration, default_value = "5m")]
    pub verify_period: Duration,
    /// Passive outlier detection for every Service (`on`), or only those annotated
    /// `kpr.io/outlier-detection: "on"` (`off`; an annotation `"off"` wins over `on`): an
    /// endpoint that leaves `--outlier-failures` new flows unanswered (or refused) within
    /// `--outlier-window`, answering fewer than failed in between, is left out of new
    /// connections for `--outlier-backoff` (doubled each time it fails again on return, up to
    /// `--outlier-max-backoff`), never all of a Service's endpoints. A UDP Service whose
    /// clients expect no answer (syslog) must not take part. Off by default: kube-proxy's
    /// backends.
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    pub outlier_detection: Switch,
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub outlier_window: Duration,
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub outlier_failures: u32,
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub outlier_backoff: Duration,
    #[arg(long, value_parser = parse_duration, default_value = "5m")]
    pub outlier_max_backoff: Duration,
    /// Whose sockets are translated at `connect()`: `all` (the node's and pods'), or
    /// `host-only` (the node's): pods' traffic is then translated per packet on their links,
    /// with the same semantics, so that what runs inside a pod before its packets leave it (a
    /// service mesh's sidecar redirect reading `SO_ORIGINAL_DST`, a VM's or sandbox's own
    /// kernel) sees the Service's address, as behind kube-proxy. `host-only` needs every link
    /// covered (no `--interfaces`) and a kernel that tells network namespaces apart (5.14+).
    #[arg(long, value_enum, default_value_t = SocketLb::All)]
    pub socket_lb: SocketLb,
    /// Serve only the Services labelled `service.kubernetes.io/service-proxy-name=NAME` (and
    /// their EndpointSlices, which carry the Service's labels), and leave every other Service
    /// to the kube-proxy running beside kpr, which skips labelled ones: Services move to kpr one
    /// at a time, and back by removing the label. The service range is then not refused (its
    /// other addresses are kube-proxy's). Give kpr other health and metrics ports than
    /// kube-proxy's.
    #[arg(long, value_name = "NAME", conflicts_with = "cleanup_kube_proxy")]
    pub service_proxy_name: Option<String>,
    /// The same as `--forward-direct never` (kept for earlier command lines).
    #[arg(long)]
    pub host_routing: bool,
    /// `mode: iptables`: leave packets to the service range that no service port takes to the
    /// routing table, as kube-proxy's iptables mode does. By default kpr refuses them as its
    /// nftables mode does (an unknown port of a ClusterIP rejected, an unallocated address
    /// dropped) instead of letting them leave the node.
    #[arg(long)]
    pub pass_service_range: bool,
    /// Take the node over from kube-proxy: once every Service is programmed, leave the flows
    /// kube-proxy translated to netfilter's conntrack and remove kube-proxy's iptables chains
    /// and nftables tables (as `kube-proxy --cleanup` does). Needs iptables-save/-restore and
    /// nft on PATH for the backends in use.
    #[arg(long)]
    pub cleanup_kube_proxy: bool,
    /// Shadow mode: load and attach nothing, change nothing on the node, and compare what kpr
    /// would do with each Service's connections (per frontend and source: endpoints,
    /// masquerade, reject or drop, affinity, source ranges) with what the kube-proxy running
    /// on the node does, read from its iptables or nftables rules. Mismatches are logged,
    /// counted in `kpr_shadow_mismatches{namespace,service}` and listed by `kpr shadow report`.
    /// Give kpr other health and metrics ports than kube-proxy's.
    #[arg(long, conflicts_with = "cleanup_kube_proxy")]
    pub shadow: bool,
    /// cgroup2 directory whose sockets are load-balanced [default: the cgroup2 root].
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    /// bpffs directory for kpr's pinned maps and links (a layout version is appended).
    #[arg(long, default_value = "/sys/fs/bpf/kpr")]
    pub pin_root: PathBuf,
    /// This node's name (endpoint locality, the Node to watch) [default: the file's
    /// hostnameOverride, else NODE_NAME, else the host name].
    #[arg(long = "hostname-override", alias = "node-name")]
    pub hostname_override: Option<String>,
    /// Entries of the service map (a ClusterIP's port takes one per source class); fixed
    /// once pinned.
    #[arg(long, default_value_t = defaults::MAX_SERVICE_PORTS)]
    pub max_service_ports: u32,
    /// Slots of the backend array (each service port's endpoints, contiguous); fixed once pinned.
    #[arg(long, default_value_t = defaults::MAX_BACKENDS)]
    pub max_backends: u32,
    /// Entries of the socket path's reverse-translation and datagram-pick maps (LRU).
    #[arg(long, default_value_t = defaults::MAX_SOCK_REVNAT)]
    pub max_sock_revnat: u32,
    /// Reverse-translation entries the sockets of one network namespace (a pod, or the node)
    /// may hold; beyond them its new connections are served per packet. 0: a sixteenth of
    /// --max-sock-revnat.
    #[arg(long, default_value_t = 0)]
    pub max_sock_revnat_per_pod: u32,
    /// Entries of the loadBalancerSourceRanges map (one per range per LoadBalancer IP
    /// frontend); a Service whose ranges do not fit is left as it was, and the others are
    /// programmed.
    #[arg(long, default_value_t = defaults::MAX_SOURCE_RANGES)]
    pub max_source_ranges: u32,
    /// Count new flows, connects, unanswered flows, packets and bytes per endpoint too
    /// (`kpr_endpoint_*`), for at most this many endpoints (each takes 40 bytes per possible
    /// CPU); the others are counted per Service port only. 0: off.
    #[arg(long, default_value_t = 0)]
    pub endpoint_counters: u32,
    /// Per-packet conntrack entries (two per flow through NodePort/external frontends) of each
    /// family's table of established flows.
    #[arg(long, default_value_t = defaults::MAX_CONNTRACK)]
    pub max_conntrack: u32,
    /// The same, of each family's table of flows not answered yet.
    #[arg(long, default_value_t = defaults::MAX_CONNTRACK_NEW)]
    pub max_conntrack_new: u32,
    /// Where the kernel's conntrack sysctls are written from kube-proxy's `conntrack.*`
    /// settings, as kube-proxy writes them (a container's /proc/sys is read-only: the
    /// DaemonSet mounts the node's `/proc/sys/net/netfilter` here).
    #[arg(long, default_value = "/proc/sys/net/netfilter")]
    pub netfilter_sysctl_dir: PathBuf,
    /// Restrict the per-packet datapath to these interfaces (comma-separated), or `none` to
    /// turn it off [default: every interface but loopback, including ones created later].
    #[arg(long, value_delimiter = ',')]
    pub interfaces: Vec<String>,
    /// Addresses that are this node's (NodePorts, "from the node") even if no interface holds
    /// them; the first is the primary address (masquerade fallback, `primary` NodePorts).
    #[arg(long = "node-ip")]
    pub node_ips: Vec<IpAddr>,
    /// The pods' range(s), comma-separated (kube-proxy's --cluster-cidr).
    #[arg(long)]
    pub cluster_cidr: Option<String>,
    /// ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix.
    #[arg(long)]
    pub detect_local_mode: Option<String>,
    /// detectLocalMode BridgeInterface: the bridge whose traffic is the pods' (kube-proxy's flag).
    #[arg(long)]
    pub pod_bridge_interface: Option<String>,
    /// detectLocalMode InterfaceNamePrefix: the prefix of the pods' links (kube-proxy's flag).
    #[arg(long)]
    pub pod_interface_name_prefix: Option<String>,
    /// CIDRs (or `primary`) of the addresses NodePorts are served on.
    #[arg(long = "nodeport-addresses", value_delimiter = ',')]
    pub nodeport_addresses: Option<Vec<String>>,
    /// Masquerade all traffic to ClusterIPs.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub masquerade_all: Option<bool>,
    /// Serve NodePorts on 127.0.0.0/8 to the node's own sockets.
    #[arg(long = "iptables-localhost-nodeports")]
    pub localhost_nodeports: Option<bool>,
    /// The node's primary address (kube-proxy's --bind-address).
    #[arg(long)]
    pub bind_address: Option<IpAddr>,
    /// Full reconcile interval (Go duration, e.g. 30s).
    #[arg(long = "iptables-sync-period", value_parser = parse_duration)]
    pub sync_period: Option<Duration>,
    /// Least time between two syncs (Go duration, e.g. 1s; 0s: none).
    #[arg(long = "iptables-min-sync-period", value_parser = parse_duration)]
    pub min_sync_period: Option<Duration>,
    /// Seconds between full reconciles (older spelling of --iptables-sync-period).
    #[arg(long)]
    pub reconcile_interval: Option<u64>,
    /// kube-proxy's metrics server: IP:port, or an IP (port 10249); empty: off.
    #[arg(long)]
    pub metrics_bind_address: Option<String>,
    /// kube-proxy's healthz server: IP:port, or an IP (port 10256); empty: off.
    #[arg(long)]
    pub healthz_bind_address: Option<String>,
    #[command(flatten)]
    pub kube_proxy: KubeProxyFlags,
    #[command(flatten)]
    pub ignored: IgnoredFlags,
}

/// kube-proxy's own flags that kpr maps onto its settings, so that a DaemonSet copied from
/// kube-proxy's starts as it is (kube-proxy's names, Go's `--flag=value` and bare booleans).
#[derive(clap::Args, Clone, Debug, Default)]
#[command(next_help_heading = "kube-proxy's flags")]
pub struct KubeProxyFlags {
    /// Log verbosity as kube-proxy's: up to 2 (kube-proxy's usual) info, 3-4 debug, 5 and
    /// more trace. `RUST_LOG`, when set, decides instead.
    #[arg(long = "v", short = 'v')]
    pub verbosity: Option<u8>,
    /// The configuration file's `mode`: iptables, nftables or ipvs (iptables' behaviour). kpr
    /// has one datapath; the mode picks kube-proxy's defaults for it and whether the service
    /// range is refused (nftables) [default: the file's, else iptables].
    #[arg(long)]
    pub proxy_mode: Option<String>,
    /// Remove kpr's pins and undo what it changed on the node, then exit (as `kpr cleanup`).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub cleanup: Option<bool>,
    /// Write the kernel's conntrack settings (`conntrack.*`), then exit.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub init_only: Option<bool>,
    /// The file's `oomScoreAdj`: the agent's /proc/self/oom_score_adj (kube-proxy's default
    /// is -999; kpr's datapath outlives the agent, so kpr leaves it alone unless told).
    #[arg(long, allow_negative_numbers = true)]
    pub oom_score_adj: Option<i32>,
    /// The file's `conntrack.maxPerCore`.
    #[arg(long)]
    pub conntrack_max_per_core: Option<i32>,
    /// The file's `conntrack.min`.
    #[arg(long)]
    pub conntrack_min: Option<i32>,
    /// The file's `conntrack.tcpEstablishedTimeout`.
    #[arg(long, value_parser = parse_duration)]
    pub conntrack_tcp_timeout_established: Option<Duration>,
    /// The file's `conntrack.tcpCloseWaitTimeout`.
    #[arg(long, value_parser = parse_duration)]
    pub conntrack_tcp_timeout_close_wait: Option<Duration>,
    /// The file's `conntrack.tcpBeLiberal`.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub conntrack_tcp_be_liberal: Option<bool>,
    /// The file's `conntrack.udpTimeout`.
    #[arg(long, value_parser = parse_duration)]
    pub conntrack_udp_timeout: Option<Duration>,
    /// The file's `conntrack.udpStreamTimeout`.
    #[arg(long, value_parser = parse_duration)]
    pub conntrack_udp_timeout_stream: Option<Duration>,
    /// The port of the healthz server's address (deprecated in kube-proxy; 0: off).
    #[arg(long)]
    pub healthz_port: Option<u16>,
    /// The port of the metrics server's address (deprecated in kube-proxy; 0: off).
    #[arg(long)]
    pub metrics_port: Option<u16>,
}

impl KubeProxyFlags {
    /// The log filter `--v` asks for.
    pub fn log_filter(&self) -> &'static str {
        match self.verbosity.unwrap_or(0) {
            0..=2 => "info",
            3..=4 => "debug",
            _ => "trace",
        }
    }
}

/// kube-proxy flags with no meaning for kpr, each accepted (with or without a value) and
/// named in one warning at start.
macro_rules! ignored_flags {
    ($($field:ident = $flag:literal),* $(,)?) => {
        #[derive(clap::Args, Clone, Debug, Default)]
        #[command(next_help_heading = "kube-proxy's flags that kpr accepts and ignores")]
        pub struct IgnoredFlags {
            $(
                #[arg(long = $flag, num_args = 0..=1, default_missing_value = "true", value_name = "VALUE",
                      help = concat!("kube-proxy's --", $flag, ": no effect in kpr"))]
                $field: Option<String>,
            )*
        }

        impl IgnoredFlags {
            /// The flags given, as `--name`.
            pub fn given(&self) -> Vec<&'static str> {
                let mut given = Vec::new();
                $(if self.$field.is_some() {
                    given.push(concat!("--", $flag));
                })*
                given
            }
        }
    };
}

ignored_flags! {
    feature_gates = "feature-gates",
    kube_api_content_type = "kube-api-content-type",
    kube_api_qps = "kube-api-qps",
    kube_api_burst = "kube-api-burst",
    bind_address_hard_fail = "bind-address-hard-fail",
    profiling = "profiling",
    show_hidden_metrics_for_version = "show-hidden-metrics-for-version",
    iptables_masquerade_bit = "iptables-masquerade-bit",
    ipvs_sync_period = "ipvs-sync-period",
    ipvs_min_sync_period = "ipvs-min-sync-period",
    ipvs_scheduler = "ipvs-scheduler",
    ipvs_exclude_cidrs = "ipvs-exclude-cidrs",
    ipvs_strict_arp = "ipvs-strict-arp",
    ipvs_tcp_timeout = "ipvs-tcp-timeout",
    ipvs_tcpfin_timeout = "ipvs-tcpfin-timeout",
    ipvs_udp_timeout = "ipvs-udp-timeout",
    config_sync_period = "config-sync-period",
    vmodule = "vmodule",
    log_flush_frequency = "log-flush-frequency",
    log_text_split_stream = "log-text-split-stream",
    log_text_info_buffer_size = "log-text-info-buffer-size",
    log_json_split_stream = "log-json-split-stream",
    log_json_info_buffer_size = "log-json-info-buffer-size",
}

/// The configuration file (or kube-proxy's defaults), then the flags given on top.
pub fn effective_config(args: &AgentArgs) -> Result<ProxyConfig> {
    let ignored = args.ignored.given();
    if !ignored.is_empty() {
        tracing::warn!(flags = ?ignored, "kube-proxy flags accepted but without effect in kpr");
    }
    let kp = &args.kube_proxy;
    let mut config = ProxyConfig::load(args.config.as_deref(), kp.proxy_mode.as_deref())?;
    config.apply_flags(&FlagOverrides {
        hostname_override: args.hostname_override.clone(),
        cluster_cidr: args.cluster_cidr.clone(),
        detect_local_mode: args.detect_local_mode.clone(),
        pod_bridge_interface: args.pod_bridge_interface.clone(),
        pod_interface_name_prefix: args.pod_interface_name_prefix.clone(),
        node_port_addresses: args.nodeport_addresses.clone(),
        masquerade_all: args.masquerade_all,
        localhost_node_ports: args.localhost_nodeports,
        bind_address: args.bind_address,
        sync_period: args.sync_period.or(args.reconcile_interval.map(Duration::from_secs)),
        min_sync_period: args.min_sync_period,
        kubeconfig: args.kubeconfig.clone(),
        metrics_bind_address: args.metrics_bind_address.clone(),
        healthz_bind_address: args.healthz_bind_address.clone(),
        conntrack_max_per_core: kp.conntrack_max_per_core,
        conntrack_min: kp.conntrack_min,
        conntrack_tcp_established: kp.conntrack_tcp_timeout_established,
        conntrack_tcp_close_wait: kp.conntrack_tcp_timeout_close_wait,
        conntrack_tcp_be_liberal: kp.conntrack_tcp_be_liberal,
        conntrack_udp: kp.conntrack_udp_timeout,
        conntrack_udp_stream: kp.conntrack_udp_timeout_stream,
        healthz_port: kp.healthz_port,
        metrics_port: kp.metrics_port,
        oom_score_adj: kp.oom_score_adj,
    })?;
    Ok(config)
}

/// A Kubernetes label value: at most 63 characters, alphanumerics, '-', '_' and '.', beginning
/// and ending with an alphanumeric (empty is a value, but names no proxy).
fn label_value_ok(value: &str) -> bool {
    let ends = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    value.len() <= 63
        && ends(value.chars().next())
        && ends(value.chars().last())
        && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The agent's whole configuration: the file, the flags, and what follows from them.
pub fn agent_config(args: AgentArgs) -> Result<AgentConfig> {
    let config = effective_config(&args)?;
    let cgroup = match args.cgroup {
        Some(c) => bpf::cgroup2_dir(&c)?,
        None => bpf::cgroup2_root()?,
    };
    let tc_links = match args.interfaces.as_slice() {
        [] => TcLinks::All,
        [none] if none == "none" => TcLinks::Off,
        names => TcLinks::Only(names.to_vec()),
    };
    let detector = config.detector();
    let mut datapath = DatapathConfig::new(args.pin_root, cgroup);
    datapath.max_service_ports = args.max_service_ports;
    datapath.max_backends = args.max_backends;
    datapath.max_sock_revnat = args.max_sock_revnat;
    datapath.max_sock_revnat_per_pod = args.max_sock_revnat_per_pod;
    datapath.max_source_ranges = args.max_source_ranges;
    datapath.endpoint_counters = args.endpoint_counters;
    datapath.maglev_seed = args.maglev_seed;
    datapath.maglev_table_size = args.maglev_table_size;
    datapath.max_conntrack = args.max_conntrack;
    datapath.max_conntrack_new = args.max_conntrack_new;
    datapath.ct_timeouts = config.conntrack.timeouts.datapath();
    datapath.tc_netlink = args.tc_netlink;
    datapath.detect_local = match detector {
        DetectLocal::None => proxy_common::DETECT_LOCAL_NONE,
        DetectLocal::ClusterCidr(_) | DetectLocal::NodeCidr => proxy_common::DETECT_LOCAL_CIDR,
        DetectLocal::BridgeInterface(_) | DetectLocal::InterfaceNamePrefix(_) => proxy_common::DETECT_LOCAL_INTERFACE,
    };
    datapath.localhost_node_ports = config.localhost_node_ports_effective();
    datapath.pod_links_covered = tc_links == TcLinks::All;
    datapath.socket_lb_pods = args.socket_lb == SocketLb::All;
    if !datapath.socket_lb_pods && !datapath.pod_links_covered {
        bail!(
            "--socket-lb host-only leaves pods' traffic to the per-packet path: it needs every link (no --interfaces)"
        );
    }
    // Straight out only where kpr is on every link: a reply that comes back by a link kpr is
    // not on meets the host's conntrack, which must then have seen the flow's first packet.
    datapath.forward_direct =
        if args.host_routing || !datapath.pod_links_covered { ForwardDirect::Never } else { args.forward_direct };
    datapath.xdp = args.xdp;
    if args.xdp != bpf::XdpSetting::Off && datapath.forward_direct == ForwardDirect::Never {
        tracing::warn!("--xdp sends nothing out while translated packets take the host's forwarding path");
    }
    datapath.agent_cgroup_id = match bpf::agent_cgroup_id() {
        Ok(Some(id)) => id,
        Ok(None) => {
            tracing::info!(
                "kpr shares its cgroup with other processes: its own connections are translated like theirs \
                 (externalIPs and LoadBalancer IPs included)"
            );
            0
        }
        Err(e) => {
            tracing::warn!("cannot tell kpr's own cgroup ({e:#}): its own connections are translated like others'");
            0
        }
    };
    // What no service port takes in the service range is refused, as kube-proxy's nftables
    // mode does; iptables mode passes it to the routing table, which kpr does on request only.
    let refuse_service_range =
        (config.mode == "nftables" || !args.pass_service_range) && args.service_proxy_name.is_none();
    if args.pass_service_range && config.mode == "nftables" {
        tracing::warn!("--pass-service-range has no effect in mode: nftables, which refuses the service range itself");
    }
    let service_proxy_name = match args.service_proxy_name {
        Some(name) if !label_value_ok(&name) => bail!(
            "--service-proxy-name {name:?} is not a label value (at most 63 letters, digits, '-', '_', '.', \
             beginning and ending with a letter or digit)"
        ),
        Some(name) => {
            tracing::info!(
                name,
                "serving only the Services labelled service.kubernetes.io/service-proxy-name={name}; the service \
                 range is not refused (the rest is kube-proxy's)"
            );
            // The command line lives as long as the process.
            Some(&*Box::leak(name.into_boxed_str()))
        }
        None => None,
    };
    datapath.refuse_service_range = refuse_service_range;
    let source = match args.manifests {
        Some(dir) => SourceConfig::Manifests(dir),
        None => SourceConfig::Kube { kubeconfig: config.kubeconfig.clone(), master: args.master.clone() },
    };
    let name = match config.hostname_override.clone().or_else(|| std::env::var("NODE_NAME").ok()) {
        Some(n) => n,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")?.trim().to_lowercase(),
    };
    let node = NodeSettings {
        name,
        node_port_addresses: config.node_port_addresses(),
        detect_local: detector.clone(),
        node_ips: args.node_ips,
        bind_address: Some(config.bind_address).filter(|a| !a.is_unspecified()),
        pod_cgroups: Some(datapath.cgroup.clone()),
        tc_links,
    };
    tracing::info!(config = %serde_json::to_string(&config)?, "effective configuration");
    let cfg = AgentConfig {
        source,
        datapath,
        node,
        options: ProxyOptions {
            masquerade_all: config.masquerade_all,
            detect_local: detector.implemented(),
            refuse_service_range,
            host_external_ips_local_only: args.host_external_ips == HostExternalIps::Local,
            service_proxy_name,
            abort_dead_tcp: args.abort_dead_tcp,
            maglev: args.lb_algorithm == LbAlgorithm::Maglev,
            lb_mode: args.lb_mode.into(),
        },
        sync_period: config.sync_period,
        min_sync_period: config.min_sync_period,
        metrics_bind_address: config.metrics_bind_address,
        healthz_bind_address: config.healthz_bind_address,
        configz: config.configz(),
        cleanup_kube_proxy: args.cleanup_kube_proxy,
        shadow: args.shadow,
        verify_period: args.verify_period,
        outliers: crate::model::outliers::OutlierSettings {
            default_on: args.outlier_detection == Switch::On,
            window: args.outlier_window,
            failures: args.outlier_failures,
            backoff: args.outlier_backoff,
            max_backoff: args.outlier_max_backoff.max(args.outlier_backoff),
        },
        oom_score_adj: config.oom_score_adj,
        netfilter_sysctls: (
            args.netfilter_sysctl_dir,
            crate::datapath::netfilter_sysctls::plan(
                &config.conntrack,
                std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            ),
        ),
    };
    Ok(cfg)
}

impl From<LbMode> for crate::model::LbMode {
    fn from(mode: LbMode) -> Self {
        match mode {
            LbMode::Snat => Self::Snat,
            LbMode::Dsr => Self::Dsr,
            LbMode::Hybrid => Self::Hybrid,
        }
    }
}
