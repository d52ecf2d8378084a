//! The worker loop: one link to a coordinator, many attempts at once.
//!
//! The worker says `Hello` (backends, models, labels, slots, and the attempts it still holds
//! from an earlier link), then runs every `Assignment` it receives as a task of its own,
//! streaming progress, transcript chunks and finally one `Outcome` per assignment. A `Cancel`
//! fires the attempt's cancel token; the backend kills what it started and the outcome reports
//! `Cancelled`. A link that breaks does not end the attempts ([`Worker::serve`]); when the
//! worker stops, every attempt is cancelled and awaited before it returns.
//!
//! Invariant: every assignment gets exactly one outcome (that is how the coordinator gets its
//! slot back), and the outcome is sent after the attempt's last transcript chunk.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_proto::link::Link;
use flotilla_proto::v1::{
    self, Assignment, CoordinatorMessage, FailureKind, Hello, ProgressKind, WorkerMessage,
    coordinator_message, outcome, worker_message,
};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backend::{AgentBackend, Error, EventSink, Events, Task};
use crate::workspace::Workspace;
use tracing::Instrument;

/// Transcript events are sent in chunks of at most this many events.
const TRANSCRIPT_CHUNK: usize = 64;

/// Options of one worker.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Name announced in `Hello` (informational; remote workers are known by certificate).
    pub name: String,
    /// Attempts this worker runs at once.
    pub slots: u32,
    /// Root of all per-call working directories.
    pub workspace: std::path::PathBuf,
    /// Free-form labels announced to the scheduler.
    pub labels: HashMap<String, String>,
    /// Every agent works in `workspace` itself (the embedded mode: the user's repository or
    /// directory) instead of a scratch directory per call.
    pub shared_workspace: bool,
    /// The largest result (outcome) this worker sends; a bigger one fails its call with its
    /// size (at most [`flotilla_proto::frag::MAX_MESSAGE_BYTES`]).
    pub max_result_bytes: usize,
    /// Sources named by `file://` URLs or local paths may be fetched.
    pub allow_file_sources: bool,
    /// Hosts a URL source may name although they resolve to this machine or its link
    /// (loopback, link-local such as a cloud metadata service); `*`: any.
    pub allow_source_hosts: Vec<String>,
    /// URL sources are fetched with the worker's own git and ssh credentials (its home's
    /// keys and config, the ssh agent, the system git config) rather than anonymously.
    pub source_credentials: bool,
    /// Where agents' processes run.
    pub sandbox: crate::sandbox::Sandbox,
    /// What one attempt may use.
    pub limits: crate::limits::Limits,
    /// The provider accounts' limits this worker declares (input tokens per minute, requests
    /// at once; 0: not configured), for the coordinator's admission.
    pub account_limits: AccountLimits,
    /// Source checkouts are copy-on-write views made by these (else full checkouts).
    pub layers: Option<crate::layers::Layers>,
}

impl WorkerOptions {
    /// A worker of `slots` slots under `workspace` whose agents run unconfined, with a scratch
    /// directory each, no labels, no file sources and no declared account limits: an
    /// in-process worker of a test or a benchmark.
    pub fn unsandboxed(name: &str, slots: u32, workspace: std::path::PathBuf) -> WorkerOptions {
        WorkerOptions {
            name: name.to_owned(),
            slots,
            workspace,
            labels: HashMap::new(),
            shared_workspace: false,
            max_result_bytes: flotilla_proto::frag::MAX_MESSAGE_BYTES,
            allow_file_sources: false,
            allow_source_hosts: Vec::new(),
            source_credentials: false,
            sandbox: crate::sandbox::Sandbox::Off,
            limits: crate::limits::Limits::default(),
            account_limits: AccountLimits::default(),
            layers: None,
        }
    }
}

/// What a worker says of the provider accounts its backends call through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccountLimits {
    pub itpm: u64,
    pub max_concurrent: u32,
    /// Backends whose model server keeps a prefix cache local to this worker
    /// (`--local-prefix-cache`): the coordinator sends calls that share a prefix back here.
    pub local_cache: Vec<String>,
}

/// A worker with its backends.
pub struct Worker {
    opts: WorkerOptions,
    /// Drawn at random when the worker is made, sent in every `Hello`: the coordinator lets a
    /// link take an attached link's place only when both are this worker's.
    incarnation: String,
    backends: HashMap<&'static str, Arc<dyn AgentBackend>>,
    default_backend: &'static str,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("opts", &self.opts)
            .field("backends", &self.backends.keys().collect::<Vec<_>>())
            .finish()
    }
}

type AttemptId = (String, u64, u32);

impl Worker {
    /// A worker whose default backend is the first one given.
    pub fn new(opts: WorkerOptions, backends: Vec<Arc<dyn AgentBackend>>) -> Self {
        let default_backend = backends.first().map_or("", |b| b.name());
        let backends = backends.into_iter().map(|b| (b.name(), b)).collect();
        let mut bytes = [0u8; 16];
        // Without entropy every worker of this name is one incarnation, as before the field
        // existed: they take each other's place instead of being refused.
        let _ = getrandom::fill(&mut bytes);
        crate::meters::SLOTS.store(i64::from(opts.slots), std::sync::atomic::Ordering::Relaxed);
        crate::meters::SANDBOXED.store(
            i64::from(!matches!(opts.sandbox, crate::sandbox::Sandbox::Off)),
            std::sync::atomic::Ordering::Relaxed,
        );
        Worker {
            opts,
            incarnation: hex::encode(bytes),
            backends,
            default_backend,
        }
    }

    /// Serves one link until it closes or `cancel` fires (an in-process worker).
    pub async fn run(&self, link: Link, cancel: CancellationToken) {
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(link);
        drop(tx);
        self.serve(rx, cancel).await;
    }

    /// The provider accounts of its backends, with the limits it was given.
    fn accounts(&self) -> Vec<v1::Account> {
        let mut out: Vec<v1::Account> = self
            .backends
            .iter()
            .filter_map(|(name, b)| {
                let local = self
                    .opts
                    .account_limits
                    .local_cache
                    .iter()
                    .any(|b| b == name);
                b.account().map(|id| v1::Account {
                    backend: (*name).to_owned(),
                    // A model server of this worker's own is an account of its own, whatever
                    // address (`localhost:8000`) other workers' servers share.
                    id: if local {
                        format!("{id}/{}", self.opts.name)
                    } else {
                        id
                    },
                    itpm: self.opts.account_limits.itpm,
                    max_concurrent: self.opts.account_limits.max_concurrent,
                    local_cache: local,
                })
            })
            .collect();
        out.sort_by(|a, b| a.backend.cmp(&b.backend));
        out
    }

    fn hello(&self, held: Vec<v1::AttemptRef>) -> WorkerMessage {
        let mut models: Vec<String> = self.backends.values().flat_map(|b| b.models()).collect();
        models.sort();
        models.dedup();
        let mut backends: Vec<String> = self.backends.keys().map(|s| (*s).to_owned()).collect();
        backends.sort();
        WorkerMessage {
            msg: Some(worker_message::Msg::Hello(Hello {
                protocol_version: flotilla_proto::PROTOCOL_VERSION.to_owned(),
                name: self.opts.name.clone(),
                backends,
                models,
                labels: self.opts.labels.clone(),
                slots: self.opts.slots,
                held,
                accounts: self.accounts(),
                incarnation: self.incarnation.clone(),
            })),
        }
    }

    /// Serves the links that arrive on `links`, one at a time, until `cancel` fires or the
    /// channel closes with no link up. Attempts outlive a broken link: while cut off, the
    /// worker keeps running them and keeps their outcomes and transcripts; the next link
    /// starts with a `Hello` listing what it holds, then delivers what it kept. Cut off for
    /// longer than the lease TTL (the coordinator has restarted them elsewhere by then), it
    /// cancels them.
    pub async fn serve(&self, mut links: mpsc::UnboundedReceiver<Link>, cancel: CancellationToken) {
        crate::sandbox::jail_git(&self.opts.sandbox, &self.opts.limits);
        if !self.opts.shared_workspace {
            // A workspace of the worker's own (never the user's directory, embedded).
            crate::source::Sources::remove_shared_caches(&self.opts.workspace);
        }
        let (out_tx, mut out_rx) = mpsc::unbounded_channel::<WorkerMessage>();
        let serving = Serving {
            tracker: TaskTracker::new(),
            running: Arc::default(),
            out_tx,
            workspace: if self.opts.shared_workspace {
                Workspace::shared(&self.opts.workspace)
            } else {
                Workspace::new(&self.opts.workspace)
            },
            sources: Arc::new(
                crate::source::Sources::with_limit(
                    &self.opts.workspace,
                    self.opts.allow_file_sources,
                    self.opts.max_result_bytes,
                )
                .allowing_hosts(self.opts.allow_source_hosts.clone())
                .with_credentials(self.opts.source_credentials)
                .with_layers(self.opts.layers.clone()),
            ),
        };
        let (tracker, running, sources) = (&serving.tracker, &serving.running, &serving.sources);
        let mut link: Option<Link> = None;
        let mut links_open = true;
        let mut kept = Kept::default();
        let mut cut_off_since: Option<Instant> = None;
        let mut grace = DEFAULT_GRACE;
        let mut sweep = tokio::time::interval(SWEEP_EVERY);
        let sweeping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        loop {
            let give_up = cut_off_since.map(|t| t + grace);
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = sweep.tick(), if !sweeping.load(std::sync::atomic::Ordering::Acquire) => {
                    self.sweep(&serving, &sweeping);
                }
                next = links.recv(), if links_open => match next {
                    Some(new) => {
                        // What runs now, then whatever the attempts already sent: an attempt
                        // sends its outcome before it leaves `running`, so none slips between.
                        let mut held = running_refs(running);
                        while let Ok(m) = out_rx.try_recv() {
                            kept.keep(m);
                        }
                        held.extend(kept.held());
                        if new.tx.send(self.hello(held)).is_ok() {
                            // Cut off until the coordinator welcomes this link.
                            link = Some(new);
                            for m in kept.take_for_resend() {
                                deliver(&mut link, &mut kept, m);
                            }
                        }
                    }
                    None => {
                        links_open = false;
                        if link.is_none() {
                            break;
                        }
                    }
                },
                msg = recv_from(&mut link) => match msg {
                    Some(CoordinatorMessage { msg: Some(msg) }) => match msg {
                        coordinator_message::Msg::Welcome(w) => {
                            // Two TTLs: one for the coordinator to give up on us, one more
                            // for a standby to take over and adopt what we run.
                            if w.lease_ttl_ms > 0 {
                                grace = Duration::from_millis(w.lease_ttl_ms.saturating_mul(2));
                            }
                            cut_off_since = None;
                            tracing::debug!(worker = %self.opts.name, id = %w.worker_id, "attached");
                        }
                        coordinator_message::Msg::Assign(a) => self.assign(&serving, a, &cancel),
                        coordinator_message::Msg::Cancel(c) => {
                            let id: AttemptId = (c.run_id, c.call, c.attempt);
                            if let Some((token, ..)) = lock(running).get(&id) {
                                tracing::debug!(run = %id.0, call = id.1, attempt = id.2, reason = %c.reason, "cancel");
                                token.cancel();
                            }
                        }
                        // Put back together by the gRPC bridge; a stray one means nothing.
                        coordinator_message::Msg::Fragment(_) => {}
                        coordinator_message::Msg::SourceData(d) => sources.deliver(d),
                    },
                    Some(CoordinatorMessage { msg: None }) => {}
                    None => {
                        link = None;
                        if !links_open {
                            break;
                        }
                        if cut_off_since.is_none() {
                            tracing::warn!(worker = %self.opts.name, attempts = lock(running).len(), "cut off from the coordinator; keeping attempts for {}", humanize(grace));
                            cut_off_since = Some(Instant::now());
                        }
                        kept.link_broke();
                    }
                },
                Some(m) = out_rx.recv() => deliver(&mut link, &mut kept, m),
                () = sleep_until_opt(give_up) => {
                    tracing::warn!(worker = %self.opts.name, "cut off for longer than the lease TTL; giving up the attempts (the coordinator has restarted them)");
                    for (token, ..) in lock(running).values() {
                        token.cancel();
                    }
                    cut_off_since = None;
                }
            }
        }
        for (token, ..) in lock(running).values() {
            token.cancel();
        }
        tracker.close();
        tracker.wait().await;
        // Outcomes of the last moments go out if the link is still there.
        while let Ok(m) = out_rx.try_recv() {
            deliver(&mut link, &mut kept, m);
        }
    }

    /// Starts attempt `a` (once: an assignment it already runs is a duplicate).
    fn assign(&self, serving: &Serving, a: Assignment, cancel: &CancellationToken) {
        let id: AttemptId = (a.run_id.clone(), a.call, a.attempt);
        if lock(&serving.running).contains_key(&id) {
            return;
        }
        let token = cancel.child_token();
        lock(&serving.running).insert(id.clone(), (token.clone(), a.fence, a.call_key.clone()));
        let backend = self.backend_for(&a);
        let tx = serving.out_tx.clone();
        let running = serving.running.clone();
        let parts = Parts {
            workspace: serving.workspace.clone(),
            sandbox: self.opts.sandbox.clone(),
            limits: self.opts.limits.clone(),
            sources: serving.sources.clone(),
            running: running.clone(),
            tracker: serving.tracker.clone(),
        };
        let limit = self.opts.max_result_bytes;
        // The attempt's future (kilobytes) is boxed once here rather than copied whole into
        // and through the task's cell: the copies were a tenth of a worker's time in the
        // fleet's fan-out.
        serving.tracker.spawn(async move {
            let outcome = Box::pin(run_attempt(a, backend, parts, tx.clone(), token)).await;
            let outcome = flotilla_proto::frag::fit_outcome(outcome, limit);
            // Into the outbox before leaving `running`, so it is always held.
            let _ = tx.send(WorkerMessage {
                msg: Some(worker_message::Msg::Outcome(outcome)),
            });
            lock(&running).remove(&id);
        });
    }

    /// Removes call directories no attempt used for [`SWEEP_AFTER`], off the serving loop
    /// (removing large trees must not hold up the link); `sweeping` while it runs.
    fn sweep(&self, serving: &Serving, sweeping: &Arc<std::sync::atomic::AtomicBool>) {
        sweeping.store(true, std::sync::atomic::Ordering::Release);
        let (ws, running, done) = (
            serving.workspace.clone(),
            serving.running.clone(),
            sweeping.clone(),
        );
        let sources = serving.sources.clone();
        let name = self.opts.name.clone();
        serving.tracker.spawn_blocking(move || {
            let gone = ws.sweep(SWEEP_AFTER, |run, call| {
                lock(&running).keys().any(|(r, c, _)| r == run && *c == call)
            });
            if gone > 0 {
                tracing::info!(worker = %name, directories = gone, "removed call directories no attempt used for {}", humanize(SWEEP_AFTER));
            }
            // After the call directories: a tree outlives the writes kept over it.
            let trees = sources.sweep_trees(SWEEP_AFTER);
            if trees > 0 {
                tracing::info!(worker = %name, trees, "removed shared trees no checkout used for {}", humanize(SWEEP_AFTER));
            }
            done.store(false, std::sync::atomic::Ordering::Release);
        });
    }

    fn backend_for(&self, a: &Assignment) -> Result<Arc<dyn AgentBackend>, Error> {
        let name = a
            .task
            .as_ref()
            .map(|t| t.backend.as_str())
            .filter(|b| !b.is_empty())
            .unwrap_or(self.default_backend);
        self.backends.get(name).cloned().ok_or_else(|| {
            let mut known: Vec<_> = self.backends.keys().copied().collect();
            known.sort_unstable();
            Error::new(
                FailureKind::Invalid,
                format!(
                    "this worker has no backend {name:?} (it has: {})",
                    known.join(", ")
                ),
            )
        })
    }
}

/// Attempts running here: their cancel tokens, fences and call keys.
type Running = Arc<Mutex<HashMap<AttemptId, (CancellationToken, i64, String)>>>;

/// How often the worker looks for call directories no attempt uses any more.
const SWEEP_EVERY: Duration = Duration::from_secs(300);
/// A call directory kept for a retry that has not come within this long goes.
const SWEEP_AFTER: Duration = Duration::from_secs(3600);

/// Longest a worker keeps its attempts while cut off before it hears the coordinator's TTL.
const DEFAULT_GRACE: Duration = Duration::from_secs(20);
/// Outcomes sent this shortly before a link broke may not have arrived; they are sent again.
const RESEND_WINDOW: Duration = Duration::from_secs(30);
/// At most this many outcomes are remembered for sending again.
const RESEND_MAX: usize = 16_384;
/// Transcript chunks kept while cut off (outcomes are always kept; progress never).
const KEPT_MAX: usize = 100_000;

/// What the worker keeps for the next link.
#[derive(Default)]
struct Kept {
    /// Not delivered: outcomes and transcript chunks produced while cut off.
    pending: VecDeque<WorkerMessage>,
    /// Outcomes sent on the current link, newest last, with when they were sent.
    recent: VecDeque<(Instant, v1::Outcome)>,
    /// Outcomes sent shortly before the last link broke.
    unsure: Vec<v1::Outcome>,
}

impl Kept {
    fn link_broke(&mut self) {
        let since = Instant::now().checked_sub(RESEND_WINDOW);
        self.unsure.extend(
            self.recent
                .drain(..)
                .filter(|(at, _)| since.is_none_or(|s| *at >= s))
                .map(|(_, o)| o),
        );
    }

    /// The attempts whose outcomes it keeps (not delivered, or not sure to have arrived).
    fn held(&self) -> Vec<v1::AttemptRef> {
        let mut held = Vec::new();
        let outcomes = self.pending.iter().filter_map(|m| match &m.msg {
            Some(worker_message::Msg::Outcome(o)) => Some(o),
            _ => None,
        });
        for o in outcomes.chain(self.unsure.iter()) {
            held.push(v1::AttemptRef {
                run_id: o.run_id.clone(),
                call: o.call,
                attempt: o.attempt,
                fence: o.fence,
                call_key: o.call_key.clone(),
                ended: true,
            });
        }
        held
    }

    /// What to send after `Hello` on a new link, in order.
    fn take_for_resend(&mut self) -> Vec<WorkerMessage> {
        let mut out: Vec<WorkerMessage> = self
            .unsure
            .drain(..)
            .map(|o| WorkerMessage {
                msg: Some(worker_message::Msg::Outcome(o)),
            })
            .collect();
        out.extend(self.pending.drain(..));
        out
    }

    fn keep(&mut self, m: WorkerMessage) {
        match &m.msg {
            Some(worker_message::Msg::Outcome(_)) => self.pending.push_back(m),
            Some(worker_message::Msg::Transcript(_)) if self.pending.len() < KEPT_MAX => {
                self.pending.push_back(m);
            }
            _ => {}
        }
    }

    fn sent(&mut self, o: &v1::Outcome) {
        let now = Instant::now();
        while self.recent.len() >= RESEND_MAX
            || self
                .recent
                .front()
                .is_some_and(|(at, _)| now.duration_since(*at) > RESEND_WINDOW)
        {
            self.recent.pop_front();
        }
        self.recent.push_back((now, o.clone()));
    }
}

/// The attempts running now.
fn running_refs(running: &Running) -> Vec<v1::AttemptRef> {
    lock(running)
        .iter()
        .map(|((run, call, attempt), (_, fence, key))| v1::AttemptRef {
            run_id: run.clone(),
            call: *call,
            attempt: *attempt,
            fence: *fence,
            call_key: key.clone(),
            ended: false,
        })
        .collect()
}

/// Sends on the current link, or keeps the message for the next one.
fn deliver(link: &mut Option<Link>, kept: &mut Kept, m: WorkerMessage) {
    let Some(l) = link.as_ref() else {
        kept.keep(m);
        return;
    };
    let outcome = match &m.msg {
        Some(worker_message::Msg::Outcome(o)) => Some(o.clone()),
        _ => None,
    };
    match l.tx.send(m) {
        Ok(()) => {
            if let Some(o) = &outcome {
                kept.sent(o);
            }
        }
        Err(mpsc::error::SendError(m)) => kept.keep(m),
    }
}

async fn recv_from(link: &mut Option<Link>) -> Option<CoordinatorMessage> {
    match link {
        Some(l) => l.rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the worker's serving loop holds for the attempts it starts: their tasks, what runs
/// now, the outbox, the workspace and the source cache.
struct Serving {
    tracker: TaskTracker,
    running: Running,
    out_tx: mpsc::UnboundedSender<WorkerMessage>,
    workspace: Workspace,
    sources: Arc<crate::source::Sources>,
}

/// The worker's parts an attempt runs with.
#[derive(Clone)]
struct Parts {
    workspace: Workspace,
    sandbox: crate::sandbox::Sandbox,
    limits: crate::limits::Limits,
    sources: Arc<crate::source::Sources>,
    /// Every attempt running here (another attempt of this call may be among them).
    running: Running,
    /// The worker's tasks: a checkout's files are removed on it, off the attempt's path.
    tracker: TaskTracker,
}

impl Parts {
    /// Removes the checkout `wt`: a source checkout's directories (a view's, or a full
    /// checkout's) are set aside at once and removed on the worker's tasks (whatever the
    /// agent wrote, its outcome does not wait for it); a worktree of the user's, now.
    async fn discard(&self, wt: &crate::worktree::Worktree) {
        match wt.set_aside() {
            Some(gone) => {
                self.tracker.spawn_blocking(move || {
                    for dir in &gone {
                        crate::workspace::remove_tree(dir);
                    }
                    if let Some(first) = gone.first() {
                        crate::workspace::prune_above(first);
                    }
                });
            }
            None => wt.discard().await,
        }
    }

    /// Whether an attempt of `run`'s call `call` other than `attempt` runs here now: its
    /// directory is that attempt's too, and must stay.
    fn another_attempt(&self, (run, call, attempt): (&str, u64, u32)) -> bool {
        lock(&self.running)
            .keys()
            .any(|(r, c, n)| r == run && *c == call && *n != attempt)
    }
}

async fn run_attempt(
    a: Assignment,
    backend: Result<Arc<dyn AgentBackend>, Error>,
    parts: Parts,
    tx: mpsc::UnboundedSender<WorkerMessage>,
    cancel: CancellationToken,
) -> v1::Outcome {
    let link = tx.clone();
    let spec = a.task.clone().unwrap_or_default();
    // This attempt's span joins the run's trace: its parent is the coordinator's attempt span.
    let span = tracing::info_span!(
        "attempt.run",
        flotilla.run_id = %a.run_id,
        flotilla.call = a.call,
        flotilla.attempt = a.attempt,
        flotilla.backend = %spec.backend,
        flotilla.label = %spec.label,
        gen_ai.request.model = %spec.model,
        flotilla.outcome = tracing::field::Empty,
    );
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let parent =
            opentelemetry::global::get_text_map_propagator(|p| p.extract(&a.trace_context));
        let _ = span.set_parent(parent);
    }
    let sink = Arc::new(LinkSink {
        tx,
        run_id: a.run_id.clone(),
        call: a.call,
        attempt: a.attempt,
        buffer: Mutex::new(Vec::new()),
        keepalive_every: keepalive_every(a.stall_timeout_ms),
        last_sent: Mutex::new(None),
        span: span.clone(),
        tools: crate::tool_spans::ToolSpans::default(),
    });
    let events = Events::new(sink.clone());
    let at = Attempt {
        a,
        spec,
        parts,
        link,
        events,
    };
    let mut counted = crate::meters::Running::start();
    let outcome = run_attempt_in(at, backend, sink, cancel)
        .instrument(span.clone())
        .await;
    counted.ended = match &outcome.result {
        Some(outcome::Result::Completed(_)) => ("completed", ""),
        Some(outcome::Result::Failure(f)) => (
            "failed",
            FailureKind::try_from(f.kind)
                .unwrap_or(FailureKind::Terminal)
                .class(),
        ),
        None => ("failed", "transient"),
    };
    span.record(
        "flotilla.outcome",
        match &outcome.result {
            Some(outcome::Result::Completed(_)) => "completed",
            Some(outcome::Result::Failure(_)) => "failed",
            None => "none",
        },
    );
    outcome
}

/// `span`'s W3C `traceparent`, when it is traced (none otherwise).
fn trace_parent(span: &tracing::Span) -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// One attempt as it runs on this worker: its assignment and task, the worker's parts it
/// runs with, the link it speaks on and its events.
struct Attempt {
    a: Assignment,
    spec: v1::TaskSpec,
    parts: Parts,
    link: mpsc::UnboundedSender<WorkerMessage>,
    events: Events,
}

/// What an attempt ran to: its result, and the leftovers of an unfinished one (W58).
type Ran = (Result<crate::backend::Output, Error>, Option<v1::Change>);

async fn run_attempt_in(
    at: Attempt,
    backend: Result<Arc<dyn AgentBackend>, Error>,
    sink: Arc<LinkSink>,
    cancel: CancellationToken,
) -> v1::Outcome {
    let (result, partial) = match at.start(backend, &cancel).await {
        Err(e) => (Err(e), None),
        Ok(started) => at.run(started, &cancel).await,
    };
    sink.flush();
    outcome_of(at.a, result, partial)
}

/// What an attempt starts with: its backend, the schema of its result, its checkout.
struct Started {
    backend: Arc<dyn AgentBackend>,
    schema: Option<Value>,
    worktree: Option<crate::worktree::Worktree>,
}

impl Attempt {
    /// The backend, the result's schema and the checkout, or why the attempt cannot start.
    async fn start(
        &self,
        backend: Result<Arc<dyn AgentBackend>, Error>,
        cancel: &CancellationToken,
    ) -> Result<Started, Error> {
        let backend = backend?;
        let schema = parse_schema(&self.spec)?;
        let most = self.parts.limits.settings.prepare;
        let worktree = tokio::select! {
            r = Box::pin(prepare(self, most, backend.uses_directory())) => r?,
            () = cancel.cancelled() => {
                return Err(Error::new(FailureKind::Cancelled, "cancelled while its checkout was made"));
            }
        };
        Ok(Started {
            backend,
            schema,
            worktree,
        })
    }

    /// Runs the agent within the attempt's limits, then judges and settles what it left.
    async fn run(&self, started: Started, cancel: &CancellationToken) -> Ran {
        let Started {
            backend,
            schema,
            worktree,
        } = started;
        let (a, spec, limits) = (&self.a, &self.spec, &self.parts.limits);
        let scratch = &self.parts.workspace;
        let attempt_limits =
            Arc::new(limits.attempt(&format!("{}-{}-{}", a.run_id, a.call, a.attempt)));
        let task = Task {
            run_id: a.run_id.clone(),
            call: a.call,
            attempt: a.attempt,
            call_key: a.call_key.clone(),
            spec: spec.clone(),
            schema,
            workspace: scratch.clone(),
            worktree: worktree.clone(),
            sandbox: self.parts.sandbox.clone(),
            limits: attempt_limits.clone(),
            tmp_size: limits.settings.tmp,
            trace_parent: trace_parent(&tracing::Span::current()),
        };
        // On a timeout or over the disk quota the attempt is cancelled the normal way, so the
        // backend kills what it started before the outcome is sent.
        let token = cancel.child_token();
        let quota = limits.settings.disk.filter(|_| !scratch.is_shared());
        // A backend that works in no directory has none to watch (nor to measure or remove
        // below): its attempt touches no file.
        let dir_used = backend.uses_directory();
        let watched = match &worktree {
            Some(wt) => Some(wt.writes().to_owned()),
            None if dir_used => scratch.call_dir(&a.run_id, a.call),
            None => None,
        };
        let watch = match quota.zip(watched) {
            Some((q, dir)) => {
                Some(Box::pin(crate::limits::DiskWatch::start(dir, q, token.clone())).await)
            }
            None => None,
        };
        // The agent starts now: the stall timer, held while its workspace was made, runs
        // from here.
        if preparing(spec) {
            self.events.progress(ProgressKind::AgentStarted, 0);
        }
        let mut result = self.bounded(&*backend, &task, token).await;
        // The agent is done; what the worker records of its workspace now is not the agent's
        // time: the stall timer is held until the outcome.
        if preparing(spec) {
            self.events.progress(ProgressKind::Preparing, 0);
        }
        // The agent is gone: its checkout's git directory is made plain before the worker's
        // git reads it.
        if let Some(wt) = &worktree {
            wt.sanitize();
        }
        // What its checkout holds now, in its usage.
        let disk = match &worktree {
            Some(wt) => crate::workspace::usage_of(wt.writes(), true),
            None if dir_used => task_dir_use(scratch, a),
            None => crate::workspace::Usage::default(),
        };
        match result.as_mut() {
            Ok(out) => out.usage.disk_bytes = disk.bytes,
            Err(e) => e.usage.disk_bytes = disk.bytes,
        }
        // A limit the attempt went over is why it ended, whatever the backend saw.
        let over_quota = watch.and_then(|w| w.over(disk));
        if let Some(why) = over_quota.or_else(|| attempt_limits.exceeded()) {
            let usage = result.as_ref().err().map(|e| e.usage).unwrap_or_default();
            let mut e = Error::new(FailureKind::Terminal, why);
            e.usage = usage;
            result = Err(e);
        } else if let (Err(e), Some(hint)) = (result.as_mut(), limits.rlimits_hint())
            && e.kind == FailureKind::Terminal
        {
            e.message.push_str(&hint);
        }
        let partial = self
            .settle_within(worktree.as_ref(), dir_used, &mut result)
            .await;
        (result, partial)
    }

    /// The agent's run, cancelled at the script's timeout or the worker's longest attempt,
    /// whichever is less.
    async fn bounded(
        &self,
        backend: &dyn AgentBackend,
        task: &Task,
        token: CancellationToken,
    ) -> Result<crate::backend::Output, Error> {
        let spec = &self.spec;
        let wall = self.parts.limits.settings.wall;
        let asked = (spec.timeout_ms > 0).then(|| Duration::from_millis(spec.timeout_ms));
        let limit = match (asked, wall) {
            (Some(a), Some(w)) => Some(a.min(w)),
            (a, w) => a.or(w),
        };
        let Some(limit) = limit else {
            return crate::backend::run_attempt(backend, task, &self.events, token).await;
        };
        let by_worker = wall == Some(limit) && asked != Some(limit);
        let run = crate::backend::run_attempt(backend, task, &self.events, token.clone());
        tokio::pin!(run);
        tokio::select! {
            r = &mut run => r,
            _ = tokio::time::sleep(limit) => {
                token.cancel();
                // Its conversation goes on with the timeout, for the call's next attempt.
                let session = run.await.err().and_then(|e| e.session);
                Err(Error {
                    session,
                    ..Error::new(
                    FailureKind::Timeout,
                    if by_worker {
                        format!("agent timed out after {}, the worker's longest attempt (--max-attempt-time)", humanize(limit))
                    } else {
                        format!("agent timed out after {}", humanize(limit))
                    },
                )})
            }
        }
    }

    /// What the agent left is recorded within a bound of its own: nothing in the checkout
    /// can keep the worker's git busy past it. The leftovers of an unfinished attempt.
    async fn settle_within(
        &self,
        worktree: Option<&crate::worktree::Worktree>,
        dir_used: bool,
        result: &mut Result<crate::backend::Output, Error>,
    ) -> Option<v1::Change> {
        let bound = settle_bound(&self.spec);
        let settled = Box::pin(settle(self, worktree, dir_used, result));
        if let Ok(partial) = tokio::time::timeout(bound, settled).await {
            return partial;
        }
        // A source checkout goes (an embedded worktree is the user's).
        if let Some(wt) = worktree.filter(|wt| wt.own_repo()) {
            Box::pin(wt.discard()).await;
        }
        let usage = match &*result {
            Ok(out) => out.usage,
            Err(e) => e.usage,
        };
        let mut e = Error::new(
            FailureKind::Terminal,
            format!(
                "recording what the agent left in its checkout took more than {}; its checkout is gone",
                humanize(bound)
            ),
        );
        e.usage = usage;
        *result = Err(e);
        None
    }
}

/// The outcome the coordinator is sent for assignment `a`.
fn outcome_of(
    a: Assignment,
    result: Result<crate::backend::Output, Error>,
    partial: Option<v1::Change>,
) -> v1::Outcome {
    let (result, usage) = match result {
        Ok(out) => (
            outcome::Result::Completed(v1::Completed {
                text: out.text,
                json: out.json.map(|v| v.to_string()),
                change: out.change,
                model: out.model,
            }),
            out.usage,
        ),
        Err(e) => (
            outcome::Result::Failure(v1::Failure {
                kind: e.kind as i32,
                message: e.message,
                retry_after_ms: e.retry_after.map_or(0, |d| d.as_millis() as u64),
                partial,
                session: e.session.map(|s| *s),
            }),
            e.usage,
        ),
    };
    v1::Outcome {
        run_id: a.run_id,
        call: a.call,
        attempt: a.attempt,
        result: Some(result),
        usage: Some(usage),
        fence: a.fence,
        call_key: a.call_key,
    }
}

/// The longest the worker's own git may take over what an attempt left: the attempt's own
/// timeout, at least 30 s, at most 10 minutes.
fn settle_bound(spec: &v1::TaskSpec) -> Duration {
    Duration::from_millis(spec.timeout_ms).clamp(Duration::from_secs(30), Duration::from_secs(600))
}

/// After an attempt: its source checkout's change goes into `result` (a finished agent's
/// edits) or comes back as the leftovers for the call's next attempt (W58); a worktree is
/// committed or removed; a scratch directory (when its backend uses one) goes when the call ends.
async fn settle(
    at: &Attempt,
    worktree: Option<&crate::worktree::Worktree>,
    dir_used: bool,
    result: &mut Result<crate::backend::Output, Error>,
) -> Option<v1::Change> {
    let (a, spec, parts, events) = (&at.a, &at.spec, &at.parts, &at.events);
    let (scratch, sources) = (&parts.workspace, &parts.sources);
    // A directory another attempt of the call uses now (a restart on this worker that did
    // not wait for this one) is that attempt's: it stays.
    let shared = parts.another_attempt((&a.run_id, a.call, a.attempt));
    let mut partial = None;
    match worktree {
        // A source checkout: a finished agent's edits go back as its change;
        // an unfinished attempt's stay for the next one (W58).
        Some(wt) if !spec.source_repo.is_empty() => {
            if let Ok(out) = result.as_mut() {
                match crate::source::change_of(wt, spec, (&a.run_id, a.call), sources.max_change())
                    .await
                {
                    Ok(Some(c)) if let Err(e) = sources.fits(out.text.len(), &c) => {
                        // Too big to send: the checkout stays (for the workspace sweep's
                        // hour), so the work is not thrown away with the result.
                        scratch.touch(&a.run_id, a.call);
                        *result = Err(Error::new(
                            FailureKind::Terminal,
                            format!(
                                "{e}; what it wrote stays at {} on this worker for an hour; have the agent commit less (generated files, build output) or raise --max-result-mib",
                                wt.writes().display()
                            ),
                        ));
                    }
                    Ok(change) => {
                        if let Some(c) = &change {
                            events.transcript(serde_json::json!({
                                "type": "change", "commit": c.commit, "base": c.base,
                                "files": c.files, "insertions": c.insertions, "deletions": c.deletions,
                            }));
                        }
                        out.change = change;
                        if !shared {
                            parts.discard(wt).await;
                        }
                    }
                    Err(e) => *result = Err(e),
                }
            } else if ends_call(result) && !shared {
                // The call ends here: no later attempt will want its checkout.
                parts.discard(wt).await;
            } else if result.is_err() && spec.source_url.is_empty() {
                // Another attempt may follow, on any worker: what this one
                // left goes with its failure (W58). The checkout stays too.
                match crate::source::partial_of(
                    wt,
                    spec,
                    (&a.run_id, a.call, a.attempt),
                    sources.max_change(),
                )
                .await
                {
                    Ok(Some(c)) => match sources.fits(0, &c) {
                        Ok(()) => {
                            events.transcript(serde_json::json!({
                                "type": "partial", "commit": c.commit, "base": c.base, "files": c.files,
                            }));
                            partial = Some(c);
                        }
                        Err(e) => {
                            tracing::warn!(run = %a.run_id, call = a.call, error = %e, "what the attempt left is too big to send; only a retry on this worker keeps it")
                        }
                    },
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(run = %a.run_id, call = a.call, error = %e, "cannot record what the attempt left; only a retry on this worker keeps it")
                    }
                }
            }
        }
        Some(wt) => {
            let message = format!(
                "flotilla: agent {:?} (#{}) of run {}, attempt {}",
                spec.label, a.call, a.run_id, a.attempt
            );
            let kept = wt.finish_as(&message).await == crate::worktree::Finished::Kept;
            events.transcript(serde_json::json!({
                "type": "worktree", "path": wt.path, "branch": wt.branch, "kept": kept,
            }));
        }
        // A scratch directory stays only for a retry of its call (W58).
        None if ends_call(result) && !shared && dir_used => scratch.remove(&a.run_id, a.call),
        None => {}
    }
    // What stays for a retry counts as used now: the workspace sweep takes it only once no
    // attempt has used it for a while.
    if !ends_call(result) && (dir_used || worktree.is_some()) {
        scratch.touch(&a.run_id, a.call);
    }
    partial
}

/// Whether no attempt of the call follows this one, whatever it left: it finished, or failed
/// in a way the coordinator does not retry.
fn ends_call(result: &Result<crate::backend::Output, Error>) -> bool {
    match result {
        Ok(_) => true,
        Err(e) => matches!(
            e.kind,
            FailureKind::Terminal
                | FailureKind::Timeout
                | FailureKind::Schema
                | FailureKind::Invalid
        ),
    }
}

/// What a call's own directory holds, if it has one (none for a shared workspace: that is
/// the user's).
fn task_dir_use(workspace: &Workspace, a: &Assignment) -> crate::workspace::Usage {
    workspace
        .call_dir(&a.run_id, a.call)
        .map_or_else(Default::default, |d| crate::workspace::usage_of(&d, true))
}

/// Whether an attempt of `spec` has a workspace to make before its agent starts (a checkout
/// of the run's source, a worktree): while it is made, the coordinator's stall timer is held.
fn preparing(spec: &v1::TaskSpec) -> bool {
    !spec.source_repo.is_empty() || spec.isolation == "worktree"
}

/// The call's checkout ([`checkout_for`]) within `most` (the worker's `--max-prepare-time`),
/// the stall timer held meanwhile. What the worker fails at here is its own failure, not the
/// agent's: `FailureKind::Setup`, which the call goes again for.
///
/// An agent that works in no directory (`dir_used` false) gets no checkout of the run's
/// source: the source costs its attempts nothing.
async fn prepare(
    at: &Attempt,
    most: Duration,
    dir_used: bool,
) -> Result<Option<crate::worktree::Worktree>, Error> {
    let (a, spec, events, link) = (&at.a, &at.spec, &at.events, &at.link);
    let (workspace, sources) = (&at.parts.workspace, &*at.parts.sources);
    if !dir_used && spec.isolation != "worktree" {
        return Ok(None);
    }
    let made = preparing(spec);
    if made {
        events.progress(ProgressKind::Preparing, 0);
    }
    let started = std::time::Instant::now();
    let checkout = checkout_for(a, spec, workspace, sources, link, events);
    let (r, result) = match tokio::time::timeout(most, checkout).await {
        Ok(Err(e)) if e.kind == FailureKind::Retryable => (
            Err(Error {
                kind: FailureKind::Setup,
                ..e
            }),
            "failed",
        ),
        Ok(Err(e)) => (Err(e), "failed"),
        Ok(Ok(w)) => (Ok(w), "made"),
        Err(_) => {
            // Nothing half made stays.
            workspace.remove(&a.run_id, a.call);
            let e = Error::new(
                FailureKind::Setup,
                format!(
                    "making the attempt's workspace took more than {} (the worker's --max-prepare-time); the call goes again",
                    humanize(most)
                ),
            );
            (Err(e), "timed_out")
        }
    };
    if made {
        crate::meters::workspace(result, started.elapsed());
    }
    r
}

/// The call's checkout: of the run's source when it has one (every call its own), else a
/// worktree of the workspace's repository for `isolation: 'worktree'`, else none.
async fn checkout_for(
    a: &Assignment,
    spec: &v1::TaskSpec,
    workspace: &Workspace,
    sources: &crate::source::Sources,
    link: &mpsc::UnboundedSender<WorkerMessage>,
    events: &Events,
) -> Result<Option<crate::worktree::Worktree>, Error> {
    if spec.source_repo.is_empty() {
        return worktree_for(a, spec, workspace, events).await;
    }
    let invalid = |e: String| Error::new(FailureKind::Invalid, e);
    let Some(dir) = workspace.call_dir(&a.run_id, a.call) else {
        return Err(invalid(format!(
            "run {:?} cannot have a checkout on this worker",
            a.run_id
        )));
    };
    let mut wt = sources.checkout(spec, &dir, link).await?;
    if !spec.cwd.is_empty() && wt.view().is_some() {
        // A view exists only for the processes that work in it: they start there, and the
        // mount makes (and confines) the directory.
        wt.workdir = wt
            .path
            .join(crate::workspace::relative(&spec.cwd).map_err(|p| invalid(p.into()))?);
    } else if !spec.cwd.is_empty() {
        wt.workdir =
            crate::workspace::confine(&wt.path, &spec.cwd).map_err(|p| invalid(p.into()))?;
    }
    events.transcript(serde_json::json!({
        "type": "checkout", "path": wt.path, "commit": wt.base, "reused": wt.reused,
    }));
    Ok(Some(wt))
}

async fn worktree_for(
    a: &Assignment,
    spec: &v1::TaskSpec,
    workspace: &Workspace,
    events: &Events,
) -> Result<Option<crate::worktree::Worktree>, Error> {
    if spec.isolation != "worktree" {
        return Ok(None);
    }
    let invalid = |e: String| Error::new(FailureKind::Invalid, e);
    if !workspace.is_shared() {
        // A worker's workspace root is its own, not a repository of the run's: the worktree
        // a fleet agent gets is its checkout of the run's source.
        return Err(invalid(
            "isolation: 'worktree' needs the run's source on a fleet, and this run has none; launch it from a git repository (or with --source git+URL#REF), or drop the isolation option".into(),
        ));
    }
    let root = workspace.root();
    std::fs::create_dir_all(root).map_err(|e| {
        invalid(format!(
            "cannot create workspace root {}: {e}",
            root.display()
        ))
    })?;
    let root = root
        .canonicalize()
        .map_err(|e| invalid(format!("cannot resolve {}: {e}", root.display())))?;
    let dir = if spec.cwd.is_empty() {
        root.clone()
    } else {
        workspace
            .dir_for(&a.run_id, a.call, &spec.cwd)
            .map_err(|p| invalid(p.into()))?
    };
    // Outside a repository there is nothing to branch from: the call fails with the reason
    // (W24: an unsupported isolation rejects), never a silent empty directory.
    let wt = crate::worktree::Worktree::create(&dir, &a.run_id, a.call)
        .await
        .map_err(|p| invalid(p.into()))?;
    events.transcript(serde_json::json!({
        "type": "worktree", "path": wt.path, "branch": wt.branch, "base": wt.base,
        "reused": wt.reused,
    }));
    Ok(Some(wt))
}

fn parse_schema(spec: &v1::TaskSpec) -> Result<Option<Value>, Error> {
    spec.schema_json
        .as_deref()
        .map(serde_json::from_str)
        .transpose()
        .map_err(|e| {
            Error::new(
                FailureKind::Invalid,
                format!("task schema is not JSON: {e}"),
            )
        })
}

fn humanize(d: Duration) -> String {
    if d.as_millis() < 1000 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

struct LinkSink {
    tx: mpsc::UnboundedSender<WorkerMessage>,
    run_id: String,
    call: u64,
    attempt: u32,
    buffer: Mutex<Vec<String>>,
    /// Keep-alives closer together than this after the last progress sent are not sent.
    keepalive_every: Duration,
    last_sent: Mutex<Option<Instant>>,
    /// The attempt's span, and its tool calls' spans under it.
    span: tracing::Span,
    tools: crate::tool_spans::ToolSpans,
}

/// How often an attempt's keep-alive goes to the coordinator: five times per stall timeout,
/// at least every 2 s and at most every 50 ms. (A backend may keep alive far more often; ten
/// thousand sleeping agents at 20 a second each would be 200,000 messages a second.)
fn keepalive_every(stall_timeout_ms: u64) -> Duration {
    if stall_timeout_ms == 0 {
        return Duration::from_secs(2);
    }
    Duration::from_millis(stall_timeout_ms / 5)
        .clamp(Duration::from_millis(50), Duration::from_secs(2))
}

impl LinkSink {
    /// Sends `p` as this attempt's progress.
    fn send_progress(&self, p: v1::Progress) {
        let _ = self.tx.send(WorkerMessage {
            msg: Some(worker_message::Msg::Progress(v1::Progress {
                run_id: self.run_id.clone(),
                call: self.call,
                attempt: self.attempt,
                ..p
            })),
        });
    }

    fn flush(&self) {
        let events = std::mem::take(&mut *lock(&self.buffer));
        if events.is_empty() {
            return;
        }
        let _ = self.tx.send(WorkerMessage {
            msg: Some(worker_message::Msg::Transcript(v1::TranscriptChunk {
                run_id: self.run_id.clone(),
                call: self.call,
                attempt: self.attempt,
                events,
            })),
        });
    }
}

impl EventSink for LinkSink {
    fn progress(&self, kind: ProgressKind, output_tokens: u64, detail: String) {
        {
            let mut last = lock(&self.last_sent);
            let now = Instant::now();
            if kind == ProgressKind::Keepalive
                && last.is_some_and(|t| now.duration_since(t) < self.keepalive_every)
            {
                return;
            }
            *last = Some(now);
        }
        self.send_progress(v1::Progress {
            kind: kind as i32,
            output_tokens,
            detail,
            ..v1::Progress::default()
        });
    }

    fn checkpoint(&self, session: v1::Session) {
        if session.state.len() > flotilla_proto::frag::MAX_SESSION_BYTES {
            return;
        }
        self.send_progress(v1::Progress {
            kind: ProgressKind::SessionCheckpoint as i32,
            session: Some(session),
            ..v1::Progress::default()
        });
    }

    fn transcript(&self, event: Value) {
        self.tools.note(&self.span, &event);
        let full = {
            let mut buffer = lock(&self.buffer);
            buffer.push(flotilla_proto::frag::fit_event(event.to_string()));
            buffer.len() >= TRANSCRIPT_CHUNK
        };
        if full {
            self.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::echo::Echo;
    use flotilla_proto::link::{CoordinatorEnd, link_pair};

    mod fuzz;

    fn worker(dir: &std::path::Path) -> Worker {
        Worker::new(
            WorkerOptions::unsandboxed("w", 2, dir.to_owned()),
            vec![Arc::new(Echo)],
        )
    }

    #[tokio::test(start_paused = true)]
    async fn keep_alives_go_out_a_few_times_per_stall_timeout_and_other_progress_always() {
        assert_eq!(keepalive_every(0), Duration::from_secs(2));
        assert_eq!(keepalive_every(300), Duration::from_millis(60));
        assert_eq!(keepalive_every(100), Duration::from_millis(50));
        assert_eq!(keepalive_every(600_000), Duration::from_secs(2));
        let (tx, mut rx) = mpsc::unbounded_channel();
        let sink = LinkSink {
            tx,
            run_id: "wf_k".into(),
            call: 0,
            attempt: 1,
            buffer: Mutex::new(Vec::new()),
            keepalive_every: keepalive_every(1000),
            last_sent: Mutex::new(None),
            span: tracing::Span::none(),
            tools: crate::tool_spans::ToolSpans::default(),
        };
        let kinds = |rx: &mut mpsc::UnboundedReceiver<WorkerMessage>| {
            let mut out = Vec::new();
            while let Ok(m) = rx.try_recv() {
                if let Some(worker_message::Msg::Progress(p)) = m.msg {
                    out.push(p.kind);
                }
            }
            out
        };
        let keepalive = ProgressKind::Keepalive as i32;
        for _ in 0..20 {
            sink.progress(ProgressKind::Keepalive, 0, String::new());
            tokio::time::advance(Duration::from_millis(5)).await;
        }
        assert_eq!(kinds(&mut rx), vec![keepalive], "one in the first 100 ms");
        sink.progress(ProgressKind::Output, 3, String::new());
        assert_eq!(kinds(&mut rx), vec![ProgressKind::Output as i32]);
        tokio::time::advance(Duration::from_millis(200)).await;
        sink.progress(ProgressKind::Keepalive, 0, String::new());
        assert_eq!(
            kinds(&mut rx),
            vec![keepalive],
            "the next once 200 ms passed"
        );
    }

    /// `w` serving the links sent on the channel, until the token is cancelled.
    pub(super) fn serving(
        w: Worker,
    ) -> (
        mpsc::UnboundedSender<Link>,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let (links_tx, links_rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let serving = tokio::spawn({
            let cancel = cancel.clone();
            async move { w.serve(links_rx, cancel).await }
        });
        (links_tx, cancel, serving)
    }

    async fn next(end: &mut CoordinatorEnd) -> worker_message::Msg {
        loop {
            let m = tokio::time::timeout(Duration::from_secs(30), end.rx.recv())
                .await
                .expect("a message from the worker")
                .expect("link open")
                .msg
                .expect("a message");
            if !matches!(
                m,
                worker_message::Msg::Progress(_) | worker_message::Msg::Transcript(_)
            ) {
                return m;
            }
        }
    }

    fn send(end: &CoordinatorEnd, msg: coordinator_message::Msg) {
        end.tx.send(CoordinatorMessage { msg: Some(msg) }).unwrap();
    }

    fn welcome(ttl: Duration) -> coordinator_message::Msg {
        coordinator_message::Msg::Welcome(v1::Welcome {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            worker_id: "w".into(),
            coordinator: "test".into(),
            lease_ttl_ms: ttl.as_millis() as u64,
        })
    }

    fn assignment(prompt: &str, fence: i64) -> Assignment {
        Assignment {
            run_id: "wf_x".into(),
            call: 7,
            attempt: 1,
            call_key: "k".into(),
            task: Some(v1::TaskSpec {
                prompt: prompt.into(),
                backend: "echo".into(),
                ..v1::TaskSpec::default()
            }),
            trace_context: HashMap::new(),
            fence,
            stall_timeout_ms: 0,
        }
    }

    /// Issue 29: an attempt of a backend that works in no directory (echo here) touches no
    /// file of the workspace: its call's directory is not watched, measured or removed, so
    /// the run's (empty) directory an earlier call left stays for the sweep.
    #[tokio::test]
    async fn an_attempt_of_a_backend_without_a_directory_touches_no_file() {
        use crate::backend::AgentBackend;
        assert!(!Echo.uses_directory());
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("wf_x");
        std::fs::create_dir(&run_dir).unwrap();
        let (links_tx, cancel, serving) = serving(worker(dir.path()));
        let (link, mut end) = link_pair();
        links_tx.send(link).unwrap();
        assert!(matches!(
            next(&mut end).await,
            worker_message::Msg::Hello(_)
        ));
        send(&end, welcome(Duration::from_secs(30)));
        send(&end, coordinator_message::Msg::Assign(assignment("hi", 1)));
        let worker_message::Msg::Outcome(o) = next(&mut end).await else {
            panic!("the attempt's outcome");
        };
        assert!(
            matches!(o.result, Some(outcome::Result::Completed(_))),
            "{o:?}"
        );
        assert!(
            run_dir.is_dir(),
            "an echo attempt at the end of its call removed the run's directory"
        );
        assert_eq!(std::fs::read_dir(&run_dir).unwrap().count(), 0);
        cancel.cancel();
        serving.await.unwrap();
    }

    #[tokio::test]
    async fn an_attempt_outlives_a_broken_link_and_is_reported_on_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let w = worker(dir.path());
        let (links_tx, cancel, serving) = serving(w);
        let (link, mut end) = link_pair();
        links_tx.send(link).unwrap();
        assert!(matches!(next(&mut end).await, worker_message::Msg::Hello(h) if h.held.is_empty()));
        send(&end, welcome(Duration::from_secs(30)));
        send(
            &end,
            coordinator_message::Msg::Assign(assignment("[[sleep:400]] hi", 42)),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(end);
        // The attempt finishes while the worker is cut off.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let (link, mut end) = link_pair();
        links_tx.send(link).unwrap();
        let worker_message::Msg::Hello(h) = next(&mut end).await else {
            panic!("Hello first");
        };
        assert_eq!(h.held.len(), 1, "{:?}", h.held);
        assert_eq!(
            (h.held[0].call, h.held[0].attempt, h.held[0].fence),
            (7, 1, 42)
        );
        let worker_message::Msg::Outcome(o) = next(&mut end).await else {
            panic!("then the kept outcome");
        };
        assert_eq!((o.call, o.attempt, o.fence), (7, 1, 42));
        assert!(
            matches!(o.result, Some(outcome::Result::Completed(_))),
            "{o:?}"
        );
        cancel.cancel();
        serving.await.unwrap();
    }

    #[tokio::test]
    async fn attempts_are_given_up_after_the_lease_ttl_without_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let w = worker(dir.path());
        let (links_tx, cancel, serving) = serving(w);
        let (link, mut end) = link_pair();
        links_tx.send(link).unwrap();
        next(&mut end).await;
        send(&end, welcome(Duration::from_millis(200)));
        send(
            &end,
            coordinator_message::Msg::Assign(assignment("[[sleep:60000]] long", 5)),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(end);
        tokio::time::sleep(Duration::from_millis(800)).await;
        let (link, mut end) = link_pair();
        links_tx.send(link).unwrap();
        next(&mut end).await;
        let worker_message::Msg::Outcome(o) = next(&mut end).await else {
            panic!("the cancelled attempt's outcome");
        };
        let Some(outcome::Result::Failure(f)) = o.result else {
            panic!("{o:?}");
        };
        assert_eq!(f.kind, FailureKind::Cancelled as i32, "{f:?}");
        cancel.cancel();
        serving.await.unwrap();
    }
}
