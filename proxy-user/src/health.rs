//! kube-proxy's healthCheckNodePort servers: for each LoadBalancer service with
//! externalTrafficPolicy=Local, an HTTP server on the node answering 200 when the node has
//! local endpoints (and the proxy itself is healthy) and 503 otherwise, with kube-proxy's JSON
//! body. Cloud load balancers use it to send traffic only to nodes that can serve it. The
//! servers listen on every address, so they share one bounded pool of connections
//! ([`http_server::Limits`]).
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use http::StatusCode;
use tokio::{sync::Semaphore, task::JoinHandle};

pub use crate::http_server::Limits;
use crate::{
    http_server::{self, Reply},
    model::ObjectKey,
    proxy_health::ProxyHealth,
};

type Shared = Arc<Mutex<BTreeMap<u16, (ObjectKey, usize)>>>;

pub struct HealthServers {
    state: Shared,
    servers: BTreeMap<u16, JoinHandle<()>>,
    limits: Limits,
    permits: Arc<Semaphore>,
    /// The proxy's own health (`serviceProxyHealthy`); healthy when absent.
    proxy: Option<Arc<ProxyHealth>>,
}

impl Default for HealthServers {
    fn default() -> Self {
        Self::with_limits(Limits::default())
    }
}

impl HealthServers {
    pub fn with_limits(limits: Limits) -> Self {
        let permits = Arc::new(Semaphore::new(limits.connections));
        Self { state: Shared::default(), servers: BTreeMap::new(), limits, permits, proxy: None }
    }

    /// Answer 503 on every port while the proxy is unhealthy, as kube-proxy does.
    pub fn with_proxy_health(mut self, proxy: Arc<ProxyHealth>) -> Self {
        self.proxy = Some(proxy);
        self
    }

    /// Serve exactly the ports of `wanted` (port → service, local endpoints).
    pub fn update(&mut self, wanted: BTreeMap<u16, (ObjectKey, usize)>) {
        for (port, server) in std::mem::take(&mut self.servers) {
            if wanted.contains_key(&port) {
                self.servers.insert(port, server);
            } else {
                server.abort();
            }
        }
        for &port in wanted.keys() {
            if !self.servers.contains_key(&port) {
                let (state, proxy) = (self.state.clone(), self.proxy.clone());
                let handler: http_server::Handler = Arc::new(move |_request| {
                    let entry = state.lock().unwrap_or_else(|p| p.into_inner()).get(&port).cloned();
                    let healthy = proxy.as_ref().is_none_or(|p| p.healthy_at(std::time::SystemTime::now()));
                    match entry {
                        Some((service, local)) => response(&service, local, healthy),
                        None => http_server::not_found(),
                    }
                });
                let (limits, permits) = (self.limits, self.permits.clone());
                let service = wanted[&port].0.to_string();
                let server = tokio::spawn(async move {
                    match tokio::net::TcpListener::bind(("0.0.0.0", port)).await {
                        Ok(listener) => http_server::serve(listener, limits, permits, handler).await,
                        Err(e) => tracing::error!(port, %service, "failed to open the health check node port: {e}"),
                    }
                });
                self.servers.insert(port, server);
            }
        }
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = wanted;
    }
}

impl Drop for HealthServers {
    fn drop(&mut self) {
        for server in self.servers.values() {
            server.abort();
        }
    }
}

/// The answer kube-proxy's health check server gives.
pub fn response(service: &ObjectKey, local_endpoints: usize, proxy_healthy: bool) -> Reply {
    let ok = local_endpoints > 0 && proxy_healthy;
    let body = serde_json::json!({
        "service": {"namespace": service.namespace, "name": service.name},
        "localEndpoints": local_endpoints,
        "serviceProxyHealthy": proxy_healthy,
    });
    let status = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let mut reply = http_server::json(status, &body);
    reply.headers_mut().insert("X-Load-Balancing-Endpoint-Weight", local_endpoints.into());
    reply
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tokio::{
        io::{AsyncReadExt as _, AsyncWriteExt as _},
        net::TcpStream,
    };

    #[tokio::test]
    async fn idle_connections_cannot_starve_the_server() {
        let limits = super::Limits { connections: 8, timeout: Duration::from_millis(300) };
        let mut servers = super::HealthServers::with_limits(limits);
        // A free port for the test.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        servers.update([(port, (super::ObjectKey::new("shop", "web"), 1))].into());
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Forty idle clients: more than the cap; they never send a request.
        let mut idle = Vec::new();
        for _ in 0..40 {
            idle.push(TcpStream::connect(("127.0.0.1", port)).await.unwrap());
        }
        // A load balancer's probe is still answered: the idle ones time out and free their
        // slots (40 idle / 8 slots × 300 ms, well within the deadline).
        let started = Instant::now();
        let mut probe = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        probe.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), probe.read_to_string(&mut answer))
            .await
            .expect("answered")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(started.elapsed() >= Duration::from_millis(300), "it waited for a slot: the cap holds");
    }

    #[tokio::test]
    async fn kube_proxy_compatible_response() {
        use http_body_util::BodyExt as _;
        let key = super::ObjectKey::new("shop", "web");
        let ok = super::response(&key, 2, true);
        assert_eq!(ok.status(), 200);
        assert_eq!(ok.headers()["X-Load-Balancing-Endpoint-Weight"], "2");
        assert_eq!(ok.headers()["Content-Type"], "application/json");
        let body = ok.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"service": {"namespace": "shop", "name": "web"}, "localEndpoints": 2, "serviceProxyHealthy": true})
        );
        assert_eq!(super::response(&key, 0, true).status(), 503);
        assert_eq!(super::response(&key, 2, false).status(), 503, "an unhealthy proxy fails every health check");
    }
}
