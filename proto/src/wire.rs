//! The JSON shapes that cross the wire besides the protocol messages: the run report (what
//! `flotilla run --json` prints, what `result.json` stores, what `flotilla show` reads back and
//! what `Wait` and `Report` answer with), the live view of a run (`Status`, the session
//! page's JSON), a listing's filter, an agent's transcript and a run's changes. Both ends
//! read and write them with serde; nothing else defines them. (A run's settings are in
//! [`crate::settings`].)
//!
//! The report is also the per-agent census (W81): every accepted `agent()` call with its
//! status, attempts and the error that made it `null` or throw.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A workflow's name and description (from its `meta`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkflowInfo {
    pub name: String,
    pub description: String,
}

/// Where a call stands, as the report, the API and the session page spell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CallStatus {
    Queued,
    Running,
    Completed,
    Failed,
    Cancelled,
}

impl CallStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            CallStatus::Queued => "queued",
            CallStatus::Running => "running",
            CallStatus::Completed => "completed",
            CallStatus::Failed => "failed",
            CallStatus::Cancelled => "cancelled",
        }
    }
}

impl std::fmt::Display for CallStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for CallStatus {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// How a run ended (or stands).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    #[default]
    Pending,
    Running,
    /// Paused by a user (W54): nothing new starts until it resumes.
    Paused,
    /// A stop was asked (W55): the script is ended and its agents are being stopped on their
    /// workers; it ends `stopped` once none runs any more.
    Stopping,
    /// The script returned. Agents of it may have failed (their `agent()` resolved `null` or
    /// threw): [`Summary::failed`] counts them, and every view says `completed, N failed`.
    Completed,
    Failed,
    Stopped,
    /// The launch was refused (syntax or `meta` error, bad args, nothing to resume).
    Rejected,
    /// It never ended: the process that drove it is gone (killed, or its machine lost) and
    /// nothing holds it any more. `resume` goes on from its completed calls.
    Interrupted,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Pending => "pending",
            RunStatus::Running => "running",
            RunStatus::Paused => "paused",
            RunStatus::Stopping => "stopping",
            RunStatus::Completed => "completed",
            RunStatus::Failed => "failed",
            RunStatus::Stopped => "stopped",
            RunStatus::Rejected => "rejected",
            RunStatus::Interrupted => "interrupted",
        }
    }

    pub fn is_final(self) -> bool {
        !matches!(
            self,
            RunStatus::Pending | RunStatus::Running | RunStatus::Paused | RunStatus::Stopping
        )
    }
}

/// The exit status of a command that reports a run whose script returned although none of
/// its agents completed and some failed (`completed, N failed`, nothing done): not 0, so a
/// script or CI job notices a run that did nothing, and not 1, which says the run itself
/// failed or was stopped (2 is a refusal, 3 a coordinator that cannot be reached). A run in
/// which some agents completed exits 0 however many failed: a failed agent is a value its
/// script handles (W23), and every view says how many failed.
pub const EXIT_ALL_AGENTS_FAILED: i32 = 4;

/// The exit status of `wait --exit-status` (and `launch --wait --exit-status`) for a run that
/// completed although some of its agents failed, for a CI job that wants every agent to
/// succeed. Without the flag such a run exits 0, as above.
pub const EXIT_SOME_AGENTS_FAILED: i32 = 5;

/// A run's state in brief, as every view of it shows it: `status`, `watch`, `wait`, `agents`,
/// `runs`, `show`, the session pages and their JSON, the MCP tools and `/metrics`. It is made
/// in one place for each source: from the engine while the run runs on this coordinator (the
/// live snapshot), else from the run's report ([`Summary::of_report`]) or its index entry.
/// Each accepted agent is in exactly one of `queued`, `running`, `done`, `failed` and
/// `cancelled`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub status: RunStatus,
    /// Accepted `agent()` calls.
    #[serde(default)]
    pub agents: u64,
    /// Agents that have not started: waiting for a slot, their stagger, a paused run, or a
    /// worker that offers what they ask (`waiting` says which).
    #[serde(default)]
    pub queued: u64,
    #[serde(default)]
    pub running: u64,
    /// Agents that completed (cached ones included).
    #[serde(default)]
    pub done: u64,
    /// Agents whose `agent()` resolved `null` or threw.
    #[serde(default)]
    pub failed: u64,
    /// Agents the run's end or stop cut short (not failures, W55).
    #[serde(default)]
    pub cancelled: u64,
    /// Of `done`, the ones served from the journal of the run it resumes.
    #[serde(default)]
    pub cached: u64,
    /// Why agents wait although the run has room (no attached worker offers what they ask, a
    /// usage limit, a failing store, agents still stopping on their workers), if they do.
    #[serde(default)]
    pub waiting: Option<String>,
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
    #[serde(default)]
    pub cost_usd: f64,
    #[serde(default)]
    pub elapsed_ms: u64,
}

impl Summary {
    /// The summary of a run from its report (final, or live with queued and running agents).
    /// A brief report lists every agent that did not complete first (the ones it leaves out
    /// completed), so its counts hold unless more than [`REPORT_AGENTS`] of them did not.
    pub fn of_report(r: &Report) -> Summary {
        let count = |s: CallStatus| r.agents.iter().filter(|a| a.status == s).count() as u64;
        let (queued, running, cancelled) = (
            count(CallStatus::Queued),
            count(CallStatus::Running),
            count(CallStatus::Cancelled),
        );
        let failed = r.usage.errors;
        let mut waits = r.agents.iter().filter_map(|a| a.waiting.as_deref());
        let waiting = waits
            .next()
            .map(|first| Summary::agents_wait(first, 1 + waits.count() as u64));
        Summary {
            status: r.status,
            agents: r.usage.agents,
            queued,
            running,
            done: count(CallStatus::Completed) + r.agents_omitted,
            failed,
            cancelled,
            cached: r.usage.cached,
            waiting,
            input_tokens: r.usage.input_tokens,
            output_tokens: r.usage.output_tokens,
            cost_usd: r.usage.cost_usd,
            elapsed_ms: r.usage.duration_ms,
        }
    }

    /// The line that says why `n` agents wait, the first of them for `first`.
    pub fn agents_wait(first: &str, n: u64) -> String {
        if n == 1 {
            format!("1 agent waits: {first}")
        } else {
            format!("{n} agents wait: {first}")
        }
    }

    /// Its script returned, but some of its agents failed.
    pub fn completed_with_failures(&self) -> bool {
        self.status == RunStatus::Completed && self.failed > 0
    }

    /// Its script returned, but none of its agents completed and some failed.
    pub fn all_agents_failed(&self) -> bool {
        self.completed_with_failures() && self.done == 0
    }

    /// The status as the views print it: `completed, 2 failed` for a run whose script returned
    /// although agents failed, else the status.
    pub fn headline(&self) -> String {
        if self.completed_with_failures() {
            format!("completed, {} failed", self.failed)
        } else {
            self.status.as_str().to_owned()
        }
    }

    /// The exit status of a command that reports this run once it has ended: 0 completed,
    /// [`EXIT_ALL_AGENTS_FAILED`] completed although every agent it ran failed, 2 refused, 1
    /// failed, stopped or interrupted.
    pub fn exit_code(&self) -> i32 {
        match self.status {
            RunStatus::Completed if self.all_agents_failed() => EXIT_ALL_AGENTS_FAILED,
            RunStatus::Completed => 0,
            RunStatus::Rejected => 2,
            _ => 1,
        }
    }

    /// [`Summary::exit_code`], except that a run that completed with any failed agent exits
    /// [`EXIT_SOME_AGENTS_FAILED`] (all of them failed: still [`EXIT_ALL_AGENTS_FAILED`]).
    pub fn strict_exit_code(&self) -> i32 {
        match self.exit_code() {
            0 if self.completed_with_failures() => EXIT_SOME_AGENTS_FAILED,
            code => code,
        }
    }

    /// Its agents in one phrase: `3/5 agents done · 1 running · 1 queued · 1 failed`.
    pub fn agents_line(&self) -> String {
        let mut line = format!("{}/{} agents done", self.done, self.agents);
        for (n, what) in [
            (self.running, "running"),
            (self.queued, "queued"),
            (self.failed, "failed"),
            (self.cancelled, "cancelled"),
            (self.cached, "cached"),
        ] {
            if n > 0 {
                line.push_str(&format!(" · {n} {what}"));
            }
        }
        line
    }
}

/// The whole report.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Report {
    /// Empty (and left out of the JSON) for a launch that was refused: no run was stored.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run_id: String,
    pub status: RunStatus,
    pub result: Value,
    pub error: Option<String>,
    pub workflow: WorkflowInfo,
    pub usage: ReportUsage,
    pub agents: Vec<AgentReport>,
    pub groups: Vec<GroupReport>,
    pub logs: Vec<String>,
    pub failures: Vec<String>,
    pub script_path: Option<String>,
    #[serde(default)]
    pub parent_run_id: Option<String>,
    #[serde(default)]
    pub store: Option<String>,
    /// What the agents changed in the run's source (fleet runs with a source).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changes: Option<ChangesSummary>,
    /// Agents a brief report leaves out of `agents` ([`Report::brief`]); 0 in a full one.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub agents_omitted: u64,
    /// Advisories about the run as a whole (W42's large workflow).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// The webhook of the run's end (`--notify`), once it was delivered or given up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify: Option<Delivery>,
    /// The namespace the run belongs to (empty: `default`, and runs from before namespaces).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// The questions its script asked with `ask()` (an extension), open or answered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub questions: Vec<Question>,
}

/// `runs/{run}/questions/{id}.json`: a question a run's script asked with `ask()`, as it was
/// first asked (a replay that asks it again keeps its time and deadline).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct QuestionRecord {
    /// `q_` and 12 hex digits of the hash of its key: the same each time the run asks it.
    pub id: String,
    /// Content key: the question, its schema and its occurrence in the run.
    pub key: String,
    pub question: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub label: String,
    /// The JSON Schema an answer must match, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Value>,
    /// RFC 3339.
    pub asked_at: String,
    /// RFC 3339: when it ends unanswered (its `timeout`), if it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
}

/// `runs/{run}/answers/{id}.json`: the answer a question got, written once (the first answer
/// wins); the script sees `value` only once this is stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AnswerRecord {
    /// The question's id and key.
    pub id: String,
    pub key: String,
    /// What `ask()` resolves with: the answer, or `null` when the question timed out.
    pub value: Value,
    /// Who answered (a certificate's or a session's name, `local user NAME`), or `timeout`.
    pub by: String,
    /// RFC 3339.
    pub at: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
    /// The run it was first answered in, when a resume served it from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_in: Option<String>,
}

/// A question with its answer once it has one (what reports, status and pages show).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Question {
    #[serde(flatten)]
    pub asked: QuestionRecord,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<AnswerRecord>,
}

/// How a run's end was delivered to its webhook.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Delivery {
    pub url: String,
    /// The receiver answered 2xx.
    pub delivered: bool,
    pub attempts: u32,
    /// The last HTTP status, if any answer came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Why the last attempt failed, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// RFC 3339 time of the last attempt.
    pub at: String,
}

/// W42: a run of more than this many agents, or more tokens than [`LARGE_TOKENS`], is a large
/// workflow (an advisory: nothing is paused or limited).
pub const LARGE_AGENTS: u64 = 25;
pub const LARGE_TOKENS: u64 = 1_500_000;

impl ReportUsage {
    /// W42's advisory, when these counters make a large workflow.
    pub fn large_workflow(&self) -> Option<String> {
        let tokens = self.input_tokens + self.output_tokens;
        (self.agents > LARGE_AGENTS || tokens > LARGE_TOKENS).then(|| {
            format!(
                "Large workflow: {} agents, {tokens} tokens (more than {LARGE_AGENTS} agents or {LARGE_TOKENS} tokens); follow it on its session page, or list its agents with `flotilla agents RUN`",
                self.agents
            )
        })
    }
}

/// Agents a report lists unless the full one is asked for (`--full`): a run of 100,000
/// agents would otherwise print tens of megabytes of JSON.
pub const REPORT_AGENTS: usize = 1000;

/// A run's changes in brief, with how to bring them home.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChangesSummary {
    /// Agents whose change is in the run head, on their branch only, or in conflict.
    pub merged: u64,
    pub isolated: u64,
    pub conflicted: u64,
    /// Agents whose change was refused (its objects failed the coordinator's checks).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refused: u64,
    /// The run head (the source's commit with the merged changes).
    pub head: String,
    /// The command that brings them into the user's repository.
    pub apply: String,
}

/// Run-wide counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ReportUsage {
    /// Accepted `agent()` calls.
    pub agents: u64,
    /// Calls sent to a backend at least once (not served by resume).
    pub dispatched: u64,
    /// Calls served from the resume source.
    pub cached: u64,
    /// Backend sessions started (restarts included).
    pub attempts: u64,
    /// Calls that resolved `null` or threw.
    pub errors: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(default)]
    pub cost_usd: f64,
    pub duration_ms: u64,
    /// Waits of its agents for throttles (429, 529) and usage limits: not attempts, and not
    /// failures.
    #[serde(default)]
    pub waits: u64,
}

/// One accepted `agent()` call.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AgentReport {
    pub label: String,
    pub group: String,
    /// `completed`, `failed` or `cancelled` (and, in a live report, `queued` or `running`).
    pub status: CallStatus,
    pub attempts: u32,
    pub cached: bool,
    /// When it took a worker slot (served, for a cached call), ms since the run started.
    pub start_ms: Option<u64>,
    /// When its slot was freed, ms since the run started.
    pub end_ms: Option<u64>,
    pub error: Option<String>,
    #[serde(default)]
    pub index: u64,
    #[serde(default)]
    pub key: String,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
    /// The most its attempts' checkouts (or working directories) held, in bytes (0 when no
    /// worker measured it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub disk_bytes: u64,
    /// Why a live agent waits although the run has room (no attached worker offers its
    /// backend and model); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// What its attempts cost, in US dollars (0 when nothing priced them).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub cost_usd: f64,
    /// Its attempts on the timeline, oldest first (at most [`MAX_SEGMENTS`]); read them with
    /// [`AgentReport::attempt_segments`]. A final report leaves out a lone first attempt that
    /// ended as the agent did (its times and status say it) and keeps its `worker`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<AttemptSegment>,
    /// The worker of that lone attempt, when `segments` leaves it out.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub worker: String,
}

impl AgentReport {
    /// Its attempts: `segments`, or the lone attempt a final report leaves out of them.
    pub fn attempt_segments(&self) -> std::borrow::Cow<'_, [AttemptSegment]> {
        match (self.segments.is_empty(), self.start_ms) {
            (true, Some(start_ms)) if !self.worker.is_empty() => {
                std::borrow::Cow::Owned(vec![AttemptSegment {
                    attempt: 1,
                    start_ms,
                    end_ms: self.end_ms,
                    worker: self.worker.clone(),
                    outcome: Some(std::borrow::Cow::Borrowed(self.status.as_str())),
                }])
            }
            _ => std::borrow::Cow::Borrowed(&self.segments),
        }
    }

    /// Sets the agent's attempts from `segments`, leaving out a lone first attempt that
    /// [`AgentReport::attempt_segments`] can tell again from the agent's times and status.
    pub fn set_segments(&mut self, segments: &[AttemptSegment]) {
        match segments {
            [s] if s.attempt == 1
                && Some(s.start_ms) == self.start_ms
                && s.end_ms == self.end_ms
                && s.end_ms.is_some()
                && s.outcome.as_deref() == Some(self.status.as_str()) =>
            {
                self.segments.clear();
                self.worker.clone_from(&s.worker);
            }
            _ => {
                self.segments = segments.to_vec();
                self.worker.clear();
            }
        }
    }
}

/// Segments an agent's timeline keeps: past this, its latest segment stands for the rest.
pub const MAX_SEGMENTS: usize = 40;

/// One attempt of an agent on the run's timeline: when it held a worker, which worker, and
/// how it ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AttemptSegment {
    pub attempt: u32,
    /// When it took the worker's slot, ms since the run started.
    pub start_ms: u64,
    /// When it left it (absent while it runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_ms: Option<u64>,
    #[serde(default)]
    pub worker: String,
    /// How it ended: `completed`, `failed`, `cancelled`, or the retry that ended it
    /// (`retrying`, `stalled`, `restarted`, `interrupted`, `waiting`); absent while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<std::borrow::Cow<'static, str>>,
}

impl AttemptSegment {
    /// Attempt `attempt` took a slot on `worker` at `t`. A segment still open is ended as
    /// `restarted` first; the same attempt met again (taken over after a failover) keeps its
    /// segment and moves to `worker`. Past [`MAX_SEGMENTS`] the latest one is reused.
    pub fn open(segments: &mut Vec<AttemptSegment>, attempt: u32, t: u64, worker: &str) {
        if let Some(last) = segments.last_mut() {
            if last.end_ms.is_none() && last.attempt == attempt {
                if last.worker != worker {
                    worker.clone_into(&mut last.worker);
                }
                return;
            }
            if last.end_ms.is_none() {
                last.end_ms = Some(t);
                last.outcome = Some(std::borrow::Cow::Borrowed("restarted"));
            }
        }
        let seg = AttemptSegment {
            attempt,
            start_ms: t,
            end_ms: None,
            worker: worker.to_owned(),
            outcome: None,
        };
        if segments.len() >= MAX_SEGMENTS {
            if let Some(last) = segments.last_mut() {
                *last = seg;
            }
        } else {
            // Most agents take one attempt: room for one, not the vector's default four.
            segments.reserve_exact(1);
            segments.push(seg);
        }
    }

    /// The open segment, if any, ended at `t` with `outcome`.
    pub fn close(segments: &mut [AttemptSegment], t: u64, outcome: &'static str) {
        if let Some(last) = segments.last_mut()
            && last.end_ms.is_none()
        {
            last.end_ms = Some(t.max(last.start_ms));
            last.outcome = Some(std::borrow::Cow::Borrowed(outcome));
        }
    }
}

/// A progress group, in display order (declared `meta.phases` first).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GroupReport {
    pub title: String,
    pub agents: Vec<String>,
    /// The group's agents a brief report leaves out of `agents`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub agents_omitted: u64,
}

impl Report {
    /// The report of a launch that was refused before anything ran.
    pub fn rejected(run_id: &str, workflow: WorkflowInfo, error: String) -> Report {
        Report {
            run_id: run_id.to_owned(),
            status: RunStatus::Rejected,
            result: Value::Null,
            error: Some(error),
            workflow,
            usage: ReportUsage::default(),
            agents: Vec::new(),
            groups: Vec::new(),
            logs: Vec::new(),
            failures: Vec::new(),
            script_path: None,
            parent_run_id: None,
            store: None,
            changes: None,
            agents_omitted: 0,
            warnings: Vec::new(),
            notify: None,
            namespace: String::new(),
            questions: Vec::new(),
        }
    }

    /// The report with at most `limit` agents listed: every one that did not complete
    /// (failed, cancelled, still running) first, then completed ones, shown in index order;
    /// `agents_omitted` (also per group) counts the rest. Counters, logs and the result are
    /// whole. A report within the limit comes back unchanged.
    pub fn brief(&self, limit: usize) -> Report {
        if self.agents.len() <= limit {
            return self.clone();
        }
        let mut keep: Vec<usize> = (0..self.agents.len())
            .filter(|&i| self.agents[i].status != CallStatus::Completed)
            .take(limit)
            .collect();
        let room = limit - keep.len();
        keep.extend(
            (0..self.agents.len())
                .filter(|&i| self.agents[i].status == CallStatus::Completed)
                .take(room),
        );
        keep.sort_unstable();
        let agents: Vec<AgentReport> = keep.iter().map(|&i| self.agents[i].clone()).collect();
        let groups = self
            .groups
            .iter()
            .map(|g| {
                let listed: Vec<String> = agents
                    .iter()
                    .filter(|a| a.group == g.title)
                    .map(|a| a.label.clone())
                    .collect();
                let total = g.agents.len() as u64 + g.agents_omitted;
                GroupReport {
                    title: g.title.clone(),
                    agents_omitted: total.saturating_sub(listed.len() as u64),
                    agents: listed,
                }
            })
            .collect();
        Report {
            agents_omitted: self.agents_omitted + (self.agents.len() - agents.len()) as u64,
            agents,
            groups,
            run_id: self.run_id.clone(),
            status: self.status,
            result: self.result.clone(),
            error: self.error.clone(),
            workflow: self.workflow.clone(),
            usage: self.usage.clone(),
            logs: self.logs.clone(),
            failures: self.failures.clone(),
            script_path: self.script_path.clone(),
            parent_run_id: self.parent_run_id.clone(),
            store: self.store.clone(),
            changes: self.changes.clone(),
            warnings: self.warnings.clone(),
            notify: self.notify.clone(),
            namespace: self.namespace.clone(),
            questions: self.questions.clone(),
        }
    }
}

fn is_zero_f64(n: &f64) -> bool {
    *n == 0.0
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The parts of a run's live state a client shows: its [`Summary`] (flattened: `status`,
/// `agents`, `queued`, ... at the top level), its logs and its groups.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotView {
    pub run_id: String,
    pub workflow: String,
    #[serde(default)]
    pub description: String,
    #[serde(flatten)]
    pub summary: Summary,
    pub logs: Vec<String>,
    /// Progress by group, in display order.
    pub groups: Vec<GroupView>,
    /// Questions its script asked with `ask()` that wait for an answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub questions: Vec<QuestionRecord>,
}

/// A run's live view in one process: what the engine publishes and the terminal's progress
/// display draws. A client watching a coordinator makes one from each [`SnapshotView`] it
/// reads; the engine's keeps its logs shared and its start time, so `elapsed` grows between
/// publications.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub run_id: String,
    pub workflow: WorkflowInfo,
    /// Status, agents by state, why they wait, tokens, cost and elapsed time as of when it
    /// was published ([`Snapshot::summary_now`] has the elapsed time of now).
    pub summary: Summary,
    pub groups: Vec<GroupView>,
    pub logs: std::sync::Arc<Vec<String>>,
    /// Questions that wait for an answer (`ask()`).
    pub questions: std::sync::Arc<Vec<QuestionRecord>>,
    /// When the run started here (so `elapsed` keeps growing between snapshots).
    pub since: Option<tokio::time::Instant>,
}

impl Snapshot {
    /// Milliseconds since the run started: growing while it runs, fixed once it ended.
    pub fn elapsed_now_ms(&self) -> u64 {
        match self.since {
            Some(since) if !self.summary.status.is_final() => {
                (since.elapsed().as_millis() as u64).max(self.summary.elapsed_ms)
            }
            _ => self.summary.elapsed_ms,
        }
    }

    /// The summary with the elapsed time of now.
    pub fn summary_now(&self) -> Summary {
        Summary {
            elapsed_ms: self.elapsed_now_ms(),
            ..self.summary.clone()
        }
    }
}

impl From<&Snapshot> for SnapshotView {
    fn from(s: &Snapshot) -> Self {
        SnapshotView {
            run_id: s.run_id.clone(),
            workflow: s.workflow.name.clone(),
            description: s.workflow.description.clone(),
            summary: s.summary_now(),
            logs: s.logs.iter().cloned().collect(),
            groups: s.groups.clone(),
            questions: s.questions.as_ref().clone(),
        }
    }
}

/// The live snapshot again (what a watching client's progress display draws).
impl From<&SnapshotView> for Snapshot {
    fn from(v: &SnapshotView) -> Snapshot {
        Snapshot {
            run_id: v.run_id.clone(),
            workflow: WorkflowInfo {
                name: v.workflow.clone(),
                description: v.description.clone(),
            },
            summary: v.summary.clone(),
            groups: v.groups.clone(),
            logs: std::sync::Arc::new(v.logs.clone()),
            questions: std::sync::Arc::new(v.questions.clone()),
            since: None,
        }
    }
}

/// One group's progress.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupView {
    pub title: String,
    pub total: u64,
    pub done: u64,
    pub failed: u64,
    pub running: u64,
    pub output_tokens: u64,
}

impl SnapshotView {
    /// The same view of a run from its report (one that ended, or a live report).
    pub fn from_report(r: &Report) -> SnapshotView {
        let groups = r
            .groups
            .iter()
            .map(|g| {
                let mine = || r.agents.iter().filter(|a| a.group == g.title);
                GroupView {
                    title: g.title.clone(),
                    total: g.agents.len() as u64,
                    done: mine().filter(|a| a.status == CallStatus::Completed).count() as u64,
                    failed: mine().filter(|a| a.status == CallStatus::Failed).count() as u64,
                    running: mine().filter(|a| a.status == CallStatus::Running).count() as u64,
                    output_tokens: mine().map(|a| a.output_tokens).sum(),
                }
            })
            .collect();
        SnapshotView {
            run_id: r.run_id.clone(),
            workflow: r.workflow.name.clone(),
            description: r.workflow.description.clone(),
            summary: Summary::of_report(r),
            logs: r.logs.clone(),
            groups,
            questions: r
                .questions
                .iter()
                .filter(|q| q.answer.is_none())
                .map(|q| q.asked.clone())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(group: &str, status: CallStatus, tokens: u64) -> AgentReport {
        AgentReport {
            label: "a".into(),
            group: group.into(),
            status,
            attempts: 1,
            cached: false,
            start_ms: None,
            end_ms: None,
            error: None,
            index: 0,
            key: String::new(),
            model: String::new(),
            input_tokens: 0,
            output_tokens: tokens,
            disk_bytes: 0,
            waiting: None,
            cost_usd: 0.0,
            segments: Vec::new(),
            worker: String::new(),
        }
    }

    #[test]
    fn a_lone_attempt_that_ended_as_its_agent_did_is_kept_as_its_worker_alone() {
        let mut a = agent("G", CallStatus::Completed, 1);
        (a.start_ms, a.end_ms) = (Some(10), Some(50));
        let mut one = Vec::new();
        AttemptSegment::open(&mut one, 1, 10, "w-1");
        AttemptSegment::close(&mut one, 50, "completed");
        a.set_segments(&one);
        assert!(a.segments.is_empty());
        assert_eq!(a.worker, "w-1");
        assert_eq!(
            a.attempt_segments().as_ref(),
            one.as_slice(),
            "told again exactly"
        );
        let back: AgentReport = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        assert_eq!(back.attempt_segments().as_ref(), one.as_slice());
        // Anything else is kept whole: a retry, a run still going, an end unlike the agent's.
        let mut two = one.clone();
        AttemptSegment::open(&mut two, 2, 60, "w-2");
        AttemptSegment::close(&mut two, 90, "completed");
        a.end_ms = Some(90);
        a.set_segments(&two);
        assert_eq!((a.segments.len(), a.worker.as_str()), (2, ""));
        let mut open = Vec::new();
        AttemptSegment::open(&mut open, 1, 10, "w-1");
        a.end_ms = None;
        a.set_segments(&open);
        assert_eq!(a.attempt_segments().as_ref(), open.as_slice());
        a.status = CallStatus::Failed;
        (a.start_ms, a.end_ms) = (Some(10), Some(50));
        a.set_segments(&one);
        assert_eq!(a.segments, one, "it completed, the agent failed");
    }

    #[test]
    fn a_brief_report_lists_what_did_not_complete_first_and_counts_the_rest() {
        let mut r = Report::rejected("wf_big", WorkflowInfo::default(), "e".into());
        r.status = RunStatus::Failed;
        r.agents = (0..5000u64)
            .map(|i| {
                let status = if i % 1000 == 999 {
                    CallStatus::Failed
                } else {
                    CallStatus::Completed
                };
                let mut a = agent(if i < 2500 { "G" } else { "H" }, status, 1);
                a.index = i;
                a.label = format!("a{i}");
                a
            })
            .collect();
        r.groups = ["G", "H"]
            .iter()
            .map(|g| GroupReport {
                title: (*g).into(),
                agents: r
                    .agents
                    .iter()
                    .filter(|a| a.group == *g)
                    .map(|a| a.label.clone())
                    .collect(),
                agents_omitted: 0,
            })
            .collect();
        let b = r.brief(100);
        assert_eq!(b.agents.len(), 100);
        assert_eq!(b.agents_omitted, 4900);
        for failed in [999, 1999, 2999, 3999, 4999] {
            assert!(b.agents.iter().any(|a| a.index == failed), "{failed}");
        }
        assert!(b.agents.windows(2).all(|w| w[0].index < w[1].index));
        let listed: u64 = b.groups.iter().map(|g| g.agents.len() as u64).sum();
        let omitted: u64 = b.groups.iter().map(|g| g.agents_omitted).sum();
        assert_eq!((listed, listed + omitted), (100, 5000));
        // The JSON says so; a small report is unchanged and says nothing.
        let json = serde_json::to_value(&b).unwrap();
        assert_eq!(json["agents_omitted"], 4900);
        assert_eq!(r.brief(5000), r);
        assert!(
            serde_json::to_value(&r)
                .unwrap()
                .get("agents_omitted")
                .is_none()
        );
        assert_eq!(b.brief(100), b, "brief twice is brief once");
    }

    #[test]
    fn a_finished_run_s_view_counts_its_groups_from_its_agents() {
        let mut r = Report::rejected("wf_x", WorkflowInfo::default(), "e".into());
        r.status = RunStatus::Completed;
        r.agents = vec![
            agent("G", CallStatus::Completed, 3),
            agent("G", CallStatus::Failed, 4),
            agent("H", CallStatus::Completed, 5),
        ];
        r.groups = vec![
            GroupReport {
                title: "G".into(),
                agents: vec!["a".into(), "a".into()],
                agents_omitted: 0,
            },
            GroupReport {
                title: "H".into(),
                agents: vec!["a".into()],
                agents_omitted: 0,
            },
        ];
        let v = SnapshotView::from_report(&r);
        assert_eq!(v.summary.done, 2);
        assert_eq!(
            v.groups[0],
            GroupView {
                title: "G".into(),
                total: 2,
                done: 1,
                failed: 1,
                running: 0,
                output_tokens: 7
            }
        );
        let back: SnapshotView = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn a_summary_counts_each_agent_once_and_says_completed_with_failures_apart() {
        let mut r = Report::rejected("wf_x", WorkflowInfo::default(), "e".into());
        r.status = RunStatus::Running;
        r.agents = vec![
            agent("G", CallStatus::Completed, 1),
            agent("G", CallStatus::Running, 2),
            agent("G", CallStatus::Queued, 0),
            agent("G", CallStatus::Failed, 0),
            agent("G", CallStatus::Cancelled, 0),
        ];
        r.agents[2].waiting = Some("no attached worker offers backend \"x\"".into());
        r.usage.agents = 5;
        r.usage.errors = 1;
        r.usage.cost_usd = 0.25;
        let s = Summary::of_report(&r);
        assert_eq!(
            (s.agents, s.queued, s.running, s.done, s.failed, s.cancelled),
            (5, 1, 1, 1, 1, 1)
        );
        assert_eq!(
            s.waiting.as_deref(),
            Some("1 agent waits: no attached worker offers backend \"x\"")
        );
        assert_eq!(s.headline(), "running");
        assert_eq!(
            s.agents_line(),
            "1/5 agents done · 1 running · 1 queued · 1 failed · 1 cancelled"
        );
        // Ended: the script returned, one agent failed and one completed. Every view says
        // so, and the run succeeded: its script handled the failure.
        r.status = RunStatus::Completed;
        let s = Summary::of_report(&r);
        assert!(s.completed_with_failures() && !s.all_agents_failed());
        assert_eq!(s.headline(), "completed, 1 failed");
        assert_eq!(s.exit_code(), 0);
        assert_eq!(
            s.strict_exit_code(),
            EXIT_SOME_AGENTS_FAILED,
            "wait --exit-status"
        );
        // None completed: the run did nothing, and says so in its exit status too.
        r.agents[0].status = CallStatus::Failed;
        r.usage.errors = 2;
        let s = Summary::of_report(&r);
        assert!(s.all_agents_failed());
        assert_eq!(s.headline(), "completed, 2 failed");
        assert_eq!(s.exit_code(), EXIT_ALL_AGENTS_FAILED);
        assert_eq!(s.strict_exit_code(), EXIT_ALL_AGENTS_FAILED);
        r.agents[0].status = CallStatus::Completed;
        r.usage.errors = 0;
        assert_eq!(Summary::of_report(&r).exit_code(), 0);
        for (status, code) in [
            (RunStatus::Failed, 1),
            (RunStatus::Stopped, 1),
            (RunStatus::Interrupted, 1),
            (RunStatus::Rejected, 2),
        ] {
            r.status = status;
            r.usage.errors = 3;
            let s = Summary::of_report(&r);
            assert_eq!(
                (s.exit_code(), s.headline()),
                (code, status.as_str().into())
            );
        }
        // A brief report: the agents it leaves out completed.
        r.status = RunStatus::Completed;
        r.usage.errors = 1;
        r.agents_omitted = 7;
        r.usage.agents = 12;
        assert_eq!(Summary::of_report(&r).done, 8);
        // Flattened into the live view, the JSON keys are the summary's.
        let v = serde_json::to_value(SnapshotView::from_report(&r)).unwrap();
        assert_eq!(v["status"], "completed");
        assert_eq!(v["failed"], 1);
        assert_eq!(v["cost_usd"], 0.25);
    }

    #[test]
    fn statuses_are_spelled_one_way() {
        assert_eq!(
            serde_json::to_string(&CallStatus::Cancelled).unwrap(),
            "\"cancelled\""
        );
        assert_eq!(
            serde_json::to_string(&RunStatus::Interrupted).unwrap(),
            "\"interrupted\""
        );
        assert!(RunStatus::Stopped.is_final() && !RunStatus::Paused.is_final());
        assert!(!RunStatus::Stopping.is_final());
        assert_eq!(
            serde_json::to_string(&RunStatus::Stopping).unwrap(),
            "\"stopping\""
        );
    }
}

/// One agent's transcript as `flotilla logs` prints it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentTranscript {
    pub index: u64,
    pub label: String,
    /// The attempt shown, and how many the agent had.
    pub attempt: u32,
    pub attempts: u32,
    /// Served from an earlier run: no transcript here.
    pub cached: bool,
    pub events: Vec<Value>,
}

/// What a call changed in its run's source, as journaled with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeRecord {
    /// The agent's commit, and the head it started from.
    pub commit: String,
    pub base: String,
    pub files: Vec<String>,
    pub insertions: u32,
    pub deletions: u32,
    /// The run head once this change was applied (`None`: it is not in the head).
    #[serde(default)]
    pub head_after: Option<String>,
    /// Files that conflicted with the head (the change stays on its own branch).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conflicts: Vec<String>,
    /// An isolated agent's change: on its branch only.
    #[serde(default)]
    pub isolated: bool,
    /// Why the change was refused (its objects failed the checks of the coordinator's `vet`): it is
    /// nowhere, neither in the head nor on a branch; the call's result stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

/// A run's changes, as `flotilla changes` and `flotilla apply` read them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunChanges {
    pub run_id: String,
    /// The run's namespace, whose sources hold its objects (`FetchSource` asks there).
    #[serde(default)]
    pub namespace: String,
    pub source: Option<crate::settings::SourceRef>,
    /// The run head now: the source's commit with every merged change in.
    pub head: Option<String>,
    pub changes: Vec<AgentChange>,
}

/// One agent's change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentChange {
    pub index: u64,
    pub label: String,
    #[serde(flatten)]
    pub change: ChangeRecord,
}

/// Which runs a listing wants, and where its page starts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Filter {
    /// Runs of this workflow (its `meta.name`).
    pub workflow: Option<String>,
    /// Runs in this status (`running`, `paused`, `stopping`, `completed`, `failed`, `stopped`,
    /// `interrupted`, ...), as a listing shows them (live ones as their engine has them).
    pub status: Option<RunStatus>,
    /// Runs created at or after this time (seconds since the epoch).
    pub since_unix: Option<u64>,
    /// Runs created before this time (seconds since the epoch).
    pub before_unix: Option<u64>,
    /// Runs that carry every one of these labels.
    pub labels: BTreeMap<String, String>,
    /// Runs of this namespace.
    pub namespace: Option<String>,
    /// Only runs of these namespaces: the caller's, set by the server (never read from a
    /// request, so a client cannot widen it).
    #[serde(skip)]
    pub within: Option<Vec<String>>,
    /// The most runs a page holds [default 100, at most 1000].
    pub limit: Option<usize>,
    /// Where the page starts: the `next` of the page before.
    pub after: Option<String>,
}

/// What the index knows of a run (also a row of `flotilla runs`): its [`Summary`] (flattened:
/// `status`, `agents`, `failed`, ... at the top level) as of its start or its end, or as its
/// engine has it now in a listing by the coordinator that runs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    pub run_id: String,
    #[serde(flatten)]
    pub summary: Summary,
    pub workflow: String,
    /// RFC 3339, seconds.
    pub created: String,
    /// When it ended (RFC 3339), if it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_run_id: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Its namespace (empty in entries from before namespaces: `default`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
}

impl RunSummary {
    pub fn status(&self) -> RunStatus {
        self.summary.status
    }
}
