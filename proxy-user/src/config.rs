//! kube-proxy's configuration file, `KubeProxyConfiguration` (`kubeproxy.config.k8s.io/v1alpha1`),
//! the file kubeadm keeps in the `kube-system/kube-proxy` ConfigMap.
//!
//! Read as kube-proxy reads it: strictly (an unknown field, a wrong apiVersion/kind or a bad
//! value is an error naming the field), with kube-proxy's defaults, and with the mode-specific
//! settings (`syncPeriod`, `masqueradeAll`, …) taken from the `iptables` block, or from
//! `nftables` when `mode: nftables`. Fields that mean nothing to kpr are accepted and listed
//! once in the log. [`ProxyConfig`] is the effective result; flags override it (see `main.rs`).
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};

use crate::model::{
    cidr::Cidr,
    node::{DetectLocal, NodePortAddress},
};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// The file as written; every field optional (kubeadm writes `null` for unset ones).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeProxyConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub feature_gates: Option<BTreeMap<String, bool>>,
    pub client_connection: Option<ClientConnection>,
    /// component-base's logging configuration; kpr logs through `RUST_LOG`.
    pub logging: Option<serde_yaml::Value>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub bind_address_hard_fail: Option<bool>,
    pub enable_profiling: Option<bool>,
    pub show_hidden_metrics_for_version: Option<String>,
    pub mode: Option<String>,
    pub iptables: Option<IptablesConfig>,
    pub ipvs: Option<IpvsConfig>,
    pub nftables: Option<NftablesConfig>,
    pub winkernel: Option<WinkernelConfig>,
    pub detect_local_mode: Option<String>,
    pub detect_local: Option<DetectLocalConfig>,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub oom_score_adj: Option<i32>,
    pub conntrack: Option<ConntrackConfig>,
    pub config_sync_period: Option<String>,
    pub port_range: Option<String>,
    pub windows_run_as_service: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientConnection {
    pub kubeconfig: Option<String>,
    pub accept_content_types: Option<String>,
    pub content_type: Option<String>,
    pub qps: Option<f64>,
    pub burst: Option<i32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IptablesConfig {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: Option<bool>,
    pub localhost_node_ports: Option<bool>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NftablesConfig {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: Option<bool>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IpvsConfig {
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
    pub scheduler: Option<String>,
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    pub strict_arp: Option<bool>,
    pub tcp_timeout: Option<String>,
    pub tcp_fin_timeout: Option<String>,
    pub udp_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WinkernelConfig {
    pub network_name: Option<String>,
    pub source_vip: Option<String>,
    #[serde(rename = "enableDSR")]
    pub enable_dsr: Option<bool>,
    pub root_hns_endpoint_name: Option<String>,
    pub forward_health_check_vip: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DetectLocalConfig {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConntrackConfig {
    pub max_per_core: Option<i32>,
    pub min: Option<i32>,
    pub tcp_established_timeout: Option<String>,
    pub tcp_close_wait_timeout: Option<String>,
    pub tcp_be_liberal: Option<bool>,
    pub udp_timeout: Option<String>,
    pub udp_stream_timeout: Option<String>,
}

/// kube-proxy's `conntrack.*`: the timeouts (kpr's flows and the kernel's tracker) and the
/// kernel tracker's table size and liberal mode ([`crate::datapath::netfilter_sysctls`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConntrackSettings {
    #[serde(flatten)]
    pub timeouts: ConntrackTimeouts,
    /// kube-proxy's default 32768; 0 leaves the table size alone.
    pub max_per_core: Option<i32>,
    /// kube-proxy's default 131072.
    pub min: Option<i32>,
    pub tcp_be_liberal: bool,
}

/// kube-proxy's conntrack timeouts (0: leave the kernel's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConntrackTimeouts {
    #[serde(with = "go_duration")]
    pub tcp_established: Duration,
    #[serde(with = "go_duration")]
    pub tcp_close_wait: Duration,
    #[serde(with = "go_duration")]
    pub udp: Duration,
    #[serde(with = "go_duration")]
    pub udp_stream: Duration,
}

impl ConntrackTimeouts {
    /// The per-packet path's flow lifetimes: kube-proxy's settings, the kernel's defaults
    /// where kube-proxy leaves them (0).
    pub fn datapath(&self) -> proxy_common::CtTimeouts {
        let d = proxy_common::CtTimeouts::DEFAULT;
        let ns = |v: Duration, default: u64| {
            if v.is_zero() { default } else { v.as_nanos().min(u128::from(u64::MAX)) as u64 }
        };
        proxy_common::CtTimeouts {
            tcp_established: ns(self.tcp_established, d.tcp_established),
            tcp_close_wait: ns(self.tcp_close_wait, d.tcp_close_wait),
            udp: ns(self.udp, d.udp),
            udp_stream: ns(self.udp_stream, d.udp_stream),
            ..d
        }
    }
}

/// The `detectLocalMode` setting with its inputs, before the Node is known.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocalSetting {
    pub mode: String,
    pub bridge_interface: String,
    pub interface_name_prefix: String,
}

/// Settings given as flags (kube-proxy's names); `None`: not given, the file decides.
#[derive(Clone, Debug, Default)]
pub struct FlagOverrides {
    pub hostname_override: Option<String>,
    pub cluster_cidr: Option<String>,
    pub detect_local_mode: Option<String>,
    pub pod_bridge_interface: Option<String>,
    pub pod_interface_name_prefix: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub masquerade_all: Option<bool>,
    pub localhost_node_ports: Option<bool>,
    pub bind_address: Option<IpAddr>,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    pub kubeconfig: Option<PathBuf>,
    pub metrics_bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub conntrack_max_per_core: Option<i32>,
    pub conntrack_min: Option<i32>,
    pub conntrack_tcp_established: Option<Duration>,
    pub conntrack_tcp_close_wait: Option<Duration>,
    pub conntrack_tcp_be_liberal: Option<bool>,
    pub conntrack_udp: Option<Duration>,
    pub conntrack_udp_stream: Option<Duration>,
    /// The deprecated `--healthz-port` / `--metrics-port`: the port of the server's address
    /// (0 turns it off).
    pub healthz_port: Option<u16>,
    pub metrics_port: Option<u16>,
    pub oom_score_adj: Option<i32>,
}

/// The effective configuration: the file with kube-proxy's defaults, then flags on top.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyConfig {
    pub hostname_override: Option<String>,
    #[serde(rename = "clusterCIDRs")]
    pub cluster_cidrs: Vec<Cidr>,
    pub detect_local: DetectLocalSetting,
    pub node_port_addresses: Vec<String>,
    pub masquerade_all: bool,
    pub localhost_node_ports: bool,
    pub bind_address: IpAddr,
    /// None: the server is off (an empty `--healthz-bind-address`).
    pub healthz_bind_address: Option<SocketAddr>,
    pub metrics_bind_address: Option<SocketAddr>,
    #[serde(with = "go_duration")]
    pub sync_period: Duration,
    #[serde(with = "go_duration")]
    pub min_sync_period: Duration,
    pub conntrack: ConntrackSettings,
    pub kubeconfig: Option<PathBuf>,
    /// `mode` as written: it picks kube-proxy's defaults of that mode and whether the service
    /// range is refused (nftables); `ipvs` is served as `iptables`.
    pub mode: String,
    /// `oomScoreAdj`: written to the agent's /proc/self/oom_score_adj when set (kube-proxy
    /// defaults it to -999; kpr's datapath outlives the agent, so kpr leaves it alone).
    pub oom_score_adj: Option<i32>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        // An empty file: kube-proxy's defaults.
        resolve(KubeProxyConfiguration::default()).expect("the defaults are valid")
    }
}

impl ProxyConfig {
    /// Read, check and resolve a configuration file (kube-proxy's defaults without one), with
    /// `--proxy-mode` in place of its `mode` when given: the mode's defaults follow it.
    pub fn load(path: Option<&Path>, mode: Option<&str>) -> Result<Self> {
        let mut file = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("failed to read the configuration file {}", path.display()))?;
                parse_file(&text).with_context(|| format!("invalid configuration file {}", path.display()))?
            }
            None => KubeProxyConfiguration::default(),
        };
        if let Some(mode) = mode {
            file.mode = Some(mode.to_owned());
        }
        resolve(file).with_context(|| match (path, mode) {
            (_, Some(mode)) => format!("--proxy-mode {mode}"),
            (Some(path), None) => format!("invalid configuration file {}", path.display()),
            (None, None) => "kube-proxy's defaults".to_owned(),
        })
    }

    pub fn parse(text: &str) -> Result<Self> {
        resolve(parse_file(text)?)
    }

    /// The local-traffic detector, given the Node (its podCIDRs) for NodeCIDR. A mode whose
    /// input is missing is kube-proxy's no-op detector.
    pub fn detector(&self) -> DetectLocal {
        let d = &self.detect_local;
        match d.mode.as_str() {
            "NodeCIDR" => DetectLocal::NodeCidr,
            "BridgeInterface" => DetectLocal::BridgeInterface(d.bridge_interface.clone()),
            "InterfaceNamePrefix" => DetectLocal::InterfaceNamePrefix(d.interface_name_prefix.clone()),
            _ if self.cluster_cidrs.is_empty() => DetectLocal::None,
            _ => DetectLocal::ClusterCidr(self.cluster_cidrs.clone()),
        }
    }

    /// `nodePortAddresses`, parsed (validated already).
    pub fn node_port_addresses(&self) -> Vec<NodePortAddress> {
        self.node_port_addresses
            .iter()
            .filter_map(|a| match a.as_str() {
                "primary" => Some(NodePortAddress::Primary),
                cidr => cidr.parse().ok().map(NodePortAddress::Cidr),
            })
            .collect()
    }

    /// `/configz`: the effective configuration in `KubeProxyConfiguration` (v1alpha1) form
    /// under kube-proxy's configz key, with the mode-specific settings in the block of the
    /// mode in effect.
    pub fn configz(&self) -> serde_json::Value {
        use go_duration::format as go;
        let addr = |a: &Option<SocketAddr>| a.map(|a| a.to_string()).unwrap_or_default();
        let cluster_cidr: Vec<String> = self.cluster_cidrs.iter().map(ToString::to_string).collect();
        let mode = if self.mode.is_empty() { "iptables" } else { self.mode.as_str() };
        let mut mode_block = serde_json::json!({
            "masqueradeAll": self.masquerade_all,
            "syncPeriod": go(self.sync_period),
            "minSyncPeriod": go(self.min_sync_period),
        });
        if mode != "nftables" {
            mode_block["localhostNodePorts"] = self.localhost_node_ports.into();
        }
        let ct = &self.conntrack.timeouts;
        let mut config = serde_json::json!({
            "apiVersion": API_VERSION,
            "kind": KIND,
            "clientConnection": {"kubeconfig": self.kubeconfig.as_ref().map(|p| p.display().to_string()).unwrap_or_default()},
            "hostnameOverride": self.hostname_override.clone().unwrap_or_default(),
            "bindAddress": self.bind_address.to_string(),
            "healthzBindAddress": addr(&self.healthz_bind_address),
            "metricsBindAddress": addr(&self.metrics_bind_address),
            "mode": self.mode,
            "detectLocalMode": self.detect_local.mode,
            "detectLocal": {
                "bridgeInterface": self.detect_local.bridge_interface,
                "interfaceNamePrefix": self.detect_local.interface_name_prefix,
            },
            "clusterCIDR": cluster_cidr.join(","),
            "nodePortAddresses": self.node_port_addresses,
            "conntrack": {
                "tcpEstablishedTimeout": go(ct.tcp_established),
                "tcpCloseWaitTimeout": go(ct.tcp_close_wait),
                "udpTimeout": go(ct.udp),
                "udpStreamTimeout": go(ct.udp_stream),
                "maxPerCore": self.conntrack.max_per_core,
                "min": self.conntrack.min,
                "tcpBeLiberal": self.conntrack.tcp_be_liberal,
            },
        });
        config[if mode == "nftables" { "nftables" } else { "iptables" }] = mode_block;
        serde_json::json!({ "kubeproxy.config.k8s.io": config })
    }

    /// localhostNodePorts as it takes effect: on, unless nodePortAddresses leaves loopback out.
    pub fn localhost_node_ports_effective(&self) -> bool {
        let loopback: IpAddr = [127, 0, 0, 1].into();
        self.localhost_node_ports
            && (self.node_port_addresses.is_empty()
                || self
                    .node_port_addresses()
                    .iter()
                    .any(|a| matches!(a, NodePortAddress::Cidr(c) if c.contains(loopback))))
    }

    /// Flags given explicitly override the file (kube-proxy's flag names), checked with the
    /// file's rules.
    pub fn apply_flags(&mut self, flags: &FlagOverrides) -> Result<()> {
        if let Some(name) = &flags.hostname_override {
            self.hostname_override = Some(name.trim().to_lowercase()).filter(|n| !n.is_empty());
        }
        if let Some(cidrs) = &flags.cluster_cidr {
            self.set_cluster_cidrs(cidrs)?;
        }
        if let Some(bridge) = &flags.pod_bridge_interface {
            self.detect_local.bridge_interface = bridge.clone();
        }
        if let Some(prefix) = &flags.pod_interface_name_prefix {
            self.detect_local.interface_name_prefix = prefix.clone();
        }
        if let Some(mode) = &flags.detect_local_mode {
            self.set_detect_local_mode(mode)?;
        }
        if let Some(addrs) = &flags.node_port_addresses {
            self.set_node_port_addresses(addrs.clone())?;
        }
        if let Some(all) = flags.masquerade_all {
            self.masquerade_all = all;
        }
        if let Some(on) = flags.localhost_node_ports {
            self.localhost_node_ports = on;
        }
        if let Some(addr) = flags.bind_address {
            self.bind_address = addr;
        }
        if let Some(period) = flags.sync_period {
            anyhow::ensure!(!period.is_zero(), "--iptables-sync-period: must be greater than 0");
            self.sync_period = period;
        }
        if let Some(period) = flags.min_sync_period {
            self.min_sync_period = period;
        }
        if let Some(kubeconfig) = &flags.kubeconfig {
            self.kubeconfig = Some(kubeconfig.clone());
        }
        // As kube-proxy's flags: empty turns the server off; an IP alone takes the usual port.
        if let Some(raw) = &flags.metrics_bind_address {
            self.metrics_bind_address = server_address_flag("--metrics-bind-address", raw, 10249)?;
        }
        if let Some(raw) = &flags.healthz_bind_address {
            self.healthz_bind_address = server_address_flag("--healthz-bind-address", raw, 10256)?;
        }
        if let Some(adj) = flags.oom_score_adj {
            anyhow::ensure!((-1000..=1000).contains(&adj), "--oom-score-adj: must be within the range [-1000, 1000]");
            self.oom_score_adj = Some(adj);
        }
        let ct = &mut self.conntrack;
        if flags.conntrack_max_per_core.is_some() {
            ct.max_per_core = flags.conntrack_max_per_core;
        }
        if flags.conntrack_min.is_some() {
            ct.min = flags.conntrack_min;
        }
        ct.tcp_be_liberal = flags.conntrack_tcp_be_liberal.unwrap_or(ct.tcp_be_liberal);
        let t = &mut ct.timeouts;
        t.tcp_established = flags.conntrack_tcp_established.unwrap_or(t.tcp_established);
        t.tcp_close_wait = flags.conntrack_tcp_close_wait.unwrap_or(t.tcp_close_wait);
        t.udp = flags.conntrack_udp.unwrap_or(t.udp);
        t.udp_stream = flags.conntrack_udp_stream.unwrap_or(t.udp_stream);
        // As kube-proxy: the port replaces the address's, and 0 turns the server off.
        for (port, address) in
            [(flags.healthz_port, &mut self.healthz_bind_address), (flags.metrics_port, &mut self.metrics_bind_address)]
        {
            match port {
                Some(0) => *address = None,
                Some(port) => {
                    let ip = address.map_or(IpAddr::from([0, 0, 0, 0]), |a| a.ip());
                    *address = Some(SocketAddr::new(ip, port));
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Parse and check settings given as flags, with the file's rules.
    fn set_cluster_cidrs(&mut self, raw: &str) -> Result<()> {
        self.cluster_cidrs = parse_cluster_cidrs(raw).map_err(|e| anyhow::anyhow!("--cluster-cidr: {e}"))?;
        Ok(())
    }

    fn set_node_port_addresses(&mut self, raw: Vec<String>) -> Result<()> {
        check_node_port_addresses(&raw).map_err(|e| anyhow::anyhow!("--nodeport-addresses: {e}"))?;
        self.node_port_addresses = raw;
        Ok(())
    }

    fn set_detect_local_mode(&mut self, mode: &str) -> Result<()> {
        check_detect_local(mode, &self.detect_local.bridge_interface, &self.detect_local.interface_name_prefix, false)
            .map_err(|e| anyhow::anyhow!("--detect-local-mode: {e}"))?;
        self.detect_local.mode = mode.to_owned();
        Ok(())
    }
}

/// The file as written, its apiVersion and kind checked.
fn parse_file(text: &str) -> Result<KubeProxyConfiguration> {
    let file: KubeProxyConfiguration = serde_yaml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
    match (file.api_version.as_deref(), file.kind.as_deref()) {
        (Some(API_VERSION), Some(KIND)) => Ok(file),
        (Some(API_VERSION), other) => bail!("kind: expected `{KIND}`, found {other:?}"),
        (other, _) => bail!("apiVersion: expected `{API_VERSION}`, found {other:?}"),
    }
}

/// Defaults, checks and the mode-specific block, as kube-proxy's defaulting, conversion and
/// validation do.
fn resolve(file: KubeProxyConfiguration) -> Result<ProxyConfig> {
    let mode = file.mode.clone().unwrap_or_default();
    if !["", "iptables", "ipvs", "nftables"].contains(&mode.as_str()) {
        bail!("mode: `{mode}` is not supported (iptables, ipvs, nftables, or empty)");
    }
    let ignored = ignored_fields(&file);
    if !ignored.is_empty() {
        tracing::info!(fields = ?ignored, "configuration fields accepted but not used by kpr");
    }

    let iptables = file.iptables.unwrap_or_default();
    let nftables = file.nftables.unwrap_or_default();
    let (masquerade_all, sync, min_sync) = if mode == "nftables" {
        (nftables.masquerade_all, nftables.sync_period, nftables.min_sync_period)
    } else {
        (iptables.masquerade_all, iptables.sync_period, iptables.min_sync_period)
    };
    let field = |name: &str, raw: Option<String>, default: Duration| -> Result<Duration> {
        match raw.as_deref() {
            None => Ok(default),
            Some(s) => go_duration::parse(s).map_err(|e| anyhow::anyhow!("{name}: {e}")),
        }
    };
    let block = if mode == "nftables" { "nftables" } else { "iptables" };
    let mut sync_period = field(&format!("{block}.syncPeriod"), sync, Duration::ZERO)?;
    if sync_period.is_zero() {
        sync_period = Duration::from_secs(30);
    }
    let mut min_sync_period = field(&format!("{block}.minSyncPeriod"), min_sync, Duration::ZERO)?;
    if min_sync_period.is_zero() {
        min_sync_period = Duration::from_secs(1);
    }
    if sync_period < min_sync_period {
        bail!("{block}.syncPeriod: must be greater than or equal to {block}.minSyncPeriod");
    }

    let ct = file.conntrack.unwrap_or_default();
    let timeouts = ConntrackTimeouts {
        tcp_established: field(
            "conntrack.tcpEstablishedTimeout",
            ct.tcp_established_timeout,
            Duration::from_secs(86_400),
        )?,
        tcp_close_wait: field("conntrack.tcpCloseWaitTimeout", ct.tcp_close_wait_timeout, Duration::from_secs(3_600))?,
        udp: field("conntrack.udpTimeout", ct.udp_timeout, Duration::ZERO)?,
        udp_stream: field("conntrack.udpStreamTimeout", ct.udp_stream_timeout, Duration::ZERO)?,
    };
    for (name, v) in [("conntrack.maxPerCore", ct.max_per_core), ("conntrack.min", ct.min)] {
        if v.is_some_and(|v| v < 0) {
            bail!("{name}: must be greater than or equal to 0");
        }
    }
    // kube-proxy's defaults (pkg/proxy/apis/config/v1alpha1/defaults.go).
    let conntrack = ConntrackSettings {
        timeouts,
        max_per_core: Some(ct.max_per_core.unwrap_or(32 * 1024)),
        min: Some(ct.min.unwrap_or(128 * 1024)),
        tcp_be_liberal: ct.tcp_be_liberal.unwrap_or(false),
    };
    if let Some(bit) = iptables.masquerade_bit.or(nftables.masquerade_bit)
        && !(0..=31).contains(&bit)
    {
        bail!("{block}.masqueradeBit: must be within the range [0, 31]");
    }
    if let Some(oom) = file.oom_score_adj
        && !(-1000..=1000).contains(&oom)
    {
        bail!("oomScoreAdj: must be within the range [-1000, 1000]");
    }
    if let Some(period) = &file.config_sync_period {
        go_duration::parse(period).map_err(|e| anyhow::anyhow!("configSyncPeriod: {e}"))?;
    }

    let bind_address = match file.bind_address.as_deref().filter(|s| !s.is_empty()) {
        None => IpAddr::from([0, 0, 0, 0]),
        Some(s) => s.parse().map_err(|_| anyhow::anyhow!("bindAddress: `{s}` is not a valid IP address"))?,
    };
    let (healthz_host, metrics_host) =
        if bind_address.is_ipv4() { ("0.0.0.0", "127.0.0.1") } else { ("[::]", "[::1]") };
    let healthz_bind_address =
        bind_address_field("healthzBindAddress", file.healthz_bind_address, healthz_host, 10256)?;
    let metrics_bind_address =
        bind_address_field("metricsBindAddress", file.metrics_bind_address, metrics_host, 10249)?;

    let cluster_cidrs = parse_cluster_cidrs(file.cluster_cidr.as_deref().unwrap_or(""))
        .map_err(|e| anyhow::anyhow!("clusterCIDR: {e}"))?;
    let mut node_port_addresses = file.node_port_addresses.unwrap_or_default();
    if mode == "nftables" && node_port_addresses.is_empty() {
        // nftables mode serves NodePorts on the node's primary IPs unless told otherwise.
        node_port_addresses = vec!["primary".into()];
    }
    check_node_port_addresses(&node_port_addresses).map_err(|e| anyhow::anyhow!("nodePortAddresses: {e}"))?;
    let detect = file.detect_local.unwrap_or_default();
    let detect_local = DetectLocalSetting {
        mode: file.detect_local_mode.unwrap_or_default(),
        bridge_interface: detect.bridge_interface.unwrap_or_default(),
        interface_name_prefix: detect.interface_name_prefix.unwrap_or_default(),
    };
    check_detect_local(&detect_local.mode, &detect_local.bridge_interface, &detect_local.interface_name_prefix, true)?;

    let client = file.client_connection.unwrap_or_default();
    if client.burst.is_some_and(|b| b < 0) {
        bail!("clientConnection.burst: must be greater than or equal to 0");
    }
    Ok(ProxyConfig {
        hostname_override: file.hostname_override.filter(|h| !h.trim().is_empty()).map(|h| h.trim().to_lowercase()),
        cluster_cidrs,
        detect_local,
        node_port_addresses,
        masquerade_all: masquerade_all.unwrap_or(false),
        // Only the iptables backend routes 127.0.0.1:nodePort (route_localnet).
        localhost_node_ports: mode != "nftables" && iptables.localhost_node_ports.unwrap_or(true),
        bind_address,
        healthz_bind_address,
        metrics_bind_address,
        sync_period,
        min_sync_period,
        conntrack,
        kubeconfig: client.kubeconfig.filter(|k| !k.is_empty()).map(PathBuf::from),
        mode,
        oom_score_adj: file.oom_score_adj,
    })
}

/// `host:port`, `host` (kube-proxy appends the default port), or empty for the default.
fn server_address_flag(name: &str, raw: &str, port: u16) -> Result<Option<SocketAddr>> {
    if raw.trim().is_empty() {
        return Ok(None);
    }
    bind_address_field(name, Some(raw.trim().to_owned()), "", port)
}

fn bind_address_field(name: &str, raw: Option<String>, default_host: &str, port: u16) -> Result<Option<SocketAddr>> {
    let raw = raw.unwrap_or_default();
    let text = if raw.is_empty() {
        format!("{default_host}:{port}")
    } else if raw.parse::<IpAddr>().is_ok() {
        match raw.parse::<IpAddr>() {
            Ok(IpAddr::V6(a)) => format!("[{a}]:{port}"),
            _ => format!("{raw}:{port}"),
        }
    } else {
        raw.clone()
    };
    text.parse::<SocketAddr>().map(Some).map_err(|_| anyhow::anyhow!("{name}: `{raw}` must be IP:port"))
}

/// `clusterCIDR`: one CIDR, or a dual-stack pair, comma-separated.
fn parse_cluster_cidrs(raw: &str) -> Result<Vec<Cidr>, String> {
    if raw.trim().is_empty() {
        return Ok(Vec::new());
    }
    let cidrs = raw.split(',').map(str::parse::<Cidr>).collect::<Result<Vec<_>, _>>()?;
    let v4 = cidrs.iter().filter(|c| c.is_ipv4()).count();
    if cidrs.len() > 2 || (cidrs.len() == 2 && v4 != 1) {
        return Err(format!("`{raw}`: must be a single CIDR or a dual-stack pair of CIDRs"));
    }
    Ok(cidrs)
}

fn check_node_port_addresses(raw: &[String]) -> Result<(), String> {
    for (i, a) in raw.iter().enumerate() {
        if a == "primary" {
            if raw.len() > 1 {
                return Err(format!("[{i}]: can't use both 'primary' and CIDRs"));
            }
        } else if a.parse::<Cidr>().is_err() {
            return Err(format!("[{i}]: `{a}` must be a valid CIDR"));
        }
    }
    Ok(())
}

fn check_detect_local(mode: &str, bridge: &str, prefix: &str, in_file: bool) -> Result<()> {
    let (mode_field, bridge_field, prefix_field) = if in_file {
        ("detectLocalMode", "detectLocal.bridgeInterface", "detectLocal.interfaceNamePrefix")
    } else {
        ("--detect-local-mode", "--pod-bridge-interface", "--pod-interface-name-prefix")
    };
    match mode {
        "" | "ClusterCIDR" | "NodeCIDR" => Ok(()),
        "BridgeInterface" if bridge.is_empty() => {
            bail!("{bridge_field}: must not be empty with {mode_field} BridgeInterface")
        }
        "InterfaceNamePrefix" if prefix.is_empty() => {
            bail!("{prefix_field}: must not be empty with {mode_field} InterfaceNamePrefix")
        }
        "BridgeInterface" | "InterfaceNamePrefix" => Ok(()),
        other => bail!(
            "{mode_field}: `{other}` is not supported (ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix)"
        ),
    }
}

/// The fields kpr accepts but does not use, when set to something.
fn ignored_fields(file: &KubeProxyConfiguration) -> Vec<&'static str> {
    let mut out = Vec::new();
    let mut note = |set: bool, name: &'static str| {
        if set {
            out.push(name);
        }
    };
    note(file.mode.as_deref() == Some("ipvs"), "mode: ipvs (served as iptables mode)");
    note(file.ipvs.is_some(), "ipvs");
    note(file.winkernel.is_some(), "winkernel");
    note(file.feature_gates.as_ref().is_some_and(|g| !g.is_empty()), "featureGates");
    note(file.port_range.as_deref().is_some_and(|p| !p.is_empty()), "portRange");
    note(file.config_sync_period.is_some(), "configSyncPeriod");
    note(file.enable_profiling == Some(true), "enableProfiling");
    note(file.bind_address_hard_fail == Some(true), "bindAddressHardFail");
    note(file.show_hidden_metrics_for_version.as_deref().is_some_and(|v| !v.is_empty()), "showHiddenMetricsForVersion");
    note(file.windows_run_as_service == Some(true), "windowsRunAsService");
    note(file.logging.as_ref().is_some_and(|l| !l.is_null()), "logging (use RUST_LOG)");
    out
}

/// Go's `time.Duration` text (`1h30m`, `500ms`, `0s`), as `metav1.Duration` writes it.
pub mod go_duration {
    use std::time::Duration;

    pub fn parse(s: &str) -> Result<Duration, String> {
        let text = s.trim();
        if text == "0" {
            return Ok(Duration::ZERO);
        }
        if text.starts_with('-') {
            return Err(format!("`{s}` must be greater than or equal to 0"));
        }
        let mut rest = text.strip_prefix('+').unwrap_or(text);
        if rest.is_empty() {
            return Err(format!("`{s}` is not a duration"));
        }
        let mut total = 0f64;
        while !rest.is_empty() {
            let num_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
            let unit_len =
                rest[num_len..].find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len() - num_len);
            let (num, unit) = (&rest[..num_len], &rest[num_len..num_len + unit_len]);
            let value: f64 = num.parse().map_err(|_| format!("`{s}` is not a duration"))?;
            let scale = match unit {
                "ns" => 1e-9,
                "us" | "µs" | "μs" => 1e-6,
                "ms" => 1e-3,
                "s" => 1.0,
                "m" => 60.0,
                "h" => 3600.0,
                _ => return Err(format!("`{s}` is not a duration (unit `{unit}`; use ns, us, ms, s, m, h)")),
            };
            total += value * scale;
            rest = &rest[num_len + unit_len..];
        }
        Ok(Duration::from_secs_f64(total))
    }

    /// Go's spelling of a duration (`24h0m0s`, `1.5s`, `0s`).
    pub fn format(d: Duration) -> String {
        let secs = d.as_secs();
        let frac = d.subsec_nanos();
        if secs == 0 && frac == 0 {
            return "0s".into();
        }
        if secs == 0 {
            return if frac.is_multiple_of(1_000_000) {
                format!("{}ms", frac / 1_000_000)
            } else {
                format!("{}ns", frac)
            };
        }
        let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
        let s =
            if frac == 0 { format!("{s}s") } else { format!("{}s", format!("{s}.{frac:09}").trim_end_matches('0')) };
        match (h, m) {
            (0, 0) => s,
            (0, m) => format!("{m}m{s}"),
            (h, m) => format!("{h}h{m}m{s}"),
        }
    }

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format(*d))
    }
}

#[cfg(test)]
mod tests;
