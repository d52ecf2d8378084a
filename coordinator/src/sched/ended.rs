//! How an attempt stopped running, as the attempt counters (`flotilla_attempts_total`) and
//! their durations label it.

use flotilla_proto::v1::{FailureKind, outcome};

/// How an attempt stopped running, as `flotilla_attempts_total` counts it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Ended {
    Completed,
    /// The worker said it failed, of this kind.
    Failed(FailureKind),
    /// The stall watchdog ended it (W58).
    Stalled,
    /// Its worker went away or its lease lapsed.
    Lost,
    /// Ended here: `restarted`, `stopped` or `paused`.
    Cancelled(&'static str),
    /// Its assignment was refused before it started.
    Unstarted,
}

impl Ended {
    /// What a worker's outcome says.
    pub(super) fn of(result: Option<&outcome::Result>) -> Ended {
        match result {
            Some(outcome::Result::Completed(_)) => Ended::Completed,
            Some(outcome::Result::Failure(f)) => {
                Ended::Failed(FailureKind::try_from(f.kind).unwrap_or(FailureKind::Terminal))
            }
            None => Ended::Failed(FailureKind::Retryable),
        }
    }

    /// Its `outcome` and `class` labels.
    pub(super) fn labels(self) -> (&'static str, &'static str) {
        match self {
            Ended::Completed => ("completed", ""),
            Ended::Failed(kind) => ("failed", kind.class()),
            Ended::Stalled => ("stalled", ""),
            Ended::Lost => ("lost", ""),
            Ended::Cancelled(why) => ("cancelled", why),
            Ended::Unstarted => ("unstarted", ""),
        }
    }
}
