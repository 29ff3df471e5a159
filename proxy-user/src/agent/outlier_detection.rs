//! Outlier detection in the agent's loop ([`crate::model::outliers`]): each observation of the
//! watched endpoints may sideline some or put some back, which is logged, counted, told as an
//! Event on their Services, and written as a change of the backends at the next sync (the
//! metric and `/sidelined` follow once it is written).
use std::time::Instant;

use super::Syncer;
use crate::{
    events::ServiceEvent,
    model::{
        desired::Desired,
        outliers::{Change, Observation},
    },
};

impl Syncer {
    /// Take in an observation of the watched endpoints: whether the backends change.
    pub(super) fn observe_backends(&mut self, at: Instant, seen: &Observation) -> bool {
        let changes = self.outliers.observe(at, seen);
        for change in &changes {
            let (endpoint, sidelined) = match change {
                Change::Sidelined { endpoint, failures, backoff } => {
                    tracing::warn!(
                        %endpoint,
                        failures,
                        backoff_s = backoff.as_secs(),
                        "endpoint sidelined: it left new flows unanswered or refused them; new connections go to \
                         the Service's other endpoints for a while (unless all of them are sidelined)"
                    );
                    (endpoint, true)
                }
                Change::Returned { endpoint } => {
                    tracing::info!(%endpoint, "sidelined endpoint back among the backends, on probation");
                    (endpoint, false)
                }
            };
            for service in self.outliers.services_of(endpoint) {
                if sidelined {
                    self.metrics.sidelining(service);
                }
                if let Some(events) = &self.service_events {
                    let _ = events.try_send(ServiceEvent::Outlier { service: service.clone(), change: change.clone() });
                }
            }
        }
        self.outliers_changed |= !changes.is_empty();
        !changes.is_empty()
    }

    /// Leave the sidelined endpoints out of `desired`, and hand the endpoints of the opted-in
    /// Services to the source that watches them.
    pub(super) fn sideline(&mut self, desired: &mut Desired) {
        let default_on = self.outliers.settings.default_on;
        let state = &self.state;
        self.outliers.sideline(desired, |service| state.outlier_detection(service).unwrap_or(default_on));
        self.outliers_changed = false;
        if let Some(watched) = &self.watched {
            *watched.lock().unwrap_or_else(|e| e.into_inner()) = self.outliers.watched();
        }
    }
}
