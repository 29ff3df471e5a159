use super::*;

/// What `kubeadm init` writes into the kube-proxy ConfigMap (v1.3x), with nulls.
const KUBEADM: &str = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

#[test]
fn kubeadm_file_gets_kube_proxy_defaults() {
    let c = ProxyConfig::parse(KUBEADM).unwrap();
    assert_eq!(
        c.cluster_cidrs.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
        ["10.244.0.0/16", "fd00:10:244::/56"]
    );
    assert_eq!(c.detector(), DetectLocal::ClusterCidr(c.cluster_cidrs.clone()));
    assert_eq!(c.healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()));
    assert_eq!(c.metrics_bind_address, Some("127.0.0.1:10249".parse().unwrap()));
    assert_eq!((c.sync_period, c.min_sync_period), (Duration::from_secs(30), Duration::from_secs(1)));
    assert_eq!(c.conntrack.timeouts.tcp_established, Duration::from_secs(86_400));
    assert_eq!(c.conntrack.timeouts.tcp_close_wait, Duration::from_secs(3_600));
    assert!(c.localhost_node_ports && !c.masquerade_all);
    assert_eq!(c.kubeconfig, Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf")));
    assert_eq!(c.hostname_override, None);
    assert_eq!(ProxyConfig::default(), ProxyConfig { cluster_cidrs: vec![], kubeconfig: None, ..c.clone() });
    let json = serde_json::to_value(&c).unwrap();
    assert_eq!(json["syncPeriod"], "30s");
    assert_eq!(json["conntrack"]["tcpEstablished"], "24h0m0s");
}

#[test]
fn mode_specific_settings_and_overrides() {
    let c = ProxyConfig::parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nnftables: {masqueradeAll: true, syncPeriod: 1m, minSyncPeriod: 500ms}\niptables: {localhostNodePorts: false}\nnodePortAddresses: [192.168.0.0/16]\nhostnameOverride: Node-A\nbindAddress: 192.168.0.2\nmetricsBindAddress: 0.0.0.0\ndetectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: veth}\nconntrack: {tcpEstablishedTimeout: 2h30m, udpTimeout: 30s}\n",
        )
        .unwrap();
    assert!(c.masquerade_all);
    assert_eq!((c.sync_period, c.min_sync_period), (Duration::from_secs(60), Duration::from_millis(500)));
    assert!(!c.localhost_node_ports, "nftables mode has no localhost NodePorts");
    assert_eq!(c.hostname_override.as_deref(), Some("node-a"));
    assert_eq!(c.metrics_bind_address, Some("0.0.0.0:10249".parse().unwrap()));
    assert_eq!(c.detector(), DetectLocal::InterfaceNamePrefix("veth".into()));
    assert_eq!(c.conntrack.timeouts.tcp_established, Duration::from_secs(9000));
    assert_eq!(c.conntrack.timeouts.udp, Duration::from_secs(30));
    assert_eq!(c.node_port_addresses(), [NodePortAddress::Cidr("192.168.0.0/16".parse().unwrap())]);
    assert!(!c.localhost_node_ports_effective());
}

#[test]
fn localhost_node_ports_follow_node_port_addresses() {
    let mut c = ProxyConfig::default();
    assert!(c.localhost_node_ports_effective());
    c.set_node_port_addresses(vec!["127.0.0.0/8".into(), "10.0.0.0/8".into()]).unwrap();
    assert!(c.localhost_node_ports_effective());
    c.set_node_port_addresses(vec!["primary".into()]).unwrap();
    assert!(!c.localhost_node_ports_effective());
}

#[test]
fn flags_override_the_file_and_are_checked_like_it() {
    let mut c = ProxyConfig::parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/16\nhostnameOverride: from-file\niptables: {masqueradeAll: true}\n",
        )
        .unwrap();
    c.apply_flags(&FlagOverrides {
        hostname_override: Some("Flag-Node".into()),
        cluster_cidr: Some("10.0.0.0/8,fd00::/48".into()),
        masquerade_all: Some(false),
        min_sync_period: Some(Duration::ZERO),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(c.hostname_override.as_deref(), Some("flag-node"));
    assert_eq!(c.cluster_cidrs.len(), 2);
    assert!(!c.masquerade_all);
    assert_eq!(c.min_sync_period, Duration::ZERO);
    assert_eq!(c.sync_period, Duration::from_secs(30), "not given: the file's (default) value stays");
    for (flags, field) in [
        (FlagOverrides { cluster_cidr: Some("10.0.0.0/40".into()), ..Default::default() }, "--cluster-cidr"),
        (
            FlagOverrides { node_port_addresses: Some(vec!["nope".into()]), ..Default::default() },
            "--nodeport-addresses",
        ),
        (
            FlagOverrides { detect_local_mode: Some("InterfaceNamePrefix".into()), ..Default::default() },
            "--pod-interface-name-prefix",
        ),
        (FlagOverrides { sync_period: Some(Duration::ZERO), ..Default::default() }, "--iptables-sync-period"),
    ] {
        let err = format!("{:#}", c.clone().apply_flags(&flags).unwrap_err());
        assert!(err.contains(field), "`{err}` should name {field}");
    }
}

#[test]
fn bad_files_name_the_field() {
    let head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
    let cases = [
        ("apiVersion: v1\nkind: KubeProxyConfiguration\n".to_owned(), "apiVersion"),
        ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n".to_owned(), "kind"),
        (format!("{head}clusterCIDRs: 10.0.0.0/8\n"), "unknown field `clusterCIDRs`"),
        (format!("{head}iptables: {{masqueradeAl: true}}\n"), "unknown field `masqueradeAl`"),
        (format!("{head}clusterCIDR: 10.0.0.0/33\n"), "clusterCIDR"),
        (format!("{head}clusterCIDR: 10.0.0.0/8,10.1.0.0/16\n"), "clusterCIDR"),
        (format!("{head}nodePortAddresses: [primary, 10.0.0.0/8]\n"), "nodePortAddresses: [0]"),
        (format!("{head}nodePortAddresses: [10.0.0.1]\n"), "nodePortAddresses: [0]"),
        (format!("{head}detectLocalMode: Bridge\n"), "detectLocalMode"),
        (format!("{head}detectLocalMode: BridgeInterface\n"), "detectLocal.bridgeInterface"),
        (format!("{head}iptables: {{syncPeriod: 30x}}\n"), "iptables.syncPeriod"),
        (format!("{head}iptables: {{syncPeriod: 1s, minSyncPeriod: 5s}}\n"), "iptables.syncPeriod"),
        (format!("{head}conntrack: {{udpTimeout: -1s}}\n"), "conntrack.udpTimeout"),
        (format!("{head}bindAddress: 300.1.1.1\n"), "bindAddress"),
        (format!("{head}healthzBindAddress: 'localhost:x'\n"), "healthzBindAddress"),
        (format!("{head}mode: userspace\n"), "mode"),
        (format!("{head}masqueradeAll: true\n"), "unknown field `masqueradeAll`"),
    ];
    for (text, field) in cases {
        let err = format!("{:#}", ProxyConfig::parse(&text).unwrap_err());
        assert!(err.contains(field), "{text:?}: error `{err}` should name `{field}`");
    }
}

#[test]
fn go_durations() {
    for (text, d) in
        [("0s", 0.0), ("1m0s", 60.0), ("24h0m0s", 86_400.0), ("1.5s", 1.5), ("500ms", 0.5), ("1h30m", 5400.0)]
    {
        assert_eq!(go_duration::parse(text).unwrap(), Duration::from_secs_f64(d), "{text}");
    }
    assert_eq!(go_duration::format(Duration::from_secs(86_400)), "24h0m0s");
    assert_eq!(go_duration::format(Duration::from_millis(1500)), "1.5s");
    assert_eq!(go_duration::format(Duration::from_millis(500)), "500ms");
    assert!(go_duration::parse("5").is_err());
    assert!(go_duration::parse("5d").is_err());
}
