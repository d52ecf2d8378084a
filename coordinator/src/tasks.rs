//! An owner's tasks (issue 30, 4): every task it starts is tracked, so the owner can stop
//! them and wait until they have ended. A leaf: it names nothing of the coordinator.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The tasks of one owner (the coordinator's runs: their engines, journals, event and
/// transcript logs and head keepers), and the token that tells the long-lived ones to stop.
#[derive(Debug, Clone, Default)]
pub struct Tasks {
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl Tasks {
    /// Tasks told to stop when `stop` is cancelled.
    pub fn new(stop: CancellationToken) -> Tasks {
        Tasks {
            tracker: TaskTracker::new(),
            stop,
        }
    }

    /// Tasks tracked by `tracker`, an owner's that others spawn on too (a serving process's),
    /// told to stop when `stop` is cancelled.
    pub fn over(tracker: TaskTracker, stop: CancellationToken) -> Tasks {
        Tasks { tracker, stop }
    }

    /// Starts `task`, tracked; it ends on its own (a writer whose queue was closed).
    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn(task);
    }

    /// Starts `task`, tracked, and drops it where it stands when the owner stops: what it
    /// did is left as a crash of the process would leave it, for whoever takes over.
    pub fn spawn_until_stopped<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let stop = self.stop.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                () = task => {}
                () = stop.cancelled() => {}
            }
        });
    }

    /// Whether the owner was told to stop.
    pub fn stopping(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Tells the tasks to stop and waits at most `within` for every one to end; whether
    /// they all did.
    pub async fn stopped(&self, within: Duration) -> bool {
        self.stop.cancel();
        self.tracker.close();
        tokio::time::timeout(within, self.tracker.wait())
            .await
            .is_ok()
    }

    /// How many are running.
    pub fn running(&self) -> usize {
        self.tracker.len()
    }

    /// The tracker, for a lower module that starts a task of this owner's.
    pub fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stopping_drops_the_long_lived_and_waits_for_the_rest_to_end() {
        let tasks = Tasks::new(CancellationToken::new());
        // Would never end by itself.
        tasks.spawn_until_stopped(std::future::pending());
        // Ends once its queue closes, after the stop.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        tasks.spawn(async move {
            while rx.recv().await.is_some() {}
            let _ = done_tx.send(());
        });
        assert_eq!(tasks.running(), 2);
        assert!(!tasks.stopping());
        // The writer's queue is still open: it is waited for, and the wait runs out.
        assert!(!tasks.stopped(Duration::from_millis(50)).await);
        assert!(tasks.stopping());
        assert_eq!(tasks.running(), 1, "the long-lived one was dropped");
        drop(tx);
        assert!(tasks.stopped(Duration::from_secs(10)).await);
        assert_eq!(tasks.running(), 0);
        done_rx.await.expect("the writer ran to its end");
    }
}
