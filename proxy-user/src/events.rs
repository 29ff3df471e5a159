//! Kubernetes Events about what kpr decided for a Service that its owner should see in
//! `kubectl describe service`: a frontend address it did not program because an older
//! Service has it.
use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tokio::sync::mpsc;

use crate::model::{ObjectKey, desired::Conflict};

/// Publish the conflicts sent on the returned channel as Warning events, until it closes.
/// Publishing failures (no permission, API server down) are logged, never fatal.
pub fn publisher(client: Client, node: String) -> (mpsc::Sender<Conflict>, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<Conflict>(256);
    let task = tokio::spawn(async move {
        let recorder = Recorder::new(client, Reporter { controller: "kpr".into(), instance: Some(node.clone()) });
        while let Some(conflict) = rx.recv().await {
            let event = Event {
                type_: EventType::Warning,
                reason: "AddressInUse".into(),
                note: Some(format!(
                    "{} is already used by the older Service {}; kpr on node {node} does not program it for this Service",
                    conflict.address, conflict.owner
                )),
                action: "ProgramFrontend".into(),
                secondary: Some(service_reference(&conflict.owner)),
            };
            if let Err(e) = recorder.publish(&event, &service_reference(&conflict.service)).await {
                tracing::warn!(service = %conflict.service, "failed to publish an event: {e}");
            }
        }
    });
    (tx, task)
}

fn service_reference(key: &ObjectKey) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        name: Some(key.name.clone()),
        namespace: Some(key.namespace.clone()),
        ..Default::default()
    }
}
