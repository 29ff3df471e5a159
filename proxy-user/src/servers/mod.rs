//! The operator's HTTP servers, as kube-proxy's `pkg/proxy/healthcheck/` and `metrics/`:
//! `proxy_servers` binds kube-proxy's metrics and healthz addresses and routes their paths;
//! `proxy_health` is the proxy's own health (`/healthz`, `/livez`, kpr's `/readyz`);
//! `service_health` the healthCheckNodePort servers; `metrics` the registry behind
//! `/metrics`; `http_server` the bounded HTTP/1.1 server they all run on.
pub mod http_server;
pub mod metrics;
pub mod proxy_health;
pub mod proxy_servers;
pub mod service_health;
