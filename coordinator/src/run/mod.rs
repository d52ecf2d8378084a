//! The run engine: one actor per run that owns its state.
//!
//! It takes [`ScriptOp`]s from the script thread (or from a benchmark driver), turns each
//! `agent()` into a call — checking the agent cap, options, schema (W15) and budget, computing
//! the call key, serving it from the resume source when it can — and submits the rest to the
//! dispatcher. It follows every call through [`CallEvent`]s, journals completed results and
//! settles the script's promises.
//!
//! Invariants:
//! - a result reaches the script only after the journal segment holding it is durable;
//! - every accepted call ends `completed`, `failed` or `cancelled` in the report;
//! - the report counts `agents = dispatched + cached + (calls rejected before dispatch)`.
//!
//! Start at [`RunEngine::run`].

pub mod resume;

use crate::reject::RejectCode;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::report::{AgentReport, GroupReport, Report, ReportUsage, RunStatus};
use crate::sched::{
    CallEvent, CallFailure, CallResult, DispatchHandle, Retry, RunRegistration, Ticket,
};
use crate::script::{self, HostError, HostReply, ScriptEnd, ScriptOp, ScriptShared, source};
use crate::settings::{ReplayMode, RunSettings};
use crate::spec::{CallSpec, call_key};
use crate::store::journal::{EventLog, Journal, JournalAck, TranscriptLine, TranscriptLog};
use crate::store::records::{CallRecord, EventRecord, RunEvent, UsageRecord, WorkflowInfo};
use crate::store::{Store, keys};
use crate::workflows::{WorkflowRef, WorkflowResolver};
use resume::ResumeSource;

/// How often the live snapshot is refreshed while something changes.
const SNAPSHOT_EVERY: Duration = Duration::from_millis(100);
/// How long a stopped run waits for its script thread before it finishes anyway.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Requests from outside the run.
#[derive(Debug)]
pub enum Control {
    /// Stop the whole run (W55): nothing counts as failed, pending promises never settle.
    Stop,
    /// Pause (W54): interrupt running agents, start nothing new; or resume.
    Pause(bool),
    /// Act on one agent, named by its index or label; the reply says what happened.
    Agent {
        action: AgentAction,
        agent: String,
        reply: oneshot::Sender<Result<String, String>>,
    },
    /// The report as it stands now, with live states (`queued`, `running`) for calls that
    /// have not ended (the session page).
    Report(oneshot::Sender<Report>),
}

/// What to do to one agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentAction {
    /// W55: its `agent()` resolves `null`, and it counts as failed.
    Stop,
    /// W56: abandon the running attempt and start a new one.
    Restart,
}

/// Live view of a run for progress displays.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub run_id: String,
    pub workflow: WorkflowInfo,
    pub status: Option<RunStatus>,
    pub elapsed_ms: u64,
    pub groups: Vec<GroupProgress>,
    pub logs: Arc<Vec<String>>,
    pub agents: u64,
    pub done: u64,
    pub failed: u64,
    pub running: u64,
    pub cached: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// A wait in progress, if any: a usage limit, or agents no attached worker can run.
    pub waiting: Option<String>,
    /// When the run started here (so `elapsed` keeps growing between snapshots).
    pub since: Option<Instant>,
}

impl Snapshot {
    /// Milliseconds since the run started: growing while it runs, fixed once it ended.
    pub fn elapsed_now_ms(&self) -> u64 {
        match (self.since, self.status) {
            (Some(since), Some(s)) if !s.is_final() => {
                (since.elapsed().as_millis() as u64).max(self.elapsed_ms)
            }
            _ => self.elapsed_ms,
        }
    }
}

/// Progress of one group.
#[derive(Debug, Clone, Default)]
pub struct GroupProgress {
    pub title: String,
    pub total: u64,
    pub done: u64,
    pub failed: u64,
    pub running: u64,
    pub output_tokens: u64,
}

/// Handle of a launched run.
#[derive(Debug)]
pub struct RunHandle {
    pub run_id: String,
    pub snapshot: watch::Receiver<Arc<Snapshot>>,
    control: mpsc::UnboundedSender<Control>,
    report: oneshot::Receiver<Report>,
}

impl RunHandle {
    pub fn stop(&self) {
        let _ = self.control.send(Control::Stop);
    }

    /// A sender that can stop the run from elsewhere.
    pub fn stopper(&self) -> mpsc::UnboundedSender<Control> {
        self.control.clone()
    }

    /// Waits for the run to end.
    pub async fn wait(self) -> Report {
        match self.report.await {
            Ok(r) => r,
            Err(_) => Report::rejected(
                &self.run_id,
                WorkflowInfo::default(),
                "the run engine ended without a report (a bug)".into(),
            ),
        }
    }
}

/// Where replies to the script go.
pub type ReplySink = Box<dyn Fn(HostReply) + Send>;

/// Everything a run engine starts from.
pub struct EngineInit {
    pub run_id: String,
    pub workflow: WorkflowInfo,
    pub phases: Vec<String>,
    pub settings: RunSettings,
    pub store: Store,
    pub generation: u64,
    pub dispatch: DispatchHandle,
    pub resolver: Arc<dyn WorkflowResolver>,
    pub resume: Option<ResumeSource>,
    pub shared: Arc<ScriptShared>,
    pub script_path: Option<String>,
    pub parent_run_id: Option<String>,
    /// Write `result.json` at the end (off for benchmarks).
    pub write_result: bool,
    /// Owner records this run holds (itself, and the run it resumes), let go once its report
    /// is stored.
    pub owners: Vec<crate::owner::Held>,
    /// Where the coordinator merges agents' changes into the run head (a git cache).
    pub cache_dir: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Queued,
    Running,
    /// Completed by the backend (or served by resume), waiting for the journal.
    Journaling,
    Completed,
    Failed,
    Cancelled,
}

struct Call {
    script_id: u64,
    key: String,
    label: String,
    group: String,
    model: String,
    status: Status,
    cached: bool,
    cached_from: Option<String>,
    attempts: u32,
    start_ms: Option<u64>,
    end_ms: Option<u64>,
    error: Option<String>,
    usage: UsageRecord,
    live_tokens: u64,
    /// The most its attempts' checkouts held.
    disk_bytes: u64,
    worker: Option<Arc<str>>,
    result: Option<Value>,
    /// Why it waits although the run has room: no attached worker offers its backend.
    waiting_for: Option<String>,
    /// `isolation: 'worktree'`: its change stays on its branch, out of the head.
    isolated: bool,
    /// What it changed in the run's source, once applied to the head.
    change: Option<crate::head::ChangeRecord>,
    /// Served from this run's own journal (adopted): applied to the head, not journaled again.
    own_journal: bool,
    /// The call's trace span (`agent`), open until the call ends.
    span: tracing::Span,
}

/// The engine of one run.
pub struct RunEngine {
    init: EngineInit,
    run: Arc<str>,
    started: Instant,
    reply: ReplySink,
    calls: Vec<Call>,
    occurrences: HashMap<String, u32>,
    prefix_intact: bool,
    groups: Vec<String>,
    /// Position of each group title in `groups`.
    group_index: HashMap<String, usize>,
    logs: Vec<String>,
    /// The logs as last published (cloned only when they change).
    published_logs: Arc<Vec<String>>,
    failures: Vec<String>,
    usage: UsageRecord,
    attempts_total: u64,
    schema_checks: HashMap<String, Result<(), String>>,
    agent_types: Option<Vec<crate::workflows::AgentType>>,
    journal: Option<Journal>,
    journal_task: Option<tokio::task::JoinHandle<()>>,
    events: EventLog,
    status: RunStatus,
    error: Option<String>,
    result: Value,
    stopping: bool,
    /// The money ceiling was crossed.
    money_spent: bool,
    waiting: Option<String>,
    /// Storage writes were failing when the snapshot was last published.
    storage_failing: bool,
    /// The run head's keeper (fleet runs with a snapshot source).
    head: Option<mpsc::UnboundedSender<crate::head::Apply>>,
    head_watch: Option<watch::Receiver<String>>,
    /// Reasons for waiting already logged (each once).
    waits_logged: std::collections::HashSet<String>,
    snapshot: watch::Sender<Arc<Snapshot>>,
    dirty: bool,
    transcripts: TranscriptLog,
    /// Trace spans: the run, and one per phase (group) under it.
    span: tracing::Span,
    phase_spans: HashMap<String, tracing::Span>,
}

/// Starts a run engine. Script ops come in on `ops`; replies go out through `reply`.
pub fn start(
    init: EngineInit,
    ops: mpsc::UnboundedReceiver<ScriptOp>,
    reply: ReplySink,
) -> RunHandle {
    let run_id = init.run_id.clone();
    let (snap_tx, snap_rx) = watch::channel(Arc::new(Snapshot {
        run_id: run_id.clone(),
        workflow: init.workflow.clone(),
        status: Some(RunStatus::Running),
        ..Snapshot::default()
    }));
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let (report_tx, report_rx) = oneshot::channel();
    let engine = RunEngine::new(init, reply, snap_tx);
    tokio::spawn(async move {
        let report = engine.run(ops, control_rx).await;
        let _ = report_tx.send(report);
    });
    RunHandle {
        run_id,
        snapshot: snap_rx,
        control: control_tx,
        report: report_rx,
    }
}

impl RunEngine {
    fn new(init: EngineInit, reply: ReplySink, snapshot: watch::Sender<Arc<Snapshot>>) -> Self {
        let run: Arc<str> = Arc::from(init.run_id.as_str());
        let events = EventLog::spawn(init.store.clone(), init.run_id.clone(), init.generation);
        let mut groups: Vec<String> = Vec::new();
        let mut group_index = HashMap::new();
        for p in &init.phases {
            if !group_index.contains_key(p) {
                group_index.insert(p.clone(), groups.len());
                groups.push(p.clone());
            }
        }
        let span = tracing::info_span!(
            "run",
            workflow.run_id = %init.run_id,
            workflow.name = %init.workflow.name,
            generation = init.generation,
        );
        RunEngine {
            span,
            phase_spans: HashMap::new(),
            run,
            started: Instant::now(),
            reply,
            calls: Vec::new(),
            occurrences: HashMap::new(),
            prefix_intact: true,
            groups,
            group_index,
            logs: Vec::new(),
            published_logs: Arc::new(Vec::new()),
            failures: Vec::new(),
            usage: UsageRecord::default(),
            attempts_total: 0,
            schema_checks: HashMap::new(),
            agent_types: None,
            journal: None,
            journal_task: None,
            events,
            status: RunStatus::Running,
            error: None,
            result: Value::Null,
            stopping: false,
            money_spent: false,
            waiting: None,
            waits_logged: std::collections::HashSet::new(),
            storage_failing: false,
            head: None,
            head_watch: None,
            snapshot,
            dirty: true,
            transcripts: TranscriptLog::spawn(
                init.store.clone(),
                init.run_id.clone(),
                init.generation,
            ),
            init,
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn event(&mut self, event: RunEvent) {
        self.dirty = true;
        self.events.push(EventRecord {
            t: self.now_ms(),
            event,
        });
    }

    /// Runs until the script ends (or the run is stopped) and returns the report.
    pub async fn run(
        mut self,
        mut ops: mpsc::UnboundedReceiver<ScriptOp>,
        mut control: mpsc::UnboundedReceiver<Control>,
    ) -> Report {
        let (call_tx, mut call_rx) = mpsc::unbounded_channel();
        let (ack_tx, mut ack_rx) = mpsc::unbounded_channel();
        let (journal, journal_task) = Journal::spawn(
            self.init.store.clone(),
            self.init.run_id.clone(),
            self.init.generation,
            ack_tx,
        );
        self.journal = Some(journal);
        self.journal_task = Some(journal_task);
        let (applied_tx, mut applied_rx) = mpsc::unbounded_channel();
        if let Some(src) = self
            .init
            .settings
            .source
            .clone()
            .filter(|s| s.url.is_none())
        {
            let cache = self
                .init
                .cache_dir
                .clone()
                .unwrap_or_else(|| std::env::temp_dir().join("flotilla-coordinator-cache"));
            let (tx, watch) = crate::head::spawn(
                self.init.store.clone(),
                src.repo,
                src.commit,
                cache,
                applied_tx,
            );
            self.head = Some(tx);
            self.head_watch = Some(watch);
        }
        self.init.dispatch.register(RunRegistration {
            run_id: self.run.clone(),
            concurrency: self.init.settings.concurrency as usize,
            stall_timeout: Duration::from_millis(self.init.settings.stall_timeout_ms),
            max_attempts: self.init.settings.attempts,
            stagger: Duration::from_millis(self.init.settings.stagger_ms),
            budget_total: self.init.settings.budget_tokens,
            worker_wait: Duration::from_millis(self.init.settings.worker_wait_ms),
            head: self.head_watch.clone(),
            shared: self.init.shared.clone(),
            events: call_tx,
        });
        self.event(RunEvent::Status {
            status: "running".into(),
            error: None,
        });
        for g in self.groups.clone() {
            self.event(RunEvent::Group { title: g });
        }
        let warnings = self
            .init
            .resume
            .as_ref()
            .map(|r| r.warnings.clone())
            .unwrap_or_default();
        for line in warnings {
            self.logs.push(line.clone());
            self.event(RunEvent::Log { line });
        }

        let mut tick = tokio::time::interval(SNAPSHOT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stop_deadline: Option<Instant> = None;
        // A closed channel stays ready forever; stop polling it once it has closed.
        let (mut acks_open, mut calls_open, mut control_open) = (true, true, true);
        let end: ScriptEnd = loop {
            tokio::select! {
                biased;
                ack = ack_rx.recv(), if acks_open => match ack {
                    Some(ack) => self.on_ack(ack),
                    None => acks_open = false,
                },
                ev = call_rx.recv(), if calls_open => match ev {
                    Some(ev) => self.on_call_event(ev),
                    None => calls_open = false,
                },
                Some(applied) = applied_rx.recv() => self.on_applied(applied),
                op = ops.recv() => match op {
                    Some(ScriptOp::Finished(end)) => break end,
                    Some(op) => self.on_op(op),
                    None => break ScriptEnd::Failed(script::ScriptFailure {
                        kind: script::FailureKind::Internal,
                        message: "the script thread ended without a result".into(),
                        line: None,
                    }),
                },
                c = control.recv(), if control_open && stop_deadline.is_none() => match c {
                    Some(Control::Stop) => {
                        self.begin_stop();
                        stop_deadline = Some(Instant::now() + STOP_GRACE);
                    }
                    Some(Control::Pause(paused)) => self.pause(paused),
                    Some(Control::Agent { action, agent, reply }) => {
                        let _ = reply.send(self.act_on_agent(action, &agent));
                    }
                    Some(Control::Report(reply)) => {
                        let _ = reply.send(self.report_with(true));
                    }
                    // Nobody can stop the run any more; it goes on to its end.
                    None => control_open = false,
                },
                _ = tick.tick() => {
                    // A storage outage shows in the status while it lasts (and once it ends).
                    let failing = self.init.store.health.problem().is_some();
                    if failing || failing != self.storage_failing {
                        self.storage_failing = failing;
                        self.dirty = true;
                    }
                    if stop_deadline.is_some_and(|d| Instant::now() >= d) {
                        break ScriptEnd::Failed(script::ScriptFailure {
                            kind: script::FailureKind::Stopped,
                            message: "the run was stopped".into(),
                            line: None,
                        });
                    }
                    self.publish();
                }
            }
        };
        self.finish(end, &mut ack_rx, &mut applied_rx).await
    }

    fn pause(&mut self, paused: bool) {
        if self.stopping || (self.status == RunStatus::Paused) == paused {
            return;
        }
        self.status = if paused {
            RunStatus::Paused
        } else {
            RunStatus::Running
        };
        self.init.dispatch.pause_run(&self.run, paused);
        self.event(RunEvent::Status {
            status: self.status.as_str().into(),
            error: None,
        });
        let line = if paused {
            "[pause] the run is paused: running agents were interrupted and nothing new starts"
        } else {
            "[pause] the run resumed"
        };
        self.logs.push(line.into());
        self.event(RunEvent::Log { line: line.into() });
    }

    /// Finds one live agent by index or label and stops or restarts it.
    fn act_on_agent(&mut self, action: AgentAction, agent: &str) -> Result<String, String> {
        let live = |c: &Call| matches!(c.status, Status::Queued | Status::Running);
        let index = match agent.parse::<usize>() {
            Ok(i) if i < self.calls.len() => i,
            Ok(i) => {
                return Err(format!(
                    "no agent #{i}: this run has {} agents",
                    self.calls.len()
                ));
            }
            Err(_) => {
                let found: Vec<usize> = self
                    .calls
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.label == agent)
                    .map(|(i, _)| i)
                    .collect();
                let alive: Vec<usize> = found
                    .iter()
                    .copied()
                    .filter(|i| live(&self.calls[*i]))
                    .collect();
                match (found.len(), alive.as_slice()) {
                    (0, _) => return Err(format!("no agent labeled {agent:?} in this run")),
                    (_, [one]) => *one,
                    (_, []) => return Err(format!("agent {agent:?} is not running")),
                    (_, many) => {
                        return Err(format!(
                            "{} running agents are labeled {agent:?}; name one by its index ({})",
                            many.len(),
                            many.iter()
                                .map(|i| format!("#{i}"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ));
                    }
                }
            }
        };
        let c = &self.calls[index];
        if !live(c) {
            return Err(format!("agent #{index} ({:?}) is not running", c.label));
        }
        let label = c.label.clone();
        match action {
            AgentAction::Stop => {
                self.init.dispatch.stop_call(
                    &self.run,
                    index as u64,
                    crate::sched::CallFailure::Terminal,
                    "stopped by the user",
                );
                Ok(format!(
                    "stopped agent #{index} ({label:?}); its agent() resolves null"
                ))
            }
            AgentAction::Restart => {
                if c.status != Status::Running {
                    return Err(format!(
                        "agent #{index} ({label:?}) is queued, not running; nothing to restart"
                    ));
                }
                self.init.dispatch.restart_call(&self.run, index as u64);
                Ok(format!(
                    "restarted agent #{index} ({label:?}) as a new attempt"
                ))
            }
        }
    }

    fn begin_stop(&mut self) {
        if self.stopping {
            return;
        }
        self.stopping = true;
        self.init.shared.stop.store(true, Ordering::Relaxed);
        (self.reply)(HostReply::Stop);
        self.init.dispatch.close_run(&self.run);
        let now = self.now_ms();
        for c in &mut self.calls {
            if matches!(c.status, Status::Queued | Status::Running) {
                c.status = Status::Cancelled;
                c.end_ms.get_or_insert(now);
            }
        }
    }

    fn reject(&self, id: u64, code: RejectCode, message: impl Into<String>) {
        (self.reply)(HostReply::Agent {
            id,
            result: Err(HostError::new(code, message)),
        });
    }

    fn ensure_group(&mut self, title: &str) {
        if !self.group_index.contains_key(title) {
            self.group_index.insert(title.to_owned(), self.groups.len());
            self.groups.push(title.to_owned());
            self.event(RunEvent::Group {
                title: title.to_owned(),
            });
        }
    }

    fn on_op(&mut self, op: ScriptOp) {
        match op {
            ScriptOp::Agent {
                id,
                prompt,
                opts_json,
                group,
                child: _,
            } => self.on_agent(id, prompt, &opts_json, group),
            ScriptOp::Phase(title) => self.ensure_group(&title),
            ScriptOp::Log(line) => {
                self.logs.push(line.clone());
                self.event(RunEvent::Log { line });
            }
            ScriptOp::Failure(line) => {
                self.failures.push(line.clone());
                self.event(RunEvent::Failure { line });
            }
            ScriptOp::ResolveWorkflow { id, reference } => {
                let result = WorkflowRef::from_json(&reference)
                    .and_then(|r| self.init.resolver.resolve(&r))
                    .and_then(|found| {
                        let prepared = source::prepare(&found.source)
                            .map_err(|e| format!("workflow {:?} cannot run: {e}", found.name))?;
                        Ok((found.name, script::runnable_body(&prepared)))
                    })
                    .map_err(|e| HostError::new(RejectCode::WorkflowNotFound, e));
                (self.reply)(HostReply::Workflow { id, result });
            }
            ScriptOp::Finished(_) => {}
        }
    }

    /// The money ceiling: once crossed, every live call stops with `BUDGET_EXCEEDED`.
    fn check_money(&mut self) {
        let Some(limit) = self.init.settings.budget_usd else {
            return;
        };
        if self.usage.cost_usd < limit || self.money_spent {
            return;
        }
        self.money_spent = true;
        let line = format!(
            "[budget] the run has cost ${:.4} of its ${limit} budget: running agents are stopped and no new agent starts",
            self.usage.cost_usd
        );
        self.logs.push(line.clone());
        self.event(RunEvent::Log { line });
        let message = format!(
            "money budget exceeded (${:.4} / ${limit}); completed results are kept",
            self.usage.cost_usd
        );
        for (index, c) in self.calls.iter().enumerate() {
            if matches!(c.status, Status::Queued | Status::Running) {
                self.init.dispatch.stop_call(
                    &self.run,
                    index as u64,
                    crate::sched::CallFailure::Budget,
                    &message,
                );
            }
        }
    }

    fn on_agent(&mut self, id: u64, prompt: String, opts_json: &str, group: String) {
        if self.stopping {
            return;
        }
        if let Some(limit) = self.init.settings.budget_usd
            && self.usage.cost_usd >= limit
        {
            self.reject(
                id,
                RejectCode::BudgetExceeded,
                format!(
                    "money budget exceeded (${:.4} / ${limit}); no new agent starts",
                    self.usage.cost_usd
                ),
            );
            return;
        }
        let max = self.init.settings.max_agents;
        if self.calls.len() as u64 >= max {
            self.reject(
                id,
                RejectCode::AgentCap,
                format!(
                    "agent cap reached: this run already started {max} agents (the limit per run, set with --max-agents); \
                     a loop over budget.remaining() never ends without a budget — cap the iterations or set --budget"
                ),
            );
            return;
        }
        // Checked before anything is recorded: one call must fit the worker stream.
        if let Err(e) = flotilla_proto::frag::check_call_size(prompt.len() + opts_json.len()) {
            self.reject(id, RejectCode::TooLarge, e);
            return;
        }
        let mut spec = match CallSpec::parse(prompt, opts_json, &self.init.settings.backend, "") {
            Ok(s) => s,
            Err(e) => {
                self.reject(id, RejectCode::InvalidOption, e);
                return;
            }
        };
        let mut type_model = None;
        let mut type_def = None;
        if !spec.agent_type.is_empty() {
            let known = self
                .agent_types
                .get_or_insert_with(|| self.init.resolver.agent_types());
            match known.iter().find(|t| t.name == spec.agent_type) {
                Some(t) => {
                    type_model = t.model.clone();
                    type_def = t.definition_json();
                }
                None => {
                    let list = known
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ");
                    self.reject(
                        id,
                        RejectCode::UnknownAgentType,
                        format!(
                            "unknown agentType {:?}: the available agent types are {list} (custom agents live in .claude/agents/*.md)",
                            spec.agent_type
                        ),
                    );
                    return;
                }
            }
        }
        // Model resolution (W18): the call's model, then the agent type's, then the run's;
        // a forced run model wins over all of them.
        let run_model = &self.init.settings.model;
        if self.init.settings.force_model && !run_model.is_empty() {
            spec.model = run_model.clone();
        } else if spec.model.is_empty() {
            spec.model = type_model.unwrap_or_else(|| run_model.clone());
        }
        if let Some(schema) = &spec.schema {
            let text = schema.to_string();
            let check = self
                .schema_checks
                .entry(text)
                .or_insert_with(|| flotilla_proto::schema::preflight(schema))
                .clone();
            if let Err(e) = check {
                self.reject(
                    id,
                    RejectCode::SchemaInvalid,
                    format!("agent() schema rejected before start: {e}"),
                );
                return;
            }
        }
        if let Some(total) = self.init.settings.budget_tokens {
            let spent = self.init.shared.spent.load(Ordering::Relaxed);
            if spent >= total {
                self.reject(
                    id,
                    RejectCode::BudgetExceeded,
                    format!(
                        "token budget exceeded ({spent} / {total} output tokens); in-flight agents will complete and their results are kept"
                    ),
                );
                return;
            }
        }

        let index = self.calls.len() as u64;
        let content = spec.content_hash();
        let occ = self.occurrences.entry(content.clone()).or_insert(0);
        let key = call_key(&content, *occ);
        *occ += 1;
        self.ensure_group(&group);
        let now = self.now_ms();

        // Resume: served from the source run when the replay rule allows.
        let cached = self
            .init
            .resume
            .as_ref()
            .and_then(|src| match self.init.settings.replay {
                ReplayMode::Content => src.by_key(&key).cloned(),
                ReplayMode::Prefix => {
                    if !self.prefix_intact {
                        return None;
                    }
                    match src.at_index(index) {
                        Some(r) if r.key == key => Some(r.clone()),
                        _ => None,
                    }
                }
            });
        if self.init.resume.is_some()
            && self.init.settings.replay == ReplayMode::Prefix
            && cached.is_none()
        {
            self.prefix_intact = false;
        }

        let phase = self
            .phase_spans
            .entry(group.clone())
            .or_insert_with(|| {
                tracing::info_span!(
                    parent: &self.span,
                    "phase",
                    workflow.run_id = %self.init.run_id,
                    phase = %group,
                )
            })
            .clone();
        let span = tracing::info_span!(
            parent: &phase,
            "agent",
            workflow.run_id = %self.init.run_id,
            workflow.name = %self.init.workflow.name,
            index,
            label = %spec.label,
            model = %spec.model,
            attempts = tracing::field::Empty,
            input_tokens = tracing::field::Empty,
            output_tokens = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let mut call = Call {
            span,
            script_id: id,
            key: key.clone(),
            label: spec.label.clone(),
            group: group.clone(),
            model: spec.model.clone(),
            status: Status::Queued,
            cached: false,
            cached_from: None,
            attempts: 0,
            start_ms: None,
            end_ms: None,
            error: None,
            usage: UsageRecord::default(),
            live_tokens: 0,
            disk_bytes: 0,
            worker: None,
            result: None,
            waiting_for: None,
            isolated: spec.isolation == "worktree",
            change: None,
            own_journal: false,
        };
        if let Some(record) = cached {
            call.span.record("outcome", "cached");
            call.span = tracing::Span::none();
            call.cached = true;
            call.cached_from = Some(
                record
                    .cached_from
                    .clone()
                    .or_else(|| self.init.resume.as_ref().map(|s| s.run_id.clone()))
                    .unwrap_or_default(),
            );
            call.status = Status::Journaling;
            call.start_ms = Some(now);
            call.end_ms = Some(now);
            call.result = record.result.clone();
            call.own_journal = self
                .init
                .resume
                .as_ref()
                .is_some_and(|s| s.run_id == self.init.run_id);
            let change = record.change.clone();
            self.calls.push(call);
            // Its change is applied to this run's head again, never re-run (design.md).
            if let (Some(head), Some(mut ch)) = (&self.head, change) {
                ch.head_after = None;
                let _ = head.send(crate::head::Apply {
                    call: index,
                    label: spec.label.clone(),
                    record: ch,
                    pack: None,
                });
            } else if self.calls[index as usize].own_journal {
                // Adopted after a failover: the result is in this run's own journal already.
                self.on_ack(JournalAck::Durable(vec![index]));
            } else {
                self.journal_call(index);
            }
            self.event(RunEvent::Call {
                index,
                label: spec.label,
                group,
                state: "cached".into(),
                attempt: None,
                detail: None,
            });
            return;
        }
        let call_span = call.span.clone();
        self.calls.push(call);
        // Served calls are not: the page finds their prompt in the run they came from.
        self.event(RunEvent::Prompt {
            index,
            prompt: spec.prompt.clone(),
        });
        self.event(RunEvent::Call {
            index,
            label: spec.label.clone(),
            group: group.clone(),
            state: "queued".into(),
            attempt: None,
            detail: None,
        });
        let schema_attempts = self.init.settings.schema_attempts;
        let task = flotilla_proto::v1::TaskSpec {
            prompt: spec.prompt.clone(),
            backend: spec.backend.clone(),
            model: spec.model.clone(),
            effort: spec.effort.clone(),
            agent_type: spec.agent_type.clone(),
            schema_json: spec.schema.as_ref().map(Value::to_string),
            isolation: spec.isolation.clone(),
            cwd: spec.cwd.clone(),
            tools: spec.tools.clone(),
            timeout_ms: spec.timeout_ms,
            label: spec.label.clone(),
            group,
            schema_attempts,
            options_json: Value::Object(spec.options.clone()).to_string(),
            agent_def_json: type_def.unwrap_or_default(),
            source_repo: self
                .init
                .settings
                .source
                .as_ref()
                .map(|s| s.repo.clone())
                .unwrap_or_default(),
            source_commit: self
                .init
                .settings
                .source
                .as_ref()
                .map(|s| s.commit.clone())
                .unwrap_or_default(),
            source_url: self
                .init
                .settings
                .source
                .as_ref()
                .and_then(|s| s.url.clone())
                .unwrap_or_default(),
            source_partial: String::new(),
        };
        self.init.dispatch.submit(
            &self.run,
            Ticket {
                call: index,
                key,
                task,
                span: call_span,
                // Worktree agents never share a prefix (each has its own directory, W60).
                prefix_group: if spec.isolation == "worktree" {
                    index.wrapping_add(1) << 32 ^ spec.prefix_group()
                } else {
                    spec.prefix_group()
                },
            },
        );
    }

    fn journal_call(&mut self, index: u64) {
        let Some(c) = self.calls.get(index as usize) else {
            return;
        };
        let record = CallRecord {
            index,
            key: c.key.clone(),
            label: c.label.clone(),
            group: c.group.clone(),
            result: c.result.clone(),
            payload: None,
            usage: c.usage,
            attempts: c.attempts,
            cached_from: c.cached_from.clone(),
            worker: c.worker.as_ref().map(|w| w.to_string()),
            change: c.change.clone(),
        };
        let queued = self.journal.as_ref().is_some_and(|j| j.append(record));
        if !queued {
            self.on_ack(JournalAck::Failed {
                indices: vec![index],
                error: "the journal writer is gone".into(),
            });
        }
    }

    fn on_ack(&mut self, ack: JournalAck) {
        match ack {
            JournalAck::Durable(indices) => {
                for index in indices {
                    let Some(c) = self.calls.get_mut(index as usize) else {
                        continue;
                    };
                    if c.status != Status::Journaling {
                        continue;
                    }
                    c.status = Status::Completed;
                    let json = c
                        .result
                        .as_ref()
                        .map_or_else(|| "null".to_owned(), Value::to_string);
                    let (id, label, group) = (c.script_id, c.label.clone(), c.group.clone());
                    if !self.stopping {
                        (self.reply)(HostReply::Agent {
                            id,
                            result: Ok(json),
                        });
                    }
                    self.event(RunEvent::Call {
                        index,
                        label,
                        group,
                        state: "completed".into(),
                        attempt: None,
                        detail: None,
                    });
                }
            }
            JournalAck::Failed { indices, error } => {
                // Results that cannot be stored are never handed to the script: the run fails
                // rather than pretend they are durable.
                tracing::error!(run = %self.run, error = %error, "cannot store completed calls");
                if self.error.is_none() {
                    self.error = Some(format!(
                        "cannot store completed agent results ({} calls): {error}",
                        indices.len()
                    ));
                }
                self.begin_stop();
                self.status = RunStatus::Failed;
            }
        }
    }

    fn on_call_event(&mut self, ev: CallEvent) {
        self.dirty = true;
        let now = self.now_ms();
        match ev {
            CallEvent::Started {
                call,
                attempt,
                worker,
            } => {
                self.attempts_total += 1;
                let Some(c) = self.calls.get_mut(call as usize) else {
                    return;
                };
                if c.status == Status::Queued {
                    c.status = Status::Running;
                }
                c.attempts = c.attempts.max(attempt);
                c.start_ms.get_or_insert(now);
                c.worker = Some(worker.clone());
                c.live_tokens = 0;
                let (label, group) = (c.label.clone(), c.group.clone());
                self.event(RunEvent::Call {
                    index: call,
                    label,
                    group,
                    state: "running".into(),
                    attempt: Some(attempt),
                    detail: Some(worker.to_string()),
                });
            }
            CallEvent::Progress {
                call,
                output_tokens,
                ..
            } => {
                if let Some(c) = self.calls.get_mut(call as usize) {
                    c.live_tokens = c.live_tokens.max(output_tokens);
                }
                if self.waiting.is_some() {
                    self.waiting = None;
                }
            }
            CallEvent::Transcript {
                call,
                attempt,
                events,
            } => self.store_transcript(call, attempt, events),
            CallEvent::Usage { call, usage, .. } => {
                let u = UsageRecord::from(&usage);
                self.usage.add(&u);
                self.check_money();
                self.init
                    .shared
                    .spent
                    .fetch_add(u.output_tokens, Ordering::Relaxed);
                if let Some(c) = self.calls.get_mut(call as usize) {
                    c.usage.add(&u);
                    c.disk_bytes = c.disk_bytes.max(usage.disk_bytes);
                }
            }
            CallEvent::Retrying {
                call,
                attempt,
                retry,
                counted,
            } => {
                let Some(c) = self.calls.get(call as usize) else {
                    return;
                };
                let (label, group) = (c.label.clone(), c.group.clone());
                let max = self.init.settings.attempts;
                let (line, state) = match &retry {
                    Retry::Stalled { after } => (
                        format!(
                            "[stall] agent \"{label}\" stalled (no progress) after {} — retrying ({counted}/{})",
                            human(*after),
                            max.saturating_sub(1)
                        ),
                        "stalled",
                    ),
                    Retry::RateLimited { wait } => {
                        self.waiting = Some(format!(
                            "usage limit: agent \"{label}\" waits {} before retrying",
                            human(*wait)
                        ));
                        (
                            format!(
                                "[limit] agent \"{label}\" is rate limited; waiting {} (the run continues)",
                                human(*wait)
                            ),
                            "waiting",
                        )
                    }
                    Retry::Transient { message } => (
                        format!(
                            "[retry] agent \"{label}\" attempt {attempt} failed: {message} — retrying ({counted}/{})",
                            max.saturating_sub(1)
                        ),
                        "retrying",
                    ),
                    Retry::User => (
                        format!(
                            "[restart] agent \"{label}\" restarted by the user ({counted}/{})",
                            max.saturating_sub(1)
                        ),
                        "restarted",
                    ),
                    Retry::Paused => (
                        format!(
                            "[pause] agent \"{label}\" was interrupted by the pause; it starts again when the run resumes"
                        ),
                        "interrupted",
                    ),
                };
                if let Some(c) = self.calls.get_mut(call as usize)
                    && c.status == Status::Running
                {
                    c.status = Status::Queued;
                }
                self.logs.push(line.clone());
                self.event(RunEvent::Log { line });
                self.event(RunEvent::Call {
                    index: call,
                    label,
                    group,
                    state: state.into(),
                    attempt: Some(attempt),
                    detail: None,
                });
            }
            CallEvent::Waiting { call, reason } => {
                let Some(c) = self.calls.get_mut(call as usize) else {
                    return;
                };
                c.waiting_for.clone_from(&reason);
                if let Some(reason) = reason
                    && self.waits_logged.insert(reason.clone())
                {
                    let line = format!(
                        "[wait] agent \"{}\" waits: {reason}; it fails after {} unless such a worker attaches",
                        c.label,
                        human(Duration::from_millis(self.init.settings.worker_wait_ms))
                    );
                    self.logs.push(line.clone());
                    self.event(RunEvent::Log { line });
                }
            }
            CallEvent::Finished { call, result } => self.on_finished(call, result, now),
        }
    }

    fn on_finished(&mut self, call: u64, result: CallResult, now: u64) {
        let stopping = self.stopping;
        let Some(c) = self.calls.get_mut(call as usize) else {
            return;
        };
        if !matches!(c.status, Status::Queued | Status::Running) {
            return;
        }
        c.end_ms = Some(now);
        c.waiting_for = None;
        c.span.record("attempts", c.attempts);
        c.span.record("input_tokens", c.usage.input_tokens);
        c.span.record("output_tokens", c.usage.output_tokens);
        c.span.record(
            "outcome",
            match &result {
                CallResult::Completed(_) => "completed",
                CallResult::Failed { .. } => "failed",
            },
        );
        c.span = tracing::Span::none();
        match result {
            CallResult::Completed(done) => {
                let value = match done.json {
                    Some(json) => serde_json::from_str(&json).unwrap_or(Value::String(json)),
                    None => Value::String(done.text),
                };
                c.result = Some(value);
                c.status = Status::Journaling;
                match (done.change, &self.head) {
                    // Its change goes into the head (or onto its branch) before it is journaled.
                    (Some(ch), Some(head)) => {
                        let _ = head.send(crate::head::Apply {
                            call,
                            label: c.label.clone(),
                            record: crate::head::ChangeRecord {
                                commit: ch.commit,
                                base: ch.base,
                                files: ch.files,
                                insertions: ch.insertions,
                                deletions: ch.deletions,
                                head_after: None,
                                conflicts: Vec::new(),
                                isolated: c.isolated,
                            },
                            pack: Some(ch.pack),
                        });
                    }
                    // A source the workers fetched by URL has no head here: said, never lost
                    // without a word.
                    (Some(ch), None) => {
                        let line = format!(
                            "agent \"{}\" changed {} file(s), but this run's source is fetched by URL and its changes are not kept; launch from a checkout of the repository (--source auto) to get them back as branches",
                            c.label,
                            ch.files.len()
                        );
                        self.failures.push(line.clone());
                        self.event(RunEvent::Failure { line });
                        self.journal_call(call);
                    }
                    (None, _) => self.journal_call(call),
                }
            }
            CallResult::Failed { failure, message } => {
                c.status = Status::Failed;
                c.error = Some(message.clone());
                let (id, label, group) = (c.script_id, c.label.clone(), c.group.clone());
                if !stopping {
                    match failure {
                        CallFailure::Terminal => {
                            (self.reply)(HostReply::Agent {
                                id,
                                result: Ok("null".into()),
                            });
                            let line = format!("agent \"{label}\" failed: {message}");
                            self.failures.push(line.clone());
                            self.event(RunEvent::Failure { line });
                        }
                        CallFailure::Schema => {
                            self.reject(id, RejectCode::SchemaFailed, message.clone())
                        }
                        CallFailure::Invalid => {
                            self.reject(id, RejectCode::InvalidAgent, message.clone())
                        }
                        CallFailure::Stalled => {
                            self.reject(id, RejectCode::Stalled, message.clone())
                        }
                        CallFailure::Budget => {
                            self.reject(id, RejectCode::BudgetExceeded, message.clone())
                        }
                    }
                }
                self.event(RunEvent::Call {
                    index: call,
                    label,
                    group,
                    state: "failed".into(),
                    attempt: None,
                    detail: Some(message),
                });
            }
        }
    }

    /// A change applied to the head (or kept on its branch): said, then journaled with its call.
    fn on_applied(&mut self, a: crate::head::Applied) {
        self.dirty = true;
        let Some(c) = self.calls.get_mut(a.call as usize) else {
            return;
        };
        let label = c.label.clone();
        let branch = format!("flotilla/{}/{}", self.init.run_id, a.call);
        let line = match a.result {
            Ok(record) => {
                let line = if !record.conflicts.is_empty() {
                    Some(format!(
                        "agent \"{label}\" changed files that conflict with the run's head ({}); its change is on branch {branch} (`flotilla apply {} --agent {}`)",
                        record.conflicts.join(", "),
                        self.init.run_id,
                        a.call
                    ))
                } else {
                    None
                };
                c.change = Some(record);
                line
            }
            Err(e) => {
                // The result stands; only the change could not be kept.
                Some(format!(
                    "agent \"{label}\" changed files, but the change could not be kept: {e}"
                ))
            }
        };
        let own = c.own_journal;
        if let Some(line) = line {
            self.failures.push(line.clone());
            self.event(RunEvent::Failure { line });
        }
        if own {
            self.on_ack(JournalAck::Durable(vec![a.call]));
        } else {
            self.journal_call(a.call);
        }
    }

    fn store_transcript(&mut self, call: u64, attempt: u32, events: Vec<String>) {
        let events = events
            .into_iter()
            .map(|e| serde_json::from_str(&e).unwrap_or(Value::String(e)))
            .collect();
        self.transcripts.push(TranscriptLine {
            call,
            attempt,
            events,
        });
    }

    async fn finish(
        mut self,
        end: ScriptEnd,
        ack_rx: &mut mpsc::UnboundedReceiver<JournalAck>,
        applied_rx: &mut mpsc::UnboundedReceiver<crate::head::Applied>,
    ) -> Report {
        match end {
            ScriptEnd::Returned(json) => {
                if self.status != RunStatus::Failed {
                    self.status = if self.stopping {
                        RunStatus::Stopped
                    } else {
                        RunStatus::Completed
                    };
                }
                self.result = json
                    .as_deref()
                    .and_then(|j| serde_json::from_str(j).ok())
                    .unwrap_or(Value::Null);
            }
            ScriptEnd::Failed(f) => {
                if self.status != RunStatus::Failed {
                    self.status = if f.kind == script::FailureKind::Stopped && self.stopping {
                        RunStatus::Stopped
                    } else {
                        RunStatus::Failed
                    };
                }
                if self.error.is_none() && self.status == RunStatus::Failed {
                    self.error = Some(f.message);
                }
            }
        }
        // Whatever is still queued or running is cancelled: the script no longer waits for it.
        self.init.dispatch.close_run(&self.run);
        let now = self.now_ms();
        for c in &mut self.calls {
            if matches!(c.status, Status::Queued | Status::Running) {
                c.status = Status::Cancelled;
                c.end_ms.get_or_insert(now);
            }
        }
        // Changes still being applied to the head are journaled first.
        if self.head.take().is_some() {
            while let Some(a) = applied_rx.recv().await {
                self.on_applied(a);
            }
        }
        // Let the journal finish what it has: results completed after the script ended are
        // still worth keeping for a resume.
        self.journal = None;
        if let Some(task) = self.journal_task.take() {
            let _ = task.await;
        }
        while let Ok(ack) = ack_rx.try_recv() {
            if let JournalAck::Durable(indices) = ack {
                for i in indices {
                    if let Some(c) = self.calls.get_mut(i as usize)
                        && c.status == Status::Journaling
                    {
                        c.status = Status::Completed;
                    }
                }
            }
        }
        for c in &mut self.calls {
            if c.status == Status::Journaling {
                c.status = Status::Failed;
                c.error = Some("the result could not be stored".into());
            }
        }
        self.transcripts.close().await;
        let status = self.status;
        let error = self.error.clone();
        self.event(RunEvent::Status {
            status: status.as_str().into(),
            error,
        });
        self.events.close().await;
        let report = self.report();
        if self.init.write_result {
            match serde_json::to_vec_pretty(&report) {
                Ok(body) => {
                    if let Err(e) = self
                        .init
                        .store
                        .put_overwrite(&keys::result(&self.init.run_id), Bytes::from(body))
                        .await
                    {
                        tracing::error!(run = %self.run, error = %e, "cannot store the run report");
                    }
                }
                Err(e) => tracing::error!(error = %e, "cannot encode the run report"),
            }
        }
        for held in std::mem::take(&mut self.init.owners) {
            held.release().await;
        }
        self.publish();
        report
    }

    fn publish(&mut self) {
        if !self.dirty {
            return;
        }
        self.dirty = false;
        let mut groups: Vec<GroupProgress> = self
            .groups
            .iter()
            .map(|t| GroupProgress {
                title: t.clone(),
                ..GroupProgress::default()
            })
            .collect();
        let mut snap = Snapshot {
            run_id: self.init.run_id.clone(),
            workflow: self.init.workflow.clone(),
            status: Some(self.status),
            elapsed_ms: self.now_ms(),
            logs: {
                if self.published_logs.len() != self.logs.len() {
                    self.published_logs = Arc::new(self.logs.clone());
                }
                self.published_logs.clone()
            },
            input_tokens: self.usage.input_tokens,
            output_tokens: self.usage.output_tokens,
            waiting: self
                .init
                .store
                .health
                .problem()
                .or_else(|| self.waiting.clone())
                .or_else(|| self.no_worker_summary()),
            since: Some(self.started),
            ..Snapshot::default()
        };
        for c in &self.calls {
            snap.agents += 1;
            let Some(g) = self
                .group_index
                .get(&c.group)
                .and_then(|&i| groups.get_mut(i))
            else {
                continue;
            };
            g.total += 1;
            g.output_tokens += c.usage.output_tokens.max(c.live_tokens);
            match c.status {
                Status::Completed | Status::Journaling => {
                    g.done += 1;
                    snap.done += 1;
                }
                Status::Failed | Status::Cancelled => {
                    g.failed += 1;
                    snap.failed += 1;
                }
                Status::Running => {
                    g.running += 1;
                    snap.running += 1;
                }
                Status::Queued => {}
            }
            if c.cached {
                snap.cached += 1;
            }
        }
        snap.groups = groups;
        let _ = self.snapshot.send(Arc::new(snap));
    }

    /// What the calls that no attached worker can run wait for, in one line.
    fn no_worker_summary(&self) -> Option<String> {
        let mut waiting = self.calls.iter().filter_map(|c| c.waiting_for.as_ref());
        let first = waiting.next()?;
        let more = waiting.count();
        Some(if more == 0 {
            format!("1 agent waits: {first}")
        } else {
            format!("{} agents wait: {first}", more + 1)
        })
    }

    fn report(&self) -> Report {
        self.report_with(false)
    }

    /// The report; `live` keeps the states of calls that have not ended instead of calling
    /// them cancelled.
    fn report_with(&self, live: bool) -> Report {
        let mut usage = ReportUsage {
            agents: self.calls.len() as u64,
            attempts: self.attempts_total,
            input_tokens: self.usage.input_tokens,
            output_tokens: self.usage.output_tokens,
            cost_usd: self.usage.cost_usd,
            duration_ms: self.now_ms(),
            ..ReportUsage::default()
        };
        let mut agents = Vec::with_capacity(self.calls.len());
        for (i, c) in self.calls.iter().enumerate() {
            if c.cached {
                usage.cached += 1;
            } else if c.attempts > 0 {
                usage.dispatched += 1;
            }
            let status = match c.status {
                Status::Completed => "completed",
                Status::Failed => "failed",
                Status::Journaling if live => "completed",
                Status::Running if live => "running",
                Status::Queued if live => "queued",
                Status::Cancelled | Status::Queued | Status::Running | Status::Journaling => {
                    "cancelled"
                }
            };
            if c.status == Status::Failed {
                usage.errors += 1;
            }
            agents.push(AgentReport {
                label: c.label.clone(),
                group: c.group.clone(),
                status: status.into(),
                attempts: c.attempts,
                cached: c.cached,
                start_ms: c.start_ms,
                end_ms: c.end_ms,
                error: c.error.clone(),
                index: i as u64,
                key: c.key.clone(),
                model: c.model.clone(),
                input_tokens: c.usage.input_tokens,
                output_tokens: c.usage.output_tokens,
                disk_bytes: c.disk_bytes,
                waiting: if live { c.waiting_for.clone() } else { None },
            });
        }
        let mut groups: Vec<GroupReport> = self
            .groups
            .iter()
            .map(|t| GroupReport {
                title: t.clone(),
                agents: Vec::new(),
            })
            .collect();
        for c in &self.calls {
            if let Some(g) = self
                .group_index
                .get(&c.group)
                .and_then(|&i| groups.get_mut(i))
            {
                g.agents.push(c.label.clone());
            }
        }
        Report {
            run_id: self.init.run_id.clone(),
            status: self.status,
            result: self.result.clone(),
            error: self.error.clone(),
            workflow: self.init.workflow.clone(),
            usage,
            agents,
            groups,
            logs: self.logs.clone(),
            failures: self.failures.clone(),
            script_path: self.init.script_path.clone(),
            parent_run_id: self.init.parent_run_id.clone(),
            store: Some(self.init.store.url.clone()),
            changes: self.head_watch.as_ref().map(|head| {
                let of = |f: &dyn Fn(&crate::head::ChangeRecord) -> bool| {
                    self.calls
                        .iter()
                        .filter_map(|c| c.change.as_ref())
                        .filter(|r| f(r))
                        .count() as u64
                };
                crate::report::ChangesSummary {
                    merged: of(&|r| r.head_after.is_some()),
                    isolated: of(&|r| r.isolated),
                    conflicted: of(&|r| !r.conflicts.is_empty()),
                    head: head.borrow().clone(),
                    apply: format!("flotilla apply {}", self.init.run_id),
                }
            }),
        }
    }
}

fn human(d: Duration) -> String {
    if d.as_millis() < 1000 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests;
