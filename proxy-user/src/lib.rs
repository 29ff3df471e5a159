//! kpr: a kube-proxy replacement on eBPF. The agent is a pipeline:
//! [`source`] (Kubernetes API or manifests) → [`model`] (kube-proxy's semantics) →
//! [`datapath::Programmer`] (ordered, minimal map writes) → [`datapath::bpf`] (the kernel).
pub mod agent;
pub mod config;
pub mod datapath;
pub mod demo;
pub mod events;
pub mod health;
pub mod http_server;
pub mod inspect;
pub mod metrics;
pub mod model;
pub mod netlink;
pub mod proxy_health;
pub mod proxy_servers;
pub mod source;
pub mod takeover;
pub mod testbed;
