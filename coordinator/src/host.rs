//! The one face of the coordinator for the processes that host one (issue 30, 3): embedded
//! mode (`flotilla run`), `flotilla coordinator`, the MCP server's own runs, and the commands
//! that read a store (`show`, `logs`, `runs`, `gc`). Everything those name of the coordinator
//! is listed here, and the layering test holds the CLI to it
//! (`layering::layering_the_cli_reaches_the_coordinator_through_one_facade`). Client commands
//! need none of it: they speak `flotilla-proto` and use `flotilla-local`.

// Building and running one.
pub use crate::coordinator::{Coordinator, CoordinatorOptions, LaunchRequest};
pub use crate::group::RunClaims;
pub use crate::leader::Leadership;
pub use crate::lease::etcd::EtcdLeaseStore;
pub use crate::lease::memory::MemoryLeaseStore;
pub use crate::lease::tenure::GatedLeases;
pub use crate::lease::{LeaseStore, Tenure};
pub use crate::registry::RunRegistry;
pub use crate::run::Control;
pub use crate::sched::{DispatchOptions, UsageBounds, WORKER_LEASE_TTL};
pub use crate::tasks::Tasks;

// Its policy.
pub use crate::namespace::{Namespaces, Policy as NamespacePolicy};
pub use crate::notify::{Notifier, stored as delivery_of};

// Its faces and their listeners.
pub use crate::api::{LaunchPolicy, ServerOptions, serve as serve_grpc};
pub use crate::listen::{ConnLimits, Limited};
pub use crate::web::{
    Access, TokenKey, WebOptions, metrics_router, new_page_key, router as pages_router,
    serve as serve_pages, serve_metrics, serve_router as serve_pages_router,
};

// Stored runs: reading them back, listing them, and retention.
pub use crate::gc::{Policy as RetentionPolicy, Swept, sweep};
pub use crate::history::{
    AgentTranscript, TranscriptError, load_report, transcript_line, transcripts,
};
pub use crate::index::{Filter, page as runs_page};
// Questions of runs (`ask()`): answering an embedded run's through its store.
pub use crate::run::ask::{answer_in_store, stored_questions};
pub use crate::store::{Error as StoreError, Store, open as open_store};
