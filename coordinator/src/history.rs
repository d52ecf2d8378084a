//! Reading stored runs back: the list of runs, and the report of one run.
//!
//! A finished run has `result.json`. A run whose process died has only its manifest, events
//! and journal; its report is rebuilt from those (status as last recorded, agents from call
//! events, completed ones from the journal), so nothing stored is ever hidden.

use crate::call::{Mark, Status};
use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::report::{AgentReport, AttemptSegment, GroupReport, Report, ReportUsage, RunStatus};
use crate::store::journal::{read_calls, read_calls_checked, read_events};
use crate::store::records::{CallRecord, Manifest, RunEvent};
use crate::store::{Error, Store, keys};

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

/// The namespace of a stored run (`None`: there is no such run).
pub async fn namespace_of(store: &Store, run: &str) -> Result<Option<String>, Error> {
    match manifest(store, run).await {
        Ok(m) => Ok(Some(
            crate::namespace::effective(&m.settings.namespace).to_owned(),
        )),
        Err(Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The report of a stored run: the one it stored when it ended, else one rebuilt from its
/// events and journal, in which an agent is queued or running as its last event says while
/// the run goes on, and cancelled once the run has ended.
pub async fn load_report(store: &Store, run: &str) -> Result<Report, Error> {
    let m = manifest(store, run).await?;
    let mut notes = Vec::new();
    if let Some(body) = store.get(&keys::result(run)).await? {
        match serde_json::from_slice::<Report>(&body) {
            Ok(mut r) => {
                if r.namespace.is_empty() {
                    r.namespace = crate::namespace::effective(&m.settings.namespace).to_owned();
                }
                if m.settings.notify.is_some() {
                    r.notify = crate::notify::stored(store, run).await;
                }
                return Ok(r);
            }
            // A damaged report hides nothing: the events and the journal say the same.
            Err(e) => notes.push(format!(
                "[history] {} is unreadable ({e}); this report was rebuilt from the run's events and journal",
                keys::result(run)
            )),
        }
    }
    let mut report = rebuild(store, &m).await?;
    report.logs.splice(0..0, notes);
    // No report was stored: a run still marked running whose driver is gone never ends.
    if !report.status.is_final()
        && let Some((_, _, live)) = crate::owner::current(store, run).await?
        && live != crate::owner::Liveness::Live
    {
        report.status = RunStatus::Interrupted;
        report.error.get_or_insert_with(|| {
            format!(
                "the process that ran it is gone and it never finished; `flotilla run SCRIPT --resume {run}` (or `flotilla resume {run}` on a fleet) goes on from its completed calls"
            )
        });
    }
    // Of a run that has ended, an agent its events leave queued or running was cut short.
    if report.status.is_final() {
        for a in &mut report.agents {
            if matches!(a.status, Status::Queued | Status::Running) {
                a.status = Status::Cancelled;
            }
        }
    }
    Ok(report)
}

async fn rebuild(store: &Store, m: &Manifest) -> Result<Report, Error> {
    let run = &m.run_id;
    let events = read_events(store, run).await?;
    let read = read_calls_checked(store, run).await?;
    let skipped = read.summary();
    let calls = read.calls;
    let mut r = Replayed {
        status: RunStatus::Running,
        logs: skipped
            .map(|s| format!("[history] {s}"))
            .into_iter()
            .collect(),
        ..Replayed::default()
    };
    for e in &events {
        r.apply(e);
    }
    // The journal is the truth for completed calls, events or not (events are batched and
    // may never have been written).
    for c in &calls {
        let a = r.agents.entry(c.index).or_insert_with(|| {
            let mut a = new_agent(c.index, &c.label, &c.group, Status::Completed);
            a.attempts = c.attempts;
            a.cached = c.cached_from.is_some();
            a
        });
        a.status = Status::Completed;
        a.key.clone_from(&c.key);
        a.attempts = a.attempts.max(c.attempts);
        a.input_tokens = c.usage.input_tokens;
        a.output_tokens = c.usage.output_tokens;
        if !r.groups.contains(&c.group) {
            r.groups.push(c.group.clone());
        }
    }
    let agents: Vec<AgentReport> = r.agents.into_values().collect();
    let usage = ReportUsage {
        agents: agents.len() as u64,
        cached: agents.iter().filter(|a| a.cached).count() as u64,
        dispatched: agents
            .iter()
            .filter(|a| !a.cached && a.attempts > 0)
            .count() as u64,
        attempts: agents.iter().map(|a| u64::from(a.attempts)).sum(),
        errors: agents.iter().filter(|a| a.status == Status::Failed).count() as u64,
        input_tokens: agents.iter().map(|a| a.input_tokens).sum(),
        output_tokens: agents.iter().map(|a| a.output_tokens).sum(),
        cost_usd: 0.0,
        duration_ms: events.last().map_or(0, |e| e.t),
        // Waits are not events of their own: a report rebuilt from events does not know them.
        waits: 0,
    };
    let groups = r
        .groups
        .into_iter()
        .map(|title| GroupReport {
            agents: agents
                .iter()
                .filter(|a| a.group == title)
                .map(|a| a.label.clone())
                .collect(),
            title,
            agents_omitted: 0,
        })
        .collect();
    Ok(Report {
        run_id: run.clone(),
        status: r.status,
        result: Value::Null,
        error: r.error,
        workflow: m.workflow.clone(),
        warnings: usage.large_workflow().into_iter().collect(),
        notify: None,
        namespace: m.settings.namespace.clone(),
        usage,
        agents,
        groups,
        logs: r.logs,
        failures: r.failures,
        script_path: Some(store.display_path(&keys::script(run))),
        parent_run_id: m.parent_run_id.clone(),
        store: Some(store.url.clone()),
        agents_omitted: 0,
        changes: m
            .settings
            .source
            .as_ref()
            .map(|src| changes_summary(run, &src.commit, &calls)),
        // What it asks (`ask()`) is in the store, answered or not.
        questions: crate::run::ask::stored_questions(store, run)
            .await
            .unwrap_or_default(),
    })
}

/// What a run's event log says, replayed in order.
#[derive(Default)]
struct Replayed {
    status: RunStatus,
    error: Option<String>,
    groups: Vec<String>,
    logs: Vec<String>,
    failures: Vec<String>,
    agents: BTreeMap<u64, AgentReport>,
}

impl Replayed {
    fn apply(&mut self, e: &crate::store::records::EventRecord) {
        match &e.event {
            RunEvent::Status { status, error } => {
                self.status = match status.as_str() {
                    "completed" => RunStatus::Completed,
                    "failed" => RunStatus::Failed,
                    "stopped" => RunStatus::Stopped,
                    "paused" => RunStatus::Paused,
                    "stopping" => RunStatus::Stopping,
                    _ => RunStatus::Running,
                };
                self.error.clone_from(error);
            }
            RunEvent::Group { title } => {
                if !self.groups.contains(title) {
                    self.groups.push(title.clone());
                }
            }
            RunEvent::Log { line } => self.logs.push(line.clone()),
            RunEvent::Failure { line } => self.failures.push(line.clone()),
            RunEvent::Prompt { .. } | RunEvent::Notified { .. } => {}
            RunEvent::Call {
                index,
                label,
                group,
                state,
                attempt,
                detail,
            } => {
                let a = self
                    .agents
                    .entry(*index)
                    .or_insert_with(|| new_agent(*index, label, group, Status::Queued));
                marked(a, *state, e.t, *attempt, detail);
            }
        }
    }
}

/// An agent the report has not met yet.
fn new_agent(index: u64, label: &str, group: &str, status: Status) -> AgentReport {
    AgentReport {
        label: label.to_owned(),
        group: group.to_owned(),
        status,
        attempts: 0,
        cached: false,
        start_ms: None,
        end_ms: None,
        error: None,
        index,
        key: String::new(),
        model: String::new(),
        input_tokens: 0,
        output_tokens: 0,
        disk_bytes: 0,
        waiting: None,
        cost_usd: 0.0,
        segments: Vec::new(),
        worker: String::new(),
    }
}

/// Agent `a` after mark `state` at `t`: until it ends, an agent is where its last mark left
/// it.
fn marked(a: &mut AgentReport, state: Mark, t: u64, attempt: Option<u32>, detail: &Option<String>) {
    let live = matches!(a.status, Status::Queued | Status::Running);
    match state {
        Mark::Running => {
            a.start_ms.get_or_insert(t);
            if let Some(n) = attempt {
                a.attempts = a.attempts.max(n);
            }
            if live {
                let worker = detail.as_deref().unwrap_or("");
                AttemptSegment::open(&mut a.segments, attempt.unwrap_or(a.attempts), t, worker);
            }
            if live {
                a.status = Status::Running;
            }
        }
        Mark::Cached => {
            a.cached = true;
            a.start_ms = Some(t);
        }
        Mark::Queued
        | Mark::Stalled
        | Mark::Waiting
        | Mark::Retrying
        | Mark::Restarted
        | Mark::Interrupted
            if live =>
        {
            a.status = Status::Queued;
            AttemptSegment::close(&mut a.segments, t, state.as_str());
        }
        Mark::Completed => {
            a.status = Status::Completed;
            a.end_ms.get_or_insert(t);
            AttemptSegment::close(&mut a.segments, t, "completed");
        }
        Mark::Failed => {
            a.status = Status::Failed;
            a.error.clone_from(detail);
            a.end_ms.get_or_insert(t);
            AttemptSegment::close(&mut a.segments, t, "failed");
        }
        Mark::Cancelled if live => {
            a.status = Status::Cancelled;
            a.end_ms.get_or_insert(t);
            AttemptSegment::close(&mut a.segments, t, "cancelled");
        }
        _ => {}
    }
}

/// What a run's journaled changes add up to, over its source's `commit`.
fn changes_summary(run: &str, commit: &str, calls: &[CallRecord]) -> crate::report::ChangesSummary {
    let records: Vec<&crate::head::ChangeRecord> =
        calls.iter().filter_map(|c| c.change.as_ref()).collect();
    crate::report::ChangesSummary {
        merged: records.iter().filter(|r| r.head_after.is_some()).count() as u64,
        isolated: records.iter().filter(|r| r.isolated).count() as u64,
        conflicted: records.iter().filter(|r| !r.conflicts.is_empty()).count() as u64,
        refused: records.iter().filter(|r| r.refused.is_some()).count() as u64,
        head: records
            .iter()
            .rev()
            .find_map(|r| r.head_after.clone())
            .unwrap_or_else(|| commit.to_owned()),
        apply: format!("flotilla apply {run}"),
    }
}

/// What the session page shows of one agent: its prompt, its result and the transcript of
/// each attempt, all read from storage (so a live run and a reopened one look the same).
#[derive(Debug, Clone, Serialize)]
pub struct AgentDetail {
    pub index: u64,
    pub prompt: Option<String>,
    /// The value handed to the script, once the call has completed.
    pub result: Option<Value>,
    /// `(attempt, events)` for every attempt with a stored transcript.
    pub attempts: Vec<(u32, Vec<Value>)>,
    /// What it changed in the run's source.
    pub change: Option<crate::head::ChangeRecord>,
}

/// Reads one agent's detail; `attempts` is how many attempts the run reported for it.
pub async fn agent_detail(
    store: &Store,
    run: &str,
    index: u64,
    attempts: u32,
) -> Result<AgentDetail, Error> {
    let prompt_in = |events: Vec<crate::store::records::EventRecord>, index: u64| {
        events.into_iter().find_map(|e| match e.event {
            RunEvent::Prompt { index: i, prompt } if i == index => Some(prompt),
            _ => None,
        })
    };
    let mut prompt = prompt_in(read_events(store, run).await?, index);
    let mut result = None;
    let mut change = None;
    if let Some(c) = read_calls(store, run)
        .await?
        .into_iter()
        .find(|c| c.index == index)
    {
        // A call served from an earlier run: its prompt is recorded there, under the same key.
        if prompt.is_none()
            && let Some(from) = &c.cached_from
            && let Some(there) = read_calls(store, from)
                .await?
                .into_iter()
                .find(|p| p.key == c.key)
        {
            prompt = prompt_in(read_events(store, from).await?, there.index);
        }
        change = c.change;
        result = match (c.result, c.payload) {
            (Some(v), _) => Some(v.value()),
            (None, Some(sha)) => match store.get(&keys::payload(&sha)).await? {
                Some(body) => serde_json::from_slice(&body).ok(),
                None => None,
            },
            (None, None) => None,
        };
    }
    let mut out = Vec::new();
    for n in 1..=attempts {
        let events = crate::store::journal::read_transcript(store, run, index, n).await?;
        if !events.is_empty() {
            out.push((n, events));
        }
    }
    Ok(AgentDetail {
        index,
        prompt,
        result,
        attempts: out,
        change,
    })
}

/// One transcript event as a line of text (`flotilla logs` and the session page): text,
/// thinking, tool calls with their input, tool results, permission answers, the result.
pub fn transcript_line(e: &Value) -> String {
    let s = |k: &str| {
        e.get(k).map_or_else(String::new, |v| match v {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        })
    };
    let cut = |t: String| -> String {
        if t.chars().count() > 400 {
            format!("{}…", t.chars().take(400).collect::<String>())
        } else {
            t
        }
    };
    match e.get("type").and_then(Value::as_str).unwrap_or("") {
        "text" | "assistant_text" => format!("  text: {}", cut(s("text"))),
        "thinking" => format!("  thinking: {}", cut(s("text"))),
        "tool_call" => format!("  tool {}: {}", s("name"), cut(s("input"))),
        "tool_result" => format!("  result: {}", cut(s("output"))),
        "permission" => format!(
            "  permission {}: {}",
            s("tool"),
            if e["allowed"] == true {
                "allowed"
            } else {
                "denied"
            }
        ),
        "permission_denied" => format!("  permission {}: denied", s("tool")),
        "retry" => format!("  retry: {}", cut(s("reason"))),
        "worktree" => format!("  worktree {} {}", s("path"), s("branch")),
        "result" => format!("  done (error: {}): {}", s("is_error"), cut(s("result"))),
        _ => format!("  {}", cut(e.to_string())),
    }
}

pub use flotilla_proto::wire::AgentTranscript;

/// Why transcripts cannot be shown.
#[derive(Debug)]
pub enum TranscriptError {
    /// No agent of that index or label (the caller's mistake).
    NoAgent(String),
    Store(Error),
}

/// The transcripts of a run's agents: all of them, or the one named by index or label (every
/// agent with that label); the last attempt unless `attempt` says which.
pub async fn transcripts(
    store: &Store,
    report: &Report,
    agent: Option<&str>,
    attempt: Option<u32>,
) -> Result<Vec<AgentTranscript>, TranscriptError> {
    let picked: Vec<_> = match agent {
        None => report.agents.iter().collect(),
        Some(a) => {
            let by_index = a.parse::<u64>().ok();
            let found: Vec<_> = report
                .agents
                .iter()
                .filter(|x| Some(x.index) == by_index || x.label == a)
                .collect();
            if found.is_empty() {
                return Err(TranscriptError::NoAgent(format!(
                    "no agent {a:?} in run {run}; `flotilla show {run}` lists them",
                    run = report.run_id
                )));
            }
            found
        }
    };
    let mut out = Vec::with_capacity(picked.len());
    for a in picked {
        let n = attempt.unwrap_or(a.attempts.max(1));
        let events = if a.cached {
            Vec::new()
        } else {
            crate::store::journal::read_transcript(store, &report.run_id, a.index, n)
                .await
                .map_err(TranscriptError::Store)?
        };
        out.push(AgentTranscript {
            index: a.index,
            label: a.label.clone(),
            attempt: n,
            attempts: a.attempts,
            cached: a.cached,
            events,
        });
    }
    Ok(out)
}
