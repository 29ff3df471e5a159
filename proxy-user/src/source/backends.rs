//! How the endpoints of Services with outlier detection answer new flows, read from the
//! datapath once a second ([`crate::datapath::backend_answers`]) while any are watched, and
//! delivered as [`SourceEvent::Backends`].
use std::{
    collections::BTreeSet,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Result;
use tokio::sync::mpsc;

use super::SourceEvent;
use crate::{datapath::backend_answers::BackendWatch, model::outliers::Endpoint};

/// How often the endpoints are observed: also the grace a new flow has to be answered in
/// (a flow unanswered at two observations in a row has failed).
pub const PERIOD: Duration = Duration::from_secs(1);

/// The endpoints to watch: the agent's to write after each sync, this source's to read.
pub type Watched = Arc<Mutex<BTreeSet<Endpoint>>>;

/// Observe `watched` every [`PERIOD`] while it is not empty, until `tx` closes; the programs
/// count answers only meanwhile.
pub async fn run(pin_root: PathBuf, watched: Watched, tx: mpsc::Sender<SourceEvent>) -> Result<()> {
    let mut tick = tokio::time::interval(PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut opened: Option<BackendWatch> = None;
    // Whether the programs were last told to count answers (None: not told since the start).
    let mut wanted: Option<bool> = None;
    loop {
        tick.tick().await;
        let endpoints = watched.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if endpoints.is_empty() && wanted == Some(false) {
            continue;
        }
        let root = pin_root.clone();
        let watch = opened.take();
        let want = !endpoints.is_empty();
        let tell = wanted != Some(want);
        let (watch, seen) = tokio::task::spawn_blocking(move || -> Result<_> {
            let mut watch = match watch {
                Some(w) => w,
                None => BackendWatch::open(&root)?,
            };
            if tell {
                watch.want_answers(want)?;
            }
            let seen = watch.observe(&endpoints)?;
            Ok((watch, seen))
        })
        .await??;
        opened = Some(watch);
        wanted = Some(want);
        if !want {
            continue;
        }
        if tx.send(SourceEvent::Backends(Instant::now(), seen)).await.is_err() {
            return Ok(());
        }
    }
}
