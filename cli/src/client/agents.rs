//! `flotilla agents RUN`: a run's agents a page at a time, filtered by status or phase. A big
//! run's report lists at most [`REPORT_AGENTS`](flotilla_proto::wire::REPORT_AGENTS)
//! of them; this lists any of them, from a store or from a coordinator.

use std::io::Write;

use clap::Args;
use flotilla_proto::wire::AgentReport;
use serde::Serialize;

use crate::{client, fail_kind, term};

#[derive(Debug, Args)]
pub struct AgentsArgs {
    run_id: String,
    /// Only agents with this status: queued, running, completed, failed or cancelled.
    #[arg(long)]
    status: Option<String>,
    /// Only agents of this phase (its title; "" for agents outside any phase).
    #[arg(long)]
    phase: Option<String>,
    /// Skip this many agents (after the filters).
    #[arg(long, default_value_t = 0)]
    offset: usize,
    /// List at most this many.
    #[arg(long, default_value_t = 100)]
    limit: usize,
    #[command(flatten)]
    from: client::ReadFrom,
    /// One JSON object: the page, the total and the next offset.
    #[arg(long)]
    json: bool,
}

const STATUSES: [&str; 5] = ["queued", "running", "completed", "failed", "cancelled"];

#[derive(Serialize)]
struct Page<'a> {
    run_id: &'a str,
    /// Agents that pass the filters.
    total: usize,
    offset: usize,
    limit: usize,
    /// The offset of the next page, if there is one.
    next_offset: Option<usize>,
    agents: Vec<&'a AgentReport>,
}

impl AgentsArgs {
    pub fn json(&self) -> bool {
        self.json
    }
}

pub async fn run(a: AgentsArgs) -> i32 {
    if let Some(s) = &a.status
        && !STATUSES.contains(&s.as_str())
    {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            format!(
                "--status {s:?} is not a status; use one of {}",
                STATUSES.join(", ")
            ),
        );
    }
    if a.limit == 0 {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            "--limit must be at least 1",
        );
    }
    let report = match &a.from.coordinator {
        Some(c) => match client::report_of(c, &a.from.tls, &a.run_id).await {
            Ok(r) => r,
            Err(code) => return code,
        },
        None => match crate::stored::report(a.from.store.clone(), &a.run_id).await {
            Ok(r) => r,
            Err(p) => return crate::refuse(p),
        },
    };
    let matching: Vec<&AgentReport> = report
        .agents
        .iter()
        .filter(|g| a.status.as_deref().is_none_or(|s| g.status.as_str() == s))
        .filter(|g| a.phase.as_deref().is_none_or(|p| g.group == p))
        .collect();
    let total = matching.len();
    let page: Vec<&AgentReport> = matching.into_iter().skip(a.offset).take(a.limit).collect();
    let end = a.offset + page.len();
    let next_offset = (end < total).then_some(end);
    let mut out = std::io::stdout().lock();
    if a.json {
        let p = Page {
            run_id: &report.run_id,
            total,
            offset: a.offset,
            limit: a.limit,
            next_offset,
            agents: page,
        };
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&p).unwrap_or_default()
        );
        return 0;
    }
    let _ = writeln!(
        out,
        "{:>7}  {:<9} {:>8}  {:<20} LABEL",
        "INDEX", "STATUS", "ATTEMPTS", "PHASE"
    );
    for g in &page {
        let error = g
            .error
            .as_deref()
            .map(|e| format!(" — {}", term::clean(e)))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{:>7}  {:<9} {:>8}  {:<20} {}{}{error}",
            g.index,
            g.status.as_str(),
            g.attempts,
            term::clean(&g.group),
            term::clean(&g.label),
            if g.cached { " (cached)" } else { "" },
        );
    }
    let _ = out.flush();
    if page.is_empty() {
        eprintln!("no agents at offset {} of {total}", a.offset);
    } else {
        eprintln!(
            "agents {}–{end} of {total}{}",
            a.offset + 1,
            next_offset
                .map(|n| format!(" (next page: --offset {n})"))
                .unwrap_or_default()
        );
    }
    0
}
