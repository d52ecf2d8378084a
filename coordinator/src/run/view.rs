//! What others see of a run: the live [`Snapshot`] it publishes (progress displays, the
//! session page) and the [`Report`].

use super::*;

impl RunEngine {
    pub(super) fn publish(&mut self) {
        if !self.dirty {
            return;
        }
        self.dirty = false;
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
                .or_else(|| self.held.clone())
                .or_else(|| self.quota_held.clone())
                .or_else(|| self.waiting.clone())
                .or_else(|| self.book.no_worker_summary()),
            ..Summary::default()
        };
        let groups = self.book.progress(&mut summary);
        if summary.waiting.is_none() && summary.running == 0 && summary.queued == 0 {
            summary.waiting = self.asks.waiting(&self.init.run_id);
        }
        let snap = Snapshot {
            run_id: self.init.run_id.clone(),
            workflow: self.init.workflow.clone(),
            summary,
            groups,
            questions: Arc::new(self.asks.open()),
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

    /// While a stopped run waits for its agents to leave their workers: how many are left.
    fn still_stopping(&self) -> Option<String> {
        match self.stopping_left {
            0 => None,
            1 => Some("1 agent is still stopping on its worker".into()),
            n => Some(format!("{n} agents are still stopping on their workers")),
        }
    }

    /// Each queued agent of a live report says why it has not started (unless it already
    /// says which worker it waits for): a paused run, a usage limit or throttle, the run's
    /// concurrency, its stagger, or the fleet's slots.
    fn say_why_queued(&self, agents: &mut [crate::report::AgentReport]) {
        let running = agents
            .iter()
            .filter(|a| a.status == crate::call::Status::Running)
            .count() as u64;
        let s = &self.init.settings;
        let why = if self.status == RunStatus::Paused {
            "the run is paused (resume it to start more agents)".to_owned()
        } else if let Some(w) = self
            .init
            .store
            .health
            .problem()
            .or_else(|| self.waiting.clone())
        {
            w
        } else if s.concurrency > 0 && running >= u64::from(s.concurrency) {
            format!(
                "waits for a slot: the run's {running} agents in flight fill its concurrency ({}, --concurrency)",
                s.concurrency
            )
        } else if s.stagger_ms > 0 {
            format!(
                "waits for its turn: the run starts agents {} apart (--stagger)",
                human(Duration::from_millis(s.stagger_ms))
            )
        } else {
            "waits for a free worker slot (every attached worker's slots are taken)".to_owned()
        };
        for a in agents
            .iter_mut()
            .filter(|a| a.status == crate::call::Status::Queued && a.waiting.is_none())
        {
            a.waiting = Some(why.clone());
        }
    }

    pub(super) fn report(&self) -> Report {
        self.report_with(false)
    }

    /// The report; `live` keeps the states of calls that have not ended instead of calling
    /// them cancelled.
    pub(super) fn report_with(&self, live: bool) -> Report {
        let mut usage = ReportUsage {
            input_tokens: self.budgets.used().input_tokens,
            output_tokens: self.budgets.used().output_tokens,
            cost_usd: self.budgets.used().cost_usd,
            duration_ms: self.now_ms(),
            waits: self.waits,
            ..ReportUsage::default()
        };
        let mut agents = self.book.agent_reports(live, &mut usage);
        if live {
            self.say_why_queued(&mut agents);
        }
        let groups = self.book.group_reports();
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
            questions: self.asks.all(),
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
                let of = |f: fn(&crate::head::ChangeRecord) -> bool| self.book.changes_where(f);
                crate::report::ChangesSummary {
                    merged: of(|r| r.head_after.is_some()),
                    isolated: of(|r| r.isolated),
                    conflicted: of(|r| !r.conflicts.is_empty()),
                    refused: of(|r| r.refused.is_some()),
                    head: head.borrow().clone(),
                    apply: format!("flotilla apply {}", self.init.run_id),
                }
            }),
        }
    }
}
