//! kube-proxy's healthCheckNodePort servers: for each LoadBalancer service with
//! externalTrafficPolicy=Local, an HTTP server on the node answering 200 when the node has
//! local endpoints and 503 when it has none, with kube-proxy's JSON body. Cloud load balancers
//! use it to send traffic only to nodes that can serve it.
//!
//! The servers listen on every address, so they are bounded: at most `Limits::connections`
//! connections at once over all ports (more wait in the listen backlog), each given
//! `Limits::timeout` to send its request and take the answer; a failing `accept()` (out of file
//! descriptors) backs off instead of spinning.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpListener,
    sync::Semaphore,
    task::JoinHandle,
};

use crate::model::ObjectKey;

type Shared = Arc<Mutex<BTreeMap<u16, (ObjectKey, usize)>>>;

/// How much the servers take on.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once, over all ports.
    pub connections: usize,
    /// Time a connection has to send its request and read the answer.
    pub timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self { connections: 256, timeout: Duration::from_secs(5) }
    }
}

pub struct HealthServers {
    state: Shared,
    servers: BTreeMap<u16, JoinHandle<()>>,
    limits: Limits,
    permits: Arc<Semaphore>,
}

impl Default for HealthServers {
    fn default() -> Self {
        Self::with_limits(Limits::default())
    }
}

impl HealthServers {
    pub fn with_limits(limits: Limits) -> Self {
        Self { state: Shared::default(), servers: BTreeMap::new(), limits, permits: Arc::new(Semaphore::new(limits.connections)) }
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
        for port in wanted.keys() {
            if !self.servers.contains_key(port) {
                let server = serve(*port, self.state.clone(), self.limits, self.permits.clone());
                self.servers.insert(*port, tokio::spawn(server));
            }
        }
        *self.state.lock().expect("not poisoned") = wanted;
    }
}

impl Drop for HealthServers {
    fn drop(&mut self) {
        for server in self.servers.values() {
            server.abort();
        }
    }
}

async fn serve(port: u16, state: Shared, limits: Limits, permits: Arc<Semaphore>) {
    let listener = match TcpListener::bind(("0.0.0.0", port)).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(port, "failed to open the health check node port: {e}");
            return;
        }
    };
    let mut backoff = Duration::from_millis(10);
    loop {
        // A connection slot first: past the cap, clients wait in the listen backlog.
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let mut conn = match listener.accept().await {
            Ok((conn, _)) => {
                backoff = Duration::from_millis(10);
                conn
            }
            Err(e) => {
                tracing::warn!(port, "health check node port: accept failed: {e}; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let answer = async {
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf).await;
                let entry = state.lock().expect("not poisoned").get(&port).cloned();
                let Some((service, local)) = entry else { return };
                let _ = conn.write_all(response(&service, local).as_bytes()).await;
            };
            let _ = tokio::time::timeout(limits.timeout, answer).await;
        });
    }
}

/// The HTTP response kube-proxy's health check server sends.
pub fn response(service: &ObjectKey, local_endpoints: usize) -> String {
    let status = if local_endpoints > 0 { "200 OK" } else { "503 Service Unavailable" };
    let body = format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {:?},\n\t\t\"name\": {:?}\n\t}},\n\t\"localEndpoints\": {local_endpoints},\n\t\"serviceProxyHealthy\": true\n}}",
        service.namespace, service.name
    );
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nX-Content-Type-Options: nosniff\r\n\
         X-Load-Balancing-Endpoint-Weight: {local_endpoints}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
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
        tokio::time::timeout(Duration::from_secs(5), probe.read_to_string(&mut answer)).await.expect("answered").unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(started.elapsed() >= Duration::from_millis(300), "it waited for a slot: the cap holds");
    }

    #[test]
    fn kube_proxy_compatible_response() {
        let key = super::ObjectKey::new("shop", "web");
        let ok = super::response(&key, 2);
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.contains("X-Load-Balancing-Endpoint-Weight: 2\r\n"));
        let body = ok.split_once("\r\n\r\n").unwrap().1;
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"service": {"namespace": "shop", "name": "web"}, "localEndpoints": 2, "serviceProxyHealthy": true})
        );
        assert!(super::response(&key, 0).starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
    }
}
