//! What happens to calls when workers come and go. The workers themselves — their links,
//! slots, leases and names — are the [`Fleet`](super::fleet::Fleet)'s; this file moves the
//! calls those events touch (takeovers, lapses, orphaned attempts). Attempt keys written or
//! refused are the assignment path's (`assign.rs`).
//!
//! - A link attaches and says `Hello`. The worker is known by its name (a remote worker's
//!   certificate CN). A name seen before, whose lease has not lapsed, is the same worker coming
//!   back: the new link takes over its state, and the attempts it lists in `Hello` carry on.
//!   While the name's link is up, only the same process (`Hello.incarnation`) may take its
//!   place; another process claiming the name is refused, naming both peers, and the attached
//!   one keeps serving.
//! - Each named worker has a lease task ([`worker_lease`]) that grants its lease, writes its
//!   registration key under it and renews it while the worker is attached. While the worker is
//!   cut off, nobody renews it.
//! - Every attempt is a key under its worker's lease, written by the key writer
//!   ([`spawn_key_writer`]) in batches, in order, before the assignment is sent; the batch's
//!   revision is the attempt's fence.
//! - A watch on attempt keys sees them vanish when a lease lapses; a vanished key of a current
//!   attempt restarts its call. A watch on registrations retires workers that never came back.

use std::collections::HashSet;
use std::sync::Arc;

use flotilla_proto::link::CoordinatorEnd;
use flotilla_proto::v1::{self, CoordinatorMessage, coordinator_message};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::lease_writes::{KeyOp, LeaseCtl, worker_lease};
use super::{CallEvent, CallId, Dispatcher, Ended, Retry, State, Timer};
use crate::lease::{self, LeaseId, Revision, WatchEvent};

impl Dispatcher {
    pub(super) fn attach(
        &mut self,
        end: CoordinatorEnd,
        peer: Arc<str>,
        verdict: Option<tokio::sync::oneshot::Sender<Result<(), super::NameTaken>>>,
    ) {
        self.fleet.attach(end, peer, verdict, self.tx.clone());
    }

    pub(super) fn hello(&mut self, link_id: u64, h: v1::Hello) {
        if self.opts.admission && self.fleet.worker(link_id).is_some() {
            for a in &h.accounts {
                self.admission
                    .declare(&a.id, a.itpm, a.max_concurrent, Instant::now());
            }
        }
        let Some(w) = self.fleet.worker_mut(link_id) else {
            return;
        };
        if w.named {
            tracing::warn!(worker = %w.name, "a second Hello on one link; ignored");
            return;
        }
        if !flotilla_proto::protocol_compatible(&h.protocol_version) {
            tracing::warn!(worker = %h.name, version = %h.protocol_version,
                "refusing a worker that speaks protocol {} (this coordinator speaks {})",
                h.protocol_version, flotilla_proto::PROTOCOL_VERSION);
            w.link_alive.cancel();
            self.fleet.forget(link_id);
            return;
        }
        let name: Arc<str> = if h.name.is_empty() {
            w.name.clone()
        } else {
            Arc::from(h.name.as_str())
        };
        let held: HashSet<(Arc<str>, u64, u32)> = h
            .held
            .iter()
            .map(|a| (Arc::from(a.run_id.as_str()), a.call, a.attempt))
            .collect();
        let wid = match self.fleet.named(&name) {
            Some(old) if old != link_id && self.fleet.worker(old).is_some() => {
                if let Some(taken) = self.fleet.clash(old, link_id, &h.incarnation) {
                    // Two processes with one name would take the name from each other on
                    // every reconnect, for ever: the one attached keeps it.
                    tracing::warn!(
                        worker = %name,
                        attached_from = %taken.attached_from,
                        refused_from = %taken.refused_from,
                        "refused a second worker named {name:?}: the one attached from {} keeps serving; the one from {} is another process with the same certificate and name",
                        taken.attached_from,
                        taken.refused_from,
                    );
                    self.fleet.refuse(link_id, taken);
                    return;
                }
                self.adopt(old, link_id, &h, &held)
            }
            _ => {
                self.fleet.register(link_id, name.clone(), &h);
                let w = self.fleet.worker_mut(link_id).expect("checked above");
                let info = serde_json::json!({
                    "slots": h.slots,
                    "backends": h.backends,
                    "models": h.models,
                    "labels": h.labels,
                })
                .to_string()
                .into_bytes();
                let (attached, attached_rx) = watch::channel(true);
                let stop = CancellationToken::new();
                self.tasks.spawn(worker_lease(
                    self.leases.clone(),
                    self.opts.worker_ttl,
                    name.clone(),
                    info,
                    attached_rx,
                    stop.clone(),
                    self.tx.clone(),
                ));
                w.ctl = Some(Arc::new(LeaseCtl { attached, stop }));
                // Nothing it holds was assigned here; a run taken over from a coordinator that
                // went away may claim some (same run, call and key). The rest are cancelled
                // after one TTL.
                w.orphans = super::fleet::Orphans::of(&h.held, h.slots);
                if !w.orphans.is_empty() {
                    let at = Instant::now() + self.opts.worker_ttl;
                    self.timers.insert_at(Timer::Orphans(link_id, link_id), at);
                }
                link_id
            }
        };
        self.welcome(wid);
    }

    /// A worker known by name comes back on a new link (`link_id`): the link takes over the
    /// worker's state, and its attempts are reconciled with what it holds.
    fn adopt(
        &mut self,
        wid: u64,
        link_id: u64,
        h: &v1::Hello,
        held: &HashSet<(Arc<str>, u64, u32)>,
    ) -> u64 {
        if !self.fleet.take_over(wid, link_id, h) {
            return wid;
        }
        let Some(w) = self.fleet.worker(wid) else {
            return wid;
        };
        // Slots of attempts it no longer holds come back, and the current ones among them
        // restart. An assignment whose key is still being written was never sent; it keeps
        // its slot and goes out on this link.
        let gone: Vec<(Arc<str>, u64, u32)> = w
            .running
            .keys()
            .filter(|a| !held.contains(*a))
            .filter(|(run, call, attempt)| {
                !self.calls.get(&(run.clone(), *call)).is_some_and(|c| {
                    c.state == State::Running
                        && c.attempt == *attempt
                        && c.worker == Some(wid)
                        && !c.fence.is_written()
                })
            })
            .cloned()
            .collect();
        let name = w.name.clone();
        for (run, call, attempt) in gone {
            self.lose_attempt(
                wid,
                &(run, call),
                attempt,
                format!("worker {name} came back without attempt {attempt}"),
            );
        }
        // Attempts it holds that are not current here: stop them.
        for a in &h.held {
            let current = self
                .calls
                .get(&(Arc::from(a.run_id.as_str()), a.call))
                .is_some_and(|c| {
                    c.state == State::Running
                        && c.attempt == a.attempt
                        && c.worker == Some(wid)
                        && c.fence.written() == Some(a.fence)
                });
            if !current {
                self.cancel_stray(wid, a, "no longer current");
            }
        }
        wid
    }

    fn cancel_stray(&self, wid: u64, a: &v1::AttemptRef, reason: &str) {
        self.fleet.cancel(wid, &a.run_id, a.call, a.attempt, reason);
    }

    /// Cancels the held attempts no run claimed.
    pub(super) fn drop_orphans(&mut self, wid: u64, link: u64) {
        let Some(w) = self.fleet.worker_mut(wid) else {
            return;
        };
        if w.link != link {
            return;
        }
        let left = w.orphans.drain();
        for ((run, call, attempt), o) in w.orphan_outcomes.drain() {
            tracing::info!(run = %run, call, attempt, fence = o.fence, "dropping the outcome of an attempt that is no longer current (fenced)");
        }
        if !left.is_empty() {
            tracing::info!(worker = %w.name, attempts = left.len(), "cancelling held attempts no run claimed");
        }
        for a in &left {
            self.cancel_stray(wid, a, "not claimed by any run here");
        }
    }

    /// A call was submitted: a ready worker that holds an attempt of it (same key) from a
    /// coordinator that went away carries on with it instead of a new attempt.
    pub(super) fn claim_orphans(&mut self, id: &CallId) {
        // Only a call waiting for a worker: one running elsewhere has moved on.
        let Some(key) = self
            .calls
            .get(id)
            .filter(|c| c.state == State::Queued)
            .map(|c| c.ticket.key.clone())
        else {
            return;
        };
        let found = self
            .fleet
            .all_mut()
            .filter(|(_, w)| w.ready())
            .find_map(|(wid, w)| w.orphans.take(id, &key).map(|a| (*wid, a)));
        if let Some((wid, a)) = found {
            self.adopt_attempt(id, wid, &a);
        }
    }

    /// Takes over a running attempt: it gets a key under its worker's lease (so liveness and
    /// fencing work as for any attempt), and its outcome is accepted with the fence it was
    /// started with.
    fn adopt_attempt(&mut self, id: &CallId, wid: u64, a: &v1::AttemptRef) {
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        if c.state != State::Queued {
            return;
        }
        let Some(w) = self.fleet.worker(wid) else {
            return;
        };
        let Some(lease) = w.lease else {
            return;
        };
        let name = w.name.clone();
        c.attempt = c.attempt.max(a.attempt);
        c.set(State::Running);
        c.worker = Some(wid);
        c.fence.adopt(a.fence);
        c.captured = None;
        c.watchdog.hold(false);
        let attempt = c.attempt;
        // It started before this coordinator knew of it: at most its timeout ago.
        let ran_before = super::usage::adopted_ran_before(&c.ticket.task);
        self.fleet.take_slot(
            wid,
            (id.0.clone(), id.1, attempt),
            &c.ticket.key,
            a.fence,
            ran_before,
        );
        tracing::info!(run = %id.0, call = id.1, attempt, worker = %name, "re-attached an attempt that outlived its coordinator");
        let finished = self
            .fleet
            .worker_mut(wid)
            .and_then(|w| w.orphan_outcomes.remove(&(id.0.clone(), id.1, attempt)));
        if let Some(o) = finished {
            // It ended while nobody owned it: take its outcome now.
            if let Some(r) = self.runs.get_mut(&id.0) {
                r.running += 1;
                r.queue.retain(|call| *call != id.1);
                let _ = r.reg.events.send(CallEvent::Started {
                    call: id.1,
                    attempt,
                    worker: name,
                });
            }
            self.outcome(wid, o);
            return;
        }
        let op = KeyOp::attempt(id, wid, &name, attempt, lease);
        if let Some(r) = self.runs.get_mut(&id.0) {
            r.running += 1;
            r.queue.retain(|call| *call != id.1);
        }
        self.write_key(op);
    }

    /// Sends `Welcome` once the worker is named and has a lease.
    fn welcome(&mut self, wid: u64) {
        let ttl = self.opts.worker_ttl;
        let Some(w) = self.fleet.worker_mut(wid) else {
            return;
        };
        if w.welcomed || !w.ready() {
            return;
        }
        w.welcomed = true;
        // Calls already submitted that this worker's held attempts belong to.
        let claims: Vec<CallId> = w.orphans.calls();
        if let Some(tx) = &w.tx {
            let _ = tx.send(CoordinatorMessage {
                msg: Some(coordinator_message::Msg::Welcome(v1::Welcome {
                    protocol_version: flotilla_proto::PROTOCOL_VERSION.to_owned(),
                    worker_id: w.name.to_string(),
                    coordinator: "flotilla".into(),
                    lease_ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
                })),
            });
        }
        tracing::debug!(worker = %w.name, slots = w.slots, "worker ready");
        for id in claims {
            self.claim_orphans(&id);
        }
        // It may offer what calls set aside were waiting for.
        self.requeue_unplaceable();
    }

    pub(super) fn lease_granted(&mut self, name: &Arc<str>, lease: LeaseId, revision: Revision) {
        if let Some(wid) = self.fleet.lease_granted(name, lease, revision) {
            self.welcome(wid);
        }
    }

    pub(super) fn link_closed(&mut self, wid: u64, link: u64) {
        let wid = self.fleet.release_link(link).unwrap_or(wid);
        if self.fleet.cut_off(wid, link) {
            let at = Instant::now() + self.opts.worker_ttl * 3;
            self.timers.insert_at(Timer::Lapse(wid, link), at);
        }
    }

    /// A cut-off worker that was not seen lapsing through the watch: after three TTLs without
    /// renewal its lease is gone for sure.
    pub(super) fn lapse_backstop(&mut self, wid: u64, link: u64) {
        let lapsed = self
            .fleet
            .worker(wid)
            .is_some_and(|w| w.link == link && w.tx.is_none());
        if lapsed {
            self.worker_lapsed(wid);
        }
    }

    pub(super) fn watched(&mut self, ev: WatchEvent) {
        let WatchEvent::Delete { key, revision } = ev else {
            return;
        };
        if let Some((run, call)) = lease::keys::parse_attempt(&key) {
            let id: CallId = (Arc::from(run), call);
            let lapsed = self.calls.get(&id).and_then(|c| {
                let current =
                    c.state == State::Running && c.fence.written().is_some_and(|f| revision > f);
                current.then_some((c.worker, c.attempt))
            });
            if let Some((Some(wid), attempt)) = lapsed {
                let name = self
                    .fleet
                    .worker(wid)
                    .map_or_else(|| "?".to_owned(), |w| w.name.to_string());
                tracing::info!(run = %id.0, call, attempt, worker = %name, "attempt key vanished (the worker's lease lapsed); restarting the call");
                // A worker still attached (its lease lapsed while the store was out of reach)
                // is told to stop; its slot comes back with that attempt's outcome.
                let attached = self.fleet.worker(wid).is_some_and(|w| w.tx.is_some());
                let message = format!("worker {name}'s lease lapsed");
                if attached {
                    self.send_cancel(&id, "its lease lapsed; restarted elsewhere");
                    self.leave_running(&id, Ended::Lost);
                    self.retry_or_fail(&id, Retry::Transient { message });
                } else {
                    self.lose_attempt(wid, &id, attempt, message);
                }
            }
        } else if let Some(name) = lease::keys::parse_worker(&key) {
            let Some(wid) = self.fleet.named(name) else {
                return;
            };
            let lapsed = self
                .fleet
                .worker(wid)
                .is_some_and(|w| w.tx.is_none() && revision > w.reg_revision);
            if lapsed {
                self.worker_lapsed(wid);
            }
        }
    }

    /// A cut-off worker's lease is gone: forget it and restart whatever it still had.
    fn worker_lapsed(&mut self, wid: u64) {
        let Some((name, running)) = self.fleet.retire(wid) else {
            return;
        };
        tracing::info!(worker = %name, attempts = running.len(), "worker lease lapsed; restarting its attempts elsewhere");
        for (run, call, attempt) in running {
            self.lose_attempt(
                wid,
                &(run, call),
                attempt,
                format!("worker {name} went away"),
            );
        }
    }

    /// Gives back the slot of `attempt` on `wid` and, if it is the call's current attempt,
    /// restarts the call (counted as a failed attempt).
    fn lose_attempt(&mut self, wid: u64, id: &CallId, attempt: u32, message: String) {
        self.fleet.free_slot(wid, &id.0, id.1, attempt);
        let current = self.calls.get(id).is_some_and(|c| {
            c.state == State::Running && c.attempt == attempt && c.worker == Some(wid)
        });
        if current {
            self.leave_running(id, Ended::Lost);
            self.retry_or_fail(id, Retry::Transient { message });
        }
    }
}
