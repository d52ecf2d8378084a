//! `/metrics`: the Prometheus text exposition of this coordinator — its runs and their agents,
//! the dispatcher and the fleet, and the process counters of [`crate::counters`].

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};

use super::auth::*;
use super::state::Web;
use crate::counters as m;
use crate::report::Summary;
use crate::sched::{Stats, WorkerView};

/// Prometheus text format: runs and agents of this coordinator, the dispatcher and the fleet.
/// A namespace's figures are shown to a token of that namespace (an operator's shows all).
pub(super) async fn metrics(State(web): State<Web>, headers: HeaderMap) -> Response {
    let scope = match check(&web, &headers) {
        Ok(s) => s,
        Err(why) => return refuse(why, true),
    };
    exposition(&web, &scope).await
}

/// The operator listener's `/metrics` (`--metrics-listen`): every namespace, no sign-in; who
/// can reach it is the listener's address.
pub(super) async fn operator_metrics(State(web): State<Web>) -> Response {
    exposition(&web, &crate::namespace::Scope::All).await
}

/// The exposition of the figures `scope` may see.
async fn exposition(web: &Web, scope: &crate::namespace::Scope) -> Response {
    let tracked = Tracked::of(
        web.registry
            .all()
            .into_iter()
            .filter(|(ns, _)| scope.may(ns))
            .map(|(_, s)| s),
    );
    let mut stats = web.coordinator.dispatch().stats().await.unwrap_or_default();
    stats.namespaces.retain(|n| scope.may(&n.name));
    let workers = web.coordinator.dispatch().workers().await;
    let mut body = render(&tracked, &stats, &workers);
    if let Some(q) = web.coordinator.quotas() {
        let mut views = q.views();
        views.retain(|v| scope.may(&v.namespace));
        let mut refusals = q.refusals();
        refusals.retain(|(ns, _), _| scope.may(ns));
        body.push_str(&quotas(&views, &refusals));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

/// What the tracked runs add up to.
#[derive(Debug, Default, PartialEq)]
struct Tracked {
    runs: BTreeMap<&'static str, u64>,
    /// Runs whose script returned although agents of them failed.
    with_failures: u64,
    agents: BTreeMap<&'static str, u64>,
    output_tokens: u64,
}

impl Tracked {
    /// Runs by status, agents by state: the runs' summaries, as every other view has them.
    fn of(runs: impl IntoIterator<Item = Summary>) -> Tracked {
        let mut t = Tracked::default();
        for s in runs {
            *t.runs.entry(s.status.as_str()).or_default() += 1;
            if s.completed_with_failures() {
                t.with_failures += 1;
            }
            for (state, n) in [
                ("queued", s.queued),
                ("running", s.running),
                ("done", s.done),
                ("failed", s.failed),
                ("cancelled", s.cancelled),
                ("cached", s.cached),
            ] {
                *t.agents.entry(state).or_default() += n;
            }
            t.output_tokens += s.output_tokens;
        }
        t
    }
}

/// One exposition, family by family.
#[derive(Default)]
struct Exposition(String);

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str, rows: &[(String, u64)]) {
        self.0
            .push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (labels, value) in rows {
            self.0.push_str(&format!("{name}{labels} {value}\n"));
        }
    }

    fn gauge(&mut self, name: &str, help: &str, value: u64) {
        self.family(name, "gauge", help, &[(String::new(), value)]);
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.family(name, "counter", help, &[(String::new(), value)]);
    }
}

/// `{key="value"}`, the value escaped.
fn label(key: &str, value: &str) -> String {
    format!(
        "{{{key}=\"{}\"}}",
        value.replace('\\', "\\\\").replace('"', "\\\"")
    )
}

/// One row per name of `names`, labeled `key`, counted in `counts` (0 when absent).
fn by(key: &str, names: &[&str], counts: &BTreeMap<&'static str, u64>) -> Vec<(String, u64)> {
    names
        .iter()
        .map(|n| (label(key, n), counts.get(n).copied().unwrap_or(0)))
        .collect()
}

fn render(t: &Tracked, stats: &Stats, workers: &[WorkerView]) -> String {
    let mut e = Exposition::default();
    let statuses = [
        "running",
        "paused",
        "stopping",
        "completed",
        "failed",
        "stopped",
        "rejected",
    ];
    e.family(
        "flotilla_runs",
        "gauge",
        "Runs tracked by this coordinator, by status.",
        &by("status", &statuses, &t.runs),
    );
    e.gauge(
        "flotilla_runs_completed_with_failures",
        "Tracked runs whose script returned although agents of them failed (also counted as completed).",
        t.with_failures,
    );
    e.family(
        "flotilla_agents",
        "gauge",
        "agent() calls of the tracked runs, by status (done counts cached ones too).",
        &by(
            "status",
            &["queued", "running", "done", "failed", "cancelled", "cached"],
            &t.agents,
        ),
    );
    e.gauge(
        "flotilla_output_tokens",
        "Output tokens of the tracked runs.",
        t.output_tokens,
    );
    fleet(&mut e, stats, workers);
    process(&mut e);
    e.0
}

/// The dispatcher and the workers.
fn fleet(e: &mut Exposition, stats: &Stats, workers: &[WorkerView]) {
    let attached = workers.iter().filter(|w| w.attached).count() as u64;
    e.gauge(
        "flotilla_queue_depth",
        "Calls waiting for a worker slot.",
        stats.queued as u64,
    );
    e.counter(
        "flotilla_attempts_assigned_total",
        "Attempts assigned to workers since the coordinator started.",
        stats.assigned,
    );
    e.family(
        "flotilla_worker_slots",
        "gauge",
        "Worker slots, busy and free.",
        &[
            (label("state", "busy"), u64::from(stats.busy)),
            (
                label("state", "free"),
                u64::from(stats.slots.saturating_sub(stats.busy)),
            ),
        ],
    );
    e.family(
        "flotilla_workers",
        "gauge",
        "Workers with a lease, attached or cut off.",
        &[
            (label("state", "attached"), attached),
            (label("state", "cut_off"), workers.len() as u64 - attached),
        ],
    );
    accounts(e, stats);
    namespaces(e, stats);
}

/// The namespaces: what they run and queue (from `stats`, in `render`).
fn namespaces(e: &mut Exposition, stats: &Stats) {
    let rows = |f: &dyn Fn(&crate::sched::NamespaceView) -> u64| -> Vec<(String, u64)> {
        stats
            .namespaces
            .iter()
            .map(|n| (label("namespace", &n.name), f(n)))
            .collect()
    };
    e.family(
        "flotilla_namespace_running",
        "gauge",
        "Agents of a namespace's runs on worker slots.",
        &rows(&|n| n.running as u64),
    );
    e.family(
        "flotilla_namespace_queued",
        "gauge",
        "Agents of a namespace's runs waiting for a slot.",
        &rows(&|n| n.queued as u64),
    );
    e.family(
        "flotilla_namespace_weight",
        "gauge",
        "A namespace's weight: its share of the slots against the others'.",
        &rows(&|n| u64::from(n.weight)),
    );
}

/// The namespaces' daily use and their quota refusals.
fn quotas(
    views: &[crate::namespace::QuotaView],
    refusals: &std::collections::BTreeMap<(String, &'static str), u64>,
) -> String {
    let mut e = Exposition::default();
    let rows = |f: &dyn Fn(&crate::namespace::QuotaView) -> u64| -> Vec<(String, u64)> {
        views
            .iter()
            .map(|v| (label("namespace", &v.namespace), f(v)))
            .collect()
    };
    e.family(
        "flotilla_namespace_agents_today",
        "gauge",
        "Agents a namespace started today (UTC).",
        &rows(&|v| v.used.agents),
    );
    e.family(
        "flotilla_namespace_tokens_today",
        "gauge",
        "Input and output tokens a namespace's agents used today (UTC).",
        &rows(&|v| v.used.tokens),
    );
    e.0.push_str(
        "# HELP flotilla_namespace_cost_usd_today What a namespace's agents cost today (UTC), in US dollars.\n# TYPE flotilla_namespace_cost_usd_today gauge\n",
    );
    for v in views {
        e.0.push_str(&format!(
            "flotilla_namespace_cost_usd_today{} {}\n",
            label("namespace", &v.namespace),
            v.used.cost_usd
        ));
    }
    let refused: Vec<(String, u64)> = refusals
        .iter()
        .map(|((ns, quota), n)| {
            (
                format!(
                    "{{namespace=\"{}\",quota=\"{}\"}}",
                    ns.replace('\\', "\\\\").replace('"', "\\\""),
                    quota.replace(' ', "_")
                ),
                *n,
            )
        })
        .collect();
    e.family(
        "flotilla_quota_refusals_total",
        "counter",
        "Launches and agents refused because their namespace used up a daily quota (QUOTA_EXCEEDED).",
        &refused,
    );
    e.0
}

/// Admission per provider account.
fn accounts(e: &mut Exposition, stats: &Stats) {
    let rows = |f: &dyn Fn(&crate::sched::AccountView) -> u64| -> Vec<(String, u64)> {
        stats
            .accounts
            .iter()
            .map(|a| (label("account", &a.id), f(a)))
            .collect()
    };
    e.family(
        "flotilla_account_window",
        "gauge",
        "Calls a provider account's adaptive window lets in at once.",
        &rows(&|a| u64::from(a.window)),
    );
    e.family(
        "flotilla_account_in_flight",
        "gauge",
        "Calls in flight through a provider account.",
        &rows(&|a| u64::from(a.in_flight)),
    );
    e.family(
        "flotilla_account_throttled_total",
        "counter",
        "Attempts a provider account refused for rate or load (429, 529), each waited out.",
        &rows(&|a| a.throttled),
    );
    e.family(
        "flotilla_account_waits_total",
        "counter",
        "Calls that waited for room in a provider account (its window or its pacing).",
        &rows(&|a| a.held),
    );
    e.family(
        "flotilla_account_started_total",
        "counter",
        "Attempts started through a provider account.",
        &rows(&|a| a.started),
    );
}

/// The process counters and histograms.
fn process(e: &mut Exposition) {
    e.counter(
        "flotilla_stalls_total",
        "Attempts ended by the stall watchdog (no progress for the stall timeout).",
        m::get(&m::STALLS),
    );
    e.family(
        "flotilla_restarts_total",
        "counter",
        "Calls started again, by reason.",
        &[
            (label("reason", "stall"), m::get(&m::RESTARTS_STALL)),
            (label("reason", "lease_lapsed"), m::get(&m::RESTARTS_LAPSE)),
            (label("reason", "user"), m::get(&m::RESTARTS_USER)),
            (label("reason", "transient"), m::get(&m::RESTARTS_TRANSIENT)),
        ],
    );
    e.counter(
        "flotilla_lease_renewal_failures_total",
        "Failed renewals of worker leases (each is retried).",
        m::get(&m::LEASE_RENEWAL_FAILURES),
    );
    e.counter(
        "flotilla_storage_write_retries_total",
        "Object-store writes that failed and were retried.",
        m::get(&m::STORAGE_WRITE_RETRIES),
    );
    e.counter(
        "flotilla_worker_messages_dropped_total",
        "Messages from workers that named no attempt they hold (another call's, another run's, or one that ended): dropped, nothing of them counted.",
        m::get(&m::WORKER_STRAYS),
    );
    e.counter(
        "flotilla_worker_usage_clipped_total",
        "Usage reports from workers above what one attempt can use, clipped to it before they were counted.",
        m::get(&m::USAGE_CLIPPED),
    );
    e.0.push_str(&m::DISPATCH_LATENCY.render(
        "flotilla_dispatch_latency_seconds",
        "From a call being ready to run to its attempt being assigned to a worker.",
    ));
    e.0.push_str(&m::STORAGE_WRITE_LATENCY.render(
        "flotilla_storage_write_seconds",
        "One object-store write, retries included.",
    ));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::RunStatus;

    fn snap(status: RunStatus, agents: u64, done: u64, running: u64) -> Summary {
        Summary {
            status,
            agents,
            done,
            running,
            queued: agents - done - running,
            output_tokens: 10,
            ..Summary::default()
        }
    }

    #[test]
    fn runs_count_by_status_and_agents_by_state() {
        let mut partial = snap(RunStatus::Completed, 4, 2, 0);
        (partial.queued, partial.failed) = (0, 2);
        let t = Tracked::of([
            snap(RunStatus::Running, 5, 2, 1),
            snap(RunStatus::Paused, 1, 0, 0),
            snap(RunStatus::Stopping, 1, 0, 1),
            snap(RunStatus::Completed, 3, 3, 0),
            partial,
        ]);
        assert_eq!(t.runs.get("running"), Some(&1));
        assert_eq!(t.runs.get("paused"), Some(&1));
        assert_eq!(t.runs.get("stopping"), Some(&1));
        assert_eq!(t.runs.get("completed"), Some(&2));
        assert_eq!(t.with_failures, 1);
        assert_eq!(t.agents.get("done"), Some(&7));
        assert_eq!(t.agents.get("failed"), Some(&2));
        assert_eq!(t.agents.get("queued"), Some(&3));
        assert_eq!(t.output_tokens, 50);
    }

    #[test]
    fn every_family_is_declared_once_and_every_sample_parses() {
        let t = Tracked::of([snap(RunStatus::Running, 2, 1, 1)]);
        let stats = Stats {
            slots: 4,
            busy: 1,
            accounts: vec![crate::sched::AccountView {
                id: "anthropic@api.anthropic.com#0a1b2c3d".into(),
                window: 12,
                in_flight: 3,
                started: 40,
                throttled: 2,
                held: 5,
                itpm: 0,
            }],
            ..Stats::default()
        };
        let workers = [WorkerView {
            name: "w\"1".into(),
            attached: false,
            slots: 4,
            busy: 1,
            backends: vec![],
            models: vec![],
            labels: Default::default(),
        }];
        let text = render(&t, &stats, &workers);
        let mut types = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap();
                assert!(types.insert(name.to_owned()), "{name} declared twice");
            } else if !line.starts_with('#') {
                let (_, value) = line.rsplit_once(' ').expect("a sample has a value");
                assert!(value.parse::<f64>().is_ok(), "{line}");
            }
        }
        assert!(
            text.contains("flotilla_worker_slots{state=\"free\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("flotilla_workers{state=\"cut_off\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("flotilla_agents{status=\"running\"} 1\n"),
            "{text}"
        );
        assert_eq!(label("k", "a\"b\\c"), "{k=\"a\\\"b\\\\c\"}");
    }
}
