//! Leftovers kept in the store too (`runs/RUN/leftovers/ID.pb`): what a call's interrupted
//! attempt left its next one (the files' commit and the agent's conversation), so that a
//! coordinator that adopts the run starts that next attempt from it as this one would have.
//!
//! Writes leave the dispatcher's actor through one task. Only the newest state of each call is
//! written (one superseded before it went is never sent), so what waits to be written is
//! bounded by what the dispatcher keeps in memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use flotilla_proto::frag::MAX_SESSION_BYTES;
use flotilla_proto::v1::KeptLeftovers;
use object_store::path::Path;
use prost::Message;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::store::{Store, keys};

/// The object name of a call's leftovers: 24 hex digits of its key's sha256.
fn id_of(call_key: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(&Sha256::digest(call_key.as_bytes())[..12])
}

#[derive(Default)]
struct Pending {
    /// Per object, its newest state: a body to put, or `None` to delete it.
    writes: Mutex<HashMap<Path, Option<Bytes>>>,
    wake: Notify,
}

/// Writes the dispatcher's leftovers to the store, in the background.
#[derive(Clone)]
pub(super) struct Writer {
    pending: Arc<Pending>,
}

impl Writer {
    pub(super) fn spawn(store: Store, tasks: &TaskTracker, cancel: CancellationToken) -> Writer {
        let pending = Arc::new(Pending::default());
        let p = pending.clone();
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = p.wake.notified() => {}
                }
                let batch = std::mem::take(&mut *p.writes.lock().unwrap_or_else(|e| e.into_inner()));
                for (key, body) in batch {
                    let put = body.is_some();
                    let written = match body {
                        Some(b) => store.put_overwrite(&key, b).await,
                        None => store.delete(&key).await,
                    };
                    match written {
                        Ok(()) if put => {
                            tracing::info!(key = %key, "an interrupted attempt's leftovers are in the store")
                        }
                        Ok(()) => {}
                        // The call's next attempt here still has them; only an adopting
                        // coordinator would start it over.
                        Err(e) => {
                            tracing::warn!(key = %key, error = %e, "cannot keep an interrupted attempt's leftovers in the store")
                        }
                    }
                }
            }
        });
        Writer { pending }
    }

    fn set(&self, key: Path, body: Option<Bytes>) {
        self.pending
            .writes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, body);
        self.pending.wake.notify_one();
    }

    /// Keeps `kept` as what run `run`'s call `kept.call_key` left its next attempt.
    pub(super) fn put(&self, run: &str, kept: &KeptLeftovers) {
        let key = keys::leftovers(run, &id_of(&kept.call_key));
        self.set(key, Some(Bytes::from(kept.encode_to_vec())));
    }

    /// The call ended (or starts over with nothing): what it kept goes.
    pub(super) fn delete(&self, run: &str, call_key: &str) {
        self.set(keys::leftovers(run, &id_of(call_key)), None);
    }
}

/// What run `run`'s interrupted calls left their next attempts, by call key: read by a
/// coordinator that adopts the run. What cannot be read is left out (that call starts over),
/// and said in the log.
pub async fn load(store: &Store, run: &str) -> HashMap<String, KeptLeftovers> {
    let mut kept = HashMap::new();
    let objects = match store.list_objects(&keys::leftovers_dir(run)).await {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!(run, error = %e, "cannot list the run's kept leftovers; its interrupted calls start over");
            return kept;
        }
    };
    for key in objects {
        let read = match store.get(&key).await {
            Ok(Some(body)) => KeptLeftovers::decode(body).map_err(|e| e.to_string()),
            Ok(None) => continue,
            Err(e) => Err(e.to_string()),
        };
        let named =
            |k: &KeptLeftovers| key.filename() == Some(&format!("{}.pb", id_of(&k.call_key)));
        match read {
            Ok(k)
                if named(&k)
                    && k.session
                        .as_ref()
                        .is_none_or(|s| s.state.len() <= MAX_SESSION_BYTES) =>
            {
                kept.insert(k.call_key.clone(), k);
            }
            Ok(_) => {
                tracing::warn!(run, key = %key, "ignoring kept leftovers that are not what their name says");
            }
            Err(e) => {
                tracing::warn!(run, key = %key, error = %e, "cannot read kept leftovers; that call starts over");
            }
        }
    }
    kept
}
