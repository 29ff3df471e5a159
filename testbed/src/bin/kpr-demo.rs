//! `kpr-demo` (what `cargo xtask run` starts without a kubeconfig): kpr on this machine only,
//! in network namespaces it makes and removes (see `testbed::demo`). The agent is the `kpr`
//! binary beside this one, or `$KPR_BIN`.
use anyhow::Result;
use clap::Parser;

#[derive(Parser)]
#[command(version = kpr::VERSION, about = "kpr's demo: pods in network namespaces behind a Service, on this machine only")]
struct Cli {
    /// Keep the demo up (for `bpftool` and `kpr services`) until Ctrl-C.
    #[arg(long)]
    keep_running: bool,
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    testbed::demo::run(cli.keep_running).await
}
