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

pub mod admit;
pub mod ask;
mod asking;
mod book;
mod budgets;
mod calls;
mod control;
mod finish;
pub mod resume;
mod snapshot;
mod view;

pub use snapshot::{GroupProgress, Snapshot};

use crate::call::{Mark, Stage, human};
use crate::reject::RejectCode;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::report::{Report, ReportUsage, RunStatus, Summary};
use crate::sched::{
    CallEvent, CallFailure, CallResult, DispatchHandle, Retry, RunRegistration, Ticket,
};
use crate::script::{self, HostError, HostReply, ScriptEnd, ScriptOp, ScriptShared, text};
use crate::settings::RunSettings;
use crate::store::journal::{EventLog, Journal, JournalAck, TranscriptLine, TranscriptLog};
use crate::store::records::{
    CallRecord, EventRecord, RawJson, RunEvent, UsageRecord, WorkflowInfo,
};
use crate::store::{Store, keys};
use crate::workflows::{WorkflowRef, WorkflowResolver};
use book::{Call, CallBook};
use resume::ResumeSource;

/// How often the live snapshot is refreshed while something changes.
const SNAPSHOT_EVERY: Duration = Duration::from_millis(100);
/// How long a stopped run waits for its script thread before it finishes anyway.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// How long a stopped run waits for its agents to leave their workers before it ends anyway.
/// A worker that does not answer loses its lease sooner (`--worker-ttl`), which ends the wait.
const STOP_DRAIN: Duration = Duration::from_secs(120);

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
        reply: oneshot::Sender<Result<String, flotilla_proto::Problem>>,
    },
    /// The report as it stands now, with live states (`queued`, `running`) for calls that
    /// have not ended (the session page).
    Report(oneshot::Sender<Report>),
    /// A line for the run's log and events: who asked for the control that follows, and why.
    Note(String),
    /// The run's money budget set anew, in dollars; the reply says where the run stands.
    Budget {
        usd: f64,
        reply: oneshot::Sender<Result<String, flotilla_proto::Problem>>,
    },
    /// An answer to a question of the script (`ask()`): the one named (`question`), or the
    /// run's only open one; `by` is who answered. The reply comes once it is stored.
    Answer {
        question: Option<String>,
        value: Value,
        by: String,
        reply: oneshot::Sender<Result<String, flotilla_proto::Problem>>,
    },
}

/// What to do to one agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentAction {
    /// W55: its `agent()` resolves `null`, and it counts as failed.
    Stop,
    /// W56: abandon the running attempt and start a new one, which continues the abandoned
    /// one's session (issue 33, 3) unless `fresh`.
    Restart { fresh: bool },
}

/// Handle of a launched run.
#[derive(Debug)]
pub struct RunHandle {
    pub run_id: String,
    /// The namespace it belongs to.
    pub namespace: String,
    pub snapshot: watch::Receiver<Arc<Snapshot>>,
    /// What its launcher should be told at once: the backend chosen for it when the launch
    /// named none, and that no attached worker offers what it needs, if so
    /// ([`crate::Coordinator::launch`]).
    pub notes: Vec<String>,
    control: mpsc::UnboundedSender<Control>,
    report: oneshot::Receiver<Ending>,
    /// Its owner's run tasks (what waits for its end runs there too).
    tasks: crate::tasks::Tasks,
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
        let run_id = self.run_id.clone();
        match self.ended().await {
            Some(r) => r,
            None => Report::rejected(
                &run_id,
                WorkflowInfo::default(),
                "the run engine ended without a report (its coordinator stopped, or the engine failed)"
                    .into(),
            ),
        }
    }

    /// Waits for the run to end: its report, or `None` when its coordinator stopped first
    /// (the run is left as a crash would leave it, for a successor to adopt or a resume) or
    /// it was parked.
    pub async fn ended(self) -> Option<Report> {
        match self.report.await.ok()? {
            Ending::Ended(r) => Some(*r),
            Ending::Parked(_) => None,
        }
    }

    /// How the engine ended: its report or parked; `None` when its coordinator stopped first.
    pub async fn ending(self) -> Option<Ending> {
        self.report.await.ok()
    }

    /// The tasks of its owner's runs.
    pub fn tasks(&self) -> &crate::tasks::Tasks {
        &self.tasks
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
    /// The run's entry in the run index, rewritten with its end (`None`: not indexed).
    pub indexed: Option<crate::index::Entry>,
    /// Sends the end webhook when the run's settings name one.
    pub notifier: Option<Arc<crate::notify::Notifier>>,
    /// The namespaces' policies and daily quotas (`None`: no quotas, weight 1).
    pub quotas: Option<Arc<crate::namespace::Quotas>>,
    /// The tasks of its owner's runs: the engine and what it starts run there, and are
    /// stopped with them (`Tasks::default()`: an owner that never stops them).
    pub tasks: crate::tasks::Tasks,
    /// At its money budget the run is held until the budget is raised (a coordinator's runs:
    /// `flotilla budget` reaches them), instead of stopping its agents (`flotilla run`).
    pub budget_pauses: bool,
    /// Answers to its questions may come through the store as well as through controls
    /// (an embedded run: `flotilla answer` writes them there): it looks while one is open.
    pub answers_from_store: bool,
    /// The coordinator's pages (`http://host:port`), for the links its webhooks carry.
    pub page_base: Option<String>,
    /// A run that has waited this long on questions alone (no agent live, its script
    /// waiting) is parked: its script and engine go, a small record stays, and an answer or a
    /// question's deadline adopts it again (`None`: never; `flotilla run` keeps its run).
    pub park_after: Option<Duration>,
    /// Its log so far, from the generations before this engine (an adopted run's).
    pub logs_before: Vec<String>,
    /// What its interrupted calls left their next attempts, by call key (an adopted run's,
    /// from the store: `sched::kept::load`).
    pub kept: HashMap<String, flotilla_proto::v1::KeptLeftovers>,
}

/// How a run engine ended: with its report, or parked while it waits on questions alone
/// (what an owner keeps of it to wake it: [`Parked`]).
#[derive(Debug)]
pub enum Ending {
    Ended(Box<Report>),
    Parked(Parked),
}

/// A run parked while it waits for answers: what wakes it, and the records it owns.
#[derive(Debug)]
pub struct Parked {
    pub run_id: String,
    /// The earliest deadline of its open questions, if one has any.
    pub deadline: Option<std::time::SystemTime>,
    /// Owner records it held (kept by whoever keeps it parked, given to the engine that
    /// wakes it).
    pub owners: Vec<crate::owner::Held>,
    /// Its controls: the engine's own channel, so that one sent while it parked is not lost.
    pub controls: mpsc::UnboundedReceiver<Control>,
}

/// How the status of a run held at its money budget begins (`waiting`).
pub const HELD_AT_BUDGET: &str = "paused at its money budget";
/// How the status of a run held at its namespace's daily tokens or dollars begins.
pub const HELD_AT_QUOTA: &str = "paused at its namespace's daily quota";

/// The engine of one run.
pub struct RunEngine {
    init: EngineInit,
    run: Arc<str>,
    started: Instant,
    reply: ReplySink,
    /// Its calls and their groups.
    book: CallBook,
    admitter: admit::Admitter,
    logs: Vec<String>,
    /// The logs as last published (cloned only when they change).
    published_logs: Arc<Vec<String>>,
    failures: Vec<String>,
    /// What the run has used, against its ceilings.
    budgets: budgets::Budgets,
    agent_types: Option<Vec<crate::workflows::AgentType>>,
    journal: Option<Journal>,
    events: EventLog,
    status: RunStatus,
    error: Option<String>,
    result: Value,
    stopping: bool,
    /// Once stopped: its agents still on workers (the run is `stopping` until none is).
    stopping_left: u64,
    waiting: Option<String>,
    /// Held at its money budget: why (see [`HELD_AT_BUDGET`]).
    held: Option<String>,
    /// Held at its namespace's daily tokens or dollars until they reset: why
    /// ([`HELD_AT_QUOTA`]).
    quota_held: Option<String>,
    /// The money budget last given with `flotilla budget`, for the write that keeps it.
    latest_budget: Option<Arc<std::sync::Mutex<f64>>>,
    /// Throttle and usage-limit waits of its calls (not counted as attempts).
    waits: u64,
    /// Agents that run on a substitute model: (asked, used) → how many (W18).
    substitutions: std::collections::BTreeMap<(String, String), u64>,
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
    /// Its questions (`ask()`).
    asks: ask::Asks,
    /// Since when it waits on questions alone (see [`EngineInit::park_after`]).
    idle_since: Option<Instant>,
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
    let namespace = crate::namespace::effective(&init.settings.namespace).to_owned();
    let (snap_tx, snap_rx) = watch::channel(Arc::new(Snapshot {
        run_id: run_id.clone(),
        workflow: init.workflow.clone(),
        summary: Summary {
            status: RunStatus::Running,
            ..Summary::default()
        },
        ..Snapshot::default()
    }));
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let (report_tx, report_rx) = oneshot::channel();
    let tasks = init.tasks.clone();
    let (asks, ask_rx) = ask::Asks::new();
    let engine = RunEngine::new(init, reply, snap_tx, asks);
    // Stopped with its coordinator: dropped where it stands, its report never written.
    tasks.spawn_until_stopped(async move {
        let report = engine.run(ops, control_rx, ask_rx).await;
        let _ = report_tx.send(report);
    });
    RunHandle {
        run_id,
        namespace,
        snapshot: snap_rx,
        notes: Vec::new(),
        control: control_tx,
        report: report_rx,
        tasks,
    }
}

impl RunEngine {
    fn new(
        init: EngineInit,
        reply: ReplySink,
        snapshot: watch::Sender<Arc<Snapshot>>,
        asks: ask::Asks,
    ) -> Self {
        let run: Arc<str> = Arc::from(init.run_id.as_str());
        let events = EventLog::spawn(
            init.store.clone(),
            init.run_id.clone(),
            init.generation,
            init.tasks.tracker(),
        );
        let span = tracing::info_span!(
            "run",
            otel.name = %format_args!("run {}", init.workflow.name),
            flotilla.run_id = %init.run_id,
            flotilla.workflow = %init.workflow.name,
            flotilla.namespace = %init.settings.namespace,
            flotilla.generation = init.generation,
        );
        RunEngine {
            asks,
            idle_since: None,
            span,
            phase_spans: HashMap::new(),
            run,
            started: Instant::now(),
            reply,
            book: CallBook::with_phases(&init.phases),
            admitter: admit::Admitter::default(),
            logs: init.logs_before.clone(),
            published_logs: Arc::new(Vec::new()),
            failures: Vec::new(),
            budgets: budgets::Budgets::new(
                init.shared.clone(),
                init.settings.budget_usd,
                init.settings.budget_tokens,
            ),
            agent_types: None,
            journal: None,
            events,
            status: RunStatus::Running,
            error: None,
            result: Value::Null,
            stopping: false,
            stopping_left: 0,
            waiting: None,
            held: None,
            quota_held: None,
            latest_budget: None,
            waits: 0,
            substitutions: std::collections::BTreeMap::new(),
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
                init.tasks.tracker(),
            ),
            init,
        }
    }

    /// The run's namespace as the dispatcher shares slots by it.
    fn share(&self) -> crate::sched::Share {
        let ns = crate::namespace::effective(&self.init.settings.namespace);
        let policy = self
            .init
            .quotas
            .as_ref()
            .map(|q| q.policy(ns))
            .unwrap_or_default();
        crate::sched::Share {
            namespace: Arc::from(ns),
            weight: policy.weight,
            max_agents: policy.max_agents.map(|m| m as usize),
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// A line in the run's log, kept in its events.
    fn note(&mut self, line: String) {
        self.logs.push(line.clone());
        self.event(RunEvent::Log { line });
    }

    fn event(&mut self, event: RunEvent) {
        self.dirty = true;
        self.events.push(EventRecord {
            t: self.now_ms(),
            event,
        });
    }

    /// Starts the run's journal and head keeper, registers it with the dispatcher and logs its
    /// start. Returns where call events, journal acks and applied changes arrive.
    fn open(
        &mut self,
    ) -> (
        mpsc::UnboundedReceiver<CallEvent>,
        mpsc::UnboundedReceiver<JournalAck>,
        mpsc::UnboundedReceiver<crate::head::Applied>,
    ) {
        let (call_tx, call_rx) = mpsc::unbounded_channel();
        let (ack_tx, ack_rx) = mpsc::unbounded_channel();
        self.journal = Some(Journal::spawn(
            self.init.store.clone(),
            self.init.run_id.clone(),
            self.init.generation,
            ack_tx,
            self.init.tasks.tracker(),
        ));
        let (applied_tx, applied_rx) = mpsc::unbounded_channel();
        // The run's own namespace and repository: its changes are filed there, whatever a
        // worker's message names (settings were validated, so both are well formed).
        if let Some((src, repo)) = self
            .init
            .settings
            .source
            .clone()
            .filter(|s| s.url.is_none())
            .and_then(|s| {
                let repo = crate::source::Repo::new(&self.init.settings.namespace, &s.repo).ok()?;
                Some((s, repo))
            })
        {
            let cache = self
                .init
                .cache_dir
                .clone()
                .unwrap_or_else(|| std::env::temp_dir().join("flotilla-coordinator-cache"));
            let (tx, watch) = crate::head::spawn(
                self.init.store.clone(),
                repo,
                src.commit,
                cache,
                applied_tx,
                self.init.tasks.tracker(),
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
            worker_wait: Duration::from_millis(self.init.settings.worker_wait_ms),
            retry_budget: self.init.settings.retry_budget,
            throttle_wait: Duration::from_millis(self.init.settings.throttle_wait_ms),
            head: self.head_watch.clone(),
            events: call_tx,
            share: self.share(),
            kept: std::mem::take(&mut self.init.kept),
        });
        self.event(RunEvent::Status {
            status: "running".into(),
            error: None,
        });
        for g in self.book.groups().to_vec() {
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

        (call_rx, ack_rx, applied_rx)
    }

    /// Runs until the script ends (or the run is stopped) and returns the report.
    pub async fn run(
        mut self,
        mut ops: mpsc::UnboundedReceiver<ScriptOp>,
        mut control: mpsc::UnboundedReceiver<Control>,
        mut ask_rx: mpsc::UnboundedReceiver<ask::AskEvent>,
    ) -> Ending {
        let (mut call_rx, mut ack_rx, mut applied_rx) = self.open();
        let mut tick = tokio::time::interval(SNAPSHOT_EVERY);
        // The first tick publishes at once.
        let mut last_publish = Instant::now()
            .checked_sub(SNAPSHOT_EVERY)
            .unwrap_or_else(Instant::now);
        let mut publish_every = SNAPSHOT_EVERY;
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stop_deadline: Option<Instant> = None;
        // A closed channel stays ready forever; stop polling it once it has closed.
        let (mut acks_open, mut calls_open, mut control_open) = (true, true, true);
        let end: Option<ScriptEnd> = 'engine: loop {
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
                Some(ev) = ask_rx.recv() => self.on_ask_event(ev),
                op = ops.recv() => match op {
                    Some(ScriptOp::Finished(end)) => break Some(end),
                    Some(op) => self.on_op(op),
                    None => break Some(ScriptEnd::Failed(script::ScriptFailure {
                        kind: script::FailureKind::Internal,
                        message: "the script thread ended without a result".into(),
                        line: None,
                    })),
                },
                c = control.recv(), if control_open && stop_deadline.is_none() => match c {
                    Some(Control::Stop) => {
                        self.begin_stop();
                        stop_deadline = Some(Instant::now() + STOP_GRACE);
                    }
                    Some(Control::Pause(paused)) => self.pause(paused),
                    Some(Control::Note(line)) => self.note(line),
                    Some(Control::Agent { action, agent, reply }) => {
                        let _ = reply.send(self.act_on_agent(action, &agent));
                    }
                    Some(Control::Report(reply)) => {
                        let _ = reply.send(self.report_with(true));
                    }
                    Some(Control::Budget { usd, reply }) => {
                        let _ = reply.send(self.set_budget(usd));
                    }
                    Some(Control::Answer { question, value, by, reply }) => {
                        self.answer(question, value, by, reply);
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
                    self.ask_tick();
                    self.quota_tick();
                    if self.park_due(&ops) {
                        break 'engine None;
                    }
                    if stop_deadline.is_some_and(|d| Instant::now() >= d) {
                        break Some(ScriptEnd::Failed(script::ScriptFailure {
                            kind: script::FailureKind::Stopped,
                            message: "the run was stopped".into(),
                            line: None,
                        }));
                    }
                    // A snapshot walks every call: a run of many calls is published less
                    // often, so at most a twentieth of the engine's time goes to it.
                    if last_publish.elapsed() >= publish_every {
                        let began = Instant::now();
                        self.publish();
                        publish_every = (began.elapsed() * 20).max(SNAPSHOT_EVERY);
                        last_publish = Instant::now();
                    }
                }
            }
        };
        let Some(end) = end else {
            return Ending::Parked(self.park(ops, &mut applied_rx, control).await);
        };
        if self.stopping {
            self.drain(&mut control, control_open).await;
        }
        Ending::Ended(Box::new(
            self.finish(end, &mut ack_rx, &mut applied_rx).await,
        ))
    }

    /// A stopped run, its script ended: `stopping` until none of its agents runs on a worker
    /// any more (each worker has answered its cancel, or was let go), at most [`STOP_DRAIN`].
    /// Meanwhile it answers for its report and refuses what a stopped run cannot do.
    async fn drain(
        &mut self,
        control: &mut mpsc::UnboundedReceiver<Control>,
        mut control_open: bool,
    ) {
        let deadline = Instant::now() + STOP_DRAIN;
        let mut tick = tokio::time::interval(SNAPSHOT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                c = control.recv(), if control_open => match c {
                    Some(Control::Report(reply)) => {
                        let _ = reply.send(self.report_with(true));
                    }
                    Some(
                        Control::Agent { reply, .. }
                        | Control::Budget { reply, .. }
                        | Control::Answer { reply, .. },
                    ) => {
                        let _ = reply.send(Err(flotilla_proto::Problem::new(
                            flotilla_proto::ErrorKind::Conflict,
                            "the run is stopping",
                        )));
                    }
                    Some(Control::Note(line)) => self.note(line),
                    Some(Control::Stop | Control::Pause(_)) => {}
                    None => control_open = false,
                },
                _ = tick.tick() => {
                    let left = self.init.dispatch.in_flight(&self.run).await as u64;
                    if left != self.stopping_left {
                        self.stopping_left = left;
                        self.dirty = true;
                    }
                    if left == 0 {
                        break;
                    }
                    if Instant::now() >= deadline {
                        tracing::warn!(run = %self.run, agents = left, "a stopped run's agents did not leave their workers in time; it ends anyway");
                        break;
                    }
                    self.publish();
                }
            }
        }
        self.stopping_left = 0;
        self.dirty = true;
    }

    fn reject(&self, id: u64, code: RejectCode, message: impl Into<String>) {
        (self.reply)(HostReply::Agent {
            id,
            result: Err(HostError::new(code, message)),
        });
    }

    /// The place of group `title`, added (and told) when it is new.
    fn ensure_group(&mut self, title: &str) -> usize {
        let (at, new) = self.book.group(title);
        if new {
            self.event(RunEvent::Group {
                title: title.to_owned(),
            });
        }
        at
    }

    fn on_op(&mut self, op: ScriptOp) {
        match op {
            ScriptOp::Agent {
                id,
                prompt,
                opts_json,
                group,
                child: _,
            } => self.on_agent(
                id,
                admit::Request {
                    prompt,
                    opts_json,
                    group,
                },
            ),
            ScriptOp::Ask {
                id,
                question,
                opts_json,
            } => self.on_ask(id, question, &opts_json),
            ScriptOp::Phase(title) => {
                self.ensure_group(&title);
            }
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
                    .map_err(|e| e.to_string())
                    .and_then(|found| {
                        let prepared = text::prepare(&found.source)
                            .map_err(|e| format!("workflow {:?} cannot run: {e}", found.name))?;
                        Ok((found.name, script::runnable_body(&prepared)))
                    })
                    .map_err(|e| HostError::new(RejectCode::WorkflowNotFound, e));
                (self.reply)(HostReply::Workflow { id, result });
            }
            ScriptOp::Finished(_) => {}
        }
    }
}

#[cfg(test)]
mod tests;
