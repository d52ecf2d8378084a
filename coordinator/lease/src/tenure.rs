//! How long a coordinator of a group may still act on its lease: its *tenure*.
//!
//! etcd expires a lease no sooner than its TTL after the last keep-alive it processed, and
//! that keep-alive was sent after the coordinator started the call. So a coordinator that
//! started a keep-alive at `t` and heard it succeed holds its lease until at least `t + TTL`;
//! no successor can own its runs before then. A coordinator cut off from etcd cannot learn
//! whether its lease lapsed — it can only count: its tenure runs to `t + TTL × 4/5` (the rest
//! of the TTL covers writes already on their way). Past that it is *suspended*: it writes
//! nothing (the coordinator's `store::gate`; writes wait, as in a storage outage) and does not lead.
//! A renewal that succeeds later proves the lease never lapsed — nobody took over — and the
//! tenure goes on; a lease found gone [`Tenure::end`]s it for good, and the coordinator stops.
//!
//! Time is the monotonic clock, which goes on while the process is frozen (`SIGSTOP`): a
//! coordinator that wakes up after its successor took over finds its tenure over before it
//! does anything else.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::{BatchOp, Error, KeyValue, LeaseId, LeaseStore, Revision, WatchEvent};

/// The share of the TTL a renewal extends the tenure by, in fifths.
const SHARE_OF_TTL_IN_FIFTHS: u32 = 4;

/// Until when this coordinator may act; see the module doc.
#[derive(Debug)]
pub struct Tenure {
    /// Nanoseconds since [`base`] until which the tenure holds; `u64::MAX`: no lease yet
    /// (nothing to lose; a coordinator without a group never has one).
    until: AtomicU64,
}

fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

fn nanos(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(base()).as_nanos()).unwrap_or(u64::MAX - 1)
}

impl Default for Tenure {
    fn default() -> Self {
        Tenure::open()
    }
}

impl Tenure {
    /// A tenure with no end yet (before the lease is granted, or without a group).
    pub fn open() -> Tenure {
        base();
        Tenure {
            until: AtomicU64::new(u64::MAX),
        }
    }

    /// How long a renewal started at `sent`, with a lease of `ttl`, lets the coordinator act:
    /// the end of the tenure it gives.
    pub fn end_after(sent: Instant, ttl: Duration) -> Instant {
        sent + ttl * SHARE_OF_TTL_IN_FIFTHS / 5
    }

    /// A grant or keep-alive started at `sent` succeeded: the tenure runs until
    /// [`Tenure::end_after`]. It never moves back, and never comes back once ended.
    pub fn renewed(&self, sent: Instant, ttl: Duration) {
        let to = nanos(Self::end_after(sent, ttl)).max(1);
        let _ = self
            .until
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                if now == 0 {
                    None
                } else if now == u64::MAX {
                    Some(to)
                } else {
                    Some(now.max(to))
                }
            });
    }

    /// Ends the tenure for good.
    pub fn end(&self) {
        self.until.store(0, Ordering::Release);
    }

    /// When the tenure ends (`None`: not bounded yet).
    pub fn deadline(&self) -> Option<Instant> {
        match self.until.load(Ordering::Acquire) {
            u64::MAX => None,
            n => Some(base() + Duration::from_nanos(n)),
        }
    }

    /// Whether the tenure ended for good (the lease is gone).
    pub fn ended(&self) -> bool {
        self.until.load(Ordering::Acquire) == 0
    }

    /// Whether the coordinator may act now (not suspended, not ended).
    pub fn holds(&self) -> bool {
        match self.until.load(Ordering::Acquire) {
            0 => false,
            u64::MAX => true,
            n => nanos(Instant::now()) < n,
        }
    }
}

/// A coordinator's lease store in a group: writes (puts, campaigns, deletes, batches) only
/// while its [`Tenure`] holds, so a suspended or deposed coordinator writes no attempt key and
/// wins no election. Grants, renewals, reads and watches go through — renewing is how a
/// suspension ends.
pub struct GatedLeases {
    inner: Arc<dyn LeaseStore>,
    tenure: Arc<Tenure>,
}

impl GatedLeases {
    pub fn new(inner: Arc<dyn LeaseStore>, tenure: Arc<Tenure>) -> Arc<GatedLeases> {
        Arc::new(GatedLeases { inner, tenure })
    }

    fn check(&self) -> Result<(), Error> {
        if self.tenure.holds() {
            Ok(())
        } else {
            Err(Error::Unavailable(
                "this coordinator could not renew its own lease in time; it writes to etcd again once it does"
                    .into(),
            ))
        }
    }
}

#[async_trait::async_trait]
impl LeaseStore for GatedLeases {
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, Error> {
        self.inner.grant(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), Error> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke(&self, lease: LeaseId) -> Result<(), Error> {
        self.inner.revoke(lease).await
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<Revision, Error> {
        self.check()?;
        self.inner.put(key, value, lease).await
    }
    async fn campaign(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<Option<Revision>, Error> {
        self.check()?;
        self.inner.campaign(key, value, lease).await
    }
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, Error> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, Error> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, key: &str) -> Result<bool, Error> {
        self.check()?;
        self.inner.delete(key).await
    }
    async fn write_batch(&self, ops: Vec<BatchOp>) -> Result<Revision, Error> {
        self.check()?;
        self.inner.write_batch(ops).await
    }
    // Never at once: every batch asks the tenure first, in `write_batch`.
    async fn watch(&self, prefix: &str) -> Result<mpsc::UnboundedReceiver<WatchEvent>, Error> {
        self.inner.watch(prefix).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenure_runs_four_fifths_of_the_ttl_past_the_renewal_s_start_and_ends_for_good() {
        let t = Tenure::open();
        assert!(t.holds() && t.deadline().is_none());
        let sent = Instant::now();
        t.renewed(sent, Duration::from_secs(10));
        let end = t.deadline().unwrap();
        let d = end.duration_since(sent);
        assert!(
            d <= Duration::from_secs(8) && d > Duration::from_millis(7_999),
            "{d:?}"
        );
        assert!(t.holds());
        // An older renewal that answers late does not shorten it.
        t.renewed(sent - Duration::from_secs(5), Duration::from_secs(10));
        assert_eq!(t.deadline(), Some(end));
        // One whose start is long past has ended already.
        let stale = Tenure::open();
        stale.renewed(
            Instant::now() - Duration::from_secs(9),
            Duration::from_secs(10),
        );
        assert!(!stale.holds());
        // Past its end it is suspended; a renewal brings it back.
        assert!(!stale.ended());
        stale.renewed(Instant::now(), Duration::from_secs(10));
        assert!(stale.holds());
        t.end();
        assert!(!t.holds() && t.ended());
        t.renewed(Instant::now(), Duration::from_secs(10));
        assert!(!t.holds(), "an ended tenure stays ended");
    }

    #[tokio::test]
    async fn a_suspended_coordinator_writes_no_key_and_wins_no_election_but_can_renew() {
        let inner = crate::memory::MemoryLeaseStore::new();
        let tenure = Arc::new(Tenure::open());
        let leases = GatedLeases::new(inner.clone(), tenure.clone());
        let lease = leases.grant(Duration::from_secs(10)).await.unwrap();
        tenure.renewed(
            Instant::now() - Duration::from_secs(9),
            Duration::from_secs(10),
        );
        assert!(!tenure.holds());
        assert!(matches!(
            leases
                .campaign("/flotilla/leader", b"me".to_vec(), lease)
                .await,
            Err(Error::Unavailable(_))
        ));
        assert!(leases.put("/k", b"v".to_vec(), None).await.is_err());
        assert!(leases.write_batch(Vec::new()).await.is_err());
        assert!(leases.write_batch_now(&[]).is_none());
        assert_eq!(inner.get("/flotilla/leader").await.unwrap(), None);
        // Renewing goes through, and ends the suspension.
        let sent = Instant::now();
        leases.keep_alive(lease).await.unwrap();
        tenure.renewed(sent, Duration::from_secs(10));
        assert!(
            leases
                .campaign("/flotilla/leader", b"me".to_vec(), lease)
                .await
                .unwrap()
                .is_some()
        );
    }

    /// While its tenure holds, the gated store keeps the whole lease contract: it is the store
    /// a coordinator in a group writes through.
    #[tokio::test(start_paused = true)]
    async fn a_gated_store_in_office_passes_the_conformance_suite() {
        let tenure = Arc::new(Tenure::open());
        let leases = GatedLeases::new(crate::memory::MemoryLeaseStore::new(), tenure.clone());
        crate::conformance::run_all(leases.as_ref()).await;
        assert!(tenure.holds());
    }
}
