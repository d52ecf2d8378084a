//! What unfinished attempts left (W58 on the fleet): a call's next attempt starts from the
//! files its last interrupted attempt left, on any worker.
//!
//! An attempt that ends unfinished sends its leftovers with its failure (`Failure.partial`);
//! the dispatcher stores them off the actor and records them here once stored. A restart
//! after a stall or a user's restart (or a pause) waits for the interrupted attempt's outcome,
//! at most [`WAIT`]; a retry after a failure that carried leftovers waits until they are
//! stored. This module owns that state: per call, the stored leftovers and what a retry
//! waits for.

use std::collections::HashMap;
use std::time::Duration;

use flotilla_proto::v1::KeptLeftovers;

use super::handle::CallId;

/// Longest a restarted call waits for what its interrupted attempt leaves.
pub(super) const WAIT: Duration = Duration::from_secs(30);
use flotilla_proto::frag::MAX_SESSION_BYTES;
/// What the coordinator holds of conversations in all; past it, the oldest kept go.
pub(super) const SESSIONS_BYTES: usize = 1 << 30;
/// What it holds of one namespace's; past it, that namespace's oldest go (one tenant's
/// agents cannot push out everyone else's).
pub(super) const NAMESPACE_SESSIONS_BYTES: usize = 256 << 20;

#[derive(Debug, Default)]
struct Entry {
    /// The latest stored leftovers: (attempt, base, partial commit).
    stored: Option<(u32, String, String)>,
    /// The attempt whose leftovers (outcome, then store) a retry waits for.
    awaiting: Option<u32>,
    /// The retry would go now, but for the wait.
    due: bool,
    /// The conversation its latest interrupted attempt left, for the next to continue.
    session: Option<flotilla_proto::v1::Session>,
    /// When it was kept (which go first past [`SESSIONS_BYTES`]).
    session_seq: u64,
    /// The namespace of the call's run, whose share the conversation counts against.
    namespace: String,
    /// Sessions of attempts up to this one are not kept (a restart asked to start over).
    fresh_upto: u32,
    /// What it keeps is in the store too (`kept.rs`).
    in_store: bool,
}

/// What to do with the store's copy of a call's leftovers.
#[derive(Debug, PartialEq)]
pub(super) enum Keep {
    Put(KeptLeftovers),
    Delete,
    Nothing,
}

/// Leftovers of the calls of every run.
#[derive(Debug, Default)]
pub(super) struct Leftovers {
    calls: HashMap<CallId, Entry>,
    /// Bytes of the conversations kept, in all and per namespace, and a counter that orders
    /// them.
    session_bytes: usize,
    namespace_bytes: HashMap<String, usize>,
    kept: u64,
}

impl Leftovers {
    /// `id`'s retry waits for what attempt `attempt` leaves; `due`: it would go now.
    pub(super) fn wait_for(&mut self, id: &CallId, attempt: u32, due: bool) {
        let e = self.calls.entry(id.clone()).or_default();
        e.awaiting = Some(attempt);
        e.due = due;
    }

    /// Whether `id`'s retry waits for attempt `attempt`.
    pub(super) fn awaits(&self, id: &CallId, attempt: u32) -> bool {
        self.calls
            .get(id)
            .is_some_and(|e| e.awaiting == Some(attempt))
    }

    /// Whether `id`'s retry waits for anything.
    pub(super) fn waiting(&self, id: &CallId) -> bool {
        self.calls.get(id).is_some_and(|e| e.awaiting.is_some())
    }

    /// `id`'s retry came due while it waits.
    pub(super) fn set_due(&mut self, id: &CallId) {
        if let Some(e) = self.calls.get_mut(id) {
            e.due = true;
        }
    }

    /// The wait for attempt `attempt` is over: whether the retry is due now (`false` when
    /// it was not waiting for that attempt).
    pub(super) fn end_wait(&mut self, id: &CallId, attempt: u32) -> bool {
        match self.calls.get_mut(id) {
            Some(e) if e.awaiting == Some(attempt) => {
                e.awaiting = None;
                std::mem::take(&mut e.due)
            }
            _ => false,
        }
    }

    /// Attempt `attempt`'s leftovers are stored as `commit` on `base`; `false` when newer
    /// ones are there already.
    pub(super) fn stored(
        &mut self,
        id: &CallId,
        attempt: u32,
        base: String,
        commit: String,
    ) -> bool {
        let e = self.calls.entry(id.clone()).or_default();
        if e.stored.as_ref().is_some_and(|(a, ..)| *a >= attempt) {
            return false;
        }
        e.stored = Some((attempt, base, commit));
        true
    }

    /// Where `id`'s next attempt starts: the base and the leftovers' commit.
    pub(super) fn start_of(&self, id: &CallId) -> Option<(&str, &str)> {
        self.calls
            .get(id)
            .and_then(|e| e.stored.as_ref())
            .map(|(_, b, c)| (b.as_str(), c.as_str()))
    }

    /// A new attempt of `id` is sent: nothing earlier holds it back any more.
    pub(super) fn sent(&mut self, id: &CallId) {
        if let Some(e) = self.calls.get_mut(id) {
            e.awaiting = None;
            e.due = false;
        }
    }

    /// `id` is gone: its conversation too. Whether the store holds a copy of what it kept.
    pub(super) fn forget(&mut self, id: &CallId) -> bool {
        self.drop_session(id);
        self.calls.remove(id).is_some_and(|e| e.in_store)
    }

    /// What the store should hold for `id` (key `call_key`) now that what it keeps changed.
    pub(super) fn store_copy(&mut self, id: &CallId, call_key: &str) -> Keep {
        let Some(e) = self.calls.get_mut(id) else {
            return Keep::Nothing;
        };
        if e.stored.is_none() && e.session.is_none() {
            return match std::mem::take(&mut e.in_store) {
                true => Keep::Delete,
                false => Keep::Nothing,
            };
        }
        e.in_store = true;
        let (base, commit) = e
            .stored
            .as_ref()
            .map(|(_, b, c)| (b.clone(), c.clone()))
            .unwrap_or_default();
        Keep::Put(KeptLeftovers {
            call_key: call_key.to_owned(),
            base,
            commit,
            session: e.session.clone(),
        })
    }

    /// `id` starts from what a coordinator before this one kept of it (a run adopted): as
    /// attempt 0's, so that any attempt here supersedes it.
    pub(super) fn adopt(&mut self, id: &CallId, namespace: &str, k: KeptLeftovers) {
        let e = self.calls.entry(id.clone()).or_default();
        e.in_store = true;
        if !k.commit.is_empty() {
            e.stored = Some((0, k.base, k.commit));
        }
        if let Some(mut s) = k.session {
            s.attempt = 0;
            self.put_session(id, namespace, s);
        }
    }

    /// Keeps the conversation attempt `attempt` of `id` (a call of namespace `namespace`'s)
    /// left, for its next attempt; `false` (and nothing kept) when a newer one is there, or it
    /// is over [`MAX_SESSION_BYTES`].
    pub(super) fn keep_session(
        &mut self,
        id: &CallId,
        namespace: &str,
        attempt: u32,
        mut s: flotilla_proto::v1::Session,
    ) -> bool {
        if s.state.len() > MAX_SESSION_BYTES {
            tracing::info!(run = %id.0, call = id.1, attempt, bytes = s.state.len(), "an interrupted agent's conversation is too big to keep; its next attempt starts over");
            return false;
        }
        s.attempt = attempt;
        let e = self.calls.entry(id.clone()).or_default();
        if e.session.as_ref().is_some_and(|old| old.attempt > attempt) || attempt <= e.fresh_upto {
            return false;
        }
        self.put_session(id, namespace, s);
        true
    }

    /// Holds `s` as `id`'s conversation; past the namespace's share or the whole bound, the
    /// oldest conversations (of that namespace first) go.
    fn put_session(&mut self, id: &CallId, namespace: &str, s: flotilla_proto::v1::Session) {
        self.drop_session(id);
        self.kept += 1;
        let len = s.state.len();
        let e = self.calls.entry(id.clone()).or_default();
        e.session = Some(s);
        e.session_seq = self.kept;
        e.namespace = namespace.to_owned();
        self.session_bytes += len;
        *self
            .namespace_bytes
            .entry(namespace.to_owned())
            .or_default() += len;
        while self.namespace_bytes.get(namespace).copied().unwrap_or(0) > NAMESPACE_SESSIONS_BYTES {
            let Some(oldest) = self.oldest(Some(namespace)) else {
                break;
            };
            self.drop_session(&oldest);
        }
        while self.session_bytes > SESSIONS_BYTES {
            let Some(oldest) = self.oldest(None) else {
                break;
            };
            self.drop_session(&oldest);
        }
    }

    /// The call whose conversation was kept first (of `namespace`, if given).
    fn oldest(&self, namespace: Option<&str>) -> Option<CallId> {
        self.calls
            .iter()
            .filter(|(_, e)| e.session.is_some() && namespace.is_none_or(|n| e.namespace == n))
            .min_by_key(|(_, e)| e.session_seq)
            .map(|(k, _)| k.clone())
    }

    /// The conversation `id`'s next attempt continues, if one is kept.
    pub(super) fn session_of(&self, id: &CallId) -> Option<&flotilla_proto::v1::Session> {
        self.calls.get(id).and_then(|e| e.session.as_ref())
    }

    /// `id`'s next attempt starts over (`flotilla restart --fresh`): no session of attempt
    /// `attempt` or before is kept.
    pub(super) fn start_over(&mut self, id: &CallId, attempt: u32) {
        self.drop_session(id);
        let e = self.calls.entry(id.clone()).or_default();
        e.fresh_upto = e.fresh_upto.max(attempt);
    }

    /// Lets go of `id`'s session.
    fn drop_session(&mut self, id: &CallId) {
        let Some(e) = self.calls.get_mut(id) else {
            return;
        };
        if let Some(s) = e.session.take() {
            let len = s.state.len();
            self.session_bytes -= len;
            if let Some(n) = self.namespace_bytes.get_mut(&e.namespace) {
                *n -= len;
                if *n == 0 {
                    self.namespace_bytes.remove(&e.namespace);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn id(n: u64) -> CallId {
        (Arc::from("wf_x"), n)
    }

    #[test]
    fn a_wait_ends_once_for_its_own_attempt_and_says_whether_the_retry_is_due() {
        let mut l = Leftovers::default();
        l.wait_for(&id(0), 1, false);
        assert!(l.awaits(&id(0), 1) && !l.awaits(&id(0), 2) && l.waiting(&id(0)));
        assert!(
            !l.end_wait(&id(0), 2),
            "another attempt's end changes nothing"
        );
        l.set_due(&id(0));
        assert!(l.end_wait(&id(0), 1), "due while it waited: it goes now");
        assert!(!l.end_wait(&id(0), 1), "and only once");
        assert!(!l.waiting(&id(0)));
        // A stall's wait is due from the start; a new attempt ends every wait.
        l.wait_for(&id(1), 3, true);
        l.sent(&id(1));
        assert!(!l.waiting(&id(1)) && !l.end_wait(&id(1), 3));
    }

    #[test]
    fn the_newest_stored_leftovers_are_where_the_next_attempt_starts() {
        let mut l = Leftovers::default();
        assert_eq!(l.start_of(&id(0)), None);
        assert!(l.stored(&id(0), 2, "b".into(), "p2".into()));
        assert!(
            !l.stored(&id(0), 1, "b".into(), "p1".into()),
            "older ones arrive late"
        );
        assert_eq!(l.start_of(&id(0)), Some(("b", "p2")));
        assert!(l.stored(&id(0), 3, "b".into(), "p3".into()));
        assert_eq!(l.start_of(&id(0)), Some(("b", "p3")));
        l.forget(&id(0));
        assert_eq!(l.start_of(&id(0)), None);
    }

    #[test]
    fn the_store_holds_what_is_kept_and_an_adopted_call_s_first_attempt_supersedes_it() {
        let mut l = Leftovers::default();
        let session = |turns| flotilla_proto::v1::Session {
            state: vec![1; 10],
            turns,
            ..Default::default()
        };
        assert_eq!(l.store_copy(&id(0), "k0"), Keep::Nothing);
        assert!(l.keep_session(&id(0), "n", 1, session(2)));
        let Keep::Put(k) = l.store_copy(&id(0), "k0") else {
            panic!("a conversation kept is put")
        };
        assert_eq!((k.call_key.as_str(), k.commit.as_str()), ("k0", ""));
        // A restart that starts over: the store's copy goes, once.
        l.start_over(&id(0), 1);
        assert_eq!(l.store_copy(&id(0), "k0"), Keep::Delete);
        assert_eq!(l.store_copy(&id(0), "k0"), Keep::Nothing);
        // Adopted from the store: the files and the conversation, which any attempt here
        // replaces.
        let mut kept = k.clone();
        kept.base = "b".into();
        kept.commit = "c".into();
        l.adopt(&id(1), "n", kept);
        assert_eq!(l.start_of(&id(1)), Some(("b", "c")));
        assert_eq!(l.session_of(&id(1)).map(|s| s.turns), Some(2));
        assert!(l.keep_session(&id(1), "n", 1, session(5)));
        assert!(l.stored(&id(1), 1, "b".into(), "c1".into()));
        assert_eq!(l.session_of(&id(1)).map(|s| s.turns), Some(5));
        assert!(l.forget(&id(1)), "its end deletes the store's copy");
        assert!(!l.forget(&id(0)), "nothing of it is in the store");
        assert_eq!(l.session_bytes, 0);
        assert!(l.namespace_bytes.is_empty());
    }

    #[test]
    fn one_namespace_s_conversations_push_out_only_its_own_past_its_share() {
        let mut l = Leftovers::default();
        let big = |fill| flotilla_proto::v1::Session {
            state: vec![fill; MAX_SESSION_BYTES],
            ..Default::default()
        };
        assert!(l.keep_session(&id(0), "quiet", 1, big(0)));
        let share = NAMESPACE_SESSIONS_BYTES / MAX_SESSION_BYTES;
        for n in 1..=(share as u64 + 3) {
            assert!(l.keep_session(&id(n), "loud", 1, big(1)));
        }
        assert!(
            l.session_of(&id(0)).is_some(),
            "another namespace's is kept"
        );
        let loud = (1..=share as u64 + 3)
            .filter(|n| l.session_of(&id(*n)).is_some())
            .collect::<Vec<_>>();
        assert_eq!(
            loud,
            (4..=share as u64 + 3).collect::<Vec<_>>(),
            "its oldest went"
        );
        assert_eq!(l.namespace_bytes["loud"], NAMESPACE_SESSIONS_BYTES);
        assert_eq!(
            l.session_bytes,
            NAMESPACE_SESSIONS_BYTES + MAX_SESSION_BYTES
        );
    }
}
