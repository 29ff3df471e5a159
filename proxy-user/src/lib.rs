//! kpr: a kube-proxy replacement on eBPF. The agent is a pipeline:
//! [`source`] (Kubernetes API or manifests) → [`model`] (kube-proxy's semantics) →
//! [`datapath::Programmer`] (ordered, minimal map writes) → [`datapath::bpf`] (the kernel).
pub mod agent;
pub mod config;
pub mod datapath;
pub mod events;
pub mod inspect;
pub mod model;
pub mod netlink;
pub mod netns;
pub mod servers;
pub mod settings;
pub mod shadow;
pub mod source;
pub mod takeover;
pub mod verify;

/// kpr's version and the commit it was built from (`kpr --version`, the agent's first log line).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("KPR_GIT_COMMIT"), ")");

/// SIGTERM (the kubelet stopping the pod, `kill`, `timeout`) or SIGINT (Ctrl-C): the agent's
/// (and the demo's) orderly shutdown.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
}
