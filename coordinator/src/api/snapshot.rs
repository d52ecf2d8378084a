//! A run's live view as it crosses the wire ([`SnapshotView`]), made from the engine's
//! [`crate::run::Snapshot`] and back for a client's progress display; both shapes and both
//! conversions are in [`flotilla_proto::wire`].

pub use flotilla_proto::wire::SnapshotView;
