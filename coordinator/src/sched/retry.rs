//! What a failed attempt leads to: the call fails, waits for a usage limit to reset (W59), or
//! is tried again (W58) — after a backoff, or at once for a stall, a restart or a pause.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use flotilla_proto::v1::FailureKind;

use super::{CallFailure, Retry};

/// Shortest wait after a usage or rate limit (a backend saying "retry after 0" must not spin).
pub(super) const MIN_LIMIT_WAIT: Duration = Duration::from_millis(50);
/// Longest reset a call waits for (W59); a later reset fails the call.
pub(super) const MAX_LIMIT_WAIT: Duration = Duration::from_secs(24 * 3600);
/// Usage-limit waits one call may go through before it fails.
pub(super) const MAX_LIMIT_WAITS: u32 = 100;
/// Throttles (429, 529) one call may wait out before it fails: far more than any burst or
/// storm of them (at the longest backoff, over eight hours).
pub(super) const MAX_THROTTLE_WAITS: u32 = 1000;
/// The longest a throttled call without a `retry-after` waits.
const MAX_THROTTLE_BACKOFF: Duration = Duration::from_secs(30);

/// What comes of a failed attempt.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Verdict {
    Fail(CallFailure, String),
    /// Wait this long for the usage limit to reset, then go again (not counted as an attempt).
    WaitLimit(Duration),
    /// The provider throttled it: wait this long, then go again (not counted as an attempt;
    /// the gate stays open, the account's window shrinks).
    Throttle(Duration),
    /// Go again, counted against the attempt limit.
    Retry(Retry),
}

/// The attempt will be tried again (so what it left is worth keeping).
pub(super) fn goes_again(kind: FailureKind) -> bool {
    matches!(
        kind,
        FailureKind::RateLimited
            | FailureKind::Throttled
            | FailureKind::Retryable
            | FailureKind::Setup
            | FailureKind::Cancelled
            | FailureKind::Unspecified
    )
}

/// The verdict on an attempt that failed with `kind` and `message`; `retry_after_ms` is the
/// backend's reset, `limit_waits` the usage-limit waits so far, this one included.
pub(super) fn verdict(
    kind: FailureKind,
    message: String,
    retry_after_ms: u64,
    limit_waits: u32,
) -> Verdict {
    match kind {
        FailureKind::RateLimited => {
            let wait = Duration::from_millis(retry_after_ms).max(MIN_LIMIT_WAIT);
            if wait > MAX_LIMIT_WAIT {
                Verdict::Fail(
                    CallFailure::Terminal,
                    format!(
                        "usage limit: the backend resets in {}s, more than the 24 h a call waits ({message})",
                        wait.as_secs()
                    ),
                )
            } else if limit_waits > MAX_LIMIT_WAITS {
                Verdict::Fail(
                    CallFailure::Terminal,
                    format!("usage limit: still limited after {MAX_LIMIT_WAITS} waits ({message})"),
                )
            } else {
                Verdict::WaitLimit(wait)
            }
        }
        FailureKind::Throttled => {
            if limit_waits > MAX_THROTTLE_WAITS {
                return Verdict::Fail(
                    CallFailure::Terminal,
                    format!(
                        "throttled: still refused after {MAX_THROTTLE_WAITS} waits ({message})"
                    ),
                );
            }
            let wait = if retry_after_ms > 0 {
                Duration::from_millis(retry_after_ms).min(MAX_LIMIT_WAIT)
            } else {
                // Doubling from half a second.
                (Duration::from_millis(500) * (1u32 << limit_waits.saturating_sub(1).min(8)))
                    .min(MAX_THROTTLE_BACKOFF)
            };
            Verdict::Throttle(wait.max(MIN_LIMIT_WAIT))
        }
        FailureKind::Retryable
        | FailureKind::Setup
        | FailureKind::Cancelled
        | FailureKind::Unspecified => Verdict::Retry(Retry::Transient { message }),
        FailureKind::Terminal | FailureKind::Timeout => {
            Verdict::Fail(CallFailure::Terminal, message)
        }
        FailureKind::Schema => Verdict::Fail(CallFailure::Schema, message),
        FailureKind::Invalid => Verdict::Fail(CallFailure::Invalid, message),
    }
}

/// How long a transient failure waits before its next attempt: doubling from 200 ms, at most
/// 5 s. `counted`: attempts counted so far.
pub(super) fn backoff(counted: u32) -> Duration {
    Duration::from_millis((100u64 << counted.min(6)).min(5_000))
}

/// The restart counter a retry adds to.
pub(super) fn restart_counter(retry: &Retry) -> &'static AtomicU64 {
    match retry {
        Retry::Stalled { .. } => &crate::counters::RESTARTS_STALL,
        Retry::User => &crate::counters::RESTARTS_USER,
        Retry::Transient { message } if message.contains("lease") => {
            &crate::counters::RESTARTS_LAPSE
        }
        _ => &crate::counters::RESTARTS_TRANSIENT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_waits_its_retry_after_or_a_doubling_backoff_and_never_counts() {
        assert_eq!(
            verdict(FailureKind::Throttled, "529".into(), 1_000, 1),
            Verdict::Throttle(Duration::from_secs(1))
        );
        let waits: Vec<Verdict> = (1..=8)
            .map(|n| verdict(FailureKind::Throttled, "429".into(), 0, n))
            .collect();
        assert_eq!(waits[0], Verdict::Throttle(Duration::from_millis(500)));
        assert_eq!(waits[1], Verdict::Throttle(Duration::from_secs(1)));
        assert_eq!(waits[7], Verdict::Throttle(MAX_THROTTLE_BACKOFF));
        assert!(matches!(
            verdict(
                FailureKind::Throttled,
                "429".into(),
                0,
                MAX_THROTTLE_WAITS + 1
            ),
            Verdict::Fail(CallFailure::Terminal, _)
        ));
        assert!(goes_again(FailureKind::Throttled));
    }

    #[test]
    fn a_usage_limit_waits_for_its_reset_within_bounds() {
        assert_eq!(
            verdict(FailureKind::RateLimited, "429".into(), 0, 1),
            Verdict::WaitLimit(MIN_LIMIT_WAIT),
            "a reset of 0 does not spin"
        );
        assert_eq!(
            verdict(FailureKind::RateLimited, "429".into(), 3_000, 1),
            Verdict::WaitLimit(Duration::from_secs(3))
        );
        let Verdict::Fail(CallFailure::Terminal, m) =
            verdict(FailureKind::RateLimited, "429".into(), 25 * 3600 * 1000, 1)
        else {
            panic!("a reset beyond a day fails the call");
        };
        assert!(m.contains("24 h") && m.contains("429"), "{m}");
        assert!(matches!(
            verdict(
                FailureKind::RateLimited,
                "429".into(),
                10,
                MAX_LIMIT_WAITS + 1
            ),
            Verdict::Fail(CallFailure::Terminal, _)
        ));
    }

    #[test]
    fn each_failure_kind_has_its_verdict() {
        for kind in [
            FailureKind::Retryable,
            FailureKind::Cancelled,
            FailureKind::Unspecified,
        ] {
            assert!(goes_again(kind));
            assert_eq!(
                verdict(kind, "x".into(), 0, 0),
                Verdict::Retry(Retry::Transient {
                    message: "x".into()
                })
            );
        }
        for (kind, failure) in [
            (FailureKind::Terminal, CallFailure::Terminal),
            (FailureKind::Timeout, CallFailure::Terminal),
            (FailureKind::Schema, CallFailure::Schema),
            (FailureKind::Invalid, CallFailure::Invalid),
        ] {
            assert!(!goes_again(kind), "{kind:?}");
            assert_eq!(
                verdict(kind, "x".into(), 0, 0),
                Verdict::Fail(failure, "x".into())
            );
        }
        assert!(goes_again(FailureKind::RateLimited));
    }

    #[test]
    fn backoff_doubles_and_stops_at_five_seconds() {
        assert_eq!(backoff(1), Duration::from_millis(200));
        assert_eq!(backoff(2), Duration::from_millis(400));
        assert!(backoff(5) < backoff(6));
        assert_eq!(backoff(6), Duration::from_secs(5));
        assert_eq!(backoff(60), Duration::from_secs(5));
    }

    #[test]
    fn a_lost_lease_counts_as_a_lapse_restart() {
        let lapse = Retry::Transient {
            message: "the worker's lease lapsed".into(),
        };
        assert!(std::ptr::eq(
            restart_counter(&lapse),
            &crate::counters::RESTARTS_LAPSE
        ));
        assert!(std::ptr::eq(
            restart_counter(&Retry::User),
            &crate::counters::RESTARTS_USER
        ));
    }
}
