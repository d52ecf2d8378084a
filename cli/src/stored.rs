//! `flotilla runs` and `flotilla show`: reading stored runs.

use std::io::Write;

use flotilla_coordinator::{history, store};

use crate::{config, fail};

pub async fn list(store_flag: Option<String>, json: bool) -> i32 {
    let url = config::store_url(store_flag);
    let store = match store::open(&url) {
        Ok(s) => s,
        Err(e) => return fail(e.kind().exit_code(), e),
    };
    let runs = match history::list_runs(&store).await {
        Ok(r) => r,
        Err(e) => return fail(1, format!("cannot list runs in {url}: {e}")),
    };
    let mut out = std::io::stdout().lock();
    if json {
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&runs).unwrap_or_default()
        );
        return 0;
    }
    if runs.is_empty() {
        eprintln!("no runs in {url}");
        return 0;
    }
    let _ = writeln!(
        out,
        "{:<18} {:<10} {:<7} {:<21} WORKFLOW",
        "RUN", "STATUS", "AGENTS", "CREATED"
    );
    for r in runs {
        let _ = writeln!(
            out,
            "{:<18} {:<10} {:<7} {:<21} {}",
            r.run_id,
            r.status.as_str(),
            r.agents,
            r.created,
            crate::term::clean(&r.workflow)
        );
    }
    0
}

pub async fn show(store_flag: Option<String>, run: &str, json: bool, full: bool) -> i32 {
    let url = config::store_url(store_flag);
    let store = match store::open(&url) {
        Ok(s) => s,
        Err(e) => return fail(e.kind().exit_code(), e),
    };
    let report = match history::load_report(&store, run).await {
        Ok(r) => r,
        Err(e) => return fail(e.kind().exit_code(), e),
    };
    let report = if full {
        report
    } else {
        report.brief(flotilla_coordinator::report::REPORT_AGENTS)
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
    let _ = writeln!(out, "status    {}", report.status.as_str());
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

/// `flotilla logs RUN [--agent A] [--attempt N]`: transcripts from the store.
pub async fn logs(
    store_flag: Option<String>,
    run: &str,
    agent: Option<&str>,
    attempt: Option<u32>,
    json: bool,
) -> i32 {
    let url = config::store_url(store_flag);
    let store = match store::open(&url) {
        Ok(s) => s,
        Err(e) => return fail(e.kind().exit_code(), e),
    };
    let report = match history::load_report(&store, run).await {
        Ok(r) => r,
        Err(e) => return fail(e.kind().exit_code(), e),
    };
    match history::transcripts(&store, &report, agent, attempt).await {
        Ok(found) => print_transcripts(&found, json),
        Err(history::TranscriptError::NoAgent(m)) => fail(2, m),
        Err(history::TranscriptError::Store(e)) => {
            fail(1, format!("cannot read the transcript: {e}"))
        }
    }
}

/// Prints transcripts: `== #INDEX LABEL (attempt N of M)` and one line per event, or one JSON
/// object per event with `--json`.
pub fn print_transcripts(found: &[history::AgentTranscript], json: bool) -> i32 {
    let mut out = std::io::stdout().lock();
    for a in found {
        if a.cached {
            if !json {
                let _ = writeln!(
                    out,
                    "== #{} {} (served from the journal: no transcript)",
                    a.index, a.label
                );
            }
            continue;
        }
        if json {
            for e in &a.events {
                let _ = writeln!(
                    out,
                    "{}",
                    serde_json::json!({"agent": a.index, "attempt": a.attempt, "event": e})
                );
            }
            continue;
        }
        let _ = writeln!(
            out,
            "== #{} {} (attempt {} of {})",
            a.index, a.label, a.attempt, a.attempts
        );
        for e in &a.events {
            let _ = writeln!(out, "{}", history::transcript_line(e));
        }
    }
    0
}
