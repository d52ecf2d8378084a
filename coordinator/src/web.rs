//! The coordinator's HTTP face: session pages and their JSON, behind sign-in.
//!
//! - `GET /runs/{run}`: the session page of a run (live while it runs here: the changing part
//!   arrives as HTML over server-sent events from `/runs/{run}/events`; read from storage when
//!   it ran elsewhere or earlier).
//! - `GET /runs/{run}/status.json`, `GET /runs.json`: the same data as JSON.
//! - `GET /runs/{run}/agents/{index}`: one agent, its transcript and its change's diff;
//!   `GET /runs/{run}/diff`: the run's whole diff.
//! - `POST /runs/{run}/control`: pause, resume, stop or restart (W54–W56).
//! - `GET /metrics`: Prometheus exposition of the coordinator's metrics.
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
    /// Connection limit and idle timeout of the listener.
    pub limits: crate::listen::Limits,
}

#[derive(Clone)]
struct Web {
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    access: Access,
}

/// Who the pages answer.
#[derive(Debug, Clone)]
pub enum Access {
    /// Session tokens from `flotilla token create` (the fleet).
    Tokens(TokenKey),
    /// A page on loopback without sign-in (an `--insecure` coordinator): only requests whose
    /// `Host` is this address, so a web page elsewhere cannot reach it by DNS rebinding.
    Loopback { port: u16 },
    /// `flotilla run --serve`: loopback `Host` only, and the run's random key, which the
    /// printed URL carries (`?key=`) and the first visit keeps in a cookie.
    Keyed { port: u16, key: String },
}

impl Access {
    fn tokens(&self) -> Option<&TokenKey> {
        match self {
            Access::Tokens(k) => Some(k),
            _ => None,
        }
    }
}

/// Name of the cookie that carries a `--serve` page's key.
pub const KEY_COOKIE: &str = "flotilla_key";

/// A random key for a `--serve` page (128 bits, URL-safe).
pub fn new_page_key() -> String {
    let mut b = [0u8; 16];
    if getrandom::fill(&mut b).is_err() {
        // Without entropy the page would be guessable: fail closed to a key nobody has.
        return "unavailable".into();
    }
    URL_SAFE_NO_PAD.encode(b)
}

fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// The `Host` check and the page key, before any route (the fleet's tokens are checked by
/// each route).
async fn guard(
    State(web): State<Web>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (port, key) = match &web.access {
        Access::Tokens(_) => return next.run(req).await,
        Access::Loopback { port } => (*port, None),
        Access::Keyed { port, key } => (*port, Some(key.clone())),
    };
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let ours = ["127.0.0.1", "localhost", "[::1]"]
        .iter()
        .any(|h| host == format!("{h}:{port}"));
    if !ours {
        let why = format!(
            "this page answers only at http://127.0.0.1:{port} (the request was for host {host:?}): a page on loopback is not served to other names, so a web site cannot reach it"
        );
        return (StatusCode::FORBIDDEN, why).into_response();
    }
    let Some(key) = key else {
        return next.run(req).await;
    };
    let from_query = req.uri().query().and_then(|q| {
        q.split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == "key")
            .map(|(_, v)| v.to_owned())
    });
    let from_cookie = cookie(req.headers(), KEY_COOKIE);
    let from_bearer = token_of(req.headers());
    let given = [&from_query, &from_cookie, &from_bearer];
    if !given
        .iter()
        .any(|k| k.as_deref().is_some_and(|k| same(k, &key)))
    {
        return (
            StatusCode::UNAUTHORIZED,
            "this page needs its key: open the URL `flotilla run --serve` printed (it ends in ?key=…)",
        )
            .into_response();
    }
    let mut resp = next.run(req).await;
    if from_query.is_some() && from_cookie.is_none() {
        let cookie = format!("{KEY_COOKIE}={key}; Path=/; HttpOnly; SameSite=Strict");
        if let Ok(v) = header::HeaderValue::from_str(&cookie) {
            resp.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    resp
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
    let access = match opts.auth {
        Some(key) => Access::Tokens(key),
        None => Access::Loopback {
            port: listener
                .local_addr()
                .map_or(opts.listen.port(), |a| a.port()),
        },
    };
    let listener = crate::listen::Limited::new(listener, opts.limits);
    axum::serve(listener, router(coordinator, registry, access))
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await
        .map_err(|e| format!("session pages on {}: {e}", opts.listen))
}

/// The routes (public for tests).
pub fn router(coordinator: Arc<Coordinator>, registry: Arc<RunRegistry>, access: Access) -> Router {
    let web = Web {
        coordinator,
        registry,
        access,
    };
    Router::new()
        .route("/", get(|| async { Redirect::to("/runs") }))
        .route("/login", get(login))
        .route("/runs", get(runs_page))
        .route("/runs.json", get(runs_json))
        .route("/runs/{run}", get(run_page))
        .route("/runs/{run}/status.json", get(run_json))
        .route("/runs/{run}/events", get(run_events))
        .route("/runs/{run}/agents/{index}", get(agent_page))
        .route("/runs/{run}/diff", get(run_diff))
        .route("/runs/{run}/control", axum::routing::post(control))
        .route("/metrics", get(metrics))
        .layer(axum::middleware::from_fn_with_state(web.clone(), guard))
        .with_state(web)
}

fn token_of(headers: &HeaderMap) -> Option<String> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        && let Some(t) = v.strip_prefix("Bearer ")
    {
        return Some(t.trim().to_owned());
    }
    cookie(headers, COOKIE)
}

/// The value of cookie `name`.
fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

/// Why a request is refused; `Ok` when it may go on.
fn check(web: &Web, headers: &HeaderMap) -> Result<(), &'static str> {
    let Some(key) = web.access.tokens() else {
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
        Html(page("Sign in", &format!("<p class=err>{}</p>", esc(why)))).into_response()
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
    let Some(key) = web.access.tokens() else {
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

/// A run's report from storage (it is not running here), or the HTTP error to answer with.
async fn stored_report(web: &Web, run: &str) -> Result<Report, (StatusCode, String)> {
    history::load_report(web.coordinator.store(), run)
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
        })
}

async fn view(web: &Web, run: &str) -> Result<RunView, (StatusCode, String)> {
    if let Some((snap, report)) = web.registry.live(run) {
        return Ok(RunView {
            snapshot: SnapshotView::from(&*snap),
            finished: report.is_some(),
            report: report.map(|r| (*r).clone()),
        });
    }
    let report = stored_report(web, run).await?;
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

/// `?all=1` on a run's page and event stream: list every agent of every phase.
#[derive(Deserialize, Default)]
struct AllQuery {
    #[serde(default)]
    all: Option<String>,
}

impl AllQuery {
    fn all(&self) -> bool {
        self.all.as_deref().is_some_and(|v| v == "1" || v == "true")
    }
}

async fn run_page(
    State(web): State<Web>,
    Path(run): Path<String>,
    Query(q): Query<AllQuery>,
    headers: HeaderMap,
) -> Response {
    if let Err(why) = check(&web, &headers) {
        return refuse(why, false);
    }
    match page_data(&web, &run).await {
        Ok(d) => Html(render_run(&d, q.all())).into_response(),
        Err((code, msg)) => (
            code,
            Html(page(
                "Not found",
                &format!("<p class=err>{}</p>", esc(&msg)),
            )),
        )
            .into_response(),
    }
}

/// Server-sent events: the changing part of the page, as HTML, whenever it changes (every
/// half second at most while the run is here, every two seconds when read from storage);
/// `end` carries the last one.
async fn run_events(
    State(web): State<Web>,
    Path(run): Path<String>,
    Query(q): Query<AllQuery>,
    headers: HeaderMap,
) -> Response {
    use axum::response::sse::{Event, KeepAlive, Sse};
    if let Err(why) = check(&web, &headers) {
        return refuse(why, true);
    }
    let all = q.all();
    let stream = futures::stream::unfold(
        (web, run, None::<String>, false),
        move |(web, run, last, done)| async move {
            if done {
                return None;
            }
            let mut last = last;
            loop {
                let data = page_data(&web, &run).await;
                let d = match data {
                    Ok(d) => d,
                    Err((_, msg)) => {
                        let ev = Event::default()
                            .event("end")
                            .data(format!("<p class=err>{}</p>", esc(&msg)));
                        return Some((
                            Ok::<_, std::convert::Infallible>(ev),
                            (web, run, last, true),
                        ));
                    }
                };
                let html = render_live(&d, all);
                if !d.live() {
                    let ev = Event::default().event("end").data(html);
                    return Some((Ok(ev), (web, run, None, true)));
                }
                if last.as_deref() != Some(html.as_str()) {
                    let ev = Event::default().event("update").data(html.clone());
                    return Some((Ok(ev), (web, run, Some(html), false)));
                }
                last = Some(html);
                let pause = if d.here { 500 } else { 2000 };
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
        },
    );
    // The first update goes out at once; later ones no faster than the pause above.
    let paced = futures::StreamExt::then(stream, {
        let mut first = true;
        move |ev| {
            let wait = !std::mem::take(&mut first);
            async move {
                if wait {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                ev
            }
        }
    });
    Sse::new(paced)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// One agent's prompt, result and transcripts (an HTML fragment for the page).
async fn agent_page(
    State(web): State<Web>,
    Path((run, index)): Path<(String, u64)>,
    headers: HeaderMap,
) -> Response {
    if let Err(why) = check(&web, &headers) {
        return refuse(why, false);
    }
    let d = match page_data(&web, &run).await {
        Ok(d) => d,
        Err((code, msg)) => {
            return (code, Html(format!("<p class=err>{}</p>", esc(&msg)))).into_response();
        }
    };
    let Some(a) = d.report.agents.iter().find(|a| a.index == index) else {
        return (
            StatusCode::NOT_FOUND,
            Html(format!(
                "<p class=err>run {} has no agent #{index}</p>",
                esc(&run)
            )),
        )
            .into_response();
    };
    match history::agent_detail(web.coordinator.store(), &run, index, a.attempts).await {
        Ok(detail) => {
            let mut html = render_agent(a, &detail);
            if let Some(ch) = &detail.change {
                html.push_str(&render_change(&web, &run, index, ch).await);
            }
            Html(html).into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Html(format!(
                "<p class=err>cannot read agent #{index}: {}</p>",
                esc(&e.to_string())
            )),
        )
            .into_response(),
    }
}

/// An agent's change: its files, where it went, and its diff.
async fn render_change(web: &Web, run: &str, index: u64, ch: &crate::head::ChangeRecord) -> String {
    let placed = if ch.isolated {
        "on its own branch (isolated)".to_owned()
    } else if !ch.conflicts.is_empty() {
        format!(
            "conflicted with the run head ({}): on its own branch",
            ch.conflicts.join(", ")
        )
    } else if ch.head_after.is_some() {
        "merged into the run head".to_owned()
    } else {
        "not applied".to_owned()
    };
    let mut out = format!(
        "<section class=change><h3>Change</h3><p>{} files, +{} −{}, {} — branch <code>flotilla/{}/{index}</code> after <code>flotilla apply {}</code></p>",
        ch.files.len(),
        ch.insertions,
        ch.deletions,
        esc(&placed),
        esc(run),
        esc(run)
    );
    let repo = crate::head::changes_of(web.coordinator.store(), run)
        .await
        .ok()
        .and_then(|c| c.source)
        .map(|s| s.repo);
    if let Some(repo) = repo {
        match crate::head::diff(
            web.coordinator.store(),
            &repo,
            &ch.base,
            &ch.commit,
            &web.coordinator.cache_dir(),
        )
        .await
        {
            Ok(d) => out.push_str(&format!("<pre class=diff>{}</pre>", esc(&d))),
            Err(e) => out.push_str(&format!(
                "<p class=err>cannot show the diff: {}</p>",
                esc(&e)
            )),
        }
    }
    out.push_str("</section>");
    out
}

/// The run's whole change: its source against its head.
async fn run_diff(State(web): State<Web>, Path(run): Path<String>, headers: HeaderMap) -> Response {
    if let Err(why) = check(&web, &headers) {
        return refuse(why, false);
    }
    let c = match crate::head::changes_of(web.coordinator.store(), &run).await {
        Ok(c) => c,
        Err(e) => {
            return (
                StatusCode::NOT_FOUND,
                Html(format!("<p class=err>{}</p>", esc(&e.to_string()))),
            )
                .into_response();
        }
    };
    let (Some(src), Some(head)) = (c.source, c.head) else {
        return Html(page(&run, "<p class=note>this run has no source</p>")).into_response();
    };
    let body = match crate::head::diff(
        web.coordinator.store(),
        &src.repo,
        &src.commit,
        &head,
        &web.coordinator.cache_dir(),
    )
    .await
    {
        Ok(d) => format!(
            "<h2>Run {} — its head against its source</h2><p>{} agents changed files; <code>flotilla apply {}</code> brings them home</p><pre class=diff>{}</pre>",
            esc(&run),
            c.changes.len(),
            esc(&run),
            esc(&d)
        ),
        Err(e) => format!("<p class=err>cannot show the diff: {}</p>", esc(&e)),
    };
    Html(page(&run, &body)).into_response()
}

#[derive(Deserialize)]
struct ControlBody {
    action: String,
    #[serde(default)]
    agent: String,
}

/// The page's buttons: pause, resume or stop the run, stop or restart one agent. Needs the
/// `x-flotilla` header, which a cross-site form cannot send.
async fn control(
    State(web): State<Web>,
    Path(run): Path<String>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<ControlBody>,
) -> Response {
    if let Err(why) = check(&web, &headers) {
        return refuse(why, true);
    }
    if !headers.contains_key("x-flotilla") {
        return (
            StatusCode::FORBIDDEN,
            axum::Json(serde_json::json!({"error": "send the x-flotilla header (the page does)"})),
        )
            .into_response();
    }
    match web.registry.control(&run, &body.action, &body.agent).await {
        Ok(message) => axum::Json(serde_json::json!({ "message": message })).into_response(),
        Err(s) => {
            let code = match s.code() {
                tonic::Code::NotFound => StatusCode::NOT_FOUND,
                tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
                _ => StatusCode::CONFLICT,
            };
            (
                code,
                axum::Json(serde_json::json!({ "error": s.message() })),
            )
                .into_response()
        }
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
    Html(page("Runs", &body)).into_response()
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
    use crate::metrics as m;
    family(
        "flotilla_stalls_total",
        "counter",
        "Attempts ended by the stall watchdog (no progress for the stall timeout).",
        vec![(String::new(), m::get(&m::STALLS).to_string())],
    );
    family(
        "flotilla_restarts_total",
        "counter",
        "Calls started again, by reason.",
        vec![
            (
                label("reason", "stall"),
                m::get(&m::RESTARTS_STALL).to_string(),
            ),
            (
                label("reason", "lease_lapsed"),
                m::get(&m::RESTARTS_LAPSE).to_string(),
            ),
            (
                label("reason", "user"),
                m::get(&m::RESTARTS_USER).to_string(),
            ),
            (
                label("reason", "transient"),
                m::get(&m::RESTARTS_TRANSIENT).to_string(),
            ),
        ],
    );
    family(
        "flotilla_lease_renewal_failures_total",
        "counter",
        "Failed renewals of worker leases (each is retried).",
        vec![(
            String::new(),
            m::get(&m::LEASE_RENEWAL_FAILURES).to_string(),
        )],
    );
    family(
        "flotilla_storage_write_retries_total",
        "counter",
        "Object-store writes that failed and were retried.",
        vec![(String::new(), m::get(&m::STORAGE_WRITE_RETRIES).to_string())],
    );
    out.push_str(&m::DISPATCH_LATENCY.render(
        "flotilla_dispatch_latency_seconds",
        "From a call being ready to run to its attempt being assigned to a worker.",
    ));
    out.push_str(&m::STORAGE_WRITE_LATENCY.render(
        "flotilla_storage_write_seconds",
        "One object-store write, retries included.",
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// What the page shows of a run: its report (final, or as it stands now with live states),
/// the usage-limit wait in progress, and whether it can still change.
struct PageData {
    report: Arc<Report>,
    waiting: Option<String>,
    /// Running on this coordinator (buttons work, updates every half second).
    here: bool,
}

impl PageData {
    fn live(&self) -> bool {
        !self.report.status.is_final()
    }
}

async fn page_data(web: &Web, run: &str) -> Result<PageData, (StatusCode, String)> {
    if let Some(report) = web.registry.live_report(run).await {
        let waiting = web
            .registry
            .live(run)
            .and_then(|(snap, _)| snap.waiting.clone());
        return Ok(PageData {
            report,
            waiting,
            here: true,
        });
    }
    let report = stored_report(web, run).await?;
    Ok(PageData {
        report: Arc::new(report),
        waiting: None,
        here: false,
    })
}

/// W42: more than 25 agents, or more than 1.5 million tokens.
const LARGE_AGENTS: u64 = 25;
const LARGE_TOKENS: u64 = 1_500_000;

/// Rows a phase lists unless the reader asks for all of them (`?all=1`): a big fan-out
/// would otherwise send thousands of rows on every update.
const PHASE_ROWS: usize = 100;

/// Which agents of a big phase are listed: every running and failed one, then the latest
/// completed ones, then the next queued ones, up to [`PHASE_ROWS`]; in index order.
fn rows_to_show<'a>(
    agents: &[&'a crate::report::AgentReport],
) -> Vec<&'a crate::report::AgentReport> {
    if agents.len() <= PHASE_ROWS {
        return agents.to_vec();
    }
    let mut keep = std::collections::BTreeSet::new();
    for a in agents {
        if matches!(a.status.as_str(), "running" | "failed") {
            keep.insert(a.index);
        }
    }
    let room = |keep: &std::collections::BTreeSet<u64>| keep.len() < PHASE_ROWS;
    let completed_room = PHASE_ROWS.saturating_sub(10);
    for a in agents.iter().rev() {
        if keep.len() >= completed_room {
            break;
        }
        if a.status != "queued" {
            keep.insert(a.index);
        }
    }
    for a in agents {
        if !room(&keep) {
            break;
        }
        if a.status == "queued" {
            keep.insert(a.index);
        }
    }
    agents
        .iter()
        .filter(|a| keep.contains(&a.index))
        .copied()
        .collect()
}

/// The part of the page that changes while the run goes on (sent again over SSE); `all`
/// lists every agent of every phase.
fn render_live(d: &PageData, all: bool) -> String {
    let r = &*d.report;
    let u = &r.usage;
    let status = r.status.as_str();
    let done = r.agents.iter().filter(|a| a.status == "completed").count();
    let failed = r.agents.iter().filter(|a| a.status == "failed").count();
    let running = r.agents.iter().filter(|a| a.status == "running").count();
    let mut out = String::new();
    out.push_str(&format!(
        "<p class=counters><span class=\"st {status}\" id=status>{status}</span> \
         · agents <b id=done>{done}</b> done / <b id=agents>{total}</b> \
         · running <b id=running>{running}</b> · failed <b id=failed>{failed}</b> \
         · tokens <b id=tokens>{tin} in / {tout} out</b> · cost <b id=cost>${cost:.4}</b> \
         · elapsed <b id=elapsed>{elapsed}</b></p>",
        total = u.agents,
        tin = u.input_tokens,
        tout = u.output_tokens,
        cost = u.cost_usd,
        elapsed = fmt_ms(u.duration_ms),
    ));
    let mut warnings = Vec::new();
    if u.agents > LARGE_AGENTS || u.input_tokens + u.output_tokens > LARGE_TOKENS {
        warnings.push(format!(
            "Large workflow: {} agents, {} tokens so far",
            u.agents,
            u.input_tokens + u.output_tokens
        ));
    }
    if let Some(w) = &d.waiting {
        warnings.push(w.clone());
    }
    for w in warnings {
        out.push_str(&format!("<p class=warn>{}</p>", esc(&w)));
    }
    if let Some(c) = &r.changes {
        let changed = c.merged + c.isolated + c.conflicted;
        if changed > 0 {
            out.push_str(&format!(
                "<p class=changes>{changed} agents changed files ({} merged into the run head, {} on their own branches, {} in conflict) — <a href=\"/runs/{}/diff\">the run's diff</a>; <code>{}</code> brings them home</p>",
                c.merged,
                c.isolated,
                c.conflicted,
                esc(&r.run_id),
                esc(&c.apply)
            ));
        }
    }
    if d.here && d.live() {
        let (action, label) = if r.status == RunStatus::Paused {
            ("resume", "Resume")
        } else {
            ("pause", "Pause")
        };
        out.push_str(&format!(
            "<p class=buttons><button data-action={action}>{label}</button> \
             <button data-action=stop class=danger>Stop run</button></p>"
        ));
    }
    if !r.logs.is_empty() {
        out.push_str("<pre id=logs>");
        for line in &r.logs {
            out.push_str(&esc(line));
            out.push('\n');
        }
        out.push_str("</pre>");
    }
    out.push_str("<div id=phases>");
    for g in &r.groups {
        let agents: Vec<_> = r.agents.iter().filter(|a| a.group == g.title).collect();
        let done = agents.iter().filter(|a| a.status == "completed").count();
        let tokens: u64 = agents
            .iter()
            .map(|a| a.input_tokens + a.output_tokens)
            .sum();
        let elapsed = span_ms(agents.iter().map(|a| (a.start_ms, a.end_ms)), u.duration_ms);
        out.push_str(&format!(
            "<section class=phase><h3>{} <small>{done}/{} agents · {tokens} tokens · {}</small></h3>\
             <table><thead><tr><th>#</th><th>agent</th><th>status</th><th>model</th><th>tokens</th><th>attempts</th><th>elapsed</th><th></th></tr></thead><tbody>",
            esc(&g.title),
            agents.len(),
            fmt_ms(elapsed),
        ));
        let shown = if all {
            agents.clone()
        } else {
            rows_to_show(&agents)
        };
        let hidden = agents.len() - shown.len();
        for a in shown {
            let elapsed = match (a.start_ms, a.end_ms) {
                (Some(s), Some(e)) => fmt_ms(e.saturating_sub(s)),
                (Some(s), None) if d.live() => fmt_ms(u.duration_ms.saturating_sub(s)),
                _ => String::new(),
            };
            let buttons = match a.status.as_str() {
                "running" if d.here && d.live() => format!(
                    "<button data-action=stop_agent data-target={i}>stop</button> \
                     <button data-action=restart_agent data-target={i}>restart</button>",
                    i = a.index
                ),
                "queued" if d.here && d.live() => format!(
                    "<button data-action=stop_agent data-target={i}>stop</button>",
                    i = a.index
                ),
                _ => String::new(),
            };
            let cached = if a.cached { " (cached)" } else { "" };
            out.push_str(&format!(
                "<tr id=agent-{i}><td>{i}</td><td><a href=\"#agent-{i}\" data-agent={i}>{label}</a></td>\
                 <td class=\"st {st}\">{st}{cached}</td><td>{model}</td><td>{tokens}</td><td>{attempts}</td><td>{elapsed}</td><td>{buttons}</td></tr>",
                i = a.index,
                label = esc(&a.label),
                st = a.status.as_str(),
                model = esc(&a.model),
                tokens = a.input_tokens + a.output_tokens,
                attempts = a.attempts,
            ));
        }
        if hidden > 0 {
            out.push_str(&format!(
                "<tr class=more><td colspan=8>{hidden} more agents of this phase are not listed \
                 (running and failed ones always are) · <a href=\"?all=1\">show all</a></td></tr>"
            ));
        }
        out.push_str("</tbody></table></section>");
    }
    out.push_str("</div>");
    if let Some(err) = &r.error {
        out.push_str(&format!("<h2>Error</h2><pre class=err>{}</pre>", esc(err)));
    }
    if !r.failures.is_empty() {
        out.push_str("<h2>Failures</h2><pre>");
        for f in &r.failures {
            out.push_str(&esc(f));
            out.push('\n');
        }
        out.push_str("</pre>");
    }
    if r.status.is_final() {
        let result = serde_json::to_string_pretty(&r.result).unwrap_or_default();
        out.push_str(&format!(
            "<h2>Result</h2><pre id=result>{}</pre>",
            esc(&result)
        ));
    }
    out
}

/// Wall time covered by a set of agents (first start to last end, or now).
fn span_ms(spans: impl Iterator<Item = (Option<u64>, Option<u64>)>, now: u64) -> u64 {
    let mut first = None::<u64>;
    let mut last = 0u64;
    for (s, e) in spans {
        if let Some(s) = s {
            first = Some(first.map_or(s, |f| f.min(s)));
            last = last.max(e.unwrap_or(now));
        }
    }
    first.map_or(0, |f| last.saturating_sub(f))
}

fn render_run(d: &PageData, all: bool) -> String {
    let r = &*d.report;
    let name = if r.workflow.name.is_empty() {
        "workflow"
    } else {
        &r.workflow.name
    };
    let body = format!(
        "<h1>{} <small>{}</small></h1><p class=desc>{}</p><p id=notice></p>\
         <div id=live>{}</div><div id=detail></div>",
        esc(name),
        esc(&r.run_id),
        esc(&r.workflow.description),
        render_live(d, all),
    );
    page_with(
        &format!("{name} · flotilla"),
        &body,
        &[
            ("run", r.run_id.as_str()),
            ("live", if d.live() { "1" } else { "0" }),
        ],
    )
}

/// One agent's prompt, result and transcripts, as a fragment for the page.
fn render_agent(a: &crate::report::AgentReport, d: &history::AgentDetail) -> String {
    let mut out = format!(
        "<section class=agent><h2>#{} {} <small class=\"st {st}\">{st}</small></h2>",
        a.index,
        esc(&a.label),
        st = a.status.as_str()
    );
    out.push_str(&format!(
        "<h3>Prompt</h3><pre class=prompt>{}</pre>",
        esc(d.prompt.as_deref().unwrap_or("(not stored)"))
    ));
    if let Some(err) = &a.error {
        out.push_str(&format!("<h3>Error</h3><pre class=err>{}</pre>", esc(err)));
    }
    match &d.result {
        Some(serde_json::Value::String(t)) => {
            out.push_str(&format!(
                "<h3>Result</h3><pre class=result>{}</pre>",
                esc(t)
            ));
        }
        Some(v) => out.push_str(&format!(
            "<h3>Result</h3><pre class=result>{}</pre>",
            esc(&serde_json::to_string_pretty(v).unwrap_or_default())
        )),
        None => {}
    }
    if d.attempts.is_empty() {
        let why = if a.cached {
            "served from an earlier run: no transcript here"
        } else {
            "no transcript stored yet"
        };
        out.push_str(&format!("<p class=note>{why}</p>"));
    }
    for (n, events) in &d.attempts {
        out.push_str(&format!(
            "<h3>Transcript, attempt {n}</h3><pre class=transcript>"
        ));
        for e in events {
            out.push_str(&esc(&history::transcript_line(e)));
            out.push('\n');
        }
        out.push_str("</pre>");
    }
    out.push_str("</section>");
    out
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
h1 small,h3 small{color:#888;font-weight:normal;font-size:70%}table{border-collapse:collapse}\
td,th{padding:2px 10px;border-bottom:1px solid #eee;text-align:left}\
pre{background:#f6f6f6;padding:8px;max-height:30em;overflow:auto;white-space:pre-wrap}.err{color:#b00}\
.warn{color:#a60;font-weight:bold}.danger{color:#b00}#notice{color:#06c}\
.st.completed{color:#070}.st.failed,.st.rejected{color:#b00}.st.running{color:#06c}.st.paused{color:#a60}";

/// The page's script: follows the run over server-sent events (the server sends the changing
/// part of the page as HTML), opens an agent's detail on click, and sends the buttons' actions
/// to the same control path the CLI uses.
const SCRIPT: &str = r#"const run=document.body.dataset.run;
async function openAgent(i){const r=await fetch('/runs/'+run+'/agents/'+i,{credentials:'same-origin'});
const d=document.getElementById('detail');d.innerHTML=await r.text();d.dataset.agent=i;}
async function act(action,agent){const r=await fetch('/runs/'+run+'/control',{method:'POST',credentials:'same-origin',
headers:{'content-type':'application/json','x-flotilla':'1'},body:JSON.stringify({action:action,agent:agent||''})});
const v=await r.json();document.getElementById('notice').textContent=v.message||v.error;}
function bind(){document.querySelectorAll('[data-agent]').forEach(a=>a.onclick=e=>{e.preventDefault();openAgent(a.dataset.agent);});
document.querySelectorAll('[data-action]').forEach(b=>b.onclick=()=>act(b.dataset.action,b.dataset.target));}
function show(html){document.getElementById('live').innerHTML=html;bind();
const d=document.getElementById('detail');if(d.dataset.agent)openAgent(d.dataset.agent);}
if(run&&document.body.dataset.live==='1'){const es=new EventSource('/runs/'+run+'/events'+location.search);
es.addEventListener('update',e=>show(e.data));es.addEventListener('end',e=>{show(e.data);es.close();});}
bind();"#;

fn page(title: &str, body: &str) -> String {
    page_with(title, body, &[])
}

fn page_with(title: &str, body: &str, data: &[(&str, &str)]) -> String {
    let attrs: String = data
        .iter()
        .map(|(k, v)| format!(" data-{k}=\"{}\"", esc(v)))
        .collect();
    format!(
        "<!doctype html><html><head><meta charset=utf-8><title>{}</title><style>{STYLE}</style></head>\
         <body{attrs}><nav><a href=\"/runs\">runs</a></nav>{body}<script>{SCRIPT}</script></body></html>",
        esc(title)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(index: u64, status: &str) -> crate::report::AgentReport {
        crate::report::AgentReport {
            label: format!("a{index}"),
            group: "G".into(),
            status: serde_json::from_value(serde_json::json!(status)).expect("a status"),
            attempts: 1,
            cached: false,
            start_ms: Some(index),
            end_ms: None,
            error: None,
            index,
            key: String::new(),
            model: String::new(),
            input_tokens: 0,
            output_tokens: 0,
            disk_bytes: 0,
            waiting: None,
        }
    }

    #[test]
    fn a_big_phase_lists_running_and_failed_agents_and_says_how_many_it_hides() {
        let all: Vec<_> = (0..1000u64)
            .map(|i| match i {
                500 => agent(i, "failed"),
                600..=615 => agent(i, "running"),
                i if i < 600 => agent(i, "completed"),
                _ => agent(i, "queued"),
            })
            .collect();
        let refs: Vec<_> = all.iter().collect();
        let shown = rows_to_show(&refs);
        assert_eq!(shown.len(), PHASE_ROWS);
        for must in [500, 600, 615] {
            assert!(shown.iter().any(|a| a.index == must), "{must}");
        }
        assert!(shown.iter().any(|a| a.status == "queued"));
        assert!(
            shown.windows(2).all(|w| w[0].index < w[1].index),
            "index order"
        );
        let small: Vec<_> = all.iter().take(10).collect();
        assert_eq!(rows_to_show(&small).len(), 10);

        let report = Report {
            run_id: "wf_x".into(),
            status: RunStatus::Running,
            result: serde_json::Value::Null,
            error: None,
            workflow: Default::default(),
            usage: Default::default(),
            agents: all.clone(),
            groups: vec![crate::report::GroupReport {
                title: "G".into(),
                agents: Vec::new(),
            }],
            logs: Vec::new(),
            failures: Vec::new(),
            script_path: None,
            parent_run_id: None,
            store: None,
            changes: None,
        };
        let d = PageData {
            report: Arc::new(report),
            waiting: None,
            here: true,
        };
        let page = render_live(&d, false);
        assert!(
            page.contains("900 more agents of this phase are not listed"),
            "{page}"
        );
        assert_eq!(page.matches("<tr id=agent-").count(), PHASE_ROWS);
        let full = render_live(&d, true);
        assert_eq!(full.matches("<tr id=agent-").count(), 1000);
        assert!(!full.contains("more agents of this phase"));
        // Restart only where an agent runs; a queued one can only be stopped.
        assert!(full.contains("data-action=restart_agent data-target=600>"));
        assert!(!full.contains("data-action=restart_agent data-target=700>"));
        assert!(full.contains("data-action=stop_agent data-target=700>"));
    }

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
