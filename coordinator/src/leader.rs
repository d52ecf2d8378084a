//! Coordinators sharing one etcd: one leader, run ownership, failover.
//!
//! - Every coordinator holds a lease of its own, renewed while the process lives. A
//!   coordinator whose lease is gone anyway (cut off from etcd longer than the TTL) has been
//!   replaced: it stops at once (`lost` fires) rather than write over its successor.
//! - The leader holds `/flotilla/leader` (its address) under that lease. Only the leader
//!   takes workers and runs; the others are standbys that forward client requests to it.
//! - Each run holds `/flotilla/runs/{run}/owner` under its owner's lease, and a marker
//!   `/flotilla/runs/{run}/live` (no lease) from launch until its report is stored. A live run
//!   without an owner has lost its coordinator: the leader adopts it ([`Coordinator::adopt`]),
//!   replaying it from storage so no completed call runs twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::api::RunRegistry;
use crate::coordinator::Coordinator;
use crate::lease::{self, LeaseId, LeaseStore};

/// Why the fleet would not let this coordinator own, or resume, a run.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("run {run} is owned by another coordinator")]
    OwnedElsewhere { run: String },
    #[error(
        "run {run} is still live on the fleet (its coordinator runs it, or will adopt it); stop it with `flotilla stop {run}` and wait for its report, then resume"
    )]
    StillLive { run: String },
    #[error(
        "run {run} is being resumed already, by run {by}; wait for it to end (`flotilla wait {by}`) or stop it, or resume {by} instead"
    )]
    BeingResumed { run: String, by: String },
    #[error("{doing}: {source}")]
    Etcd {
        doing: String,
        #[source]
        source: lease::Error,
    },
}

impl ClaimError {
    pub fn kind(&self) -> flotilla_proto::ErrorKind {
        match self {
            ClaimError::Etcd { .. } => flotilla_proto::ErrorKind::Unavailable,
            _ => flotilla_proto::ErrorKind::Conflict,
        }
    }
}
/// How often a standby checks whether the leader is still there.
const POLL: Duration = Duration::from_millis(500);

/// Leadership and ownership of one coordinator.
pub struct Leadership {
    leases: Arc<dyn LeaseStore>,
    lease: LeaseId,
    advertise: String,
    leading: AtomicBool,
    leader: watch::Sender<Option<String>>,
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

impl Leadership {
    /// Grants this coordinator's lease and starts campaigning. `lost` fires if the lease is
    /// ever gone: the process must stop.
    pub async fn start(
        coordinator: Arc<Coordinator>,
        registry: Arc<RunRegistry>,
        leases: Arc<dyn LeaseStore>,
        advertise: String,
        ttl: Duration,
        lost: CancellationToken,
    ) -> Result<Arc<Leadership>, String> {
        let lease = leases
            .grant(ttl)
            .await
            .map_err(|e| format!("cannot take a lease in etcd: {e}"))?;
        let (leader, _) = watch::channel(None);
        let me = Arc::new(Leadership {
            leases,
            lease,
            advertise,
            leading: AtomicBool::new(false),
            leader,
            resumes: std::sync::Mutex::default(),
        });
        tokio::spawn(keep_alive(me.clone(), ttl, lost.clone()));
        tokio::spawn(campaign(me.clone(), coordinator, registry, ttl, lost));
        Ok(me)
    }

    pub fn is_leader(&self) -> bool {
        self.leading.load(Ordering::Acquire)
    }

    /// The leader's address, when known.
    pub fn leader(&self) -> Option<String> {
        self.leader.borrow().clone()
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

/// Renews the coordinator's lease; a lease found gone means another coordinator may own
/// our runs by now, so `lost` fires.
async fn keep_alive(me: Arc<Leadership>, ttl: Duration, lost: CancellationToken) {
    loop {
        tokio::select! {
            _ = lost.cancelled() => return,
            _ = tokio::time::sleep(ttl / 3) => {}
        }
        match me.leases.keep_alive(me.lease).await {
            Ok(()) => {}
            Err(lease::Error::LeaseGone(_)) => {
                tracing::error!(
                    "this coordinator's lease in etcd lapsed; another coordinator may own its runs now"
                );
                me.leading.store(false, Ordering::Release);
                lost.cancel();
                return;
            }
            Err(e) => tracing::warn!(error = %e, "cannot renew the coordinator's lease; retrying"),
        }
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
                me.leading.store(true, Ordering::Release);
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
