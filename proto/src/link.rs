//! A worker link as a pair of channels carrying protocol messages.
//!
//! In-process workers use [`link_pair`] directly; a remote worker's gRPC stream is bridged to
//! the same two channels, so the dispatcher serves both the same way.

use tokio::sync::mpsc;

use crate::v1::{CoordinatorMessage, WorkerMessage};

/// The worker's end: it sends worker messages and receives coordinator messages.
#[derive(Debug)]
pub struct Link {
    pub tx: mpsc::UnboundedSender<WorkerMessage>,
    pub rx: mpsc::UnboundedReceiver<CoordinatorMessage>,
}

/// The coordinator's end of a [`Link`].
#[derive(Debug)]
pub struct CoordinatorEnd {
    pub tx: mpsc::UnboundedSender<CoordinatorMessage>,
    pub rx: mpsc::UnboundedReceiver<WorkerMessage>,
}

/// An in-process link: the worker's end and the coordinator's end.
pub fn link_pair() -> (Link, CoordinatorEnd) {
    let (to_coord, from_worker) = mpsc::unbounded_channel();
    let (to_worker, from_coord) = mpsc::unbounded_channel();
    (
        Link {
            tx: to_coord,
            rx: from_coord,
        },
        CoordinatorEnd {
            tx: to_worker,
            rx: from_worker,
        },
    )
}
