//! `flotilla-coordinator`: runs workflow scripts and owns their runs.
//!
//! - [`script`]: the QuickJS runtime on its own thread, static reading of scripts: the
//!   `flotilla-script` crate, below this one, so nothing in it can import the coordinator.
//! - [`run`]: one engine per run: calls, keys, resume, journal, report.
//! - [`sched`]: the dispatcher: queues, limits, stagger, stalls, usage-limit waits, fencing.
//! - [`store`]: object storage layout and the group-committed journal: the `flotilla-store`
//!   crate, below this one.
//! - [`lease`]: the `LeaseStore` seam (memory; etcd with the fleet): the `flotilla-lease`
//!   crate, below this one.
//! - [`coordinator`]: launching runs.
//! - [`server`]: the gRPC services; [`web`]: session pages over HTTP.
//!
//! Start reading at [`coordinator::Coordinator::launch`], then [`run::RunEngine::run`].

pub mod api;
pub mod call;
pub mod coordinator;
pub mod counters;
pub mod gc;
pub mod group;
pub mod head;
pub mod history;
pub mod host;
pub mod ids;
pub mod index;
pub mod leader;
pub use flotilla_lease as lease;
pub use flotilla_local::{bundled, reads, vet, workflows};
pub use flotilla_store as store;
pub mod listen;
pub mod namespace;
pub mod notify;
pub mod owner;
pub use flotilla_script::reject;
pub mod registry;
pub mod report;
pub mod run;
pub mod saved;
pub mod sched;
pub use flotilla_proto::settings;
pub use flotilla_script as script;
pub mod source;
pub mod spec;
pub mod tasks;
pub mod tokens;
pub use flotilla_proto::usage;
pub mod web;

pub use coordinator::{Coordinator, CoordinatorOptions, LaunchRequest, Rejected};
pub use report::{Report, RunStatus};
pub use settings::{ReplayMode, RunSettings};
