//! The dispatcher: one actor that puts the calls of every run onto worker slots.
//!
//! Runs register with their limits; the run engine submits one [`Ticket`] per call and gets
//! [`CallEvent`]s back. Workers attach through a [`CoordinatorEnd`] (in-process) — the same
//! messages a remote worker sends over gRPC — announce their slots in `Hello`, and receive
//! assignments only against free slots.
//!
//! What the dispatcher decides:
//! - **order**: namespaces share the slots by weight, runs within one take turns (round robin)
//!   so one big run cannot starve another; within a run, calls go in submission order; a
//!   restarted call goes to the front;
//! - **limits**: a namespace's cap on running agents, per-run concurrency (W38) and worker slots; the run engine owns the budgets
//!   and says when they stop calls, and the calls end here, where their outcomes come in
//!   (a call whose outcome is in already is not stopped);
//! - **prefix affinity**: where a worker's model server keeps a prefix cache of its own, the
//!   calls of a prefix group go back to the worker that served the group first when it has
//!   a free slot (`affinity.rs`, a policy the placer asks);
//! - **prefix stagger** (W60): the first call of a prefix group goes alone; the others of the
//!   group wait until its response begins or the hold cap passes;
//! - **usage-limit waits** (W59): a rate-limited attempt makes its call wait `retry_after`
//!   and closes the backend/model gate for everyone until then; the wait is not a failure;
//! - **stalls** (W58): an attempt with no progress for the stall timeout (tool calls in
//!   flight excepted) is cancelled and restarted, up to the attempt limit;
//! - **fencing**: every attempt is a key `/flotilla/attempts/{run}/{call}` under its worker's
//!   lease, written before the assignment is sent; the key's revision is the attempt's fence.
//!   Only the outcome of a call's current attempt, on its current worker, with its fence, is
//!   accepted; an older attempt the worker was given ends with its usage counted (once, held
//!   to what one attempt can use: `usage.rs`), and anything a worker sends for an attempt it
//!   was not given (another call's fence or key, another run) is dropped and never counted;
//! - **liveness** (`workers.rs`): each worker holds a lease the coordinator keeps alive while
//!   the worker's stream is up. A worker that is cut off keeps its attempts for one lease TTL:
//!   if it comes back in time it reports what it holds and carries on; otherwise its lease
//!   lapses, its attempt keys vanish with it, and the watch on them restarts those calls.
//!
//! Invariant: each call ends with at most one `Finished` event, and every assignment's slot is
//! returned when its worker reports the outcome (or the worker goes away).
//!
//! Where each part lives: the face runs and the server use (`handle.rs`); placement
//! (`place.rs`: which call, which worker) with its policies — fair share (`fair.rs`),
//! usage-limit gates (`gates.rs`), prefix stagger (`stagger.rs`), prefix affinity
//! (`affinity.rs`); the assignment path, from a slot taken to the attempt key written and the
//! assignment sent with its fence (`assign.rs`); the source server (`transfers.rs`), which
//! answers workers' source requests; each attempt's stall watchdog (`watchdog.rs`) and each
//! call's fence (`fencing.rs`: which attempt may speak for it); what outcomes do (`outcomes.rs`) with the retry verdicts (`retry.rs`), what unfinished attempts
//! left (`leftovers.rs`) and the ceilings of a worker's usage reports (`usage.rs`); the fleet
//! (`fleet.rs`), the lease-store writes and watches (`lease_writes.rs`), and worker links,
//! leases and takeovers (`workers.rs`). A call's states are [`crate::call::State`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::v1::{self, FailureKind, ProgressKind, WorkerMessage, outcome, worker_message};
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tokio_util::time::DelayQueue;

pub use crate::call::{CallEvent, CallFailure, CallResult, Retry};
use crate::call::{State, human};
use crate::lease::{self, LeaseStore};

mod accounts;
mod affinity;
mod assign;
mod ended;
mod fair;
mod fencing;
mod fleet;
mod gates;
mod handle;
pub mod kept;
mod lease_writes;
mod leftovers;
mod outcomes;
mod place;
mod retry;
mod spans;
mod stagger;
mod transfers;
mod usage;
mod watchdog;
mod workers;

pub use accounts::AccountView;
pub use fair::Share;
use handle::Msg;
pub use handle::{
    DispatchHandle, DispatchOptions, NameTaken, NamespaceView, RunRegistration, Stats, Ticket,
    WORKER_LEASE_TTL, WorkerView,
};
pub use usage::UsageBounds;

use fleet::Fleet;
use lease_writes::KeyOp;

use ended::Ended;
use handle::CallId;

struct CallState {
    ticket: Ticket,
    /// Only the live states: the dispatcher forgets a call once it ends.
    state: State,
    attempt: u32,
    counted: u32,
    worker: Option<u64>,
    /// Which attempt may speak for it: its key's revision, or the fence an adopted attempt
    /// was started with.
    fence: fencing::Fence,
    /// The current attempt's stall watchdog (W58).
    watchdog: watchdog::Watchdog,
    captured: Option<String>,
    /// Usage-limit waits so far (not counted as attempts).
    limit_waits: u32,
    /// When the call last became ready to run (dispatch latency counts from here).
    ready_at: Instant,
    /// When its current attempt was assigned a slot (its held time counts from here).
    assigned_at: Instant,
    /// The current attempt's trace span (`attempt`, a child of the call's).
    attempt_span: tracing::Span,
    /// The source commit the last assignment started from.
    sent_base: String,
    /// What the current attempt took of its provider account's admission.
    admitted: Option<accounts::Draw>,
    /// It waits for room in an account (counted once per wait).
    held_by_account: bool,
    /// When the provider first throttled it.
    throttled_since: Option<Instant>,
    /// Times it let other calls go first while its prefix's worker was busy (affinity).
    passed_over: u32,
}

impl CallState {
    fn new(ticket: Ticket) -> CallState {
        CallState {
            ticket,
            state: State::Queued,
            attempt: 0,
            counted: 0,
            worker: None,
            fence: fencing::Fence::default(),
            watchdog: watchdog::Watchdog::new(),
            captured: None,
            limit_waits: 0,
            ready_at: Instant::now(),
            assigned_at: Instant::now(),
            attempt_span: tracing::Span::none(),
            sent_base: String::new(),
            admitted: None,
            held_by_account: false,
            throttled_since: None,
            passed_over: 0,
        }
    }

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
    /// Calls submitted, and retries made (attempts beyond a call's first, counted).
    submitted: u64,
    retries: u64,
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
    /// An account's token bucket has refilled enough for the call that waits on it.
    Paced,
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
    // Every task of the dispatcher's, so its owner can wait for them to end.
    let tasks = TaskTracker::new();
    let handle = DispatchHandle {
        tx: tx.clone(),
        tasks: tasks.clone(),
    };
    let kept = sources
        .clone()
        .map(|s| kept::Writer::spawn(s, &tasks, cancel.clone()));
    let keys = lease_writes::spawn_key_writer(leases.clone(), tx.clone(), &tasks, cancel.clone());
    lease_writes::spawn_watches(leases.clone(), tx.clone(), &tasks, cancel.clone());
    let d = Dispatcher {
        tx,
        affinity: affinity::Affinity::new(opts.affinity),
        opts,
        assigned: 0,
        leases,
        runs: HashMap::new(),
        shares: fair::Shares::default(),
        calls: HashMap::new(),
        fleet: Fleet::new(keys, tasks.clone()),
        stagger: stagger::Stagger::default(),
        gates: gates::Gates::default(),
        admission: accounts::Accounts::default(),
        paced_wake: None,
        unplaceable: HashMap::new(),
        sources: transfers::SourceServer::new(sources, tasks.clone()),
        leftovers: leftovers::Leftovers::default(),
        kept,
        timers: DelayQueue::new(),
        tasks: tasks.clone(),
    };
    tasks.spawn(d.run(rx, cancel));
    handle
}

struct Dispatcher {
    tx: mpsc::UnboundedSender<Msg>,
    opts: DispatchOptions,
    /// Attempts assigned so far.
    assigned: u64,
    leases: Arc<dyn LeaseStore>,
    runs: HashMap<Arc<str>, RunState>,
    /// Fair share: namespaces by weight, runs in turn.
    shares: fair::Shares,
    /// Boxed: a call's state is several hundred bytes, and a table sized for ten thousand
    /// calls in flight would otherwise hold that much in every empty slot too.
    calls: HashMap<CallId, Box<CallState>>,
    fleet: Fleet,
    /// Prefix stagger (W60).
    stagger: stagger::Stagger,
    /// Usage-limit gates (W59).
    gates: gates::Gates,
    /// Admission per provider account: adaptive windows and pacing.
    admission: accounts::Accounts,
    /// When the pump is woken for a paced account (one timer at a time).
    paced_wake: Option<Instant>,
    /// Prefix affinity: each prefix group's home worker.
    affinity: affinity::Affinity,
    /// Calls set aside because no attached worker offers their backend and model: since when,
    /// why, and when they give up. They go back to their queues whenever a worker becomes
    /// ready.
    unplaceable: HashMap<CallId, (Instant, String, Instant)>,
    /// Answers workers' `SourceRequest`s from where runs' sources are.
    sources: transfers::SourceServer,
    /// What unfinished attempts left, and retries that wait for it (W58).
    leftovers: leftovers::Leftovers,
    /// Writes what it keeps to the store, for a coordinator that adopts a run.
    kept: Option<kept::Writer>,
    timers: DelayQueue<Timer>,
    /// Every task it starts (the handle's owner waits for them: [`DispatchHandle::stopped`]).
    tasks: TaskTracker,
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
        for w in self.fleet.all() {
            w.link_alive.cancel();
            if let Some(ctl) = &w.ctl {
                ctl.stop();
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Register(reg) => self.register(reg),
            Msg::Submit { run, ticket } => self.submit(run, *ticket),
            Msg::Cancel { run, call, reason } => self.cancel_call(&(run, call), &reason),
            Msg::PauseRun {
                run,
                paused,
                interrupt,
            } => self.pause_run(&run, paused, interrupt),
            Msg::StopCall {
                run,
                call,
                failure,
                message,
            } => self.stop_call(&(run, call), failure, message),
            Msg::BudgetSpent { run, message } => self.budget_spent(&run, message),
            Msg::RestartCall { run, call, fresh } => self.restart_call(&(run, call), fresh),
            Msg::CloseRun { run } => self.close_run(&run),
            Msg::PartialStored {
                run,
                call,
                attempt,
                stored,
            } => self.partial_stored(&(run, call), attempt, stored),
            Msg::Attach { end, peer, verdict } => self.attach(end, peer, verdict),
            Msg::FromWorker { worker, msg } => self.on_worker(worker, *msg),
            Msg::LinkClosed { worker, link } => self.link_closed(worker, link),
            Msg::Watch(ev) => self.watched(ev),
            Msg::LeaseGranted {
                worker,
                lease,
                revision,
            } => self.lease_granted(&worker, lease, revision),
            Msg::LeaseLost { worker, lease } => self.fleet.lease_lost(&worker, lease),
            Msg::Written { puts, revision } => self.written(puts, revision),
            Msg::Refused { puts, why } => self.refused(puts, why),
            Msg::Workers(reply) => {
                let _ = reply.send(self.fleet.views());
            }
            Msg::Offered(task, reply) => {
                let _ = reply.send(if self.fleet.capable(&task) {
                    Ok(())
                } else {
                    Err(flotilla_proto::Problem::invalid(
                        self.fleet.why_none_offers(&task),
                    ))
                });
            }
            Msg::InFlight { run, reply } => {
                let _ = reply.send(self.fleet.held_of(&run));
            }
            Msg::Stats(reply) => {
                let (workers, slots, busy) = self.fleet.totals();
                let _ = reply.send(Stats {
                    workers,
                    slots,
                    busy,
                    queued: self.runs.values().map(|r| r.queue.len()).sum(),
                    running: self.runs.values().map(|r| r.running).sum(),
                    assigned: self.assigned,
                    accounts: self.admission.views(),
                    namespaces: self.namespace_views(),
                });
            }
        }
    }

    /// The namespaces with runs, by name.
    fn namespace_views(&self) -> Vec<NamespaceView> {
        let mut by: std::collections::BTreeMap<&str, NamespaceView> = Default::default();
        for r in self.runs.values() {
            let share = &r.reg.share;
            let v = by.entry(&share.namespace).or_insert_with(|| NamespaceView {
                name: share.namespace.to_string(),
                weight: share.weight,
                max_agents: share.max_agents,
                ..NamespaceView::default()
            });
            v.runs += 1;
            v.running += r.running;
            v.queued += r.queue.len();
        }
        by.into_values().collect()
    }

    fn register(&mut self, reg: RunRegistration) {
        let id = reg.run_id.clone();
        self.runs.insert(
            id.clone(),
            RunState {
                reg,
                running: 0,
                queue: VecDeque::new(),
                paused: false,
                budget_spent: None,
                submitted: 0,
                retries: 0,
            },
        );
        let share = self.runs[&id].reg.share.clone();
        self.shares.join(id, &share);
    }

    fn submit(&mut self, run: Arc<str>, ticket: Ticket) {
        let Some(r) = self.runs.get_mut(&run) else {
            return;
        };
        r.queue.push_back(ticket.call);
        r.submitted += 1;
        // Empty but for a run adopted with interrupted calls: no hashing on the hot path.
        let adopted = match r.reg.kept.is_empty() {
            true => None,
            false => r.reg.kept.remove(&ticket.key),
        };
        let id = (run, ticket.call);
        if let Some(k) = adopted {
            tracing::info!(run = %id.0, call = id.1, conversation = k.session.is_some(), files = !k.commit.is_empty(), "the call starts from what its interrupted attempt left before this coordinator adopted the run");
            let namespace = self.runs[&id.0].reg.share.namespace.clone();
            self.leftovers.adopt(&id, &namespace, k);
        }
        self.calls
            .insert(id.clone(), Box::new(CallState::new(ticket)));
        self.claim_orphans(&id);
    }

    /// W55: the call ends `Failed` unless its outcome is in already.
    fn stop_call(&mut self, id: &CallId, failure: CallFailure, message: String) {
        if !self.calls.contains_key(id) {
            return;
        }
        self.cancel_call(id, &message);
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r.reg.events.send(CallEvent::Finished {
                call: id.1,
                result: CallResult::Failed { failure, message },
            });
        }
    }

    /// W56: a running call's attempt is abandoned and a new one starts: it continues the
    /// abandoned one's session, or starts over (`fresh`: none of it is kept).
    fn restart_call(&mut self, id: &CallId, fresh: bool) {
        let running = self
            .calls
            .get(id)
            .filter(|c| c.state == State::Running)
            .map(|c| c.attempt);
        if let Some(attempt) = running
            && fresh
        {
            self.leftovers.start_over(id, attempt);
            self.keep_in_store(id);
        }
        if running.is_some() {
            self.send_cancel(id, "restarted by the user");
            self.leave_running(id, Ended::Cancelled("restarted"));
            self.retry_or_fail(id, Retry::User);
        }
    }

    /// Cancels everything of a run and forgets it.
    fn close_run(&mut self, run: &Arc<str>) {
        let ids: Vec<CallId> = self
            .calls
            .keys()
            .filter(|(r, _)| r == run)
            .cloned()
            .collect();
        for id in ids {
            self.cancel_call(&id, "the run ended");
        }
        if let Some(r) = self.runs.remove(run) {
            self.shares.leave(run, &r.reg.share.namespace);
        }
        self.stagger.forget_run(run);
    }

    fn on_worker(&mut self, worker: u64, msg: WorkerMessage) {
        let worker = self.fleet.resolve(worker);
        let Some(msg) = msg.msg else { return };
        match msg {
            worker_message::Msg::Hello(h) => self.hello(worker, h),
            worker_message::Msg::Progress(p) => self.progress(worker, p),
            worker_message::Msg::Transcript(t) => self.transcript(worker, t),
            worker_message::Msg::Outcome(o) => self.outcome(worker, o),
            // Put back together by the gRPC bridge; a stray one means nothing.
            worker_message::Msg::Fragment(_) => {}
            // The store is read off the actor; the answer goes straight to the worker's link.
            worker_message::Msg::SourceRequest(req) => self.source_request(worker, req),
        }
    }

    /// A worker's source request: an acknowledgment goes to its transfer; a new one is
    /// answered for the namespace of the attempt that wants it, or refused.
    fn source_request(&mut self, worker: u64, req: v1::SourceRequest) {
        if self.sources.acknowledged(worker, &req) {
            return;
        }
        let Some(tx) = self.fleet.link(worker).cloned() else {
            return;
        };
        let namespace = self.source_namespace(worker, &req);
        if namespace.is_none() {
            self.fleet.stray(
                worker,
                "a source request",
                format_args!(
                    "commit {} of {} is not the source of an attempt it runs",
                    req.commit, req.repo
                ),
            );
        }
        self.sources.serve(worker, req, tx, namespace);
    }

    /// The namespace whose sources answer `worker`'s request: that of an attempt the worker
    /// holds of the request's repository at the commit it names (the commit it was sent, or
    /// the leftovers it starts from), preferring the namespace the request names when
    /// several do. `None`: no attempt of the worker's wants it, so nothing is sent.
    fn source_namespace(&self, worker: u64, req: &v1::SourceRequest) -> Option<String> {
        let w = self.fleet.worker(worker)?;
        let asked = crate::namespace::effective(&req.namespace);
        let mut found = None;
        for (run, call, _) in w.running.keys() {
            let id: CallId = (run.clone(), *call);
            let Some(c) = self.calls.get(&id) else {
                continue;
            };
            let task = &c.ticket.task;
            if task.source_repo != req.repo || !task.source_url.is_empty() {
                continue;
            }
            let partial = self.leftovers.start_of(&id).map(|(_, p)| p);
            if c.sent_base != req.commit && partial != Some(req.commit.as_str()) {
                continue;
            }
            let ns = crate::namespace::effective(&task.namespace);
            if ns == asked {
                return Some(ns.to_owned());
            }
            found.get_or_insert_with(|| ns.to_owned());
        }
        found
    }

    /// Lets the held calls of a prefix group go. `warm`: the leader's response began.
    fn open_prefix(&mut self, run: &Arc<str>, group: u64, leader: Option<u64>, warm: bool) {
        let held = self
            .stagger
            .release(run, group, leader, warm, Instant::now());
        self.requeue_held(run, held);
    }

    /// Held calls of `run` go back to the front of its queue, in the order given.
    fn requeue_held(&mut self, run: &Arc<str>, calls: Vec<u64>) {
        let Some(r) = self.runs.get_mut(run) else {
            return;
        };
        for call in calls.into_iter().rev() {
            if let Some(c) = self.calls.get_mut(&(run.clone(), call))
                && c.state == State::Held
            {
                c.make_ready();
                r.queue.push_front(call);
            }
        }
    }

    fn cancel_call(&mut self, id: &CallId, reason: &str) {
        let Some(c) = self.calls.get(id) else {
            return;
        };
        if c.state == State::Running {
            self.send_cancel(id, reason);
            self.leave_running(id, Ended::Cancelled("stopped"));
        }
        self.leftovers.forget(id);
        if let Some(mut c) = self.calls.remove(id) {
            c.watchdog.disarm(&mut self.timers);
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

    fn pause_run(&mut self, run: &Arc<str>, paused: bool, interrupt: bool) {
        let Some(r) = self.runs.get_mut(run) else {
            return;
        };
        if r.paused == paused {
            return;
        }
        r.paused = paused;
        if !paused || !interrupt {
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
            self.leave_running(&id, Ended::Cancelled("paused"));
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
        if let Some(wid) = c.worker {
            self.fleet.cancel(wid, &id.0, id.1, c.attempt, reason);
        }
    }

    fn timer(&mut self, t: Timer) {
        match t {
            Timer::Stall(run, call, attempt) => self.stall_due(&(run, call), attempt),
            Timer::Hold(run, group, leader) => {
                // The cap passed while this leader's response has not begun: let the group go.
                if self.stagger.is_leader(&run, group, leader) {
                    self.open_prefix(&run, group, Some(leader), false);
                }
            }
            Timer::Gate(gate) => self.release_gate(&gate),
            Timer::Lapse(worker, link) => self.lapse_backstop(worker, link),
            Timer::NoWorker(run, call) => self.no_worker_due(&(run, call)),
            Timer::Orphans(worker, link) => self.drop_orphans(worker, link),
            Timer::Salvage(run, call, attempt) => self.salvaged(&(run, call), attempt),
            Timer::Retry(run, call) => self.retry_due(&(run, call)),
            // The pump that follows every timer looks again.
            Timer::Paced => self.paced_wake = None,
        }
    }

    fn release_gate(&mut self, gate: &str) {
        match self.gates.open(gate, Instant::now()) {
            Err(until) => {
                self.timers.insert_at(Timer::Gate(gate.to_owned()), until);
            }
            Ok(parked) => {
                for id in parked.into_iter().rev() {
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
        }
    }
}

#[cfg(test)]
mod tests;
