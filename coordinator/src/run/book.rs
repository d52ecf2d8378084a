//! The run's call book: every call the run accepted, by its index, and the phases (groups)
//! they belong to.
//!
//! The book owns what the run holds of a call — the script's side of it (journaling, ended,
//! result, usage, change) and view data from the dispatcher's events — never its live
//! states, which the dispatcher owns. Indices are dense and never reused: a call's index is
//! its place in the book, the key its journal record, events and branch are filed under.

use std::collections::HashMap;
use std::sync::Arc;

use flotilla_proto::Problem;

use crate::call::{Mark, Stage};
use crate::report::{AgentReport, AttemptSegment, GroupReport, ReportUsage, Summary};
use crate::store::records::{RawJson, RunEvent, UsageRecord};

use super::snapshot::GroupProgress;

/// What the run holds of one call.
#[derive(Debug)]
pub(super) struct Call {
    pub(super) script_id: u64,
    pub(super) key: String,
    pub(super) label: String,
    pub(super) group: String,
    /// Its group's place in the book's groups (views count by it without a lookup).
    pub(super) group_at: usize,
    pub(super) model: String,
    /// What the run holds of it: live (the dispatcher's), journaling, or how it ended.
    pub(super) stage: Stage,
    /// View data from the dispatcher's events, not a state of the run's: an attempt of this
    /// live call holds a worker now (its latest is `attempts`, on `worker`, since `start_ms`).
    pub(super) running: bool,
    pub(super) cached: bool,
    pub(super) cached_from: Option<String>,
    pub(super) attempts: u32,
    pub(super) start_ms: Option<u64>,
    pub(super) end_ms: Option<u64>,
    pub(super) error: Option<String>,
    pub(super) usage: UsageRecord,
    pub(super) live_tokens: u64,
    /// The most its attempts' checkouts held.
    pub(super) disk_bytes: u64,
    pub(super) worker: Option<Arc<str>>,
    /// Its attempts on the run's timeline.
    pub(super) segments: Vec<AttemptSegment>,
    /// Its result as JSON text: parsed again only by the script.
    pub(super) result: Option<RawJson>,
    /// Why it waits although the run has room: no attached worker offers its backend.
    pub(super) waiting_for: Option<String>,
    /// `isolation: 'worktree'`: its change stays on its branch, out of the head.
    pub(super) isolated: bool,
    /// What it changed in the run's source, once applied to the head.
    pub(super) change: Option<crate::head::ChangeRecord>,
    /// Served from this run's own journal (adopted): applied to the head, not journaled again.
    pub(super) own_journal: bool,
    /// The call's trace span (`agent`), open until the call ends.
    pub(super) span: tracing::Span,
}

impl Call {
    /// A live call of the script's `script_id`, named `label`, that has not started: no
    /// attempt, usage, result or change yet. Its key, group, model and isolation are the
    /// caller's to fill in.
    pub(super) fn new(script_id: u64, label: String, span: tracing::Span) -> Call {
        Call {
            span,
            script_id,
            key: String::new(),
            label,
            group: String::new(),
            group_at: 0,
            model: String::new(),
            stage: Stage::Live,
            running: false,
            cached: false,
            cached_from: None,
            attempts: 0,
            start_ms: None,
            end_ms: None,
            error: None,
            usage: UsageRecord::default(),
            live_tokens: 0,
            disk_bytes: 0,
            worker: None,
            segments: Vec::new(),
            result: None,
            waiting_for: None,
            isolated: false,
            change: None,
            own_journal: false,
        }
    }

    /// Moves along the run's part of the call lifecycle ([`Stage::allows`]).
    pub(super) fn set(&mut self, to: Stage) {
        let moved = self.stage.go(to);
        debug_assert!(
            moved,
            "call {:?} cannot go from {:?} to {:?}",
            self.label, self.stage, to
        );
        if !to.is_live() {
            self.running = false;
        }
    }

    /// The event that says this call (at `index`) is now `state`.
    pub(super) fn mark(&self, index: u64, state: Mark, detail: Option<String>) -> RunEvent {
        RunEvent::Call {
            index,
            label: self.label.clone(),
            group: self.group.clone(),
            state,
            attempt: None,
            detail,
        }
    }
}

/// Every call of a run by index, and its groups in the order they were first named.
#[derive(Default)]
pub(super) struct CallBook {
    /// Boxed: a run of many calls grows this by doubling, and moving small pointers costs
    /// far less than moving (and touching fresh pages for) whole calls.
    #[allow(clippy::vec_box)]
    calls: Vec<Box<Call>>,
    groups: Vec<String>,
    /// Position of each group title in `groups`.
    group_index: HashMap<String, usize>,
}

impl CallBook {
    /// A book whose groups start with the script's declared phases (each once).
    pub(super) fn with_phases(phases: &[String]) -> Self {
        let mut book = CallBook::default();
        for p in phases {
            book.group(p);
        }
        book
    }

    /// How many calls the run accepted.
    pub(super) fn len(&self) -> usize {
        self.calls.len()
    }

    /// The index the next call gets.
    pub(super) fn next_index(&self) -> u64 {
        self.calls.len() as u64
    }

    pub(super) fn get(&self, index: u64) -> Option<&Call> {
        self.calls.get(usize::try_from(index).ok()?).map(|c| &**c)
    }

    pub(super) fn get_mut(&mut self, index: u64) -> Option<&mut Call> {
        self.calls
            .get_mut(usize::try_from(index).ok()?)
            .map(|c| &mut **c)
    }

    /// Files a new call under the next index and returns it.
    pub(super) fn push(&mut self, call: Call) -> u64 {
        let index = self.next_index();
        self.calls.push(Box::new(call));
        index
    }

    /// The group titles, in the order they were first named.
    pub(super) fn groups(&self) -> &[String] {
        &self.groups
    }

    /// The place of group `title`, and whether it was new (added now).
    pub(super) fn group(&mut self, title: &str) -> (usize, bool) {
        if let Some(&at) = self.group_index.get(title) {
            return (at, false);
        }
        let at = self.groups.len();
        self.group_index.insert(title.to_owned(), at);
        self.groups.push(title.to_owned());
        (at, true)
    }

    /// The live call that `agent` names — its index, or a label that exactly one live call
    /// carries — with its index, or why there is none.
    pub(super) fn find_live(&self, agent: &str) -> Result<(u64, &Call), Problem> {
        let index = match agent.parse::<usize>() {
            Ok(i) if i < self.calls.len() => i,
            Ok(i) => {
                return Err(Problem::invalid(format!(
                    "no agent #{i}: this run has {} agents",
                    self.calls.len()
                )));
            }
            Err(_) => {
                let found: Vec<(usize, bool)> = self
                    .calls
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.label == agent)
                    .map(|(i, c)| (i, c.stage.is_live()))
                    .collect();
                let alive: Vec<usize> = found
                    .iter()
                    .filter(|(_, live)| *live)
                    .map(|(i, _)| *i)
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
        if !c.stage.is_live() {
            return Err(Problem::invalid(format!(
                "agent #{index} ({:?}) is not running",
                c.label
            )));
        }
        Ok((index as u64, c))
    }

    /// Whether every call has ended and is journaled (none live, none journaling).
    pub(super) fn all_settled(&self) -> bool {
        self.calls
            .iter()
            .all(|c| !c.stage.is_live() && c.stage != crate::call::Stage::Journaling)
    }

    /// The indices of the calls that have not ended.
    pub(super) fn live(&self) -> impl Iterator<Item = u64> + '_ {
        self.calls
            .iter()
            .enumerate()
            .filter(|(_, c)| c.stage.is_live())
            .map(|(i, _)| i as u64)
    }

    /// Cancels every call that has not ended (at `now`), and returns the events that say so.
    pub(super) fn cancel_live(&mut self, now: u64) -> Vec<RunEvent> {
        let mut cancelled = Vec::new();
        for (index, c) in self.calls.iter_mut().enumerate() {
            if c.stage.is_live() {
                c.set(Stage::Cancelled);
                c.end_ms.get_or_insert(now);
                AttemptSegment::close(&mut c.segments, now, "cancelled");
                cancelled.push(c.mark(index as u64, Mark::Cancelled, None));
            }
        }
        cancelled
    }

    /// At the run's end: what the journal confirmed is completed, and a result still waiting
    /// for it was not stored.
    pub(super) fn settle_journaling(&mut self, durable: impl IntoIterator<Item = u64>) {
        for i in durable {
            if let Some(c) = self.get_mut(i)
                && c.stage == Stage::Journaling
            {
                c.set(Stage::Completed);
            }
        }
        for c in &mut self.calls {
            if c.stage == Stage::Journaling {
                c.set(Stage::Failed);
                c.error = Some("the result could not be stored".into());
            }
        }
    }

    /// Counts the calls into `summary` and returns each group's progress.
    pub(super) fn progress(&self, summary: &mut Summary) -> Vec<GroupProgress> {
        let mut groups: Vec<GroupProgress> = self
            .groups
            .iter()
            .map(|t| GroupProgress {
                title: t.clone(),
                ..GroupProgress::default()
            })
            .collect();
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
        groups
    }

    /// What the calls that no attached worker can run wait for, in one line.
    pub(super) fn no_worker_summary(&self) -> Option<String> {
        let mut waiting = self.calls.iter().filter_map(|c| c.waiting_for.as_ref());
        let first = waiting.next()?;
        Some(Summary::agents_wait(first, 1 + waiting.count() as u64))
    }

    /// Each call as the report shows it, counted into `usage`; `live` keeps the states of
    /// calls that have not ended instead of calling them cancelled.
    pub(super) fn agent_reports(&self, live: bool, usage: &mut ReportUsage) -> Vec<AgentReport> {
        usage.agents = self.calls.len() as u64;
        // Each call's attempts are numbered from 1: the highest is how many it took, also
        // across a failover (an attempt taken over keeps its number, and calls served from
        // the run's own journal bring theirs).
        usage.attempts = self.calls.iter().map(|c| u64::from(c.attempts)).sum();
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
                cost_usd: c.usage.cost_usd,
                segments: Vec::new(),
                worker: String::new(),
            });
            if let Some(a) = agents.last_mut() {
                a.set_segments(&c.segments);
            }
        }
        agents
    }

    /// Each group with the labels of its calls.
    pub(super) fn group_reports(&self) -> Vec<GroupReport> {
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
        groups
    }

    /// How many of the calls' kept changes `f` holds for.
    pub(super) fn changes_where(&self, f: impl Fn(&crate::head::ChangeRecord) -> bool) -> u64 {
        self.calls
            .iter()
            .filter_map(|c| c.change.as_ref())
            .filter(|r| f(r))
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(label: &str, group_at: usize) -> Call {
        Call {
            group_at,
            ..Call::new(0, label.into(), tracing::Span::none())
        }
    }

    #[test]
    fn groups_keep_the_order_they_were_first_named_and_each_is_filed_once() {
        let mut book = CallBook::with_phases(&["a".into(), "b".into(), "a".into()]);
        assert_eq!(book.groups(), ["a", "b"]);
        assert_eq!(book.group("b"), (1, false));
        assert_eq!(book.group("c"), (2, true));
        assert_eq!(book.groups(), ["a", "b", "c"]);
    }

    #[test]
    fn an_agent_is_found_by_index_or_by_the_label_of_the_one_live_call_that_carries_it() {
        let mut book = CallBook::default();
        assert_eq!(book.push(call("x", 0)), 0);
        assert_eq!(book.push(call("x", 0)), 1);
        assert_eq!(book.push(call("y", 0)), 2);
        let twice = book.find_live("x").unwrap_err().to_string();
        assert!(twice.contains("#0, #1"), "{twice}");
        book.get_mut(0).unwrap().set(Stage::Failed);
        assert_eq!(book.find_live("x").unwrap().0, 1);
        assert_eq!(book.find_live("2").unwrap().0, 2);
        assert!(
            book.find_live("0")
                .unwrap_err()
                .to_string()
                .contains("is not running")
        );
        assert!(
            book.find_live("7")
                .unwrap_err()
                .to_string()
                .contains("has 3 agents")
        );
        assert!(
            book.find_live("z")
                .unwrap_err()
                .to_string()
                .contains("no agent labeled")
        );
        assert_eq!(book.live().collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn cancelling_ends_only_live_calls_and_says_so_for_each() {
        let mut book = CallBook::default();
        book.push(call("done", 0));
        book.get_mut(0).unwrap().set(Stage::Journaling);
        book.push(call("live", 0));
        let events = book.cancel_live(42);
        assert_eq!(events.len(), 1);
        assert!(matches!(
            &events[0],
            RunEvent::Call {
                index: 1,
                state: Mark::Cancelled,
                ..
            }
        ));
        assert_eq!(book.get(1).unwrap().stage, Stage::Cancelled);
        assert_eq!(book.get(1).unwrap().end_ms, Some(42));
        assert_eq!(book.live().count(), 0);
        // At the end, a result the journal never confirmed was not stored.
        book.settle_journaling([]);
        assert_eq!(book.get(0).unwrap().stage, Stage::Failed);
        assert!(
            book.get(0)
                .unwrap()
                .error
                .as_deref()
                .unwrap()
                .contains("not be stored")
        );
    }
}
