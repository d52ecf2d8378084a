//! The dispatcher: one actor that puts the calls of every run onto worker slots.
//!
//! Runs register with their limits; the run engine submits one [`Ticket`] per call and gets
//! [`CallEvent`]s back. Workers attach through a [`CoordinatorEnd`] (in-process) — the same
//! messages a remote worker sends over gRPC — announce their slots in `Hello`, and receive
//! assignments only against free slots.
//!
//! What the dispatcher decides:
//! - **order**: runs take turns (round robin) so one big run cannot starve another; within a
//!   run, calls go in submission order; a restarted call goes to the front;
//! - **limits**: per-run concurrency (W38) and worker slots; the run engine owns the budgets
//!   and says when they stop calls, and the calls end here, where their outcomes come in
//!   (a call whose outcome is in already is not stopped);
//! - **prefix stagger** (W60): the first call of a prefix group goes alone; the others of the
//!   group wait until its response begins or the hold cap passes;
//! - **usage-limit waits** (W59): a rate-limited attempt makes its call wait `retry_after`
//!   and closes the backend/model gate for everyone until then; the wait is not a failure;
//! - **stalls** (W58): an attempt with no progress for the stall timeout (tool calls in
//!   flight excepted) is cancelled and restarted, up to the attempt limit;
//! - **fencing**: every attempt is a key `/flotilla/attempts/{run}/{call}` under its worker's
//!   lease, written before the assignment is sent; the key's revision is the attempt's fence.
//!   Only the outcome of a call's current attempt, on its current worker, with its fence, is
//!   accepted; anything else is dropped (its usage is still counted);
//! - **liveness** (`workers.rs`): each worker holds a lease the coordinator keeps alive while
//!   the worker's stream is up. A worker that is cut off keeps its attempts for one lease TTL:
//!   if it comes back in time it reports what it holds and carries on; otherwise its lease
//!   lapses, its attempt keys vanish with it, and the watch on them restarts those calls.
//!
//! Invariant: each call ends with at most one `Finished` event, and every assignment's slot is
//! returned when its worker reports the outcome (or the worker goes away).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::link::CoordinatorEnd;
use flotilla_proto::v1::{
    self, CoordinatorMessage, FailureKind, ProgressKind, WorkerMessage, coordinator_message,
    outcome, worker_message,
};
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::time::{DelayQueue, delay_queue};

pub use crate::call::{CallEvent, CallFailure, CallResult, Retry};
use crate::call::{State, human};
use crate::lease::{self, LeaseId, LeaseStore, Revision, WatchEvent};

mod leftovers;
mod workers;

use workers::{KeyOp, LeaseCtl, PendingPut, Refusal};

/// How long a warm prefix group stays warm after its last dispatch (the prompt cache TTL).
const WARM_FOR: Duration = Duration::from_secs(300);
/// Shortest wait after a usage or rate limit (a backend saying "retry after 0" must not spin).
const MIN_LIMIT_WAIT: Duration = Duration::from_millis(50);
/// Longest reset a call waits for (W59); a later reset fails the call.
const MAX_LIMIT_WAIT: Duration = Duration::from_secs(24 * 3600);
/// Usage-limit waits one call may go through before it fails.
const MAX_LIMIT_WAITS: u32 = 100;
/// Default TTL of a worker's liveness lease.
pub const WORKER_LEASE_TTL: Duration = Duration::from_secs(10);

/// How the dispatcher treats workers.
#[derive(Debug, Clone)]
pub struct DispatchOptions {
    /// TTL of each worker's liveness lease: how long a cut-off worker keeps its attempts.
    pub worker_ttl: Duration,
    /// The workers are all there is (the embedded mode): a call none of the attached workers
    /// can run fails at once instead of waiting for one that offers its backend.
    pub fixed_fleet: bool,
}

impl Default for DispatchOptions {
    fn default() -> Self {
        DispatchOptions {
            worker_ttl: WORKER_LEASE_TTL,
            fixed_fleet: false,
        }
    }
}

/// The limits and channels of one run.
#[derive(Debug, Clone)]
pub struct RunRegistration {
    pub run_id: Arc<str>,
    pub concurrency: usize,
    pub stall_timeout: Duration,
    pub max_attempts: u32,
    pub stagger: Duration,
    /// How long a call waits for an attached worker that offers its backend and model.
    pub worker_wait: Duration,
    /// The run's head (fleet runs with a source): every attempt starts from it as it stands
    /// when the attempt is sent.
    pub head: Option<tokio::sync::watch::Receiver<String>>,
    pub events: mpsc::UnboundedSender<CallEvent>,
}

/// One call to run.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub call: u64,
    pub key: String,
    pub task: v1::TaskSpec,
    pub prefix_group: u64,
    /// The call's trace span; each attempt's span is its child, and travels to the worker in
    /// the assignment's `trace_context` (W3C trace context).
    pub span: tracing::Span,
}

enum Msg {
    Register(RunRegistration),
    Submit {
        run: Arc<str>,
        ticket: Box<Ticket>,
    },
    Cancel {
        run: Arc<str>,
        call: u64,
        reason: String,
    },
    CloseRun {
        run: Arc<str>,
    },
    /// W54: a paused run starts nothing; its running attempts are interrupted and go back to
    /// the front of its queue (not counted as attempts).
    PauseRun {
        run: Arc<str>,
        paused: bool,
    },
    /// W55: one call stops; it ends failed (why: `failure`, `message`).
    StopCall {
        run: Arc<str>,
        call: u64,
        failure: CallFailure,
        message: String,
    },
    /// W35: the run's token budget is spent.
    BudgetSpent {
        run: Arc<str>,
        message: String,
    },
    /// W56: one call's running attempt is abandoned and a new one starts at once.
    RestartCall {
        run: Arc<str>,
        call: u64,
    },
    Attach(CoordinatorEnd),
    FromWorker {
        worker: u64,
        msg: Box<WorkerMessage>,
    },
    /// A worker's link ended (`link` tells a stale link from the current one).
    LinkClosed {
        worker: u64,
        link: u64,
    },
    Watch(WatchEvent),
    LeaseGranted {
        worker: Arc<str>,
        lease: LeaseId,
        revision: Revision,
    },
    LeaseLost {
        worker: Arc<str>,
        lease: LeaseId,
    },
    /// Attempt keys are written; their assignments may go.
    Written {
        puts: Vec<PendingPut>,
        revision: Revision,
    },
    /// Attempt keys the store would not write (their worker's lease is gone, or the store
    /// refused them).
    Refused {
        puts: Vec<PendingPut>,
        why: Refusal,
    },
    Stats(tokio::sync::oneshot::Sender<Stats>),
    Workers(tokio::sync::oneshot::Sender<Vec<WorkerView>>),
    /// What an attempt left is stored (`Ok`: the partial commit and its base) or not.
    PartialStored {
        run: Arc<str>,
        call: u64,
        attempt: u32,
        stored: Result<(String, String), String>,
    },
}

/// One attached worker, as `flotilla workers` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView {
    pub name: String,
    /// Its stream is up (otherwise it is cut off and its lease is running out).
    pub attached: bool,
    pub slots: u32,
    pub busy: u32,
    pub backends: Vec<String>,
    pub models: Vec<String>,
    pub labels: std::collections::BTreeMap<String, String>,
}

/// Counters for tests and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub workers: usize,
    pub slots: u32,
    pub busy: u32,
    pub queued: usize,
    pub running: usize,
    /// Attempts assigned since the dispatcher started.
    pub assigned: u64,
}

/// Cheap handle to the dispatcher.
#[derive(Clone)]
pub struct DispatchHandle {
    tx: mpsc::UnboundedSender<Msg>,
}

impl std::fmt::Debug for DispatchHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatchHandle").finish_non_exhaustive()
    }
}

impl DispatchHandle {
    pub fn register(&self, reg: RunRegistration) {
        let _ = self.tx.send(Msg::Register(reg));
    }
    pub fn submit(&self, run: &Arc<str>, ticket: Ticket) {
        let _ = self.tx.send(Msg::Submit {
            run: run.clone(),
            ticket: Box::new(ticket),
        });
    }
    /// Cancels one call (its run ended it): a running attempt is told `reason`.
    pub fn cancel(&self, run: &Arc<str>, call: u64, reason: &str) {
        let _ = self.tx.send(Msg::Cancel {
            run: run.clone(),
            call,
            reason: reason.to_owned(),
        });
    }
    /// Pauses (`true`) or resumes a run.
    pub fn pause_run(&self, run: &Arc<str>, paused: bool) {
        let _ = self.tx.send(Msg::PauseRun {
            run: run.clone(),
            paused,
        });
    }
    /// Stops one call: unless its outcome is in already, it ends `Failed` with `failure` and
    /// `message` (the dispatcher is where an outcome and a stop meet, so it decides).
    pub fn stop_call(&self, run: &Arc<str>, call: u64, failure: CallFailure, message: &str) {
        let _ = self.tx.send(Msg::StopCall {
            run: run.clone(),
            call,
            failure,
            message: message.to_owned(),
        });
    }
    /// The run's token budget is spent (W35): every call of it that has not started ends
    /// `Failed` with `message`, now or when it would start; running ones complete.
    pub fn budget_spent(&self, run: &Arc<str>, message: &str) {
        let _ = self.tx.send(Msg::BudgetSpent {
            run: run.clone(),
            message: message.to_owned(),
        });
    }
    /// Restarts one running call as a new attempt.
    pub fn restart_call(&self, run: &Arc<str>, call: u64) {
        let _ = self.tx.send(Msg::RestartCall {
            run: run.clone(),
            call,
        });
    }
    /// Cancels everything of a run and forgets it.
    pub fn close_run(&self, run: &Arc<str>) {
        let _ = self.tx.send(Msg::CloseRun { run: run.clone() });
    }
    /// Attaches a worker link (an in-process worker, or a gRPC stream bridged to channels).
    pub fn attach(&self, end: CoordinatorEnd) {
        let _ = self.tx.send(Msg::Attach(end));
    }
    /// The workers with a lease: attached, or cut off and not yet lapsed.
    pub async fn workers(&self) -> Vec<WorkerView> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Msg::Workers(tx)).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    pub async fn stats(&self) -> Option<Stats> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx.send(Msg::Stats(tx)).ok()?;
        rx.await.ok()
    }
}

type CallId = (Arc<str>, u64);

struct CallState {
    ticket: Ticket,
    /// Only the live states: the dispatcher forgets a call once it ends.
    state: State,
    attempt: u32,
    counted: u32,
    worker: Option<u64>,
    /// Revision of the current attempt's key; `None` until it is written (the assignment is
    /// sent only then).
    fence: Option<Revision>,
    /// An attempt taken over from a coordinator that went away: the fence it was started
    /// with (its outcome carries that one), and no assignment is sent for it.
    adopted_fence: Option<Revision>,
    last_progress: Instant,
    in_tool: bool,
    captured: Option<String>,
    stall_key: Option<delay_queue::Key>,
    /// Usage-limit waits so far (not counted as attempts).
    limit_waits: u32,
    /// When the call last became ready to run (dispatch latency counts from here).
    ready_at: Instant,
    /// The current attempt's trace span (`attempt`, a child of the call's).
    attempt_span: tracing::Span,
    /// The source commit the last assignment started from.
    sent_base: String,
}

impl CallState {
    /// Moves along the call lifecycle ([`State::allows`]).
    fn set(&mut self, to: State) {
        let moved = self.state.go(to);
        debug_assert!(
            moved,
            "call {} cannot go from {:?} to {:?}",
            self.ticket.call, self.state, to
        );
    }

    /// Back in its run's queue: ready to run from now (dispatch latency counts from here).
    fn make_ready(&mut self) {
        self.set(State::Queued);
        self.ready_at = Instant::now();
    }
}

struct RunState {
    reg: RunRegistration,
    running: usize,
    queue: VecDeque<u64>,
    paused: bool,
    /// The token budget is spent: calls that have not started end with this.
    budget_spent: Option<String>,
}

struct WorkerState {
    name: Arc<str>,
    /// The current link; `None` while the worker is cut off.
    tx: Option<mpsc::UnboundedSender<CoordinatorMessage>>,
    /// Which link is current (links of a worker that reconnects are told apart by this).
    link: u64,
    /// Ends the current link's reader.
    link_alive: CancellationToken,
    /// Where the current link's reader sends (a reconnecting worker's link is re-pointed at
    /// the worker's existing state).
    target: Arc<std::sync::atomic::AtomicU64>,
    /// `Hello` received.
    named: bool,
    /// `Welcome` sent on the current link.
    welcomed: bool,
    slots: u32,
    busy: u32,
    backends: HashSet<String>,
    models: HashSet<String>,
    labels: std::collections::BTreeMap<String, String>,
    /// Assignments this worker holds a slot for: (run, call, attempt).
    running: HashSet<(Arc<str>, u64, u32)>,
    /// Attempts it held when it attached that this coordinator did not assign: a run taken
    /// over from a coordinator that went away may claim them (see `workers.rs`).
    orphans: Vec<v1::AttemptRef>,
    /// Outcomes of orphans that arrived before a run claimed them.
    orphan_outcomes: HashMap<(Arc<str>, u64, u32), v1::Outcome>,
    /// Its liveness lease, once granted, and the revision of its registration key.
    lease: Option<LeaseId>,
    reg_revision: Revision,
    ctl: Option<Arc<LeaseCtl>>,
}

impl WorkerState {
    /// May take assignments: attached, named, with a live lease.
    fn ready(&self) -> bool {
        self.tx.is_some() && self.named && self.lease.is_some()
    }

    /// Has the task's backend (and model, when it lists models).
    fn offers(&self, task: &v1::TaskSpec) -> bool {
        (self.backends.is_empty() || self.backends.contains(&task.backend))
            && (self.models.is_empty()
                || task.model.is_empty()
                || self.models.contains(&task.model))
    }
}

#[derive(Default)]
struct PrefixState {
    leader: Option<u64>,
    since: Option<Instant>,
    open_until: Option<Instant>,
    held: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Timer {
    Stall(Arc<str>, u64, u32),
    /// The hold cap of a prefix group's leader: (run, group, leader call).
    Hold(Arc<str>, u64, u64),
    Gate(String),
    Retry(Arc<str>, u64),
    /// Backstop for a cut-off worker whose lease lapse was never seen: (worker, link).
    Lapse(u64, u64),
    /// Held attempts nobody claimed by now are cancelled: (worker, link).
    Orphans(u64, u64),
    /// A call that no attached worker can run fails if it still cannot by now.
    NoWorker(Arc<str>, u64),
    /// A restarted call stops waiting for what its interrupted attempt leaves: (run, call,
    /// attempt).
    Salvage(Arc<str>, u64, u32),
}

/// Starts the dispatcher with default options. Worker liveness leases go to `leases`.
pub fn spawn(leases: Arc<dyn LeaseStore>, cancel: CancellationToken) -> DispatchHandle {
    spawn_with(leases, DispatchOptions::default(), None, cancel)
}

/// Starts the dispatcher; `sources` is the store workers' source requests are answered from.
pub fn spawn_with(
    leases: Arc<dyn LeaseStore>,
    opts: DispatchOptions,
    sources: Option<crate::store::Store>,
    cancel: CancellationToken,
) -> DispatchHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let handle = DispatchHandle { tx: tx.clone() };
    let keys = workers::spawn_key_writer(leases.clone(), tx.clone(), cancel.clone());
    workers::spawn_watches(leases.clone(), tx.clone(), cancel.clone());
    let d = Dispatcher {
        tx,
        opts,
        keys,
        by_name: HashMap::new(),
        assigned: 0,
        adopted: HashMap::new(),
        leases,
        runs: HashMap::new(),
        rr: VecDeque::new(),
        calls: HashMap::new(),
        workers: HashMap::new(),
        next_worker: 0,
        prefixes: HashMap::new(),
        gates: HashMap::new(),
        gated: HashMap::new(),
        unplaceable: HashMap::new(),
        sources,
        source_acks: HashMap::new(),
        leftovers: leftovers::Leftovers::default(),
        timers: DelayQueue::new(),
    };
    tokio::spawn(d.run(rx, cancel));
    handle
}

struct Dispatcher {
    tx: mpsc::UnboundedSender<Msg>,
    opts: DispatchOptions,
    /// Attempt-key writes, applied in order by the key writer.
    keys: mpsc::UnboundedSender<KeyOp>,
    by_name: HashMap<Arc<str>, u64>,
    /// Attempts assigned so far.
    assigned: u64,
    /// Links that a known worker took over on reattaching: link id → worker id. Messages a
    /// link's reader tagged with the link id before the takeover are resolved through it.
    adopted: HashMap<u64, u64>,
    leases: Arc<dyn LeaseStore>,
    runs: HashMap<Arc<str>, RunState>,
    rr: VecDeque<Arc<str>>,
    calls: HashMap<CallId, CallState>,
    workers: HashMap<u64, WorkerState>,
    next_worker: u64,
    prefixes: HashMap<(Arc<str>, u64), PrefixState>,
    gates: HashMap<String, Instant>,
    gated: HashMap<String, Vec<CallId>>,
    /// Calls set aside because no attached worker offers their backend and model: since when,
    /// why, and when they give up. They go back to their queues whenever a worker becomes
    /// ready.
    unplaceable: HashMap<CallId, (Instant, String, Instant)>,
    /// Where runs' sources are (answers to workers' `SourceRequest`s).
    sources: Option<crate::store::Store>,
    /// Source transfers under way, by worker and request: where the worker's acknowledgments
    /// go (see [`crate::source::serve`]).
    source_acks: HashMap<(u64, u64), tokio::sync::watch::Sender<u64>>,
    /// What unfinished attempts left, and retries that wait for it (W58).
    leftovers: leftovers::Leftovers,
    timers: DelayQueue<Timer>,
}

fn gate_of(task: &v1::TaskSpec) -> String {
    format!("{}/{}", task.backend, task.model)
}

impl Dispatcher {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>, cancel: CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                msg = rx.recv() => match msg {
                    Some(msg) => self.handle(msg),
                    None => break,
                },
                Some(expired) = self.timers.next(), if !self.timers.is_empty() => {
                    self.timer(expired.into_inner());
                }
            }
            self.pump();
        }
        for w in self.workers.values() {
            w.link_alive.cancel();
            if let Some(ctl) = &w.ctl {
                ctl.stop();
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Register(reg) => {
                let id = reg.run_id.clone();
                self.runs.insert(
                    id.clone(),
                    RunState {
                        reg,
                        running: 0,
                        queue: VecDeque::new(),
                        paused: false,
                        budget_spent: None,
                    },
                );
                self.rr.push_back(id);
            }
            Msg::Submit { run, ticket } => {
                let ticket = *ticket;
                let Some(r) = self.runs.get_mut(&run) else {
                    return;
                };
                r.queue.push_back(ticket.call);
                let claim = (run.clone(), ticket.call);
                self.calls.insert(
                    (run, ticket.call),
                    CallState {
                        ticket,
                        state: State::Queued,
                        attempt: 0,
                        counted: 0,
                        worker: None,
                        fence: None,
                        adopted_fence: None,
                        last_progress: Instant::now(),
                        in_tool: false,
                        captured: None,
                        stall_key: None,
                        limit_waits: 0,
                        ready_at: Instant::now(),
                        attempt_span: tracing::Span::none(),
                        sent_base: String::new(),
                    },
                );
                self.claim_orphans(&claim);
            }
            Msg::Cancel { run, call, reason } => self.cancel_call(&(run, call), &reason),
            Msg::PauseRun { run, paused } => self.pause_run(&run, paused),
            Msg::StopCall {
                run,
                call,
                failure,
                message,
            } => {
                let id = (run, call);
                if self.calls.contains_key(&id) {
                    self.cancel_call(&id, &message);
                    if let Some(r) = self.runs.get(&id.0) {
                        let _ = r.reg.events.send(CallEvent::Finished {
                            call: id.1,
                            result: CallResult::Failed { failure, message },
                        });
                    }
                }
            }
            Msg::BudgetSpent { run, message } => self.budget_spent(&run, message),
            Msg::RestartCall { run, call } => {
                let id = (run, call);
                let running = self
                    .calls
                    .get(&id)
                    .is_some_and(|c| c.state == State::Running);
                if running {
                    self.send_cancel(&id, "restarted by the user");
                    self.leave_running(&id);
                    self.retry_or_fail(&id, Retry::User);
                }
            }
            Msg::CloseRun { run } => {
                let ids: Vec<CallId> = self
                    .calls
                    .keys()
                    .filter(|(r, _)| *r == run)
                    .cloned()
                    .collect();
                for id in ids {
                    self.cancel_call(&id, "the run ended");
                }
                self.runs.remove(&run);
                self.rr.retain(|r| *r != run);
                self.prefixes.retain(|(r, _), _| *r != run);
            }
            Msg::PartialStored {
                run,
                call,
                attempt,
                stored,
            } => self.partial_stored(&(run, call), attempt, stored),
            Msg::Attach(end) => self.attach(end),
            Msg::FromWorker { worker, msg } => self.on_worker(worker, *msg),
            Msg::LinkClosed { worker, link } => self.link_closed(worker, link),
            Msg::Watch(ev) => self.watched(ev),
            Msg::LeaseGranted {
                worker,
                lease,
                revision,
            } => self.lease_granted(&worker, lease, revision),
            Msg::LeaseLost { worker, lease } => self.lease_lost(&worker, lease),
            Msg::Written { puts, revision } => self.written(puts, revision),
            Msg::Refused { puts, why } => self.refused(puts, why),
            Msg::Workers(reply) => {
                let mut out: Vec<WorkerView> = self
                    .workers
                    .values()
                    .filter(|w| w.named && w.lease.is_some())
                    .map(|w| {
                        let mut backends: Vec<String> = w.backends.iter().cloned().collect();
                        backends.sort();
                        let mut models: Vec<String> = w.models.iter().cloned().collect();
                        models.sort();
                        WorkerView {
                            name: w.name.to_string(),
                            attached: w.tx.is_some(),
                            slots: w.slots,
                            busy: w.busy,
                            backends,
                            models,
                            labels: w.labels.clone(),
                        }
                    })
                    .collect();
                out.sort_by(|a, b| a.name.cmp(&b.name));
                let _ = reply.send(out);
            }
            Msg::Stats(reply) => {
                let _ = reply.send(Stats {
                    workers: self.workers.values().filter(|w| w.ready()).count(),
                    slots: self.workers.values().map(|w| w.slots).sum(),
                    busy: self.workers.values().map(|w| w.busy).sum(),
                    queued: self.runs.values().map(|r| r.queue.len()).sum(),
                    running: self.runs.values().map(|r| r.running).sum(),
                    assigned: self.assigned,
                });
            }
        }
    }

    fn on_worker(&mut self, worker: u64, msg: WorkerMessage) {
        let worker = self.adopted.get(&worker).copied().unwrap_or(worker);
        let Some(msg) = msg.msg else { return };
        match msg {
            worker_message::Msg::Hello(h) => self.hello(worker, h),
            worker_message::Msg::Progress(p) => self.progress(worker, p),
            worker_message::Msg::Transcript(t) => {
                let id: CallId = (Arc::from(t.run_id.as_str()), t.call);
                if let Some(r) = self.runs.get(&id.0) {
                    let _ = r.reg.events.send(CallEvent::Transcript {
                        call: t.call,
                        attempt: t.attempt,
                        events: t.events,
                    });
                }
            }
            worker_message::Msg::Outcome(o) => self.outcome(worker, o),
            // Put back together by the gRPC bridge; a stray one means nothing.
            worker_message::Msg::Fragment(_) => {}
            // The store is read off the actor; the answer goes straight to the worker's link.
            worker_message::Msg::SourceRequest(req) => {
                if let Some(acks) = self.source_acks.get(&(worker, req.id))
                    && !acks.is_closed()
                {
                    if req.acked > 0 {
                        acks.send_replace(req.acked);
                    }
                    return;
                }
                // Transfers that ended leave their entries; they go as new ones come.
                self.source_acks.retain(|_, a| !a.is_closed());
                if req.acked > 0 {
                    return;
                }
                let tx = self.workers.get(&worker).and_then(|w| w.tx.clone());
                match (&self.sources, tx) {
                    (Some(store), Some(tx)) => {
                        let (acks, acked) = tokio::sync::watch::channel(0u64);
                        self.source_acks.insert((worker, req.id), acks);
                        tokio::spawn(crate::source::serve(store.clone(), req, tx, acked));
                    }
                    (None, Some(tx)) => {
                        let _ = tx.send(CoordinatorMessage {
                            msg: Some(coordinator_message::Msg::SourceData(v1::SourceData {
                                request: req.id,
                                done: true,
                                error: "this coordinator keeps no sources".into(),
                                ..v1::SourceData::default()
                            })),
                        });
                    }
                    _ => {}
                }
            }
        }
    }

    fn progress(&mut self, worker: u64, p: v1::Progress) {
        let id: CallId = (Arc::from(p.run_id.as_str()), p.call);
        let Some(c) = self.calls.get_mut(&id) else {
            return;
        };
        if c.state != State::Running
            || c.attempt != p.attempt
            || c.worker != Some(worker)
            || c.fence.is_none()
        {
            return;
        }
        c.last_progress = Instant::now();
        let kind = ProgressKind::try_from(p.kind).unwrap_or(ProgressKind::Unspecified);
        match kind {
            ProgressKind::ToolStarted => c.in_tool = true,
            ProgressKind::ToolFinished => c.in_tool = false,
            ProgressKind::StructuredCaptured => c.captured = Some(p.detail),
            _ => {}
        }
        let began = matches!(
            kind,
            ProgressKind::ResponseStarted | ProgressKind::Output | ProgressKind::StructuredCaptured
        );
        let group = c.ticket.prefix_group;
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r.reg.events.send(CallEvent::Progress {
                call: id.1,
                attempt: p.attempt,
                output_tokens: p.output_tokens,
            });
        }
        if began {
            self.open_prefix(&id.0, group, Some(id.1), true);
        }
    }

    /// Lets the held calls of a prefix group go. `warm`: the leader's response began.
    fn open_prefix(&mut self, run: &Arc<str>, group: u64, leader: Option<u64>, warm: bool) {
        let Some(p) = self.prefixes.get_mut(&(run.clone(), group)) else {
            return;
        };
        if leader.is_some() && p.leader != leader {
            return;
        }
        if warm {
            p.open_until = Some(Instant::now() + WARM_FOR);
        }
        let held = std::mem::take(&mut p.held);
        if let Some(r) = self.runs.get_mut(run) {
            for call in held.into_iter().rev() {
                if let Some(c) = self.calls.get_mut(&(run.clone(), call))
                    && c.state == State::Held
                {
                    c.make_ready();
                    r.queue.push_front(call);
                }
            }
        }
    }

    fn outcome(&mut self, worker: u64, o: v1::Outcome) {
        let id: CallId = (Arc::from(o.run_id.as_str()), o.call);
        if let Some(w) = self.workers.get_mut(&worker)
            && w.running.remove(&(id.0.clone(), id.1, o.attempt))
        {
            w.busy = w.busy.saturating_sub(1);
        }
        let usage = o.usage.unwrap_or_default();
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r.reg.events.send(CallEvent::Usage {
                call: o.call,
                attempt: o.attempt,
                usage,
            });
        }
        let current = self.calls.get(&id).is_some_and(|c| {
            c.state == State::Running
                && c.attempt == o.attempt
                && c.worker == Some(worker)
                && (c.fence == Some(o.fence) || c.adopted_fence == Some(o.fence))
        });
        let awaited = self.leftovers.awaits(&id, o.attempt)
            && self
                .calls
                .get(&id)
                .is_some_and(|c| c.worker == Some(worker));
        if !current && awaited {
            // The interrupted attempt of a restarted call: what it left is all we want.
            let partial = match o.result {
                Some(outcome::Result::Failure(f)) => f.partial,
                _ => None,
            };
            let storing = partial.is_some_and(|p| self.keep_partial(&id, o.attempt, p));
            if !storing {
                self.salvaged(&id, o.attempt);
            }
            return;
        }
        if !current {
            // An attempt from a coordinator that went away, not claimed yet: keep its outcome
            // for the run that takes it over.
            let claimable = self.calls.get(&id).is_none_or(|c| c.state == State::Queued);
            if claimable
                && let Some(w) = self.workers.get_mut(&worker)
                && w.orphans.iter().any(|a| {
                    a.run_id == *id.0
                        && a.call == id.1
                        && a.attempt == o.attempt
                        && a.fence == o.fence
                })
            {
                w.orphan_outcomes.insert((id.0.clone(), id.1, o.attempt), o);
                self.claim_orphans(&id);
                return;
            }
            tracing::info!(run = %id.0, call = id.1, attempt = o.attempt, fence = o.fence, "dropping the outcome of an attempt that is no longer current (fenced)");
            return;
        }
        self.leave_running(&id);
        match o.result {
            Some(outcome::Result::Completed(done)) => {
                self.finish(&id, CallResult::Completed(done));
            }
            Some(outcome::Result::Failure(mut f)) => {
                let kind = FailureKind::try_from(f.kind).unwrap_or(FailureKind::Terminal);
                let again = matches!(
                    kind,
                    FailureKind::RateLimited
                        | FailureKind::Retryable
                        | FailureKind::Cancelled
                        | FailureKind::Unspecified
                );
                if again
                    && let Some(p) = f.partial.take()
                    && self.keep_partial(&id, o.attempt, p)
                {
                    // The retry waits until it is stored.
                    self.leftovers.wait_for(&id, o.attempt, false);
                }
                match kind {
                    FailureKind::RateLimited => {
                        let waits = self.calls.get_mut(&id).map_or(0, |c| {
                            c.limit_waits += 1;
                            c.limit_waits
                        });
                        let wait = Duration::from_millis(f.retry_after_ms).max(MIN_LIMIT_WAIT);
                        if wait > MAX_LIMIT_WAIT {
                            self.fail(&id, CallFailure::Terminal, format!(
                                "usage limit: the backend resets in {}s, more than the 24 h a call waits ({})",
                                wait.as_secs(), f.message
                            ));
                        } else if waits > MAX_LIMIT_WAITS {
                            self.fail(
                                &id,
                                CallFailure::Terminal,
                                format!(
                                    "usage limit: still limited after {MAX_LIMIT_WAITS} waits ({})",
                                    f.message
                                ),
                            );
                        } else {
                            self.wait_rate_limit(&id, wait, o.attempt);
                        }
                    }
                    FailureKind::Retryable | FailureKind::Cancelled | FailureKind::Unspecified => {
                        self.retry_or_fail(&id, Retry::Transient { message: f.message });
                    }
                    FailureKind::Terminal => self.fail(&id, CallFailure::Terminal, f.message),
                    FailureKind::Timeout => self.fail(&id, CallFailure::Terminal, f.message),
                    FailureKind::Schema => self.fail(&id, CallFailure::Schema, f.message),
                    FailureKind::Invalid => self.fail(&id, CallFailure::Invalid, f.message),
                }
            }
            None => self.retry_or_fail(
                &id,
                Retry::Transient {
                    message: "the worker sent an outcome without a result".into(),
                },
            ),
        }
    }

    /// Bookkeeping when a call's current attempt stops running.
    fn leave_running(&mut self, id: &CallId) {
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        if c.state != State::Running {
            return;
        }
        if let Some(key) = c.stall_key.take() {
            self.timers.remove(&key);
        }
        let sent = c.fence.take().is_some();
        c.adopted_fence = None;
        c.make_ready();
        c.in_tool = false;
        let group = c.ticket.prefix_group;
        if let Some(r) = self.runs.get_mut(&id.0) {
            r.running = r.running.saturating_sub(1);
        }
        if sent {
            self.write_key(KeyOp::Delete {
                key: lease::keys::attempt(&id.0, id.1),
            });
        }
        // A leader that ends without its response beginning hands the lead on.
        let leader_ended = self
            .prefixes
            .get(&(id.0.clone(), group))
            .is_some_and(|p| p.leader == Some(id.1));
        if leader_ended {
            if let Some(p) = self.prefixes.get_mut(&(id.0.clone(), group)) {
                p.leader = None;
                p.since = None;
            }
            self.open_prefix(&id.0, group, None, false);
        }
    }

    fn finish(&mut self, id: &CallId, result: CallResult) {
        self.leftovers.forget(id);
        if let Some(c) = self.calls.remove(id) {
            c.attempt_span.record("outcome", result.span_outcome());
            if let Some(key) = c.stall_key {
                self.timers.remove(&key);
            }
        }
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r
                .reg
                .events
                .send(CallEvent::Finished { call: id.1, result });
        }
    }

    fn fail(&mut self, id: &CallId, failure: CallFailure, message: String) {
        self.finish(id, CallResult::Failed { failure, message });
    }

    fn wait_rate_limit(&mut self, id: &CallId, wait: Duration, attempt: u32) {
        let until = Instant::now() + wait;
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        c.set(State::Waiting);
        let gate = gate_of(&c.ticket.task);
        let counted = c.counted;
        let e = self.gates.entry(gate.clone()).or_insert(until);
        if *e < until {
            *e = until;
        }
        self.timers
            .insert_at(Timer::Retry(id.0.clone(), id.1), until);
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r.reg.events.send(CallEvent::Retrying {
                call: id.1,
                attempt,
                retry: Retry::RateLimited { wait },
                counted,
            });
        }
    }

    /// Counts a failed attempt; starts another one or fails the call at the limit.
    fn retry_or_fail(&mut self, id: &CallId, retry: Retry) {
        let salvageable = self.salvageable(id);
        let Some(r) = self.runs.get(&id.0) else {
            self.calls.remove(id);
            self.leftovers.forget(id);
            return;
        };
        let max = r.reg.max_attempts;
        let stall_timeout = r.reg.stall_timeout;
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        c.counted += 1;
        let (counted, attempt) = (c.counted, c.attempt);
        if counted >= max {
            let (failure, message) = retry.exhausted(max, stall_timeout);
            self.fail(id, failure, message);
            return;
        }
        let _ = r.reg.events.send(CallEvent::Retrying {
            call: id.1,
            attempt,
            retry: retry.clone(),
            counted,
        });
        c.attempt_span.record("outcome", retry.span_outcome());
        crate::metrics::inc(match &retry {
            Retry::Stalled { .. } => &crate::metrics::RESTARTS_STALL,
            Retry::User => &crate::metrics::RESTARTS_USER,
            Retry::Transient { message } if message.contains("lease") => {
                &crate::metrics::RESTARTS_LAPSE
            }
            _ => &crate::metrics::RESTARTS_TRANSIENT,
        });
        if retry.at_once() && salvageable {
            // What the interrupted attempt left comes with its outcome (W58): the retry
            // waits for it, a while.
            c.set(State::Waiting);
            self.leftovers.wait_for(id, attempt, true);
            self.timers.insert_at(
                Timer::Salvage(id.0.clone(), id.1, attempt),
                Instant::now() + leftovers::WAIT,
            );
        } else if retry.at_once() {
            // Same prompt, fresh transcript, at once and ahead of the queue.
            c.make_ready();
            if let Some(r) = self.runs.get_mut(&id.0) {
                r.queue.push_front(id.1);
            }
        } else {
            let backoff = Duration::from_millis((100u64 << counted.min(6)).min(5_000));
            c.set(State::Waiting);
            self.timers
                .insert_at(Timer::Retry(id.0.clone(), id.1), Instant::now() + backoff);
        }
    }

    /// Whether a restarted call's interrupted attempt can still send what it left: the run
    /// has a stored source and the attempt's worker is attached.
    fn salvageable(&self, id: &CallId) -> bool {
        let stored =
            self.sources.is_some() && self.runs.get(&id.0).is_some_and(|r| r.reg.head.is_some());
        stored
            && self
                .calls
                .get(id)
                .and_then(|c| c.worker)
                .and_then(|w| self.workers.get(&w))
                .is_some_and(|w| w.tx.is_some())
    }

    /// Stores what attempt `attempt` of a call left (off the actor; `PartialStored` comes
    /// back). `false`: nothing to store, or it is not this call's.
    fn keep_partial(&mut self, id: &CallId, attempt: u32, p: v1::Change) -> bool {
        let Some(store) = self.sources.clone() else {
            return false;
        };
        let Some(c) = self.calls.get(id) else {
            return false;
        };
        let stored = self.runs.get(&id.0).is_some_and(|r| r.reg.head.is_some());
        let hex = |s: &str| s.len() >= 40 && s.chars().all(|c| c.is_ascii_hexdigit());
        if !stored
            || p.pack.is_empty()
            || p.repo != c.ticket.task.source_repo
            || p.base != c.sent_base
            || !hex(&p.commit)
        {
            tracing::warn!(run = %id.0, call = id.1, attempt, "ignoring leftovers that do not match the attempt's source");
            return false;
        }
        let (tx, run, call) = (self.tx.clone(), id.0.clone(), id.1);
        tokio::spawn(async move {
            let stored =
                crate::source::put_pack(&store, &p.repo, &p.commit, vec![p.base.clone()], p.pack)
                    .await
                    .map(|_| (p.base, p.commit));
            let _ = tx.send(Msg::PartialStored {
                run,
                call,
                attempt,
                stored,
            });
        });
        true
    }

    fn partial_stored(
        &mut self,
        id: &CallId,
        attempt: u32,
        stored: Result<(String, String), String>,
    ) {
        if !self.calls.contains_key(id) {
            return;
        }
        match stored {
            Ok((base, commit)) => {
                let shown = commit.clone();
                if self.leftovers.stored(id, attempt, base, commit) {
                    tracing::info!(run = %id.0, call = id.1, attempt, commit = %shown, "the next attempt starts from what this one left");
                }
            }
            Err(e) => {
                tracing::warn!(run = %id.0, call = id.1, attempt, error = %e, "cannot store what the attempt left; the next attempt starts without it unless it runs on the same worker");
            }
        }
        self.salvaged(id, attempt);
    }

    /// The wait for what attempt `attempt` left is over: a retry that is due goes.
    fn salvaged(&mut self, id: &CallId, attempt: u32) {
        let due = self.leftovers.end_wait(id, attempt);
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        if due && c.state == State::Waiting {
            c.make_ready();
            if let Some(r) = self.runs.get_mut(&id.0) {
                r.queue.push_front(id.1);
            }
        }
    }

    fn cancel_call(&mut self, id: &CallId, reason: &str) {
        let Some(c) = self.calls.get(id) else {
            return;
        };
        if c.state == State::Running {
            self.send_cancel(id, reason);
            self.leave_running(id);
        }
        self.leftovers.forget(id);
        if let Some(c) = self.calls.remove(id)
            && let Some(key) = c.stall_key
        {
            self.timers.remove(&key);
        }
    }

    /// Ends the calls of `run` that have not started: the budget is spent (W35).
    fn budget_spent(&mut self, run: &Arc<str>, message: String) {
        let Some(r) = self.runs.get_mut(run) else {
            return;
        };
        r.budget_spent = Some(message.clone());
        let unstarted: Vec<CallId> = self
            .calls
            .iter()
            .filter(|((r, _), c)| r == run && c.attempt == 0)
            .map(|(id, _)| id.clone())
            .collect();
        for id in unstarted {
            self.fail(&id, CallFailure::Budget, message.clone());
        }
    }

    fn pause_run(&mut self, run: &Arc<str>, paused: bool) {
        let Some(r) = self.runs.get_mut(run) else {
            return;
        };
        if r.paused == paused {
            return;
        }
        r.paused = paused;
        if !paused {
            return;
        }
        // Interrupt what runs and put it back in front; what each attempt left comes with
        // its outcome and is where its next attempt starts (W58).
        let running: Vec<CallId> = self
            .calls
            .iter()
            .filter(|((r, _), c)| r == run && c.state == State::Running)
            .map(|(id, _)| id.clone())
            .collect();
        for id in running.into_iter().rev() {
            let salvageable = self.salvageable(&id);
            self.send_cancel(&id, "the run was paused");
            self.leave_running(&id);
            if salvageable && let Some(c) = self.calls.get(&id) {
                self.leftovers.wait_for(&id, c.attempt, false);
            }
            let (attempt, counted) = self
                .calls
                .get(&id)
                .map_or((0, 0), |c| (c.attempt, c.counted));
            if let Some(r) = self.runs.get_mut(&id.0) {
                r.queue.push_front(id.1);
                let _ = r.reg.events.send(CallEvent::Retrying {
                    call: id.1,
                    attempt,
                    retry: Retry::Paused,
                    counted,
                });
            }
        }
    }

    fn send_cancel(&self, id: &CallId, reason: &str) {
        let Some(c) = self.calls.get(id) else { return };
        if let Some(tx) = c
            .worker
            .and_then(|w| self.workers.get(&w))
            .and_then(|w| w.tx.as_ref())
        {
            let _ = tx.send(CoordinatorMessage {
                msg: Some(coordinator_message::Msg::Cancel(v1::Cancel {
                    run_id: id.0.to_string(),
                    call: id.1,
                    attempt: c.attempt,
                    reason: reason.to_owned(),
                })),
            });
        }
    }

    fn timer(&mut self, t: Timer) {
        match t {
            Timer::Stall(run, call, attempt) => {
                let id: CallId = (run, call);
                let Some(stall) = self.runs.get(&id.0).map(|r| r.reg.stall_timeout) else {
                    return;
                };
                let Some(c) = self.calls.get_mut(&id) else {
                    return;
                };
                c.stall_key = None;
                if c.state != State::Running || c.attempt != attempt {
                    return;
                }
                let now = Instant::now();
                let quiet = now.saturating_duration_since(c.last_progress);
                if c.in_tool || quiet < stall {
                    let at = if c.in_tool {
                        now + stall
                    } else {
                        c.last_progress + stall
                    };
                    c.stall_key = Some(
                        self.timers
                            .insert_at(Timer::Stall(id.0.clone(), call, attempt), at),
                    );
                    return;
                }
                let captured = c.captured.take();
                self.send_cancel(&id, "stalled");
                self.leave_running(&id);
                if let Some(json) = captured {
                    // W58: a stall after a valid structured output counts as success.
                    self.finish(
                        &id,
                        CallResult::Completed(v1::Completed {
                            text: json.clone(),
                            json: Some(json),
                            change: None,
                        }),
                    );
                } else {
                    crate::metrics::inc(&crate::metrics::STALLS);
                    self.retry_or_fail(&id, Retry::Stalled { after: quiet });
                }
            }
            Timer::Hold(run, group, leader) => {
                // The cap passed while this leader's response has not begun: let the group go.
                let current = self
                    .prefixes
                    .get(&(run.clone(), group))
                    .is_some_and(|p| p.leader == Some(leader));
                if current {
                    self.open_prefix(&run, group, Some(leader), false);
                }
            }
            Timer::Gate(gate) => self.release_gate(&gate),
            Timer::Lapse(worker, link) => self.lapse_backstop(worker, link),
            Timer::NoWorker(run, call) => {
                let id: CallId = (run, call);
                // A timer of an earlier wait of the call (set aside, placed, set aside again)
                // is not this wait's.
                let due = self
                    .unplaceable
                    .get(&id)
                    .is_some_and(|(_, _, deadline)| Instant::now() >= *deadline);
                if !due {
                    return;
                }
                let Some(c) = self.calls.get(&id) else {
                    self.unplaceable.remove(&id);
                    return;
                };
                let waiting = matches!(c.state, State::Held | State::Queued);
                // A worker that can run it attached meanwhile (and is merely busy): it waits
                // in its queue like any other call.
                let capable = self
                    .workers
                    .values()
                    .any(|w| w.ready() && w.offers(&c.ticket.task));
                let Some((since, reason, _)) = self.unplaceable.remove(&id) else {
                    return;
                };
                if capable {
                    if let Some(r) = self.runs.get(&id.0) {
                        let _ = r.reg.events.send(CallEvent::Waiting {
                            call: id.1,
                            reason: None,
                        });
                    }
                } else if waiting {
                    let waited = human(since.elapsed());
                    self.fail(
                        &id,
                        CallFailure::Terminal,
                        format!("{reason}; waited {waited} (--worker-wait) and gave up"),
                    );
                }
            }
            Timer::Orphans(worker, link) => self.drop_orphans(worker, link),
            Timer::Salvage(run, call, attempt) => self.salvaged(&(run, call), attempt),
            Timer::Retry(run, call) => {
                let id: CallId = (run, call);
                if self.leftovers.waiting(&id)
                    && self
                        .calls
                        .get(&id)
                        .is_some_and(|c| c.state == State::Waiting)
                {
                    // Still storing what the last attempt left: it goes once that is done.
                    self.leftovers.set_due(&id);
                } else if let Some(c) = self.calls.get_mut(&id)
                    && c.state == State::Waiting
                {
                    c.make_ready();
                    if let Some(r) = self.runs.get_mut(&id.0) {
                        r.queue.push_front(call);
                    }
                }
                let gate = self.calls.get(&id).map(|c| gate_of(&c.ticket.task));
                if let Some(g) = gate {
                    self.release_gate(&g);
                }
            }
        }
    }

    fn release_gate(&mut self, gate: &str) {
        if let Some(until) = self.gates.get(gate) {
            if *until > Instant::now() {
                self.timers.insert_at(Timer::Gate(gate.to_owned()), *until);
                return;
            }
            self.gates.remove(gate);
        }
        for id in self
            .gated
            .remove(gate)
            .unwrap_or_default()
            .into_iter()
            .rev()
        {
            if let Some(c) = self.calls.get_mut(&id)
                && c.state == State::Held
            {
                c.make_ready();
                if let Some(r) = self.runs.get_mut(&id.0) {
                    r.queue.push_front(id.1);
                }
            }
        }
    }

    /// Dispatches as much as slots, limits and holds allow.
    fn pump(&mut self) {
        let mut blocked: HashSet<Arc<str>> = HashSet::new();
        let mut turns = 0usize;
        loop {
            if !self.workers.values().any(|w| w.ready() && w.busy < w.slots) {
                return;
            }
            // Next run in round-robin order that can take a call.
            let n = self.rr.len();
            let mut picked = None;
            for _ in 0..n {
                let Some(run) = self.rr.pop_front() else {
                    break;
                };
                self.rr.push_back(run.clone());
                if blocked.contains(&run) || self.runs.get(&run).is_some_and(|r| r.paused) {
                    continue;
                }
                if let Some(r) = self.runs.get(&run)
                    && !r.queue.is_empty()
                    && r.running < r.reg.concurrency
                {
                    picked = Some(run);
                    break;
                }
            }
            let Some(run) = picked else { return };
            turns += 1;
            if turns > 1_000_000 {
                tracing::error!("dispatcher pump made no progress; stopping this round");
                return;
            }
            let Some(call) = self.runs.get_mut(&run).and_then(|r| r.queue.pop_front()) else {
                continue;
            };
            let id: CallId = (run.clone(), call);
            match self.place(&id) {
                Placement::Dispatched | Placement::Parked | Placement::Gone => {}
                Placement::Unplaceable => self.set_aside(&id),
                Placement::NoWorker => {
                    if let Some(r) = self.runs.get_mut(&run) {
                        r.queue.push_front(call);
                    }
                    blocked.insert(run);
                }
            }
        }
    }

    /// Puts a call no attached worker can run aside, says why once, and starts its wait.
    fn set_aside(&mut self, id: &CallId) {
        let Some(r) = self.runs.get(&id.0) else {
            return;
        };
        let wait = r.reg.worker_wait;
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        c.set(State::Held);
        if self.unplaceable.contains_key(id) {
            return;
        }
        let task = &c.ticket.task;
        let attached = self.workers.values().filter(|w| w.ready()).count();
        let reason = if attached == 0 {
            format!(
                "no worker is attached to this coordinator (the agent needs backend {:?}{})",
                task.backend,
                if task.model.is_empty() {
                    String::new()
                } else {
                    format!(" / model {:?}", task.model)
                }
            )
        } else {
            let mut offered: Vec<&str> = self
                .workers
                .values()
                .filter(|w| w.ready())
                .flat_map(|w| w.backends.iter().map(String::as_str))
                .collect();
            offered.sort_unstable();
            offered.dedup();
            let backend_known = self.workers.values().any(|w| {
                w.ready() && (w.backends.is_empty() || w.backends.contains(&task.backend))
            });
            if backend_known {
                format!(
                    "no attached worker offers backend {:?} / model {:?}",
                    task.backend, task.model
                )
            } else {
                format!(
                    "no attached worker offers backend {:?} (the {attached} attached offer {}); start a worker with --backend {}",
                    task.backend,
                    offered.join(", "),
                    task.backend
                )
            }
        };
        if self.opts.fixed_fleet && attached > 0 {
            self.fail(
                id,
                CallFailure::Terminal,
                format!("{reason}, and no other worker can attach to this process"),
            );
            return;
        }
        let _ = r.reg.events.send(CallEvent::Waiting {
            call: id.1,
            reason: Some(reason.clone()),
        });
        let deadline = Instant::now() + wait;
        self.unplaceable
            .insert(id.clone(), (Instant::now(), reason, deadline));
        self.timers
            .insert_at(Timer::NoWorker(id.0.clone(), id.1), deadline);
    }

    /// A worker became ready: the calls set aside for want of one go back to their queues.
    fn requeue_unplaceable(&mut self) {
        let ids: Vec<CallId> = self.unplaceable.keys().cloned().collect();
        for id in ids {
            if let Some(c) = self.calls.get_mut(&id)
                && c.state == State::Held
            {
                c.make_ready();
                if let Some(r) = self.runs.get_mut(&id.0) {
                    r.queue.push_front(id.1);
                }
            }
        }
    }

    fn place(&mut self, id: &CallId) -> Placement {
        let Some(r) = self.runs.get(&id.0) else {
            return Placement::Gone;
        };
        let (stagger, spent) = (r.reg.stagger, r.budget_spent.clone());
        let Some(c) = self.calls.get(id) else {
            return Placement::Gone;
        };
        if c.state != State::Queued {
            return Placement::Gone;
        }
        // Budget at dispatch (W35); restarts of an admitted call are not new spending.
        if c.attempt == 0
            && let Some(message) = spent
        {
            self.fail(id, CallFailure::Budget, message);
            return Placement::Parked;
        }
        // Usage-limit gate of the backend/model.
        let gate = gate_of(&c.ticket.task);
        if let Some(until) = self.gates.get(&gate)
            && *until > Instant::now()
        {
            let until = *until;
            if let Some(c) = self.calls.get_mut(id) {
                c.set(State::Held);
            }
            let list = self.gated.entry(gate.clone()).or_default();
            if list.is_empty() {
                self.timers.insert_at(Timer::Gate(gate), until);
            }
            list.push(id.clone());
            return Placement::Parked;
        }
        // Prefix stagger.
        let group = c.ticket.prefix_group;
        let mut lead = false;
        if !stagger.is_zero() {
            let now = Instant::now();
            let p = self.prefixes.entry((id.0.clone(), group)).or_default();
            // Open when the leader's response began recently (warm cache), or when the hold
            // cap has passed for the current leader.
            let open = p.open_until.is_some_and(|t| t > now)
                || p.since.is_some_and(|since| since + stagger <= now);
            if !open {
                match p.leader {
                    None => lead = true,
                    Some(leader) if leader == id.1 => {}
                    Some(_) => {
                        p.held.push(id.1);
                        if let Some(c) = self.calls.get_mut(id) {
                            c.set(State::Held);
                        }
                        return Placement::Parked;
                    }
                }
            }
        }
        // A worker with the backend (and model, when it lists models) and a free slot.
        let task = &c.ticket.task;
        let worker = self
            .workers
            .iter()
            .filter(|(_, w)| w.ready() && w.busy < w.slots && w.offers(task))
            .max_by_key(|(wid, w)| (w.slots - w.busy, std::cmp::Reverse(**wid)))
            .map(|(wid, _)| *wid);
        let Some(wid) = worker else {
            let capable = self.workers.values().any(|w| w.ready() && w.offers(task));
            return if capable {
                Placement::NoWorker
            } else {
                Placement::Unplaceable
            };
        };
        if lead {
            let p = self.prefixes.entry((id.0.clone(), group)).or_default();
            p.leader = Some(id.1);
            p.since = Some(Instant::now());
            self.timers.insert_at(
                Timer::Hold(id.0.clone(), group, id.1),
                Instant::now() + stagger,
            );
        }
        self.assign(id, wid);
        Placement::Dispatched
    }

    /// Takes a slot on `wid` for the call's next attempt and writes the attempt key; the
    /// assignment goes out once the key is written ([`Dispatcher::written`]).
    fn assign(&mut self, id: &CallId, wid: u64) {
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        let Some(w) = self.workers.get_mut(&wid) else {
            return;
        };
        let Some(lease) = w.lease else {
            return;
        };
        c.attempt += 1;
        self.assigned += 1;
        if self.unplaceable.remove(id).is_some()
            && let Some(r) = self.runs.get(&id.0)
        {
            let _ = r.reg.events.send(CallEvent::Waiting {
                call: id.1,
                reason: None,
            });
        }
        crate::metrics::DISPATCH_LATENCY.observe(c.ready_at.elapsed());
        c.set(State::Running);
        c.worker = Some(wid);
        c.fence = None;
        c.captured = None;
        c.in_tool = false;
        w.busy += 1;
        w.running.insert((id.0.clone(), id.1, c.attempt));
        let op = KeyOp::attempt(id, wid, &w.name, c.attempt, lease);
        if let Some(r) = self.runs.get_mut(&id.0) {
            r.running += 1;
        }
        self.write_key(op);
    }

    /// Sends the assignment of a call whose attempt key is written at `fence`.
    fn send_assignment(&mut self, id: &CallId, fence: Revision) {
        let Some(stall) = self.runs.get(&id.0).map(|r| r.reg.stall_timeout) else {
            return;
        };
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        let Some(wid) = c.worker else { return };
        let Some(w) = self.workers.get(&wid) else {
            return;
        };
        c.fence = Some(fence);
        c.last_progress = Instant::now();
        // A new attempt: no earlier one holds it back any more.
        self.leftovers.sent(id);
        c.stall_key = Some(self.timers.insert_at(
            Timer::Stall(id.0.clone(), id.1, c.attempt),
            Instant::now() + stall,
        ));
        c.attempt_span = tracing::info_span!(
            parent: &c.ticket.span,
            "attempt",
            workflow.run_id = %id.0,
            index = id.1,
            attempt = c.attempt,
            worker = %w.name,
            outcome = tracing::field::Empty,
        );
        let mut task = c.ticket.task.clone();
        if let Some((base, partial)) = self.leftovers.start_of(id) {
            task.source_commit = base.to_owned();
            task.source_partial = partial.to_owned();
        } else if let Some(head) = self.runs.get(&id.0).and_then(|r| r.reg.head.as_ref()) {
            task.source_commit = head.borrow().clone();
        }
        c.sent_base = task.source_commit.clone();
        let assignment = v1::Assignment {
            run_id: id.0.to_string(),
            call: id.1,
            attempt: c.attempt,
            call_key: c.ticket.key.clone(),
            task: Some(task),
            trace_context: trace_context(&c.attempt_span),
            fence,
        };
        let attempt = c.attempt;
        // A worker cut off right now misses this; it does not list the attempt when it comes
        // back, so the attempt is restarted then (or when its lease lapses). An adopted
        // attempt runs already: nothing to send.
        if let (None, Some(tx)) = (c.adopted_fence, &w.tx) {
            let _ = tx.send(CoordinatorMessage {
                msg: Some(coordinator_message::Msg::Assign(assignment)),
            });
        }
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r.reg.events.send(CallEvent::Started {
                call: id.1,
                attempt,
                worker: w.name.clone(),
            });
        }
    }
}

enum Placement {
    Dispatched,
    /// No attached worker offers its backend and model at all: it is set aside (the rest
    /// of the run goes on) until a worker that does becomes ready, or its wait runs out.
    Unplaceable,
    /// Held, gated or failed: not in the queue any more, nothing to retry now.
    Parked,
    /// No worker can take it now; it goes back to the front.
    NoWorker,
    Gone,
}

/// The W3C trace context of `span`, for an assignment (empty when nothing is traced).
fn trace_context(span: &tracing::Span) -> HashMap<String, String> {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let mut out = HashMap::new();
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut out));
    out
}

#[cfg(test)]
mod tests;
