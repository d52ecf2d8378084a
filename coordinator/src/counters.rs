//! Process-wide counters and histograms for `/metrics` (Prometheus text format), fed by the
//! dispatcher, the worker leases, the runs and the object store. Those on hot paths are plain
//! atomics (a few relaxed adds, no lock); the labeled families (attempts by outcome, durations,
//! usage by namespace, workflow and model) are touched once per attempt or run.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use flotilla_proto::usage::UsageRecord;
use opentelemetry::KeyValue;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

pub use flotilla_proto::histogram::Histogram;
use flotilla_proto::histogram::LATENCY_SECONDS as LATENCY;

/// From a call being ready to run to its attempt's assignment going to a worker.
pub static DISPATCH_LATENCY: Histogram = Histogram::new(LATENCY);
/// One object-store write, retries included (kept by the store's write meter).
pub use crate::store::metered::WRITE_LATENCY as STORAGE_WRITE_LATENCY;

/// Attempts ended by the stall watchdog (W58).
pub static STALLS: AtomicU64 = AtomicU64::new(0);
/// Calls started again, by reason.
pub static RESTARTS_STALL: AtomicU64 = AtomicU64::new(0);
pub static RESTARTS_TRANSIENT: AtomicU64 = AtomicU64::new(0);
pub static RESTARTS_USER: AtomicU64 = AtomicU64::new(0);
pub static RESTARTS_LAPSE: AtomicU64 = AtomicU64::new(0);
/// Attempts a provider refused for rate or load (429, 529), each waited out.
pub static THROTTLES: AtomicU64 = AtomicU64::new(0);
/// Failed renewals of a worker's lease (each retried).
pub static LEASE_RENEWAL_FAILURES: AtomicU64 = AtomicU64::new(0);
/// Failed object-store writes that were retried (counted by the store's retry layer).
pub use crate::store::metered::WRITE_RETRIES as STORAGE_WRITE_RETRIES;
/// Messages from workers that named no attempt they hold (dropped; nothing of them counted).
pub static WORKER_STRAYS: AtomicU64 = AtomicU64::new(0);
/// Usage reports from workers above what one attempt can use (clipped before counting).
pub static USAGE_CLIPPED: AtomicU64 = AtomicU64::new(0);

pub fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// Times this coordinator won the leader's seat (a standby taking over counts one).
pub static LEADER_WINS: AtomicU64 = AtomicU64::new(0);

/// Labels whose values are all known in advance: recorded without an allocation.
type Fixed<const N: usize> = [(&'static str, &'static str); N];
type Seconds = prometheus_client::metrics::histogram::Histogram;
type SecondsFamily = Family<Fixed<1>, Seconds, fn() -> Seconds>;

/// Attempts that ended, by outcome (`completed`, `failed`, `stalled`, `lost`) and failure
/// class (the worker's failure kind; empty when it completed).
pub static ATTEMPTS: LazyLock<Family<Fixed<2>, Counter>> = LazyLock::new(Family::default);
/// How long ended attempts held their worker slot, by outcome.
pub static ATTEMPT_SECONDS: LazyLock<SecondsFamily> =
    LazyLock::new(|| Family::new_with_constructor(|| Seconds::new(LONG.iter().copied())));
/// How long finished runs took, launch to end, by status.
pub static RUN_SECONDS: LazyLock<SecondsFamily> =
    LazyLock::new(|| Family::new_with_constructor(|| Seconds::new(LONGER.iter().copied())));
/// Tokens and cost by namespace, workflow and model, since the coordinator started.
pub static USAGE: LazyLock<Mutex<Usage>> = LazyLock::new(Default::default);

/// Attempts last seconds to an hour.
const LONG: &[f64] = &[
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
];
/// Runs last seconds to a day.
const LONGER: &[f64] = &[
    1.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0,
];

/// An attempt ended: `class` names its failure (`""` when it completed).
pub fn attempt_ended(outcome: &'static str, class: &'static str, held: Duration, of: Operation) {
    ATTEMPTS
        .get_or_create(&[("outcome", outcome), ("class", class)])
        .inc();
    ATTEMPT_SECONDS
        .get_or_create(&[("outcome", outcome)])
        .observe(held.as_secs_f64());
    if otel_on() {
        let i = &*INSTRUMENTS;
        let mut attrs = of.attributes();
        if outcome != "completed" {
            attrs.push(KeyValue::new("error.type", class));
        }
        i.duration.record(held.as_secs_f64(), &attrs);
        i.attempts.add(
            1,
            &[
                KeyValue::new("flotilla.outcome", outcome),
                KeyValue::new("flotilla.class", class),
            ],
        );
    }
}

/// What an attempt was, for the OpenTelemetry instruments' attributes.
#[derive(Debug, Clone, Copy)]
pub struct Operation<'a> {
    /// `gen_ai.provider.name`.
    pub provider: &'static str,
    /// The model asked for, and the one that answered (empty: not known).
    pub request_model: &'a str,
    pub response_model: &'a str,
}

impl Operation<'_> {
    fn attributes(&self) -> Vec<KeyValue> {
        let mut a = vec![
            KeyValue::new("gen_ai.operation.name", "invoke_agent"),
            KeyValue::new("gen_ai.provider.name", self.provider),
        ];
        if !self.request_model.is_empty() {
            a.push(KeyValue::new(
                "gen_ai.request.model",
                self.request_model.to_owned(),
            ));
        }
        if !self.response_model.is_empty() {
            a.push(KeyValue::new(
                "gen_ai.response.model",
                self.response_model.to_owned(),
            ));
        }
        a
    }
}

/// The tokens an attempt used, on `gen_ai.client.token.usage` (input and output).
pub fn tokens_used(of: Operation, input: u64, output: u64) {
    if !otel_on() {
        return;
    }
    let mut attrs = of.attributes();
    for (kind, n) in [("input", input), ("output", output)] {
        attrs.push(KeyValue::new("gen_ai.token.type", kind));
        INSTRUMENTS.tokens.record(n, &attrs);
        attrs.pop();
    }
}

fn otel_on() -> bool {
    flotilla_proto::traces::METRICS_ON.load(std::sync::atomic::Ordering::Relaxed)
}

/// The OpenTelemetry instruments, made on the global meter once the process installed its
/// meter provider ([`flotilla_proto::traces::METRICS_ON`]): the GenAI client conventions'
/// token usage and operation duration (one operation per attempt), and attempts by outcome.
struct Instruments {
    tokens: opentelemetry::metrics::Histogram<u64>,
    duration: opentelemetry::metrics::Histogram<f64>,
    attempts: opentelemetry::metrics::Counter<u64>,
}

static INSTRUMENTS: LazyLock<Instruments> = LazyLock::new(|| {
    let m = opentelemetry::global::meter("flotilla");
    Instruments {
        tokens: m
            .u64_histogram("gen_ai.client.token.usage")
            .with_unit("{token}")
            .with_description("Tokens an agent's attempt used, by type (input, output).")
            .with_boundaries(vec![
                1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0,
                4194304.0, 16777216.0, 67108864.0,
            ])
            .build(),
        duration: m
            .f64_histogram("gen_ai.client.operation.duration")
            .with_unit("s")
            .with_description("How long an agent's attempt held its worker's slot.")
            .with_boundaries(vec![
                0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
                81.92, 163.84, 327.68, 655.36, 1310.72,
            ])
            .build(),
        attempts: m
            .u64_counter("flotilla.attempts")
            .with_description("Agents' attempts that ended, by outcome and failure class.")
            .build(),
    }
});

/// A run ended with `status` after `took`.
pub fn run_ended(status: &'static str, took: Duration) {
    RUN_SECONDS
        .get_or_create(&[("status", status)])
        .observe(took.as_secs_f64());
}

/// The usage counters' rows: one per namespace, workflow and model, up to [`Usage::MAX_ROWS`];
/// past that a namespace's new workflows count under `(other)`, so a tenant that names a
/// workflow per run cannot grow the coordinator's memory or the scrape without end.
#[derive(Debug, Default)]
pub struct Usage {
    /// Namespace → workflow → model: a row that exists is found without an allocation.
    rows: BTreeMap<String, BTreeMap<String, BTreeMap<String, UsageRecord>>>,
    len: usize,
}

impl Usage {
    pub const MAX_ROWS: usize = 2000;
    pub const OTHER: &str = "(other)";

    /// Counts what an attempt of a run of `workflow` in `namespace` used of `model`.
    pub fn add(&mut self, namespace: &str, workflow: &str, model: &str, u: &UsageRecord) {
        let model = if model.is_empty() { "default" } else { model };
        if let Some(row) = self
            .rows
            .get_mut(namespace)
            .and_then(|w| w.get_mut(workflow))
            .and_then(|m| m.get_mut(model))
        {
            row.add(u);
            return;
        }
        let workflow = if self.len >= Self::MAX_ROWS {
            Self::OTHER
        } else {
            workflow
        };
        let models = self
            .rows
            .entry(namespace.to_owned())
            .or_default()
            .entry(workflow.to_owned())
            .or_default();
        if !models.contains_key(model) {
            self.len += 1;
        }
        models.entry(model.to_owned()).or_default().add(u);
    }

    /// The rows `shown` lets through: (namespace, workflow, model) and their totals.
    pub fn rows(&self, shown: impl Fn(&str) -> bool) -> Vec<([&str; 3], &UsageRecord)> {
        self.rows
            .iter()
            .filter(|(ns, _)| shown(ns))
            .flat_map(|(ns, w)| {
                w.iter().flat_map(move |(wf, m)| {
                    m.iter()
                        .map(move |(model, u)| ([ns.as_str(), wf.as_str(), model.as_str()], u))
                })
            })
            .collect()
    }
}

/// Counts an attempt's usage (see [`Usage`]).
pub fn used(namespace: &str, workflow: &str, model: &str, u: &UsageRecord) {
    USAGE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .add(namespace, workflow, model, u);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_rows_add_up_and_stop_growing_at_the_cap() {
        let mut u = Usage::default();
        let one = UsageRecord {
            input_tokens: 10,
            output_tokens: 1,
            cost_usd: 0.5,
            ..UsageRecord::default()
        };
        u.add("a", "w", "", &one);
        u.add("a", "w", "", &one);
        let rows = u.rows(|_| true);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].0[2], "default");
        assert_eq!(rows[0].1.input_tokens, 20);
        for i in 0..Usage::MAX_ROWS + 50 {
            u.add("b", &format!("w{i}"), "m", &one);
        }
        assert_eq!(u.rows(|_| true).len(), Usage::MAX_ROWS + 1);
        let other = u
            .rows(|ns| ns == "b")
            .into_iter()
            .find(|(k, _)| k[1] == Usage::OTHER)
            .expect("workflows past the cap count under (other)");
        assert_eq!(other.1.input_tokens, 10 * 51);
        assert!(
            u.rows(|ns| ns == "a").len() == 1,
            "namespace a keeps its own row"
        );
        // A known row still counts where it is.
        u.add("a", "w", "", &one);
        assert_eq!(u.rows(|ns| ns == "a")[0].1.input_tokens, 30);
    }
}
