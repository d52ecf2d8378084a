//! The coordinator's HTTP face: session pages and their JSON, behind sign-in.
//!
//! - `GET /runs/{run}`: the session page of a run (live while it runs here: the page polls
//!   `/runs/{run}/status.json`; read from storage when it ran elsewhere or earlier).
//! - `GET /runs/{run}/status.json`, `GET /runs.json`: the same data as JSON.
//! - `GET /runs`: the runs in the store.
//! - `GET /login?token=T[&next=/runs/…]`: checks a session token and keeps it in a cookie.
//!
//! Access: every route but `/login` needs a session token, as `Authorization: Bearer T` or
//! the `flotilla_session` cookie. Tokens come from `flotilla token create` (an mTLS call, so
//! only holders of a client certificate get one); they are signed with a key derived from the
//! coordinator's private key ([`TokenKey`]), so every coordinator sharing that key accepts
//! them and a restart does not sign anyone out. A coordinator started `--insecure` on
//! loopback serves the pages to anyone (development only).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::get;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::coordinator::Coordinator;
use crate::history;
use crate::report::{Report, RunStatus};
use crate::server::{RunRegistry, SnapshotView};

/// Name of the cookie that carries a session token.
pub const COOKIE: &str = "flotilla_session";
/// Longest a session token may live.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Signs and checks session tokens (HMAC-SHA256).
#[derive(Clone)]
pub struct TokenKey(ring::hmac::Key);

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

/// What a token says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// Who it was issued to (the CN of the certificate that asked for it).
    pub sub: String,
    /// Expiry, seconds since the Unix epoch.
    pub exp: u64,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl TokenKey {
    /// A key derived from secret bytes (the coordinator's private key file).
    pub fn derive(secret: &[u8]) -> TokenKey {
        let seed = ring::digest::digest(
            &ring::digest::SHA256,
            &[b"flotilla session token v1\0".as_slice(), secret].concat(),
        );
        TokenKey(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, seed.as_ref()))
    }

    /// A token for `sub`, valid for `ttl` (at most [`MAX_TOKEN_TTL`]).
    pub fn issue(&self, sub: &str, ttl: Duration) -> String {
        let claims = Claims {
            sub: sub.to_owned(),
            exp: now_secs() + ttl.min(MAX_TOKEN_TTL).as_secs(),
        };
        let body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).unwrap_or_default());
        let tag = ring::hmac::sign(&self.0, body.as_bytes());
        format!("v1.{body}.{}", URL_SAFE_NO_PAD.encode(tag.as_ref()))
    }

    /// The claims of a valid, unexpired token.
    pub fn verify(&self, token: &str) -> Result<Claims, &'static str> {
        let mut parts = token.trim().split('.');
        let (Some("v1"), Some(body), Some(tag), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err("not a flotilla session token");
        };
        let tag = URL_SAFE_NO_PAD
            .decode(tag)
            .map_err(|_| "not a flotilla session token")?;
        ring::hmac::verify(&self.0, body.as_bytes(), &tag)
            .map_err(|_| "the token was not issued by this fleet's coordinator")?;
        let claims: Claims = URL_SAFE_NO_PAD
            .decode(body)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or("not a flotilla session token")?;
        if claims.exp <= now_secs() {
            return Err("the token has expired; create a new one with `flotilla token create`");
        }
        Ok(claims)
    }
}

/// How the pages are served.
#[derive(Debug, Clone)]
pub struct WebOptions {
    pub listen: SocketAddr,
    /// `None`: no sign-in (an `--insecure` coordinator on loopback).
    pub auth: Option<TokenKey>,
}

#[derive(Clone)]
struct Web {
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    auth: Option<TokenKey>,
}

/// Serves the pages until `cancel` fires.
pub async fn serve(
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    opts: WebOptions,
    cancel: CancellationToken,
) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| format!("cannot serve session pages on {}: {e}", opts.listen))?;
    axum::serve(listener, router(coordinator, registry, opts.auth))
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await
        .map_err(|e| format!("session pages on {}: {e}", opts.listen))
}

/// The routes (public for tests).
pub fn router(
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    auth: Option<TokenKey>,
) -> Router {
    Router::new()
        .route("/", get(|| async { Redirect::to("/runs") }))
        .route("/login", get(login))
        .route("/runs", get(runs_page))
        .route("/runs.json", get(runs_json))
        .route("/runs/{run}", get(run_page))
        .route("/runs/{run}/status.json", get(run_json))
        .route("/metrics", get(metrics))
        .with_state(Web {
            coordinator,
            registry,
            auth,
        })
}

fn token_of(headers: &HeaderMap) -> Option<String> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        && let Some(t) = v.strip_prefix("Bearer ")
    {
        return Some(t.trim().to_owned());
    }
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_owned())
}

/// Why a request is refused; `Ok` when it may go on.
fn check(web: &Web, headers: &HeaderMap) -> Result<(), &'static str> {
    let Some(key) = &web.auth else {
        return Ok(());
    };
    let token = token_of(headers).ok_or(
        "sign in first: run `flotilla token create` (with your client certificate) and open the link it prints",
    )?;
    key.verify(&token).map(|_| ())
}

fn refuse(why: &str, json: bool) -> Response {
    let body = if json {
        serde_json::json!({ "error": why })
            .to_string()
            .into_response()
    } else {
        Html(page(
            "Sign in",
            &format!("<p class=err>{}</p>", esc(why)),
            None,
        ))
        .into_response()
    };
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer realm=\"flotilla\"")],
        body,
    )
        .into_response()
}

#[derive(Deserialize)]
struct LoginQuery {
    token: String,
    next: Option<String>,
}

async fn login(State(web): State<Web>, Query(q): Query<LoginQuery>) -> Response {
    let Some(key) = &web.auth else {
        return Redirect::to("/runs").into_response();
    };
    let claims = match key.verify(&q.token) {
        Ok(c) => c,
        Err(why) => return refuse(why, false),
    };
    // Only paths on this site (no `//host` redirects).
    let next = q
        .next
        .filter(|n| n.starts_with('/') && !n.starts_with("//"))
        .unwrap_or_else(|| "/runs".to_owned());
    let max_age = claims.exp.saturating_sub(now_secs());
    let cookie = format!(
        "{COOKIE}={}; Path=/; HttpOnly; SameSite=Lax; Max-Age={max_age}",
        q.token.trim()
    );
    (
        StatusCode::SEE_OTHER,
        [(header::SET_COOKIE, cookie), (header::LOCATION, next)],
    )
        .into_response()
}

/// What a page shows of a run: live from this coordinator, or its stored report.
#[derive(Debug, Clone, Serialize)]
struct RunView {
    #[serde(flatten)]
    snapshot: SnapshotView,
    finished: bool,
    /// The report once the run has ended.
    report: Option<Report>,
}

async fn view(web: &Web, run: &str) -> Result<RunView, (StatusCode, String)> {
    if let Some((snap, report)) = web.registry.live(run) {
        return Ok(RunView {
            snapshot: SnapshotView::from(&*snap),
            finished: report.is_some(),
            report: report.map(|r| (*r).clone()),
        });
    }
    let report = history::load_report(web.coordinator.store(), run)
        .await
        .map_err(|e| match e.kind() {
            flotilla_proto::ErrorKind::NotFound => (
                StatusCode::NOT_FOUND,
                format!("no run {run} on this coordinator or in its store"),
            ),
            _ => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cannot read run {run}: {e}"),
            ),
        })?;
    Ok(RunView {
        snapshot: SnapshotView::from_report(&report),
        finished: report.status.is_final(),
        report: Some(report),
    })
}

async fn run_json(State(web): State<Web>, Path(run): Path<String>, headers: HeaderMap) -> Response {
    if let Err(why) = check(&web, &headers) {
        return refuse(why, true);
    }
    match view(&web, &run).await {
        Ok(v) => axum::Json(v).into_response(),
        Err((code, msg)) => (code, axum::Json(serde_json::json!({ "error": msg }))).into_response(),
    }
}

async fn run_page(State(web): State<Web>, Path(run): Path<String>, headers: HeaderMap) -> Response {
    if let Err(why) = check(&web, &headers) {
        return refuse(why, false);
    }
    match view(&web, &run).await {
        Ok(v) => Html(render_run(&v)).into_response(),
        Err((code, msg)) => (
            code,
            Html(page(
                "Not found",
                &format!("<p class=err>{}</p>", esc(&msg)),
                None,
            )),
        )
            .into_response(),
    }
}

async fn runs_json(State(web): State<Web>, headers: HeaderMap) -> Response {
    if let Err(why) = check(&web, &headers) {
        return refuse(why, true);
    }
    match history::list_runs(web.coordinator.store()).await {
        Ok(runs) => axum::Json(runs).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({ "error": format!("cannot list runs: {e}") })),
        )
            .into_response(),
    }
}

async fn runs_page(State(web): State<Web>, headers: HeaderMap) -> Response {
    if let Err(why) = check(&web, &headers) {
        return refuse(why, false);
    }
    let runs = match history::list_runs(web.coordinator.store()).await {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                Html(page(
                    "Runs",
                    &format!("<p class=err>cannot list runs: {}</p>", esc(&e.to_string())),
                    None,
                )),
            )
                .into_response();
        }
    };
    let mut rows = String::new();
    for r in runs.iter().rev() {
        rows.push_str(&format!(
            "<tr><td><a href=\"/runs/{id}\">{id}</a></td><td>{wf}</td><td class=\"st {st}\">{st}</td><td>{agents}</td><td>{created}</td></tr>",
            id = esc(&r.run_id),
            wf = esc(&r.workflow),
            st = r.status.as_str(),
            agents = r.agents,
            created = esc(&r.created),
        ));
    }
    let body = format!(
        "<table><thead><tr><th>run</th><th>workflow</th><th>status</th><th>agents</th><th>created</th></tr></thead><tbody>{rows}</tbody></table>"
    );
    Html(page("Runs", &body, None)).into_response()
}

/// Prometheus text format: runs and agents of this coordinator, the dispatcher and the fleet.
async fn metrics(State(web): State<Web>, headers: HeaderMap) -> Response {
    if let Err(why) = check(&web, &headers) {
        return refuse(why, true);
    }
    let mut runs: std::collections::BTreeMap<&'static str, u64> = std::collections::BTreeMap::new();
    let mut agents: std::collections::BTreeMap<&'static str, u64> =
        std::collections::BTreeMap::new();
    let mut tokens = 0u64;
    for (snap, ended) in web.registry.all() {
        let status = snap.status.map_or("pending", RunStatus::as_str);
        *runs
            .entry(if ended {
                status
            } else if status == "paused" {
                "paused"
            } else {
                "running"
            })
            .or_default() += 1;
        *agents.entry("done").or_default() += snap.done;
        *agents.entry("failed").or_default() += snap.failed;
        *agents.entry("running").or_default() += snap.running;
        *agents.entry("cached").or_default() += snap.cached;
        *agents.entry("queued").or_default() += snap
            .agents
            .saturating_sub(snap.done + snap.failed + snap.running);
        tokens += snap.output_tokens;
    }
    let stats = web.coordinator.dispatch().stats().await.unwrap_or_default();
    let workers = web.coordinator.dispatch().workers().await;
    let attached = workers.iter().filter(|w| w.attached).count();
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, rows: Vec<(String, String)>| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (labels, value) in rows {
            out.push_str(&format!("{name}{labels} {value}\n"));
        }
    };
    let label = |k: &str, v: &str| {
        format!(
            "{{{k}=\"{}\"}}",
            v.replace('\\', "\\\\").replace('"', "\\\"")
        )
    };
    family(
        "flotilla_runs",
        "gauge",
        "Runs tracked by this coordinator, by status.",
        [
            "running",
            "paused",
            "completed",
            "failed",
            "stopped",
            "rejected",
        ]
        .iter()
        .map(|s| {
            (
                label("status", s),
                runs.get(s).copied().unwrap_or(0).to_string(),
            )
        })
        .collect(),
    );
    family(
        "flotilla_agents",
        "gauge",
        "agent() calls of the tracked runs, by status.",
        ["queued", "running", "done", "failed", "cached"]
            .iter()
            .map(|s| {
                (
                    label("status", s),
                    agents.get(s).copied().unwrap_or(0).to_string(),
                )
            })
            .collect(),
    );
    family(
        "flotilla_output_tokens",
        "gauge",
        "Output tokens of the tracked runs.",
        vec![(String::new(), tokens.to_string())],
    );
    family(
        "flotilla_queue_depth",
        "gauge",
        "Calls waiting for a worker slot.",
        vec![(String::new(), stats.queued.to_string())],
    );
    family(
        "flotilla_attempts_assigned_total",
        "counter",
        "Attempts assigned to workers since the coordinator started.",
        vec![(String::new(), stats.assigned.to_string())],
    );
    family(
        "flotilla_worker_slots",
        "gauge",
        "Worker slots, busy and free.",
        vec![
            (label("state", "busy"), stats.busy.to_string()),
            (
                label("state", "free"),
                stats.slots.saturating_sub(stats.busy).to_string(),
            ),
        ],
    );
    family(
        "flotilla_workers",
        "gauge",
        "Workers with a lease, attached or cut off.",
        vec![
            (label("state", "attached"), attached.to_string()),
            (
                label("state", "cut_off"),
                (workers.len() - attached).to_string(),
            ),
        ],
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

fn render_run(v: &RunView) -> String {
    let s = &v.snapshot;
    let status = s.status.map_or("pending", RunStatus::as_str);
    let mut body = format!(
        "<h1>{wf} <small>{id}</small></h1>\
         <p class=counters><span class=\"st {status}\" id=status>{status}</span> \
         · agents <b id=done>{done}</b> done / <b id=agents>{agents}</b> \
         · running <b id=running>{running}</b> · failed <b id=failed>{failed}</b> \
         · output tokens <b id=tokens>{tokens}</b> · elapsed <b id=elapsed>{elapsed}</b></p>",
        wf = esc(if s.workflow.is_empty() {
            "workflow"
        } else {
            &s.workflow
        }),
        id = esc(&s.run_id),
        done = s.done,
        agents = s.agents,
        running = s.running,
        failed = s.failed,
        tokens = s.output_tokens,
        elapsed = fmt_ms(s.elapsed_ms),
    );
    body.push_str("<h2>Phases</h2><table id=groups><tbody>");
    for (title, done, total) in &s.groups {
        body.push_str(&format!(
            "<tr><td>{}</td><td>{done} / {total}</td></tr>",
            esc(title)
        ));
    }
    body.push_str("</tbody></table><h2>Log</h2><pre id=logs>");
    for line in &s.logs {
        body.push_str(&esc(line));
        body.push('\n');
    }
    body.push_str("</pre>");
    if let Some(r) = &v.report {
        body.push_str("<h2>Agents</h2><table><thead><tr><th>#</th><th>label</th><th>phase</th><th>status</th><th>attempts</th><th>tokens</th><th>elapsed</th></tr></thead><tbody>");
        for a in &r.agents {
            let elapsed = match (a.start_ms, a.end_ms) {
                (Some(s), Some(e)) => fmt_ms(e.saturating_sub(s)),
                _ => String::new(),
            };
            body.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"st {st}\">{st}</td><td>{}</td><td>{}</td><td>{elapsed}</td></tr>",
                a.index,
                esc(&a.label),
                esc(&a.group),
                a.attempts,
                a.output_tokens,
                st = esc(&a.status),
            ));
        }
        body.push_str("</tbody></table>");
        if let Some(err) = &r.error {
            body.push_str(&format!("<h2>Error</h2><pre class=err>{}</pre>", esc(err)));
        }
        if !r.failures.is_empty() {
            body.push_str("<h2>Failures</h2><pre>");
            for f in &r.failures {
                body.push_str(&esc(f));
                body.push('\n');
            }
            body.push_str("</pre>");
        }
        let result = serde_json::to_string_pretty(&r.result).unwrap_or_default();
        body.push_str(&format!("<h2>Result</h2><pre>{}</pre>", esc(&result)));
    }
    let live = (!v.finished).then(|| format!("/runs/{}/status.json", s.run_id));
    page(
        &format!("{} · flotilla", s.workflow),
        &body,
        live.as_deref(),
    )
}

fn fmt_ms(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 120_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else {
        format!("{}m{:02}s", ms / 60_000, (ms / 1000) % 60)
    }
}

/// Escapes text for HTML.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}\
h1 small{color:#888;font-weight:normal;font-size:60%}table{border-collapse:collapse}\
td,th{padding:2px 10px;border-bottom:1px solid #eee;text-align:left}\
pre{background:#f6f6f6;padding:8px;max-height:30em;overflow:auto}.err{color:#b00}\
.st.completed{color:#070}.st.failed,.st.rejected{color:#b00}.st.running{color:#06c}";

/// Polls the run's JSON while it runs and updates the counters and the log; reloads once
/// when it ends, to show the report.
const LIVE: &str = "const src=document.body.dataset.live;\
const fmt=ms=>ms<1000?ms+'ms':ms<120000?(ms/1000).toFixed(1)+'s':Math.floor(ms/60000)+'m'+String(Math.floor(ms/1000)%60).padStart(2,'0')+'s';\
async function tick(){try{const r=await fetch(src,{credentials:'same-origin'});if(r.ok){const v=await r.json();\
for(const k of ['done','agents','running','failed']){const e=document.getElementById(k);if(e)e.textContent=v[k];}\
document.getElementById('tokens').textContent=v.output_tokens;document.getElementById('elapsed').textContent=fmt(v.elapsed_ms);\
const st=document.getElementById('status');st.textContent=v.status||'pending';st.className='st '+(v.status||'pending');\
document.getElementById('logs').textContent=v.logs.join('\\n')+(v.logs.length?'\\n':'');\
if(v.finished){location.reload();return;}}}catch(e){}setTimeout(tick,1000);}\
if(src)setTimeout(tick,1000);";

fn page(title: &str, body: &str, live: Option<&str>) -> String {
    let live_attr = live.map_or(String::new(), |src| format!(" data-live=\"{}\"", esc(src)));
    format!(
        "<!doctype html><html><head><meta charset=utf-8><title>{}</title><style>{STYLE}</style></head>\
         <body{live_attr}><nav><a href=\"/runs\">runs</a></nav>{body}<script>{LIVE}</script></body></html>",
        esc(title)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_verify_only_with_their_key_and_until_they_expire() {
        let key = TokenKey::derive(b"secret");
        let t = key.issue("alice", Duration::from_secs(60));
        assert_eq!(key.verify(&t).unwrap().sub, "alice");
        assert!(TokenKey::derive(b"other").verify(&t).is_err());
        // A changed body breaks the signature.
        let mut parts: Vec<&str> = t.split('.').collect();
        let forged = URL_SAFE_NO_PAD.encode(br#"{"sub":"mallory","exp":99999999999}"#);
        parts[1] = &forged;
        assert!(key.verify(&parts.join(".")).is_err());
        assert!(key.verify("garbage").is_err());
        let expired = key.issue("alice", Duration::ZERO);
        assert!(key.verify(&expired).unwrap_err().contains("expired"));
    }

    #[test]
    fn html_is_escaped() {
        assert_eq!(
            esc("<a href='x'>&\""),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;"
        );
    }
}
