//! Reading stored runs back: the list of runs, and the report of one run.
//!
//! A finished run has `result.json`. A run whose process died has only its manifest, events
//! and journal; its report is rebuilt from those (status as last recorded, agents from call
//! events, completed ones from the journal), so nothing stored is ever hidden.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::report::{AgentReport, GroupReport, Report, ReportUsage, RunStatus};
use crate::store::journal::{read_calls, read_events};
use crate::store::records::{Manifest, RunEvent};
use crate::store::{Error, Store, keys};

/// One line of `flotilla runs`.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub run_id: String,
    pub status: RunStatus,
    pub workflow: String,
    pub created: String,
    pub agents: u64,
    pub parent_run_id: Option<String>,
}

async fn manifest(store: &Store, run: &str) -> Result<Manifest, Error> {
    let key = keys::manifest(run);
    let body = store.get(&key).await?.ok_or_else(|| Error::NotFound {
        what: format!("run {run}"),
        url: store.url.clone(),
    })?;
    serde_json::from_slice(&body).map_err(|e| Error::Corrupt {
        key: key.to_string(),
        reason: e.to_string(),
    })
}

/// Every run in the store, newest first.
pub async fn list_runs(store: &Store) -> Result<Vec<RunSummary>, Error> {
    let mut out = Vec::new();
    for dir in store.list_prefixes(&keys::runs()).await? {
        let Some(run) = dir.filename() else { continue };
        let Ok(m) = manifest(store, run).await else {
            continue;
        };
        let report = load_report(store, run).await.ok();
        out.push(RunSummary {
            run_id: m.run_id.clone(),
            status: report.as_ref().map_or(RunStatus::Running, |r| r.status),
            workflow: m.workflow.name.clone(),
            created: m.created.clone(),
            agents: report.as_ref().map_or(0, |r| r.usage.agents),
            parent_run_id: m.parent_run_id.clone(),
        });
    }
    out.sort_by(|a, b| b.created.cmp(&a.created).then(b.run_id.cmp(&a.run_id)));
    Ok(out)
}

/// The report of a stored run.
pub async fn load_report(store: &Store, run: &str) -> Result<Report, Error> {
    let m = manifest(store, run).await?;
    if let Some(body) = store.get(&keys::result(run)).await? {
        return serde_json::from_slice(&body).map_err(|e| Error::Corrupt {
            key: keys::result(run).to_string(),
            reason: e.to_string(),
        });
    }
    rebuild(store, &m).await
}

async fn rebuild(store: &Store, m: &Manifest) -> Result<Report, Error> {
    let run = &m.run_id;
    let events = read_events(store, run).await?;
    let calls = read_calls(store, run).await?;
    let mut status = RunStatus::Running;
    let mut error = None;
    let mut groups: Vec<String> = Vec::new();
    let mut logs = Vec::new();
    let mut failures = Vec::new();
    let mut agents: BTreeMap<u64, AgentReport> = BTreeMap::new();
    for e in &events {
        match &e.event {
            RunEvent::Status {
                status: s,
                error: err,
            } => {
                status = match s.as_str() {
                    "completed" => RunStatus::Completed,
                    "failed" => RunStatus::Failed,
                    "stopped" => RunStatus::Stopped,
                    _ => RunStatus::Running,
                };
                error.clone_from(err);
            }
            RunEvent::Group { title } => {
                if !groups.contains(title) {
                    groups.push(title.clone());
                }
            }
            RunEvent::Log { line } => logs.push(line.clone()),
            RunEvent::Failure { line } => failures.push(line.clone()),
            RunEvent::Call {
                index,
                label,
                group,
                state,
                attempt,
                detail,
            } => {
                let a = agents.entry(*index).or_insert_with(|| AgentReport {
                    label: label.clone(),
                    group: group.clone(),
                    status: "cancelled".into(),
                    attempts: 0,
                    cached: false,
                    start_ms: None,
                    end_ms: None,
                    error: None,
                    index: *index,
                    key: String::new(),
                    model: String::new(),
                    input_tokens: 0,
                    output_tokens: 0,
                });
                match state.as_str() {
                    "running" => {
                        a.start_ms.get_or_insert(e.t);
                        if let Some(n) = attempt {
                            a.attempts = a.attempts.max(*n);
                        }
                    }
                    "cached" => {
                        a.cached = true;
                        a.start_ms = Some(e.t);
                    }
                    "completed" => {
                        a.status = "completed".into();
                        a.end_ms.get_or_insert(e.t);
                    }
                    "failed" => {
                        a.status = "failed".into();
                        a.error.clone_from(detail);
                        a.end_ms.get_or_insert(e.t);
                    }
                    _ => {}
                }
            }
        }
    }
    for c in &calls {
        if let Some(a) = agents.get_mut(&c.index) {
            a.status = "completed".into();
            a.key.clone_from(&c.key);
            a.input_tokens = c.usage.input_tokens;
            a.output_tokens = c.usage.output_tokens;
        }
    }
    let agents: Vec<AgentReport> = agents.into_values().collect();
    let usage = ReportUsage {
        agents: agents.len() as u64,
        cached: agents.iter().filter(|a| a.cached).count() as u64,
        dispatched: agents
            .iter()
            .filter(|a| !a.cached && a.attempts > 0)
            .count() as u64,
        attempts: agents.iter().map(|a| u64::from(a.attempts)).sum(),
        errors: agents.iter().filter(|a| a.status == "failed").count() as u64,
        input_tokens: agents.iter().map(|a| a.input_tokens).sum(),
        output_tokens: agents.iter().map(|a| a.output_tokens).sum(),
        cost_usd: 0.0,
        duration_ms: events.last().map_or(0, |e| e.t),
    };
    let groups = groups
        .into_iter()
        .map(|title| GroupReport {
            agents: agents
                .iter()
                .filter(|a| a.group == title)
                .map(|a| a.label.clone())
                .collect(),
            title,
        })
        .collect();
    Ok(Report {
        run_id: run.clone(),
        status,
        result: Value::Null,
        error,
        workflow: m.workflow.clone(),
        usage,
        agents,
        groups,
        logs,
        failures,
        script_path: Some(store.display_path(&keys::script(run))),
        parent_run_id: m.parent_run_id.clone(),
        store: Some(store.url.clone()),
    })
}
