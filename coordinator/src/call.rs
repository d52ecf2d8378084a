//! One `agent()` call's lifecycle, in one vocabulary.
//!
//! A call is admitted by its run ([`crate::run::admit`]), placed and retried by the
//! dispatcher ([`crate::sched`]), and ended by the run once its result is durable. Both actors
//! keep the call's [`State`] and move it only along [`State::allows`]; what one tells the
//! other travels as a [`CallEvent`]. The report and the event log spell a call's state one way
//! each: [`Status`] (where the call stands) and [`Mark`] (what just happened to it).
//!
//! ```text
//!            ┌──────── hold / wait ────────┐
//!            ▼                             │
//!  Queued ◀─▶ Held, Waiting      Queued ──▶ Running ──▶ Journaling ──▶ Completed
//!    │                              ▲         │ (retry)                    
//!    └─▶ Journaling (served)        └─────────┘
//!  any live state ──▶ Failed | Cancelled
//! ```

use std::time::Duration;

use flotilla_proto::v1;
use serde::{Deserialize, Serialize};

use crate::reject::RejectCode;

/// Where a call is. The dispatcher uses the live states; the run engine also the ending ones.
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
    /// Completed (or served by resume), its result on its way to the journal.
    Journaling,
    Completed,
    Failed,
    Cancelled,
}

impl State {
    /// Not ended: it may still run.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            State::Queued | State::Held | State::Waiting | State::Running
        )
    }

    /// Whether a call may move from `self` to `to`.
    pub fn allows(self, to: State) -> bool {
        use State::*;
        match (self, to) {
            (Queued, Queued | Held | Waiting | Running | Journaling) => true,
            (Held | Waiting, Queued | Held | Waiting) => true,
            (Running, Queued | Waiting | Journaling) => true,
            (Journaling, Completed) => true,
            (from, Failed | Cancelled) => from.is_live() || from == Journaling,
            _ => false,
        }
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

    /// How the report shows it. `live`: a report of a run still going, where queued and
    /// running calls are just that; in a final report they were cancelled.
    pub fn status(self, live: bool) -> Status {
        match self {
            State::Completed => Status::Completed,
            State::Failed => Status::Failed,
            State::Journaling if live => Status::Completed,
            State::Running if live => Status::Running,
            State::Queued | State::Held | State::Waiting if live => Status::Queued,
            _ => Status::Cancelled,
        }
    }
}

/// Where a call stands, as the report, the API and the session page spell it (its shape
/// crosses the wire, so it lives in [`flotilla_proto::wire`]).
pub use flotilla_proto::wire::CallStatus as Status;

/// What just happened to a call, as its run's event log spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mark {
    Queued,
    /// Served from the run it resumes.
    Cached,
    Running,
    Stalled,
    /// Rate limited: waits for the limit's reset.
    Waiting,
    Retrying,
    Restarted,
    /// Interrupted by a pause.
    Interrupted,
    Completed,
    Failed,
    /// Cut short by the run's stop or end (not a failure, W55).
    Cancelled,
    /// A mark written by a newer version.
    #[serde(other)]
    Other,
}

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

    const ALL: [State; 8] = [
        State::Queued,
        State::Held,
        State::Waiting,
        State::Running,
        State::Journaling,
        State::Completed,
        State::Failed,
        State::Cancelled,
    ];

    #[test]
    fn an_ended_call_never_moves_again() {
        for from in [State::Completed, State::Failed, State::Cancelled] {
            for to in ALL {
                let mut s = from;
                assert!(!s.go(to), "{from:?} -> {to:?} must be refused");
                assert_eq!(s, from);
            }
        }
    }

    #[test]
    fn a_result_is_completed_only_through_the_journal() {
        for from in ALL {
            assert_eq!(
                from.allows(State::Completed),
                from == State::Journaling,
                "{from:?} -> Completed"
            );
        }
        let mut s = State::Queued;
        assert!(s.go(State::Running));
        assert!(s.go(State::Journaling));
        assert!(
            !s.go(State::Running),
            "a journaling result is not run again"
        );
        assert!(s.go(State::Completed));
    }

    #[test]
    fn only_a_queued_call_takes_a_slot() {
        for from in ALL {
            assert_eq!(
                from.allows(State::Running),
                from == State::Queued,
                "{from:?} -> Running"
            );
        }
    }

    #[test]
    fn every_live_state_can_fail_or_be_cancelled() {
        for from in ALL {
            let can_end = from.is_live() || from == State::Journaling;
            assert_eq!(from.allows(State::Failed), can_end);
            assert_eq!(from.allows(State::Cancelled), can_end);
        }
    }

    #[test]
    fn the_report_spells_live_states_only_while_the_run_goes_on() {
        assert_eq!(State::Held.status(true), Status::Queued);
        assert_eq!(State::Waiting.status(true), Status::Queued);
        assert_eq!(State::Running.status(true), Status::Running);
        assert_eq!(State::Journaling.status(true), Status::Completed);
        for s in [
            State::Queued,
            State::Held,
            State::Waiting,
            State::Running,
            State::Journaling,
        ] {
            assert_eq!(s.status(false), Status::Cancelled, "{s:?}");
        }
        assert_eq!(State::Failed.status(false), Status::Failed);
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
