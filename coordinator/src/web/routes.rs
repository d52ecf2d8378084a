//! The routes: a run's page, its live events (SSE), one agent, the diffs, the controls, and
//! the list of runs — each as HTML and JSON.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::api::SnapshotView;
use flotilla_proto::ErrorKind;

use super::auth::*;
use super::live_cache::{Rendered, sse_frame};
use super::render::*;
use super::state::{Web, http};
use crate::history;
use crate::report::{Report, Summary};

/// The signed-in check of a run's routes: the token must show the run's namespace (a run
/// outside it is answered as not there). `Err`: the response to send instead.
pub(super) async fn allowed(
    web: &Web,
    headers: &HeaderMap,
    run: &str,
    json: bool,
) -> Result<(), Response> {
    let scope = check(web, headers).map_err(|why| refuse(why, json))?;
    if scope == crate::namespace::Scope::All {
        return Ok(());
    }
    let ns = match web.registry.namespace(run) {
        Some(ns) => Some(ns),
        None => history::namespace_of(web.coordinator.store(), run)
            .await
            .ok()
            .flatten(),
    };
    if ns.is_some_and(|ns| scope.may(&ns)) {
        return Ok(());
    }
    let msg = format!(
        "no run {run} in namespace(s) {} (the ones your sign-in shows)",
        scope.list()
    );
    Err(if json {
        (
            http(ErrorKind::NotFound),
            axum::Json(serde_json::json!({ "error": msg })),
        )
            .into_response()
    } else {
        (
            http(ErrorKind::NotFound),
            Html(page(
                "Not found",
                &format!("<p class=err>{}</p>", esc(&msg)),
            )),
        )
            .into_response()
    })
}

/// What a page shows of a run: live from this coordinator, or its stored report.
#[derive(Debug, Clone, Serialize)]
pub(super) struct RunView {
    #[serde(flatten)]
    pub(super) snapshot: SnapshotView,
    pub(super) finished: bool,
    /// The report once the run has ended.
    pub(super) report: Option<Report>,
}

/// A run's report from storage (it is not running here), or the HTTP error to answer with.
pub(super) async fn stored_report(web: &Web, run: &str) -> Result<Report, (StatusCode, String)> {
    history::load_report(web.coordinator.store(), run)
        .await
        .map_err(|e| match e.kind() {
            ErrorKind::NotFound => (
                http(ErrorKind::NotFound),
                format!("no run {run} on this coordinator or in its store"),
            ),
            _ => (
                http(ErrorKind::Unavailable),
                format!("cannot read run {run}: {e}"),
            ),
        })
}

pub(super) async fn view(web: &Web, run: &str) -> Result<RunView, (StatusCode, String)> {
    if let Some((snap, report)) = web.registry.live(run) {
        let mut snapshot = SnapshotView::from(&*snap);
        if let Some(summary) = web.registry.summary(run) {
            snapshot.summary = summary;
        }
        return Ok(RunView {
            snapshot,
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

pub(super) async fn run_json(
    State(web): State<Web>,
    Path(run): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = allowed(&web, &headers, &run, true).await {
        return refused;
    }
    match view(&web, &run).await {
        Ok(v) => axum::Json(v).into_response(),
        Err((code, msg)) => (code, axum::Json(serde_json::json!({ "error": msg }))).into_response(),
    }
}

/// `?all=1` on a run's page and event stream: list every agent of every phase;
/// `?timeline=0`: leave the timeline out.
#[derive(Deserialize, Default)]
pub(super) struct AllQuery {
    #[serde(default)]
    pub(super) all: Option<String>,
    #[serde(default)]
    pub(super) timeline: Option<String>,
}

impl AllQuery {
    fn view(&self) -> View {
        View {
            all: self.all.as_deref().is_some_and(|v| v == "1" || v == "true"),
            timeline: !self
                .timeline
                .as_deref()
                .is_some_and(|v| v == "0" || v == "false"),
        }
    }
}

pub(super) async fn run_page(
    State(web): State<Web>,
    Path(run): Path<String>,
    Query(q): Query<AllQuery>,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = allowed(&web, &headers, &run, false).await {
        return refused;
    }
    match page_data(&web, &run).await {
        Ok(d) => Html(render_run(&d, q.view())).into_response(),
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
pub(super) async fn run_events(
    State(web): State<Web>,
    Path(run): Path<String>,
    Query(q): Query<AllQuery>,
    headers: HeaderMap,
) -> Response {
    use bytes::Bytes;
    if let Err(refused) = allowed(&web, &headers, &run, true).await {
        return refused;
    }
    let view = q.view();
    // A comment line now and then keeps proxies from closing a quiet stream.
    const QUIET: Duration = Duration::from_secs(15);
    let stream = futures::stream::unfold(
        (web, run, None::<Arc<str>>, false, Instant::now()),
        move |(web, run, last, done, sent)| async move {
            if done {
                return None;
            }
            let mut last = last;
            loop {
                // One rendering (and its framed event) per tick for every reader of this run
                // and view: a reader costs a write of shared bytes.
                let data = web
                    .live
                    .get(&run, view.key(), async {
                        let d = page_data(&web, &run).await?;
                        Ok(Rendered::new(render_live(&d, view), d.live(), d.here))
                    })
                    .await;
                let d = match data {
                    Ok(d) => d,
                    Err((_, msg)) => {
                        let ev = sse_frame("end", &format!("<p class=err>{}</p>", esc(&msg)));
                        return Some((
                            Ok::<_, std::convert::Infallible>(ev),
                            (web, run, last, true, sent),
                        ));
                    }
                };
                if !d.live {
                    return Some((Ok(d.frame), (web, run, None, true, sent)));
                }
                let same = last
                    .as_ref()
                    .is_some_and(|l| Arc::ptr_eq(l, &d.html) || **l == *d.html);
                if !same {
                    return Some((Ok(d.frame), (web, run, Some(d.html), false, Instant::now())));
                }
                last = Some(d.html);
                if sent.elapsed() > QUIET {
                    let ping = Bytes::from_static(b": still here\n\n");
                    return Some((Ok(ping), (web, run, last, false, Instant::now())));
                }
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
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/event-stream"),
            (axum::http::header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(paced),
    )
        .into_response()
}

/// One agent's page: where and when it ran, its prompt, result and transcripts, its change.
pub(super) async fn agent_page(
    State(web): State<Web>,
    Path((run, index)): Path<(String, u64)>,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = allowed(&web, &headers, &run, false).await {
        return refused;
    }
    let d = match page_data(&web, &run).await {
        Ok(d) => d,
        Err((code, msg)) => {
            return (
                code,
                Html(page(
                    "Not found",
                    &format!("<p class=err>{}</p>", esc(&msg)),
                )),
            )
                .into_response();
        }
    };
    let Some(a) = d.report.agents.iter().find(|a| a.index == index) else {
        return (
            http(ErrorKind::NotFound),
            Html(page(
                "Not found",
                &format!("<p class=err>run {} has no agent #{index}</p>", esc(&run)),
            )),
        )
            .into_response();
    };
    let title = format!("#{index} {} · {run}", a.label);
    match history::agent_detail(web.coordinator.store(), &run, index, a.attempts).await {
        Ok(detail) => {
            let mut html = render_agent(&run, a, &detail);
            if let Some(ch) = &detail.change {
                html.push_str(&render_change(&web, &run, index, ch).await);
            }
            Html(page(&title, &html)).into_response()
        }
        Err(e) => (
            http(ErrorKind::Unavailable),
            Html(page(
                &title,
                &format!(
                    "<p class=err>cannot read agent #{index}: {}</p>",
                    esc(&e.to_string())
                ),
            )),
        )
            .into_response(),
    }
}

/// An agent's change: its files, where it went, and its diff.
pub(super) async fn render_change(
    web: &Web,
    run: &str,
    index: u64,
    ch: &crate::head::ChangeRecord,
) -> String {
    let placed = if let Some(why) = &ch.refused {
        format!("refused ({why}): nowhere, its result stands")
    } else if ch.isolated {
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
        .and_then(|c| crate::source::Repo::new(&c.namespace, &c.source?.repo).ok());
    if let Some(repo) = repo.filter(|_| ch.refused.is_none()) {
        match crate::head::diff(
            web.coordinator.store(),
            &repo,
            &ch.base,
            &ch.commit,
            &web.coordinator.cache_dir(),
        )
        .await
        {
            Ok(d) => out.push_str(&super::turns::diff(&d)),
            Err(e) => out.push_str(&format!(
                "<p class=err>cannot show the diff: {}</p>",
                esc(&e.to_string())
            )),
        }
    }
    out.push_str("</section>");
    out
}

/// The run's whole change: its source against its head.
pub(super) async fn run_diff(
    State(web): State<Web>,
    Path(run): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = allowed(&web, &headers, &run, false).await {
        return refused;
    }
    let c = match crate::head::changes_of(web.coordinator.store(), &run).await {
        Ok(c) => c,
        Err(e) => {
            return (
                http(e.kind()),
                Html(format!("<p class=err>{}</p>", esc(&e.to_string()))),
            )
                .into_response();
        }
    };
    let (Some(src), Some(head)) = (c.source, c.head) else {
        return Html(page(&run, "<p class=note>this run has no source</p>")).into_response();
    };
    let diffed = match crate::source::Repo::new(&c.namespace, &src.repo) {
        Ok(repo) => {
            crate::head::diff(
                web.coordinator.store(),
                &repo,
                &src.commit,
                &head,
                &web.coordinator.cache_dir(),
            )
            .await
        }
        Err(e) => Err(e),
    };
    let body = match diffed {
        Ok(d) => format!(
            "<h2>Run {} — its head against its source</h2><p>{} agents changed files; <code>flotilla apply {}</code> brings them home</p>{}",
            esc(&run),
            c.changes.len(),
            esc(&run),
            super::turns::diff(&d)
        ),
        Err(e) => format!(
            "<p class=err>cannot show the diff: {}</p>",
            esc(&e.to_string())
        ),
    };
    Html(page(&run, &body)).into_response()
}

#[derive(Deserialize)]
pub(super) struct ControlBody {
    pub(super) action: String,
    #[serde(default)]
    pub(super) agent: String,
    /// Why (the page asks for it before a stop or pause); kept in the run's log and events.
    #[serde(default)]
    pub(super) reason: String,
    /// For `budget`: the run's money budget, in dollars.
    #[serde(default)]
    pub(super) usd: Option<f64>,
    /// For `answer`: the question (`q_…`; empty: the run's only open one) and the answer.
    #[serde(default)]
    pub(super) question: String,
    #[serde(default)]
    pub(super) answer: Option<serde_json::Value>,
}

/// The page's buttons: pause, resume or stop the run, stop or restart one agent. Needs the
/// `x-flotilla` header, which a cross-site form cannot send.
pub(super) async fn control(
    State(web): State<Web>,
    Path(run): Path<String>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<ControlBody>,
) -> Response {
    if let Err(refused) = allowed(&web, &headers, &run, true).await {
        return refused;
    }
    if !headers.contains_key("x-flotilla") {
        return (
            http(ErrorKind::Denied),
            axum::Json(serde_json::json!({"error": "send the x-flotilla header (the page does)"})),
        )
            .into_response();
    }
    if body.reason.len() > crate::registry::MAX_REASON {
        return (
            http(ErrorKind::Invalid),
            axum::Json(serde_json::json!({"error": format!("the reason is {} bytes; keep it under {}", body.reason.len(), crate::registry::MAX_REASON)})),
        )
            .into_response();
    }
    let who = who_signed_in(&web, &headers);
    if body.action == "answer" {
        return answer_from_page(&web, &run, body, &who).await;
    }
    let asked = crate::registry::Asked {
        by: &who,
        reason: &body.reason,
    };
    match web
        .registry
        .control(&run, &body.action, &body.agent, body.usd, asked)
        .await
    {
        Ok(message) => axum::Json(serde_json::json!({ "message": message })).into_response(),
        Err(s) => (
            http(ErrorKind::from_grpc(s.code())),
            axum::Json(serde_json::json!({ "error": s.message() })),
        )
            .into_response(),
    }
}

/// The page's answer to a question of the run: checked for size, then what `flotilla answer`
/// does.
async fn answer_from_page(web: &Web, run: &str, body: ControlBody, who: &str) -> Response {
    let refused = |kind: ErrorKind, message: String| {
        (
            http(kind),
            axum::Json(serde_json::json!({ "error": message })),
        )
            .into_response()
    };
    let value = body.answer.unwrap_or(serde_json::Value::Null);
    if let Err(p) = flotilla_local::sizes::text("the question", &body.question)
        .and_then(|()| flotilla_local::sizes::answer(&value.to_string()).map(|_| ()))
    {
        return refused(p.kind, p.message);
    }
    match web
        .registry
        .answer(
            run,
            Some(body.question),
            value,
            &format!("{who} (the page)"),
        )
        .await
    {
        Ok(message) => axum::Json(serde_json::json!({ "message": message })).into_response(),
        Err(s) => refused(ErrorKind::from_grpc(s.code()), s.message().to_owned()),
    }
}

pub(super) async fn page_data(web: &Web, run: &str) -> Result<PageData, (StatusCode, String)> {
    if let Some(report) = web.registry.live_report(run).await {
        let summary = web
            .registry
            .summary(run)
            .unwrap_or_else(|| Summary::of_report(&report));
        return Ok(PageData {
            summary,
            report,
            here: true,
        });
    }
    let report = stored_report(web, run).await?;
    Ok(PageData {
        summary: Summary::of_report(&report),
        report: Arc::new(report),
        here: false,
    })
}
