//! The assignment path, in the order it runs: a placed call takes a slot on its worker and
//! its attempt key is written under the worker's lease ([`Dispatcher::assign`],
//! [`Dispatcher::write_key`]); once the key is written ([`Dispatcher::written`]) its revision
//! is the attempt's fence and the assignment goes out with it
//! ([`Dispatcher::send_assignment`]); a key the store will not write sends the call back or
//! fails it ([`Dispatcher::refused`]).

use std::collections::HashMap;
use std::time::Duration;

use flotilla_proto::v1::{self, CoordinatorMessage, coordinator_message};
use tokio::time::Instant;

use super::handle::{PendingPut, Refusal};
use super::lease_writes::KeyOp;
use super::place::prompt_tokens;
use super::{CallEvent, CallFailure, CallId, Dispatcher, Ended, State, Timer};
use crate::lease::{self, Revision};

impl Dispatcher {
    /// Takes a slot on `wid` for the call's next attempt and writes the attempt key; the
    /// assignment goes out once the key is written ([`Dispatcher::written`]).
    pub(super) fn assign(&mut self, id: &CallId, wid: u64) {
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        let Some((lease, name)) = self
            .fleet
            .worker(wid)
            .and_then(|w| Some((w.lease?, w.name.clone())))
        else {
            return;
        };
        c.attempt += 1;
        self.assigned += 1;
        // The first worker to serve a prefix group through a local prefix cache keeps it
        // (unless it is gone).
        self.affinity.served(
            c.ticket.prefix_group,
            wid,
            &c.ticket.task.backend,
            &self.fleet,
        );
        if self.unplaceable.remove(id).is_some()
            && let Some(r) = self.runs.get(&id.0)
        {
            let _ = r.reg.events.send(CallEvent::Waiting {
                call: id.1,
                reason: None,
            });
        }
        c.assigned_at = Instant::now();
        crate::counters::DISPATCH_LATENCY.observe(c.assigned_at - c.ready_at);
        c.set(State::Running);
        c.worker = Some(wid);
        c.fence.unwritten();
        c.captured = None;
        // A worker makes a workspace first (a checkout of the run's source, a worktree):
        // the stall timer is held from the start, until it says the agent started.
        let task = &c.ticket.task;
        c.watchdog
            .hold(!task.source_repo.is_empty() || task.isolation == "worktree");
        self.fleet.take_slot(
            wid,
            (id.0.clone(), id.1, c.attempt),
            &c.ticket.key,
            0,
            Duration::ZERO,
        );
        c.held_by_account = false;
        c.admitted = self
            .fleet
            .account_of(wid, &c.ticket.task.backend)
            .and_then(|a| {
                self.admission
                    .start(&a, prompt_tokens(&c.ticket.task), Instant::now())
            });
        let op = KeyOp::attempt(id, wid, &name, c.attempt, lease);
        if let Some(r) = self.runs.get_mut(&id.0) {
            r.running += 1;
        }
        self.write_key(op);
    }

    /// Writes an attempt key: at once when the store can (in memory), else through the key
    /// writer. A put's assignment goes out once its key is written.
    pub(super) fn write_key(&mut self, op: KeyOp) {
        let Some(res) = self.leases.write_batch_now(&[op.batch_op()]) else {
            self.fleet.queue_key(op);
            return;
        };
        let Some(put) = op.into_put() else { return };
        match res {
            Ok(revision) => self.written(vec![put], revision),
            Err(lease::Error::Refused(e)) => self.refused(vec![put], Refusal::Refused(e)),
            Err(_) => self.refused(vec![put], Refusal::LeaseGone),
        }
    }

    /// Attempt keys written at `revision`: each current attempt's assignment goes out with it
    /// as its fence; one cancelled or lost meanwhile gives its slot back.
    pub(super) fn written(&mut self, puts: Vec<PendingPut>, revision: Revision) {
        for p in puts {
            let id: CallId = (p.run.clone(), p.call);
            let state = self
                .calls
                .get(&id)
                .map(|c| (c.state, c.attempt, c.worker, c.fence.written()));
            match state {
                Some((State::Running, attempt, Some(w), None))
                    if attempt == p.attempt && w == p.worker =>
                {
                    self.send_assignment(&id, revision);
                }
                other => {
                    // Cancelled or lost before it was sent: give the slot back, and take the
                    // key away unless a newer attempt's key (written after it) replaces it.
                    self.fleet.free_slot(p.worker, &p.run, p.call, p.attempt);
                    if !matches!(other, Some((State::Running, ..))) {
                        self.write_key(KeyOp::Delete {
                            key: lease::keys::attempt(&p.run, p.call),
                        });
                    }
                }
            }
        }
    }

    /// Sends the assignment of a call whose attempt key is written at `fence`.
    pub(super) fn send_assignment(&mut self, id: &CallId, fence: Revision) {
        let Some(stall) = self.runs.get(&id.0).map(|r| r.reg.stall_timeout) else {
            return;
        };
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        let Some(wid) = c.worker else { return };
        // What comes back for this attempt must carry this fence (an adopted attempt's own
        // carries the one it was started with, kept since it was claimed).
        if !c.fence.is_adopted() {
            self.fleet
                .sent(wid, &(id.0.clone(), id.1, c.attempt), fence);
        }
        let Some(w) = self.fleet.worker(wid) else {
            return;
        };
        c.fence.written_at(fence);

        // A new attempt: no earlier one holds it back any more.
        self.leftovers.sent(id);
        c.watchdog.arm(
            &mut self.timers,
            Timer::Stall(id.0.clone(), id.1, c.attempt),
            stall,
        );
        c.attempt_span = super::spans::attempt_span(&c.ticket, id, c.attempt, &w.name);
        let mut task = c.ticket.task.clone();
        if let Some((base, partial)) = self.leftovers.start_of(id) {
            task.source_commit = base.to_owned();
            task.source_partial = partial.to_owned();
        } else if let Some(head) = self.runs.get(&id.0).and_then(|r| r.reg.head.as_ref()) {
            task.source_commit = head.borrow().clone();
        }
        c.sent_base = task.source_commit.clone();
        task.session = self.leftovers.session_of(id).cloned();
        let assignment = v1::Assignment {
            run_id: id.0.to_string(),
            call: id.1,
            attempt: c.attempt,
            call_key: c.ticket.key.clone(),
            task: Some(task),
            trace_context: trace_context(&c.attempt_span),
            fence,
            stall_timeout_ms: u64::try_from(stall.as_millis()).unwrap_or(u64::MAX),
        };
        let attempt = c.attempt;
        // A worker cut off right now misses this; it does not list the attempt when it comes
        // back, so the attempt is restarted then (or when its lease lapses). An adopted
        // attempt runs already: nothing to send.
        if let (false, Some(tx)) = (c.fence.is_adopted(), &w.tx) {
            let _ = tx.send(CoordinatorMessage {
                msg: Some(coordinator_message::Msg::Assign(assignment)),
            });
        }
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r.reg.events.send(CallEvent::Started {
                call: id.1,
                attempt,
                worker: w.name.clone(),
            });
        }
    }

    /// Attempt keys the store would not write. Because the worker's lease is gone: the calls
    /// go back to the front of their queues (not counted as attempts; nothing ran). Refused
    /// by the store itself: the calls fail with its reason (it would refuse them again).
    pub(super) fn refused(&mut self, puts: Vec<PendingPut>, why: Refusal) {
        for p in puts {
            let id: CallId = (p.run.clone(), p.call);
            self.fleet.free_slot(p.worker, &p.run, p.call, p.attempt);
            if why == Refusal::LeaseGone
                && let Some(w) = self.fleet.worker_mut(p.worker)
                && w.lease == Some(p.lease)
            {
                w.lease = None;
            }
            let current = self.calls.get(&id).is_some_and(|c| {
                c.state == State::Running
                    && c.attempt == p.attempt
                    && c.worker == Some(p.worker)
                    && !c.fence.is_written()
            });
            if !current {
                continue;
            }
            self.leave_running(&id, Ended::Unstarted);
            match &why {
                Refusal::LeaseGone => {
                    if let Some(r) = self.runs.get_mut(&id.0) {
                        r.queue.push_front(id.1);
                    }
                }
                Refusal::Refused(e) => self.fail(
                    &id,
                    CallFailure::Terminal,
                    format!("the lease store refused this agent's attempt key ({e}); the call cannot be tracked, so it was not started"),
                ),
            }
        }
    }
}

/// The W3C trace context of `span`, for an assignment (empty when nothing is traced).
fn trace_context(span: &tracing::Span) -> HashMap<String, String> {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let mut out = HashMap::new();
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut out));
    out
}
