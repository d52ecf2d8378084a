//! One `agent()` call's lifecycle, in one vocabulary.
//!
//! A call is admitted by its run ([`crate::run::admit`]), placed and retried by the
//! dispatcher ([`crate::sched`]), and ended by the run once its result is durable. Each part
//! of its life has one owner. The dispatcher alone holds where a live call is ([`State`]:
//! queued, held, waiting, running) and forgets the call once its outcome is sent. The run
//! holds what the script and the report need ([`Stage`]: live, journaling, ended — with the
//! result, the usage and the change), and keeps what its views show of a live call (running
//! since, which attempt, on which worker) as data from the dispatcher's [`CallEvent`]s, never
//! as a state of its own. Each moves only along its own `allows`. The report and the event
//! log spell a call one way each: [`Status`] (where the call stands) and [`Mark`] (what just
//! happened to it).
//!
//! ```text
//!  dispatcher (State):  Queued ◀─▶ Held, Waiting      Queued ──▶ Running ──▶ (outcome sent)
//!                                                        ▲          │ (retry)
//!                                                        └──────────┘
//!  run (Stage):         Live ──▶ Journaling ──▶ Completed
//!                       Live, Journaling ──▶ Failed | Cancelled
//! ```

use std::time::Duration;

use flotilla_proto::v1;

use crate::reject::RejectCode;

/// Where a live call is: the dispatcher's alone (the run never holds one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// In its run's queue, ready to run.
    Queued,
    /// Out of the queue until something lets it go: its prefix group's leader (W60), a
    /// usage-limit gate (W59), or a worker that offers its backend.
    Held,
    /// Waiting for a retry's time to come: a backoff, a usage-limit reset, or what its
    /// interrupted attempt left (W58).
    Waiting,
    /// An attempt holds a worker slot.
    Running,
}

impl State {
    /// Whether a call may move from `self` to `to`.
    pub fn allows(self, to: State) -> bool {
        use State::*;
        matches!(
            (self, to),
            (Queued, Queued | Held | Waiting | Running)
                | (Held | Waiting, Queued | Held | Waiting)
                | (Running, Queued | Waiting)
        )
    }

    /// Moves to `to` if the lifecycle allows it; `false` (and nothing changes) otherwise.
    #[must_use]
    pub fn go(&mut self, to: State) -> bool {
        if self.allows(to) {
            *self = to;
            true
        } else {
            tracing::debug!(from = ?self, to = ?to, "a call state change the lifecycle does not allow");
            false
        }
    }
}

/// What a run holds of one of its calls: still the dispatcher's (live), its result on its way
/// to the journal, or how it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The dispatcher has it (where it is, [`State`], is the dispatcher's).
    Live,
    /// Completed (or served by resume), its result on its way to the journal.
    Journaling,
    Completed,
    Failed,
    Cancelled,
}

impl Stage {
    /// Not ended, and no result yet: it may still run.
    pub fn is_live(self) -> bool {
        self == Stage::Live
    }

    /// Whether a call may move from `self` to `to`: forward only, and to `Completed` only
    /// through the journal.
    pub fn allows(self, to: Stage) -> bool {
        use Stage::*;
        matches!(
            (self, to),
            (Live, Journaling) | (Journaling, Completed) | (Live | Journaling, Failed | Cancelled)
        )
    }

    /// Moves to `to` if the lifecycle allows it; `false` (and nothing changes) otherwise.
    #[must_use]
    pub fn go(&mut self, to: Stage) -> bool {
        if self.allows(to) {
            *self = to;
            true
        } else {
            tracing::debug!(from = ?self, to = ?to, "a call stage change the lifecycle does not allow");
            false
        }
    }

    /// How the report shows it. `running`: what the dispatcher's events last said of a live
    /// call (an attempt of it holds a worker). `live`: a report of a run still going, where
    /// queued and running calls are just that; in a final report they were cancelled.
    pub fn status(self, running: bool, live: bool) -> Status {
        match self {
            Stage::Completed => Status::Completed,
            Stage::Failed => Status::Failed,
            Stage::Journaling if live => Status::Completed,
            Stage::Live if live && running => Status::Running,
            Stage::Live if live => Status::Queued,
            _ => Status::Cancelled,
        }
    }
}

/// Where a call stands, as the report, the API and the session page spell it (its shape
/// crosses the wire, so it lives in [`flotilla_proto::wire`]).
pub use flotilla_proto::wire::CallStatus as Status;

/// What just happened to a call, as its run's event log spells it (a stored shape, so it
/// lives with the records).
pub use crate::store::records::Mark;

/// Why a call is being tried again.
#[derive(Debug, Clone, PartialEq)]
pub enum Retry {
    /// No progress for the stall timeout.
    Stalled { after: Duration },
    /// Usage or rate limit: waits, does not count as an attempt.
    RateLimited { wait: Duration },
    /// The provider refused it for rate or load (429, 529) through `account`: waits outside
    /// the account's window, does not count as an attempt.
    Throttled { wait: Duration, account: String },
    /// A transient failure (or a lost worker).
    Transient { message: String },
    /// Restarted by the user (W56): counts as an attempt, starts again at once.
    User,
    /// Interrupted by a pause (W54): not counted; starts again when the run resumes.
    Paused,
}

impl Retry {
    pub fn mark(&self) -> Mark {
        match self {
            Retry::Stalled { .. } => Mark::Stalled,
            Retry::RateLimited { .. } | Retry::Throttled { .. } => Mark::Waiting,
            Retry::Transient { .. } => Mark::Retrying,
            Retry::User => Mark::Restarted,
            Retry::Paused => Mark::Interrupted,
        }
    }

    /// The `outcome` of the abandoned attempt's trace span.
    pub fn span_outcome(&self) -> &'static str {
        match self {
            Retry::Stalled { .. } => "stalled",
            Retry::User => "restarted",
            Retry::Paused => "paused",
            Retry::RateLimited { .. } => "rate_limited",
            Retry::Throttled { .. } => "throttled",
            Retry::Transient { .. } => "retried",
        }
    }

    /// Starts again at once, ahead of its run's queue (rather than after a backoff).
    pub fn at_once(&self) -> bool {
        matches!(self, Retry::Stalled { .. } | Retry::User | Retry::Paused)
    }

    /// The run's log line for it. `counted`: attempts counted so far; `max`: the limit.
    pub fn log_line(&self, label: &str, attempt: u32, counted: u32, max: u32) -> String {
        let left = max.saturating_sub(1);
        match self {
            Retry::Stalled { after } => format!(
                "[stall] agent \"{label}\" stalled (no progress) after {} — retrying ({counted}/{left})",
                human(*after)
            ),
            Retry::RateLimited { wait } => format!(
                "[limit] agent \"{label}\" is rate limited; waiting {} (the run continues)",
                human(*wait)
            ),
            Retry::Throttled { wait, account } => format!(
                "[throttle] agent \"{label}\" was throttled by {account}; waiting {} (not counted as an attempt)",
                human(*wait)
            ),
            Retry::Transient { message } => format!(
                "[retry] agent \"{label}\" attempt {attempt} failed: {message} — retrying ({counted}/{left})"
            ),
            Retry::User => {
                format!("[restart] agent \"{label}\" restarted by the user ({counted}/{left})")
            }
            Retry::Paused => format!(
                "[pause] agent \"{label}\" was interrupted by the pause; it starts again when the run resumes"
            ),
        }
    }

    /// How the call fails when this retry would go over the attempt limit `max`.
    pub fn exhausted(&self, max: u32, stall_timeout: Duration) -> (CallFailure, String) {
        match self {
            Retry::Stalled { .. } => (
                CallFailure::Stalled,
                format!(
                    "agent stalled on all {max} attempts (no progress for {}ms each)",
                    stall_timeout.as_millis()
                ),
            ),
            Retry::Transient { message } => (
                CallFailure::Terminal,
                format!("agent failed on all {max} attempts; last error: {message}"),
            ),
            Retry::RateLimited { .. } => (CallFailure::Terminal, "rate limited".into()),
            Retry::Throttled { .. } => (CallFailure::Terminal, "throttled".into()),
            Retry::User | Retry::Paused => (
                CallFailure::Terminal,
                format!("agent restarted by the user after {max} attempts; no attempts left"),
            ),
        }
    }
}

/// How the failure of a call begins when its run's retry budget was spent (the call failed
/// instead of trying again).
pub const RETRY_BUDGET_SPENT: &str = "the run's retry budget is spent";

/// How a call ended, as the script will see it.
#[derive(Debug, Clone, PartialEq)]
pub enum CallResult {
    Completed(v1::Completed),
    Failed {
        failure: CallFailure,
        message: String,
    },
}

impl CallResult {
    /// The `outcome` of the call's trace span.
    pub fn span_outcome(&self) -> &'static str {
        match self {
            CallResult::Completed(_) => "completed",
            CallResult::Failed { .. } => "failed",
        }
    }
}

/// Classified final failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFailure {
    /// A terminal error: the call resolves to `null` (W23).
    Terminal,
    /// Structured output never validated: rejects (W14).
    Schema,
    /// The task cannot run as asked: rejects (W24).
    Invalid,
    /// Every attempt stalled: rejects (W58).
    Stalled,
    /// A budget was exhausted: rejects (W35).
    Budget,
    /// The run's retry budget was spent, so the call failed instead of trying again, as its
    /// last attempt would have: `stalled`, it rejects with `STALLED`; else it resolves to
    /// `null`, as a terminal error does.
    RetryBudget { stalled: bool },
}

impl CallFailure {
    /// The code the call's promise rejects with; `None`: it resolves `null` instead.
    pub fn reject_code(self) -> Option<RejectCode> {
        match self {
            CallFailure::Terminal | CallFailure::RetryBudget { stalled: false } => None,
            CallFailure::Schema => Some(RejectCode::SchemaFailed),
            CallFailure::Invalid => Some(RejectCode::InvalidAgent),
            CallFailure::Stalled | CallFailure::RetryBudget { stalled: true } => {
                Some(RejectCode::Stalled)
            }
            CallFailure::Budget => Some(RejectCode::BudgetExceeded),
        }
    }
}

/// What happens to a call, told by the dispatcher to the call's run.
#[derive(Debug, Clone)]
pub enum CallEvent {
    /// An attempt took a worker slot.
    Started {
        call: u64,
        attempt: u32,
        worker: std::sync::Arc<str>,
    },
    Progress {
        call: u64,
        attempt: u32,
        output_tokens: u64,
    },
    Transcript {
        call: u64,
        attempt: u32,
        events: Vec<String>,
    },
    /// Usage of an attempt that ended (current or not): what the call spent.
    Usage {
        call: u64,
        attempt: u32,
        usage: v1::Usage,
    },
    Retrying {
        call: u64,
        attempt: u32,
        retry: Retry,
        /// Attempts counted against the limit so far.
        counted: u32,
    },
    /// Why a call waits although the run has room for it (no attached worker offers its
    /// backend and model); `None` once it no longer waits for that.
    Waiting {
        call: u64,
        reason: Option<String>,
    },
    Finished {
        call: u64,
        result: CallResult,
    },
}

/// A duration as a log line shows it.
pub fn human(d: Duration) -> String {
    if d.as_secs() >= 60 {
        format!("{}m{}s", d.as_secs() / 60, d.as_secs() % 60)
    } else if d.as_millis() < 1000 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATES: [State; 4] = [State::Queued, State::Held, State::Waiting, State::Running];
    const STAGES: [Stage; 5] = [
        Stage::Live,
        Stage::Journaling,
        Stage::Completed,
        Stage::Failed,
        Stage::Cancelled,
    ];

    #[test]
    fn an_ended_call_never_moves_again() {
        for from in [Stage::Completed, Stage::Failed, Stage::Cancelled] {
            for to in STAGES {
                let mut s = from;
                assert!(!s.go(to), "{from:?} -> {to:?} must be refused");
                assert_eq!(s, from);
            }
        }
        // Nothing goes back to live: a call with a result is never run again.
        for from in STAGES {
            assert!(!from.allows(Stage::Live), "{from:?} -> Live");
        }
    }

    #[test]
    fn a_result_is_completed_only_through_the_journal() {
        for from in STAGES {
            assert_eq!(
                from.allows(Stage::Completed),
                from == Stage::Journaling,
                "{from:?} -> Completed"
            );
        }
        let mut s = Stage::Live;
        assert!(s.go(Stage::Journaling));
        assert!(!s.go(Stage::Live), "a journaling result is not run again");
        assert!(s.go(Stage::Completed));
    }

    #[test]
    fn only_a_queued_call_takes_a_slot() {
        for from in STATES {
            assert_eq!(
                from.allows(State::Running),
                from == State::Queued,
                "{from:?} -> Running"
            );
        }
        // A held or waiting call goes back to the queue before it runs.
        for from in [State::Held, State::Waiting] {
            assert!(from.allows(State::Queued), "{from:?} -> Queued");
        }
    }

    #[test]
    fn every_live_call_can_fail_or_be_cancelled() {
        for from in STAGES {
            let can_end = matches!(from, Stage::Live | Stage::Journaling);
            assert_eq!(from.allows(Stage::Failed), can_end);
            assert_eq!(from.allows(Stage::Cancelled), can_end);
        }
    }

    #[test]
    fn the_report_spells_live_states_only_while_the_run_goes_on() {
        assert_eq!(Stage::Live.status(false, true), Status::Queued);
        assert_eq!(Stage::Live.status(true, true), Status::Running);
        assert_eq!(Stage::Journaling.status(false, true), Status::Completed);
        for running in [false, true] {
            for s in [Stage::Live, Stage::Journaling] {
                assert_eq!(s.status(running, false), Status::Cancelled, "{s:?}");
            }
            assert_eq!(Stage::Failed.status(running, false), Status::Failed);
            assert_eq!(Stage::Completed.status(running, true), Status::Completed);
        }
        assert_eq!(
            serde_json::to_string(&Status::Cancelled).unwrap(),
            "\"cancelled\""
        );
    }

    #[test]
    fn marks_are_read_back_as_written_and_unknown_ones_are_kept_apart() {
        for m in [
            Mark::Queued,
            Mark::Cached,
            Mark::Interrupted,
            Mark::Failed,
            Mark::Cancelled,
        ] {
            let s = serde_json::to_string(&m).unwrap();
            assert_eq!(serde_json::from_str::<Mark>(&s).unwrap(), m);
        }
        assert_eq!(
            serde_json::from_str::<Mark>("\"teleported\"").unwrap(),
            Mark::Other
        );
    }

    #[test]
    fn each_retry_has_its_own_mark_and_log_line() {
        let retries = [
            Retry::Stalled {
                after: Duration::from_secs(3),
            },
            Retry::RateLimited {
                wait: Duration::from_millis(250),
            },
            Retry::Transient {
                message: "boom".into(),
            },
            Retry::User,
            Retry::Paused,
        ];
        let marks: std::collections::HashSet<String> =
            retries.iter().map(|r| format!("{:?}", r.mark())).collect();
        assert_eq!(marks.len(), retries.len());
        for r in &retries {
            assert!(r.log_line("x", 1, 1, 3).contains("agent \"x\""), "{r:?}");
        }
        assert!(retries[2].log_line("x", 2, 1, 3).contains("boom"));
        assert_eq!(
            Retry::Stalled {
                after: Duration::ZERO
            }
            .exhausted(3, Duration::from_millis(10))
            .0,
            CallFailure::Stalled
        );
    }

    #[test]
    fn failures_reject_with_their_code_except_terminal_ones() {
        assert_eq!(CallFailure::Terminal.reject_code(), None);
        assert_eq!(
            CallFailure::Budget.reject_code(),
            Some(RejectCode::BudgetExceeded)
        );
        assert_eq!(
            CallFailure::Schema.reject_code(),
            Some(RejectCode::SchemaFailed)
        );
    }
}
