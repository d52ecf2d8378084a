//! The live view of a run as it crosses the wire (`status`, the session page's JSON).

use super::*;

/// The parts of a live snapshot a client shows.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SnapshotView {
    pub run_id: String,
    pub workflow: String,
    pub status: Option<RunStatus>,
    pub elapsed_ms: u64,
    pub agents: u64,
    pub done: u64,
    pub failed: u64,
    pub running: u64,
    pub cached: u64,
    pub output_tokens: u64,
    pub logs: Vec<String>,
    pub groups: Vec<(String, u64, u64)>,
    /// The rest of the live snapshot, for `flotilla watch`.
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub waiting: Option<String>,
    /// Per group: title, total, done, failed, running, output tokens.
    #[serde(default)]
    pub group_detail: Vec<(String, u64, u64, u64, u64, u64)>,
}

impl SnapshotView {
    /// The live snapshot again (what the terminal progress view draws).
    pub fn to_snapshot(&self) -> Snapshot {
        Snapshot {
            run_id: self.run_id.clone(),
            workflow: crate::store::records::WorkflowInfo {
                name: self.workflow.clone(),
                description: self.description.clone(),
            },
            status: self.status,
            elapsed_ms: self.elapsed_ms,
            groups: self
                .group_detail
                .iter()
                .map(|(title, total, done, failed, running, output_tokens)| {
                    crate::run::GroupProgress {
                        title: title.clone(),
                        total: *total,
                        done: *done,
                        failed: *failed,
                        running: *running,
                        output_tokens: *output_tokens,
                    }
                })
                .collect(),
            logs: Arc::new(self.logs.clone()),
            agents: self.agents,
            done: self.done,
            failed: self.failed,
            running: self.running,
            cached: self.cached,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            waiting: self.waiting.clone(),
            since: None,
        }
    }
}

impl SnapshotView {
    /// The same view of a run that ended, from its report.
    pub fn from_report(r: &Report) -> SnapshotView {
        let groups = r
            .groups
            .iter()
            .map(|g| {
                let ended = r
                    .agents
                    .iter()
                    .filter(|a| a.group == g.title && a.status != "running")
                    .count() as u64;
                (g.title.clone(), ended, g.agents.len() as u64)
            })
            .collect();
        SnapshotView {
            run_id: r.run_id.clone(),
            workflow: r.workflow.name.clone(),
            status: Some(r.status),
            elapsed_ms: r.usage.duration_ms,
            agents: r.usage.agents,
            done: r.agents.iter().filter(|a| a.status == "completed").count() as u64,
            failed: r.usage.errors,
            running: 0,
            cached: r.usage.cached,
            output_tokens: r.usage.output_tokens,
            logs: r.logs.clone(),
            description: r.workflow.description.clone(),
            input_tokens: r.usage.input_tokens,
            waiting: None,
            group_detail: r
                .groups
                .iter()
                .map(|g| {
                    let of = |st: &str| {
                        r.agents
                            .iter()
                            .filter(|a| a.group == g.title && a.status == st)
                            .count() as u64
                    };
                    let tokens = r
                        .agents
                        .iter()
                        .filter(|a| a.group == g.title)
                        .map(|a| a.output_tokens)
                        .sum();
                    (
                        g.title.clone(),
                        g.agents.len() as u64,
                        of("completed"),
                        of("failed"),
                        0,
                        tokens,
                    )
                })
                .collect(),
            groups,
        }
    }
}

impl From<&Snapshot> for SnapshotView {
    fn from(s: &Snapshot) -> Self {
        SnapshotView {
            run_id: s.run_id.clone(),
            workflow: s.workflow.name.clone(),
            status: s.status,
            elapsed_ms: s.elapsed_now_ms(),
            agents: s.agents,
            done: s.done,
            failed: s.failed,
            running: s.running,
            cached: s.cached,
            output_tokens: s.output_tokens,
            logs: s.logs.iter().cloned().collect(),
            groups: s
                .groups
                .iter()
                .map(|g| (g.title.clone(), g.done + g.failed, g.total))
                .collect(),
            description: s.workflow.description.clone(),
            input_tokens: s.input_tokens,
            waiting: s.waiting.clone(),
            group_detail: s
                .groups
                .iter()
                .map(|g| {
                    (
                        g.title.clone(),
                        g.total,
                        g.done,
                        g.failed,
                        g.running,
                        g.output_tokens,
                    )
                })
                .collect(),
        }
    }
}
