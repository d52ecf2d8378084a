//! The coordinator's HTTP face: session pages and their JSON, behind sign-in.
//!
//! - `GET /runs/{run}`: the session page of a run (live while it runs here: the changing part
//!   arrives as HTML over server-sent events from `/runs/{run}/events`; read from storage when
//!   it ran elsewhere or earlier).
//! - `GET /runs/{run}/status.json`, `GET /runs.json`: the same data as JSON.
//! - `GET /runs/{run}/agents/{index}`: one agent's page (where and when it ran, what it cost,
//!   its transcript as turns, its change as a coloured diff);
//!   `GET /runs/{run}/diff`: the run's whole diff.
//! - `POST /runs/{run}/control`: pause, resume, stop or restart (W54–W56), with the reader's
//!   reason, which the run's log and events keep.
//! - `GET /metrics`: Prometheus exposition of the coordinator's metrics.
//! - `GET /runs` (`/runs.json`): the runs in the store, newest first, filtered and paged.
//! - `GET /fleet`: workers, provider accounts, and the reader's namespaces against their quotas.
//! - `GET /login?token=T[&next=/runs/…]`: checks a session token and keeps it in a cookie.
//! - `GET /healthz` (no sign-in): 200 when this coordinator can serve — it leads, or stands
//!   by with its lease renewed (etcd answers), and its store takes writes — else 503 with
//!   why; `GET /livez`: 200 while the process answers.
//!
//! Access: every route but `/login` needs a session token, as `Authorization: Bearer T` or
//! the `flotilla_session` cookie. Tokens come from `flotilla token create` (an mTLS call, so
//! only holders of a client certificate get one); they are signed with a key derived from the
//! coordinator's private key ([`TokenKey`]), so every coordinator sharing that key accepts
//! them and a restart does not sign anyone out. A coordinator started `--insecure` on
//! loopback serves the pages to anyone (development only).
//!
//! Slow clients: the listener caps connections per peer and lets a new peer in when full
//! (`listen`); a request's headers and body must each arrive within the read timeout
//! (`server.rs`), so `/healthz` and `/livez` answer while others trickle bytes.
//!
//! Files: `auth.rs` (tokens, sign-in and the guard), `routes.rs` (the handlers), `render.rs`
//! (the HTML), `timeline.rs` (a run's agents over time), `turns.rs` (transcripts and diffs),
//! `metrics.rs` (the Prometheus exposition), `server.rs` (HTTP on the listener).

use flotilla_proto::Problem;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use crate::registry::RunRegistry;

use crate::coordinator::Coordinator;

mod auth;
mod escape;
mod fleet_page;
mod listing;
mod live_cache;
mod metrics;
mod render;
mod routes;
mod server;
mod state;
mod timeline;
mod turns;

pub use crate::tokens::TokenKey;
use auth::*;
pub use auth::{COOKIE, Claims, KEY_COOKIE, MAX_TOKEN_TTL, new_page_key};
pub use escape::esc;
use listing::{runs_json, runs_page};
use routes::*;
pub use server::{MAX_BODY_BYTES, serve_router, serve_router_tls};
pub use state::Access;
use state::Web;

/// How the pages are served.
#[derive(Debug, Clone)]
pub struct WebOptions {
    pub listen: SocketAddr,
    /// `None`: no sign-in (an `--insecure` coordinator on loopback).
    pub auth: Option<TokenKey>,
    /// Connection limits, idle and read timeouts of the listener.
    pub limits: crate::listen::ConnLimits,
}

/// Serves the pages until `cancel` fires.
pub async fn serve(
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    opts: WebOptions,
    cancel: CancellationToken,
) -> Result<(), Problem> {
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| {
            Problem::unavailable(format!(
                "cannot serve session pages on {}: {e}",
                opts.listen
            ))
        })?;
    let access = match opts.auth {
        Some(key) => Access::Tokens(key),
        None => Access::Loopback {
            port: listener
                .local_addr()
                .map_or(opts.listen.port(), |a| a.port()),
        },
    };
    let listener = crate::listen::Limited::new(listener, opts.limits);
    serve_router(listener, router(coordinator, registry, access), cancel).await;
    Ok(())
}

/// Serves the operator listener (`--metrics-listen`) until `cancel` fires: `GET /metrics`
/// with every namespace's figures and no sign-in, and nothing else — no run, page or control
/// is reachable on it. Who may scrape it is decided by the address it is bound to, and with
/// `tls` (`--metrics-tls`) by a client certificate of the fleet's CA as well.
pub async fn serve_metrics(
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    listen: SocketAddr,
    limits: crate::listen::ConnLimits,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    cancel: CancellationToken,
) -> Result<(), Problem> {
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        Problem::unavailable(format!(
            "cannot serve operator metrics on {listen}: {e} (choose another --metrics-listen address)"
        ))
    })?;
    let router = metrics_router(coordinator, registry);
    match tls {
        Some(config) => serve_router_tls(listener, config, limits, router, cancel).await,
        None => {
            serve_router(
                crate::listen::Limited::new(listener, limits),
                router,
                cancel,
            )
            .await
        }
    }
    Ok(())
}

/// The operator listener's one route (public for tests).
pub fn metrics_router(coordinator: Arc<Coordinator>, registry: Arc<RunRegistry>) -> Router {
    let web = Web {
        coordinator,
        registry,
        // Never consulted: the one route takes no sign-in.
        access: Access::Loopback { port: 0 },
        live: Default::default(),
    };
    Router::new()
        .route("/metrics", get(metrics::operator_metrics))
        .with_state(web)
}

/// Readiness (for a load balancer or Kubernetes): its role and its store, 503 unless both
/// are well. Says nothing about runs, so it needs no sign-in.
async fn healthz(State(web): State<Web>) -> Response {
    let role = web.coordinator.leadership().map_or("single", |l| l.role());
    let store = web.coordinator.store().health.problem();
    let ready = role != "suspended" && store.is_none();
    let body = serde_json::json!({ "ready": ready, "role": role, "store": store.as_deref().unwrap_or("ok") });
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body)).into_response()
}

/// The routes (public for tests).
pub fn router(coordinator: Arc<Coordinator>, registry: Arc<RunRegistry>, access: Access) -> Router {
    let web = Web {
        coordinator,
        registry,
        access,
        live: Default::default(),
    };
    Router::new()
        .route("/", get(|| async { Redirect::to("/runs") }))
        .route("/login", get(login))
        .route("/runs", get(runs_page))
        .route("/fleet", get(fleet_page::fleet_page))
        .route("/runs.json", get(runs_json))
        .route("/runs/{run}", get(run_page))
        .route("/runs/{run}/status.json", get(run_json))
        .route("/runs/{run}/events", get(run_events))
        .route("/runs/{run}/agents/{index}", get(agent_page))
        .route("/runs/{run}/diff", get(run_diff))
        .route("/runs/{run}/control", axum::routing::post(control))
        .route("/metrics", get(metrics::metrics))
        .route("/healthz", get(healthz))
        .route("/livez", get(|| async { "ok\n" }))
        .layer(axum::middleware::from_fn_with_state(web.clone(), guard))
        .with_state(web)
}
