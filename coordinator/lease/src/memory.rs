//! In-memory `LeaseStore` for the embedded mode.
//!
//! All state sits behind one mutex. Expiry is lazy and exact: every operation first expires
//! the leases whose deadline has passed, and a reaper task wakes at the earliest deadline so
//! watchers learn of an expiry even when nobody calls in. Time is tokio's, so a test with a
//! paused clock controls expiry.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::{BatchOp, Error, KeyValue, LeaseId, LeaseStore, Revision, WatchEvent};

#[derive(Default)]
struct State {
    revision: Revision,
    next_lease: LeaseId,
    keys: BTreeMap<String, KeyValue>,
    leases: HashMap<LeaseId, Lease>,
    watchers: Vec<(String, mpsc::UnboundedSender<WatchEvent>)>,
}

struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: HashSet<String>,
}

/// The in-memory lease store.
pub struct MemoryLeaseStore {
    state: Arc<Mutex<State>>,
    wake: Arc<Notify>,
}

impl std::fmt::Debug for MemoryLeaseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryLeaseStore").finish_non_exhaustive()
    }
}

impl MemoryLeaseStore {
    /// Creates a store and starts its reaper on the current tokio runtime.
    pub fn new() -> Arc<Self> {
        let store = Arc::new(MemoryLeaseStore {
            state: Arc::default(),
            wake: Arc::new(Notify::new()),
        });
        let weak = Arc::downgrade(&store.state);
        let wake = store.wake.clone();
        tokio::spawn(reaper(weak, wake));
        store
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.expire(Instant::now());
        s
    }
}

async fn reaper(state: Weak<Mutex<State>>, wake: Arc<Notify>) {
    loop {
        let next = {
            let Some(state) = state.upgrade() else { return };
            let mut s = state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            s.expire(Instant::now());
            s.leases.values().map(|l| l.deadline).min()
        };
        match next {
            Some(deadline) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => {}
                    _ = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

impl State {
    fn bump(&mut self) -> Revision {
        self.revision += 1;
        self.revision
    }

    fn notify(&mut self, event: &WatchEvent) {
        let key = match event {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        };
        self.watchers.retain(|(prefix, tx)| {
            !key.starts_with(prefix.as_str()) || tx.send(event.clone()).is_ok()
        });
    }

    fn remove_key(&mut self, key: &str) -> bool {
        let Some(kv) = self.keys.remove(key) else {
            return false;
        };
        if let Some(lease) = kv.lease.and_then(|l| self.leases.get_mut(&l)) {
            lease.keys.remove(key);
        }
        let revision = self.bump();
        self.notify(&WatchEvent::Delete {
            key: key.to_owned(),
            revision,
        });
        true
    }

    fn end_lease(&mut self, id: LeaseId) {
        if let Some(lease) = self.leases.remove(&id) {
            let mut keys: Vec<_> = lease.keys.into_iter().collect();
            keys.sort();
            for key in keys {
                self.remove_key(&key);
            }
        }
    }

    fn expire(&mut self, now: Instant) {
        let expired: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.end_lease(id);
        }
    }

    fn write(
        &mut self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<Revision, Error> {
        if let Some(id) = lease
            && !self.leases.contains_key(&id)
        {
            return Err(Error::LeaseGone(id));
        }
        if let Some(old) = self.keys.get(key).and_then(|kv| kv.lease)
            && let Some(l) = self.leases.get_mut(&old)
        {
            l.keys.remove(key);
        }
        let revision = self.bump();
        let kv = KeyValue {
            key: key.to_owned(),
            value,
            mod_revision: revision,
            lease,
        };
        if let Some(l) = lease.and_then(|id| self.leases.get_mut(&id)) {
            l.keys.insert(key.to_owned());
        }
        self.keys.insert(key.to_owned(), kv.clone());
        self.notify(&WatchEvent::Put(kv));
        Ok(revision)
    }
}

#[async_trait::async_trait]
impl LeaseStore for MemoryLeaseStore {
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, Error> {
        let id = {
            let mut s = self.lock();
            s.next_lease += 1;
            let id = s.next_lease;
            s.leases.insert(
                id,
                Lease {
                    ttl,
                    deadline: Instant::now() + ttl,
                    keys: HashSet::new(),
                },
            );
            id
        };
        self.wake.notify_one();
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), Error> {
        let mut s = self.lock();
        let l = s.leases.get_mut(&lease).ok_or(Error::LeaseGone(lease))?;
        l.deadline = Instant::now() + l.ttl;
        Ok(())
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), Error> {
        let mut s = self.lock();
        if !s.leases.contains_key(&lease) {
            return Err(Error::LeaseGone(lease));
        }
        s.end_lease(lease);
        Ok(())
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<Revision, Error> {
        self.lock().write(key, value, lease)
    }

    async fn campaign(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<Option<Revision>, Error> {
        let mut s = self.lock();
        if s.keys.contains_key(key) {
            return Ok(None);
        }
        s.write(key, value, Some(lease)).map(Some)
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>, Error> {
        Ok(self.lock().keys.get(key).cloned())
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, Error> {
        let s = self.lock();
        Ok(s.keys
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v.clone())
            .collect())
    }

    async fn delete(&self, key: &str) -> Result<bool, Error> {
        Ok(self.lock().remove_key(key))
    }

    async fn write_batch(&self, ops: Vec<BatchOp>) -> Result<Revision, Error> {
        self.write_now(&ops)
    }

    fn write_batch_now(&self, ops: &[BatchOp]) -> Option<Result<Revision, Error>> {
        Some(self.write_now(ops))
    }

    async fn watch(&self, prefix: &str) -> Result<mpsc::UnboundedReceiver<WatchEvent>, Error> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock().watchers.push((prefix.to_owned(), tx));
        Ok(rx)
    }
}

impl MemoryLeaseStore {
    fn write_now(&self, ops: &[BatchOp]) -> Result<Revision, Error> {
        let mut s = self.lock();
        for op in ops {
            if let BatchOp::Put {
                lease: Some(id), ..
            } = op
                && !s.leases.contains_key(id)
            {
                return Err(Error::LeaseGone(*id));
            }
        }
        for op in ops {
            match op {
                BatchOp::Put { key, value, lease } => {
                    s.write(key, value.clone(), *lease)?;
                }
                BatchOp::Delete { key } => {
                    s.remove_key(key);
                }
            }
        }
        Ok(s.revision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn memory_store_passes_the_conformance_suite() {
        let store = MemoryLeaseStore::new();
        crate::conformance::run_all(store.as_ref()).await;
    }
}
