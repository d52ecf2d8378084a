//! The fleet as the dispatcher sees it: the workers that attached, their slots and what they
//! offer, and the key writer their attempt keys go through. Which worker a call can go to, and
//! why none can, is decided here.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use flotilla_proto::v1::{self, CoordinatorMessage};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::WorkerView;
use super::keys::{KeyOp, LeaseCtl};
use crate::lease::{LeaseId, Revision};

pub(super) struct WorkerState {
    pub(super) name: Arc<str>,
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
    /// Assignments this worker holds a slot for: (run, call, attempt).
    pub(super) running: HashSet<(Arc<str>, u64, u32)>,
    /// Attempts it held when it attached that this coordinator did not assign: a run taken
    /// over from a coordinator that went away may claim them (see `workers.rs`).
    pub(super) orphans: Vec<v1::AttemptRef>,
    /// Outcomes of orphans that arrived before a run claimed them.
    pub(super) orphan_outcomes: HashMap<(Arc<str>, u64, u32), v1::Outcome>,
    /// Its liveness lease, once granted, and the revision of its registration key.
    pub(super) lease: Option<LeaseId>,
    pub(super) reg_revision: Revision,
    pub(super) ctl: Option<Arc<LeaseCtl>>,
}

impl WorkerState {
    /// May take assignments: attached, named, with a live lease.
    pub(super) fn ready(&self) -> bool {
        self.tx.is_some() && self.named && self.lease.is_some()
    }

    /// Has the task's backend (and model, when it lists models).
    pub(super) fn offers(&self, task: &v1::TaskSpec) -> bool {
        (self.backends.is_empty() || self.backends.contains(&task.backend))
            && (self.models.is_empty()
                || task.model.is_empty()
                || self.models.contains(&task.model))
    }
}

/// Every worker with a link or a lease, and the key writer.
pub(super) struct Fleet {
    pub(super) workers: HashMap<u64, WorkerState>,
    pub(super) by_name: HashMap<Arc<str>, u64>,
    /// Links that a known worker took over on reattaching: link id → worker id. Messages a
    /// link's reader tagged with the link id before the takeover are resolved through it.
    pub(super) adopted: HashMap<u64, u64>,
    pub(super) next_worker: u64,
    /// Attempt-key writes, applied in order by the key writer.
    pub(super) keys: mpsc::UnboundedSender<KeyOp>,
}

impl Fleet {
    pub fn new(keys: mpsc::UnboundedSender<KeyOp>) -> Fleet {
        Fleet {
            workers: HashMap::new(),
            by_name: HashMap::new(),
            adopted: HashMap::new(),
            next_worker: 0,
            keys,
        }
    }

    /// The worker a link's messages belong to (a link taken over by a reattached worker).
    pub fn resolve(&self, link: u64) -> u64 {
        self.adopted.get(&link).copied().unwrap_or(link)
    }

    /// Some ready worker has a free slot.
    pub fn has_free_slot(&self) -> bool {
        self.workers.values().any(|w| w.ready() && w.busy < w.slots)
    }

    /// The ready worker with the most free slots that offers the task (the lowest id among
    /// equals), if one has a slot free.
    pub fn pick(&self, task: &v1::TaskSpec) -> Option<u64> {
        self.workers
            .iter()
            .filter(|(_, w)| w.ready() && w.busy < w.slots && w.offers(task))
            .max_by_key(|(wid, w)| (w.slots - w.busy, std::cmp::Reverse(**wid)))
            .map(|(wid, _)| *wid)
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
                running: HashSet::new(),
                orphans: Vec::new(),
                orphan_outcomes: HashMap::new(),
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
        let mut f = Fleet::new(mpsc::unbounded_channel().0);
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
        let mut f = Fleet::new(mpsc::unbounded_channel().0);
        let w = worker(&mut f, "w", 2, 0, &["echo"]);
        f.workers.get_mut(&w).unwrap().lease = None;
        assert_eq!(f.pick(&task("echo")), None);
        assert!(!f.has_free_slot());
        assert!(f.views().is_empty());
    }

    #[test]
    fn why_no_worker_runs_a_call_names_the_backend_and_the_fix() {
        let mut f = Fleet::new(mpsc::unbounded_channel().0);
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
}
