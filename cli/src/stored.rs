//! `flotilla runs` and `flotilla show`: reading stored runs.

use flotilla_proto::Problem;
use std::io::Write;

use flotilla_coordinator::host;

use crate::{config, fail_kind};

/// Which runs `flotilla runs` lists, a page at a time.
#[derive(Debug, Clone, clap::Args)]
pub struct FilterArgs {
    /// Runs of this workflow (its `meta.name`).
    #[arg(long)]
    workflow: Option<String>,
    /// Runs in this status: running, paused, stopping, completed, failed, stopped, interrupted
    /// (a coordinator shows the runs it runs as their engines have them).
    #[arg(long)]
    status: Option<String>,
    /// Runs created since then: a duration back from now (`24h`, `7d`) or an RFC 3339 time.
    #[arg(long, value_name = "DUR|TIME")]
    since: Option<String>,
    /// Runs with this label (`launch --label`; repeatable: every one must match).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    labels: Vec<String>,
    /// Runs of this namespace (on a fleet you see only your certificate's namespaces).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,
    /// Runs per page [default: 100, at most 1000].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1000))]
    limit: Option<u64>,
    /// The page after this token (printed at the end of a page that has more).
    #[arg(long, value_name = "TOKEN")]
    after: Option<String>,
}

impl FilterArgs {
    /// The index filter; an error names the bad flag and its form.
    pub fn filter(&self) -> Result<host::Filter, Problem> {
        let status = match &self.status {
            None => None,
            Some(s) => Some(
                serde_json::from_value::<flotilla_proto::wire::RunStatus>(
                    serde_json::Value::String(s.clone()),
                )
                .map_err(|_| {
                    Problem::invalid(format!(
                        "--status {s:?} is not a run status: use running, paused, stopping, completed, failed, stopped or interrupted"
                    ))
                })?,
            ),
        };
        let since_unix = match &self.since {
            None => None,
            Some(t) => Some(since(t)?),
        };
        Ok(host::Filter {
            workflow: self.workflow.clone(),
            status,
            since_unix,
            before_unix: None,
            labels: config::parse_labels(&self.labels)?,
            namespace: match &self.namespace {
                Some(ns) if !flotilla_proto::names::valid_namespace(ns) => {
                    return Err(Problem::invalid(format!(
                        "--namespace {ns:?} is not a namespace name: 1 to 63 lower-case letters, digits, - _ and ."
                    )));
                }
                ns => ns.clone(),
            },
            within: None,
            limit: self.limit.map(|l| l as usize),
            after: self.after.clone(),
        })
    }
}

/// `--since`: seconds since the epoch of a time, or of now minus a duration.
fn since(t: &str) -> Result<u64, Problem> {
    let now = flotilla_proto::clock::now();
    let at = match humantime::parse_rfc3339_weak(t) {
        Ok(at) => at,
        Err(_) => {
            let d = config::parse_duration("--since", t).map_err(|_| {
                Problem::invalid(format!("--since {t:?} is neither a duration (24h, 7d) nor a time (2026-11-01T00:00:00Z)"))
            })?;
            now.checked_sub(d).unwrap_or(std::time::UNIX_EPOCH)
        }
    };
    Ok(at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()))
}

/// Prints a page of runs; the exit status.
pub fn print_runs(
    runs: &[flotilla_proto::wire::RunSummary],
    next: Option<&str>,
    json: bool,
    from: &str,
) -> i32 {
    let mut out = std::io::stdout().lock();
    if json {
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&runs).unwrap_or_default()
        );
    } else if runs.is_empty() {
        eprintln!("no runs in {from} match");
    } else {
        let _ = writeln!(
            out,
            "{:<18} {:<21} {:<7} {:<8} {:<25} {:<24} {:<12} LABELS",
            "RUN", "STATUS", "AGENTS", "QUEUED", "CREATED", "WORKFLOW", "NAMESPACE"
        );
        for r in runs {
            let s = &r.summary;
            let labels: Vec<String> = r.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = writeln!(
                out,
                "{:<18} {:<21} {:<7} {:<8} {:<25} {:<24} {:<12} {}",
                r.run_id,
                s.headline(),
                s.agents,
                s.queued,
                r.created,
                crate::term::clean(&r.workflow),
                flotilla_proto::names::effective_namespace(&r.namespace),
                crate::term::clean(&labels.join(","))
            );
            if let Some(w) = &s.waiting {
                let _ = writeln!(out, "{:<18} waiting: {}", "", crate::term::clean(w));
            }
        }
    }
    if let Some(next) = next {
        eprintln!("more runs follow: add --after {next}");
    }
    0
}

pub async fn list(store_flag: Option<String>, filter: &FilterArgs, json: bool) -> i32 {
    let filter = match filter.filter() {
        Ok(f) => f,
        Err(e) => return crate::refuse(e),
    };
    let url = config::store_url(store_flag);
    let store = match host::open_store(&url) {
        Ok(s) => s,
        Err(e) => return crate::refuse(e.into()),
    };
    match host::runs_page(&store, &filter).await {
        Ok(page) => print_runs(&page.runs, page.next.as_deref(), json, &url),
        Err(e) => fail_kind(
            flotilla_proto::ErrorKind::Unavailable,
            format!("cannot list runs in {url}: {e}"),
        ),
    }
}

pub async fn show(store_flag: Option<String>, run: &str, json: bool, full: bool) -> i32 {
    match report(store_flag, run).await {
        Ok(report) => print_show(report, json, full),
        Err(p) => crate::refuse(p),
    }
}

/// The report of run `run` in the store `store_flag` names (or the default one).
pub async fn report(
    store_flag: Option<String>,
    run: &str,
) -> Result<flotilla_proto::wire::Report, Problem> {
    let store = host::open_store(&config::store_url(store_flag))?;
    Ok(host::load_report(&store, run).await?)
}

/// Prints a run's report as `show` does: the JSON report, or its summary, agents, logs and
/// result.
pub fn print_show(report: flotilla_proto::wire::Report, json: bool, full: bool) -> i32 {
    let report = if full {
        report
    } else {
        report.brief(flotilla_proto::wire::REPORT_AGENTS)
    };
    if json {
        let _ = writeln!(
            std::io::stdout().lock(),
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
        return 0;
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "run       {}", report.run_id);
    let _ = writeln!(
        out,
        "workflow  {} — {}",
        report.workflow.name, report.workflow.description
    );
    let summary = flotilla_proto::wire::Summary::of_report(&report);
    let _ = writeln!(out, "status    {}", summary.headline());
    if let Some(p) = &report.parent_run_id {
        let _ = writeln!(out, "resumed   from {p}");
    }
    if let Some(e) = &report.error {
        let _ = writeln!(out, "error     {e}");
    }
    let u = &report.usage;
    let _ = writeln!(
        out,
        "agents    {} ({} dispatched, {} cached, {} errors, {} attempts)",
        u.agents, u.dispatched, u.cached, u.errors, u.attempts
    );
    let _ = writeln!(
        out,
        "tokens    {} in / {} out",
        u.input_tokens, u.output_tokens
    );
    let _ = writeln!(out, "duration  {} ms", u.duration_ms);
    for w in &report.warnings {
        let _ = writeln!(out, "warning   {w}");
    }
    for g in &report.groups {
        let title = if g.title.is_empty() {
            "(no phase)"
        } else {
            &g.title
        };
        let _ = writeln!(out, "\n[{title}]");
        for a in report.agents.iter().filter(|a| a.group == g.title) {
            let _ = writeln!(
                out,
                "  {:<9} {:<50} attempts {}{}{}",
                a.status,
                a.label,
                a.attempts,
                if a.cached { " cached" } else { "" },
                a.error
                    .as_ref()
                    .map(|e| format!(" — {e}"))
                    .unwrap_or_default()
            );
        }
    }
    if report.agents_omitted > 0 {
        let _ = writeln!(
            out,
            "\n… and {} more agents: `flotilla agents {}` pages through them, `--full` lists them here",
            report.agents_omitted, report.run_id
        );
    }
    for l in &report.logs {
        let _ = writeln!(out, "log: {l}");
    }
    for f in &report.failures {
        let _ = writeln!(out, "failure: {f}");
    }
    if !report.result.is_null() {
        let _ = writeln!(
            out,
            "\nresult:\n{}",
            serde_json::to_string_pretty(&report.result).unwrap_or_default()
        );
    }
    0
}

/// `flotilla logs RUN [--agent A] [--attempt N] [--follow]`: transcripts from the store;
/// with `follow`, again every second until the run has ended (as its stored state says).
pub async fn logs(store_flag: Option<String>, ask: crate::client::LogsAsk<'_>) -> i32 {
    let url = config::store_url(store_flag);
    let store = match host::open_store(&url) {
        Ok(s) => s,
        Err(e) => return crate::refuse(e.into()),
    };
    let mut printed = if ask.follow {
        Printed::following()
    } else {
        Printed::default()
    };
    loop {
        let report = match host::load_report(&store, ask.run).await {
            Ok(r) => r,
            Err(e) => return crate::refuse(e.into()),
        };
        let ended = !ask.follow || report.status.is_final();
        match host::transcripts(&store, &report, ask.agent, ask.attempt).await {
            Ok(found) => printed.print(&found, ask.json),
            Err(host::TranscriptError::NoAgent(m)) if !ask.follow || ended => {
                return fail_kind(flotilla_proto::ErrorKind::Invalid, m);
            }
            // Followed from the start, the agent asked for may not have been called yet.
            Err(host::TranscriptError::NoAgent(_)) => {}
            Err(host::TranscriptError::Store(e)) => {
                return fail_kind(
                    flotilla_proto::ErrorKind::Unavailable,
                    format!("cannot read the transcript: {e}"),
                );
            }
        }
        if ended {
            return 0;
        }
        tokio::time::sleep(crate::client::FOLLOW_EVERY).await;
    }
}

/// Prints transcripts (`== #INDEX LABEL (attempt N of M)` and one line per event, or one JSON
/// object per event with `--json`) and keeps what it printed, so `logs --follow` prints each
/// event once: per agent and attempt, how many of its events.
#[derive(Default)]
pub struct Printed {
    events: std::collections::HashMap<(u64, u32), usize>,
    /// Following a run: an attempt with no event yet gets its heading with its first one.
    follow: bool,
}

impl Printed {
    pub fn following() -> Printed {
        Printed {
            follow: true,
            ..Printed::default()
        }
    }

    /// Prints what of `found` was not printed yet: an attempt's heading (a served agent's
    /// once), then its new events.
    pub fn print(&mut self, found: &[host::AgentTranscript], json: bool) {
        let mut out = std::io::stdout().lock();
        for a in found {
            let key = (a.index, a.attempt);
            let shown = self.events.get(&key).copied();
            if a.cached {
                if shown.is_none() && !json {
                    let _ = writeln!(
                        out,
                        "== #{} {} (served from the journal: no transcript)",
                        a.index, a.label
                    );
                }
                self.events.insert(key, 0);
                continue;
            }
            let new = a.events.get(shown.unwrap_or(0)..).unwrap_or_default();
            if shown.is_none() && !json && (!self.follow || !new.is_empty()) {
                let _ = writeln!(
                    out,
                    "== #{} {} (attempt {} of {})",
                    a.index, a.label, a.attempt, a.attempts
                );
            }
            for e in new {
                if json {
                    let _ = writeln!(
                        out,
                        "{}",
                        serde_json::json!({"agent": a.index, "attempt": a.attempt, "event": e})
                    );
                } else {
                    let _ = writeln!(out, "{}", host::transcript_line(e));
                }
            }
            if shown.is_some() || !self.follow || !new.is_empty() {
                self.events.insert(key, a.events.len());
            }
        }
        let _ = out.flush();
    }
}

/// `flotilla gc`: retention on a store.
#[derive(Debug, clap::Args)]
pub struct GcArgs {
    /// Delete runs created longer ago than this (`30d`, `12h`), with the stored results and
    /// sources no other run uses.
    #[arg(long, value_name = "DUR")]
    older_than: String,
    /// Keep failed and interrupted runs whatever their age.
    #[arg(long)]
    keep_failed: bool,
    /// Say what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print what was deleted as JSON.
    #[arg(long)]
    json: bool,
    /// Object store URL (file:///path, s3://bucket/prefix) [default: the local store].
    #[arg(long, env = "FLOTILLA_STORE")]
    store: Option<String>,
}

pub async fn gc(a: GcArgs) -> i32 {
    let older_than = match config::parse_duration("--older-than", &a.older_than) {
        Ok(d) if d.as_secs() >= 1 => d,
        Ok(_) => {
            return fail_kind(
                flotilla_proto::ErrorKind::Invalid,
                "--older-than must be at least 1s; e.g. --older-than 30d",
            );
        }
        Err(e) => return crate::refuse(e),
    };
    let url = config::store_url(a.store);
    let store = match host::open_store(&url) {
        Ok(s) => s,
        Err(e) => return crate::refuse(e.into()),
    };
    let policy = flotilla_coordinator::host::RetentionPolicy {
        older_than,
        keep_failed: a.keep_failed,
        dry_run: a.dry_run,
    };
    match flotilla_coordinator::host::sweep(&store, &policy, &Default::default()).await {
        Ok(swept) => {
            if a.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&swept).unwrap_or_default()
                );
            } else {
                println!("{}", swept_line(&swept));
                for k in &swept.kept {
                    println!("  kept {}: {}", k.run_id, k.why);
                }
            }
            0
        }
        Err(e) => crate::fail_kind(e.kind(), format!("cannot sweep {url}: {e}")),
    }
}

/// One line of what a sweep did.
pub fn swept_line(s: &flotilla_coordinator::host::Swept) -> String {
    format!(
        "{} {} runs ({} objects), {} payloads and {} source objects, {}; kept {} old runs",
        if s.dry_run { "would delete" } else { "deleted" },
        s.runs.len(),
        s.objects,
        s.payloads,
        s.source_objects,
        flotilla_local::reads::human_bytes(s.bytes as usize),
        s.kept.len()
    )
}

/// The questions run `run` asked (`ask()`), as the store `store_flag` names keeps them.
pub async fn questions(
    store_flag: Option<String>,
    run: &str,
) -> Result<Vec<flotilla_proto::wire::Question>, Problem> {
    let store = host::open_store(&config::store_url(store_flag))?;
    Ok(host::stored_questions(&store, run).await?)
}

/// Answers a question of an embedded run in the store `store_flag` names (the run looks
/// there while a question is open), as the local user (`via`: how, e.g. ` (MCP)`).
pub async fn answer(
    store_flag: Option<String>,
    run: &str,
    question: Option<&str>,
    value: serde_json::Value,
    via: &str,
) -> Result<String, Problem> {
    let store = host::open_store(&config::store_url(store_flag))?;
    let name = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    host::answer_in_store(
        &store,
        run,
        question,
        value,
        &format!("local user {name}{via}"),
    )
    .await
}
