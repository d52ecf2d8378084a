//! The stall watchdog of a call's current attempt (W58), a type that owns its state: when
//! the attempt was last heard from, whether its timer is held (a tool call in flight, the
//! workspace being made), and its timer in the dispatcher's queue. The dispatcher arms it
//! when an assignment goes out, tells it what the attempt says, and asks it when the timer
//! is due; it names nothing of the dispatcher (its timers are whatever item the queue holds).

use std::time::Duration;

use flotilla_proto::v1::ProgressKind;
use tokio::time::Instant;
use tokio_util::time::{DelayQueue, delay_queue};

#[derive(Debug)]
pub(super) struct Watchdog {
    last_heard: Instant,
    /// A tool call in flight, or the workspace being made: the timer is held.
    held: bool,
    timer: Option<delay_queue::Key>,
}

impl Watchdog {
    pub(super) fn new() -> Watchdog {
        Watchdog {
            last_heard: Instant::now(),
            held: false,
            timer: None,
        }
    }

    /// An attempt was sent: quiet from now, due `stall` from now as `item` in `timers`.
    pub(super) fn arm<T>(&mut self, timers: &mut DelayQueue<T>, item: T, stall: Duration) {
        self.disarm_timer(timers);
        self.last_heard = Instant::now();
        self.timer = Some(timers.insert_at(item, self.last_heard + stall));
    }

    /// Holds the timer (the workspace is being made before the agent starts) or lets it go.
    pub(super) fn hold(&mut self, held: bool) {
        self.held = held;
    }

    /// The attempt said `kind`: heard from now; a tool call or the workspace holds the
    /// timer until the tool finishes or the agent starts.
    pub(super) fn heard(&mut self, kind: ProgressKind) {
        self.last_heard = Instant::now();
        match kind {
            ProgressKind::ToolStarted | ProgressKind::Preparing => self.held = true,
            ProgressKind::ToolFinished | ProgressKind::AgentStarted => self.held = false,
            _ => {}
        }
    }

    /// The attempt ended: its timer goes, and nothing holds it any more.
    pub(super) fn disarm<T>(&mut self, timers: &mut DelayQueue<T>) {
        self.disarm_timer(timers);
        self.held = false;
    }

    fn disarm_timer<T>(&mut self, timers: &mut DelayQueue<T>) {
        if let Some(key) = self.timer.take() {
            timers.remove(&key);
        }
    }

    /// Its timer came due: the queue gave it back, so there is nothing to remove any more.
    pub(super) fn fired(&mut self) {
        self.timer = None;
    }

    /// After [`Watchdog::fired`]: the time the attempt has been quiet when it stalled; `None`
    /// when it did not (a hold, or heard from since), and it is set again as `item`, for
    /// `stall` after it was last heard from (or from now, while held).
    pub(super) fn due<T>(
        &mut self,
        timers: &mut DelayQueue<T>,
        item: T,
        stall: Duration,
    ) -> Option<Duration> {
        let now = Instant::now();
        let quiet = now.saturating_duration_since(self.last_heard);
        if !self.held && quiet >= stall {
            return Some(quiet);
        }
        let at = if self.held {
            now + stall
        } else {
            self.last_heard + stall
        };
        self.timer = Some(timers.insert_at(item, at));
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_quiet_attempt_stalls_and_a_tool_call_or_a_word_puts_it_off() {
        let stall = Duration::from_secs(10);
        let mut timers = DelayQueue::new();
        let mut w = Watchdog::new();
        w.arm(&mut timers, "a", stall);
        assert_eq!(timers.len(), 1);
        // Heard from after 6 s: not stalled at 10 s, set again for 16 s.
        tokio::time::advance(Duration::from_secs(6)).await;
        w.heard(ProgressKind::Output);
        tokio::time::advance(Duration::from_secs(4)).await;
        // (the queue hands the expired timer back before the dispatcher asks)
        assert_eq!(timers.len(), 1);
        w.fired();
        timers.clear();
        assert_eq!(w.due(&mut timers, "a", stall), None);
        assert_eq!(timers.len(), 1);
        // A tool call in flight holds it, however long it is quiet.
        w.heard(ProgressKind::ToolStarted);
        tokio::time::advance(Duration::from_secs(60)).await;
        w.fired();
        timers.clear();
        assert_eq!(w.due(&mut timers, "a", stall), None);
        // Once the tool is done and it is quiet for the whole timeout, it stalled.
        w.heard(ProgressKind::ToolFinished);
        tokio::time::advance(Duration::from_secs(11)).await;
        w.fired();
        timers.clear();
        assert_eq!(
            w.due(&mut timers, "a", stall),
            Some(Duration::from_secs(11))
        );
        assert!(
            timers.is_empty(),
            "a stalled attempt's timer is not set again"
        );
        // A new attempt, then its end: its timer is gone and nothing holds it.
        w.arm(&mut timers, "b", stall);
        w.hold(true);
        assert_eq!(timers.len(), 1);
        w.disarm(&mut timers);
        assert!(timers.is_empty());
        assert!(!w.held);
        // Arming again replaces a live timer rather than adding one.
        w.arm(&mut timers, "c", stall);
        w.arm(&mut timers, "d", stall);
        assert_eq!(timers.len(), 1);
    }
}
