//! The live [`Snapshot`] of a run: what progress displays, the API's `Status` and the pages
//! read. The run publishes it ([`super::RunEngine`]'s view); this file names nothing above it.

use std::sync::Arc;

use tokio::time::Instant;

use crate::report::Summary;
use crate::store::records::WorkflowInfo;

/// Live view of a run for progress displays, the API's `Status` and the pages: its
/// [`Summary`] (what every view of the run says of it) with its groups and logs.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub run_id: String,
    pub workflow: WorkflowInfo,
    /// Status, agents by state, why they wait, tokens, cost and elapsed time as of when it
    /// was published ([`Snapshot::summary_now`] has the elapsed time of now).
    pub summary: Summary,
    pub groups: Vec<GroupProgress>,
    pub logs: Arc<Vec<String>>,
    /// When the run started here (so `elapsed` keeps growing between snapshots).
    pub since: Option<Instant>,
}

impl Snapshot {
    /// Milliseconds since the run started: growing while it runs, fixed once it ended.
    pub fn elapsed_now_ms(&self) -> u64 {
        match self.since {
            Some(since) if !self.summary.status.is_final() => {
                (since.elapsed().as_millis() as u64).max(self.summary.elapsed_ms)
            }
            _ => self.summary.elapsed_ms,
        }
    }

    /// The summary with the elapsed time of now.
    pub fn summary_now(&self) -> Summary {
        Summary {
            elapsed_ms: self.elapsed_now_ms(),
            ..self.summary.clone()
        }
    }
}

/// Progress of one group: the same shape the live view sends over the wire.
pub use flotilla_proto::wire::GroupView as GroupProgress;
