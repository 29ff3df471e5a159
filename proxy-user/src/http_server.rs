//! The agent's HTTP servers (kube-proxy's metrics, healthz and healthCheckNodePort servers):
//! HTTP/1.1 with hyper on a listener bound at startup. Some listen on every address, so they
//! are bounded: at most `Limits::connections` connections at once per pool (more wait in the
//! listen backlog), each given `Limits::timeout` to send its request and take the answer; a
//! failing `accept()` (out of file descriptors) backs off instead of spinning.
use std::{convert::Infallible, net::SocketAddr, sync::Arc, time::Duration};

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
    /// Connections served at once, over all servers sharing the permits.
    pub connections: usize,
    /// Time a connection has to send its request and read the answer.
    pub timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self { connections: 256, timeout: Duration::from_secs(5) }
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
pub fn spawn(listener: TcpListener, limits: Limits, permits: Arc<Semaphore>, handler: Handler) -> JoinHandle<()> {
    tokio::spawn(serve(listener, limits, permits, handler))
}

/// Serve `listener` until the future is dropped.
pub async fn serve(listener: TcpListener, limits: Limits, permits: Arc<Semaphore>, handler: Handler) {
    let mut backoff = Duration::from_millis(10);
    loop {
        // A connection slot first: past the cap, clients wait in the listen backlog.
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                backoff = Duration::from_millis(10);
                stream
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
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let reply = handler(&request.into_parts().0);
                async move { Ok::<_, Infallible>(reply) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
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
