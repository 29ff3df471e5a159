//! `kpr`: the agent and its operator commands.
use std::{path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand};
use kpr::{
    agent,
    datapath::bpf,
    settings::{AgentArgs, agent_config, parse_duration},
};

#[derive(Parser)]
#[command(name = "kpr", version = kpr::VERSION, about = "kube-proxy replacement on eBPF")]
struct Cli {
    /// Log lines as text or as JSON objects (for log collectors); kube-proxy's
    /// `--logging-format` too.
    #[arg(long, alias = "logging-format", global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Watch Services and EndpointSlices and program the datapath.
    Agent(AgentArgs),
    /// One screen on kpr on this node: agent up and synced, attachments, fallbacks in force,
    /// map occupancy, counters that signal trouble.
    Status {
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
        /// The agent's health server (`healthzBindAddress`), for `/readyz` and `/healthz`.
        #[arg(long, default_value = "127.0.0.1:10256")]
        healthz_address: std::net::SocketAddr,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Shadow mode (`kpr agent --shadow`): kpr's plan against the running kube-proxy.
    Shadow {
        #[command(subcommand)]
        action: ShadowAction,
    },
    /// Show the programmed service ports, their backends and the datapath counters.
    Services {
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
        /// The agent's metrics server (`metricsBindAddress`), asked for the Service port each
        /// frontend serves; without an answer, frontends are shown by address only.
        #[arg(long, default_value = "127.0.0.1:10249")]
        metrics_address: std::net::SocketAddr,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Ask the running agent to check its datapath now: a synthetic new connection per
    /// frontend and source class through the live per-packet programs, compared with what
    /// kube-proxy would do; a mismatch is resynced. Exits 1 when a probe failed.
    Verify {
        /// The agent's metrics server (`metricsBindAddress`).
        #[arg(long, default_value = "127.0.0.1:10249")]
        metrics_address: std::net::SocketAddr,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// The agent's socket path probes (`kpr verify`): connect from CGROUP to the frontends
    /// read from standard input (JSON), sending nothing, and write what each socket was given.
    #[command(name = "socket-probe", hide = true)]
    SocketProbe { cgroup: PathBuf },
    /// Compare what the agent would program (from the API or the manifests, with the agent's
    /// flags and configuration file) with the pinned maps; exits 1 when they differ.
    Diff {
        #[command(flatten)]
        agent: AgentArgs,
        /// How long to wait for the source's complete lists.
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        wait: Duration,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// What the datapath does with a new connection from SRC to DST:PORT/PROTO: the path, the
    /// frontend entry, the policies, the candidate endpoints, masquerade, the verdict — from
    /// the live maps.
    Trace {
        source: std::net::IpAddr,
        destination: kpr::inspect::trace::Destination,
        /// Where SRC is [default: as the datapath classifies it].
        #[arg(long, value_enum)]
        from: Option<kpr::inspect::trace::From>,
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// The per-packet path's drops and rejects as they happen, one line (or JSON object) each,
    /// until interrupted: the reason, the protocol, the source and the frontend. Events are
    /// written only while this runs (one reader at a time).
    Events {
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
        /// Stop after this many events.
        #[arg(long)]
        count: Option<usize>,
        /// Stop after this long.
        #[arg(long, value_parser = parse_duration)]
        timeout: Option<Duration>,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// The per-packet path's connections (list), or forget a service's (flush).
    Conntrack {
        #[command(subcommand)]
        action: ConntrackAction,
    },
    /// Detach kpr and remove its pinned maps (like `kube-proxy --cleanup`); turns accept_local
    /// off where kpr turned it on.
    Cleanup {
        #[arg(long, default_value = "/sys/fs/bpf/kpr")]
        pin_root: PathBuf,
        /// Even while an agent runs on the pin root.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Text,
    Json,
}

#[derive(Subcommand)]
enum ShadowAction {
    /// The shadow agent's last comparison with kube-proxy: every frontend and source where
    /// kpr would decide otherwise (exits 1 when there is one).
    Report {
        /// The shadow agent's metrics server (`metricsBindAddress`).
        #[arg(long, default_value = "127.0.0.1:10249")]
        metrics_address: std::net::SocketAddr,
        /// Compare twice now (a difference counts once seen twice) instead of showing the last
        /// periodic comparison.
        #[arg(long)]
        now: bool,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
}

#[derive(Subcommand)]
enum ConntrackAction {
    /// One line per flow: client, frontend, backend, the source the backend sees, state.
    List {
        #[command(flatten)]
        select: FlowSelect,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Remove the flows of a service port (both directions): their next packets start anew.
    Flush {
        #[command(flatten)]
        select: FlowSelect,
    },
}

#[derive(clap::Args)]
struct FlowSelect {
    #[arg(long, default_value = "/sys/fs/bpf/kpr")]
    pin_root: PathBuf,
    /// Only the flows of this frontend, as `kpr services` shows it (`10.96.0.10:80/TCP`;
    /// every source class unless one is named, e.g. `192.168.0.2:30080/TCP ext`).
    #[arg(long)]
    frontend: Option<String>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse_from(with_agent_implied(std::env::args_os().collect()));
    let filter = match &cli.command {
        Command::Agent(args) => args.kube_proxy.log_filter(),
        _ => "info",
    };
    init_logging(cli.log_format, filter);
    match cli.command {
        Command::Agent(args) => run_agent(args).await,
        Command::Status { pin_root, healthz_address, output } => {
            let report = kpr::inspect::status::report(&pin_root, healthz_address)?;
            print_out(output, &report, kpr::inspect::status::text)
        }
        Command::Services { pin_root, metrics_address, output } => {
            let report = kpr::inspect::services::report(&pin_root, Some(metrics_address))?;
            print_out(output, &report, kpr::inspect::services::text)
        }
        Command::Diff { agent, wait, output } => diff(agent, wait, output).await,
        Command::SocketProbe { cgroup } => kpr::datapath::socket_probe::serve(&cgroup),
        Command::Verify { metrics_address, output } => {
            let report = kpr::verify::fetch_report(metrics_address)?;
            print_out(output, &report, kpr::verify::VerifyReport::render)?;
            if !report.failures.is_empty() || report.problem.is_some() {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Shadow { action: ShadowAction::Report { metrics_address, now, output } } => {
            let report = kpr::shadow::fetch_report(metrics_address, now)?;
            print_out(output, &report, kpr::shadow::ShadowReport::render)?;
            if !report.mismatches.is_empty() {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Events { pin_root, count, timeout, output } => events(&pin_root, count, timeout, output),
        Command::Conntrack { action } => conntrack(action),
        Command::Trace { source, destination, from, pin_root, output } => {
            let report = kpr::inspect::trace::trace(&pin_root, source, destination, from)?;
            print_out(output, &report, kpr::inspect::trace::text)
        }
        Command::Cleanup { pin_root, force } => cleanup(&pin_root, force),
    }
}

/// kube-proxy's command line runs the agent: `kpr --config=…` with no command (a DaemonSet
/// copied from kube-proxy's, its command changed to `kpr`), or kpr installed as `kube-proxy`.
fn with_agent_implied(mut argv: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    use clap::CommandFactory as _;
    let as_kube_proxy = argv.first().and_then(|a| std::path::Path::new(a).file_name()) == Some("kube-proxy".as_ref());
    // The first argument after the global flags (`--log-format json`) names a command, if any.
    let mut args = argv.iter().skip(1).filter_map(|a| a.to_str());
    let first = loop {
        match args.next() {
            Some("--log-format" | "--logging-format") => {
                args.next();
            }
            Some(a) if a.starts_with("--log-format=") || a.starts_with("--logging-format=") => {}
            other => break other,
        }
    };
    let is_command = |a: &str| a == "help" || Cli::command().get_subcommands().any(|c| c.get_name() == a);
    let about_kpr = |a: &str| ["-h", "--help", "-V", "--version"].contains(&a);
    let implied = match first {
        Some(a) if is_command(a) => false,
        Some(a) => as_kube_proxy || (a.starts_with('-') && !about_kpr(a)),
        None => as_kube_proxy,
    };
    if implied {
        argv.insert(1, "agent".into());
    }
    argv
}

fn cleanup(pin_root: &std::path::Path, force: bool) -> Result<()> {
    if bpf::AgentLock::held(pin_root) && !force {
        anyhow::bail!(
            "a kpr agent is running on {}: stop it first (or --force, which leaves the node without service translation)",
            pin_root.display()
        );
    }
    bpf::cleanup(pin_root)?;
    // The NAT chains kept for the flows kube-proxy made, if a takeover left them.
    kpr::takeover::release_nat_hooks();
    println!("removed kpr's pins under {}", pin_root.display());
    Ok(())
}

/// Logs go to stderr; colours only on a terminal and without `NO_COLOR`.
fn init_logging(format: LogFormat, default_filter: &str) {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into());
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Json => logs.json().flatten_event(true).init(),
        LogFormat::Text => {
            let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
            logs.with_ansi(colour).init();
        }
    }
}

async fn run_agent(args: AgentArgs) -> Result<()> {
    kpr::settings::log_startup(args.tc_netlink, &args.pin_root);
    if args.kube_proxy.cleanup == Some(true) {
        return cleanup(&args.pin_root, false);
    }
    let kube_proxy = args.kube_proxy.clone();
    let cfg = agent_config(args)?;
    if kube_proxy.init_only == Some(true) {
        // kube-proxy's privileged start-up work: the kernel's conntrack settings.
        let (dir, writes) = &cfg.netfilter_sysctls;
        for e in kpr::datapath::netfilter_sysctls::apply(dir, writes) {
            tracing::warn!("{e:#}");
        }
        return Ok(());
    }
    if let Some(adj) = cfg.oom_score_adj
        && let Err(e) = std::fs::write("/proc/self/oom_score_adj", adj.to_string())
    {
        tracing::warn!("oomScoreAdj {adj} not applied: {e}");
    }
    raise_fd_limit();
    if cfg.shadow {
        return kpr::shadow::run(cfg, kpr::shutdown_signal()).await;
    }
    kpr::datapath::bpf::raise_memlock_limit();
    agent::run(cfg, kpr::shutdown_signal()).await
}

/// Raise the soft limit on open files to the hard limit (as Go programs such as kube-proxy
/// do): watches, sockets and health check clients must not run the agent out of descriptors.
fn raise_fd_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write one rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, ..limit };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                tracing::debug!(from = limit.rlim_cur, to = limit.rlim_max, "raised the open files limit");
            }
        }
    }
}

/// Print a report as text, or as JSON; a closed pipe (`| head`) is not an error.
fn print_out<T: serde::Serialize>(output: Output, report: &T, text: impl Fn(&T) -> String) -> Result<()> {
    use std::io::Write as _;
    let out = match output {
        Output::Text => text(report),
        Output::Json => serde_json::to_string_pretty(report)? + "\n",
    };
    match std::io::stdout().lock().write_all(out.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

async fn diff(args: AgentArgs, wait: Duration, output: Output) -> Result<()> {
    let cfg = agent_config(args)?;
    let mut desired = agent::desired_state(cfg.source, cfg.node, cfg.options, wait).await?;
    // Endpoints the running agent's outlier detection left out are not drift.
    let sidelined = cfg.metrics_bind_address.map(kpr::inspect::sidelined).unwrap_or_default();
    if !sidelined.is_empty() {
        eprintln!("kpr diff: {} endpoints sidelined by outlier detection are left out", sidelined.len());
        kpr::model::outliers::leave_out(&mut desired, |service, endpoint| {
            sidelined.iter().any(|s| {
                s.namespace == service.namespace && s.service == service.name && s.endpoint == endpoint.to_string()
            })
        });
    }
    let maps = bpf::BpfMaps::open_pinned(&cfg.datapath.pin_root)?;
    let programmed = kpr::datapath::read_programmed(&maps)?;
    let report = kpr::inspect::diff::compare(&desired, &programmed);
    print_out(output, &report, kpr::inspect::diff::text)?;
    if !report.in_sync {
        std::process::exit(1);
    }
    Ok(())
}

/// The service ids of the frontend `kpr services` shows as `frontend` (all its source
/// classes when no class is named).
fn frontend_ids(pin_root: &std::path::Path, frontend: &str) -> Result<Vec<u32>> {
    let maps = bpf::BpfMaps::open_pinned(pin_root)?;
    let ids: Vec<u32> = kpr::datapath::read_programmed(&maps)?
        .iter()
        .filter(|(key, _)| {
            let shown = kpr::model::display_key(key).to_string();
            shown == frontend || shown.split(' ').next() == Some(frontend)
        })
        .map(|(_, p)| p.value.service_id)
        .collect();
    anyhow::ensure!(!ids.is_empty(), "no frontend {frontend} in the maps (see `kpr services`)");
    Ok(ids)
}

/// `kpr events`: each event printed as it comes (a JSON object per line with `-o json`).
fn events(pin_root: &std::path::Path, count: Option<usize>, timeout: Option<Duration>, output: Output) -> Result<()> {
    use std::io::Write as _;
    let mut seen = 0;
    kpr::inspect::events::follow(pin_root, timeout, |e| {
        let line = match output {
            Output::Text => kpr::inspect::events::text(&e),
            Output::Json => serde_json::to_string(&e)? + "\n",
        };
        let mut out = std::io::stdout().lock();
        match out.write_all(line.as_bytes()).and_then(|()| out.flush()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(false),
            r => r?,
        }
        seen += 1;
        Ok(count.is_none_or(|c| seen < c))
    })
}

fn conntrack(action: ConntrackAction) -> Result<()> {
    use kpr::inspect::conntrack as ct;
    match action {
        ConntrackAction::List { select, output } => {
            let ids = select.frontend.as_deref().map(|f| frontend_ids(&select.pin_root, f)).transpose()?;
            let flows = ct::list(&select.pin_root, ids.as_deref(), &proxy_common::CtTimeouts::DEFAULT)?;
            print_out(output, &flows, |f| ct::text(f))
        }
        ConntrackAction::Flush { select } => {
            let frontend =
                select.frontend.as_deref().ok_or_else(|| anyhow::anyhow!("--frontend: which flows to flush"))?;
            let mut removed = 0;
            for id in frontend_ids(&select.pin_root, frontend)? {
                removed += ct::flush(&select.pin_root, id)?;
            }
            println!("removed {removed} conntrack entries of {frontend}");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::ConfigMap};

    use super::*;

    fn argv(args: &[&str]) -> Vec<std::ffi::OsString> {
        args.iter().map(Into::into).collect()
    }

    fn words(argv: Vec<std::ffi::OsString>) -> Vec<String> {
        argv.into_iter().map(|a| a.into_string().unwrap()).collect()
    }

    /// kubeadm's kube-proxy DaemonSet command, its binary swapped for kpr (or kpr installed as
    /// `kube-proxy`), with the flags other distributions add: the agent runs on them.
    #[test]
    fn a_kube_proxy_command_line_runs_the_agent() {
        let flags = [
            "--config=/var/lib/kube-proxy/config.conf",
            "--hostname-override=node-1",
            "--v=2",
            "--logging-format=json",
            "--proxy-mode=nftables",
            "--feature-gates=A=true,B=false",
            "--kube-api-qps",
            "5",
            "--ipvs-strict-arp",
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=2h",
            "--conntrack-tcp-be-liberal",
            "--oom-score-adj=-999",
            "--healthz-port=0",
        ];
        for binary in ["/usr/local/bin/kpr", "/usr/local/bin/kube-proxy"] {
            let line: Vec<&str> = [binary].into_iter().chain(flags).collect();
            let cli = Cli::try_parse_from(with_agent_implied(argv(&line))).unwrap_or_else(|e| panic!("{binary}: {e}"));
            assert!(cli.log_format == LogFormat::Json);
            let Command::Agent(args) = cli.command else { panic!("{binary}: not the agent") };
            assert_eq!(args.config.as_deref(), Some(std::path::Path::new("/var/lib/kube-proxy/config.conf")));
            assert_eq!(args.hostname_override.as_deref(), Some("node-1"));
            let kp = &args.kube_proxy;
            assert_eq!((kp.verbosity, kp.log_filter()), (Some(2), "info"));
            assert_eq!(kp.proxy_mode.as_deref(), Some("nftables"));
            assert_eq!(kp.conntrack_max_per_core, Some(0));
            assert_eq!(kp.conntrack_tcp_timeout_established, Some(Duration::from_secs(7200)));
            assert_eq!(kp.conntrack_tcp_be_liberal, Some(true));
            assert_eq!(kp.oom_score_adj, Some(-999));
            assert_eq!(kp.healthz_port, Some(0));
            assert_eq!(args.ignored.given(), ["--feature-gates", "--kube-api-qps", "--ipvs-strict-arp"]);
        }
    }

    #[test]
    fn only_a_command_line_without_a_command_is_the_agents() {
        for (line, want) in [
            (&["kpr", "services"][..], &["kpr", "services"][..]),
            (&["kpr", "--log-format", "json", "services"], &["kpr", "--log-format", "json", "services"]),
            (&["kpr", "--log-format=json", "agent"], &["kpr", "--log-format=json", "agent"]),
            (&["kpr", "--version"], &["kpr", "--version"]),
            (&["kpr", "--help"], &["kpr", "--help"]),
            (&["kpr"], &["kpr"]),
            (&["kpr", "--v=2"], &["kpr", "agent", "--v=2"]),
            (&["kpr", "--log-format", "json", "--v", "4"], &["kpr", "agent", "--log-format", "json", "--v", "4"]),
            (&["/bin/kube-proxy"], &["/bin/kube-proxy", "agent"]),
            (&["/bin/kube-proxy", "--cleanup"], &["/bin/kube-proxy", "agent", "--cleanup"]),
        ] {
            assert_eq!(words(with_agent_implied(argv(line))), want, "{line:?}");
        }
    }

    /// kube-proxy's flags reach the effective configuration as its file's fields would.
    #[test]
    fn kube_proxy_flags_set_the_configuration() {
        let line = [
            "kpr",
            "agent",
            "--proxy-mode",
            "nftables",
            "--conntrack-min=1000",
            "--conntrack-udp-timeout=45s",
            "--healthz-port=12000",
            "--metrics-port=0",
        ];
        let Command::Agent(args) = Cli::try_parse_from(line).unwrap().command else { unreachable!() };
        let config = kpr::settings::effective_config(&args).unwrap();
        assert_eq!(config.mode, "nftables");
        assert!(!config.localhost_node_ports, "nftables mode's default");
        assert_eq!(config.conntrack.min, Some(1000));
        assert_eq!(config.conntrack.timeouts.udp, Duration::from_secs(45));
        assert_eq!(config.healthz_bind_address, Some("0.0.0.0:12000".parse().unwrap()));
        assert_eq!(config.metrics_bind_address, None);
        let bad = ["kpr", "agent", "--proxy-mode", "userspace"];
        let Command::Agent(args) = Cli::try_parse_from(bad).unwrap().command else { unreachable!() };
        let e = format!("{:#}", kpr::settings::effective_config(&args).unwrap_err());
        assert!(e.contains("--proxy-mode userspace") && e.contains("not supported"), "{e}");
    }

    const DAEMONSET: &str = include_str!("../../deploy/daemonset.yaml");
    const CONFIGMAP: &str = include_str!("../../deploy/configmap.yaml");

    /// deploy/: the DaemonSet's command is a valid `kpr agent` command line, and the files it
    /// names are the ConfigMap's, which kpr parses.
    #[test]
    fn deploy_manifests_agree_with_the_agent() {
        let daemonset: DaemonSet = serde_yaml::from_str(DAEMONSET).unwrap();
        let pod = daemonset.spec.template.spec.unwrap();
        let container = &pod.containers[0];
        let cli = Cli::try_parse_from(container.command.as_ref().unwrap()).unwrap();
        let Command::Agent(args) = cli.command else { panic!("the DaemonSet runs `kpr agent`") };
        let config_path = args.config.unwrap();
        let config_mount = container.volume_mounts.as_ref().unwrap().iter().find(|m| m.name == "config").unwrap();
        let config_volume = pod.volumes.as_ref().unwrap().iter().find(|v| v.name == "config").unwrap();
        assert_eq!(config_volume.config_map.as_ref().unwrap().name, "kpr");

        let configmap: ConfigMap = serde_yaml::from_str(CONFIGMAP).unwrap();
        let data = configmap.data.unwrap();
        let file_in_configmap = |path: &std::path::Path| {
            let key = path.strip_prefix(&config_mount.mount_path).expect("a file of the ConfigMap's mount");
            data.get(key.to_str().unwrap()).unwrap_or_else(|| panic!("the ConfigMap has no {}", key.display())).clone()
        };
        let config = kpr::config::ProxyConfig::parse(&file_in_configmap(&config_path)).unwrap();
        let kubeconfig_path = config.kubeconfig.clone().expect("the file names a kubeconfig");
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&file_in_configmap(&kubeconfig_path)).unwrap();
        let user = kubeconfig.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(user.token_file.as_deref(), Some("/var/run/secrets/kubernetes.io/serviceaccount/token"));
        assert_eq!(args.cgroup.as_deref(), Some(std::path::Path::new("/run/kpr/cgroup2")));
        let cgroup_mount = container.volume_mounts.as_ref().unwrap().iter().find(|m| m.name == "cgroup2").unwrap();
        assert_eq!(cgroup_mount.mount_path, "/run/kpr/cgroup2");
    }
}
