//! The source server (issue 30, 2): answers the source requests workers send on their links
//! from the store, each transfer a task of its own that reads the store off the dispatcher's
//! actor and paces itself by the worker's acknowledgments. The dispatcher decides only whom
//! a request may be answered for (the namespace of an attempt the worker holds); this owns
//! the store, the transfers under way and their acknowledgments.

use std::collections::HashMap;

use flotilla_proto::v1::{self, CoordinatorMessage, coordinator_message};
use tokio::sync::{mpsc, watch};
use tokio_util::task::TaskTracker;

use crate::store::Store;

pub(super) struct SourceServer {
    /// Where runs' sources are; `None`: this coordinator keeps none.
    store: Option<Store>,
    /// Transfers under way, by worker and request: where the worker's acknowledgments go
    /// (see [`crate::source::serve`]).
    acks: HashMap<(u64, u64), watch::Sender<u64>>,
    /// The dispatcher's tasks: each transfer is one.
    tasks: TaskTracker,
}

impl SourceServer {
    pub(super) fn new(store: Option<Store>, tasks: TaskTracker) -> SourceServer {
        SourceServer {
            store,
            acks: HashMap::new(),
            tasks,
        }
    }

    /// The store runs' sources and attempts' leftovers are kept in, if this coordinator
    /// keeps them.
    pub(super) fn store(&self) -> Option<&Store> {
        self.store.as_ref()
    }

    /// Takes `req` if it acknowledges what a transfer under way sent (or one that ended):
    /// `true` when there is nothing more to do with it.
    pub(super) fn acknowledged(&mut self, worker: u64, req: &v1::SourceRequest) -> bool {
        if let Some(acks) = self.acks.get(&(worker, req.id))
            && !acks.is_closed()
        {
            if req.acked > 0 {
                acks.send_replace(req.acked);
            }
            return true;
        }
        // Transfers that ended leave their entries; they go as new ones come.
        self.acks.retain(|_, a| !a.is_closed());
        req.acked > 0
    }

    /// Starts answering `worker`'s request `req` on its link `tx` from `namespace`'s sources;
    /// `namespace` `None`: no attempt of the worker's wants it, and the worker is told so.
    pub(super) fn serve(
        &mut self,
        worker: u64,
        req: v1::SourceRequest,
        tx: mpsc::UnboundedSender<CoordinatorMessage>,
        namespace: Option<String>,
    ) {
        let refuse = |error: String| {
            let _ = tx.send(CoordinatorMessage {
                msg: Some(coordinator_message::Msg::SourceData(v1::SourceData {
                    request: req.id,
                    done: true,
                    error,
                    ..v1::SourceData::default()
                })),
            });
        };
        let Some(namespace) = namespace else {
            refuse(format!(
                "commit {} of {} is not the source of an attempt this worker runs: the coordinator sends a source only to the attempts it gave",
                req.commit, req.repo
            ));
            return;
        };
        let Some(store) = &self.store else {
            refuse("this coordinator keeps no sources".into());
            return;
        };
        let (acks, acked) = watch::channel(0u64);
        self.acks.insert((worker, req.id), acks);
        self.tasks.spawn(crate::source::serve(
            store.clone(),
            namespace,
            req,
            tx,
            acked,
        ));
    }
}
