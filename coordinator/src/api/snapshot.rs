//! A run's live view as it crosses the wire ([`SnapshotView`], defined in
//! [`flotilla_proto::wire`]): made from the engine's [`Snapshot`], and back for the terminal
//! progress view.

use std::sync::Arc;

use crate::run::Snapshot;

pub use flotilla_proto::wire::SnapshotView;

impl From<&Snapshot> for SnapshotView {
    fn from(s: &Snapshot) -> Self {
        SnapshotView {
            run_id: s.run_id.clone(),
            workflow: s.workflow.name.clone(),
            description: s.workflow.description.clone(),
            summary: s.summary_now(),
            logs: s.logs.iter().cloned().collect(),
            groups: s.groups.clone(),
        }
    }
}

/// The live snapshot again (what the terminal progress view draws).
impl From<&SnapshotView> for Snapshot {
    fn from(v: &SnapshotView) -> Snapshot {
        Snapshot {
            run_id: v.run_id.clone(),
            workflow: crate::store::records::WorkflowInfo {
                name: v.workflow.clone(),
                description: v.description.clone(),
            },
            summary: v.summary.clone(),
            groups: v.groups.clone(),
            logs: Arc::new(v.logs.clone()),
            since: None,
        }
    }
}
