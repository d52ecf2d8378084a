//! `flotilla-worker`: runs agent attempts for a coordinator.
//!
//! - [`backend`]: the `AgentBackend` seam and its implementations (`echo`, `exec`).
//! - [`worker`]: the loop that serves one link to a coordinator: `Hello`, assignments against
//!   free slots, progress and transcript events, one outcome per assignment, cancels.
//! - [`workspace`]: per-call working directories confined to the workspace root.
//! - [`source`]: run sources fetched through the link into a cache, a checkout per call.
//! - [`layers`]: copy-on-write checkouts: overlayfs views of one shared tree per commit.
//! - [`meters`]: the worker's figures on its operator listener (`--metrics-listen`).
//!
//! **Architecture invariant:** a worker talks only to its coordinator link — never to etcd or
//! object storage. Start reading at [`worker::Worker::run`].

pub mod backend;
pub mod failure;
pub mod gateway;
pub mod layers;
pub mod limits;
pub mod meters;
pub mod remote;
pub mod sandbox;
pub mod seccomp;
pub mod source;
pub mod tool_spans;
pub mod worker;
pub mod workspace;
pub mod worktree;

pub use backend::{AgentBackend, Error, Events, Output, Task};
pub use flotilla_proto::link::{CoordinatorEnd, Link, link_pair};
pub use worker::{AccountLimits, Worker, WorkerOptions};
