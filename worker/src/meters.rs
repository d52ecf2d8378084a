//! The worker's figures for Prometheus: its slots, its attempts and how they ended, the
//! workspaces it made, its link to the coordinator. Served by [`serve`] on the worker's
//! operator listener (`flotilla worker --metrics-listen ADDR`): `GET /metrics` and nothing
//! else, no sign-in, so who may scrape it is decided by the address it is bound to. The
//! counters are process-wide atomics, recorded once per attempt.

use std::net::SocketAddr;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use flotilla_proto::exposition::{CONTENT_TYPE, Exposition, label};
use flotilla_proto::histogram::Histogram;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio_util::sync::CancellationToken;

/// Labels whose values are all known in advance: recorded without an allocation.
type Fixed<const N: usize> = [(&'static str, &'static str); N];

/// Slots this worker offers (the last worker made in this process).
pub static SLOTS: AtomicI64 = AtomicI64::new(0);
/// Attempts running now.
pub static BUSY: AtomicI64 = AtomicI64::new(0);
/// Whether a link to a coordinator is up.
pub static ATTACHED: AtomicI64 = AtomicI64::new(0);
/// Links made to a coordinator, and tries that failed.
pub static LINKS_MADE: AtomicU64 = AtomicU64::new(0);
pub static LINK_FAILURES: AtomicU64 = AtomicU64::new(0);
/// Whether agents run sandboxed (bubblewrap) here.
pub static SANDBOXED: AtomicI64 = AtomicI64::new(0);
/// Attempts that ended here, by outcome and failure class.
pub static ATTEMPTS: LazyLock<Family<Fixed<2>, Counter>> = LazyLock::new(Family::default);
/// From an assignment arriving to its outcome.
pub static ATTEMPT_SECONDS: Histogram = Histogram::new(LONG);
/// Making an attempt's workspace (its checkout or worktree), by how it went.
pub static WORKSPACES: LazyLock<Family<Fixed<1>, Counter>> = LazyLock::new(Family::default);
pub static WORKSPACE_SECONDS: Histogram =
    Histogram::new(flotilla_proto::histogram::LATENCY_SECONDS);

/// Attempts last seconds to an hour (at most 16 bounds).
const LONG: &[f64] = &[
    0.1, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
];

/// Counts one attempt as running until it is dropped, then as ended with `ended`'s labels.
pub struct Running {
    since: std::time::Instant,
    pub ended: (&'static str, &'static str),
}

impl Running {
    pub fn start() -> Running {
        BUSY.fetch_add(1, Ordering::Relaxed);
        Running {
            since: std::time::Instant::now(),
            // An attempt dropped before its outcome (its task ended with the worker).
            ended: ("abandoned", ""),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        BUSY.fetch_sub(1, Ordering::Relaxed);
        let (outcome, class) = self.ended;
        ATTEMPTS
            .get_or_create(&[("outcome", outcome), ("class", class)])
            .inc();
        ATTEMPT_SECONDS.observe(self.since.elapsed());
    }
}

/// A workspace was made (`made`), failed (`failed`) or took too long (`timed_out`).
pub fn workspace(result: &'static str, took: Duration) {
    WORKSPACES.get_or_create(&[("result", result)]).inc();
    WORKSPACE_SECONDS.observe(took);
}

fn get(a: &AtomicI64) -> i64 {
    a.load(Ordering::Relaxed)
}

/// The exposition of this worker process.
pub fn exposition() -> String {
    let mut e = Exposition::default();
    e.process();
    let (slots, busy) = (get(&SLOTS), get(&BUSY));
    e.gauges(
        "flotilla_worker_slots",
        "This worker's slots, busy and free.",
        [
            (label("state", "busy"), busy),
            (label("state", "free"), (slots - busy).max(0)),
        ],
    );
    e.gauge(
        "flotilla_worker_attached",
        "Whether this worker has a link to a coordinator (1) or is reconnecting (0).",
        get(&ATTACHED),
    );
    e.counters(
        "flotilla_worker_links_total",
        "Links this worker made to a coordinator (attached), and tries that failed.",
        [
            (
                label("result", "attached"),
                LINKS_MADE.load(Ordering::Relaxed),
            ),
            (
                label("result", "failed"),
                LINK_FAILURES.load(Ordering::Relaxed),
            ),
        ],
    );
    e.gauge(
        "flotilla_worker_sandboxed",
        "Whether this worker runs agents in a bubblewrap sandbox (1) or not (0, --sandbox off).",
        get(&SANDBOXED),
    );
    e.metric(
        "flotilla_worker_attempts_total",
        "Attempts that ended on this worker, by outcome (completed, failed, abandoned) and failure class (empty when completed).",
        ATTEMPTS.clone(),
    );
    e.histogram(
        "flotilla_worker_attempt_duration_seconds",
        "From an assignment reaching this worker to its outcome.",
        &ATTEMPT_SECONDS,
    );
    e.metric(
        "flotilla_worker_workspaces_total",
        "Workspaces (checkouts of a run's source, worktrees) this worker made, by result (made, failed, timed_out).",
        WORKSPACES.clone(),
    );
    e.histogram(
        "flotilla_worker_workspace_seconds",
        "Making one attempt's workspace.",
        &WORKSPACE_SECONDS,
    );
    e.finish()
}

/// The operator listener's socket, bound before the worker attaches (so a bad address stops
/// it with the reason).
pub async fn bind(listen: SocketAddr) -> Result<tokio::net::TcpListener, flotilla_proto::Problem> {
    tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        flotilla_proto::Problem::unavailable(format!(
            "cannot serve worker metrics on {listen}: {e} (choose another --metrics-listen address)"
        ))
    })
}

/// Serves `GET /metrics` on `listener` until `stop` fires; any other path is 404.
pub async fn serve(listener: tokio::net::TcpListener, stop: CancellationToken) {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(|| async {
            (
                [(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)],
                exposition(),
            )
        }),
    );
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await;
    if let Err(e) = served {
        tracing::warn!(error = %e, "the worker's metrics listener stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_proto::v1::FailureKind;

    #[test]
    fn an_attempt_counts_as_busy_while_it_runs_and_by_its_outcome_after() {
        SLOTS.store(3, Ordering::Relaxed);
        let before = ATTEMPTS
            .get_or_create(&[("outcome", "failed"), ("class", "setup")])
            .get();
        let mut r = Running::start();
        assert!(exposition().contains("flotilla_worker_slots{state=\"busy\"} "));
        r.ended = ("failed", FailureKind::Setup.class());
        drop(r);
        let after = ATTEMPTS
            .get_or_create(&[("outcome", "failed"), ("class", "setup")])
            .get();
        assert_eq!(after, before + 1);
        let text = exposition();
        assert!(
            text.contains("flotilla_worker_attempts_total{outcome=\"failed\",class=\"setup\"} "),
            "{text}"
        );
        assert!(
            text.contains("# TYPE flotilla_worker_attempt_duration_seconds histogram\n"),
            "{text}"
        );
    }
}
