//! A run's live view as it crosses the wire ([`SnapshotView`], defined in
//! [`flotilla_proto::wire`]): made from the engine's [`Snapshot`], and back for the terminal
//! progress view.

use super::*;
pub use flotilla_proto::wire::SnapshotView;

impl From<&Snapshot> for SnapshotView {
    fn from(s: &Snapshot) -> Self {
        SnapshotView {
            run_id: s.run_id.clone(),
            workflow: s.workflow.name.clone(),
            description: s.workflow.description.clone(),
            status: s.status,
            elapsed_ms: s.elapsed_now_ms(),
            agents: s.agents,
            done: s.done,
            failed: s.failed,
            running: s.running,
            cached: s.cached,
            input_tokens: s.input_tokens,
            output_tokens: s.output_tokens,
            logs: s.logs.iter().cloned().collect(),
            groups: s.groups.clone(),
            waiting: s.waiting.clone(),
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
            status: v.status,
            elapsed_ms: v.elapsed_ms,
            groups: v.groups.clone(),
            logs: Arc::new(v.logs.clone()),
            agents: v.agents,
            done: v.done,
            failed: v.failed,
            running: v.running,
            cached: v.cached,
            input_tokens: v.input_tokens,
            output_tokens: v.output_tokens,
            waiting: v.waiting.clone(),
            since: None,
        }
    }
}
