//! The live [`Snapshot`] of a run: what progress displays, the API's `Status` and the pages
//! read. The run publishes it ([`super::RunEngine`]'s view); its shape is the wire's, in
//! [`flotilla_proto::wire`], so a client's progress display draws it without the coordinator.

pub use flotilla_proto::wire::Snapshot;

/// Progress of one group: the same shape the live view sends over the wire.
pub use flotilla_proto::wire::GroupView as GroupProgress;
