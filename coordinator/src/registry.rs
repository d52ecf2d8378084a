//! The runs this coordinator holds in memory: their handles, snapshots and reports, and the
//! reader that brings back a run that is not here from storage.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, watch};

use flotilla_proto::ErrorKind;
use tonic::Status;

use crate::report::{Report, RunStatus, Summary};
use crate::run::{AgentAction, Control, Ending, Parked, RunHandle, Snapshot};

/// Wakes a parked run: adopts it again (its script replayed from its journal to where it
/// waits), giving it the owner records it held.
pub type Waker = Arc<
    dyn Fn(
            String,
            Vec<crate::owner::Held>,
        ) -> std::pin::Pin<
            Box<
                dyn std::future::Future<Output = Result<RunHandle, flotilla_proto::Problem>> + Send,
            >,
        > + Send
        + Sync,
>;

/// The runs this coordinator is running (or has finished since it started).
#[derive(Default)]
pub struct RunRegistry {
    pub(crate) runs: Mutex<HashMap<String, RunEntry>>,
    /// Called with a run's id once its report is stored.
    pub(crate) on_end: std::sync::OnceLock<Arc<dyn Fn(String) + Send + Sync>>,
    /// What wakes a parked run, and the store its answers are kept in (a coordinator that
    /// parks runs sets it).
    pub(crate) waker: std::sync::OnceLock<(Waker, crate::store::Store)>,
}

impl std::fmt::Debug for RunRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunRegistry").finish_non_exhaustive()
    }
}

pub(crate) struct RunEntry {
    pub(crate) namespace: String,
    pub(crate) snapshot: watch::Receiver<Arc<Snapshot>>,
    pub(crate) stopper: mpsc::UnboundedSender<Control>,
    pub(crate) report: watch::Receiver<Option<Arc<Report>>>,
    /// The last live report asked of the run, and when: every reader within
    /// [`LIVE_REPORT_EVERY`] shares it, so many viewers of a big run cost the run one report
    /// per tick, not one each.
    pub(crate) live: Arc<tokio::sync::Mutex<Option<SharedReport>>>,
}

/// A live report and when the run made it.
pub(crate) type SharedReport = (tokio::time::Instant, Arc<Report>);

/// How long a live report is shared before the run is asked for a new one (the session
/// page's update tick).
pub const LIVE_REPORT_EVERY: std::time::Duration = std::time::Duration::from_millis(450);

impl crate::index::Live for RunRegistry {
    fn summary(&self, run: &str) -> Option<Summary> {
        RunRegistry::summary(self, run)
    }
}

/// A tracked run's summary: its report's once it has ended (the snapshot's last word may
/// precede the end's), else its live snapshot's.
fn summary_of(e: &RunEntry) -> Summary {
    if let Some(r) = e.report.borrow().as_ref() {
        return Summary::of_report(r);
    }
    e.snapshot.borrow().summary_now()
}

/// Refuses to resume a run held at its money budget (only a raised budget lets it go on) or at
/// its namespace's quota (it goes on by itself once the quota resets); `waiting` is its status.
fn resumable(run_id: &str, waiting: &str) -> Result<(), Status> {
    if waiting.starts_with(crate::run::HELD_AT_BUDGET) {
        return Err(ErrorKind::Conflict.status(format!(
            "run {run_id} is paused at its money budget; raise it to go on: `flotilla budget {run_id} --usd DOLLARS`"
        )));
    }
    if waiting.starts_with(crate::run::HELD_AT_QUOTA) {
        return Err(ErrorKind::Conflict.status(format!(
            "run {run_id} is {waiting}; it goes on by itself then"
        )));
    }
    Ok(())
}

/// The longest reason a control request may carry, in bytes.
pub const MAX_REASON: usize = 1000;

/// Who asked for a control action, and why: kept in the run's log and events as one line.
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    /// Who asked: a client certificate's name, a session token's subject, the page.
    pub by: &'a str,
    /// Their reason (may be empty).
    pub reason: &'a str,
}

impl Asked<'_> {
    /// The log line for `action` (on `agent`), for the actions that change what runs.
    fn line(&self, action: &str, agent: &str) -> Option<String> {
        let what = match action {
            "stop" => "stop the run".to_owned(),
            "pause" => "pause the run".to_owned(),
            "resume" => "resume the run".to_owned(),
            "stop_agent" => format!("stop agent {agent}"),
            "restart_agent" => format!("restart agent {agent}"),
            "restart_agent_fresh" => format!("restart agent {agent} from scratch"),
            "budget" => "set the run's money budget".to_owned(),
            _ => return None,
        };
        let verb = action.split('_').next().unwrap_or(action);
        let reason: String = self
            .reason
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let reason = reason.trim();
        Some(if reason.is_empty() {
            format!("[{verb}] {} asked to {what} (no reason given)", self.by)
        } else {
            format!("[{verb}] {} asked to {what}: {reason}", self.by)
        })
    }
}

impl RunRegistry {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, RunEntry>> {
        self.runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The runs this process drives that have not ended.
    pub fn running_ids(&self) -> std::collections::HashSet<String> {
        self.lock()
            .iter()
            .filter(|(_, e)| e.report.borrow().is_none())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Every run this process tracks: its namespace and its summary.
    pub fn all(&self) -> Vec<(String, Summary)> {
        self.lock()
            .values()
            .map(|e| (e.namespace.clone(), summary_of(e)))
            .collect()
    }

    /// What every view says of a run this coordinator runs (or ran since it started): from
    /// its engine while it runs, from its report once it has ended. `None`: not here.
    pub fn summary(&self, run: &str) -> Option<Summary> {
        self.lock().get(run).map(summary_of)
    }

    /// The namespace of a run this coordinator runs (or ran since it started).
    pub fn namespace(&self, run: &str) -> Option<String> {
        self.lock().get(run).map(|e| e.namespace.clone())
    }

    /// The live snapshot of a run this coordinator runs, and its report once it has ended.
    pub fn live(&self, run: &str) -> Option<(Arc<Snapshot>, Option<Arc<Report>>)> {
        self.lock()
            .get(run)
            .map(|e| (e.snapshot.borrow().clone(), e.report.borrow().clone()))
    }

    /// The report of a run this coordinator runs: the final one once it has ended, else the
    /// report as it stands now (calls that have not ended show `queued` or `running`).
    pub async fn live_report(&self, run: &str) -> Option<Arc<Report>> {
        let (stopper, done, live) = {
            let runs = self.lock();
            let e = runs.get(run)?;
            (e.stopper.clone(), e.report.borrow().clone(), e.live.clone())
        };
        if let Some(r) = done {
            return Some(r);
        }
        // One reader asks the run; the others wait here and take what it got.
        let mut shared = live.lock().await;
        if let Some((at, r)) = shared.as_ref()
            && at.elapsed() < LIVE_REPORT_EVERY
        {
            return Some(r.clone());
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        stopper.send(Control::Report(tx)).ok()?;
        match rx.await {
            Ok(r) => {
                let r = Arc::new(r);
                *shared = Some((tokio::time::Instant::now(), r.clone()));
                Some(r)
            }
            // It ended meanwhile: its final report is there now.
            Err(_) => self.lock().get(run).and_then(|e| e.report.borrow().clone()),
        }
    }

    /// Pauses or resumes a run, stops it, or stops or restarts one of its agents (W54–W56):
    /// the one path the client API and the session page share. `action` is `pause`,
    /// `resume`, `stop`, `stop_agent` or `restart_agent`.
    pub async fn control(
        &self,
        run_id: &str,
        action: &str,
        agent: &str,
        usd: Option<f64>,
        asked: Asked<'_>,
    ) -> Result<String, Status> {
        let stopper = self.lock().get(run_id).map(|e| {
            let finished = e.report.borrow().is_some();
            let status = e.snapshot.borrow().summary.status;
            (e.stopper.clone(), finished, status, e.snapshot.clone())
        });
        let Some((stopper, false, status, mut snapshot)) = stopper else {
            return Err(ErrorKind::NotFound
                .status(format!("run {run_id} is not running on this coordinator")));
        };
        let gone = || ErrorKind::NotFound.status(format!("run {run_id} has ended"));
        // A stop asked again is the stop under way; nothing else applies to a stopping run.
        if status == RunStatus::Stopping && action == "stop" {
            return Ok(format!("stopping {run_id}"));
        }
        if status == RunStatus::Stopping {
            return Err(ErrorKind::Conflict.status(format!(
                "run {run_id} is stopping: it ends once its agents have left their workers (`flotilla wait {run_id}`)"
            )));
        }
        let paused = status == RunStatus::Paused;
        if action == "resume" {
            let waiting = snapshot.borrow().summary.waiting.clone();
            resumable(run_id, waiting.as_deref().unwrap_or_default())?;
        }
        if action == "budget" && !usd.is_some_and(|u| u.is_finite() && u > 0.0) {
            return Err(ErrorKind::Invalid.status(
                "give the run's money budget as a positive number of dollars (`flotilla budget RUN --usd 5`)",
            ));
        }
        if let Some(line) = asked.line(action, agent) {
            // Said before the action, so the log reads in order.
            let _ = stopper.send(Control::Note(line));
        }
        match action {
            "stop" => {
                stopper.send(Control::Stop).map_err(|_| gone())?;
                Ok(format!("stopping {run_id}"))
            }
            "pause" | "resume" => {
                let pause = action == "pause";
                if pause == paused {
                    return Err(ErrorKind::Conflict.status(format!(
                        "run {run_id} is {} already",
                        if paused { "paused" } else { "running" }
                    )));
                }
                stopper.send(Control::Pause(pause)).map_err(|_| gone())?;
                // Answer once the run shows it, so a second request sees the new state.
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                    loop {
                        let now = snapshot.borrow_and_update().summary.status == RunStatus::Paused;
                        if now == pause || snapshot.changed().await.is_err() {
                            break;
                        }
                    }
                })
                .await;
                Ok(format!(
                    "{} {run_id}",
                    if pause { "paused" } else { "resumed" }
                ))
            }
            "stop_agent" | "restart_agent" | "restart_agent_fresh" => {
                if agent.is_empty() {
                    return Err(ErrorKind::Invalid.status(
                        "name the agent: its index (as `flotilla status` shows) or its label",
                    ));
                }
                let action = if action == "stop_agent" {
                    AgentAction::Stop
                } else {
                    AgentAction::Restart {
                        fresh: action == "restart_agent_fresh",
                    }
                };
                let (tx, rx) = tokio::sync::oneshot::channel();
                stopper
                    .send(Control::Agent {
                        action,
                        agent: agent.to_owned(),
                        reply: tx,
                    })
                    .map_err(|_| gone())?;
                rx.await
                    .map_err(|_| gone())?
                    .map_err(|e| ErrorKind::Conflict.status(e))
            }
            "budget" => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                stopper
                    .send(Control::Budget {
                        usd: usd.unwrap_or_default(),
                        reply: tx,
                    })
                    .map_err(|_| gone())?;
                rx.await
                    .map_err(|_| gone())?
                    .map_err(|e| ErrorKind::Conflict.status(e))
            }
            other => Err(ErrorKind::Invalid.status(format!(
                "unknown action {other:?}: use pause, resume, stop, stop_agent, restart_agent (restart_agent_fresh), budget or answer"
            ))),
        }
    }

    /// Answers a question of a live run (`ask()`): the one named, or its only open one; `by`
    /// is who answers. The reply comes once the answer is stored, or says why it was refused
    /// (a value its schema refuses, a question answered already), the question left open.
    pub async fn answer(
        &self,
        run_id: &str,
        question: Option<String>,
        value: serde_json::Value,
        by: &str,
    ) -> Result<String, Status> {
        let stopper = self.lock().get(run_id).and_then(|e| {
            let finished = e.report.borrow().is_some();
            (!finished).then(|| e.stopper.clone())
        });
        let Some(stopper) = stopper else {
            return Err(ErrorKind::NotFound
                .status(format!("run {run_id} is not running on this coordinator")));
        };
        let gone = || ErrorKind::NotFound.status(format!("run {run_id} has ended"));
        let (tx, rx) = tokio::sync::oneshot::channel();
        stopper
            .send(Control::Answer {
                question,
                value,
                by: by.to_owned(),
                reply: tx,
            })
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?.map_err(|e| e.status())
    }

    /// Waits for a tracked run's final report (`None` for a run this process does not track).
    pub async fn wait_report(&self, run: &str) -> Option<Arc<Report>> {
        let mut rx = self.lock().get(run)?.report.clone();
        loop {
            if let Some(r) = rx.borrow_and_update().clone() {
                return Some(r);
            }
            rx.changed().await.ok()?;
        }
    }

    /// Sets what happens when a tracked run ends (once).
    pub fn on_end(&self, f: Arc<dyn Fn(String) + Send + Sync>) {
        let _ = self.on_end.set(f);
    }

    /// Tracks a launched run until it ends.
    pub fn track(self: &Arc<Self>, handle: RunHandle) {
        self.track_with(handle, watch::channel(None).0);
    }

    /// [`RunRegistry::track`], its report sent on `report_tx` (a woken run's: whoever waited
    /// for the parked run gets it).
    fn track_with(
        self: &Arc<Self>,
        handle: RunHandle,
        report_tx: watch::Sender<Option<Arc<Report>>>,
    ) {
        let report_rx = report_tx.subscribe();
        let entry = RunEntry {
            namespace: handle.namespace.clone(),
            snapshot: handle.snapshot.clone(),
            stopper: handle.stopper(),
            report: report_rx,
            live: Arc::default(),
        };
        let run_id = handle.run_id.clone();
        self.lock().insert(run_id.clone(), entry);
        let on_end = self.on_end.get().cloned();
        let tasks = handle.tasks().clone();
        let me = self.clone();
        let keeper = tasks.clone();
        tasks.spawn(async move {
            // A run whose coordinator stopped first did not end: nothing is said of it.
            match handle.ending().await {
                None => {}
                Some(Ending::Parked(p)) => me.keep_parked(p, &keeper, report_tx),
                Some(Ending::Ended(report)) => {
                    let _ = report_tx.send(Some(Arc::new(*report)));
                    if let Some(f) = on_end {
                        f(run_id);
                    }
                }
            }
        });
    }

    /// Sets what wakes this coordinator's parked runs, and the store their answers go to.
    pub fn wake_with(&self, store: crate::store::Store, waker: Waker) {
        let _ = self.waker.set((waker, store));
    }

    /// Keeps a parked run: a small task reads its controls (the engine's channel, so nothing
    /// sent while it parked is lost) in place of its engine. An answer is checked and stored,
    /// then wakes it; a question's deadline wakes it; any other control wakes it first and goes
    /// to it then. Its last snapshot stays for its views.
    fn keep_parked(
        self: &Arc<Self>,
        p: Parked,
        tasks: &crate::tasks::Tasks,
        report_tx: watch::Sender<Option<Arc<Report>>>,
    ) {
        let Some((waker, store)) = self.waker.get().cloned() else {
            tracing::error!(run = %p.run_id, "a run was parked where nothing can wake it");
            return;
        };
        let me = self.clone();
        tasks.spawn_until_stopped(async move {
            let Parked {
                run_id,
                deadline,
                owners,
                controls: mut rx,
            } = p;
            let until = deadline.map(|d| {
                let left = d
                    .duration_since(flotilla_proto::clock::now())
                    .unwrap_or_default();
                tokio::time::Instant::now() + left
            });
            let mut pending = Vec::new();
            loop {
                let c = tokio::select! {
                    c = rx.recv() => match c {
                        Some(c) => Some(c),
                        // Nobody can reach it any more (its coordinator goes): left as it is.
                        None => return,
                    },
                    () = async {
                        match until {
                            Some(at) => tokio::time::sleep_until(at).await,
                            None => std::future::pending().await,
                        }
                    } => None,
                };
                match c {
                    // Who asked for what follows: said once it is awake.
                    Some(Control::Note(line)) => pending.push(Control::Note(line)),
                    Some(Control::Answer { question, value, by, reply }) => {
                        let said = crate::run::ask::answer_in_store(
                            &store, &run_id, question.as_deref(), value, &by,
                        )
                        .await;
                        let ok = said.is_ok();
                        let _ = reply.send(said);
                        if ok {
                            break;
                        }
                    }
                    Some(Control::Report(reply)) => {
                        if let Ok(r) = crate::history::load_report(&store, &run_id).await {
                            let _ = reply.send(r);
                        }
                    }
                    Some(other) => {
                        pending.push(other);
                        break;
                    }
                    None => break,
                }
            }
            // What came meanwhile goes to it too, in order.
            while let Ok(c) = rx.try_recv() {
                pending.push(c);
            }
            match waker(run_id.clone(), owners).await {
                Ok(handle) => {
                    let stopper = handle.stopper();
                    me.track_with(handle, report_tx);
                    // And what came while it woke, before its controls went to the new engine.
                    while let Ok(c) = rx.try_recv() {
                        pending.push(c);
                    }
                    for c in pending {
                        let _ = stopper.send(c);
                    }
                }
                Err(e) => {
                    tracing::error!(run = %run_id, error = %e, "a parked run could not be woken; a successor or a resume goes on from its journal");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn many_readers_of_a_live_run_cost_it_one_report_per_tick() {
        let registry = Arc::new(RunRegistry::default());
        let (_snapshot, snapshot) = watch::channel(Arc::new(Snapshot::default()));
        let (_report, report) = watch::channel(None);
        let (stopper, mut controls) = mpsc::unbounded_channel();
        registry.lock().insert(
            "wf_many".into(),
            RunEntry {
                namespace: "default".into(),
                snapshot,
                stopper,
                report,
                live: Arc::default(),
            },
        );
        // The run: answers every report it is asked for, and counts them.
        let asked = Arc::new(AtomicUsize::new(0));
        tokio::spawn({
            let asked = asked.clone();
            async move {
                while let Some(c) = controls.recv().await {
                    if let Control::Report(reply) = c {
                        asked.fetch_add(1, Ordering::SeqCst);
                        let r = Report::rejected("wf_many", Default::default(), "live".into());
                        let _ = reply.send(r);
                    }
                }
            }
        });
        let readers: Vec<_> = (0..50)
            .map(|_| {
                let registry = registry.clone();
                tokio::spawn(async move { registry.live_report("wf_many").await })
            })
            .collect();
        for r in readers {
            assert_eq!(r.await.unwrap().unwrap().run_id, "wf_many");
        }
        assert_eq!(asked.load(Ordering::SeqCst), 1, "fifty readers, one report");
        tokio::time::advance(LIVE_REPORT_EVERY).await;
        assert!(registry.live_report("wf_many").await.is_some());
        assert_eq!(asked.load(Ordering::SeqCst), 2, "a tick later, a fresh one");
    }
}
