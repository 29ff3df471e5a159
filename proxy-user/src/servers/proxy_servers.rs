//! kube-proxy's two servers, at kube-proxy's addresses:
//! - `metricsBindAddress` (default `127.0.0.1:10249`): `/metrics`, `/proxyMode` (`kpr`),
//!   `/configz` (the effective configuration), `/healthz` (`ok`: the process answers), `/shadow`
//!   (shadow mode's last comparison, [`crate::shadow`]), and
//!   `/livez` and `/readyz` as on the healthz server: on loopback by default, where no pod can
//!   hold connections to them, so the DaemonSet's probes use these;
//! - `healthzBindAddress` (default `0.0.0.0:10256`): `/healthz` and `/livez` ([`ProxyHealth`]),
//!   and kpr's `/readyz` (synced once: the DaemonSet's readiness probe).
//!
//! Both are bound before the agent starts, so a port in use or an address the node does not
//! have is a startup error, not a silent gap in monitoring.
use std::{net::SocketAddr, sync::Arc};

use anyhow::Result;
use http::StatusCode;
use tokio::task::JoinHandle;

use super::{
    http_server::{self, Handler, Limits},
    metrics::Metrics,
    proxy_health::ProxyHealth,
};

/// What `/proxyMode` answers: the proxy that programs this node.
pub const PROXY_MODE: &str = "kpr";

/// The OpenMetrics text format, which Prometheus negotiates.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

const TEXT: &str = "text/plain; charset=utf-8";

/// The servers' listeners, bound; `None` where the address is not set.
pub struct Listeners {
    metrics: Option<tokio::net::TcpListener>,
    healthz: Option<tokio::net::TcpListener>,
}

impl Listeners {
    pub async fn bind(metrics: Option<SocketAddr>, healthz: Option<SocketAddr>) -> Result<Self> {
        let metrics = match metrics {
            Some(addr) => Some(http_server::bind(addr, "metrics").await?),
            None => None,
        };
        let healthz = match healthz {
            Some(addr) => Some(http_server::bind(addr, "healthz").await?),
            None => None,
        };
        Ok(Self { metrics, healthz })
    }

    /// Serve until the returned tasks are aborted. `configz`: the effective configuration;
    /// `extra`: one more path of the metrics server (shadow mode's `/shadow`).
    pub fn serve(
        self,
        metrics: Arc<Metrics>,
        health: Arc<ProxyHealth>,
        configz: serde_json::Value,
        extra: Option<(&'static str, Handler)>,
    ) -> Vec<JoinHandle<()>> {
        let limits = Limits { connections: 64, ..Limits::default() };
        let mut tasks = Vec::new();
        if let Some(listener) = self.metrics {
            let configz = serde_json::to_vec(&configz).expect("serializable");
            let health = health.clone();
            let handler: Handler = Arc::new(move |request| match request.uri.path() {
                path if extra.as_ref().is_some_and(|(at, _)| *at == path) => {
                    extra.as_ref().map(|(_, serve)| serve(request)).unwrap_or_else(http_server::not_found)
                }
                "/metrics" => http_server::reply(StatusCode::OK, OPENMETRICS, metrics.encode()),
                "/proxyMode" => http_server::reply(StatusCode::OK, TEXT, PROXY_MODE),
                "/configz" => http_server::reply(StatusCode::OK, "application/json", configz.clone()),
                "/service-ports" => http_server::json(StatusCode::OK, &metrics.service_port_names()),
                "/sidelined" => http_server::json(StatusCode::OK, &metrics.sidelined_now()),
                "/healthz" => http_server::reply(StatusCode::OK, TEXT, "ok"),
                path => probe(&health, path).unwrap_or_else(http_server::not_found),
            });
            tasks.push(http_server::spawn(listener, limits, http_server::Pool::new(&limits), handler));
        }
        if let Some(listener) = self.healthz {
            let handler: Handler = Arc::new(move |request| match request.uri.path() {
                "/healthz" => {
                    let (status, report) = health.healthz();
                    http_server::json(status, &report)
                }
                path => probe(&health, path).unwrap_or_else(http_server::not_found),
            });
            tasks.push(http_server::spawn(listener, limits, http_server::Pool::new(&limits), handler));
        }
        tasks
    }
}

/// `/livez` and `/readyz`, the kubelet's probes, served alike by both servers.
fn probe(health: &ProxyHealth, path: &str) -> Option<http_server::Reply> {
    let (status, report) = match path {
        "/livez" => health.livez(),
        "/readyz" => health.readyz(),
        _ => return None,
    };
    Some(http_server::json(status, &report))
}
