//! Usage-limit gates (W59): a rate-limited attempt closes its backend/model gate for everyone
//! until the limit resets; calls that would start behind a closed gate are parked on it and go,
//! in the order they came, once it opens.

use std::collections::HashMap;

use flotilla_proto::v1;
use tokio::time::Instant;

use super::handle::CallId;

/// The gate a task goes through: its backend and model.
pub(super) fn gate_of(task: &v1::TaskSpec) -> String {
    format!("{}/{}", task.backend, task.model)
}

#[derive(Debug, Default)]
pub(super) struct Gates {
    /// Closed gates, and until when.
    until: HashMap<String, Instant>,
    /// Calls parked on each gate, in the order they came.
    parked: HashMap<String, Vec<CallId>>,
}

impl Gates {
    /// Closes `gate` until `until` (a later close wins).
    pub fn close(&mut self, gate: String, until: Instant) {
        let e = self.until.entry(gate).or_insert(until);
        if *e < until {
            *e = until;
        }
    }

    /// Until when `gate` is closed at `now`, if it is.
    pub fn closed(&self, gate: &str, now: Instant) -> Option<Instant> {
        self.until.get(gate).copied().filter(|t| *t > now)
    }

    /// Parks a call on a closed gate. `true`: the first one parked there (the caller sets the
    /// gate's timer).
    pub fn park(&mut self, gate: &str, id: CallId) -> bool {
        let list = self.parked.entry(gate.to_owned()).or_default();
        list.push(id);
        list.len() == 1
    }

    /// Opens `gate` if its time has come: `Ok` with the calls parked on it (in the order they
    /// came); `Err(until)` while it is still closed.
    pub fn open(&mut self, gate: &str, now: Instant) -> Result<Vec<CallId>, Instant> {
        if let Some(until) = self.closed(gate, now) {
            return Err(until);
        }
        self.until.remove(gate);
        Ok(self.parked.remove(gate).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn id(call: u64) -> CallId {
        (Arc::from("wf_gates"), call)
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_gate_holds_its_calls_until_the_latest_reset_and_lets_them_go_in_order() {
        let mut g = Gates::default();
        let now = Instant::now();
        g.close("claude/opus".into(), now + Duration::from_secs(5));
        g.close("claude/opus".into(), now + Duration::from_secs(2));
        assert_eq!(
            g.closed("claude/opus", now),
            Some(now + Duration::from_secs(5)),
            "an earlier reset never shortens the wait"
        );
        assert_eq!(
            g.closed("claude/sonnet", now),
            None,
            "other models are not held"
        );
        assert!(g.park("claude/opus", id(3)));
        assert!(!g.park("claude/opus", id(1)), "one timer per gate");
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(
            g.open("claude/opus", Instant::now()),
            Err(now + Duration::from_secs(5))
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            g.open("claude/opus", Instant::now()),
            Ok(vec![id(3), id(1)])
        );
        assert_eq!(g.closed("claude/opus", Instant::now()), None);
        assert_eq!(g.open("claude/opus", Instant::now()), Ok(vec![]));
    }

    #[test]
    fn the_gate_is_the_backend_and_model() {
        let task = v1::TaskSpec {
            backend: "claude".into(),
            model: "opus".into(),
            ..v1::TaskSpec::default()
        };
        assert_eq!(gate_of(&task), "claude/opus");
    }
}
