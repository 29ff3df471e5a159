//! kube-proxy's healthCheckNodePort servers: for each LoadBalancer service with
//! externalTrafficPolicy=Local, an HTTP server on the node answering 200 when the node has
//! local endpoints and 503 when it has none, with kube-proxy's JSON body. Cloud load balancers
//! use it to send traffic only to nodes that can serve it.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpListener,
    task::JoinHandle,
};

use crate::model::ObjectKey;

type Shared = Arc<Mutex<BTreeMap<u16, (ObjectKey, usize)>>>;

#[derive(Default)]
pub struct HealthServers {
    state: Shared,
    servers: BTreeMap<u16, JoinHandle<()>>,
}

impl HealthServers {
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
                self.servers.insert(*port, tokio::spawn(serve(*port, self.state.clone())));
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

async fn serve(port: u16, state: Shared) {
    let listener = match TcpListener::bind(("0.0.0.0", port)).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(port, "failed to open the health check node port: {e}");
            return;
        }
    };
    loop {
        let Ok((mut conn, _)) = listener.accept().await else { continue };
        let state = state.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf).await;
            let entry = state.lock().expect("not poisoned").get(&port).cloned();
            let Some((service, local)) = entry else { return };
            let _ = conn.write_all(response(&service, local).as_bytes()).await;
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
