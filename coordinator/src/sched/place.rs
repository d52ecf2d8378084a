//! Placement: which call goes to which worker slot, and when. Namespaces share by weight and
//! their runs take turns (`fair.rs`); a call passes
//! the budget, its usage-limit gate and its prefix group's stagger, then takes the free slot of
//! a worker that offers its backend and model; its attempt key is written under that worker's
//! lease, and only then is the assignment sent.

use super::*;

impl Dispatcher {
    /// Dispatches as much as slots, limits and holds allow.
    pub(super) fn pump(&mut self) {
        let mut blocked: HashSet<Arc<str>> = HashSet::new();
        let mut turns = 0usize;
        // Agents running per namespace, kept up to date as this round places calls.
        let mut running: HashMap<Arc<str>, usize> = HashMap::new();
        for r in self.runs.values() {
            *running.entry(r.reg.share.namespace.clone()).or_default() += r.running;
        }
        loop {
            if !self.fleet.has_free_slot() {
                return;
            }
            // Next run in turn (of the namespace furthest below its share) that can take a call.
            let runs = &self.runs;
            let picked = self.shares.next(
                |ns| running.get(ns).copied().unwrap_or(0),
                |run| {
                    !blocked.contains(run)
                        && runs.get(run).is_some_and(|r| {
                            !r.paused && !r.queue.is_empty() && r.running < r.reg.concurrency
                        })
                },
            );
            let Some(run) = picked else { return };
            turns += 1;
            if turns > 1_000_000 {
                tracing::error!("dispatcher pump made no progress; stopping this round");
                return;
            }
            let Some(call) = self.next_call(&run) else {
                continue;
            };
            let id: CallId = (run.clone(), call);
            match self.place(&id) {
                Placement::Dispatched => {
                    if let Some(r) = self.runs.get(&run) {
                        *running.entry(r.reg.share.namespace.clone()).or_default() += 1;
                    }
                }
                Placement::Parked | Placement::Gone => {}
                Placement::Unplaceable => self.set_aside(&id),
                Placement::NoWorker => {
                    if let Some(r) = self.runs.get_mut(&run) {
                        r.queue.push_front(call);
                    }
                    blocked.insert(run);
                }
            }
        }
    }

    /// The call of `run` to place next: the first in its queue, unless prefix affinity picks
    /// another ([`affinity::Affinity::pick`]). A call whose worker is busy lets others go first,
    /// [`affinity::PATIENCE`] times at most.
    fn next_call(&mut self, run: &Arc<str>) -> Option<u64> {
        if self.affinity.reorders() {
            let r = self.runs.get(run)?;
            let front_waited = r
                .queue
                .front()
                .and_then(|call| self.calls.get(&(run.clone(), *call)))
                .is_some_and(|c| c.passed_over >= affinity::PATIENCE);
            let pick = (!front_waited)
                .then(|| {
                    let queue = r.queue.iter().map(|call| {
                        self.calls
                            .get(&(run.clone(), *call))
                            .map(|c| (c.ticket.prefix_group, &c.ticket.task))
                    });
                    self.affinity.pick(queue, &self.fleet)
                })
                .flatten();
            if let Some(i) = pick.filter(|&i| i > 0) {
                let passed: Vec<u64> = r.queue.iter().take(i).copied().collect();
                for call in passed {
                    if let Some(c) = self.calls.get_mut(&(run.clone(), call)) {
                        c.passed_over += 1;
                    }
                }
                return self.runs.get_mut(run)?.queue.remove(i);
            }
        }
        self.runs.get_mut(run)?.queue.pop_front()
    }

    /// Puts a call no attached worker can run aside, says why once, and starts its wait.
    pub(super) fn set_aside(&mut self, id: &CallId) {
        let Some(r) = self.runs.get(&id.0) else {
            return;
        };
        let wait = r.reg.worker_wait;
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        c.set(State::Held);
        if self.unplaceable.contains_key(id) {
            return;
        }
        let reason = self.fleet.why_none_offers(&c.ticket.task);
        let attached = self.fleet.ready_count();
        if self.opts.fixed_fleet && attached > 0 {
            self.fail(
                id,
                CallFailure::Terminal,
                format!("{reason}, and no other worker can attach to this process"),
            );
            return;
        }
        let _ = r.reg.events.send(CallEvent::Waiting {
            call: id.1,
            reason: Some(reason.clone()),
        });
        let deadline = Instant::now() + wait;
        self.unplaceable
            .insert(id.clone(), (Instant::now(), reason, deadline));
        self.timers
            .insert_at(Timer::NoWorker(id.0.clone(), id.1), deadline);
    }

    /// A worker became ready: the calls set aside for want of one go back to their queues.
    pub(super) fn requeue_unplaceable(&mut self) {
        let ids: Vec<CallId> = self.unplaceable.keys().cloned().collect();
        for id in ids {
            if let Some(c) = self.calls.get_mut(&id)
                && c.state == State::Held
            {
                c.make_ready();
                if let Some(r) = self.runs.get_mut(&id.0) {
                    r.queue.push_front(id.1);
                }
            }
        }
    }

    /// A call that no attached worker could run has waited its `--worker-wait`: it fails,
    /// unless a worker that can run it attached meanwhile.
    pub(super) fn no_worker_due(&mut self, id: &CallId) {
        // A timer of an earlier wait of the call (set aside, placed, set aside again)
        // is not this wait's.
        let due = self
            .unplaceable
            .get(id)
            .is_some_and(|(_, _, deadline)| Instant::now() >= *deadline);
        if !due {
            return;
        }
        let Some(c) = self.calls.get(id) else {
            self.unplaceable.remove(id);
            return;
        };
        let waiting = matches!(c.state, State::Held | State::Queued);
        // A worker that can run it attached meanwhile (and is merely busy): it waits
        // in its queue like any other call.
        let capable = self.fleet.capable(&c.ticket.task);
        let Some((since, reason, _)) = self.unplaceable.remove(id) else {
            return;
        };
        if capable {
            if let Some(r) = self.runs.get(&id.0) {
                let _ = r.reg.events.send(CallEvent::Waiting {
                    call: id.1,
                    reason: None,
                });
            }
        } else if waiting {
            let waited = human(since.elapsed());
            self.fail(
                id,
                CallFailure::Terminal,
                format!("{reason}; waited {waited} (--worker-wait) and gave up"),
            );
        }
    }

    pub(super) fn place(&mut self, id: &CallId) -> Placement {
        let Some(r) = self.runs.get(&id.0) else {
            return Placement::Gone;
        };
        let (stagger, spent) = (r.reg.stagger, r.budget_spent.clone());
        let Some(c) = self.calls.get(id) else {
            return Placement::Gone;
        };
        if c.state != State::Queued {
            return Placement::Gone;
        }
        // Budget at dispatch (W35); restarts of an admitted call are not new spending.
        if c.attempt == 0
            && let Some(message) = spent
        {
            self.fail(id, CallFailure::Budget, message);
            return Placement::Parked;
        }
        // Usage-limit gate of the backend/model.
        let now = Instant::now();
        let gate = gates::gate_of(&c.ticket.task);
        if let Some(until) = self.gates.closed(&gate, now) {
            if let Some(c) = self.calls.get_mut(id) {
                c.set(State::Held);
            }
            if self.gates.park(&gate, id.clone()) {
                self.timers.insert_at(Timer::Gate(gate), until);
            }
            return Placement::Parked;
        }
        // Prefix stagger.
        let group = c.ticket.prefix_group;
        let turn = self.stagger.turn(&id.0, group, id.1, stagger, now);
        if turn == stagger::Turn::Held {
            if let Some(c) = self.calls.get_mut(id) {
                c.set(State::Held);
            }
            return Placement::Parked;
        }
        // A worker with the backend (and model, when it lists models), a free slot, and room
        // in the provider account it calls through.
        let prompt_tokens = prompt_tokens(&c.ticket.task);
        let (mut full, mut paced): (Option<Arc<str>>, Option<Instant>) = (None, None);
        let prefer = self.affinity.home(group);
        let admission = &mut self.admission;
        let picked = self
            .fleet
            .pick_where(&c.ticket.task, prefer, |account| match account {
                None => true,
                Some(a) => match admission.room(a, prompt_tokens, now) {
                    Ok(()) => true,
                    Err(why) => {
                        if let accounts::Full::Paced(at) = why {
                            paced = Some(paced.map_or(at, |p| p.min(at)));
                        }
                        full.get_or_insert_with(|| a.clone());
                        false
                    }
                },
            });
        let Some(wid) = picked else {
            if let Some(account) = full {
                // A slot is free, but its account has no room: the call waits at the front of
                // its run's queue until an attempt through the account ends or its bucket
                // refills.
                if let Some(c) = self.calls.get_mut(id)
                    && !c.held_by_account
                {
                    c.held_by_account = true;
                    self.admission.held(&account);
                }
                if let Some(at) = paced
                    && self.paced_wake.is_none_or(|w| at < w)
                {
                    self.paced_wake = Some(at);
                    self.timers.insert_at(Timer::Paced, at);
                }
                return Placement::NoWorker;
            }
            return if self.fleet.capable(&c.ticket.task) {
                Placement::NoWorker
            } else {
                Placement::Unplaceable
            };
        };
        if turn == stagger::Turn::Lead {
            self.stagger.lead(&id.0, group, id.1, now);
            self.timers
                .insert_at(Timer::Hold(id.0.clone(), group, id.1), now + stagger);
        }
        self.assign(id, wid);
        Placement::Dispatched
    }
}

pub(super) enum Placement {
    Dispatched,
    /// No attached worker offers its backend and model at all: it is set aside (the rest
    /// of the run goes on) until a worker that does becomes ready, or its wait runs out.
    Unplaceable,
    /// Held, gated or failed: not in the queue any more, nothing to retry now.
    Parked,
    /// No worker can take it now; it goes back to the front.
    NoWorker,
    Gone,
}

/// About how many input tokens a task's prompt is (four bytes a token), for pacing.
pub(super) fn prompt_tokens(task: &v1::TaskSpec) -> u64 {
    (task.prompt.len() / 4) as u64
}
