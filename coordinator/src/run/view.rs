//! What others see of a run: the live [`Snapshot`] it publishes (progress displays, the
//! session page) and the [`Report`].

use super::*;

impl RunEngine {
    pub(super) fn publish(&mut self) {
        if !self.dirty {
            return;
        }
        self.dirty = false;
        let mut groups: Vec<GroupProgress> = self
            .groups
            .iter()
            .map(|t| GroupProgress {
                title: t.clone(),
                ..GroupProgress::default()
            })
            .collect();
        let mut summary = Summary {
            status: self.status,
            elapsed_ms: self.now_ms(),
            input_tokens: self.budgets.used().input_tokens,
            output_tokens: self.budgets.used().output_tokens,
            cost_usd: self.budgets.used().cost_usd,
            waiting: self
                .init
                .store
                .health
                .problem()
                .or_else(|| self.still_stopping())
                .or_else(|| self.waiting.clone())
                .or_else(|| self.no_worker_summary()),
            ..Summary::default()
        };
        for c in &self.calls {
            summary.agents += 1;
            match c.stage {
                Stage::Completed | Stage::Journaling => summary.done += 1,
                Stage::Failed => summary.failed += 1,
                Stage::Cancelled => summary.cancelled += 1,
                Stage::Live if c.running => summary.running += 1,
                Stage::Live => summary.queued += 1,
            }
            if c.cached {
                summary.cached += 1;
            }
            let Some(g) = groups.get_mut(c.group_at) else {
                continue;
            };
            g.total += 1;
            g.output_tokens += c.usage.output_tokens.max(c.live_tokens);
            match c.stage {
                Stage::Completed | Stage::Journaling => g.done += 1,
                Stage::Failed | Stage::Cancelled => g.failed += 1,
                Stage::Live if c.running => g.running += 1,
                Stage::Live => {}
            }
        }
        let snap = Snapshot {
            run_id: self.init.run_id.clone(),
            workflow: self.init.workflow.clone(),
            summary,
            groups,
            logs: {
                if self.published_logs.len() != self.logs.len() {
                    self.published_logs = Arc::new(self.logs.clone());
                }
                self.published_logs.clone()
            },
            since: Some(self.started),
        };
        let _ = self.snapshot.send(Arc::new(snap));
    }

    /// What the calls that no attached worker can run wait for, in one line.
    pub(super) fn no_worker_summary(&self) -> Option<String> {
        let mut waiting = self.calls.iter().filter_map(|c| c.waiting_for.as_ref());
        let first = waiting.next()?;
        Some(Summary::agents_wait(first, 1 + waiting.count() as u64))
    }

    /// While a stopped run waits for its agents to leave their workers: how many are left.
    fn still_stopping(&self) -> Option<String> {
        match self.stopping_left {
            0 => None,
            1 => Some("1 agent is still stopping on its worker".into()),
            n => Some(format!("{n} agents are still stopping on their workers")),
        }
    }

    pub(super) fn report(&self) -> Report {
        self.report_with(false)
    }

    /// The report; `live` keeps the states of calls that have not ended instead of calling
    /// them cancelled.
    pub(super) fn report_with(&self, live: bool) -> Report {
        let mut usage = ReportUsage {
            agents: self.calls.len() as u64,
            // Each call's attempts are numbered from 1: the highest is how many it took, also
            // across a failover (an attempt taken over keeps its number, and calls served
            // from the run's own journal bring theirs).
            attempts: self.calls.iter().map(|c| u64::from(c.attempts)).sum(),
            input_tokens: self.budgets.used().input_tokens,
            output_tokens: self.budgets.used().output_tokens,
            cost_usd: self.budgets.used().cost_usd,
            duration_ms: self.now_ms(),
            waits: self.waits,
            ..ReportUsage::default()
        };
        let mut agents = Vec::with_capacity(self.calls.len());
        for (i, c) in self.calls.iter().enumerate() {
            if c.cached {
                usage.cached += 1;
            } else if c.attempts > 0 {
                usage.dispatched += 1;
            }
            if c.stage == Stage::Failed {
                usage.errors += 1;
            }
            agents.push(AgentReport {
                label: c.label.clone(),
                group: c.group.clone(),
                status: c.stage.status(c.running, live),
                attempts: c.attempts,
                cached: c.cached,
                start_ms: c.start_ms,
                end_ms: c.end_ms,
                error: c.error.clone(),
                index: i as u64,
                key: c.key.clone(),
                model: c.model.clone(),
                input_tokens: c.usage.input_tokens,
                output_tokens: c.usage.output_tokens,
                disk_bytes: c.disk_bytes,
                waiting: if live { c.waiting_for.clone() } else { None },
            });
        }
        let mut groups: Vec<GroupReport> = self
            .groups
            .iter()
            .map(|t| GroupReport {
                title: t.clone(),
                agents: Vec::new(),
                agents_omitted: 0,
            })
            .collect();
        for c in &self.calls {
            if let Some(g) = groups.get_mut(c.group_at) {
                g.agents.push(c.label.clone());
            }
        }
        Report {
            run_id: self.init.run_id.clone(),
            status: self.status,
            result: self.result.clone(),
            error: self.error.clone(),
            workflow: self.init.workflow.clone(),
            warnings: usage
                .large_workflow()
                .into_iter()
                .chain((self.budgets.retries_refused() > 0).then(|| {
                    let budget = self.init.settings.retry_budget.unwrap_or(0);
                    format!(
                        "Retry budget spent: {} agents failed instead of trying again (the run's budget is {budget} retries; raise it with --retry-budget)",
                        self.budgets.retries_refused()
                    )
                }))
                .chain(self.substitutions.iter().map(|((asked, used), n)| {
                    format!(
                        "Model substituted: {n} agent{} asked for {asked:?}, which the allowed models ({}) do not include; {} on {used:?}",
                        if *n == 1 { "" } else { "s" },
                        self.init.settings.allowed_models.join(", "),
                        if *n == 1 { "it ran" } else { "they ran" }
                    )
                }))
                .collect(),
            notify: None,
            namespace: self.init.settings.namespace.clone(),
            usage,
            agents,
            groups,
            logs: self.logs.clone(),
            failures: self.failures.clone(),
            script_path: self.init.script_path.clone(),
            parent_run_id: self.init.parent_run_id.clone(),
            store: Some(self.init.store.url.clone()),
            agents_omitted: 0,
            changes: self.head_watch.as_ref().map(|head| {
                let of = |f: &dyn Fn(&crate::head::ChangeRecord) -> bool| {
                    self.calls
                        .iter()
                        .filter_map(|c| c.change.as_ref())
                        .filter(|r| f(r))
                        .count() as u64
                };
                crate::report::ChangesSummary {
                    merged: of(&|r| r.head_after.is_some()),
                    isolated: of(&|r| r.isolated),
                    conflicted: of(&|r| !r.conflicts.is_empty()),
                    refused: of(&|r| r.refused.is_some()),
                    head: head.borrow().clone(),
                    apply: format!("flotilla apply {}", self.init.run_id),
                }
            }),
        }
    }
}
