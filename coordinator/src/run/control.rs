//! What is done to a running run from outside or by its limits: pause (W54), stopping the run or
//! one agent (W55), restarting one (W56), and the budgets that end calls (W35, W82).

use super::*;
use flotilla_proto::Problem;

impl RunEngine {
    pub(super) fn pause(&mut self, paused: bool) {
        if self.stopping || (self.status == RunStatus::Paused) == paused {
            return;
        }
        if !paused && let Some(why) = self.held.as_ref().or(self.quota_held.as_ref()) {
            // Only a budget that is not reached, a quota reset, lets it go on.
            let line = format!("[budget] the run stays {why}");
            self.logs.push(line.clone());
            self.event(RunEvent::Log { line });
            return;
        }
        self.status = if paused {
            RunStatus::Paused
        } else {
            RunStatus::Running
        };
        self.init.dispatch.pause_run(&self.run, paused);
        self.event(RunEvent::Status {
            status: self.status.as_str().into(),
            error: None,
        });
        let line = if paused {
            "[pause] the run is paused: running agents were interrupted and nothing new starts"
        } else {
            "[pause] the run resumed"
        };
        self.logs.push(line.into());
        self.event(RunEvent::Log { line: line.into() });
    }

    /// Finds one live agent by index or label and stops or restarts it.
    pub(super) fn act_on_agent(
        &mut self,
        action: AgentAction,
        agent: &str,
    ) -> Result<String, Problem> {
        let (index, c) = self.book.find_live(agent)?;
        let label = c.label.clone();
        match action {
            AgentAction::Stop => {
                self.init.dispatch.stop_call(
                    &self.run,
                    index,
                    CallFailure::Terminal,
                    "stopped by the user",
                );
                Ok(format!(
                    "stopped agent #{index} ({label:?}); its agent() resolves null"
                ))
            }
            AgentAction::Restart { fresh } => {
                if !(c.stage.is_live() && c.running) {
                    return Err(Problem::invalid(format!(
                        "agent #{index} ({label:?}) is queued, not running; nothing to restart"
                    )));
                }
                self.init.dispatch.restart_call(&self.run, index, fresh);
                Ok(if fresh {
                    format!(
                        "restarted agent #{index} ({label:?}) as a new attempt that starts over"
                    )
                } else {
                    format!(
                        "restarted agent #{index} ({label:?}) as a new attempt; it continues the session the interrupted one leaves, where its backend keeps one (--fresh starts over)"
                    )
                })
            }
        }
    }

    pub(super) fn begin_stop(&mut self) {
        if self.stopping {
            return;
        }
        self.stopping = true;
        if !self.status.is_final() {
            self.status = RunStatus::Stopping;
            self.event(RunEvent::Status {
                status: self.status.as_str().into(),
                error: None,
            });
        }
        self.init.shared.stop.store(true, Ordering::Relaxed);
        (self.reply)(HostReply::Stop);
        self.init.dispatch.close_run(&self.run);
        self.cancel_live();
    }

    /// Whatever is still queued or running is cancelled: the script no longer waits for it.
    /// Each says so in the run's events, so a report rebuilt from them agrees.
    pub(super) fn cancel_live(&mut self) {
        let now = self.now_ms();
        for e in self.book.cancel_live(now) {
            self.event(e);
        }
    }

    /// Acts on the ceilings usage crossed. The money ceiling: every live call stops with
    /// `BUDGET_EXCEEDED`. The token budget (W35) is checked at dispatch: once it is spent,
    /// the dispatcher ends every call that has not started with `BUDGET_EXCEEDED`; running
    /// ones complete.
    pub(super) fn over_budget(&mut self, crossed: budgets::Crossed) {
        if crossed.money.is_some() && self.init.budget_pauses {
            self.hold_at_budget();
        } else if let Some((line, message)) = crossed.money {
            self.logs.push(line.clone());
            self.event(RunEvent::Log { line });
            self.stop_live(CallFailure::Budget, &message);
        }
        if let Some(message) = crossed.tokens {
            self.init.dispatch.budget_spent(&self.run, &message);
        }
    }

    /// The run at its money budget where someone can raise it (a coordinator's run): held,
    /// as [`HELD_AT_BUDGET`] says: nothing new starts, running agents finish, and
    /// `flotilla budget` lets it go on. Its status says by how much it is over.
    pub(super) fn hold_at_budget(&mut self) {
        if self.stopping {
            return;
        }
        let limit = self.budgets.usd().unwrap_or_default();
        let cost = self.budgets.used().cost_usd;
        let running = self.what_runs_when_held();
        let why = format!(
            "{HELD_AT_BUDGET}: it has cost ${cost:.4} of ${limit} (${:.4} over); {running} and nothing new starts until it is raised (`flotilla budget {} --usd DOLLARS`)",
            (cost - limit).max(0.0),
            self.run
        );
        let line = format!("[budget] the run is {why}");
        // Its `--notify` receiver hears of it, once each time it is held.
        if self.held.is_none() {
            self.announce_paused(&why, "money_budget");
        }
        self.held = Some(why);
        self.logs.push(line.clone());
        self.event(RunEvent::Log { line });
        self.held_now();
    }

    /// The run past its namespace's daily tokens or dollars where it can wait (a coordinator's
    /// run): held as at its money budget, until the quota resets ([`Self::quota_tick`]).
    pub(super) fn hold_at_quota(&mut self, e: &crate::namespace::Exceeded) {
        if self.stopping || self.quota_held.is_some() {
            return;
        }
        let running = self.what_runs_when_held();
        let why = format!(
            "{HELD_AT_QUOTA}: namespace {} has used its {} ({} of {}); {running} and nothing new starts until it resets at {} (in {})",
            e.namespace, e.quota, e.used, e.limit, e.resets, e.left
        );
        if self.held.is_none() {
            self.announce_paused(&why, "namespace_quota");
        }
        let line = format!("[quota] the run is {why}");
        self.quota_held = Some(why);
        self.logs.push(line.clone());
        self.event(RunEvent::Log { line });
        self.held_now();
    }

    /// What a held run does with its running agents, as its status says it.
    fn what_runs_when_held(&self) -> &'static str {
        if self.init.settings.budget_interrupts {
            "running agents were interrupted (their work is kept)"
        } else {
            "running agents finish"
        }
    }

    /// Tells the run's `--notify` receiver it is paused (`why`, as its status says; `reason`:
    /// `money_budget` or `namespace_quota`), with its cost and money budget.
    fn announce_paused(&self, why: &str, reason: &str) {
        let (Some(url), Some(n)) = (&self.init.settings.notify, &self.init.notifier) else {
            return;
        };
        n.spawn_paused(
            self.init.store.clone(),
            (self.init.generation, self.now_ms()),
            url.clone(),
            (&self.init.run_id, &self.init.workflow.name),
            (why, reason),
            (self.budgets.used().cost_usd, self.budgets.usd()),
            &self.init.settings.labels,
        );
    }

    /// The run is held (at its budget or its namespace's quota): paused, and nothing of it
    /// starts (or, by its setting, what runs is interrupted too).
    fn held_now(&mut self) {
        if self.status != RunStatus::Paused {
            self.status = RunStatus::Paused;
            self.event(RunEvent::Status {
                status: self.status.as_str().into(),
                error: None,
            });
        }
        if self.init.settings.budget_interrupts {
            self.init.dispatch.pause_run(&self.run, true);
        } else {
            self.init.dispatch.hold_run(&self.run, true);
        }
        self.dirty = true;
    }

    /// Each tick: a run held at its namespace's quota goes on once the quota has reset (a new
    /// day), unless its money budget holds it too.
    pub(super) fn quota_tick(&mut self) {
        if self.quota_held.is_none() || self.stopping {
            return;
        }
        let Some(q) = self.init.quotas.clone() else {
            return;
        };
        if q.spent(&self.init.settings.namespace).is_some() {
            return;
        }
        self.quota_held = None;
        let line = "[quota] the namespace's daily quota reset".to_owned();
        self.logs.push(line.clone());
        self.event(RunEvent::Log { line });
        if self.held.is_none() {
            self.status = RunStatus::Running;
            self.init.dispatch.hold_run(&self.run, false);
            self.event(RunEvent::Status {
                status: self.status.as_str().into(),
                error: None,
            });
            let line = "[quota] the run goes on".to_owned();
            self.logs.push(line.clone());
            self.event(RunEvent::Log { line });
        }
        self.dirty = true;
    }

    /// The money budget set anew (`flotilla budget RUN --usd N`): kept in the store, so a
    /// coordinator that adopts the run holds it to this one; a held run under it goes on, a
    /// run over it is held.
    pub(super) fn set_budget(&mut self, usd: f64) -> Result<String, Problem> {
        if !(usd.is_finite() && usd > 0.0) {
            return Err(Problem::invalid(format!(
                "a money budget is a positive number of dollars, not {usd}"
            )));
        }
        if !self.init.budget_pauses {
            return Err(Problem::invalid(
                "this run stops its agents at its money budget; a budget can be raised only on a coordinator's runs",
            ));
        }
        let under = self.budgets.set_usd(usd);
        self.init.settings.budget_usd = Some(usd);
        self.keep_budget(usd);
        let cost = self.budgets.used().cost_usd;
        let line =
            format!("[budget] the run's money budget is now ${usd} (it has cost ${cost:.4})");
        self.logs.push(line.clone());
        self.event(RunEvent::Log { line });
        self.dirty = true;
        if !under {
            let was = if self.held.is_some() { "stays" } else { "is" };
            self.hold_at_budget();
            return Ok(format!(
                "the money budget of {} is now ${usd}, and it has cost ${cost:.4} already: it {was} paused",
                self.run
            ));
        }
        if let Some(why) = self
            .quota_held
            .clone()
            .filter(|_| self.held.take().is_some())
        {
            return Ok(format!(
                "the money budget of {} is now ${usd} (it has cost ${cost:.4}); it stays {why}",
                self.run
            ));
        }
        if self.held.take().is_some() && !self.stopping {
            self.status = RunStatus::Running;
            self.init.dispatch.hold_run(&self.run, false);
            self.event(RunEvent::Status {
                status: self.status.as_str().into(),
                error: None,
            });
            let line = "[budget] the run goes on".to_owned();
            self.logs.push(line.clone());
            self.event(RunEvent::Log { line });
            return Ok(format!(
                "the money budget of {} is now ${usd} (it has cost ${cost:.4}); the run goes on",
                self.run
            ));
        }
        Ok(format!(
            "the money budget of {} is now ${usd} (it has cost ${cost:.4})",
            self.run
        ))
    }

    /// Keeps the run's new money budget in the store (`budget.json`), for a coordinator that
    /// adopts or resumes it. Writes may finish out of order: each writes the latest budget.
    fn keep_budget(&mut self, usd: f64) {
        let latest = self
            .latest_budget
            .get_or_insert_with(|| Arc::new(std::sync::Mutex::new(usd)))
            .clone();
        *latest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = usd;
        let (store, key) = (
            self.init.store.clone(),
            crate::store::keys::budget(&self.init.run_id),
        );
        self.init.tasks.spawn(async move {
            // One write at a time, each of the latest value: the last to finish has it.
            static WRITES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
            let _one = WRITES.lock().await;
            let usd = *latest.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let body = bytes::Bytes::from(serde_json::json!({ "usd": usd }).to_string());
            if let Err(e) = store.put_overwrite(&key, body).await {
                tracing::warn!(error = %e, "cannot keep the run's new money budget; a coordinator that adopts the run holds it to the one it was launched with");
            }
        });
    }

    /// Stops every live call with `failure` (unless its outcome is in already).
    pub(super) fn stop_live(&self, failure: CallFailure, message: &str) {
        for index in self.book.live() {
            self.init
                .dispatch
                .stop_call(&self.run, index, failure, message);
        }
    }
}
