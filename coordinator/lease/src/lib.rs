//! The `LeaseStore` seam: leases with a TTL, keys attached to leases, revisions as fencing
//! tokens, and a watch that reports keys as they vanish.
//!
//! Contract (checked by [`conformance`] against every implementation):
//! - a lease never expires before its TTL has passed since its grant or its last keep-alive;
//! - when a lease expires or is revoked, every key attached to it is deleted at once, and
//!   watchers of a matching prefix see each deletion;
//! - revisions never decrease: every write gets a revision greater than every earlier one, so
//!   a key's revision is a fencing token;
//! - `campaign` creates a key only if it is absent: at most one holder at a time.
//!
//! Implementations: [`memory::MemoryLeaseStore`] (embedded mode; time from tokio's clock, so
//! tests can pause and advance it) and [`etcd::EtcdLeaseStore`].

pub mod etcd;
pub mod memory;
pub mod tenure;

pub use tenure::Tenure;

#[cfg(test)]
pub(crate) mod conformance;

use std::time::Duration;

use tokio::sync::mpsc;

/// A lease id.
pub type LeaseId = i64;
/// A store revision (fencing token).
pub type Revision = i64;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("lease {0} does not exist or has expired")]
    LeaseGone(LeaseId),
    #[error("lease store unavailable: {0}")]
    Unavailable(String),
    /// The store refused the request itself (etcd's `InvalidArgument`, `PermissionDenied`,
    /// ...): sending it again gets the same answer, so it is never retried.
    #[error("lease store refused the request: {0}")]
    Refused(String),
}

impl Error {
    pub fn kind(&self) -> flotilla_proto::ErrorKind {
        match self {
            Error::LeaseGone(_) => flotilla_proto::ErrorKind::Fenced,
            Error::Unavailable(_) => flotilla_proto::ErrorKind::Unavailable,
            Error::Refused(_) => flotilla_proto::ErrorKind::Invalid,
        }
    }

    /// Whether the same request may succeed later (the store was down or slow).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unavailable(_))
    }
}

/// A key with its value and revisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// Revision of the last write of this key.
    pub mod_revision: Revision,
    pub lease: Option<LeaseId>,
}

/// What a watch reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    Put(KeyValue),
    Delete { key: String, revision: Revision },
}

/// One write of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchOp {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    Delete {
        key: String,
    },
}

impl BatchOp {
    pub fn key(&self) -> &str {
        match self {
            BatchOp::Put { key, .. } | BatchOp::Delete { key } => key,
        }
    }
}

/// The writes of a batch with one write per key: the last write of each key wins, and the
/// batch keeps the order of those last writes. Applying the result leaves the same keys as
/// applying `ops` in order (a store such as etcd refuses a transaction that names a key twice).
pub fn coalesce(ops: Vec<BatchOp>) -> Vec<BatchOp> {
    let mut last = std::collections::HashMap::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        last.insert(op.key().to_owned(), i);
    }
    if last.len() == ops.len() {
        return ops;
    }
    ops.into_iter()
        .enumerate()
        .filter(|(i, op)| last.get(op.key()) == Some(i))
        .map(|(_, op)| op)
        .collect()
}

/// The lease seam.
#[async_trait::async_trait]
pub trait LeaseStore: Send + Sync + 'static {
    /// Grants a lease that lives `ttl` unless kept alive.
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, Error>;
    /// Renews a lease for another TTL.
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), Error>;
    /// Ends a lease now, deleting its keys.
    async fn revoke(&self, lease: LeaseId) -> Result<(), Error>;
    /// Writes a key, optionally attached to a lease; returns its new revision.
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<Revision, Error>;
    /// Creates a key under a lease only if it does not exist; `None` when someone holds it.
    async fn campaign(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<Option<Revision>, Error>;
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, Error>;
    /// Every key under a prefix, in key order.
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, Error>;
    /// Deletes a key; returns whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, Error>;
    /// Applies `ops` in order as one atomic write and returns its revision: every key it puts
    /// has a revision no greater than that, and every later write a greater one. A key written
    /// more than once ends as its last write left it. A put under a lease that is gone refuses
    /// the whole batch (`LeaseGone`, naming one such lease).
    async fn write_batch(&self, ops: Vec<BatchOp>) -> Result<Revision, Error>;
    /// `write_batch` without waiting, for a store that can apply it at once (in memory);
    /// `None` means "use `write_batch`". A store answers always or never.
    fn write_batch_now(&self, _ops: &[BatchOp]) -> Option<Result<Revision, Error>> {
        None
    }
    /// Reports puts and deletes of keys under a prefix from now on. The stream survives a
    /// restart of the store's server (it resumes after the last revision it reported).
    async fn watch(&self, prefix: &str) -> Result<mpsc::UnboundedReceiver<WatchEvent>, Error>;
}

/// The etcd key layout (design.md, "etcd keys").
pub mod keys {
    pub fn worker(worker: &str) -> String {
        format!("/flotilla/workers/{worker}")
    }
    pub const WORKERS: &str = "/flotilla/workers/";
    pub fn attempt(run: &str, call: u64) -> String {
        format!("/flotilla/attempts/{run}/{call}")
    }
    pub const ATTEMPTS: &str = "/flotilla/attempts/";
    /// The run and call an attempt key names.
    pub fn parse_attempt(key: &str) -> Option<(&str, u64)> {
        let rest = key.strip_prefix(ATTEMPTS)?;
        let (run, call) = rest.rsplit_once('/')?;
        Some((run, call.parse().ok()?))
    }
    /// The worker a registration key names.
    pub fn parse_worker(key: &str) -> Option<&str> {
        key.strip_prefix(WORKERS).filter(|w| !w.is_empty())
    }
    pub fn run_owner(run: &str) -> String {
        format!("/flotilla/runs/{run}/owner")
    }
    /// From launch until the run's report is stored (no lease: it outlives its owner).
    pub fn run_live(run: &str) -> String {
        format!("/flotilla/runs/{run}/live")
    }
    pub const RUNS: &str = "/flotilla/runs/";
    /// The run resuming this one, under its owner's lease (one resume at a time, W52).
    pub fn run_resumer(run: &str) -> String {
        format!("/flotilla/runs/{run}/resumer")
    }
    /// The leading coordinator's address, under its lease.
    pub const LEADER: &str = "/flotilla/leader";
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(k: &str, v: &str) -> BatchOp {
        BatchOp::Put {
            key: k.into(),
            value: v.into(),
            lease: None,
        }
    }
    fn delete(k: &str) -> BatchOp {
        BatchOp::Delete { key: k.into() }
    }

    #[test]
    fn coalescing_keeps_the_last_write_of_each_key_in_order() {
        assert_eq!(
            coalesce(vec![
                delete("a"),
                put("b", "1"),
                put("a", "2"),
                put("b", "3"),
                put("c", "4"),
                delete("c"),
            ]),
            vec![put("a", "2"), put("b", "3"), delete("c")]
        );
        let distinct = vec![put("x", "1"), delete("y")];
        assert_eq!(coalesce(distinct.clone()), distinct);
    }
}
