//! Kubernetes Events about what kpr decided for a Service that its owner should see in
//! `kubectl describe service`: a frontend address it did not program because an older
//! Service has it; an endpoint outlier detection left out of new flows, or put back.
use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tokio::sync::mpsc;

use crate::model::{ObjectKey, desired::Conflict, outliers::Change};

/// What a Service's Event is about.
#[derive(Clone, Debug)]
pub enum ServiceEvent {
    Conflict(Conflict),
    /// An endpoint of `service` sidelined or back ([`crate::model::outliers`]).
    Outlier {
        service: ObjectKey,
        change: Change,
    },
}

/// Publish what is sent on the returned channel as events, until it closes. Publishing
/// failures (no permission, API server down) are logged, never fatal.
pub fn publisher(client: Client, node: String) -> (mpsc::Sender<ServiceEvent>, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<ServiceEvent>(256);
    let task = tokio::spawn(async move {
        let recorder = Recorder::new(client, Reporter { controller: "kpr".into(), instance: Some(node.clone()) });
        while let Some(what) = rx.recv().await {
            let (service, event) = event_of(what, &node);
            if let Err(e) = recorder.publish(&event, &service_reference(&service)).await {
                tracing::warn!(%service, "failed to publish an event: {e}");
            }
        }
    });
    (tx, task)
}

/// The Service an event is about, and the event.
fn event_of(what: ServiceEvent, node: &str) -> (ObjectKey, Event) {
    match what {
        ServiceEvent::Conflict(conflict) => {
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
            (conflict.service, event)
        }
        ServiceEvent::Outlier { service, change: Change::Sidelined { endpoint, failures, backoff } } => {
            let event = Event {
                type_: EventType::Warning,
                reason: "EndpointSidelined".into(),
                note: Some(format!(
                    "endpoint {endpoint} left {failures} new flows unanswered or refused; kpr on node {node} \
                     leaves it out of new connections for {}s (unless every endpoint of the Service is)",
                    backoff.as_secs()
                )),
                action: "OutlierDetection".into(),
                secondary: None,
            };
            (service, event)
        }
        ServiceEvent::Outlier { service, change: Change::Returned { endpoint } } => {
            let event = Event {
                type_: EventType::Normal,
                reason: "EndpointReturned".into(),
                note: Some(format!("kpr on node {node} gives endpoint {endpoint} new connections again, on probation")),
                action: "OutlierDetection".into(),
                secondary: None,
            };
            (service, event)
        }
    }
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

#[cfg(test)]
mod tests {
    use std::{net::SocketAddr, time::Duration};

    use super::*;
    use crate::model::{Protocol, outliers::Endpoint};

    #[test]
    fn a_sidelined_endpoint_is_a_warning_on_its_service_and_its_return_a_normal_event() {
        let service = ObjectKey::new("shop", "web");
        let endpoint = Endpoint { addr: SocketAddr::from(([10, 244, 2, 2], 8080)), protocol: Protocol::Tcp };
        let sidelined = Change::Sidelined { endpoint, failures: 5, backoff: Duration::from_secs(20) };
        let (on, event) = event_of(ServiceEvent::Outlier { service: service.clone(), change: sidelined }, "node-1");
        assert_eq!(on, service);
        assert!(matches!(event.type_, EventType::Warning));
        assert_eq!(event.reason, "EndpointSidelined");
        let note = event.note.unwrap();
        assert!(note.contains("10.244.2.2:8080/TCP") && note.contains("node-1") && note.contains("20s"), "{note}");
        let (_, event) = event_of(ServiceEvent::Outlier { service, change: Change::Returned { endpoint } }, "node-1");
        assert!(matches!(event.type_, EventType::Normal));
        assert_eq!(event.reason, "EndpointReturned");
    }
}
