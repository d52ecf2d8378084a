//! The run report. Its shape crosses the wire, so it lives in [`flotilla_proto::wire`]; this
//! is where the coordinator's code finds it.

pub use flotilla_proto::wire::{
    AgentReport, AttemptSegment, ChangesSummary, Delivery, GroupReport, REPORT_AGENTS, Report,
    ReportUsage, RunStatus, Summary,
};
