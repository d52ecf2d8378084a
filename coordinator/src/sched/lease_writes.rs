//! The dispatcher's writes to the lease store, off its actor: attempt keys, written in order
//! and in batches by the key writer ([`spawn_key_writer`]) — the batch's revision is each
//! attempt's fence — and each worker's liveness lease with its registration key
//! ([`worker_lease`]); and the watches that tell the dispatcher when keys vanish.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::handle::{CallId, Msg, PendingPut, Refusal};
use crate::lease::{self, BatchOp, LeaseId, LeaseStore, Revision, WatchEvent};

/// Most attempt-key writes in one batch (etcd's default limit of operations per transaction).
const BATCH_MAX: usize = 128;
/// Longest wait between retries of a lease-store write that failed.
const MAX_RETRY: Duration = Duration::from_secs(2);

/// One attempt-key write.
#[derive(Debug)]
pub(super) enum KeyOp {
    Put {
        put: PendingPut,
        key: String,
        value: Vec<u8>,
        lease: LeaseId,
    },
    Delete {
        key: String,
    },
}

impl KeyOp {
    /// The key of `attempt` of call `id` on worker `wid`, under the worker's `lease`.
    pub(super) fn attempt(
        id: &CallId,
        wid: u64,
        worker: &str,
        attempt: u32,
        lease: LeaseId,
    ) -> KeyOp {
        KeyOp::Put {
            put: PendingPut {
                run: id.0.clone(),
                call: id.1,
                attempt,
                worker: wid,
                lease,
            },
            key: lease::keys::attempt(&id.0, id.1),
            value: serde_json::json!({"worker": worker, "attempt": attempt})
                .to_string()
                .into_bytes(),
            lease,
        }
    }

    pub(super) fn batch_op(&self) -> BatchOp {
        match self {
            KeyOp::Put {
                key, value, lease, ..
            } => BatchOp::Put {
                key: key.clone(),
                value: value.clone(),
                lease: Some(*lease),
            },
            KeyOp::Delete { key } => BatchOp::Delete { key: key.clone() },
        }
    }

    pub(super) fn into_put(self) -> Option<PendingPut> {
        match self {
            KeyOp::Put { put, .. } => Some(put),
            KeyOp::Delete { .. } => None,
        }
    }
}

/// Controls a worker's lease task.
#[derive(Debug)]
pub(super) struct LeaseCtl {
    pub(super) attached: watch::Sender<bool>,
    pub(super) stop: CancellationToken,
}

impl LeaseCtl {
    pub fn stop(&self) {
        self.stop.cancel();
    }
    pub(super) fn set_attached(&self, attached: bool) {
        self.attached.send_replace(attached);
    }
}

/// Writes attempt keys in order, in batches; tells the dispatcher what got written.
pub(super) fn spawn_key_writer(
    leases: Arc<dyn LeaseStore>,
    inbox: mpsc::UnboundedSender<Msg>,
    tasks: &TaskTracker,
    cancel: CancellationToken,
) -> mpsc::UnboundedSender<KeyOp> {
    let (tx, mut rx) = mpsc::unbounded_channel::<KeyOp>();
    tasks.spawn(async move {
        let mut buf = Vec::with_capacity(BATCH_MAX);
        loop {
            let n = tokio::select! {
                _ = cancel.cancelled() => return,
                n = rx.recv_many(&mut buf, BATCH_MAX) => n,
            };
            if n == 0 {
                return;
            }
            let ops = std::mem::take(&mut buf);
            tokio::select! {
                _ = cancel.cancelled() => return,
                () = write_ops(&*leases, ops, &inbox) => {}
            }
        }
    });
    tx
}

/// Writes one batch (one write per key, the last one winning), retrying while the store is
/// unavailable. A batch the store refuses is written again one key at a time, so only the
/// writes it refuses on their own fail: one poison write never blocks the keys behind it.
async fn write_ops(leases: &dyn LeaseStore, ops: Vec<KeyOp>, inbox: &mpsc::UnboundedSender<Msg>) {
    let batch = lease::coalesce(ops.iter().map(KeyOp::batch_op).collect());
    match write_retrying(leases, batch).await {
        Ok(revision) => {
            let puts = ops.into_iter().filter_map(KeyOp::into_put).collect();
            let _ = inbox.send(Msg::Written { puts, revision });
        }
        Err(why) => {
            if let Refusal::Refused(e) = &why {
                tracing::error!(error = %e, writes = ops.len(), "the lease store refused a batch of attempt keys; writing them one at a time");
            }
            for op in ops {
                let single = vec![op.batch_op()];
                let res = write_retrying(leases, single).await;
                if let Err(Refusal::Refused(e)) = &res {
                    tracing::error!(key = %op.batch_op().key(), error = %e, "the lease store refused an attempt key");
                }
                let Some(put) = op.into_put() else { continue };
                let _ = match res {
                    Ok(revision) => inbox.send(Msg::Written {
                        puts: vec![put],
                        revision,
                    }),
                    Err(why) => inbox.send(Msg::Refused {
                        puts: vec![put],
                        why,
                    }),
                };
            }
        }
    }
}

/// `Err` for a dead lease or a refused write; an unavailable store is retried until it answers.
async fn write_retrying(leases: &dyn LeaseStore, batch: Vec<BatchOp>) -> Result<Revision, Refusal> {
    let mut backoff = Duration::from_millis(50);
    loop {
        match leases.write_batch(batch.clone()).await {
            Ok(rev) => return Ok(rev),
            Err(lease::Error::LeaseGone(_)) => return Err(Refusal::LeaseGone),
            Err(lease::Error::Refused(e)) => return Err(Refusal::Refused(e)),
            Err(lease::Error::Unavailable(e)) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "cannot write attempt keys; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_RETRY);
            }
        }
    }
}

/// Watches attempt keys and worker registrations for the dispatcher.
pub(super) fn spawn_watches(
    leases: Arc<dyn LeaseStore>,
    inbox: mpsc::UnboundedSender<Msg>,
    tasks: &TaskTracker,
    cancel: CancellationToken,
) {
    for prefix in [lease::keys::ATTEMPTS, lease::keys::WORKERS] {
        let leases = leases.clone();
        let inbox = inbox.clone();
        let cancel = cancel.clone();
        tasks.spawn(async move {
            let mut backoff = Duration::from_millis(100);
            let mut events = loop {
                match leases.watch(prefix).await {
                    Ok(rx) => break rx,
                    Err(e) => {
                        tracing::warn!(prefix, error = %e, "cannot watch the lease store; retrying");
                        tokio::select! {
                            _ = cancel.cancelled() => return,
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(MAX_RETRY);
                    }
                }
            };
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    ev = events.recv() => match ev {
                        // Only deletions matter; puts are our own writes.
                        Some(ev @ WatchEvent::Delete { .. }) => {
                            if inbox.send(Msg::Watch(ev)).is_err() {
                                return;
                            }
                        }
                        Some(WatchEvent::Put(_)) => {}
                        None => return,
                    },
                }
            }
        });
    }
}

/// Holds a worker's liveness lease and registration key. Renews the lease while the worker is
/// attached; while it is cut off, waits (the lease runs out unless the worker comes back). A
/// lease that lapsed anyway (the store was down longer than the TTL) is granted anew.
pub(super) async fn worker_lease(
    leases: Arc<dyn LeaseStore>,
    ttl: Duration,
    name: Arc<str>,
    info: Vec<u8>,
    mut attached: watch::Receiver<bool>,
    stop: CancellationToken,
    inbox: mpsc::UnboundedSender<Msg>,
) {
    let key = lease::keys::worker(&name);
    let mut lease: Option<LeaseId> = None;
    let mut backoff = Duration::from_millis(100);
    loop {
        let up = *attached.borrow_and_update();
        let mut wait = ttl / 3;
        if up {
            match lease {
                None => match leases.grant(ttl).await {
                    Ok(id) => match leases.put(&key, info.clone(), Some(id)).await {
                        Ok(revision) => {
                            lease = Some(id);
                            backoff = Duration::from_millis(100);
                            let _ = inbox.send(Msg::LeaseGranted {
                                worker: name.clone(),
                                lease: id,
                                revision,
                            });
                        }
                        Err(e) => {
                            tracing::warn!(worker = %name, error = %e, "cannot register the worker");
                            wait = backoff;
                        }
                    },
                    Err(e) => {
                        tracing::warn!(worker = %name, error = %e, "cannot grant the worker's lease");
                        wait = backoff;
                    }
                },
                Some(id) => match leases.keep_alive(id).await {
                    Ok(()) => {}
                    Err(lease::Error::LeaseGone(_)) => {
                        tracing::warn!(worker = %name, "the worker's lease lapsed; granting a new one");
                        lease = None;
                        let _ = inbox.send(Msg::LeaseLost {
                            worker: name.clone(),
                            lease: id,
                        });
                        continue;
                    }
                    Err(e) => {
                        crate::counters::inc(&crate::counters::LEASE_RENEWAL_FAILURES);
                        tracing::warn!(worker = %name, error = %e, "cannot renew the worker's lease; retrying");
                        wait = backoff;
                    }
                },
            }
            backoff = (backoff * 2).min(MAX_RETRY);
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(wait) => {}
                r = attached.changed() => if r.is_err() { break },
            }
        } else {
            tokio::select! {
                _ = stop.cancelled() => break,
                r = attached.changed() => if r.is_err() { break },
            }
        }
    }
    if let Some(id) = lease {
        let _ = leases.revoke(id).await;
    }
}
