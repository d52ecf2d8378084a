//! `LeaseStore` on etcd (v3 API through `etcd-client`), optionally over TLS.
//!
//! Leases are etcd leases (TTL in whole seconds, at least one); keys under a lease are etcd
//! keys put with that lease; revisions are etcd revisions; `campaign` is a transaction that
//! puts only while the key's create revision is 0; `watch` is an etcd prefix watch. Renewals
//! reuse one keep-alive stream per lease.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, TlsOptions, Txn, TxnOp, WatchOptions,
};
use tokio::sync::{Mutex, mpsc};

use super::{BatchOp, Error, KeyValue, LeaseId, LeaseStore, Revision, WatchEvent};

/// The keep-alive stream of one lease (`None` until opened, and after it broke).
type Keeper = Arc<Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>>;

/// The etcd lease store.
pub struct EtcdLeaseStore {
    client: Client,
    /// One stream per lease, each behind a lock of its own: a renewal that hangs on a stream
    /// to a member that died holds up only its own lease, never the others'.
    keepers: std::sync::Mutex<HashMap<LeaseId, Keeper>>,
    /// The TTL each lease was granted with: a renewal waits for an answer a third of it.
    ttls: std::sync::Mutex<HashMap<LeaseId, Duration>>,
}

impl std::fmt::Debug for EtcdLeaseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLeaseStore").finish_non_exhaustive()
    }
}

/// Classifies an etcd error: a request etcd refuses as such (a malformed transaction, too
/// many operations, a request too large, no permission) is `Refused` and never retried;
/// anything else is `Unavailable`, including etcd's transient refusals: "not leader" and
/// "not capable" (`FailedPrecondition`), an expired auth token (`Unauthenticated`) and an
/// auth store that moved on ("revision of auth store is old", `InvalidArgument`).
fn unavailable(e: etcd_client::Error) -> Error {
    use tonic::Code;
    match &e {
        etcd_client::Error::GRpcStatus(status)
            if status.code() == Code::PermissionDenied
                || (status.code() == Code::InvalidArgument
                    && !status.message().contains("auth store is old")) =>
        {
            Error::Refused(status.message().to_owned())
        }
        etcd_client::Error::InvalidArgs(text) => Error::Refused(text.clone()),
        _ => Error::Unavailable(e.to_string()),
    }
}

fn lease_error(id: LeaseId, e: etcd_client::Error) -> Error {
    if e.to_string().contains("lease not found") {
        Error::LeaseGone(id)
    } else {
        unavailable(e)
    }
}

fn kv_of(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
        mod_revision: kv.mod_revision(),
        lease: (kv.lease() != 0).then_some(kv.lease()),
    }
}

impl EtcdLeaseStore {
    /// Drops what is kept for a lease that is gone.
    fn forget(&self, lease: LeaseId) {
        self.keepers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&lease);
        self.ttls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&lease);
    }

    /// Connects to etcd at `endpoints` (`http://host:port`, or `https://` with `tls`).
    pub async fn connect(endpoints: &[String], tls: Option<TlsOptions>) -> Result<Self, Error> {
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(10))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(5));
        if let Some(tls) = tls {
            opts = opts.with_tls(tls);
        }
        let client = Client::connect(endpoints, Some(opts)).await.map_err(|e| {
            Error::Unavailable(format!(
                "cannot connect to etcd at {}: {e}; is etcd running there (and --etcd-tls-dir right for https://)?",
                endpoints.join(",")
            ))
        })?;
        let store = EtcdLeaseStore {
            client,
            keepers: std::sync::Mutex::default(),
            ttls: std::sync::Mutex::default(),
        };
        // The first request is where an unreachable etcd or a refused TLS identity shows up;
        // fail at startup with the address in the message.
        store.get("/flotilla/ping").await.map_err(|e| {
            Error::Unavailable(format!(
                "cannot reach etcd at {}: {e}; is etcd running there (and are its TLS files right)?",
                endpoints.join(",")
            ))
        })?;
        Ok(store)
    }
}

#[async_trait::async_trait]
impl LeaseStore for EtcdLeaseStore {
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, Error> {
        let secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let resp = self
            .client
            .clone()
            .lease_grant(secs, None)
            .await
            .map_err(unavailable)?;
        self.ttls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(resp.id(), ttl);
        Ok(resp.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), Error> {
        let keeper = self
            .keepers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(lease)
            .or_default()
            .clone();
        let wait = self
            .ttls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&lease)
            .map_or(Duration::from_secs(2), |ttl| *ttl / 3)
            .max(Duration::from_millis(200));
        let mut held = keeper.lock().await;
        if held.is_none() {
            let pair = tokio::time::timeout(wait, self.client.clone().lease_keep_alive(lease))
                .await
                .map_err(|_| Error::Unavailable("etcd did not answer in time".into()))?
                .map_err(|err| lease_error(lease, err))?;
            *held = Some(pair);
        }
        let Some((keeper_tx, stream)) = held.as_mut() else {
            return Err(Error::Unavailable("no keep-alive stream".into()));
        };
        let renewed = tokio::time::timeout(wait, async {
            keeper_tx.keep_alive().await?;
            stream.message().await
        })
        .await;
        match renewed {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => Ok(()),
            Ok(Ok(_)) => {
                *held = None;
                self.forget(lease);
                Err(Error::LeaseGone(lease))
            }
            Ok(Err(e)) => {
                // A stream that broke (its member went away) is opened again next time.
                *held = None;
                Err(lease_error(lease, e))
            }
            Err(_) => {
                // No answer: the stream may be stuck on a member that is gone; the next
                // renewal opens a new one (the client picks a live member).
                *held = None;
                Err(Error::Unavailable(format!(
                    "etcd did not answer the renewal of lease {lease} within {wait:?}"
                )))
            }
        }
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), Error> {
        self.forget(lease);
        self.client
            .clone()
            .lease_revoke(lease)
            .await
            .map(|_| ())
            .map_err(|e| lease_error(lease, e))
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<Revision, Error> {
        let opts = lease.map(|l| PutOptions::new().with_lease(l));
        let resp = self
            .client
            .clone()
            .put(key, value, opts)
            .await
            .map_err(|e| lease_error(lease.unwrap_or_default(), e))?;
        resp.header()
            .map(|h| h.revision())
            .ok_or_else(|| Error::Unavailable("etcd answered a put without a header".into()))
    }

    async fn campaign(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<Option<Revision>, Error> {
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                value,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let resp = self
            .client
            .clone()
            .txn(txn)
            .await
            .map_err(|e| lease_error(lease, e))?;
        if !resp.succeeded() {
            return Ok(None);
        }
        Ok(resp.header().map(|h| h.revision()))
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>, Error> {
        let resp = self
            .client
            .clone()
            .get(key, None)
            .await
            .map_err(unavailable)?;
        Ok(resp.kvs().first().map(kv_of))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, Error> {
        let resp = self
            .client
            .clone()
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(unavailable)?;
        let mut out: Vec<KeyValue> = resp.kvs().iter().map(kv_of).collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    async fn delete(&self, key: &str) -> Result<bool, Error> {
        let resp = self
            .client
            .clone()
            .delete(key, None)
            .await
            .map_err(unavailable)?;
        Ok(resp.deleted() > 0)
    }

    async fn write_batch(&self, ops: Vec<BatchOp>) -> Result<Revision, Error> {
        // etcd refuses a transaction that names a key twice ("duplicate key given in txn
        // request"); the last write of each key is what applying them in order leaves.
        let ops = super::coalesce(ops);
        let first_lease = ops
            .iter()
            .find_map(|op| match op {
                BatchOp::Put { lease, .. } => *lease,
                BatchOp::Delete { .. } => None,
            })
            .unwrap_or_default();
        let txn_ops: Vec<TxnOp> = ops
            .into_iter()
            .map(|op| match op {
                BatchOp::Put { key, value, lease } => {
                    TxnOp::put(key, value, lease.map(|l| PutOptions::new().with_lease(l)))
                }
                BatchOp::Delete { key } => TxnOp::delete(key, None),
            })
            .collect();
        let resp = self
            .client
            .clone()
            .txn(Txn::new().and_then(txn_ops))
            .await
            .map_err(|e| lease_error(first_lease, e))?;
        resp.header().map(|h| h.revision()).ok_or_else(|| {
            Error::Unavailable("etcd answered a transaction without a header".into())
        })
    }

    async fn watch(&self, prefix: &str) -> Result<mpsc::UnboundedReceiver<WatchEvent>, Error> {
        let client = self.client.clone();
        let mut stream = client
            .clone()
            .watch(
                prefix,
                Some(WatchOptions::new().with_prefix().with_progress_notify()),
            )
            .await
            .map_err(unavailable)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let prefix = prefix.to_owned();
        tokio::spawn(async move {
            // The last revision reported; a broken stream (etcd restarting) resumes after it.
            let mut seen: Revision = 0;
            let mut backoff = Duration::from_millis(100);
            loop {
                loop {
                    let resp = match stream.message().await {
                        Ok(Some(resp)) => resp,
                        Ok(None) | Err(_) => break,
                    };
                    if resp.canceled() {
                        break;
                    }
                    let revision = resp.header().map_or(0, |h| h.revision());
                    // Every event up to the header's revision has been delivered.
                    let through = revision;
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        let event = match ev.event_type() {
                            EventType::Put => WatchEvent::Put(kv_of(kv)),
                            EventType::Delete => WatchEvent::Delete {
                                key: String::from_utf8_lossy(kv.key()).into_owned(),
                                revision: kv.mod_revision().max(revision),
                            },
                        };
                        seen = seen.max(kv.mod_revision());
                        if tx.send(event).is_err() {
                            return;
                        }
                    }
                    seen = seen.max(through);
                    backoff = Duration::from_millis(100);
                }
                // Re-watch from the next revision until etcd answers again.
                loop {
                    if tx.is_closed() {
                        return;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    let mut opts = WatchOptions::new().with_prefix().with_progress_notify();
                    if seen > 0 {
                        opts = opts.with_start_revision(seen + 1);
                    }
                    match client.clone().watch(prefix.as_str(), Some(opts)).await {
                        Ok(s) => {
                            tracing::info!(prefix = %prefix, after = seen, "etcd watch resumed");
                            stream = s;
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(prefix = %prefix, error = %e, "etcd watch broken; retrying");
                        }
                    }
                }
            }
        });
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_tests::services::Etcd;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_store_passes_the_conformance_suite() {
        let etcd = Etcd::start();
        let store = EtcdLeaseStore::connect(&[etcd.endpoint()], None)
            .await
            .unwrap();
        crate::conformance::run_all(&store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_etcd_refuses_is_refused_not_unavailable() {
        let etcd = Etcd::start();
        let store = EtcdLeaseStore::connect(&[etcd.endpoint()], None)
            .await
            .unwrap();
        // More operations than etcd takes in one transaction (--max-txn-ops, 128).
        let ops = (0..200)
            .map(|i| BatchOp::Put {
                key: format!("/refused/{i}"),
                value: vec![],
                lease: None,
            })
            .collect();
        let err = store.write_batch(ops).await.unwrap_err();
        assert!(matches!(err, Error::Refused(_)), "{err:?}");
        assert!(!err.is_retryable());
        assert!(err.to_string().contains("too many operations"), "{err}");
    }

    #[test]
    fn etcd_s_transient_refusals_are_retried() {
        use tonic::{Code, Status};
        let class =
            |code, msg: &str| unavailable(etcd_client::Error::GRpcStatus(Status::new(code, msg)));
        for (code, msg) in [
            (Code::FailedPrecondition, "etcdserver: not leader"),
            (Code::FailedPrecondition, "etcdserver: not capable"),
            (Code::Unauthenticated, "etcdserver: invalid auth token"),
            (
                Code::InvalidArgument,
                "etcdserver: revision of auth store is old",
            ),
            (Code::Unavailable, "etcdserver: no leader"),
        ] {
            assert!(matches!(class(code, msg), Error::Unavailable(_)), "{msg}");
        }
        for (code, msg) in [
            (
                Code::InvalidArgument,
                "etcdserver: too many operations in txn request",
            ),
            (Code::InvalidArgument, "etcdserver: request is too large"),
            (Code::PermissionDenied, "etcdserver: permission denied"),
        ] {
            assert!(matches!(class(code, msg), Error::Refused(_)), "{msg}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_missing_etcd_is_a_clear_error() {
        let port = flotilla_tests::cluster::free_port();
        let err = EtcdLeaseStore::connect(&[format!("http://127.0.0.1:{port}")], None)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("etcd"), "{err}");
    }
}
