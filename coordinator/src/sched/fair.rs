//! Fair share: namespaces share the slots by weight — the next call comes from the namespace
//! with the fewest running agents for its weight (ties take turns), and none past its cap —
//! and within a namespace runs take turns (round robin), so one big run cannot starve another.

use std::collections::VecDeque;
use std::sync::Arc;

/// A run's namespace and what its operator set for it, as the dispatcher uses them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub namespace: Arc<str>,
    /// Its share of the slots against other namespaces' (at least 1).
    pub weight: u32,
    /// Agents of the namespace that run at once, at most.
    pub max_agents: Option<usize>,
}

impl Default for Share {
    fn default() -> Self {
        Share {
            namespace: Arc::from(crate::namespace::DEFAULT),
            weight: 1,
            max_agents: None,
        }
    }
}

#[derive(Debug)]
struct Space {
    name: Arc<str>,
    weight: u64,
    max_agents: Option<usize>,
    turns: Turns,
    runs: usize,
}

/// The namespaces with runs, and the order their runs take turns in.
#[derive(Debug, Default)]
pub(super) struct Shares {
    /// In turn order: a namespace that takes a call goes to the back, so ties rotate.
    spaces: Vec<Space>,
}

impl Shares {
    /// A run joins its namespace's turns; the namespace's weight and cap are the latest run's.
    pub fn join(&mut self, run: Arc<str>, share: &Share) {
        let i = match self.spaces.iter().position(|s| s.name == share.namespace) {
            Some(i) => i,
            None => {
                self.spaces.push(Space {
                    name: share.namespace.clone(),
                    weight: 1,
                    max_agents: None,
                    turns: Turns::default(),
                    runs: 0,
                });
                self.spaces.len() - 1
            }
        };
        let s = &mut self.spaces[i];
        s.weight = u64::from(share.weight.max(1));
        s.max_agents = share.max_agents;
        s.turns.join(run);
        s.runs += 1;
    }

    pub fn leave(&mut self, run: &Arc<str>, namespace: &str) {
        if let Some(i) = self.spaces.iter().position(|s| &*s.name == namespace) {
            let s = &mut self.spaces[i];
            s.turns.leave(run);
            s.runs = s.runs.saturating_sub(1);
            if s.runs == 0 {
                self.spaces.remove(i);
            }
        }
    }

    /// The run that takes the next call: from the namespace with the fewest `running` agents
    /// for its weight that is under its cap and has a run that `can_take` one (its runs in
    /// turn).
    pub fn next(
        &mut self,
        running: impl Fn(&str) -> usize,
        mut can_take: impl FnMut(&Arc<str>) -> bool,
    ) -> Option<Arc<str>> {
        let mut order: Vec<(usize, u64)> = self
            .spaces
            .iter()
            .enumerate()
            .map(|(i, s)| (i, running(&s.name) as u64))
            .collect();
        // Fewest running per weight first: a/wa < b/wb as a*wb < b*wa. Stable: ties keep the
        // turn order.
        order.sort_by(|(i, a), (j, b)| {
            (a * self.spaces[*j].weight).cmp(&(b * self.spaces[*i].weight))
        });
        for (i, running) in order {
            let s = &mut self.spaces[i];
            if s.max_agents.is_some_and(|m| running as usize >= m) {
                continue;
            }
            if let Some(run) = s.turns.next(&mut can_take) {
                let taken = self.spaces.remove(i);
                self.spaces.push(taken);
                return Some(run);
            }
        }
        None
    }
}

/// The order runs take their turns in.
#[derive(Debug, Default)]
pub(super) struct Turns {
    order: VecDeque<Arc<str>>,
}

impl Turns {
    pub fn join(&mut self, run: Arc<str>) {
        self.order.push_back(run);
    }

    pub fn leave(&mut self, run: &Arc<str>) {
        self.order.retain(|r| r != run);
    }

    /// The next run, in turn, that `can_take` a call; it goes to the back of the line.
    pub fn next(&mut self, mut can_take: impl FnMut(&Arc<str>) -> bool) -> Option<Arc<str>> {
        for _ in 0..self.order.len() {
            let run = self.order.pop_front()?;
            self.order.push_back(run.clone());
            if can_take(&run) {
                return Some(run);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(ns: &str, weight: u32, max_agents: Option<usize>) -> Share {
        Share {
            namespace: Arc::from(ns),
            weight,
            max_agents,
        }
    }

    /// Slots fill 3:1 between namespaces of weights 3 and 1, whichever has more runs, and a
    /// freed slot goes back to the namespace below its share.
    #[test]
    fn namespaces_share_slots_by_weight_and_runs_take_turns_within_one() {
        let mut s = Shares::default();
        s.join(Arc::from("a1"), &share("a", 3, None));
        for r in ["b1", "b2", "b3"] {
            s.join(Arc::from(r), &share("b", 1, None));
        }
        let mut running = std::collections::HashMap::<String, usize>::new();
        let ns = |run: &str| run[..1].to_owned();
        for _ in 0..16 {
            let run = s
                .next(|n| running.get(n).copied().unwrap_or(0), |_| true)
                .unwrap();
            *running.entry(ns(&run)).or_default() += 1;
        }
        assert_eq!((running["a"], running["b"]), (12, 4));
        // Two of a's end: both slots go back to a.
        *running.get_mut("a").unwrap() -= 2;
        for _ in 0..2 {
            let run = s
                .next(|n| running.get(n).copied().unwrap_or(0), |_| true)
                .unwrap();
            assert_eq!(&*run, "a1");
            *running.get_mut("a").unwrap() += 1;
        }
        // b's runs took turns.
        let mut picks = Vec::new();
        let none = |_: &str| 0;
        for _ in 0..6 {
            picks.push(s.next(none, |r| r.starts_with('b')).unwrap().to_string());
        }
        picks.sort();
        assert_eq!(picks, ["b1", "b1", "b2", "b2", "b3", "b3"]);
    }

    #[test]
    fn a_namespace_at_its_cap_waits_and_the_others_go_on() {
        let mut s = Shares::default();
        s.join(Arc::from("a1"), &share("a", 5, Some(2)));
        s.join(Arc::from("b1"), &share("b", 1, None));
        let running = |n: &str| if n == "a" { 2 } else { 7 };
        assert_eq!(s.next(running, |_| true).as_deref(), Some("b1"));
        assert_eq!(
            s.next(running, |r| &**r == "a1"),
            None,
            "a waits at its cap"
        );
        s.leave(&Arc::from("b1"), "b");
        s.leave(&Arc::from("a1"), "a");
        assert_eq!(s.next(|_| 0, |_| true), None);
    }

    #[test]
    fn runs_take_turns_and_one_that_cannot_take_a_call_is_skipped() {
        let mut t = Turns::default();
        for r in ["a", "b", "c"] {
            t.join(Arc::from(r));
        }
        let picks: Vec<String> = (0..4)
            .map(|_| t.next(|r| &**r != "b").unwrap().to_string())
            .collect();
        assert_eq!(picks, ["a", "c", "a", "c"]);
        t.leave(&Arc::from("a"));
        assert_eq!(t.next(|_| true).as_deref(), Some("b"));
        assert_eq!(t.next(|_| false), None, "nobody can take one: no pick");
        assert_eq!(
            t.next(|_| true).as_deref(),
            Some("c"),
            "the line kept turning"
        );
    }
}
