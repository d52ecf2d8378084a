//! Fair share: runs take turns (round robin), so one big run cannot starve another.

use std::collections::VecDeque;
use std::sync::Arc;

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
