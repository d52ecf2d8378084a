//! A run's budgets (issue 30, 2): what it has used (tokens and money, in all and before its
//! calls are known), the ceilings it was given, and whether each was crossed. The engine adds
//! each attempt's usage here and acts on what crossed; admission reads what was spent.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::script::runtime::ScriptShared;
use crate::store::records::UsageRecord;

/// What crossed a ceiling with the usage just added: each is said once.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Crossed {
    /// The money budget (`budget_usd`): the run's log line and the calls' error.
    pub money: Option<(String, String)>,
    /// The token budget (W35): the error the calls not started end with.
    pub tokens: Option<String>,
}

pub(super) struct Budgets {
    /// What the run has used, the sum of its agents'.
    used: UsageRecord,
    /// Usage reported for calls the script has not made (yet): an attempt that outlived a
    /// failed-over coordinator reports before the replaying script reaches its call. It is
    /// in `used` already, and goes to its call when the call is made.
    early: HashMap<u64, UsageRecord>,
    /// Output tokens, shared with nested workflows and the script's `budget.spent()`.
    shared: Arc<ScriptShared>,
    budget_usd: Option<f64>,
    budget_tokens: Option<u64>,
    money_spent: bool,
    tokens_spent: bool,
    /// Calls that failed instead of retrying: the retry budget was spent.
    retries_refused: u64,
}

impl Budgets {
    pub(super) fn new(
        shared: Arc<ScriptShared>,
        budget_usd: Option<f64>,
        budget_tokens: Option<u64>,
    ) -> Budgets {
        Budgets {
            used: UsageRecord::default(),
            early: HashMap::new(),
            shared,
            budget_usd,
            budget_tokens,
            money_spent: false,
            tokens_spent: false,
            retries_refused: 0,
        }
    }

    /// What the run has used.
    pub(super) fn used(&self) -> &UsageRecord {
        &self.used
    }

    /// Output tokens spent by the run and the workflows it started.
    pub(super) fn output_tokens(&self) -> u64 {
        self.shared.spent.load(Ordering::Relaxed)
    }

    /// An attempt's usage, costed: counted, and checked against the ceilings.
    pub(super) fn add(&mut self, u: &UsageRecord) -> Crossed {
        self.used.add(u);
        self.shared
            .spent
            .fetch_add(u.output_tokens, Ordering::Relaxed);
        Crossed {
            money: self.money_crossed(),
            tokens: self.tokens_crossed(),
        }
    }

    /// What a call took before a failover, carried on in the same run (its tokens and cost
    /// are this run's, its budget too). Crosses nothing now: the next usage says it.
    pub(super) fn carry(&mut self, u: &UsageRecord) {
        self.used.add(u);
        self.shared
            .spent
            .fetch_add(u.output_tokens, Ordering::Relaxed);
    }

    /// Whether what was carried over has reached the money budget, said once (as [`Budgets::add`]
    /// says a crossing): a run adopted over its budget is held before it starts anything.
    pub(super) fn carried_over_money(&mut self) -> bool {
        let over = self
            .budget_usd
            .is_some_and(|limit| self.used.cost_usd >= limit);
        if !over || self.money_spent {
            return false;
        }
        self.money_spent = true;
        true
    }

    /// Keeps usage of call `call`, not made yet, for when it is.
    pub(super) fn keep_early(&mut self, call: u64, u: &UsageRecord) {
        self.early.entry(call).or_default().add(u);
    }

    /// The usage kept for call `call` before it was made, if any.
    pub(super) fn take_early(&mut self, call: u64) -> Option<UsageRecord> {
        self.early.remove(&call)
    }

    /// The money budget, if the run has one.
    pub(super) fn usd(&self) -> Option<f64> {
        self.budget_usd
    }

    /// The money budget set anew (`flotilla budget`): whether the run is under it. Once
    /// under, crossing it again is said again.
    pub(super) fn set_usd(&mut self, usd: f64) -> bool {
        self.budget_usd = Some(usd);
        let under = self.used.cost_usd < usd;
        self.money_spent = !under;
        under
    }

    /// A call failed instead of retrying: the retry budget was spent.
    pub(super) fn refused_retry(&mut self) {
        self.retries_refused += 1;
    }

    /// Calls that failed instead of retrying.
    pub(super) fn retries_refused(&self) -> u64 {
        self.retries_refused
    }

    fn money_crossed(&mut self) -> Option<(String, String)> {
        let limit = self.budget_usd?;
        if self.used.cost_usd < limit || self.money_spent {
            return None;
        }
        self.money_spent = true;
        let line = format!(
            "[budget] the run has cost ${:.4} of its ${limit} budget: running agents are stopped and no new agent starts",
            self.used.cost_usd
        );
        let message = format!(
            "money budget exceeded (${:.4} / ${limit}); completed results are kept",
            self.used.cost_usd
        );
        Some((line, message))
    }

    fn tokens_crossed(&mut self) -> Option<String> {
        let total = self.budget_tokens?;
        let spent = self.output_tokens();
        if spent < total || self.tokens_spent {
            return None;
        }
        self.tokens_spent = true;
        Some(super::admit::token_budget_exceeded(spent, total))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(output_tokens: u64, cost_usd: f64) -> UsageRecord {
        UsageRecord {
            output_tokens,
            cost_usd,
            ..UsageRecord::default()
        }
    }

    #[test]
    fn each_ceiling_is_crossed_once_and_usage_adds_up_with_the_shared_count() {
        let shared = Arc::new(ScriptShared::default());
        let mut b = Budgets::new(shared.clone(), Some(1.0), Some(100));
        assert_eq!(b.add(&usage(60, 0.5)), Crossed::default());
        let crossed = b.add(&usage(50, 0.6));
        assert!(
            crossed
                .money
                .as_ref()
                .unwrap()
                .1
                .contains("money budget exceeded ($1.1000 / $1)")
        );
        assert!(crossed.tokens.as_ref().unwrap().contains("110 / 100"));
        // Said once: more usage crosses nothing again.
        assert_eq!(b.add(&usage(5, 0.1)), Crossed::default());
        assert_eq!(b.used().output_tokens, 115);
        assert_eq!(shared.spent.load(Ordering::Relaxed), 115);
        assert_eq!(b.output_tokens(), 115);
    }

    #[test]
    fn a_money_budget_set_anew_is_crossed_again_once_under_it() {
        let mut b = Budgets::new(Arc::new(ScriptShared::default()), Some(1.0), None);
        assert!(b.add(&usage(0, 1.2)).money.is_some());
        assert!(!b.set_usd(1.1), "still over");
        assert_eq!(b.add(&usage(0, 0.1)), Crossed::default(), "said once");
        assert!(b.set_usd(2.0));
        assert_eq!(b.usd(), Some(2.0));
        assert_eq!(b.add(&usage(0, 0.5)), Crossed::default());
        assert!(b.add(&usage(0, 0.3)).money.is_some(), "crossed again");
    }

    #[test]
    fn without_ceilings_nothing_crosses_and_early_usage_waits_for_its_call() {
        let mut b = Budgets::new(Arc::new(ScriptShared::default()), None, None);
        assert_eq!(b.add(&usage(1_000_000, 1e6)), Crossed::default());
        b.keep_early(7, &usage(3, 0.0));
        b.keep_early(7, &usage(4, 0.0));
        assert_eq!(b.take_early(7).unwrap().output_tokens, 7);
        assert!(b.take_early(7).is_none());
        b.carry(&usage(10, 0.0));
        assert!(!b.carried_over_money(), "no money budget");
        let mut m = Budgets::new(Arc::new(ScriptShared::default()), Some(1.0), None);
        m.carry(&usage(0, 0.4));
        assert!(!m.carried_over_money());
        m.carry(&usage(0, 0.7));
        assert!(m.carried_over_money());
        assert!(!m.carried_over_money(), "said once");
        assert_eq!(m.add(&usage(0, 0.1)), Crossed::default());
        assert_eq!(b.used().output_tokens, 1_000_010);
        b.refused_retry();
        assert_eq!(b.retries_refused(), 1);
    }
}
