//! kube-proxy's healthCheckNodePort servers: for each LoadBalancer service with
//! externalTrafficPolicy=Local, an HTTP server on the node answering 200 when the node has
//! local endpoints (and the proxy itself is healthy) and 503 otherwise, with kube-proxy's JSON
//! body. Cloud load balancers use it to send traffic only to nodes that can serve it. Each
//! listens on every address of both families (`[::]`, dual-stack, as kube-proxy's Go listener
//! on `:port`), or, with `nodePortAddresses`, on each of the node's addresses they match, as
//! kube-proxy's (`newServiceHealthServer`); with a bounded pool of its own ([`http_server::Limits`]: per source address,
//! short header timeout), so that clients holding connections to one port cannot make a load
//! balancer drain the node from another. A port that could not be bound is tried again at
//! the next update.
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
};

use http::StatusCode;
use tokio::task::JoinHandle;

pub use super::http_server::Limits;
use super::{
    http_server::{self, Reply},
    proxy_health::ProxyHealth,
};
use crate::model::ObjectKey;

type Shared = Arc<Mutex<BTreeMap<u16, (ObjectKey, usize)>>>;

/// Where the health check ports listen.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum BindTo {
    /// Every address of both families (no `nodePortAddresses`).
    #[default]
    Any,
    /// These node addresses only (those `nodePortAddresses` matches).
    Addresses(Vec<IpAddr>),
}

pub struct HealthServers {
    state: Shared,
    servers: BTreeMap<u16, JoinHandle<()>>,
    bind: BindTo,
    limits: Limits,
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
        Self { state: Shared::default(), servers: BTreeMap::new(), bind: BindTo::Any, limits, proxy: None }
    }

    /// Answer 503 on every port while the proxy is unhealthy, as kube-proxy does.
    pub fn with_proxy_health(mut self, proxy: Arc<ProxyHealth>) -> Self {
        self.proxy = Some(proxy);
        self
    }

    /// Serve exactly the ports of `wanted` (port → service, local endpoints), on `bind`'s
    /// addresses (a change of them opens every port again).
    pub fn update(&mut self, wanted: BTreeMap<u16, (ObjectKey, usize)>, bind: &BindTo) {
        let rebind = *bind != self.bind;
        self.bind = bind.clone();
        for (port, server) in std::mem::take(&mut self.servers) {
            // A server that ended could not bind its port: started again below.
            if wanted.contains_key(&port) && !server.is_finished() && !rebind {
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
                let limits = self.limits;
                let service = wanted[&port].0.to_string();
                let bind = self.bind.clone();
                let server = tokio::spawn(async move {
                    match listen(&bind, port) {
                        Ok(listeners) => {
                            // One pool for the port, whichever address a client comes to.
                            let pool = http_server::Pool::new(&limits);
                            let serving = listeners
                                .into_iter()
                                .map(|listener| http_server::serve(listener, limits, pool.clone(), handler.clone()));
                            futures::future::join_all(serving).await;
                        }
                        Err(e) => tracing::error!(
                            port,
                            %service,
                            "failed to open the health check node port (tried again at the next sync): {e}"
                        ),
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

/// The listeners of health check port `port`: every address, or each of `bind`'s (all of them
/// or none: a port open on some addresses only is tried again whole).
fn listen(bind: &BindTo, port: u16) -> std::io::Result<Vec<tokio::net::TcpListener>> {
    match bind {
        BindTo::Any => Ok(vec![bind_dual_stack(port)?]),
        BindTo::Addresses(addrs) => addrs
            .iter()
            .map(|ip| {
                let addr = SocketAddr::new(*ip, port);
                let socket =
                    if ip.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
                socket.set_reuseaddr(true)?;
                socket.bind(addr).map_err(|e| std::io::Error::new(e.kind(), format!("{addr}: {e}")))?;
                socket.listen(1024)
            })
            .collect(),
    }
}

/// A listener on `port` of every address of both families (`[::]` without IPV6_V6ONLY), or of
/// IPv4 alone on a node without IPv6.
fn bind_dual_stack(port: u16) -> std::io::Result<tokio::net::TcpListener> {
    let any6 = std::net::SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port));
    let socket = match tokio::net::TcpSocket::new_v6() {
        Ok(socket) => socket,
        Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.set_reuseaddr(true)?;
            socket.bind((std::net::Ipv4Addr::UNSPECIFIED, port).into())?;
            return socket.listen(1024);
        }
        Err(e) => return Err(e),
    };
    socket.set_reuseaddr(true)?;
    // SAFETY: setsockopt on a socket we own, with an int option value.
    let off: libc::c_int = 0;
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            libc::IPPROTO_IPV6,
            libc::IPV6_V6ONLY,
            (&raw const off).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    socket.bind(any6)?;
    socket.listen(1024)
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

    /// A health check port (a free one) for `shop/web` with one local endpoint, listening.
    async fn serving_one(limits: super::Limits) -> (super::HealthServers, u16) {
        let mut servers = super::HealthServers::with_limits(limits);
        let port = std::net::TcpListener::bind("[::]:0").unwrap().local_addr().unwrap().port();
        servers.update([(port, (super::ObjectKey::new("shop", "web"), 1))].into(), &super::BindTo::Any);
        tokio::time::sleep(Duration::from_millis(100)).await;
        (servers, port)
    }

    /// 1,100 connections held open from one address (a pod, an outside client) cost it its
    /// share; a probe from another address is answered at once, over IPv4 and over IPv6
    /// (the port is dual-stack); those idle past the header timeout are closed.
    #[tokio::test]
    async fn connections_held_open_cannot_make_the_node_drain() {
        let limits = super::Limits {
            connections: 64,
            per_source: 4,
            header_timeout: Duration::from_millis(300),
            timeout: Duration::from_secs(5),
        };
        let (_servers, port) = serving_one(limits).await;
        // From 127.0.0.2: held open, never a request (1,100 descriptors here: the soft limit
        // raised to the hard one, as the agent does).
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit/setrlimit read and write one rlimit.
        unsafe {
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
        let mut held = Vec::new();
        for _ in 0..1100 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            held.push(socket.connect(([127, 0, 0, 1], port).into()).await.unwrap());
        }
        let probe = |addr: std::net::SocketAddr| async move {
            let started = Instant::now();
            let mut probe = TcpStream::connect(addr).await.unwrap();
            probe.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await.unwrap();
            let mut answer = String::new();
            tokio::time::timeout(Duration::from_secs(2), probe.read_to_string(&mut answer))
                .await
                .expect("answered")
                .unwrap();
            (answer, started.elapsed())
        };
        for addr in [([127, 0, 0, 1], port).into(), (std::net::Ipv6Addr::LOCALHOST, port).into()] {
            let (answer, took) = probe(addr).await;
            assert!(answer.starts_with("HTTP/1.1 200 OK"), "{addr}: {answer}");
            assert!(took < Duration::from_millis(250), "{addr}: answered at once, not after the held ones: {took:?}");
        }
        // The held connections: all but 4 closed at once, and those 4 after the header timeout.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let mut open = 0;
        for conn in &mut held {
            let mut byte = [0u8; 1];
            // Nothing within a millisecond: still open (a closed one reads EOF or a reset).
            if tokio::time::timeout(Duration::from_millis(1), conn.read(&mut byte)).await.is_err() {
                open += 1;
            }
        }
        assert_eq!(open, 0, "every held connection closed");
    }

    #[tokio::test]
    async fn idle_connections_cannot_starve_the_server() {
        let limits = super::Limits {
            connections: 8,
            per_source: 64,
            header_timeout: Duration::from_millis(300),
            timeout: Duration::from_secs(4),
        };
        let (_servers, port) = serving_one(limits).await;
        // Forty idle clients: more than the cap; they never send a request.
        let mut idle = Vec::new();
        for _ in 0..40 {
            idle.push(TcpStream::connect(("127.0.0.1", port)).await.unwrap());
        }
        // A load balancer's probe is still answered: it waits for a slot, which the idle ones
        // give up at their header timeout (the cap holds: 8 slots for 41 connections).
        let started = Instant::now();
        let mut probe = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        probe.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), probe.read_to_string(&mut answer))
            .await
            .expect("answered")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(started.elapsed() >= Duration::from_millis(250), "it waited for a slot: the cap holds");
    }

    /// With `nodePortAddresses`, a health check port listens on the matching node addresses
    /// only, as kube-proxy's: here 127.0.0.1 and not 127.0.0.2 (both local); a change of the
    /// addresses opens the port again where they say.
    #[tokio::test]
    async fn with_node_port_addresses_the_port_listens_on_those_addresses_only() {
        let answers = |ip: [u8; 4], port: u16| async move {
            let Ok(mut conn) = TcpStream::connect((std::net::Ipv4Addr::from(ip), port)).await else {
                return None;
            };
            conn.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await.unwrap();
            let mut answer = String::new();
            tokio::time::timeout(Duration::from_secs(2), conn.read_to_string(&mut answer)).await.ok()?.ok()?;
            Some(answer.lines().next().unwrap_or_default().to_owned())
        };
        let mut servers = super::HealthServers::default();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let wanted = || [(port, (super::ObjectKey::new("shop", "web"), 1))].into();
        let only = super::BindTo::Addresses(vec!["127.0.0.1".parse().unwrap()]);
        servers.update(wanted(), &only);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(answers([127, 0, 0, 1], port).await.as_deref(), Some("HTTP/1.1 200 OK"));
        assert_eq!(answers([127, 0, 0, 2], port).await, None, "not a NodePort address: refused");
        servers.update(wanted(), &super::BindTo::Any);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(answers([127, 0, 0, 2], port).await.as_deref(), Some("HTTP/1.1 200 OK"), "every address");
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
