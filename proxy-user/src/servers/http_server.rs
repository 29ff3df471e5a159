//! The agent's HTTP servers (kube-proxy's metrics, healthz and healthCheckNodePort servers):
//! HTTP/1.1 with hyper on a listener bound at startup. Some listen on every address, where a
//! pod or an outside client can hold connections open, so they are bounded and a few clients
//! cannot starve the rest (a load balancer's probe, the kubelet's): every connection is
//! accepted at once; one past `Limits::per_source` from one address is closed at once
//! instead of waiting in the listen backlog ahead of other clients, and one that finds the
//! pool's `Limits::connections` taken waits for a slot (first come, first served) for at most
//! `Limits::timeout`; a served connection has `Limits::header_timeout` to send its request
//! headers and `Limits::timeout` in all. A failing `accept()` (out of file descriptors) backs off instead
//! of spinning.
use std::{
    collections::HashMap,
    convert::Infallible,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context as _, Result};
use bytes::Bytes;
use http::{Response, StatusCode, header, request::Parts};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, sync::Semaphore, task::JoinHandle};

pub type Reply = Response<Full<Bytes>>;

/// Answers a request from its method, path and headers (no server here reads a body).
pub type Handler = Arc<dyn Fn(&Parts) -> Reply + Send + Sync>;

/// How much one pool of servers takes on.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once, over all servers sharing the pool.
    pub connections: usize,
    /// Connections served at once from one source address.
    pub per_source: usize,
    /// Time a connection has to send its request headers.
    pub header_timeout: Duration,
    /// Time a connection has to send its request and read the answer.
    pub timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connections: 256,
            per_source: 8,
            header_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(5),
        }
    }
}

/// The connections a pool serves now: in all (permits) and by source address.
#[derive(Debug)]
pub struct Pool {
    permits: Arc<Semaphore>,
    by_source: Mutex<HashMap<IpAddr, usize>>,
}

impl Pool {
    pub fn new(limits: &Limits) -> Arc<Self> {
        Arc::new(Self { permits: Arc::new(Semaphore::new(limits.connections)), by_source: Mutex::default() })
    }

    /// A place for a connection from `source`, if the source has room; it is served once
    /// it has a permit of the pool too.
    fn admit(self: &Arc<Self>, source: IpAddr, per_source: usize) -> Option<Slot> {
        let mut by_source = self.by_source.lock().unwrap_or_else(|p| p.into_inner());
        let held = by_source.entry(source).or_insert(0);
        if *held >= per_source {
            return None;
        }
        *held += 1;
        Some(Slot { pool: self.clone(), source })
    }
}

/// A connection's place in its pool's count by source, given back on drop.
struct Slot {
    pool: Arc<Pool>,
    source: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut by_source = self.pool.by_source.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(held) = by_source.get_mut(&self.source) {
            *held -= 1;
            if *held == 0 {
                by_source.remove(&self.source);
            }
        }
    }
}

/// Bind `addr` for `what`, with an error that says which server and address failed (a port in
/// use, an address this node does not have, a family the node has no address of).
pub async fn bind(addr: SocketAddr, what: &str) -> Result<TcpListener> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to serve {what} on {addr} (the {what} bind address)"))?;
    tracing::info!(address = %listener.local_addr()?, "serving {what}");
    Ok(listener)
}

/// Serve `listener` until the task is aborted.
pub fn spawn(listener: TcpListener, limits: Limits, pool: Arc<Pool>, handler: Handler) -> JoinHandle<()> {
    tokio::spawn(serve(listener, limits, pool, handler))
}

/// Serve `listener` until the future is dropped.
pub async fn serve(listener: TcpListener, limits: Limits, pool: Arc<Pool>, handler: Handler) {
    let mut backoff = Duration::from_millis(10);
    loop {
        let (stream, slot) = match listener.accept().await {
            Ok((stream, peer)) => {
                backoff = Duration::from_millis(10);
                // Past the source's share: closed now, so that it holds no place in the
                // backlog ahead of other clients.
                match pool.admit(peer.ip().to_canonical(), limits.per_source) {
                    Some(slot) => (stream, slot),
                    None => {
                        drop(stream);
                        continue;
                    }
                }
            }
            Err(e) => {
                let addr = listener.local_addr().ok();
                tracing::warn!(?addr, "accept failed: {e}; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let handler = handler.clone();
        let permits = pool.permits.clone();
        tokio::spawn(async move {
            let _slot = slot;
            // The pool full: slots free at the latest when their connections' header timeout
            // ends (first come, first served); past the whole timeout, this one is closed.
            let Ok(Ok(_permit)) = tokio::time::timeout(limits.timeout, permits.acquire_owned()).await else {
                return;
            };
            let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let reply = handler(&request.into_parts().0);
                async move { Ok::<_, Infallible>(reply) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(limits.timeout, connection).await;
        });
    }
}

/// A reply with a body of `content_type`.
pub fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Reply {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .header(header::X_CONTENT_TYPE_OPTIONS, "nosniff")
        .body(Full::new(body.into()))
        .expect("static headers are valid")
}

/// A JSON reply, as kube-proxy's health servers send them.
pub fn json(status: StatusCode, body: &impl serde::Serialize) -> Reply {
    reply(status, "application/json", serde_json::to_vec(body).expect("serializable"))
}

pub fn not_found() -> Reply {
    reply(StatusCode::NOT_FOUND, "text/plain; charset=utf-8", "404 page not found\n")
}
