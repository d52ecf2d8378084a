//! The dispatcher's face: what runs register and submit, what they hear back, and the
//! [`DispatchHandle`] that sends it all to the dispatcher's inbox.

use flotilla_proto::Problem;
use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::link::CoordinatorEnd;
use flotilla_proto::v1::{self, WorkerMessage};
use tokio::sync::mpsc;

use super::fair::Share;
use super::usage::UsageBounds;
pub use crate::call::{CallEvent, CallFailure};
use crate::lease::{LeaseId, Revision, WatchEvent};

/// A call as the dispatcher files it: its run and its index.
pub(super) type CallId = (Arc<str>, u64);

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
    /// Admission per provider account (adaptive windows, pacing); `false`
    /// (`FLOTILLA_ADMISSION=off`): calls go as slots and run concurrency allow.
    pub admission: bool,
    /// Prefix affinity: calls that share a prompt prefix go to the worker that served it
    /// first when its model server caches prefixes locally; `false`
    /// (`FLOTILLA_AFFINITY=off`): wherever a slot is free.
    pub affinity: bool,
    /// What one attempt can use: a worker's usage report above it is clipped before it is
    /// counted.
    pub usage: UsageBounds,
}

impl Default for DispatchOptions {
    fn default() -> Self {
        DispatchOptions {
            worker_ttl: WORKER_LEASE_TTL,
            fixed_fleet: false,
            admission: true,
            affinity: true,
            usage: UsageBounds::default(),
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
    /// Retries (attempts beyond a call's first) the run may make; `None`: no bound (Claude
    /// Code's attempts per agent only).
    pub retry_budget: Option<u64>,
    /// How long one call may wait out throttles in all before it fails.
    pub throttle_wait: Duration,
    /// The run's head (fleet runs with a source): every attempt starts from it as it stands
    /// when the attempt is sent.
    pub head: Option<tokio::sync::watch::Receiver<String>>,
    pub events: mpsc::UnboundedSender<CallEvent>,
    /// Its namespace, with the namespace's weight and cap.
    pub share: Share,
    /// What interrupted calls left their next attempts, by call key, as a coordinator before
    /// this one kept it in the store (a run adopted: [`super::kept::load`]).
    pub kept: std::collections::HashMap<String, v1::KeptLeftovers>,
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

pub(super) enum Msg {
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
    /// the front of its queue (not counted as attempts) — unless `interrupt` is off (a run
    /// held at its money budget): then they finish.
    PauseRun {
        run: Arc<str>,
        paused: bool,
        interrupt: bool,
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
        /// The new attempt starts over, whatever session the abandoned one leaves.
        fresh: bool,
    },
    Attach {
        end: CoordinatorEnd,
        /// Where the link comes from (a remote worker's address), for the logs.
        peer: Arc<str>,
        /// Told once the link's `Hello` is taken or refused (a gRPC `Attach` answers only
        /// then, so a refusal reaches the worker as the call's status).
        verdict: Option<tokio::sync::oneshot::Sender<Result<(), NameTaken>>>,
    },
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
    /// Whether an attached worker offers the task's backend, model and labels; if none does,
    /// why and what to do.
    Offered(
        Box<flotilla_proto::v1::TaskSpec>,
        tokio::sync::oneshot::Sender<Result<(), Problem>>,
    ),
    /// How many attempts of a run workers still hold (asked by a stopped run).
    InFlight {
        run: Arc<str>,
        reply: tokio::sync::oneshot::Sender<usize>,
    },
    /// What an attempt left is stored (`Ok`: the partial commit and its base) or not.
    PartialStored {
        run: Arc<str>,
        call: u64,
        attempt: u32,
        stored: Result<(String, String), Problem>,
    },
}

/// Why a link was refused: another process is attached under the name its `Hello` claims
/// (two workers started with one certificate and one name). The attached one keeps serving.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "worker name {name:?} is taken: a worker of that name is attached from {attached_from} (this one connects from {refused_from}); give each worker process a name of its own (replicas of one certificate: --name CN/INSTANCE), or stop the other one"
)]
pub struct NameTaken {
    pub name: String,
    pub attached_from: String,
    pub refused_from: String,
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
    /// Attempts given to it since it first attached to this coordinator.
    pub attempts: u64,
    /// Seconds since it last said hello, took an attempt or sent an outcome here.
    pub heard_secs_ago: u64,
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
    /// The provider accounts' admission.
    pub accounts: Vec<super::accounts::AccountView>,
    /// The namespaces with runs: what they run and queue, by name.
    pub namespaces: Vec<NamespaceView>,
}

/// A namespace as the dispatcher shares slots by it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct NamespaceView {
    pub name: String,
    pub weight: u32,
    pub max_agents: Option<usize>,
    pub runs: usize,
    pub running: usize,
    pub queued: usize,
}

/// Cheap handle to the dispatcher.
#[derive(Clone)]
pub struct DispatchHandle {
    pub(super) tx: mpsc::UnboundedSender<Msg>,
    /// The dispatcher's tasks.
    pub(super) tasks: tokio_util::task::TaskTracker,
}

impl std::fmt::Debug for DispatchHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatchHandle").finish_non_exhaustive()
    }
}

impl DispatchHandle {
    /// Waits, at most `within`, for every task of the dispatcher to end (once it is
    /// cancelled); whether they all did.
    pub async fn stopped(&self, within: std::time::Duration) -> bool {
        self.tasks.close();
        tokio::time::timeout(within, self.tasks.wait())
            .await
            .is_ok()
    }

    /// How many tasks of the dispatcher are running.
    pub fn tasks_running(&self) -> usize {
        self.tasks.len()
    }

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
            interrupt: true,
        });
    }
    /// Holds a run (`true`: nothing of it starts, what runs finishes) or lets it go on.
    pub fn hold_run(&self, run: &Arc<str>, held: bool) {
        let _ = self.tx.send(Msg::PauseRun {
            run: run.clone(),
            paused: held,
            interrupt: false,
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
    /// Restarts one running call as a new attempt: it continues the interrupted one's
    /// session, or starts over (`fresh`).
    pub fn restart_call(&self, run: &Arc<str>, call: u64, fresh: bool) {
        let _ = self.tx.send(Msg::RestartCall {
            run: run.clone(),
            call,
            fresh,
        });
    }
    /// Cancels everything of a run and forgets it.
    pub fn close_run(&self, run: &Arc<str>) {
        let _ = self.tx.send(Msg::CloseRun { run: run.clone() });
    }
    /// How many attempts of `run` workers still hold: a cancelled attempt holds its slot until
    /// its worker answers with its outcome, or the worker is let go. (0 once the dispatcher
    /// is gone.)
    pub async fn in_flight(&self, run: &Arc<str>) -> usize {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self
            .tx
            .send(Msg::InFlight {
                run: run.clone(),
                reply: tx,
            })
            .is_err()
        {
            return 0;
        }
        rx.await.unwrap_or(0)
    }
    /// Attaches an in-process worker's link.
    pub fn attach(&self, end: CoordinatorEnd) {
        let _ = self.tx.send(Msg::Attach {
            end,
            peer: Arc::from("in-process"),
            verdict: None,
        });
    }

    /// Attaches a remote worker's link (its gRPC stream bridged to channels) from `peer`; the
    /// answer says whether its `Hello` was taken, or refused because another worker of its
    /// name is attached.
    pub fn attach_remote(
        &self,
        end: CoordinatorEnd,
        peer: &str,
    ) -> tokio::sync::oneshot::Receiver<Result<(), NameTaken>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let _ = self.tx.send(Msg::Attach {
            end,
            peer: Arc::from(peer),
            verdict: Some(tx),
        });
        rx
    }
    /// The workers with a lease: attached, or cut off and not yet lapsed.
    pub async fn workers(&self) -> Vec<WorkerView> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Msg::Workers(tx)).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Whether an attached worker offers `task`'s backend, model and placement labels now;
    /// else why none does, as a call set aside for want of one is told.
    pub async fn offered(&self, task: flotilla_proto::v1::TaskSpec) -> Result<(), Problem> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Msg::Offered(Box::new(task), tx)).is_err() {
            return Ok(());
        }
        rx.await.unwrap_or(Ok(()))
    }

    pub async fn stats(&self) -> Option<Stats> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx.send(Msg::Stats(tx)).ok()?;
        rx.await.ok()
    }
}

/// An attempt whose key is being written.
#[derive(Debug, Clone)]
pub(super) struct PendingPut {
    pub run: Arc<str>,
    pub call: u64,
    pub attempt: u32,
    pub worker: u64,
    pub lease: LeaseId,
}

/// Why the lease store would not write an attempt key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The worker's lease is gone: the call goes back to its queue.
    LeaseGone,
    /// The store refused the write itself (permanent): the call fails with this reason.
    Refused(String),
}
