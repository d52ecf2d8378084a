//! One call's way through its run: admitted (or rejected, or served from the run it resumes),
//! sent to the dispatcher, followed through its [`CallEvent`]s, and ended with its result on
//! its way to the journal.

use super::*;

impl RunEngine {
    pub(super) fn on_agent(&mut self, id: u64, req: admit::Request) {
        if self.stopping {
            return;
        }
        let spent = admit::Spent {
            calls: self.book.len() as u64,
            cost_usd: self.budgets.used().cost_usd,
            output_tokens: self.budgets.output_tokens(),
            money_holds: self.init.budget_pauses,
        };
        let (types, resolver) = (&mut self.agent_types, &self.init.resolver);
        let mut known = || types.get_or_insert_with(|| resolver.agent_types()).clone();
        let admission = self.admitter.admit(
            req,
            &self.init.settings,
            spent,
            &mut known,
            self.init.resume.as_ref(),
        );
        if let admit::Admission::Dispatch(a) | admit::Admission::Cached(a, _) = &admission
            && let Some(asked) = &a.substituted
        {
            self.substituted(&a.spec.label, asked, &a.spec.model);
        }
        match admission {
            admit::Admission::Rejected(code, message) => self.reject(id, code, message),
            admit::Admission::Cached(admitted, record) => self.serve(id, admitted, *record),
            admit::Admission::Dispatch(admitted) => {
                // A new agent counts against its namespace's daily quotas; one served from
                // the run it resumes does not. Past the tokens or dollars of the day, a
                // coordinator's run is held until they reset, this agent waiting in it.
                let ns = self.init.settings.namespace.clone();
                if let Some(q) = self.init.quotas.clone() {
                    match q.spent(&ns).filter(|_| self.init.budget_pauses) {
                        Some(e) => {
                            q.count_agent(&ns);
                            self.hold_at_quota(&e);
                        }
                        None => {
                            if let Err(e) = q.take_agent(&ns) {
                                self.reject(id, RejectCode::QuotaExceeded, e.to_string());
                                return;
                            }
                        }
                    }
                }
                self.dispatch(id, admitted)
            }
        }
    }

    /// An agent runs on `used` instead of the model it asked for (W18): said in the log once
    /// per pair, and counted for the report's warnings.
    fn substituted(&mut self, label: &str, asked: &str, used: &str) {
        let n = self
            .substitutions
            .entry((asked.to_owned(), used.to_owned()))
            .or_insert(0);
        *n += 1;
        if *n == 1 {
            let line = format!(
                "[model] agent \"{label}\" asked for model {asked:?}, which the allowed models ({}) do not include: it runs on {used:?}",
                self.init.settings.allowed_models.join(", ")
            );
            self.logs.push(line.clone());
            self.event(RunEvent::Log { line });
        }
    }

    /// The record of a new call, with its trace span (under its phase's).
    pub(super) fn new_call(&mut self, id: u64, a: &admit::Admitted) -> Call {
        let group_at = self.ensure_group(&a.group);
        let index = self.book.next_index();
        let phase = self
            .phase_spans
            .entry(a.group.clone())
            .or_insert_with(|| {
                tracing::info_span!(
                    parent: &self.span,
                    "phase",
                    flotilla.run_id = %self.init.run_id,
                    flotilla.phase = %a.group,
                )
            })
            .clone();
        let span = tracing::info_span!(
            parent: &phase,
            "agent",
            flotilla.run_id = %self.init.run_id,
            flotilla.workflow = %self.init.workflow.name,
            flotilla.call = index,
            flotilla.label = %a.spec.label,
            gen_ai.request.model = %a.spec.model,
            flotilla.attempts = tracing::field::Empty,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            flotilla.outcome = tracing::field::Empty,
        );
        Call {
            key: a.key.clone(),
            group: a.group.clone(),
            group_at,
            model: a.spec.model.clone(),
            isolated: a.spec.isolation == "worktree",
            ..Call::new(id, a.spec.label.clone(), span)
        }
    }

    /// Serves a call from the run this one resumes: its change goes to the head again (never
    /// re-run, design.md), then its result to the journal.
    pub(super) fn serve(&mut self, id: u64, a: admit::Admitted, record: CallRecord) {
        let mut call = self.new_call(id, &a);
        let (index, now) = (self.book.next_index(), self.now_ms());
        call.span.record("flotilla.outcome", "cached");
        call.span = tracing::Span::none();
        call.cached = true;
        call.cached_from = Some(
            record
                .cached_from
                .clone()
                .or_else(|| self.init.resume.as_ref().map(|s| s.run_id.clone()))
                .unwrap_or_default(),
        );
        call.set(Stage::Journaling);
        call.start_ms = Some(now);
        call.end_ms = Some(now);
        call.result = record.result;
        call.own_journal = self
            .init
            .resume
            .as_ref()
            .is_some_and(|s| s.run_id == self.init.run_id);
        let own = call.own_journal;
        if own {
            // The same run, carried on after a failover: what the call took before the
            // failover is this run's too (its attempts, its tokens and cost, its budget).
            call.attempts = record.attempts;
            call.usage = record.usage;
            self.budgets.carry(&record.usage);
            if let Some(early) = self.budgets.take_early(index) {
                call.usage.add(&early);
            }
            // Adopted over its money budget: held before it starts anything new.
            if self.init.budget_pauses && self.budgets.carried_over_money() {
                self.hold_at_budget();
            }
        }
        self.book.push(call);
        if let (Some(head), Some(mut ch)) = (&self.head, record.change) {
            ch.head_after = None;
            let _ = head.send(crate::head::Apply {
                call: index,
                label: a.spec.label.clone(),
                record: ch,
                pack: None,
            });
        } else if own {
            // Adopted after a failover: the result is in this run's own journal already.
            self.on_ack(JournalAck::Durable(vec![index]));
        } else {
            self.journal_call(index);
        }
        self.event(RunEvent::Call {
            index,
            label: a.spec.label,
            group: a.group,
            state: Mark::Cached,
            attempt: None,
            detail: None,
        });
    }

    /// Sends an admitted call to the dispatcher.
    pub(super) fn dispatch(&mut self, id: u64, a: admit::Admitted) {
        let mut call = self.new_call(id, &a);
        let index = self.book.next_index();
        if let Some(early) = self.budgets.take_early(index) {
            call.usage.add(&early);
        }
        let span = call.span.clone();
        self.book.push(call);
        // Served calls are not: the page finds their prompt in the run they came from.
        self.event(RunEvent::Prompt {
            index,
            prompt: a.spec.prompt.clone(),
        });
        self.event(RunEvent::Call {
            index,
            label: a.spec.label.clone(),
            group: a.group.clone(),
            state: Mark::Queued,
            attempt: None,
            detail: None,
        });
        let ticket = Ticket {
            call: index,
            key: a.key.clone(),
            task: a.task(&self.init.settings),
            span,
            prefix_group: a.prefix_group(index),
        };
        self.init.dispatch.submit(&self.run, ticket);
    }

    pub(super) fn on_call_event(&mut self, ev: CallEvent) {
        self.dirty = true;
        let now = self.now_ms();
        match ev {
            CallEvent::Started {
                call,
                attempt,
                worker,
            } => self.on_started(call, attempt, worker, now),
            CallEvent::Progress {
                call,
                output_tokens,
                ..
            } => {
                if let Some(c) = self.book.get_mut(call) {
                    c.live_tokens = c.live_tokens.max(output_tokens);
                }
                if self.waiting.is_some() {
                    self.waiting = None;
                }
            }
            CallEvent::Transcript {
                call,
                attempt,
                events,
            } => self.store_transcript(call, attempt, events),
            CallEvent::Usage { call, usage, .. } => self.on_usage(call, &usage),
            CallEvent::Retrying {
                call,
                attempt,
                retry,
                counted,
            } => self.on_retrying(call, attempt, &retry, counted),
            CallEvent::Waiting { call, reason } => self.on_waiting(call, reason),
            CallEvent::Finished { call, result } => self.on_finished(call, result, now),
        }
    }

    /// An attempt of `call` holds a worker now: what the views show of it.
    fn on_started(&mut self, call: u64, attempt: u32, worker: Arc<str>, now: u64) {
        let Some(c) = self.book.get_mut(call) else {
            return;
        };
        if c.stage.is_live() {
            c.running = true;
        }
        c.attempts = c.attempts.max(attempt);
        c.start_ms.get_or_insert(now);
        crate::report::AttemptSegment::open(&mut c.segments, attempt, now, &worker);
        c.worker = Some(worker.clone());
        c.live_tokens = 0;
        let (label, group) = (c.label.clone(), c.group.clone());
        self.event(RunEvent::Call {
            index: call,
            label,
            group,
            state: Mark::Running,
            attempt: Some(attempt),
            detail: Some(worker.to_string()),
        });
    }

    /// What an attempt used: costed by the namespace's prices, counted against its quotas
    /// and the run's budgets, added to the call's (or kept until the call is known here).
    fn on_usage(&mut self, call: u64, usage: &flotilla_proto::v1::Usage) {
        let mut u = UsageRecord::from(usage);
        // The namespace's price table costs the tokens of the models it prices.
        if let Some(price) = self
            .book
            .get(call)
            .and_then(|c| crate::namespace::price_of(&self.init.settings.prices, &c.model))
        {
            u.cost_usd = price.cost(&u);
        }
        if let Some(q) = self.init.quotas.clone() {
            q.add(&self.init.settings.namespace, &u);
            if self.init.budget_pauses
                && let Some(e) = q.spent(&self.init.settings.namespace)
            {
                self.hold_at_quota(&e);
            }
        }
        let crossed = self.budgets.add(&u);
        self.over_budget(crossed);
        crate::counters::used(
            &self.init.settings.namespace,
            &self.init.workflow.name,
            self.book.get(call).map_or("", |c| c.model.as_str()),
            &u,
        );
        if let Some(c) = self.book.get_mut(call) {
            c.usage.add(&u);
            c.disk_bytes = c.disk_bytes.max(usage.disk_bytes);
        } else {
            self.budgets.keep_early(call, &u);
        }
    }

    /// `call` goes again (or waits first): said in the run's log and its event log.
    fn on_retrying(&mut self, call: u64, attempt: u32, retry: &Retry, counted: u32) {
        let Some(c) = self.book.get(call) else {
            return;
        };
        let (label, group) = (c.label.clone(), c.group.clone());
        let line = retry.log_line(&label, attempt, counted, self.init.settings.attempts);
        match retry {
            Retry::RateLimited { wait } => {
                self.waits += 1;
                self.waiting = Some(format!(
                    "usage limit: agent \"{label}\" waits {} before retrying",
                    human(*wait)
                ));
            }
            Retry::Throttled { wait, account } => {
                self.waits += 1;
                self.waiting = Some(format!(
                    "throttled by {account}: agent \"{label}\" waits {} (its admission window shrank)",
                    human(*wait)
                ));
            }
            _ => {}
        }
        let now = self.now_ms();
        if let Some(c) = self.book.get_mut(call) {
            c.running = false;
            crate::report::AttemptSegment::close(&mut c.segments, now, retry.mark().as_str());
        }
        self.logs.push(line.clone());
        self.event(RunEvent::Log { line });
        self.event(RunEvent::Call {
            index: call,
            label,
            group,
            state: retry.mark(),
            attempt: Some(attempt),
            detail: None,
        });
    }

    /// `call` waits for a worker that offers what it needs (`None`: no longer); said once
    /// per reason.
    fn on_waiting(&mut self, call: u64, reason: Option<String>) {
        let Some(c) = self.book.get_mut(call) else {
            return;
        };
        c.waiting_for.clone_from(&reason);
        if let Some(reason) = reason
            && self.waits_logged.insert(reason.clone())
        {
            let line = format!(
                "[wait] agent \"{}\" waits: {reason}; it fails after {} unless such a worker attaches",
                c.label,
                human(Duration::from_millis(self.init.settings.worker_wait_ms))
            );
            self.logs.push(line.clone());
            self.event(RunEvent::Log { line });
        }
    }

    pub(super) fn on_finished(&mut self, call: u64, result: CallResult, now: u64) {
        let stopping = self.stopping;
        let Some(c) = self.book.get_mut(call) else {
            return;
        };
        if !c.stage.is_live() {
            return;
        }
        c.end_ms = Some(now);
        c.waiting_for = None;
        let outcome = match (&result, stopping) {
            (CallResult::Completed(_), _) => "completed",
            (CallResult::Failed { .. }, true) => "cancelled",
            (CallResult::Failed { .. }, false) => "failed",
        };
        crate::report::AttemptSegment::close(&mut c.segments, now, outcome);
        c.span.record("flotilla.attempts", c.attempts);
        c.span
            .record("gen_ai.usage.input_tokens", c.usage.input_tokens);
        c.span
            .record("gen_ai.usage.output_tokens", c.usage.output_tokens);
        c.span.record("flotilla.outcome", result.span_outcome());
        c.span = tracing::Span::none();
        match result {
            CallResult::Completed(done) => {
                // The model its backend says it ran on (an alias's id) is the agent's model.
                if !done.model.is_empty() {
                    c.model = done.model;
                }
                let value = match done.json {
                    Some(json) => RawJson::or_string(json),
                    None => RawJson::string(&done.text),
                };
                c.result = Some(value);
                c.set(Stage::Journaling);
                match (done.change, &self.head) {
                    // Its change goes into the head (or onto its branch) before it is journaled.
                    (Some(ch), Some(head)) => {
                        let _ = head.send(crate::head::Apply {
                            call,
                            label: c.label.clone(),
                            record: crate::head::ChangeRecord {
                                commit: ch.commit,
                                base: ch.base,
                                files: ch.files,
                                insertions: ch.insertions,
                                deletions: ch.deletions,
                                head_after: None,
                                conflicts: Vec::new(),
                                isolated: c.isolated,
                                refused: None,
                            },
                            pack: Some(ch.pack),
                        });
                    }
                    // A source the workers fetched by URL has no head here: said, never lost
                    // without a word.
                    (Some(ch), None) => {
                        let line = format!(
                            "agent \"{}\" changed {} file(s), but this run's source is fetched by URL and its changes are not kept; launch from a checkout of the repository (--source auto) to get them back as branches",
                            c.label,
                            ch.files.len()
                        );
                        self.failures.push(line.clone());
                        self.event(RunEvent::Failure { line });
                        self.journal_call(call);
                    }
                    (None, _) => self.journal_call(call),
                }
            }
            CallResult::Failed { failure, message } => {
                c.set(Stage::Failed);
                c.error = Some(message.clone());
                if matches!(failure, CallFailure::RetryBudget { .. }) {
                    self.budgets.refused_retry();
                }
                let (id, label, group) = (c.script_id, c.label.clone(), c.group.clone());
                if !stopping {
                    match failure.reject_code() {
                        None => {
                            (self.reply)(HostReply::Agent {
                                id,
                                result: Ok("null".into()),
                            });
                            let line = format!("agent \"{label}\" failed: {message}");
                            self.failures.push(line.clone());
                            self.event(RunEvent::Failure { line });
                        }
                        Some(code) => self.reject(id, code, message.clone()),
                    }
                }
                self.event(RunEvent::Call {
                    index: call,
                    label,
                    group,
                    state: Mark::Failed,
                    attempt: None,
                    detail: Some(message),
                });
            }
        }
    }

    /// A change applied to the head (or kept on its branch): said, then journaled with its call.
    pub(super) fn on_applied(&mut self, a: crate::head::Applied) {
        self.dirty = true;
        let Some(c) = self.book.get_mut(a.call) else {
            return;
        };
        let label = c.label.clone();
        let branch = format!("flotilla/{}/{}", self.init.run_id, a.call);
        let line = match a.result {
            Ok(record) => {
                let line = if let Some(why) = &record.refused {
                    Some(format!(
                        "agent \"{label}\"'s change was refused: {why}; its result stands, and nothing of the change is in the run's head or on a branch"
                    ))
                } else if !record.conflicts.is_empty() {
                    Some(format!(
                        "agent \"{label}\" changed files that conflict with the run's head ({}); its change is on branch {branch} (`flotilla apply {} --agent {}`)",
                        record.conflicts.join(", "),
                        self.init.run_id,
                        a.call
                    ))
                } else {
                    None
                };
                c.change = Some(record);
                line
            }
            Err(e) => {
                // The result stands; only the change could not be kept.
                Some(format!(
                    "agent \"{label}\" changed files, but the change could not be kept: {e}"
                ))
            }
        };
        let own = c.own_journal;
        if let Some(line) = line {
            self.failures.push(line.clone());
            self.event(RunEvent::Failure { line });
        }
        if own {
            self.on_ack(JournalAck::Durable(vec![a.call]));
        } else {
            self.journal_call(a.call);
        }
    }

    pub(super) fn store_transcript(&mut self, call: u64, attempt: u32, events: Vec<String>) {
        let events = events.into_iter().map(RawJson::or_string).collect();
        self.transcripts.push(TranscriptLine {
            call,
            attempt,
            events,
        });
    }
}
