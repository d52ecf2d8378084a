//! `/metrics`: the Prometheus text exposition of this coordinator — its runs and their agents,
//! the dispatcher and the fleet, and the process counters of [`crate::counters`].

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};

use flotilla_proto::exposition::{CONTENT_TYPE, Exposition, Labels, label};

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
    let mut e = Exposition::default();
    build(
        &mut e,
        web.coordinator.leadership().map_or("single", |l| l.role()),
    );
    render(&mut e, &tracked, &stats, &workers);
    usage(&mut e, scope);
    if let Some(q) = web.coordinator.quotas() {
        let mut views = q.views();
        views.retain(|v| scope.may(&v.namespace));
        let mut refusals = q.refusals();
        refusals.retain(|(ns, _), _| scope.may(ns));
        quotas(&mut e, &views, &refusals);
    }
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], e.finish()).into_response()
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

/// A count as a gauge's value.
fn g(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// One row per name of `names`, labeled `key`, counted in `counts` (0 when absent).
fn by(
    key: &'static str,
    names: &[&str],
    counts: &BTreeMap<&'static str, u64>,
) -> Vec<(Labels, i64)> {
    names
        .iter()
        .map(|n| (label(key, *n), g(counts.get(n).copied().unwrap_or(0))))
        .collect()
}

/// Which build this is and what this coordinator is now: leader, standby, suspended, or the
/// only one (`single`, no election).
fn build(e: &mut Exposition, role: &str) {
    e.process();
    e.gauges(
        "flotilla_coordinator_role",
        "This coordinator's role now (1 for the one it has): leader, standby, suspended (could not renew its lease in time), or single (no election).",
        ["leader", "standby", "suspended", "single"]
            .into_iter()
            .map(|r| (label("role", r), i64::from(r == role))),
    );
    e.counter(
        "flotilla_leader_elections_won_total",
        "Times this coordinator won the leader's seat (a standby taking over counts one).",
        m::get(&m::LEADER_WINS),
    );
}

fn render(e: &mut Exposition, t: &Tracked, stats: &Stats, workers: &[WorkerView]) {
    let statuses = [
        "running",
        "paused",
        "stopping",
        "completed",
        "failed",
        "stopped",
        "rejected",
    ];
    e.gauges(
        "flotilla_runs",
        "Runs tracked by this coordinator, by status.",
        by("status", &statuses, &t.runs),
    );
    e.gauge(
        "flotilla_runs_completed_with_failures",
        "Tracked runs whose script returned although agents of them failed (also counted as completed).",
        g(t.with_failures),
    );
    e.gauges(
        "flotilla_agents",
        "agent() calls of the tracked runs, by status (done counts cached ones too).",
        by(
            "status",
            &["queued", "running", "done", "failed", "cancelled", "cached"],
            &t.agents,
        ),
    );
    e.gauge(
        "flotilla_output_tokens",
        "Output tokens of the tracked runs (a gauge over the runs in memory; flotilla_tokens_total counts them for good).",
        g(t.output_tokens),
    );
    fleet(e, stats, workers);
    process(e);
}

/// Tokens and cost by namespace, workflow and model since this coordinator started, as
/// counters (a rate over them survives runs leaving memory).
fn usage(e: &mut Exposition, scope: &crate::namespace::Scope) {
    let table = m::USAGE.lock().unwrap_or_else(|p| p.into_inner());
    let rows = table.rows(|ns| scope.may(ns));
    let key = |[ns, wf, model]: &[&str; 3]| -> Labels {
        vec![
            ("namespace", (*ns).to_owned()),
            ("workflow", (*wf).to_owned()),
            ("model", (*model).to_owned()),
        ]
    };
    let mut tokens = Vec::with_capacity(rows.len() * 4);
    for (k, u) in &rows {
        for (kind, n) in [
            ("input", u.input_tokens),
            ("output", u.output_tokens),
            ("cache_read", u.cache_read_tokens),
            ("cache_write", u.cache_write_tokens),
        ] {
            let mut l = key(k);
            l.push(("type", kind.into()));
            tokens.push((l, n));
        }
    }
    e.counters(
        "flotilla_tokens_total",
        "Tokens agents used, by namespace, workflow, model and type (input, output, cache_read, cache_write); workflows past the coordinator's row cap count under (other).",
        tokens,
    );
    e.float_counters(
        "flotilla_cost_usd_total",
        "What agents cost in US dollars, by namespace, workflow and model (as priced by the backend or the namespace's price table).",
        rows.iter().map(|(k, u)| (key(k), u.cost_usd)),
    );
}

/// The dispatcher and the workers.
fn fleet(e: &mut Exposition, stats: &Stats, workers: &[WorkerView]) {
    let attached = workers.iter().filter(|w| w.attached).count();
    e.gauge(
        "flotilla_queue_depth",
        "Calls waiting for a worker slot.",
        g(stats.queued),
    );
    e.counter(
        "flotilla_attempts_assigned_total",
        "Attempts assigned to workers since the coordinator started.",
        stats.assigned,
    );
    e.gauges(
        "flotilla_worker_slots",
        "Worker slots, busy and free.",
        [
            (label("state", "busy"), g(stats.busy)),
            (
                label("state", "free"),
                g(stats.slots.saturating_sub(stats.busy)),
            ),
        ],
    );
    e.gauges(
        "flotilla_workers",
        "Workers with a lease, attached or cut off.",
        [
            (label("state", "attached"), g(attached)),
            (label("state", "cut_off"), g(workers.len() - attached)),
        ],
    );
    accounts(e, stats);
    namespaces(e, stats);
}

/// The namespaces: what they run and queue (from `stats`, in `render`).
fn namespaces(e: &mut Exposition, stats: &Stats) {
    let rows = |f: &dyn Fn(&crate::sched::NamespaceView) -> i64| -> Vec<(Labels, i64)> {
        stats
            .namespaces
            .iter()
            .map(|n| (label("namespace", n.name.as_str()), f(n)))
            .collect()
    };
    e.gauges(
        "flotilla_namespace_running",
        "Agents of a namespace's runs on worker slots.",
        rows(&|n| g(n.running)),
    );
    e.gauges(
        "flotilla_namespace_queued",
        "Agents of a namespace's runs waiting for a slot.",
        rows(&|n| g(n.queued)),
    );
    e.gauges(
        "flotilla_namespace_weight",
        "A namespace's weight: its share of the slots against the others'.",
        rows(&|n| g(n.weight)),
    );
}

/// The namespaces' daily use and their quota refusals.
fn quotas(
    e: &mut Exposition,
    views: &[crate::namespace::QuotaView],
    refusals: &BTreeMap<(String, &'static str), u64>,
) {
    let ns = |v: &crate::namespace::QuotaView| label("namespace", v.namespace.as_str());
    e.gauges(
        "flotilla_namespace_agents_today",
        "Agents a namespace started today (UTC).",
        views.iter().map(|v| (ns(v), g(v.used.agents))),
    );
    e.gauges(
        "flotilla_namespace_tokens_today",
        "Input and output tokens a namespace's agents used today (UTC).",
        views.iter().map(|v| (ns(v), g(v.used.tokens))),
    );
    e.float_gauges(
        "flotilla_namespace_cost_usd_today",
        "What a namespace's agents cost today (UTC), in US dollars.",
        views.iter().map(|v| (ns(v), v.used.cost_usd)),
    );
    e.float_gauges(
        "flotilla_namespace_quota",
        "A namespace's daily quotas (UTC), by quota: agents_per_day, tokens_per_day, usd_per_day (none: no row).",
        views.iter().flat_map(|v| {
            let p = &v.policy;
            [
                ("agents_per_day", p.agents_per_day.map(|n| n as f64)),
                ("tokens_per_day", p.tokens_per_day.map(|n| n as f64)),
                ("usd_per_day", p.usd_per_day),
            ]
            .into_iter()
            .filter_map(|(quota, limit)| {
                Some((
                    vec![("namespace", v.namespace.clone()), ("quota", quota.to_owned())],
                    limit?,
                ))
            })
        }),
    );
    e.counters(
        "flotilla_quota_refusals_total",
        "Launches and agents refused because their namespace used up a daily quota (QUOTA_EXCEEDED).",
        refusals.iter().map(|((ns, quota), n)| {
            (
                vec![("namespace", ns.clone()), ("quota", quota.replace(' ', "_"))],
                *n,
            )
        }),
    );
}

/// Admission per provider account.
fn accounts(e: &mut Exposition, stats: &Stats) {
    let rows = |f: &dyn Fn(&crate::sched::AccountView) -> u64| -> Vec<(Labels, u64)> {
        stats
            .accounts
            .iter()
            .map(|a| (label("account", a.id.as_str()), f(a)))
            .collect()
    };
    let gauges = |rows: Vec<(Labels, u64)>| rows.into_iter().map(|(l, v)| (l, g(v)));
    e.gauges(
        "flotilla_account_window",
        "Calls a provider account's adaptive window lets in at once.",
        gauges(rows(&|a| u64::from(a.window))),
    );
    e.gauges(
        "flotilla_account_in_flight",
        "Calls in flight through a provider account.",
        gauges(rows(&|a| u64::from(a.in_flight))),
    );
    e.counters(
        "flotilla_account_throttled_total",
        "Attempts a provider account refused for rate or load (429, 529), each waited out.",
        rows(&|a| a.throttled),
    );
    e.counters(
        "flotilla_account_waits_total",
        "Calls that waited for room in a provider account (its window or its pacing).",
        rows(&|a| a.held),
    );
    e.counters(
        "flotilla_account_started_total",
        "Attempts started through a provider account.",
        rows(&|a| a.started),
    );
}

/// The process counters and histograms.
fn process(e: &mut Exposition) {
    e.counter(
        "flotilla_stalls_total",
        "Attempts ended by the stall watchdog (no progress for the stall timeout).",
        m::get(&m::STALLS),
    );
    e.counters(
        "flotilla_restarts_total",
        "Calls started again, by reason.",
        [
            (label("reason", "stall"), m::get(&m::RESTARTS_STALL)),
            (label("reason", "lease_lapsed"), m::get(&m::RESTARTS_LAPSE)),
            (label("reason", "user"), m::get(&m::RESTARTS_USER)),
            (label("reason", "transient"), m::get(&m::RESTARTS_TRANSIENT)),
        ],
    );
    e.metric(
        "flotilla_attempts_total",
        "Attempts that ended, by outcome (completed, failed, stalled, lost) and failure class (empty when completed).",
        m::ATTEMPTS.clone(),
    );
    e.metric(
        "flotilla_attempt_duration_seconds",
        "How long ended attempts held their worker slot, by outcome.",
        m::ATTEMPT_SECONDS.clone(),
    );
    e.metric(
        "flotilla_run_duration_seconds",
        "How long runs took from launch to their end, by status.",
        m::RUN_SECONDS.clone(),
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
    e.histogram(
        "flotilla_queue_wait_seconds",
        "From a call being ready to run to its attempt being assigned to a worker: the wait for a slot (the dispatcher's own latency when one is free).",
        &m::DISPATCH_LATENCY,
    );
    e.histogram(
        "flotilla_storage_write_seconds",
        "One object-store write, retries included.",
        &m::STORAGE_WRITE_LATENCY,
    );
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
            attempts: 0,
            heard_secs_ago: 0,
            name: "w\"1".into(),
            attached: false,
            slots: 4,
            busy: 1,
            backends: vec![],
            models: vec![],
            labels: Default::default(),
        }];
        let mut e = Exposition::default();
        build(&mut e, "standby");
        render(&mut e, &t, &stats, &workers);
        let text = e.finish();
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
        assert!(
            text.contains("flotilla_coordinator_role{role=\"standby\"} 1\n")
                && text.contains("flotilla_coordinator_role{role=\"leader\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE flotilla_stalls_total counter\n"),
            "{text}"
        );
        assert!(text.contains("flotilla_build_info{version=\""), "{text}");
    }
}
