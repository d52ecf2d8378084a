//! What is done to a running run from outside or by its limits: pause (W54), stopping the run or
//! one agent (W55), restarting one (W56), and the budgets that end calls (W35, W82).

use super::*;
use flotilla_proto::Problem;

impl RunEngine {
    pub(super) fn pause(&mut self, paused: bool) {
        if self.stopping || (self.status == RunStatus::Paused) == paused {
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
            AgentAction::Restart => {
                if !(c.stage.is_live() && c.running) {
                    return Err(Problem::invalid(format!(
                        "agent #{index} ({label:?}) is queued, not running; nothing to restart"
                    )));
                }
                self.init.dispatch.restart_call(&self.run, index);
                Ok(format!(
                    "restarted agent #{index} ({label:?}) as a new attempt"
                ))
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
        if let Some((line, message)) = crossed.money {
            self.logs.push(line.clone());
            self.event(RunEvent::Log { line });
            self.stop_live(CallFailure::Budget, &message);
        }
        if let Some(message) = crossed.tokens {
            self.init.dispatch.budget_spent(&self.run, &message);
        }
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
