//! The fleet as the dispatcher sees it: the workers that attached, their slots and what they
//! offer, and the key writer their attempt keys go through. Which worker a call can go to, and
//! why none can, is decided here.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use std::sync::atomic::{AtomicU64, Ordering};

use flotilla_proto::link::CoordinatorEnd;
use flotilla_proto::v1::{self, CoordinatorMessage, coordinator_message};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::handle::{Msg, NameTaken, WorkerView};
use super::lease_writes::{KeyOp, LeaseCtl};
use crate::lease::{LeaseId, Revision};
use crate::listen::Throttled;

/// An attempt holding a slot: (run, call, attempt).
pub(super) type Slot = (Arc<str>, u64, u32);

/// What a worker was given for one of its attempts. What it sends back for that attempt (an
/// outcome, leftovers) must name exactly these; anything else is not its to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Given {
    /// The fence its assignment carries; 0 until the attempt key is written and it is sent.
    pub(super) fence: Revision,
    /// The call's key, hashed: only compared.
    pub(super) key: u64,
    /// Since when it can have run, in seconds on the fleet's clock ([`Fleet::ran`]); its
    /// usage is bounded by how long that is.
    pub(super) since: i64,
}

/// A call key as [`Given`] keeps it.
pub(super) fn key_hash(key: &str) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(key)
}

pub(super) struct WorkerState {
    pub(super) name: Arc<str>,
    /// The process behind the current link (`Hello.incarnation`): only a link of the same
    /// one takes the current link's place while it is up.
    pub(super) incarnation: String,
    /// Where the current link comes from (a remote worker's address), for the logs.
    pub(super) peer: Arc<str>,
    /// Told whether the link's `Hello` was taken (a remote link's `Attach` answers then).
    pub(super) verdict: Option<oneshot::Sender<Result<(), NameTaken>>>,
    /// Messages it sent that were not its to send (dropped, logged at most once a second).
    pub(super) strays: Throttled,
    /// Usage reports it sent above what an attempt can use (clipped, logged likewise).
    pub(super) clipped: Throttled,
    /// The current link; `None` while the worker is cut off.
    pub(super) tx: Option<mpsc::UnboundedSender<CoordinatorMessage>>,
    /// Which link is current (links of a worker that reconnects are told apart by this).
    pub(super) link: u64,
    /// Ends the current link's reader.
    pub(super) link_alive: CancellationToken,
    /// Where the current link's reader sends (a reconnecting worker's link is re-pointed at
    /// the worker's existing state).
    pub(super) target: Arc<std::sync::atomic::AtomicU64>,
    /// `Hello` received.
    pub(super) named: bool,
    /// `Welcome` sent on the current link.
    pub(super) welcomed: bool,
    pub(super) slots: u32,
    pub(super) busy: u32,
    pub(super) backends: HashSet<String>,
    pub(super) models: HashSet<String>,
    pub(super) labels: std::collections::BTreeMap<String, String>,
    /// The provider account each of its backends calls through (admission).
    pub(super) accounts: HashMap<String, Arc<str>>,
    /// Backends whose model server keeps a prefix cache local to this worker.
    pub(super) local_cache: HashSet<String>,
    /// Assignments this worker holds a slot for, and what it was given for each.
    pub(super) running: HashMap<Slot, Given>,
    /// Attempts it held when it attached that this coordinator did not assign: a run taken
    /// over from a coordinator that went away may claim them (see `workers.rs`).
    pub(super) orphans: Orphans,
    /// Outcomes of orphans that arrived before a run claimed them.
    pub(super) orphan_outcomes: HashMap<(Arc<str>, u64, u32), v1::Outcome>,
    /// Attempts given to it since it first attached here.
    pub(super) attempts: u64,
    /// When it last said hello, took an attempt or sent an outcome ([`Fleet::seconds`]).
    pub(super) heard: i64,
    /// Its liveness lease, once granted, and the revision of its registration key.
    pub(super) lease: Option<LeaseId>,
    pub(super) reg_revision: Revision,
    pub(super) ctl: Option<Arc<LeaseCtl>>,
}

/// Attempts a worker held when it attached that this coordinator did not assign, by call. A
/// run taken over from a coordinator that went away claims the ones it still wants (same
/// call and key); until then, or until they are dropped, the ones still running keep their
/// slots, so the calls of other orphans are not started again in their place.
#[derive(Debug, Default)]
pub(super) struct Orphans {
    by_call: HashMap<(Arc<str>, u64), v1::AttemptRef>,
    /// Slots kept for orphans that still run.
    pub(super) reserved: u32,
}

impl Orphans {
    /// What a `Hello` lists, on a worker with `slots` slots. Of two attempts of one call, the
    /// one still running (else the later one) is the one to claim.
    pub(super) fn of(held: &[v1::AttemptRef], slots: u32) -> Orphans {
        let mut by_call: HashMap<(Arc<str>, u64), v1::AttemptRef> = HashMap::new();
        for a in held {
            let k = (Arc::<str>::from(a.run_id.as_str()), a.call);
            let better = by_call
                .get(&k)
                .is_none_or(|b| (!a.ended, a.attempt) > (!b.ended, b.attempt));
            if better {
                by_call.insert(k, a.clone());
            }
        }
        let running = by_call.values().filter(|a| !a.ended).count();
        Orphans {
            reserved: u32::try_from(running).unwrap_or(u32::MAX).min(slots),
            by_call,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_call.is_empty()
    }

    /// The calls they belong to.
    pub(super) fn calls(&self) -> Vec<(Arc<str>, u64)> {
        self.by_call.keys().cloned().collect()
    }

    /// The orphan of call `id` if its key is `key`, taken out (a claim).
    pub(super) fn take(&mut self, id: &(Arc<str>, u64), key: &str) -> Option<v1::AttemptRef> {
        if self.by_call.get(id)?.call_key != key {
            return None;
        }
        let a = self.by_call.remove(id)?;
        if !a.ended {
            self.reserved = self.reserved.saturating_sub(1);
        }
        Some(a)
    }

    /// Whether the worker listed attempt `attempt` of call `id` as one it still holds.
    pub(super) fn lists(&self, id: &(Arc<str>, u64), attempt: u32) -> bool {
        self.by_call.get(id).is_some_and(|a| a.attempt == attempt)
    }

    /// An outcome of `attempt` (with `fence` and call key `key`) of call `id` arrived: `true`
    /// if it is exactly this orphan's, which now holds no slot.
    pub(super) fn ended(
        &mut self,
        id: &(Arc<str>, u64),
        attempt: u32,
        fence: i64,
        key: &str,
    ) -> bool {
        let Some(a) = self.by_call.get_mut(id) else {
            return false;
        };
        if a.attempt != attempt || a.fence != fence || a.call_key != key {
            return false;
        }
        if !a.ended {
            a.ended = true;
            self.reserved = self.reserved.saturating_sub(1);
        }
        true
    }

    /// All that are left, taken out.
    pub(super) fn drain(&mut self) -> Vec<v1::AttemptRef> {
        self.reserved = 0;
        self.by_call.drain().map(|(_, a)| a).collect()
    }
}

impl WorkerState {
    /// May take assignments: attached, named, with a live lease.
    pub(super) fn ready(&self) -> bool {
        self.tx.is_some() && self.named && self.lease.is_some()
    }

    /// Slots not free for a new attempt: busy, or kept for orphans that still run there.
    pub(super) fn taken(&self) -> u32 {
        self.busy.saturating_add(self.orphans.reserved)
    }

    /// Takes what a `Hello` says the worker has.
    fn describe(&mut self, h: &v1::Hello) {
        self.incarnation = h.incarnation.clone();
        self.slots = h.slots;
        self.backends = h.backends.iter().cloned().collect();
        self.models = h.models.iter().cloned().collect();
        self.labels = h.labels.clone().into_iter().collect();
        self.accounts = h
            .accounts
            .iter()
            .map(|a| (a.backend.clone(), Arc::from(a.id.as_str())))
            .collect();
        self.local_cache = h
            .accounts
            .iter()
            .filter(|a| a.local_cache)
            .map(|a| a.backend.clone())
            .collect();
    }

    /// Has the task's backend (and model, when it lists models) and every label its
    /// placement asks for.
    pub(super) fn offers(&self, task: &v1::TaskSpec) -> bool {
        self.runs_backend(task) && self.carries(task)
    }

    fn runs_backend(&self, task: &v1::TaskSpec) -> bool {
        (self.backends.is_empty() || self.backends.contains(&task.backend))
            && (self.models.is_empty()
                || task.model.is_empty()
                || self.models.contains(&task.model))
    }

    /// Carries every label the task's placement asks for.
    fn carries(&self, task: &v1::TaskSpec) -> bool {
        task.placement_labels
            .iter()
            .all(|(k, v)| self.labels.get(k) == Some(v))
    }
}

/// Every worker with a link or a lease, and the key writer.
pub(super) struct Fleet {
    workers: HashMap<u64, WorkerState>,
    by_name: HashMap<Arc<str>, u64>,
    /// Links that a known worker took over on reattaching: link id → worker id. Messages a
    /// link's reader tagged with the link id before the takeover are resolved through it.
    adopted: HashMap<u64, u64>,
    next_worker: u64,
    /// Attempt-key writes, applied in order by the key writer.
    keys: mpsc::UnboundedSender<KeyOp>,
    /// Where the seconds of [`Given::since`] count from.
    epoch: Instant,
    /// The dispatcher's tasks (a worker's link pump is one).
    tasks: TaskTracker,
}

impl Fleet {
    pub fn new(keys: mpsc::UnboundedSender<KeyOp>, tasks: TaskTracker) -> Fleet {
        Fleet {
            workers: HashMap::new(),
            by_name: HashMap::new(),
            adopted: HashMap::new(),
            next_worker: 0,
            keys,
            epoch: Instant::now(),
            tasks,
        }
    }

    /// The worker with id `wid`, if it is known.
    pub(super) fn worker(&self, wid: u64) -> Option<&WorkerState> {
        self.workers.get(&wid)
    }

    /// The worker with id `wid`, to change, if it is known.
    pub(super) fn worker_mut(&mut self, wid: u64) -> Option<&mut WorkerState> {
        self.workers.get_mut(&wid)
    }

    /// Every known worker.
    pub(super) fn all(&self) -> impl Iterator<Item = &WorkerState> {
        self.workers.values()
    }

    /// Every known worker with its id, to change.
    pub(super) fn all_mut(&mut self) -> impl Iterator<Item = (&u64, &mut WorkerState)> {
        self.workers.iter_mut()
    }

    /// Forgets worker `wid` without retiring its calls (a link refused before it served).
    pub(super) fn forget(&mut self, wid: u64) {
        self.workers.remove(&wid);
    }

    /// The id of the worker known by `name`, if one is.
    pub(super) fn named(&self, name: &str) -> Option<u64> {
        self.by_name.get(name).copied()
    }

    /// Ends the takeover of `link` (its link is gone): the worker its messages belonged to.
    pub(super) fn release_link(&mut self, link: u64) -> Option<u64> {
        self.adopted.remove(&link)
    }

    /// Queues an attempt-key write for the key writer (its receiver is gone only at
    /// shutdown, when nothing more is written).
    pub(super) fn queue_key(&self, op: KeyOp) {
        let _ = self.keys.send(op);
    }

    /// Whole seconds since the fleet's epoch.
    fn seconds(&self) -> i64 {
        i64::try_from(self.epoch.elapsed().as_secs()).unwrap_or(i64::MAX)
    }

    /// How long the attempt given `g` can have run by now (rounded up to whole seconds).
    pub(super) fn ran(&self, g: &Given) -> std::time::Duration {
        let s = self.seconds().saturating_sub(g.since).saturating_add(1);
        std::time::Duration::from_secs(u64::try_from(s).unwrap_or(0))
    }

    /// The worker a link's messages belong to (a link taken over by a reattached worker).
    pub fn resolve(&self, link: u64) -> u64 {
        self.adopted.get(&link).copied().unwrap_or(link)
    }

    /// Some ready worker has a free slot.
    pub fn has_free_slot(&self) -> bool {
        self.workers
            .values()
            .any(|w| w.ready() && w.taken() < w.slots)
    }

    /// The ready worker with the most free slots that offers the task (the lowest id among
    /// equals), if one has a slot free.
    #[cfg(test)]
    pub fn pick(&self, task: &v1::TaskSpec) -> Option<u64> {
        self.pick_where(task, None, |_| true)
    }

    /// Like [`Fleet::pick`], among the workers whose account for the task's backend (`None`:
    /// it names none) `admits`.
    pub fn pick_where(
        &self,
        task: &v1::TaskSpec,
        prefer: Option<u64>,
        mut admits: impl FnMut(Option<&Arc<str>>) -> bool,
    ) -> Option<u64> {
        let mut free: Vec<(&u64, &WorkerState)> = self
            .workers
            .iter()
            .filter(|(_, w)| w.ready() && w.taken() < w.slots && w.offers(task))
            .collect();
        // The preferred worker (where the call's prefix was served) first, then the one with
        // the most free slots.
        free.sort_by_key(|(wid, w)| {
            (
                Some(**wid) != prefer,
                std::cmp::Reverse(w.slots - w.taken()),
                **wid,
            )
        });
        free.into_iter()
            .find(|(_, w)| admits(w.accounts.get(&task.backend)))
            .map(|(wid, _)| *wid)
    }

    /// Whether worker `wid`'s model server for `backend` keeps a prefix cache of its own.
    pub fn caches_locally(&self, wid: u64, backend: &str) -> bool {
        self.workers
            .get(&wid)
            .is_some_and(|w| w.local_cache.contains(backend))
    }

    /// Whether worker `wid` is attached and ready.
    pub fn is_ready(&self, wid: u64) -> bool {
        self.workers.get(&wid).is_some_and(|w| w.ready())
    }

    /// Whether worker `wid` is ready with a free slot and offers the task.
    pub fn has_room_for(&self, wid: u64, task: &v1::TaskSpec) -> bool {
        self.workers
            .get(&wid)
            .is_some_and(|w| w.ready() && w.taken() < w.slots && w.offers(task))
    }

    /// The account worker `wid` calls through for `backend`.
    pub fn account_of(&self, wid: u64, backend: &str) -> Option<Arc<str>> {
        self.workers.get(&wid)?.accounts.get(backend).cloned()
    }

    /// Some ready worker offers the task (busy or not).
    pub fn capable(&self, task: &v1::TaskSpec) -> bool {
        self.workers.values().any(|w| w.ready() && w.offers(task))
    }

    pub fn ready_count(&self) -> usize {
        self.workers.values().filter(|w| w.ready()).count()
    }

    /// Why no attached worker can run the task, and what to do about it.
    pub fn why_none_offers(&self, task: &v1::TaskSpec) -> String {
        let attached = self.ready_count();
        if attached == 0 {
            return format!(
                "no worker is attached to this coordinator (the agent needs backend {:?}{})",
                task.backend,
                if task.model.is_empty() {
                    String::new()
                } else {
                    format!(" / model {:?}", task.model)
                }
            );
        }
        let ready = || self.workers.values().filter(|w| w.ready());
        let mut offered: Vec<&str> = ready()
            .flat_map(|w| w.backends.iter().map(String::as_str))
            .collect();
        offered.sort_unstable();
        offered.dedup();
        let backend_known =
            ready().any(|w| w.backends.is_empty() || w.backends.contains(&task.backend));
        if !task.placement_labels.is_empty() && ready().any(|w| w.runs_backend(task)) {
            let wanted: Vec<String> = task
                .placement_labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let mut have: Vec<String> = ready()
                .filter(|w| w.runs_backend(task))
                .take(5)
                .map(|w| {
                    let l: Vec<String> = w.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    format!(
                        "{} has {}",
                        w.name,
                        if l.is_empty() {
                            "none".into()
                        } else {
                            l.join(",")
                        }
                    )
                })
                .collect();
            have.sort();
            return format!(
                "no attached worker that offers backend {:?} carries the labels {} its placement asks for ({}); start one with --label {}",
                task.backend,
                wanted.join(","),
                have.join("; "),
                wanted.join(" --label ")
            );
        }
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
    }

    /// The workers with a lease, by name (`flotilla workers`).
    pub fn views(&self) -> Vec<WorkerView> {
        let now = self.seconds();
        let sorted = |set: &HashSet<String>| {
            let mut v: Vec<String> = set.iter().cloned().collect();
            v.sort();
            v
        };
        let mut out: Vec<WorkerView> = self
            .workers
            .values()
            .filter(|w| w.named && w.lease.is_some())
            .map(|w| WorkerView {
                name: w.name.to_string(),
                attached: w.tx.is_some(),
                slots: w.slots,
                busy: w.busy,
                backends: sorted(&w.backends),
                models: sorted(&w.models),
                labels: w.labels.clone(),
                attempts: w.attempts,
                heard_secs_ago: u64::try_from(now.saturating_sub(w.heard)).unwrap_or(0),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Ready workers, all slots, busy slots.
    pub fn totals(&self) -> (usize, u32, u32) {
        (
            self.ready_count(),
            self.workers.values().map(|w| w.slots).sum(),
            self.workers.values().map(|w| w.busy).sum(),
        )
    }

    /// The current link of a worker, if it is attached.
    pub fn link(&self, wid: u64) -> Option<&mpsc::UnboundedSender<CoordinatorMessage>> {
        self.workers.get(&wid).and_then(|w| w.tx.as_ref())
    }

    /// A new link from `peer`, as a worker not named yet. Its reader sends what comes in to
    /// `inbox`, tagged with the worker it belongs to, and says when the link closes; `verdict`
    /// hears whether its `Hello` is taken.
    pub(super) fn attach(
        &mut self,
        end: CoordinatorEnd,
        peer: Arc<str>,
        verdict: Option<oneshot::Sender<Result<(), NameTaken>>>,
        inbox: mpsc::UnboundedSender<Msg>,
    ) {
        let id = self.next_worker;
        self.next_worker += 1;
        let CoordinatorEnd { tx, mut rx } = end;
        let alive = CancellationToken::new();
        let target = Arc::new(AtomicU64::new(id));
        self.workers.insert(
            id,
            WorkerState {
                name: Arc::from(format!("worker-{id}")),
                incarnation: String::new(),
                peer,
                verdict,
                strays: Throttled::default(),
                clipped: Throttled::default(),
                tx: Some(tx),
                link: id,
                link_alive: alive.clone(),
                target: target.clone(),
                named: false,
                welcomed: false,
                slots: 0,
                busy: 0,
                backends: HashSet::new(),
                models: HashSet::new(),
                labels: Default::default(),
                accounts: HashMap::new(),
                local_cache: HashSet::new(),
                orphans: Orphans::default(),
                orphan_outcomes: Default::default(),
                running: HashMap::new(),
                attempts: 0,
                heard: self.seconds(),
                lease: None,
                reg_revision: 0,
                ctl: None,
            },
        );
        self.tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = alive.cancelled() => break,
                    msg = rx.recv() => match msg {
                        Some(msg) => {
                            let worker = target.load(Ordering::Acquire);
                            if inbox.send(Msg::FromWorker { worker, msg: Box::new(msg) }).is_err() {
                                return;
                            }
                        }
                        None => break,
                    },
                }
            }
            let worker = target.load(Ordering::Acquire);
            let _ = inbox.send(Msg::LinkClosed { worker, link: id });
        });
    }

    /// Names the worker on link `link_id` from its `Hello`: a worker seen for the first time.
    pub(super) fn register(&mut self, link_id: u64, name: Arc<str>, h: &v1::Hello) {
        let now = self.seconds();
        if let Some(w) = self.workers.get_mut(&link_id) {
            w.heard = now;
            w.name = name.clone();
            w.named = true;
            w.describe(h);
            if let Some(v) = w.verdict.take() {
                let _ = v.send(Ok(()));
            }
            self.by_name.insert(name, link_id);
        }
    }

    /// Whether link `link_id`, whose `Hello` says it is `incarnation` of the worker known as
    /// `wid`, must be refused: `wid` is attached, and the link is not the same process back
    /// before its old link closed (an empty incarnation proves nothing).
    pub(super) fn clash(&self, wid: u64, link_id: u64, incarnation: &str) -> Option<NameTaken> {
        let w = self.workers.get(&wid)?;
        let same = !incarnation.is_empty() && incarnation == w.incarnation;
        if w.tx.is_none() || same {
            return None;
        }
        Some(NameTaken {
            name: w.name.to_string(),
            attached_from: w.peer.to_string(),
            refused_from: self
                .workers
                .get(&link_id)
                .map_or_else(|| "?".to_owned(), |l| l.peer.to_string()),
        })
    }

    /// Closes link `link_id` before it was named, telling it why.
    pub(super) fn refuse(&mut self, link_id: u64, why: NameTaken) {
        if let Some(mut w) = self.workers.remove(&link_id) {
            w.link_alive.cancel();
            if let Some(v) = w.verdict.take() {
                let _ = v.send(Err(why));
            }
        }
    }

    /// A worker known by name came back on link `link_id`: the link takes over the worker's
    /// state (`wid`), and messages the link's reader tags from now on go to it. `false`: one of
    /// the two is gone.
    pub(super) fn take_over(&mut self, wid: u64, link_id: u64, h: &v1::Hello) -> bool {
        let Some(fresh) = self.workers.remove(&link_id) else {
            return false;
        };
        fresh.target.store(wid, Ordering::Release);
        self.adopted.insert(link_id, wid);
        let Some(w) = self.workers.get_mut(&wid) else {
            return false;
        };
        if w.tx.is_some() {
            tracing::warn!(worker = %w.name, "worker attached again; closing its previous stream");
        } else {
            tracing::info!(worker = %w.name, held = h.held.len(), "worker reattached");
        }
        w.link_alive.cancel();
        w.tx = fresh.tx;
        w.link = fresh.link;
        w.link_alive = fresh.link_alive;
        w.target = fresh.target;
        w.peer = fresh.peer;
        w.welcomed = false;
        w.describe(h);
        if let Some(v) = fresh.verdict {
            let _ = v.send(Ok(()));
        }
        if let Some(ctl) = &w.ctl {
            ctl.set_attached(true);
        }
        true
    }

    /// Takes a slot on `wid` for an attempt of the call whose key is `key`, which started
    /// `ran_before` ago (now, for one assigned here); its fence is set once it is sent
    /// ([`Fleet::sent`]), unless it runs already (an adopted attempt's own).
    pub(super) fn take_slot(
        &mut self,
        wid: u64,
        slot: Slot,
        key: &str,
        fence: Revision,
        ran_before: std::time::Duration,
    ) {
        let now = self.seconds();
        let since = now.saturating_sub(i64::try_from(ran_before.as_secs()).unwrap_or(i64::MAX));
        if let Some(w) = self.workers.get_mut(&wid)
            && let std::collections::hash_map::Entry::Vacant(e) = w.running.entry(slot)
        {
            e.insert(Given {
                fence,
                key: key_hash(key),
                since,
            });
            w.busy += 1;
            w.attempts += 1;
            w.heard = now;
        }
    }

    /// The attempt holding `slot` on `wid` was sent with `fence`.
    pub(super) fn sent(&mut self, wid: u64, slot: &Slot, fence: Revision) {
        if let Some(g) = self
            .workers
            .get_mut(&wid)
            .and_then(|w| w.running.get_mut(slot))
        {
            g.fence = fence;
        }
    }

    /// What `wid` was given for the attempt holding `slot`, if it holds one.
    pub(super) fn given(&self, wid: u64, slot: &Slot) -> Option<Given> {
        self.workers.get(&wid)?.running.get(slot).copied()
    }

    /// Says that `wid` sent `what`, which was not its to send because `why` (dropped, never
    /// counted; the link goes on). At most once a second per worker, with how many were held
    /// back.
    pub(super) fn stray(&self, wid: u64, what: &str, why: impl std::fmt::Display) {
        crate::counters::inc(&crate::counters::WORKER_STRAYS);
        if let Some(w) = self.workers.get(&wid) {
            w.strays.say(|held| {
                tracing::warn!(
                    worker = %w.name,
                    peer = %w.peer,
                    suppressed = held,
                    "dropped {what} from worker {}: {why}; nothing of it is counted",
                    w.name
                );
            });
        }
    }

    /// Gives back the slot an attempt held on `wid`, if it held one.
    pub(super) fn free_slot(&mut self, wid: u64, run: &Arc<str>, call: u64, attempt: u32) {
        let now = self.seconds();
        if let Some(w) = self.workers.get_mut(&wid)
            && w.running.remove(&(run.clone(), call, attempt)).is_some()
        {
            w.busy = w.busy.saturating_sub(1);
            w.heard = now;
        }
    }

    /// How many attempts of `run` workers hold (their slots are taken until their outcomes
    /// come, or the worker is retired).
    pub(super) fn held_of(&self, run: &Arc<str>) -> usize {
        self.workers
            .values()
            .map(|w| w.running.keys().filter(|(r, _, _)| r == run).count())
            .sum()
    }

    /// Tells `wid` to stop an attempt, if it is attached.
    pub(super) fn cancel(&self, wid: u64, run: &str, call: u64, attempt: u32, reason: &str) {
        if let Some(tx) = self.link(wid) {
            let _ = tx.send(CoordinatorMessage {
                msg: Some(coordinator_message::Msg::Cancel(v1::Cancel {
                    run_id: run.to_owned(),
                    call,
                    attempt,
                    reason: reason.to_owned(),
                })),
            });
        }
    }

    /// A worker's lease was granted: the worker it belongs to, if it is still known.
    pub(super) fn lease_granted(
        &mut self,
        name: &Arc<str>,
        lease: LeaseId,
        revision: Revision,
    ) -> Option<u64> {
        let wid = self.by_name.get(name).copied()?;
        let w = self.workers.get_mut(&wid)?;
        w.lease = Some(lease);
        w.reg_revision = revision;
        Some(wid)
    }

    /// A worker's lease is gone: it takes no new assignments until the lease task has a new
    /// one. (Its attempt keys went with the lease; the watch restarts those calls.)
    pub(super) fn lease_lost(&mut self, name: &Arc<str>, lease: LeaseId) {
        if let Some(wid) = self.by_name.get(name)
            && let Some(w) = self.workers.get_mut(wid)
            && w.lease == Some(lease)
        {
            w.lease = None;
        }
    }

    /// Link `link` of the worker closed. `true`: a named worker is now cut off (its attempts
    /// wait for it); a worker that never said who it is is forgotten at once.
    pub(super) fn cut_off(&mut self, wid: u64, link: u64) -> bool {
        let Some(w) = self.workers.get_mut(&wid) else {
            return false;
        };
        if w.link != link {
            return false;
        }
        if !w.named {
            self.workers.remove(&wid);
            return false;
        }
        tracing::info!(worker = %w.name, attempts = w.running.len(), "worker cut off; its attempts wait for it for one lease TTL");
        w.tx = None;
        w.welcomed = false;
        if let Some(ctl) = &w.ctl {
            ctl.set_attached(false);
        }
        true
    }

    /// Forgets a worker whose lease is gone (its link closed, its lease task stopped): its
    /// name and the attempts it was running.
    pub(super) fn retire(&mut self, wid: u64) -> Option<(Arc<str>, Vec<Slot>)> {
        let w = self.workers.remove(&wid)?;
        w.link_alive.cancel();
        if let Some(ctl) = &w.ctl {
            ctl.stop();
        }
        if self.by_name.get(&w.name) == Some(&wid) {
            self.by_name.remove(&w.name);
        }
        Some((w.name, w.running.into_keys().collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(fleet: &mut Fleet, name: &str, slots: u32, busy: u32, backends: &[&str]) -> u64 {
        let wid = fleet.next_worker;
        fleet.next_worker += 1;
        let (tx, _rx) = mpsc::unbounded_channel();
        fleet.workers.insert(
            wid,
            WorkerState {
                name: Arc::from(name),
                incarnation: String::new(),
                peer: Arc::from("test"),
                verdict: None,
                strays: Throttled::default(),
                clipped: Throttled::default(),
                tx: Some(tx),
                link: wid,
                link_alive: CancellationToken::new(),
                target: Arc::new(std::sync::atomic::AtomicU64::new(wid)),
                named: true,
                welcomed: true,
                slots,
                busy,
                backends: backends.iter().map(|b| (*b).to_owned()).collect(),
                models: HashSet::new(),
                labels: Default::default(),
                accounts: HashMap::new(),
                local_cache: HashSet::new(),
                running: HashMap::new(),
                orphans: Orphans::default(),
                orphan_outcomes: HashMap::new(),
                attempts: 0,
                heard: 0,
                lease: Some(wid as LeaseId + 1),
                reg_revision: 0,
                ctl: None,
            },
        );
        wid
    }

    fn task(backend: &str) -> v1::TaskSpec {
        v1::TaskSpec {
            backend: backend.into(),
            ..v1::TaskSpec::default()
        }
    }

    #[test]
    fn a_call_goes_to_the_freest_worker_that_offers_its_backend() {
        let mut f = Fleet::new(mpsc::unbounded_channel().0, TaskTracker::new());
        let busy = worker(&mut f, "busy", 4, 3, &["echo"]);
        let free = worker(&mut f, "free", 4, 1, &["echo"]);
        let other = worker(&mut f, "other", 8, 0, &["claude"]);
        assert_eq!(f.pick(&task("echo")), Some(free));
        assert_eq!(f.pick(&task("claude")), Some(other));
        f.workers.get_mut(&free).unwrap().busy = 4;
        assert_eq!(f.pick(&task("echo")), Some(busy));
        f.workers.get_mut(&busy).unwrap().busy = 4;
        assert_eq!(f.pick(&task("echo")), None, "all full");
        assert!(f.capable(&task("echo")), "full, but able");
        assert!(!f.capable(&task("codex")));
        assert_eq!(f.totals(), (3, 16, 8));
    }

    #[test]
    fn a_worker_without_a_lease_takes_nothing_and_is_not_listed() {
        let mut f = Fleet::new(mpsc::unbounded_channel().0, TaskTracker::new());
        let w = worker(&mut f, "w", 2, 0, &["echo"]);
        f.workers.get_mut(&w).unwrap().lease = None;
        assert_eq!(f.pick(&task("echo")), None);
        assert!(!f.has_free_slot());
        assert!(f.views().is_empty());
    }

    #[test]
    fn why_no_worker_runs_a_call_names_the_backend_and_the_fix() {
        let mut f = Fleet::new(mpsc::unbounded_channel().0, TaskTracker::new());
        assert!(
            f.why_none_offers(&task("claude"))
                .starts_with("no worker is attached")
        );
        worker(&mut f, "b", 1, 0, &["echo"]);
        worker(&mut f, "a", 1, 0, &["exec", "echo"]);
        let why = f.why_none_offers(&task("claude"));
        assert!(why.contains("the 2 attached offer echo, exec"), "{why}");
        assert!(why.contains("--backend claude"), "{why}");
        let names: Vec<String> = f.views().into_iter().map(|v| v.name).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(f.views()[0].backends, ["echo", "exec"]);
    }

    #[tokio::test]
    async fn a_worker_that_comes_back_keeps_its_slots_and_a_retired_one_is_forgotten() {
        let (inbox, mut got) = mpsc::unbounded_channel();
        let mut f = Fleet::new(mpsc::unbounded_channel().0, TaskTracker::new());
        let hello = |slots| v1::Hello {
            name: "w1".into(),
            slots,
            backends: vec!["echo".into()],
            ..v1::Hello::default()
        };
        // First link: named, granted a lease, running one attempt.
        let (_first_worker, first) = flotilla_proto::link::link_pair();
        f.attach(first, Arc::from("test"), None, inbox.clone());
        f.register(0, Arc::from("w1"), &hello(2));
        let name: Arc<str> = Arc::from("w1");
        assert_eq!(f.lease_granted(&name, 7, 3), Some(0));
        let run: Arc<str> = Arc::from("wf_r");
        let now = std::time::Duration::ZERO;
        f.take_slot(0, (run.clone(), 1, 1), "k1", 0, now);
        f.take_slot(0, (run.clone(), 1, 1), "k1", 0, now);
        assert_eq!(f.workers[&0].busy, 1, "one attempt holds one slot");
        // Its link closes: cut off, not forgotten.
        assert!(f.cut_off(0, 0));
        assert!(!f.workers[&0].ready());
        // A second link says it is w1 again: it takes over, with the slot still held.
        let (mut second_worker, second) = flotilla_proto::link::link_pair();
        f.attach(second, Arc::from("test"), None, inbox.clone());
        assert!(f.take_over(0, 1, &hello(4)));
        assert_eq!(f.resolve(1), 0);
        let w = &f.workers[&0];
        assert!(w.ready() && w.slots == 4 && w.busy == 1);
        // What the new link says now reaches the worker's state, and a cancel goes out on it.
        second_worker.tx.send(v1::WorkerMessage::default()).unwrap();
        // (The old link's reader, stopped by the takeover, says it closed first.)
        let Some(Msg::LinkClosed { worker: 0, link: 0 }) = got.recv().await else {
            panic!("the old link's reader did not stop")
        };
        let Some(Msg::FromWorker { worker, .. }) = got.recv().await else {
            panic!("the new link's message did not arrive")
        };
        assert_eq!(worker, 0);
        f.cancel(0, "wf_r", 1, 1, "test");
        assert!(second_worker.rx.recv().await.is_some());
        // A link closing that is not the current one changes nothing.
        assert!(!f.cut_off(0, 0));
        f.free_slot(0, &run, 1, 1);
        f.free_slot(0, &run, 1, 1);
        assert_eq!(f.workers[&0].busy, 0);
        f.take_slot(0, (run.clone(), 2, 1), "k2", 0, now);
        let (retired, running) = f.retire(0).unwrap();
        assert_eq!((&*retired, running), ("w1", vec![(run, 2, 1)]));
        assert!(f.workers.is_empty() && f.by_name.is_empty());
        // A link that never says who it is is forgotten when it closes.
        let (_third_worker, third) = flotilla_proto::link::link_pair();
        f.attach(third, Arc::from("test"), None, inbox);
        assert!(!f.cut_off(2, 2));
        assert!(f.workers.is_empty());
    }
}
