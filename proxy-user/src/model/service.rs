//! `v1/Service` → service ports, as kube-proxy's `ServiceChangeTracker` builds them.
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;

use super::{ObjectKey, Protocol, ServicePort, ServicePortName, Skip, TrafficPolicy};

/// Label of services handled by another proxy (`--service-proxy-name`); kube-proxy skips them.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label of headless services (and their slices); kube-proxy skips them.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label selector kube-proxy's informers use for both Services and EndpointSlices.
pub const PROXY_LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// The annotation that turns outlier detection on or off for a Service (`"on"`, `"off"`),
/// whatever the cluster-wide setting says ([`super::outliers`]).
pub const OUTLIER_DETECTION: &str = "kpr.io/outlier-detection";

/// The annotation that picks a Service's backend selection for traffic from outside (`maglev`,
/// `random`), whatever `--lb-algorithm` says.
pub const LB_ALGORITHM: &str = "kpr.io/lb-algorithm";

/// The annotation that picks how a Service's traffic from outside reaches endpoints on other
/// nodes (`snat`, `dsr`, `hybrid`), whatever `--lb-mode` says.
pub const LB_MODE: &str = "kpr.io/lb-mode";

/// A switch annotation's value: Some(on) when it says one of the words.
pub fn parse_switch(value: &str) -> Option<bool> {
    match value {
        "on" | "true" => Some(true),
        "off" | "false" => Some(false),
        _ => None,
    }
}

/// Default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;

/// What became of a Service.
#[derive(Debug, PartialEq, Eq)]
pub struct Translated {
    pub ports: Vec<ServicePort>,
    /// Parts that were skipped, with the reason (logged and counted by the caller).
    pub skipped: Vec<(String, Skip)>,
}

/// What the model keeps of a Service: its translation (which does not depend on the node)
/// and its age (of two services claiming one address, the older keeps it). The object itself is
/// several times larger (k8s-openapi's `Service` is 824 bytes before its strings).
#[derive(Debug, PartialEq, Eq)]
pub struct ServiceInfo {
    pub translated: Result<Translated, Skip>,
    pub created: Option<jiff::Timestamp>,
    /// `kpr.io/outlier-detection`, when it says on or off ([`super::outliers`]).
    pub outlier_detection: Option<bool>,
    /// `kpr.io/lb-algorithm`, when it says `maglev` (true) or `random` (false).
    pub maglev: Option<bool>,
    /// `kpr.io/lb-mode`, when it says one of its words.
    pub lb_mode: Option<super::LbMode>,
}

impl ServiceInfo {
    pub fn new(service: &Service, proxy_name: Option<&str>) -> Self {
        let annotation = |name: &str| service.metadata.annotations.as_ref().and_then(|a| a.get(name));
        Self {
            translated: translate_for(service, proxy_name),
            created: service.metadata.creation_timestamp.as_ref().map(|t| t.0),
            outlier_detection: annotation(OUTLIER_DETECTION).and_then(|v| parse_switch(v)),
            maglev: annotation(LB_ALGORITHM).and_then(|v| match v.as_str() {
                "maglev" => Some(true),
                "random" => Some(false),
                _ => None,
            }),
            lb_mode: annotation(LB_MODE).and_then(|v| match v.as_str() {
                "snat" => Some(super::LbMode::Snat),
                "dsr" => Some(super::LbMode::Dsr),
                "hybrid" => Some(super::LbMode::Hybrid),
                _ => None,
            }),
        }
    }
}

pub fn object_key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<ObjectKey> {
    Some(ObjectKey::new(meta.namespace.clone().unwrap_or_else(|| "default".into()), meta.name.clone()?))
}

/// The label selector of the informers for Services and EndpointSlices (the EndpointSlice
/// controller copies a Service's labels to its slices): kube-proxy's, or with
/// `--service-proxy-name NAME` the objects labelled with that name only.
pub fn label_selector(proxy_name: Option<&str>) -> String {
    match proxy_name {
        None => PROXY_LABEL_SELECTOR.to_owned(),
        Some(name) => format!("{LABEL_SERVICE_PROXY_NAME}={name},!{LABEL_HEADLESS}"),
    }
}

/// True when the object is not this proxy's because of its labels (the informers' selector):
/// headless, or labelled for another proxy (`proxy_name`: kpr's `--service-proxy-name`; None:
/// kube-proxy's rule, any such label is another proxy's).
pub fn ignored_by_labels(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    proxy_name: Option<&str>,
) -> bool {
    let labels = meta.labels.as_ref();
    let headless = labels.is_some_and(|l| l.contains_key(LABEL_HEADLESS));
    let proxy = labels.and_then(|l| l.get(LABEL_SERVICE_PROXY_NAME)).map(String::as_str);
    headless || proxy != proxy_name
}

/// The service ports kube-proxy would program for `service`. Headless, ExternalName and
/// other-proxy services have none. A malformed ClusterIP skips the whole service (nothing
/// half-programmed); a malformed port skips that port.
pub fn translate(service: &Service) -> Result<Translated, Skip> {
    translate_for(service, None)
}

/// [`translate`] for the proxy named `proxy_name` (`--service-proxy-name`).
pub fn translate_for(service: &Service, proxy_name: Option<&str>) -> Result<Translated, Skip> {
    let key = object_key(&service.metadata).ok_or(Skip::Unnamed)?;
    let mut out = Translated { ports: Vec::new(), skipped: Vec::new() };
    let Some(spec) = &service.spec else { return Ok(out) };
    if ignored_by_labels(&service.metadata, proxy_name) || spec.type_.as_deref() == Some("ExternalName") {
        return Ok(out);
    }

    // clusterIPs (dual-stack) supersedes clusterIP; "None" or empty means headless.
    let raw_ips: Vec<&str> = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
        _ => spec.cluster_ip.as_deref().into_iter().collect(),
    };
    if raw_ips.is_empty() || raw_ips.iter().any(|ip| ip.is_empty() || *ip == "None") {
        return Ok(out);
    }
    let cluster_ips = parse_ips(raw_ips.iter().copied())?;
    let external_ips = parse_ips(spec.external_ips.iter().flatten().map(String::as_str))?;
    // LoadBalancer ingress IPs count only when ipMode is unset or VIP.
    let load_balancer_ips = parse_ips(
        service
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .into_iter()
            .flatten()
            .filter(|ing| ing.ip_mode.as_deref().is_none_or(|m| m == "VIP"))
            .filter_map(|ing| ing.ip.as_deref()),
    )?;
    let policy = |p: Option<&String>| match p.map(String::as_str) {
        Some("Local") => TrafficPolicy::Local,
        _ => TrafficPolicy::Cluster,
    };
    let session_affinity_timeout = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .unwrap_or(DEFAULT_AFFINITY_TIMEOUT)
    });
    let health_check_node_port = spec.health_check_node_port.and_then(|p| port(p).ok());

    for sp in spec.ports.iter().flatten() {
        let port_name = sp.name.clone().unwrap_or_default();
        let protocol = match Protocol::parse(sp.protocol.as_deref()) {
            Some(p) => p,
            None => {
                let raw = sp.protocol.clone().unwrap_or_default();
                out.skipped.push((port_name, Skip::UnknownProtocol(raw)));
                continue;
            }
        };
        let (service_port, node_port) = match (port(sp.port), sp.node_port.map(port).transpose()) {
            (Ok(p), Ok(np)) => (p, np),
            (Err(e), _) | (_, Err(e)) => {
                out.skipped.push((port_name, e));
                continue;
            }
        };
        out.ports.push(ServicePort {
            name: ServicePortName { service: key.clone(), port: port_name, protocol },
            cluster_ips: cluster_ips.clone(),
            port: service_port,
            protocol,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            load_balancer_source_ranges: spec.load_balancer_source_ranges.clone().unwrap_or_default(),
            session_affinity_timeout,
            external_policy: policy(spec.external_traffic_policy.as_ref()),
            internal_policy: policy(spec.internal_traffic_policy.as_ref()),
            health_check_node_port,
        });
    }
    Ok(out)
}

pub fn port(value: i32) -> Result<u16, Skip> {
    u16::try_from(value).ok().filter(|p| *p != 0).ok_or(Skip::InvalidPort(value))
}

fn parse_ips<'a>(raw: impl Iterator<Item = &'a str>) -> Result<Vec<IpAddr>, Skip> {
    raw.map(|s| s.parse::<IpAddr>().map_err(|_| Skip::InvalidIp(s.to_owned()))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::service_yaml;

    #[test]
    fn a_named_proxy_serves_its_own_label_only() {
        let labelled = |value: Option<&str>| {
            let labels = value.map_or(String::new(), |v| format!(", labels: {{{LABEL_SERVICE_PROXY_NAME}: {v}}}"));
            service_yaml(&format!(
                "metadata: {{name: p{labels}}}\nspec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}]}}"
            ))
        };
        let ports = |svc: &Service, name| translate_for(svc, name).unwrap().ports.len();
        assert_eq!(ports(&labelled(None), None), 1, "kube-proxy's: unlabelled");
        assert_eq!(ports(&labelled(Some("kpr")), None), 0, "kube-proxy skips any proxy's label");
        assert_eq!(ports(&labelled(Some("kpr")), Some("kpr")), 1, "kpr's own");
        assert_eq!(ports(&labelled(None), Some("kpr")), 0, "left to kube-proxy");
        assert_eq!(ports(&labelled(Some("other")), Some("kpr")), 0, "another proxy's");
        assert_eq!(label_selector(Some("kpr")), format!("{LABEL_SERVICE_PROXY_NAME}=kpr,!{LABEL_HEADLESS}"));
        assert_eq!(label_selector(None), PROXY_LABEL_SELECTOR);
    }

    #[test]
    fn the_outlier_detection_annotation_says_on_or_off_or_nothing() {
        let annotated = |value: &str| {
            let svc = service_yaml(&format!(
                "metadata: {{name: p, annotations: {{{OUTLIER_DETECTION}: '{value}'}}}}\nspec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}]}}"
            ));
            ServiceInfo::new(&svc, None).outlier_detection
        };
        assert_eq!(annotated("on"), Some(true));
        assert_eq!(annotated("off"), Some(false));
        assert_eq!(annotated("maybe"), None, "neither: the cluster-wide setting decides");
    }

    #[test]
    fn multi_port_service() {
        let svc = service_yaml(
            r#"
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, targetPort: 8080}
  - {name: dns, port: 53, protocol: UDP}
"#,
        );
        let t = translate(&svc).unwrap();
        assert_eq!(t.ports.len(), 2);
        assert_eq!(t.ports[0].name.to_string(), "shop/web:http/TCP");
        assert_eq!(t.ports[0].port, 80);
        assert_eq!(t.ports[1].protocol, Protocol::Udp);
        assert_eq!(t.ports[1].cluster_ips, vec!["10.96.0.10".parse::<IpAddr>().unwrap()]);
        assert!(t.skipped.is_empty());
    }

    #[test]
    fn skips_what_kube_proxy_skips() {
        for yaml in [
            "metadata: {name: h}\nspec: {clusterIP: None, ports: [{port: 80}]}",
            "metadata: {name: e}\nspec: {type: ExternalName, externalName: x.example, ports: [{port: 80}]}",
            "metadata: {name: p, labels: {service.kubernetes.io/service-proxy-name: other}}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}",
            "metadata: {name: l, labels: {service.kubernetes.io/headless: ''}}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}",
            "metadata: {name: n}\nspec: {ports: [{port: 80}]}",
        ] {
            assert_eq!(translate(&service_yaml(yaml)).unwrap().ports, vec![], "{yaml}");
        }
    }

    #[test]
    fn malformed_ip_skips_the_whole_service() {
        let svc = service_yaml("metadata: {name: bad}\nspec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}");
        assert_eq!(translate(&svc), Err(Skip::InvalidIp("10.96.0.300".into())));
    }

    #[test]
    fn malformed_port_skips_that_port() {
        let svc = service_yaml(
            "metadata: {name: p}\nspec: {clusterIP: 10.96.0.1, ports: [{name: a, port: 70000}, {name: b, port: 0}, {name: c, port: 81, protocol: QUIC}, {name: d, port: 82}]}",
        );
        let t = translate(&svc).unwrap();
        assert_eq!(t.ports.iter().map(|p| p.port).collect::<Vec<_>>(), vec![82]);
        assert_eq!(
            t.skipped,
            vec![
                ("a".into(), Skip::InvalidPort(70000)),
                ("b".into(), Skip::InvalidPort(0)),
                ("c".into(), Skip::UnknownProtocol("QUIC".into())),
            ]
        );
    }

    #[test]
    fn external_fields_are_carried() {
        let svc = service_yaml(
            r#"
metadata: {name: lb}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.5
  externalIPs: [192.0.2.7]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  sessionAffinity: ClientIP
  ports: [{port: 443, nodePort: 30443}]
status:
  loadBalancer:
    ingress: [{ip: 198.51.100.1}, {ip: 198.51.100.2, ipMode: Proxy}]
"#,
        );
        let p = &translate(&svc).unwrap().ports[0];
        assert_eq!(p.node_port, Some(30443));
        assert_eq!(p.external_policy, TrafficPolicy::Local);
        assert_eq!(p.health_check_node_port, Some(32000));
        assert_eq!(p.session_affinity_timeout, Some(DEFAULT_AFFINITY_TIMEOUT));
        assert_eq!(p.load_balancer_ips, vec!["198.51.100.1".parse::<IpAddr>().unwrap()]);
        assert!(p.externally_accessible());
    }
}
