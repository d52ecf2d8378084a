//! What one attempt can plausibly have used, and a worker's usage report held to it.
//!
//! Workers are trusted less than coordinators. A report above these ceilings — or a cost that
//! is not a number, is negative or infinite — is clipped to them and logged naming the worker,
//! and only the clipped figures reach the run, its namespace's daily quotas and `/metrics`.
//!
//! The ceilings follow from what one model request can carry and how many requests an attempt
//! can have made in the time it ran, as the coordinator measures it (from when the attempt
//! took its slot): `requests = requests_at_once + requests_per_second × seconds`. Each
//! input-side count (input, cache reads, cache writes) is at most `requests × context_tokens`,
//! output at most `requests × output_tokens`, tool calls at most
//! [`TOOL_CALLS_PER_REQUEST`] per request, and the cost at most what the clipped tokens come
//! to at the dearest prices. They are generous — an honest report does not come near them —
//! and they keep a report of 10^15 tokens or $10^12 from locking a namespace out of its day.

use flotilla_proto::Problem;
use std::time::Duration;

use flotilla_proto::v1;
use serde::{Deserialize, Serialize};

/// Tool calls one model request can ask for.
pub const TOOL_CALLS_PER_REQUEST: u64 = 64;

/// How long an attempt taken over from a coordinator that went away is taken to have run when
/// it has no timeout of its own (it started before this coordinator knew of it).
pub const ADOPTED_RAN_AT_MOST: Duration = Duration::from_secs(24 * 3600);

/// The ceilings (`[attempt_usage]` in a coordinator's config file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UsageBounds {
    /// Input-side tokens one model request can carry (each of input, cache reads and cache
    /// writes): the largest context window of the models in use.
    pub context_tokens: u64,
    /// Output tokens one model request can produce.
    pub output_tokens: u64,
    /// Model requests an attempt can have under way from its start (subagents in parallel).
    pub requests_at_once: u64,
    /// Model requests an attempt can start in each second it runs (0: the ceilings do not grow
    /// with its duration).
    pub requests_per_second: u64,
    /// The dearest input-side token, in US dollars per million.
    pub usd_per_million_input: f64,
    /// The dearest output token, in US dollars per million.
    pub usd_per_million_output: f64,
    /// Bytes one attempt's checkout can hold when it ends.
    pub disk_bytes: u64,
}

impl Default for UsageBounds {
    fn default() -> Self {
        UsageBounds {
            context_tokens: 1_000_000,
            output_tokens: 128_000,
            requests_at_once: 4,
            requests_per_second: 4,
            usd_per_million_input: 150.0,
            usd_per_million_output: 600.0,
            disk_bytes: 1 << 40,
        }
    }
}

impl UsageBounds {
    /// Why these bounds cannot be used, naming the field.
    pub fn check(&self) -> Result<(), Problem> {
        for (field, v) in [
            ("context_tokens", self.context_tokens),
            ("output_tokens", self.output_tokens),
            ("requests_at_once", self.requests_at_once),
            ("disk_bytes", self.disk_bytes),
        ] {
            if v == 0 {
                return Err(Problem::invalid(format!("{field} must be above 0")));
            }
        }
        for (field, v) in [
            ("usd_per_million_input", self.usd_per_million_input),
            ("usd_per_million_output", self.usd_per_million_output),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(Problem::invalid(format!(
                    "{field} must be a price of 0 or more, not {v}"
                )));
            }
        }
        Ok(())
    }

    /// Model requests an attempt that ran `ran` can have made.
    fn requests(&self, ran: Duration) -> u64 {
        let seconds = ran.as_secs() + u64::from(ran.subsec_nanos() > 0);
        self.requests_at_once
            .saturating_add(self.requests_per_second.saturating_mul(seconds))
    }

    /// Output tokens an attempt that ran `ran` can have produced.
    pub fn output_ceiling(&self, ran: Duration) -> u64 {
        self.requests(ran).saturating_mul(self.output_tokens)
    }

    /// `u` held to what an attempt that ran `ran` can have used; `None` when it is within.
    pub fn clip(&self, u: &v1::Usage, ran: Duration) -> Option<v1::Usage> {
        let requests = self.requests(ran);
        let input = requests.saturating_mul(self.context_tokens);
        let output = self.output_ceiling(ran);
        let tools =
            u32::try_from(requests.saturating_mul(TOOL_CALLS_PER_REQUEST)).unwrap_or(u32::MAX);
        let mut c = v1::Usage {
            input_tokens: u.input_tokens.min(input),
            output_tokens: u.output_tokens.min(output),
            cache_read_tokens: u.cache_read_tokens.min(input),
            cache_write_tokens: u.cache_write_tokens.min(input),
            cost_usd: 0.0,
            tool_calls: u.tool_calls.min(tools),
            disk_bytes: u.disk_bytes.min(self.disk_bytes),
        };
        let inputs = c
            .input_tokens
            .saturating_add(c.cache_read_tokens)
            .saturating_add(c.cache_write_tokens);
        let dearest = inputs as f64 * self.usd_per_million_input / 1e6
            + c.output_tokens as f64 * self.usd_per_million_output / 1e6;
        c.cost_usd = if u.cost_usd.is_finite() && u.cost_usd >= 0.0 {
            u.cost_usd.min(dearest)
        } else {
            0.0
        };
        // NaN compares unequal to itself: a NaN cost counts as clipped.
        (c != *u).then_some(c)
    }
}

/// How long ago an attempt taken over from a coordinator that went away can have started: its
/// timeout, or [`ADOPTED_RAN_AT_MOST`] without one.
pub(super) fn adopted_ran_before(task: &v1::TaskSpec) -> Duration {
    match task.timeout_ms {
        0 => ADOPTED_RAN_AT_MOST,
        ms => Duration::from_millis(ms).min(ADOPTED_RAN_AT_MOST),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(input: u64, output: u64, cost: f64) -> v1::Usage {
        v1::Usage {
            input_tokens: input,
            output_tokens: output,
            cost_usd: cost,
            ..v1::Usage::default()
        }
    }

    #[test]
    fn an_honest_report_passes_untouched() {
        let b = UsageBounds::default();
        let real = v1::Usage {
            input_tokens: 12_000,
            output_tokens: 3_500,
            cache_read_tokens: 180_000,
            cache_write_tokens: 9_000,
            cost_usd: 0.42,
            tool_calls: 17,
            disk_bytes: 50 << 20,
        };
        assert_eq!(b.clip(&real, Duration::from_secs(40)), None);
        // Many requests over a long session: the ceilings grow with the time it ran.
        let long = usage(400_000_000, 2_000_000, 900.0);
        assert!(b.clip(&long, Duration::from_secs(60)).is_some());
        assert_eq!(b.clip(&long, Duration::from_secs(4 * 3600)), None);
    }

    #[test]
    fn an_implausible_report_is_clipped_to_what_the_attempt_can_have_used() {
        let b = UsageBounds::default();
        // Instant: 4 requests at once, plus 4 for the (rounded up) second.
        let c = b
            .clip(
                &v1::Usage {
                    input_tokens: 1_000_000_000_000_000,
                    output_tokens: u64::MAX,
                    cache_read_tokens: u64::MAX,
                    cache_write_tokens: 1,
                    cost_usd: 1e12,
                    tool_calls: u32::MAX,
                    disk_bytes: u64::MAX,
                },
                Duration::from_millis(10),
            )
            .expect("clipped");
        assert_eq!(c.input_tokens, 8_000_000);
        assert_eq!(c.cache_read_tokens, 8_000_000);
        assert_eq!(c.cache_write_tokens, 1, "within: kept");
        assert_eq!(c.output_tokens, 8 * 128_000);
        assert_eq!(c.tool_calls, 8 * 64);
        assert_eq!(c.disk_bytes, 1 << 40);
        let dearest = 16_000_001.0 * 150.0 / 1e6 + 1_024_000.0 * 600.0 / 1e6;
        assert!((c.cost_usd - dearest).abs() < 1e-6, "{}", c.cost_usd);
        // With no growth over time, a long attempt is held to the same.
        let fixed = UsageBounds {
            requests_per_second: 0,
            ..UsageBounds::default()
        };
        let c = fixed
            .clip(&usage(u64::MAX, 0, 0.0), Duration::from_secs(3600))
            .expect("clipped");
        assert_eq!(c.input_tokens, 4_000_000);
    }

    #[test]
    fn a_cost_that_is_not_a_price_counts_as_nothing() {
        let b = UsageBounds::default();
        for cost in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -5.0, -0.0001] {
            let c = b
                .clip(&usage(100, 100, cost), Duration::from_secs(1))
                .unwrap_or_else(|| panic!("{cost} passed"));
            assert_eq!(c.cost_usd, 0.0, "{cost}");
            assert_eq!((c.input_tokens, c.output_tokens), (100, 100));
        }
        // Tokens that cost nothing by the report can still cost at most the dearest price.
        assert_eq!(b.clip(&usage(100, 100, 0.0), Duration::from_secs(1)), None);
    }

    #[test]
    fn bounds_that_cannot_hold_anything_are_refused_by_name() {
        let zero = UsageBounds {
            context_tokens: 0,
            ..UsageBounds::default()
        };
        assert!(zero.check().unwrap_err().message.contains("context_tokens"));
        let nan = UsageBounds {
            usd_per_million_output: f64::NAN,
            ..UsageBounds::default()
        };
        assert!(
            nan.check()
                .unwrap_err()
                .message
                .contains("usd_per_million_output")
        );
        assert_eq!(UsageBounds::default().check(), Ok(()));
    }

    #[test]
    fn an_adopted_attempt_is_taken_to_have_run_its_timeout_or_a_day() {
        let t = |ms| v1::TaskSpec {
            timeout_ms: ms,
            ..v1::TaskSpec::default()
        };
        assert_eq!(adopted_ran_before(&t(0)), ADOPTED_RAN_AT_MOST);
        assert_eq!(adopted_ran_before(&t(90_000)), Duration::from_secs(90));
        assert_eq!(adopted_ran_before(&t(u64::MAX)), ADOPTED_RAN_AT_MOST);
    }
}
