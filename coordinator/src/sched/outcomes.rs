//! What an attempt's progress and outcome do to its call: only the current attempt's outcome,
//! with its fence, is accepted; a failure is judged ([`retry::verdict`]) and the call fails,
//! waits for a usage limit, or goes again; what an unfinished attempt left is kept for the next
//! one (W58).
//!
//! A worker speaks only for its own attempts: an outcome counts only if it names exactly the
//! run, call, attempt, call key and fence the worker was given (or, for an attempt it held from
//! a coordinator that went away, listed in its `Hello`); its usage is held to what one attempt
//! can use ([`super::usage`]) before the run counts it, once. Anything else is dropped, logged
//! and never counted, and the link goes on.

use super::fleet::key_hash;
use super::*;

/// Why a message for attempt `.1` of call `.0` was not the worker's to send.
struct NotGiven<'a>(&'a CallId, u32);

impl std::fmt::Display for NotGiven<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let NotGiven((run, call), attempt) = self;
        write!(
            f,
            "attempt {attempt} of call {call} of run {run} is not one it was given (with that fence and call key), or it has ended"
        )
    }
}

impl Dispatcher {
    pub(super) fn progress(&mut self, worker: u64, p: v1::Progress) {
        let id: CallId = (Arc::from(p.run_id.as_str()), p.call);
        let given = self.fleet.given(worker, &(id.0.clone(), id.1, p.attempt));
        let Some(c) = self.calls.get_mut(&id) else {
            if given.is_none() {
                self.fleet
                    .stray(worker, "progress", NotGiven(&id, p.attempt));
            }
            return;
        };
        let Some(given) = given else {
            self.fleet
                .stray(worker, "progress", NotGiven(&id, p.attempt));
            return;
        };
        if c.state != State::Running
            || c.attempt != p.attempt
            || c.worker != Some(worker)
            || !c.fence.is_written()
        {
            return;
        }
        let output_tokens = p
            .output_tokens
            .min(self.opts.usage.output_ceiling(self.fleet.ran(&given)));
        let kind = ProgressKind::try_from(p.kind).unwrap_or(ProgressKind::Unspecified);
        if kind == ProgressKind::SessionCheckpoint {
            // Kept for the next attempt should this one be lost with its worker (in memory: a
            // running attempt goes on across a coordinator's failover). It says only what the
            // agent did before: not heard as progress.
            if let Some(s) = p.session {
                tracing::debug!(run = %id.0, call = id.1, attempt = p.attempt, turns = s.turns, "a checkpoint of a running agent's conversation");
                let namespace = c.ticket.task.namespace.clone();
                self.leftovers.keep_session(&id, &namespace, p.attempt, s);
            }
            return;
        }
        // A tool call in flight, or the workspace being made, holds the stall timer.
        c.watchdog.heard(kind);
        if kind == ProgressKind::StructuredCaptured {
            c.captured = Some(p.detail);
        }
        let began = matches!(
            kind,
            ProgressKind::ResponseStarted | ProgressKind::Output | ProgressKind::StructuredCaptured
        );
        let group = c.ticket.prefix_group;
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r.reg.events.send(CallEvent::Progress {
                call: id.1,
                attempt: p.attempt,
                output_tokens,
            });
        }
        if began {
            self.open_prefix(&id.0, group, Some(id.1), true);
        }
    }

    /// Transcript events of one attempt go to its run if the attempt is the worker's: one it
    /// was given here, or one it listed as still held from a coordinator that went away.
    pub(super) fn transcript(&mut self, worker: u64, t: v1::TranscriptChunk) {
        let id: CallId = (Arc::from(t.run_id.as_str()), t.call);
        let given = self
            .fleet
            .given(worker, &(id.0.clone(), id.1, t.attempt))
            .is_some();
        let held = self
            .fleet
            .worker(worker)
            .is_some_and(|w| w.orphans.lists(&id, t.attempt));
        if !given && !held {
            self.fleet
                .stray(worker, "transcript events", NotGiven(&id, t.attempt));
            return;
        }
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r.reg.events.send(CallEvent::Transcript {
                call: t.call,
                attempt: t.attempt,
                events: t.events,
            });
        }
    }

    pub(super) fn outcome(&mut self, worker: u64, o: v1::Outcome) {
        let id: CallId = (Arc::from(o.run_id.as_str()), o.call);
        // Exactly what the worker was given for this attempt: its call key and its fence.
        let given = self
            .fleet
            .given(worker, &(id.0.clone(), id.1, o.attempt))
            .filter(|g| g.fence != 0 && g.fence == o.fence && g.key == key_hash(&o.call_key));
        let Some(given) = given else {
            self.not_given(worker, &id, o);
            return;
        };
        self.fleet.free_slot(worker, &id.0, id.1, o.attempt);
        // Counted once: the slot is gone, so the same outcome sent again is not this worker's
        // any more.
        let usage = self.bounded(worker, &id, o.attempt, o.usage.unwrap_or_default(), given);
        let input_tokens = usage.input_tokens;
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r.reg.events.send(CallEvent::Usage {
                call: o.call,
                attempt: o.attempt,
                usage,
            });
        }
        let current = self.calls.get(&id).is_some_and(|c| {
            c.state == State::Running
                && c.attempt == o.attempt
                && c.worker == Some(worker)
                && c.fence.accepts(o.fence)
        });
        let awaited = self.leftovers.awaits(&id, o.attempt)
            && self
                .calls
                .get(&id)
                .is_some_and(|c| c.worker == Some(worker));
        if !current && awaited {
            // The interrupted attempt of a restarted call: what it left is all we want.
            let (partial, session) = match o.result {
                Some(outcome::Result::Failure(f)) => (f.partial, f.session),
                _ => (None, None),
            };
            if let Some(s) = session {
                self.keep_session(&id, o.attempt, s);
            }
            let storing = partial.is_some_and(|p| self.keep_partial(&id, o.attempt, p));
            if !storing {
                self.salvaged(&id, o.attempt);
            }
            return;
        }
        if !current {
            tracing::info!(run = %id.0, call = id.1, attempt = o.attempt, fence = o.fence, "dropping the outcome of an attempt that is no longer current (fenced)");
            return;
        }
        if let Some(c) = self.calls.get(&id) {
            super::spans::record_outcome(&c.attempt_span, &c.ticket.task, &usage, &o);
        }
        // The account's verdict on the attempt, before the call moves on.
        let end = match &o.result {
            Some(outcome::Result::Completed(_)) => accounts::End::Succeeded { input_tokens },
            Some(outcome::Result::Failure(f)) if f.kind == FailureKind::Throttled as i32 => {
                accounts::End::Throttled
            }
            _ => accounts::End::Other { input_tokens },
        };
        let account = self.release_admission(&id, end);
        self.leave_running(&id, Ended::of(o.result.as_ref()));
        match o.result {
            Some(outcome::Result::Completed(done)) => {
                self.finish(&id, CallResult::Completed(done));
            }
            Some(outcome::Result::Failure(mut f)) => {
                let kind = FailureKind::try_from(f.kind).unwrap_or(FailureKind::Terminal);
                if retry::goes_again(kind)
                    && let Some(s) = f.session.take()
                {
                    self.keep_session(&id, o.attempt, s);
                }
                if retry::goes_again(kind)
                    && let Some(p) = f.partial.take()
                    && self.keep_partial(&id, o.attempt, p)
                {
                    // The retry waits until it is stored.
                    self.leftovers.wait_for(&id, o.attempt, false);
                }
                let limit_waits = match (kind, self.calls.get_mut(&id)) {
                    (FailureKind::RateLimited | FailureKind::Throttled, Some(c)) => {
                        c.limit_waits += 1;
                        c.limit_waits
                    }
                    _ => 0,
                };
                let message = f.message.clone();
                match retry::verdict(kind, f.message, f.retry_after_ms, limit_waits) {
                    retry::Verdict::Fail(failure, message) => self.fail(&id, failure, message),
                    retry::Verdict::WaitLimit(wait) => self.wait_rate_limit(&id, wait, o.attempt),
                    retry::Verdict::Throttle(wait) => {
                        let account =
                            account.map_or_else(|| "its provider".into(), |a| a.to_string());
                        self.wait_throttled(&id, wait, o.attempt, account, message);
                    }
                    retry::Verdict::Retry(r) => self.retry_or_fail(&id, r),
                }
            }
            None => self.retry_or_fail(
                &id,
                Retry::Transient {
                    message: "the worker sent an outcome without a result".into(),
                },
            ),
        }
    }

    /// An outcome that names no attempt the worker was given here. One it listed in its
    /// `Hello` as held from a coordinator that went away (same attempt, fence and key) is kept
    /// for the run that takes the call over; anything else is not its to send.
    fn not_given(&mut self, worker: u64, id: &CallId, o: v1::Outcome) {
        let claimable = self.calls.get(id).is_none_or(|c| c.state == State::Queued);
        let Some(w) = self.fleet.worker_mut(worker) else {
            return;
        };
        if w.orphans.ended(id, o.attempt, o.fence, &o.call_key) {
            if claimable {
                w.orphan_outcomes.insert((id.0.clone(), id.1, o.attempt), o);
                self.claim_orphans(id);
            } else {
                tracing::info!(run = %id.0, call = id.1, attempt = o.attempt, fence = o.fence, "dropping the outcome of an attempt that is no longer current (fenced)");
            }
            return;
        }
        self.fleet
            .stray(worker, "an outcome", NotGiven(id, o.attempt));
    }

    /// `usage` as attempt `attempt` of call `id` on `worker` (given `given`) reported it, held
    /// to what one attempt can have used in the time it ran; a report above that is clipped and
    /// said, naming the worker.
    fn bounded(
        &self,
        worker: u64,
        id: &CallId,
        attempt: u32,
        usage: v1::Usage,
        given: super::fleet::Given,
    ) -> v1::Usage {
        let ran = self.fleet.ran(&given);
        let Some(clipped) = self.opts.usage.clip(&usage, ran) else {
            return usage;
        };
        crate::counters::inc(&crate::counters::USAGE_CLIPPED);
        if let Some(w) = self.fleet.worker(worker) {
            w.clipped.say(|held| {
                tracing::warn!(
                    worker = %w.name,
                    peer = %w.peer,
                    run = %id.0,
                    call = id.1,
                    attempt,
                    ran = ?ran,
                    reported = ?usage,
                    counted = ?clipped,
                    suppressed = held,
                    "clipped an implausible usage report from worker {}: more than one attempt can use in {}; only the clipped figures are counted ([attempt_usage] in the coordinator's config sets the ceilings)",
                    w.name,
                    human(ran),
                );
            });
        }
        clipped
    }

    /// The call's current attempt gives back what it took of its account; which account.
    pub(super) fn release_admission(
        &mut self,
        id: &CallId,
        end: accounts::End,
    ) -> Option<Arc<str>> {
        let a = self.calls.get_mut(id)?.admitted.take()?;
        self.admission.ended(&a, end, Instant::now());
        Some(a.account)
    }

    /// Bookkeeping when a call's current attempt stops running, `why` as the attempt counters
    /// have it.
    pub(super) fn leave_running(&mut self, id: &CallId, why: Ended) {
        // Whatever ended it (a stall, a cancel, a lost worker) says nothing of the account.
        self.release_admission(id, accounts::End::Other { input_tokens: 0 });
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        if c.state != State::Running {
            return;
        }
        c.watchdog.disarm(&mut self.timers);
        let (outcome, class) = why.labels();
        crate::counters::attempt_ended(
            outcome,
            class,
            c.assigned_at.elapsed(),
            super::spans::operation(&c.ticket.task, ""),
        );
        let sent = c.fence.end();
        c.make_ready();
        let group = c.ticket.prefix_group;
        if let Some(r) = self.runs.get_mut(&id.0) {
            r.running = r.running.saturating_sub(1);
        }
        if sent {
            self.write_key(KeyOp::Delete {
                key: lease::keys::attempt(&id.0, id.1),
            });
        }
        // A leader that ends without its response beginning hands the lead on.
        let held = self.stagger.ended(&id.0, group, id.1, Instant::now());
        self.requeue_held(&id.0, held);
    }

    pub(super) fn finish(&mut self, id: &CallId, result: CallResult) {
        let in_store = self.leftovers.forget(id);
        if let Some(mut c) = self.calls.remove(id) {
            if let (true, Some(w)) = (in_store, &self.kept) {
                w.delete(&id.0, &c.ticket.key);
            }
            c.attempt_span
                .record("flotilla.outcome", result.span_outcome());
            c.watchdog.disarm(&mut self.timers);
        }
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r
                .reg
                .events
                .send(CallEvent::Finished { call: id.1, result });
        }
    }

    pub(super) fn fail(&mut self, id: &CallId, failure: CallFailure, message: String) {
        self.finish(id, CallResult::Failed { failure, message });
    }

    pub(super) fn wait_rate_limit(&mut self, id: &CallId, wait: Duration, attempt: u32) {
        let until = Instant::now() + wait;
        if let Some(c) = self.calls.get(id) {
            self.gates.close(gates::gate_of(&c.ticket.task), until);
        }
        self.wait_until(id, until, attempt, Retry::RateLimited { wait });
    }

    /// The call waits until `until` and then goes again (not counted as an attempt); the run
    /// hears why.
    fn wait_until(&mut self, id: &CallId, until: Instant, attempt: u32, retry: Retry) {
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        c.set(State::Waiting);
        let counted = c.counted;
        self.timers
            .insert_at(Timer::Retry(id.0.clone(), id.1), until);
        if let Some(r) = self.runs.get(&id.0) {
            let _ = r.reg.events.send(CallEvent::Retrying {
                call: id.1,
                attempt,
                retry,
                counted,
            });
        }
    }

    /// The provider throttled the call's attempt: it waits `wait` and goes again, outside
    /// the account's window; not counted as an attempt, and nobody else is held.
    pub(super) fn wait_throttled(
        &mut self,
        id: &CallId,
        wait: Duration,
        attempt: u32,
        account: String,
        message: String,
    ) {
        let now = Instant::now();
        let until = now + wait;
        let Some(most) = self.runs.get(&id.0).map(|r| r.reg.throttle_wait) else {
            return;
        };
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        let since = *c.throttled_since.get_or_insert(now);
        if until.saturating_duration_since(since) > most {
            let waited = human(now.saturating_duration_since(since));
            let waits = c.limit_waits;
            self.fail(
                id,
                CallFailure::Terminal,
                format!(
                    "throttled by {account} for {waited} ({waits} waits), longer than --throttle-wait {}: {message}",
                    human(most)
                ),
            );
            return;
        }
        crate::counters::inc(&crate::counters::THROTTLES);
        self.wait_until(id, until, attempt, Retry::Throttled { wait, account });
    }

    /// Counts a failed attempt; starts another one or fails the call at the limit.
    pub(super) fn retry_or_fail(&mut self, id: &CallId, retry: Retry) {
        let salvageable = self.salvageable(id);
        let Some(r) = self.runs.get(&id.0) else {
            self.calls.remove(id);
            self.leftovers.forget(id);
            return;
        };
        let max = r.reg.max_attempts;
        let stall_timeout = r.reg.stall_timeout;
        // No budget unless the run asked for one: Claude Code gives every agent its attempts.
        let budget = r.reg.retry_budget;
        let spent = budget.is_some_and(|b| r.retries >= b);
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        c.counted += 1;
        let (counted, attempt) = (c.counted, c.attempt);
        if counted >= max {
            let (failure, message) = retry.exhausted(max, stall_timeout);
            self.fail(id, failure, message);
            return;
        }
        // A user's restart and a pause are not failures: they spend no budget.
        let costs = !matches!(retry, Retry::User | Retry::Paused);
        if costs && spent {
            // It fails as its last attempt would have: a stall still rejects STALLED.
            let (cause, why) = retry.exhausted(counted, stall_timeout);
            self.fail(
                id,
                CallFailure::RetryBudget {
                    stalled: cause == CallFailure::Stalled,
                },
                format!(
                    "{why} ({}: {} retries, --retry-budget)",
                    crate::call::RETRY_BUDGET_SPENT,
                    budget.unwrap_or(0)
                ),
            );
            return;
        }
        if costs && let Some(r) = self.runs.get_mut(&id.0) {
            r.retries += 1;
        }
        let Some(r) = self.runs.get(&id.0) else {
            return;
        };
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        let _ = r.reg.events.send(CallEvent::Retrying {
            call: id.1,
            attempt,
            retry: retry.clone(),
            counted,
        });
        c.attempt_span
            .record("flotilla.outcome", retry.span_outcome());
        crate::counters::inc(retry::restart_counter(&retry));
        if retry.at_once() && salvageable {
            // What the interrupted attempt left comes with its outcome (W58): the retry
            // waits for it, a while.
            c.set(State::Waiting);
            self.leftovers.wait_for(id, attempt, true);
            self.timers.insert_at(
                Timer::Salvage(id.0.clone(), id.1, attempt),
                Instant::now() + leftovers::WAIT,
            );
        } else if retry.at_once() {
            // Same prompt, fresh transcript, at once and ahead of the queue.
            c.make_ready();
            if let Some(r) = self.runs.get_mut(&id.0) {
                r.queue.push_front(id.1);
            }
        } else {
            let backoff = retry::backoff(counted);
            c.set(State::Waiting);
            self.timers
                .insert_at(Timer::Retry(id.0.clone(), id.1), Instant::now() + backoff);
        }
    }

    /// Whether a restarted call's interrupted attempt can still send what it left: the run
    /// has a stored source, or its backend keeps a conversation, and the attempt's worker is
    /// attached.
    pub(super) fn salvageable(&self, id: &CallId) -> bool {
        let stored = self.sources.store().is_some()
            && self.runs.get(&id.0).is_some_and(|r| r.reg.head.is_some());
        // An agent whose backend keeps its conversation leaves that too (issue 33, 3).
        let talks = self
            .calls
            .get(id)
            .is_some_and(|c| !matches!(c.ticket.task.backend.as_str(), "echo" | "exec"));
        (stored || talks)
            && self
                .calls
                .get(id)
                .and_then(|c| c.worker)
                .is_some_and(|w| self.fleet.link(w).is_some())
    }

    /// Stores what attempt `attempt` of a call left (off the actor; `PartialStored` comes
    /// back). `false`: nothing to store, or it is not this call's.
    pub(super) fn keep_partial(&mut self, id: &CallId, attempt: u32, p: v1::Change) -> bool {
        let Some(store) = self.sources.store().cloned() else {
            return false;
        };
        let Some(c) = self.calls.get(id) else {
            return false;
        };
        let stored = self.runs.get(&id.0).is_some_and(|r| r.reg.head.is_some());
        let hex = |s: &str| s.len() >= 40 && s.chars().all(|c| c.is_ascii_hexdigit());
        if !stored
            || p.pack.is_empty()
            || p.repo != c.ticket.task.source_repo
            || p.base != c.sent_base
            || !hex(&p.commit)
        {
            tracing::warn!(run = %id.0, call = id.1, attempt, "ignoring leftovers that do not match the attempt's source");
            return false;
        }
        // Filed under the run's own namespace and repository (checked equal above).
        let Ok(repo) =
            crate::source::Repo::new(&c.ticket.task.namespace, &c.ticket.task.source_repo)
        else {
            return false;
        };
        let (tx, run, call) = (self.tx.clone(), id.0.clone(), id.1);
        self.tasks.spawn(async move {
            // An agent's objects are checked before they are kept, as its change's are.
            let stored = match crate::vet::pack_alone(&p.pack).await {
                Ok(None) => {
                    crate::source::put_pack(&store, &repo, &p.commit, vec![p.base.clone()], p.pack)
                        .await
                        .map(|_| (p.base, p.commit))
                        .map_err(|e| flotilla_proto::Problem::unavailable(e.to_string()))
                }
                Ok(Some(why)) => Err(flotilla_proto::Problem::invalid(format!("refused: {why}"))),
                Err(e) => Err(e.context("cannot check them")),
            };
            let _ = tx.send(Msg::PartialStored {
                run,
                call,
                attempt,
                stored,
            });
        });
        true
    }

    pub(super) fn partial_stored(
        &mut self,
        id: &CallId,
        attempt: u32,
        stored: Result<(String, String), flotilla_proto::Problem>,
    ) {
        if !self.calls.contains_key(id) {
            return;
        }
        match stored {
            Ok((base, commit)) => {
                let shown = commit.clone();
                if self.leftovers.stored(id, attempt, base, commit) {
                    tracing::info!(run = %id.0, call = id.1, attempt, commit = %shown, "the next attempt starts from what this one left");
                    self.keep_in_store(id);
                }
            }
            Err(e) => {
                tracing::warn!(run = %id.0, call = id.1, attempt, error = %e, "cannot store what the attempt left; the next attempt starts without it unless it runs on the same worker");
            }
        }
        self.salvaged(id, attempt);
    }

    /// Keeps the conversation attempt `attempt` of `id` left, for its next attempt, within
    /// the bounds (per call, per namespace, in all), here and in the store.
    fn keep_session(&mut self, id: &CallId, attempt: u32, s: v1::Session) {
        let Some(c) = self.calls.get(id) else {
            return;
        };
        let namespace = c.ticket.task.namespace.clone();
        if self.leftovers.keep_session(id, &namespace, attempt, s) {
            self.keep_in_store(id);
        }
    }

    /// Writes what `id`'s next attempt starts from to the store, where a coordinator that
    /// adopts the run finds it (or deletes it there, once nothing is kept).
    pub(super) fn keep_in_store(&mut self, id: &CallId) {
        let (Some(w), Some(c)) = (&self.kept, self.calls.get(id)) else {
            return;
        };
        match self.leftovers.store_copy(id, &c.ticket.key) {
            leftovers::Keep::Put(k) => {
                tracing::debug!(run = %id.0, call = id.1, conversation = k.session.is_some(), "keeping what the interrupted attempt left in the store");
                w.put(&id.0, &k);
            }
            leftovers::Keep::Delete => w.delete(&id.0, &c.ticket.key),
            leftovers::Keep::Nothing => {}
        }
    }

    /// The wait for what attempt `attempt` left is over: a retry that is due goes.
    pub(super) fn salvaged(&mut self, id: &CallId, attempt: u32) {
        let due = self.leftovers.end_wait(id, attempt);
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        if due && c.state == State::Waiting {
            c.make_ready();
            if let Some(r) = self.runs.get_mut(&id.0) {
                r.queue.push_front(id.1);
            }
        }
    }

    /// The stall timer of attempt `attempt` is due: a quiet attempt (no tool call in flight) is
    /// cancelled and the call goes again (W58), or completes with the structured output it
    /// captured; otherwise the timer is set again.
    pub(super) fn stall_due(&mut self, id: &CallId, attempt: u32) {
        let Some(c) = self.calls.get_mut(id) else {
            return;
        };
        if c.attempt == attempt {
            // The queue gave its timer back (a call has one at a time, its current attempt's).
            c.watchdog.fired();
        }
        if c.state != State::Running || c.attempt != attempt {
            return;
        }
        let Some(stall) = self.runs.get(&id.0).map(|r| r.reg.stall_timeout) else {
            return;
        };
        let item = Timer::Stall(id.0.clone(), id.1, attempt);
        let Some(quiet) = c.watchdog.due(&mut self.timers, item, stall) else {
            return;
        };
        let captured = c.captured.take();
        self.send_cancel(id, "stalled");
        self.leave_running(id, Ended::Stalled);
        if let Some(json) = captured {
            // W58: a stall after a valid structured output counts as success.
            self.finish(
                id,
                CallResult::Completed(v1::Completed {
                    text: json.clone(),
                    json: Some(json),
                    change: None,
                    model: String::new(),
                }),
            );
        } else {
            crate::counters::inc(&crate::counters::STALLS);
            self.retry_or_fail(id, Retry::Stalled { after: quiet });
        }
    }

    /// A retry's wait is over: the call goes to the front of its queue (unless what its last
    /// attempt left is still being stored), and its gate may open.
    pub(super) fn retry_due(&mut self, id: &CallId) {
        if self.leftovers.waiting(id)
            && self
                .calls
                .get(id)
                .is_some_and(|c| c.state == State::Waiting)
        {
            // Still storing what the last attempt left: it goes once that is done.
            self.leftovers.set_due(id);
        } else if let Some(c) = self.calls.get_mut(id)
            && c.state == State::Waiting
        {
            c.make_ready();
            if let Some(r) = self.runs.get_mut(&id.0) {
                r.queue.push_front(id.1);
            }
        }
        let gate = self.calls.get(id).map(|c| gates::gate_of(&c.ticket.task));
        if let Some(g) = gate {
            self.release_gate(&g);
        }
    }
}
