//! The agent: source → model → plan → datapath, in one loop.
//!
//! Events are applied to the [`ClusterState`] as they arrive; after each burst (everything
//! already queued), the changed services are recomputed and the [`Programmer`] writes the
//! difference. Nothing is written until both initial lists have arrived, so a restart never
//! black-holes services whose slices are late. A periodic full reconcile re-reads the maps and
//! repairs any drift.
use std::{
    future::Future,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Result;
use tokio::sync::mpsc;

use crate::{
    datapath::{
        Maps, Programmer,
        bpf::{BpfDatapath, DatapathConfig},
    },
    model::{NodeInfo, desired::ClusterState},
    source::{self, SourceEvent},
};

pub enum SourceConfig {
    /// A directory of manifests.
    Manifests(PathBuf),
    /// The Kubernetes API; `None` infers the config (in-cluster, or `KUBECONFIG`).
    Kube { kubeconfig: Option<PathBuf> },
}

pub struct AgentConfig {
    pub source: SourceConfig,
    pub datapath: DatapathConfig,
    pub node_name: String,
    pub reconcile_interval: Duration,
}

/// Run until `shutdown` completes. The pinned datapath stays in place on exit, like kube-proxy's
/// rules: `kpr cleanup` removes it.
pub async fn run(cfg: AgentConfig, shutdown: impl Future<Output = ()>) -> Result<()> {
    let mut datapath = BpfDatapath::load(&cfg.datapath)?;
    let programmer = Programmer::recover(&mut datapath.maps)?;
    tracing::info!(
        pin_dir = %crate::datapath::bpf::pin_dir(&cfg.datapath.pin_root).display(),
        cgroup = %cfg.datapath.cgroup.display(),
        recovered_service_ports = programmer.programmed().len(),
        "datapath attached"
    );

    let (tx, rx) = mpsc::channel(4096);
    let (node, source_task) = match cfg.source {
        SourceConfig::Manifests(dir) => {
            let task = tokio::spawn(log_exit("manifests", source::manifests::run(dir, tx)));
            (NodeInfo { name: cfg.node_name, zone: None, addresses: Vec::new() }, task)
        }
        SourceConfig::Kube { kubeconfig } => {
            let client = source::kube::client(kubeconfig.as_deref()).await?;
            let node = source::kube::node_info(&client, &cfg.node_name).await;
            (node, tokio::spawn(log_exit("kubernetes", source::kube::run(client, tx))))
        }
    };
    let node = NodeInfo { addresses: cfg.datapath.node_ips.clone(), ..node };
    let mut syncer = Syncer::new(ClusterState::new(node), programmer);
    if !cfg.datapath.tc_interfaces.is_empty() {
        syncer.health = Some(crate::health::HealthServers::default());
    }
    syncer.run(rx, &mut datapath.maps, cfg.reconcile_interval, shutdown).await;
    source_task.abort();
    tracing::info!("stopped; the datapath stays programmed until the next agent takes over");
    Ok(())
}

async fn log_exit(name: &str, task: impl Future<Output = Result<()>>) {
    if let Err(e) = task.await {
        tracing::error!(source = name, "source stopped: {e:#}");
    }
}

/// The loop's state, separate from I/O so it can be driven with fake maps in tests.
pub struct Syncer {
    pub state: ClusterState,
    pub programmer: Programmer,
    /// healthCheckNodePort servers, with the per-packet (external) datapath.
    pub health: Option<crate::health::HealthServers>,
    synced_once: bool,
}

impl Syncer {
    pub fn new(state: ClusterState, programmer: Programmer) -> Self {
        Self { state, programmer, health: None, synced_once: false }
    }

    pub async fn run(
        &mut self,
        mut rx: mpsc::Receiver<SourceEvent>,
        maps: &mut dyn Maps,
        reconcile_interval: Duration,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut reconcile = tokio::time::interval(reconcile_interval);
        reconcile.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        reconcile.tick().await; // the first tick is immediate
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                event = rx.recv() => {
                    let Some(event) = event else {
                        tracing::warn!("all sources stopped; serving the last programmed state");
                        shutdown.as_mut().await;
                        return;
                    };
                    let started = Instant::now();
                    event.apply_to(&mut self.state);
                    while let Ok(event) = rx.try_recv() {
                        event.apply_to(&mut self.state);
                    }
                    self.sync(maps, started);
                }
                _ = reconcile.tick() => self.reconcile(maps),
                () = &mut shutdown => return,
            }
        }
    }

    /// Write what changed, once both initial lists are in.
    pub fn sync(&mut self, maps: &mut dyn Maps, started: Instant) {
        if !self.state.synced() || !self.state.has_changes() {
            return;
        }
        let desired = self.state.desired();
        let report = self.programmer.apply(&desired, maps);
        if let Some(health) = &mut self.health {
            health.update(self.state.health_checks());
        }
        if !self.synced_once {
            self.synced_once = true;
            tracing::info!(service_ports = desired.len(), "initial sync done");
        }
        if report.changes() > 0 || report.failed > 0 {
            tracing::info!(
                added = report.added,
                updated = report.updated,
                removed = report.removed,
                failed = report.failed,
                elapsed_us = started.elapsed().as_micros() as u64,
                "datapath updated"
            );
        }
    }

    /// Re-read the maps and rewrite whatever differs from the desired state.
    pub fn reconcile(&mut self, maps: &mut dyn Maps) {
        if !self.state.synced() {
            return;
        }
        match Programmer::recover(maps) {
            Ok(programmer) => {
                self.programmer = programmer;
                let desired = self.state.desired();
                let report = self.programmer.apply(&desired, maps);
                if report.changes() > 0 {
                    tracing::warn!(?report, "reconcile repaired drift in the maps");
                }
            }
            Err(e) => tracing::error!("reconcile could not read the maps: {e:#}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        datapath::{Capacity, backend_addr, fake::FakeMaps},
        model::{
            Protocol,
            desired::service_key,
            tests::{service_yaml, slice_yaml},
        },
    };

    fn web_slice(ips: &[&str]) -> k8s_openapi::api::discovery::v1::EndpointSlice {
        let eps: Vec<String> = ips.iter().map(|ip| format!("{{addresses: [{ip}]}}")).collect();
        slice_yaml(&format!(
            "metadata: {{name: web-1, namespace: d, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{}]",
            eps.join(", ")
        ))
    }

    fn visible(maps: &FakeMaps) -> Option<Vec<String>> {
        let key = service_key("10.96.0.10".parse().unwrap(), 80, Protocol::Tcp).unwrap();
        maps.visible_backends(&key).map(|bs| bs.iter().map(|b| backend_addr(b).0.to_string()).collect())
    }

    #[tokio::test]
    async fn events_flow_to_the_maps_only_after_both_lists() {
        let mut maps = FakeMaps::new(Capacity { service_ports: 16, backends: 64 });
        let programmer = Programmer::recover(&mut maps).unwrap();
        let mut syncer = Syncer::new(ClusterState::new(NodeInfo::default()), programmer);
        let (tx, rx) = mpsc::channel(16);
        let svc =
            service_yaml("metadata: {name: web, namespace: d}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}");

        tx.send(SourceEvent::ServicesListed(vec![svc])).await.unwrap();
        tx.send(SourceEvent::SliceApplied(web_slice(&["10.0.0.1"]))).await.unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let run = async {
            syncer.run(rx, &mut maps, Duration::from_secs(3600), async { stop_rx.await.unwrap() }).await;
            (syncer, maps)
        };
        let drive = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            tx.send(SourceEvent::SlicesListed(vec![web_slice(&["10.0.0.1", "10.0.0.2"])])).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            stop_tx.send(()).unwrap();
        };
        let ((syncer, maps), ()) = tokio::join!(run, drive);
        assert_eq!(visible(&maps), Some(vec!["10.0.0.1".into(), "10.0.0.2".into()]));
        assert_eq!(syncer.programmer.programmed().len(), 1);
    }

    #[test]
    fn nothing_is_written_before_sync_and_reconcile_repairs() {
        let mut maps = FakeMaps::new(Capacity { service_ports: 16, backends: 64 });
        let programmer = Programmer::recover(&mut maps).unwrap();
        let mut syncer = Syncer::new(ClusterState::new(NodeInfo::default()), programmer);
        let svc =
            service_yaml("metadata: {name: web, namespace: d}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}");
        SourceEvent::ServicesListed(vec![svc]).apply_to(&mut syncer.state);
        syncer.sync(&mut maps, Instant::now());
        assert_eq!(maps.writes, 0, "slices not listed yet: nothing programmed");
        SourceEvent::SlicesListed(vec![web_slice(&["10.0.0.7"])]).apply_to(&mut syncer.state);
        syncer.sync(&mut maps, Instant::now());
        assert_eq!(visible(&maps), Some(vec!["10.0.0.7".into()]));

        maps.services.clear(); // drift: someone emptied the map
        syncer.reconcile(&mut maps);
        assert_eq!(visible(&maps), Some(vec!["10.0.0.7".into()]));
    }
}
