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
        let live = |c: &Call| c.stage.is_live();
        let index = match agent.parse::<usize>() {
            Ok(i) if i < self.calls.len() => i,
            Ok(i) => {
                return Err(Problem::invalid(format!(
                    "no agent #{i}: this run has {} agents",
                    self.calls.len()
                )));
            }
            Err(_) => {
                let found: Vec<usize> = self
                    .calls
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.label == agent)
                    .map(|(i, _)| i)
                    .collect();
                let alive: Vec<usize> = found
                    .iter()
                    .copied()
                    .filter(|i| live(&self.calls[*i]))
                    .collect();
                match (found.len(), alive.as_slice()) {
                    (0, _) => {
                        return Err(Problem::invalid(format!(
                            "no agent labeled {agent:?} in this run"
                        )));
                    }
                    (_, [one]) => *one,
                    (_, []) => {
                        return Err(Problem::invalid(format!("agent {agent:?} is not running")));
                    }
                    (_, many) => {
                        return Err(Problem::invalid(format!(
                            "{} running agents are labeled {agent:?}; name one by its index ({})",
                            many.len(),
                            many.iter()
                                .map(|i| format!("#{i}"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        )));
                    }
                }
            }
        };
        let c = &self.calls[index];
        if !live(c) {
            return Err(Problem::invalid(format!(
                "agent #{index} ({:?}) is not running",
                c.label
            )));
        }
        let label = c.label.clone();
        match action {
            AgentAction::Stop => {
                self.init.dispatch.stop_call(
                    &self.run,
                    index as u64,
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
                self.init.dispatch.restart_call(&self.run, index as u64);
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
        let mut cancelled = Vec::new();
        for (index, c) in self.calls.iter_mut().enumerate() {
            if c.stage.is_live() {
                c.set(Stage::Cancelled);
                c.end_ms.get_or_insert(now);
                cancelled.push(RunEvent::Call {
                    index: index as u64,
                    label: c.label.clone(),
                    group: c.group.clone(),
                    state: Mark::Cancelled,
                    attempt: None,
                    detail: None,
                });
            }
        }
        for e in cancelled {
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
        for (index, c) in self.calls.iter().enumerate() {
            if c.stage.is_live() {
                self.init
                    .dispatch
                    .stop_call(&self.run, index as u64, failure, message);
            }
        }
    }
}
