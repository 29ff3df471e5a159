//! `kpr`: the agent and its operator commands.
use std::{path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand};
use kpr::{
    agent::{self, AgentConfig, SourceConfig},
    datapath::bpf::{self, DatapathConfig},
};
use proxy_common::defaults;

#[derive(Parser)]
#[command(name = "kpr", version, about = "kube-proxy replacement on eBPF")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Watch Services and EndpointSlices and program the datapath.
    Agent(AgentArgs),
    /// Show the programmed service ports, their backends and the datapath counters.
    Services {
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
    },
    /// Detach kpr and remove its pinned maps (like `kube-proxy --cleanup`).
    Cleanup {
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
    },
    /// The built-in demo: pods in network namespaces behind a ClusterIP, on this machine only.
    Demo {
        /// Keep the demo up (for `bpftool` and `kpr services`) until Ctrl-C.
        #[arg(long)]
        keep_running: bool,
    },
}

#[derive(clap::Args)]
struct AgentArgs {
    /// Read Services and EndpointSlices from this directory of manifests instead of the API.
    #[arg(long, conflicts_with = "kubeconfig")]
    manifests: Option<PathBuf>,
    /// Kubeconfig of the cluster; without it (and without --manifests) the in-cluster config or
    /// KUBECONFIG is used.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// cgroup2 directory whose sockets are load-balanced [default: the cgroup2 root].
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// bpffs directory for kpr's pinned maps and links (a layout version is appended).
    #[arg(long, default_value = "/sys/fs/bpf/kpr")]
    pin_root: PathBuf,
    /// This node's name (endpoint locality).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    #[arg(long, default_value_t = defaults::MAX_SERVICE_PORTS)]
    max_service_ports: u32,
    #[arg(long, default_value_t = defaults::MAX_BACKENDS)]
    max_backends: u32,
    #[arg(long, default_value_t = defaults::MAX_SOCK_REVNAT)]
    max_sock_revnat: u32,
    /// Per-packet conntrack entries (two per flow through NodePort/external frontends).
    #[arg(long, default_value_t = defaults::MAX_CONNTRACK)]
    max_conntrack: u32,
    /// Interfaces for the per-packet datapath (NodePort, externalIPs, LoadBalancer IPs),
    /// comma-separated [default: the interfaces holding the --node-ip addresses; without
    /// --node-ip the per-packet datapath is off].
    #[arg(long, value_delimiter = ',')]
    interfaces: Vec<String>,
    /// This node's IPv4 addresses (NodePorts listen on them; masquerade uses the first).
    #[arg(long = "node-ip")]
    node_ips: Vec<std::net::Ipv4Addr>,
    /// The pods' IPv4 range (like kube-proxy's --cluster-cidr): traffic from it to external
    /// addresses is in-cluster traffic and goes to all endpoints.
    #[arg(long, value_parser = parse_cidr)]
    cluster_cidr: Option<(std::net::Ipv4Addr, u8)>,
    /// Seconds between full reconciles of the maps against the desired state.
    #[arg(long, default_value_t = 30)]
    reconcile_interval: u64,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    match Cli::parse().command {
        Command::Agent(args) => run_agent(args).await,
        Command::Services { pin_root } => show_services(&pin_root),
        Command::Cleanup { pin_root } => {
            bpf::cleanup(&pin_root)?;
            println!("removed kpr's pins under {}", pin_root.display());
            Ok(())
        }
        Command::Demo { keep_running } => kpr::demo::run(keep_running).await,
    }
}

async fn run_agent(args: AgentArgs) -> Result<()> {
    let cgroup = match args.cgroup {
        Some(c) => c,
        None => bpf::cgroup2_root()?,
    };
    let mut datapath = DatapathConfig::new(args.pin_root, cgroup);
    datapath.max_service_ports = args.max_service_ports;
    datapath.max_backends = args.max_backends;
    datapath.max_sock_revnat = args.max_sock_revnat;
    datapath.max_conntrack = args.max_conntrack;
    datapath.tc_interfaces = if args.interfaces.is_empty() {
        kpr::datapath::bpf::interfaces_holding(&args.node_ips)?
    } else {
        args.interfaces
    };
    datapath.node_ips = args.node_ips;
    datapath.cluster_cidr = args.cluster_cidr;
    let source = match args.manifests {
        Some(dir) => SourceConfig::Manifests(dir),
        None => SourceConfig::Kube { kubeconfig: args.kubeconfig },
    };
    let node_name = match args.node_name {
        Some(n) => n,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")?.trim().to_owned(),
    };
    let cfg =
        AgentConfig { source, datapath, node_name, reconcile_interval: Duration::from_secs(args.reconcile_interval) };
    agent::run(cfg, shutdown_signal()).await
}

fn parse_cidr(s: &str) -> Result<(std::net::Ipv4Addr, u8), String> {
    let (addr, len) = s.split_once('/').ok_or("expected A.B.C.D/N")?;
    let len: u8 = len.parse().map_err(|_| "bad prefix length")?;
    if len > 32 {
        return Err("prefix length over 32".into());
    }
    Ok((addr.parse().map_err(|_| "bad address")?, len))
}

/// SIGTERM (the kubelet stopping the pod) or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
}

fn show_services(pin_root: &std::path::Path) -> Result<()> {
    print!("{}", kpr::status::render(pin_root)?);
    Ok(())
}
