//! `kpr-cluster [--keep-data]`: a local control plane (etcd + kube-apiserver on 127.0.0.1, from
//! `KPR_K8S_BIN`) until Ctrl-C or SIGTERM; prints the admin kubeconfig. Everything it started is
//! stopped and its directory removed on exit. Run it through `cargo xtask cluster`.
use anyhow::Result;
use kpr_tests::cluster::Cluster;

fn main() -> Result<()> {
    let keep = std::env::args().any(|a| a == "--keep-data");
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!("usage: kpr-cluster [--keep-data]\n  starts etcd + kube-apiserver on 127.0.0.1 until Ctrl-C");
        return Ok(());
    }
    // Block the signals before any thread exists, then wait for one of them.
    let set = kpr_tests::block_stop_signals();
    let mut cluster = Cluster::start("kpr-cluster")?;
    cluster.keep = keep;
    let kubeconfig = &cluster.admin_kubeconfig;
    println!("kpr-cluster: API server {} is ready (etcd and logs in {})", cluster.server(), cluster.dir.display());
    println!("kpr-cluster: export KUBECONFIG={}", kubeconfig.display());
    println!("kpr-cluster: e.g. kubectl get --raw /version; cargo xtask run (with KUBECONFIG set); Ctrl-C stops it");
    let mut sig = 0;
    // SAFETY: waiting on the set blocked above.
    unsafe { libc::sigwait(&set, &mut sig) };
    println!("kpr-cluster: signal {sig}: stopping");
    drop(cluster);
    Ok(())
}
