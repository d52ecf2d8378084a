//! Coordinators sharing one etcd: one leader, run ownership, failover.
//!
//! - Every coordinator holds a lease of its own, renewed while the process lives. It acts only
//!   within its [`Tenure`]: four fifths of the TTL past the start of its last renewal that
//!   succeeded. A coordinator that cannot renew in time (cut off from etcd, or frozen) is
//!   suspended before any successor can take over: it does not lead and its store writes
//!   nothing until a renewal succeeds (which proves nobody took over). One that learns its
//!   lease is gone steps down for good and stops (`lost` fires) rather than write over its
//!   successor.
//! - The leader holds `/flotilla/leader` (its address) under that lease. Only the leader
//!   takes workers and runs; the others are standbys that forward client requests to it.
//!   A coordinator whose lease lapsed while nobody else leads (alone in its group, paused
//!   past its TTL) starts again in its own place and campaigns as a new member: the binary's
//!   `coordinator` command does that, so nothing of the deposed tenure stays in memory.
//! - Each run holds `/flotilla/runs/{run}/owner` under its owner's lease, and a marker
//!   `/flotilla/runs/{run}/live` (no lease) from launch until its report is stored. A live run
//!   without an owner has lost its coordinator: the leader adopts it ([`Coordinator::adopt`]),
//!   replaying it from storage so no completed call runs twice.

use flotilla_proto::Problem;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::coordinator::Coordinator;
use crate::group::RunClaims;
use crate::lease::{self, LeaseId, LeaseStore, Tenure};
use crate::registry::RunRegistry;

pub use crate::group::ClaimError;
/// How often a standby checks whether the leader is still there.
const POLL: Duration = Duration::from_millis(500);

/// Leadership and ownership of one coordinator.
pub struct Leadership {
    leases: Arc<dyn LeaseStore>,
    lease: LeaseId,
    advertise: String,
    leading: AtomicBool,
    /// Whether it leads and may act now: false while suspended and once stepped down (its
    /// workers are handed back then, see [`Leadership::office`]).
    office: watch::Sender<bool>,
    leader: watch::Sender<Option<String>>,
    /// Until when it may act on its lease (shared with the gate of its store).
    tenure: Arc<Tenure>,
    /// Runs this coordinator started as resumes: run → the run it resumes.
    resumes: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("advertise", &self.advertise)
            .field("leading", &self.is_leader())
            .finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl RunClaims for Leadership {
    async fn own(&self, run: &str) -> Result<(), ClaimError> {
        Leadership::own(self, run).await
    }
    async fn claim_resume(&self, parent: &str, run: &str) -> Result<(), ClaimError> {
        Leadership::claim_resume(self, parent, run).await
    }
    async fn release_resume(&self, parent: &str, run: &str) {
        Leadership::release_resume(self, parent, run).await;
    }
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

impl Coordinator {
    /// The group this coordinator leads or stands by in, when it is in one: what the faces
    /// ask about the leader, the seat and the office. (The coordinator itself holds only the
    /// claims it makes on runs, [`RunClaims`], so it does not import this module.)
    pub fn leadership(&self) -> Option<Arc<Leadership>> {
        self.claims()?.clone().as_any().downcast().ok()
    }
}

impl Leadership {
    /// Grants this coordinator's lease and starts campaigning. `tenure` follows the lease
    /// (give the same one to the store's gate, [`crate::store::Store::gated`]). `lost` fires
    /// when the tenure ends: the process must stop.
    pub async fn join(
        leases: Arc<dyn LeaseStore>,
        advertise: String,
        ttl: Duration,
        tenure: Arc<Tenure>,
    ) -> Result<Arc<Leadership>, Problem> {
        let sent = std::time::Instant::now();
        let lease = leases
            .grant(ttl)
            .await
            .map_err(|e| Problem::unavailable(format!("cannot take a lease in etcd: {e}")))?;
        tenure.renewed(sent, ttl);
        let (leader, _) = watch::channel(None);
        let me = Arc::new(Leadership {
            leases,
            lease,
            advertise,
            leading: AtomicBool::new(false),
            office: watch::Sender::new(false),
            leader,
            tenure,
            resumes: std::sync::Mutex::default(),
        });
        Ok(me)
    }

    /// Starts serving the group for `coordinator` (built with this membership as its
    /// claims): renews the lease and campaigns for the leader's seat until `lost`, or until
    /// its process stops them, as tasks of the process's `tasks`.
    pub fn serve(
        self: &Arc<Self>,
        coordinator: Arc<Coordinator>,
        registry: Arc<RunRegistry>,
        ttl: Duration,
        lost: CancellationToken,
        tasks: &crate::tasks::Tasks,
    ) {
        tasks.spawn_until_stopped(keep_alive(self.clone(), ttl, lost.clone()));
        tasks.spawn_until_stopped(campaign(self.clone(), coordinator, registry, ttl, lost));
    }

    /// Its role now, for a readiness probe: `leader`, `standby` (its lease renewed, so etcd
    /// answers), or `suspended` (it could not renew in time, or it has stepped down).
    pub fn role(&self) -> &'static str {
        match (self.leading.load(Ordering::Acquire), self.tenure.holds()) {
            (true, true) => "leader",
            (false, true) => "standby",
            _ => "suspended",
        }
    }

    pub fn is_leader(&self) -> bool {
        self.leading.load(Ordering::Acquire) && self.tenure.holds()
    }

    /// Whether this coordinator holds the leader's seat, in office or suspended: clients are
    /// served here either way (a suspended leader's writes wait for its tenure; forwarding
    /// them would send them back to itself).
    pub fn holds_seat(&self) -> bool {
        self.leading.load(Ordering::Acquire) && !self.tenure.ended()
    }

    /// Ends the tenure: nothing more is written, the coordinator no longer leads, and `lost`
    /// stops the process.
    fn step_down(&self, why: &str, lost: &CancellationToken) {
        self.tenure.end();
        self.leading.store(false, Ordering::Release);
        self.office.send_replace(false);
        tracing::error!("{why}");
        lost.cancel();
    }

    /// Hands leadership over at once (a graceful shutdown): stops writing and leading, hands
    /// its workers back, then revokes its lease, which frees the leader's seat and its runs'
    /// owner keys, so a standby takes over now instead of when the lease would lapse. `lost`
    /// stops its campaign and renewals.
    pub async fn resign(&self, lost: &CancellationToken) {
        let was_leading = self.leading.load(Ordering::Acquire);
        // Writes end first: nothing this process still does lands after a successor starts.
        self.tenure.end();
        self.leading.store(false, Ordering::Release);
        self.office.send_replace(false);
        lost.cancel();
        match self.leases.revoke(self.lease).await {
            Ok(()) => tracing::info!(
                was_leading,
                "this coordinator resigned: its lease is revoked, so a standby takes over its runs and workers now"
            ),
            Err(e) => tracing::warn!(
                error = %e,
                "cannot revoke this coordinator's lease; a standby takes over when it lapses"
            ),
        }
    }

    /// Whether this coordinator leads and may act, as it changes. A worker link watches it:
    /// a leader that is suspended (cut off from etcd, or frozen) hands its workers back, so
    /// they attach to whichever coordinator leads next instead of waiting out the fault with
    /// one that cannot dispatch.
    pub fn office(&self) -> watch::Receiver<bool> {
        self.office.subscribe()
    }

    /// The leader's address, when known.
    pub fn leader(&self) -> Option<String> {
        self.leader.borrow().clone()
    }

    /// Who holds the leader's seat now, as etcd says (`None`: nobody). A read, so it answers
    /// also once this coordinator's tenure is over.
    pub async fn seat_holder(&self) -> Result<Option<String>, lease::Error> {
        Ok(self
            .leases
            .get(lease::keys::LEADER)
            .await?
            .map(|kv| String::from_utf8_lossy(&kv.value).into_owned()))
    }

    /// Waits until some coordinator leads (or `within` passes); its address.
    pub async fn wait_for_leader(&self, within: Duration) -> Option<String> {
        let mut rx = self.leader.subscribe();
        let found = tokio::time::timeout(within, rx.wait_for(Option::is_some)).await;
        found.ok().and_then(|r| r.ok()).and_then(|v| v.clone())
    }

    /// Marks a run as live and owned by this coordinator (before it starts).
    pub async fn own(&self, run: &str) -> Result<(), ClaimError> {
        self.leases
            .put(
                &lease::keys::run_live(run),
                self.advertise.clone().into_bytes(),
                None,
            )
            .await
            .map_err(|source| ClaimError::Etcd {
                doing: format!("cannot record run {run} in etcd"),
                source,
            })?;
        match self
            .leases
            .campaign(
                &lease::keys::run_owner(run),
                self.advertise.clone().into_bytes(),
                self.lease,
            )
            .await
        {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(ClaimError::OwnedElsewhere {
                run: run.to_owned(),
            }),
            Err(source) => Err(ClaimError::Etcd {
                doing: format!("cannot take ownership of run {run}"),
                source,
            }),
        }
    }

    /// W52: `run` resumes `parent`. Refused while `parent` is live on the fleet (its
    /// coordinator runs it, or will adopt it) or another run resumes it; the claim lives under
    /// this coordinator's lease until `run`'s report is stored.
    pub async fn claim_resume(&self, parent: &str, run: &str) -> Result<(), ClaimError> {
        let etcd = |source: lease::Error| ClaimError::Etcd {
            doing: format!("cannot check run {parent} in etcd"),
            source,
        };
        if self
            .leases
            .get(&lease::keys::run_live(parent))
            .await
            .map_err(etcd)?
            .is_some()
        {
            return Err(ClaimError::StillLive {
                run: parent.to_owned(),
            });
        }
        let key = lease::keys::run_resumer(parent);
        match self
            .leases
            .campaign(&key, run.as_bytes().to_vec(), self.lease)
            .await
            .map_err(etcd)?
        {
            Some(_) => {
                self.lock_resumes()
                    .insert(run.to_owned(), parent.to_owned());
                Ok(())
            }
            None => {
                let by = self
                    .leases
                    .get(&key)
                    .await
                    .ok()
                    .flatten()
                    .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
                    .unwrap_or_else(|| "another run".into());
                Err(ClaimError::BeingResumed {
                    run: parent.to_owned(),
                    by,
                })
            }
        }
    }

    /// Lets go of `run`'s claim on `parent` (it never started, or it ended).
    pub async fn release_resume(&self, parent: &str, run: &str) {
        self.lock_resumes().remove(run);
        let key = lease::keys::run_resumer(parent);
        if let Ok(Some(kv)) = self.leases.get(&key).await
            && kv.value == run.as_bytes()
        {
            let _ = self.leases.delete(&key).await;
        }
    }

    fn lock_resumes(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, String>> {
        self.resumes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The run's report is stored: it needs no owner any more.
    pub async fn release(&self, run: &str) {
        let parent = self.lock_resumes().get(run).cloned();
        if let Some(parent) = parent {
            self.release_resume(&parent, run).await;
        }
        for key in [lease::keys::run_live(run), lease::keys::run_owner(run)] {
            let mut backoff = Duration::from_millis(100);
            for _ in 0..20 {
                match self.leases.delete(&key).await {
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(run, error = %e, "cannot release the run in etcd; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
        }
    }

    /// Adopts every live run that has no owner. Called by the leader.
    async fn adopt_orphans(&self, coordinator: &Arc<Coordinator>, registry: &Arc<RunRegistry>) {
        let keys = match self.leases.list(lease::keys::RUNS).await {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list runs in etcd");
                return;
            }
        };
        let mut live = Vec::new();
        let mut owned = std::collections::HashSet::new();
        for kv in &keys {
            let Some(rest) = kv.key.strip_prefix(lease::keys::RUNS) else {
                continue;
            };
            match rest.rsplit_once('/') {
                Some((run, "live")) => live.push(run.to_owned()),
                Some((run, "owner")) => {
                    owned.insert(run.to_owned());
                }
                _ => {}
            }
        }
        for run in live.into_iter().filter(|r| !owned.contains(r)) {
            if registry.live(&run).is_some() {
                continue;
            }
            match self
                .leases
                .campaign(
                    &lease::keys::run_owner(&run),
                    self.advertise.clone().into_bytes(),
                    self.lease,
                )
                .await
            {
                Ok(Some(_)) => {}
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(run, error = %e, "cannot take over the run");
                    continue;
                }
            }
            match coordinator.adopt(&run).await {
                Ok(handle) => {
                    tracing::info!(run, "adopted a run whose coordinator is gone");
                    registry.track(handle);
                }
                Err(e) => {
                    tracing::error!(run, error = %e.message, "cannot adopt the run; leaving it");
                    self.release(&run).await;
                }
            }
        }
    }
}

/// Renews the coordinator's lease every third of its TTL. A renewal that has not succeeded
/// by the end of the tenure suspends the coordinator (said once); one that succeeds later
/// ends the suspension. A lease found gone ends the tenure, and `lost` fires.
async fn keep_alive(me: Arc<Leadership>, ttl: Duration, lost: CancellationToken) {
    let mut suspended = false;
    loop {
        let sent = std::time::Instant::now();
        let deadline = me.tenure.deadline().map(tokio::time::Instant::from_std);
        // A renewal that does not answer (etcd cut off: packets lost, not refused) is given up
        // and tried again.
        let renewed = tokio::select! {
            _ = lost.cancelled() => return,
            r = tokio::time::timeout(ttl / 3, me.leases.keep_alive(me.lease)) => r,
            () = sleep_until_some(deadline), if !suspended => {
                suspended = true;
                me.office.send_replace(false);
                tracing::error!("this coordinator could not renew its lease in etcd in time (cut off from etcd, or frozen): it stops leading and writing until it can, so no other coordinator's work is overwritten");
                continue;
            }
        };
        let pause = match renewed {
            Ok(Ok(())) => {
                me.tenure.renewed(sent, ttl);
                if std::mem::take(&mut suspended) {
                    me.office.send_replace(me.leading.load(Ordering::Acquire));
                    tracing::warn!(
                        "this coordinator renewed its lease again (nobody took over): it carries on"
                    );
                }
                ttl / 3
            }
            Ok(Err(lease::Error::LeaseGone(_))) => {
                me.step_down(
                    "this coordinator's lease in etcd lapsed; another coordinator may own its runs now",
                    &lost,
                );
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot renew the coordinator's lease; retrying");
                ttl / 10
            }
            Err(_) => {
                tracing::warn!(
                    "etcd did not answer the renewal of the coordinator's lease; retrying"
                );
                ttl / 10
            }
        };
        tokio::select! {
            _ = lost.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Becomes the leader when the seat is free; until then follows the current leader.
async fn campaign(
    me: Arc<Leadership>,
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    ttl: Duration,
    lost: CancellationToken,
) {
    loop {
        if lost.is_cancelled() {
            return;
        }
        let won = me
            .leases
            .campaign(
                lease::keys::LEADER,
                me.advertise.clone().into_bytes(),
                me.lease,
            )
            .await;
        match won {
            Ok(Some(_)) => {
                tracing::info!(address = %me.advertise, "this coordinator leads");
                crate::counters::inc(&crate::counters::LEADER_WINS);
                // Namespaces' daily use is counted afresh from the store: what this one
                // counted when it led before may be stale.
                if let Some(q) = coordinator.quotas() {
                    q.reset();
                }
                me.leading.store(true, Ordering::Release);
                me.office.send_replace(me.tenure.holds());
                me.leader.send_replace(Some(me.advertise.clone()));
                // Runs of a coordinator that went away; again now and then, in case one's
                // owner key lapses later.
                loop {
                    me.adopt_orphans(&coordinator, &registry).await;
                    tokio::select! {
                        _ = lost.cancelled() => return,
                        _ = tokio::time::sleep(ttl) => {}
                    }
                }
            }
            Ok(None) => {
                let current = me
                    .leases
                    .get(lease::keys::LEADER)
                    .await
                    .ok()
                    .flatten()
                    .map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
                if me.leader() != current {
                    if let Some(l) = &current {
                        tracing::info!(leader = %l, "standing by");
                    }
                    me.leader.send_replace(current);
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot campaign for leadership; retrying"),
        }
        tokio::select! {
            _ = lost.cancelled() => return,
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::memory::MemoryLeaseStore;
    use crate::lease::{BatchOp, KeyValue, Revision, WatchEvent};
    use tokio::sync::mpsc;

    /// A lease store whose keep-alives stop answering once cut off (etcd out of reach).
    struct CutOff {
        inner: Arc<MemoryLeaseStore>,
        cut: AtomicBool,
    }

    #[async_trait::async_trait]
    impl LeaseStore for CutOff {
        async fn grant(&self, ttl: Duration) -> Result<LeaseId, lease::Error> {
            self.inner.grant(ttl).await
        }
        async fn keep_alive(&self, lease: LeaseId) -> Result<(), lease::Error> {
            if self.cut.load(Ordering::Acquire) {
                std::future::pending::<()>().await;
            }
            self.inner.keep_alive(lease).await
        }
        async fn revoke(&self, lease: LeaseId) -> Result<(), lease::Error> {
            self.inner.revoke(lease).await
        }
        async fn put(
            &self,
            key: &str,
            value: Vec<u8>,
            lease: Option<LeaseId>,
        ) -> Result<Revision, lease::Error> {
            self.inner.put(key, value, lease).await
        }
        async fn campaign(
            &self,
            key: &str,
            value: Vec<u8>,
            lease: LeaseId,
        ) -> Result<Option<Revision>, lease::Error> {
            self.inner.campaign(key, value, lease).await
        }
        async fn get(&self, key: &str) -> Result<Option<KeyValue>, lease::Error> {
            self.inner.get(key).await
        }
        async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, lease::Error> {
            self.inner.list(prefix).await
        }
        async fn delete(&self, key: &str) -> Result<bool, lease::Error> {
            self.inner.delete(key).await
        }
        async fn write_batch(&self, ops: Vec<BatchOp>) -> Result<Revision, lease::Error> {
            self.inner.write_batch(ops).await
        }
        async fn watch(
            &self,
            prefix: &str,
        ) -> Result<mpsc::UnboundedReceiver<WatchEvent>, lease::Error> {
            self.inner.watch(prefix).await
        }
    }

    #[tokio::test]
    async fn a_coordinator_cut_off_from_etcd_steps_down_before_its_lease_lapses() {
        let ttl = Duration::from_millis(900);
        let leases = Arc::new(CutOff {
            inner: MemoryLeaseStore::new(),
            cut: AtomicBool::new(false),
        });
        let tenure = Arc::new(Tenure::open());
        let sent = std::time::Instant::now();
        let lease = leases.grant(ttl).await.unwrap();
        tenure.renewed(sent, ttl);
        let me = Arc::new(Leadership {
            leases: leases.clone(),
            lease,
            advertise: "https://10.0.0.1:7443".into(),
            leading: AtomicBool::new(true),
            office: watch::Sender::new(true),
            leader: watch::channel(None).0,
            tenure: tenure.clone(),
            resumes: std::sync::Mutex::default(),
        });
        let lost = CancellationToken::new();
        tokio::spawn(keep_alive(me.clone(), ttl, lost.clone()));
        // Renewals that succeed move the tenure on.
        let first = tenure.deadline().unwrap();
        while tenure.deadline().unwrap() <= first {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(me.is_leader() && !lost.is_cancelled());
        // Cut off: it stops leading by itself, while etcd still holds its lease (no
        // successor can have taken over yet).
        leases.cut.store(true, Ordering::Release);
        while tenure.holds() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!me.is_leader());
        // Its worker links watch `office`: they are handed back now.
        let mut office = me.office();
        tokio::time::timeout(Duration::from_secs(5), office.wait_for(|v| !v))
            .await
            .expect("a suspended leader stayed in office")
            .unwrap();
        assert_eq!(
            leases.inner.keep_alive(lease).await,
            Ok(()),
            "the lease lapsed before the coordinator stopped leading"
        );
        assert!(!lost.is_cancelled(), "suspended, not deposed");
        // etcd answers again and the lease is still there: it carries on.
        leases.cut.store(false, Ordering::Release);
        while !tenure.holds() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(me.is_leader());
        tokio::time::timeout(Duration::from_secs(5), office.wait_for(|v| *v))
            .await
            .expect("a leader that renewed again did not take its workers back")
            .unwrap();
        // Cut off until the lease is gone: when etcd answers, it steps down for good.
        leases.cut.store(true, Ordering::Release);
        while tenure.holds() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        leases.inner.revoke(lease).await.unwrap();
        leases.cut.store(false, Ordering::Release);
        tokio::time::timeout(Duration::from_secs(10), lost.cancelled())
            .await
            .expect("a coordinator whose lease lapsed never stepped down");
        assert!(tenure.ended() && !me.is_leader() && !*me.office().borrow());
    }
}
