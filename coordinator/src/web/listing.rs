//! `/runs` and `/runs.json`: the runs the reader's sign-in shows, newest first, filtered by
//! status, workflow, namespace, label and creation time, a page at a time (the run index
//! does the filtering and paging; see `crate::index`).

use axum::extract::{RawQuery, State};
use axum::http::HeaderMap;
use axum::response::{Html, IntoResponse, Response};

use super::auth::{check, refuse};
use super::render::{self, esc, fmt_ms, page, status_cell};
use super::state::{Web, http};
use crate::index::{Filter, PAGE, Page};
use crate::report::RunStatus;
use flotilla_proto::{ErrorKind, Problem};

/// The query of `/runs` and `/runs.json`, as the filter form writes it.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct RunsQuery {
    pub(super) status: String,
    pub(super) workflow: String,
    pub(super) namespace: String,
    /// `key=value`, several separated by commas.
    pub(super) label: String,
    /// Created within this long before now (`30m`, `24h`, `7d`).
    pub(super) since: String,
    pub(super) limit: Option<usize>,
    pub(super) after: String,
}

impl RunsQuery {
    /// Reads a query string; an unknown key or a bad value is refused with what to write.
    pub(super) fn parse(raw: Option<&str>) -> Result<RunsQuery, Problem> {
        let mut q = RunsQuery::default();
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw.unwrap_or(""))
            .map_err(|e| Problem::invalid(format!("cannot read the query: {e}")))?;
        for (k, v) in pairs {
            let v = v.trim().to_owned();
            match k.as_str() {
                "status" => q.status = v,
                "workflow" => q.workflow = v,
                "namespace" => q.namespace = v,
                "label" => q.label = v,
                "since" => q.since = v,
                "after" => q.after = v,
                // A `run --serve` or `flotilla ui` page's key: the guard's, not a filter.
                "key" => {}
                "limit" if v.is_empty() => {}
                "limit" => {
                    q.limit = Some(v.parse().map_err(|_| {
                        Problem::invalid(format!("limit {v:?} is not a number of runs"))
                    })?);
                }
                other => {
                    return Err(Problem::invalid(format!(
                        "unknown filter {other:?}: use status, workflow, namespace, label, since, limit or after"
                    )));
                }
            }
        }
        Ok(q)
    }

    /// The index filter it asks for.
    pub(super) fn filter(&self, within: Option<Vec<String>>) -> Result<Filter, Problem> {
        let status = match self.status.as_str() {
            "" | "any" => None,
            s => Some(
                serde_json::from_value::<RunStatus>(serde_json::Value::String(s.to_owned()))
                    .map_err(|_| {
                        Problem::invalid(format!(
                            "status {s:?}: use running, paused, stopping, completed, failed, stopped or interrupted"
                        ))
                    })?,
            ),
        };
        let mut labels = std::collections::BTreeMap::new();
        for pair in self
            .label
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| Problem::invalid(format!("label {pair:?}: write key=value")))?;
            labels.insert(k.trim().to_owned(), v.trim().to_owned());
        }
        let since_unix = if self.since.is_empty() {
            None
        } else {
            let back = humantime::parse_duration(&self.since).map_err(|e| {
                Problem::invalid(format!(
                    "since {:?}: {e} (write a span such as 30m, 24h or 7d)",
                    self.since
                ))
            })?;
            let now = flotilla_proto::clock::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            Some(now.saturating_sub(back).as_secs())
        };
        Ok(Filter {
            workflow: (!self.workflow.is_empty()).then(|| self.workflow.clone()),
            status,
            since_unix,
            before_unix: None,
            labels,
            namespace: (!self.namespace.is_empty()).then(|| self.namespace.clone()),
            within,
            limit: Some(self.limit.unwrap_or(PAGE).clamp(1, crate::index::MAX_PAGE)),
            after: (!self.after.is_empty()).then(|| self.after.clone()),
        })
    }

    /// This query's string with the page starting at `after`.
    fn with_after(&self, after: &str) -> String {
        let mut pairs: Vec<(&str, String)> = Vec::new();
        for (k, v) in [
            ("status", &self.status),
            ("workflow", &self.workflow),
            ("namespace", &self.namespace),
            ("label", &self.label),
            ("since", &self.since),
        ] {
            if !v.is_empty() {
                pairs.push((k, v.clone()));
            }
        }
        if let Some(l) = self.limit {
            pairs.push(("limit", l.to_string()));
        }
        pairs.push(("after", after.to_owned()));
        serde_urlencoded::to_string(&pairs).unwrap_or_default()
    }
}

/// A page of runs for the signed-in reader, or the response to send instead.
async fn runs_for(
    web: &Web,
    headers: &HeaderMap,
    raw: Option<&str>,
    json: bool,
) -> Result<(RunsQuery, Page), Response> {
    let scope = check(web, headers).map_err(|why| refuse(why, json))?;
    let refused = |code: ErrorKind, msg: String| {
        if json {
            (http(code), axum::Json(serde_json::json!({ "error": msg }))).into_response()
        } else {
            (
                http(code),
                Html(page("Runs", &format!("<p class=err>{}</p>", esc(&msg)))),
            )
                .into_response()
        }
    };
    let q = RunsQuery::parse(raw).map_err(|e| refused(e.kind, e.message))?;
    let filter = q
        .filter(scope.names().map(<[String]>::to_vec))
        .map_err(|e| refused(e.kind, e.message))?;
    let page = crate::index::page_with(web.coordinator.store(), &filter, &*web.registry)
        .await
        .map_err(|e| refused(ErrorKind::Unavailable, format!("cannot list runs: {e}")))?;
    Ok((q, page))
}

/// `/runs.json`: the page's runs as a JSON array, newest first; the next page's `after`, if
/// any, in the `x-next-after` header.
pub(super) async fn runs_json(
    State(web): State<Web>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    match runs_for(&web, &headers, raw.as_deref(), true).await {
        Ok((_, page)) => {
            let mut r = axum::Json(page.runs).into_response();
            if let Some(next) = page.next
                && let Ok(v) = next.parse()
            {
                r.headers_mut().insert("x-next-after", v);
            }
            r
        }
        Err(refused) => refused,
    }
}

/// `/runs`: the filter form, the page's runs and a link to the next page, then the provider
/// accounts.
pub(super) async fn runs_page(
    State(web): State<Web>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    let (q, runs) = match runs_for(&web, &headers, raw.as_deref(), false).await {
        Ok(r) => r,
        Err(refused) => return refused,
    };
    let mut body = filter_form(&q);
    body.push_str(&runs_table(&runs, &q));
    let accounts = web
        .coordinator
        .dispatch()
        .stats()
        .await
        .map(|s| s.accounts)
        .unwrap_or_default();
    body.push_str(&render::accounts_table(&accounts));
    Html(page("Runs", &body)).into_response()
}

fn filter_form(q: &RunsQuery) -> String {
    let mut statuses = String::from("<option value=\"\">any status</option>");
    for s in [
        "running",
        "paused",
        "stopping",
        "completed",
        "failed",
        "stopped",
        "interrupted",
    ] {
        let sel = if q.status == s { " selected" } else { "" };
        statuses.push_str(&format!("<option{sel}>{s}</option>"));
    }
    format!(
        "<h1>Runs</h1><form class=filters id=filters method=get action=/runs>\
         <select name=status id=f-status>{statuses}</select>\
         <input name=workflow id=f-workflow placeholder=workflow value=\"{wf}\">\
         <input name=namespace id=f-namespace placeholder=namespace value=\"{ns}\">\
         <input name=label id=f-label placeholder=\"label key=value\" value=\"{label}\">\
         <input name=since id=f-since placeholder=\"since (24h, 7d)\" size=10 value=\"{since}\">\
         <button type=submit id=f-go>Filter</button> <a href=/runs>clear</a></form>",
        wf = esc(&q.workflow),
        ns = esc(&q.namespace),
        label = esc(&q.label),
        since = esc(&q.since),
    )
}

fn runs_table(p: &Page, q: &RunsQuery) -> String {
    let mut rows = String::new();
    for r in &p.runs {
        let s = &r.summary;
        let failed = if s.failed > 0 {
            format!("<td class=\"st failed\">{}</td>", s.failed)
        } else {
            "<td>0</td>".to_owned()
        };
        let labels: Vec<String> = r.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        rows.push_str(&format!(
            "<tr id=\"run-{id}\"><td{marked}><a href=\"/runs/{id}\">{id}</a></td><td>{wf}</td><td>{ns}</td>{status}\
             <td class=agents>{agents}</td>{failed}<td>{tokens}</td><td>${cost:.4}</td><td>{dur}</td><td>{created}</td><td class=labels>{labels}</td></tr>",
            id = esc(&r.run_id),
            // A run whose agents failed is marked so, whatever its status.
            marked = if s.failed > 0 { " class=had-failures title=\"agents of this run failed\"" } else { "" },
            wf = esc(&r.workflow),
            ns = esc(crate::namespace::effective(&r.namespace)),
            status = status_cell(s),
            agents = esc(&s.agents_line()),
            tokens = s.input_tokens + s.output_tokens,
            cost = s.cost_usd,
            dur = if s.elapsed_ms > 0 {
                fmt_ms(s.elapsed_ms)
            } else {
                String::new()
            },
            created = esc(&r.created),
            labels = esc(&labels.join(", ")),
        ));
    }
    let mut out = format!(
        "<table id=runs><thead><tr><th>run</th><th>workflow</th><th>namespace</th><th>status</th><th>agents</th><th>failed</th><th>tokens</th><th>cost</th><th>duration</th><th>created</th><th>labels</th></tr></thead><tbody>{rows}</tbody></table>"
    );
    if p.runs.is_empty() {
        out.push_str("<p class=note id=no-runs>no run matches</p>");
    }
    if let Some(next) = &p.next {
        out.push_str(&format!(
            "<p class=pager><a id=next-page href=\"/runs?{}\">older runs →</a></p>",
            esc(&q.with_after(next))
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_becomes_the_index_filter_and_bad_values_say_what_to_write() {
        let q = RunsQuery::parse(Some(
            "status=failed&workflow=audit&label=team%3Dcore,env%3Dprod&since=24h&limit=5",
        ))
        .unwrap();
        let f = q.filter(Some(vec!["a".into()])).unwrap();
        assert_eq!(f.status, Some(RunStatus::Failed));
        assert_eq!(f.workflow.as_deref(), Some("audit"));
        assert_eq!(f.labels.get("team").map(String::as_str), Some("core"));
        assert_eq!(f.labels.len(), 2);
        assert_eq!(f.limit, Some(5));
        assert!(f.since_unix.is_some());
        assert_eq!(
            f.within,
            Some(vec!["a".to_owned()]),
            "the sign-in's namespaces"
        );
        for (bad, says) in [
            ("status=nope", "status \"nope\""),
            ("label=team", "write key=value"),
            ("since=yesterday", "30m, 24h or 7d"),
            ("limit=many", "not a number"),
            ("within=other", "unknown filter \"within\""),
        ] {
            let e = RunsQuery::parse(Some(bad))
                .and_then(|q| q.filter(None))
                .expect_err(bad);
            assert!(e.to_string().contains(says), "{bad}: {e}");
        }
        // The next page keeps the filters.
        let next = q.with_after("k1");
        assert!(
            next.contains("status=failed") && next.contains("after=k1"),
            "{next}"
        );
        assert_eq!(RunsQuery::parse(Some(&next)).unwrap().after, "k1");
    }
}
