//! The coordinator's network face: the gRPC `WorkerService` and `ClientService` over mTLS.
//!
//! - A worker's `Attach` stream is bridged onto the same channels an in-process worker uses
//!   ([`CoordinatorEnd`]), so the dispatcher cannot tell them apart. The worker's name is its
//!   certificate's CN; only `worker` certificates may attach.
//! - Clients (`client` or `coordinator` certificates) launch runs, wait for them, read status,
//!   stop them and list runs and workers. Runs live in a [`RunRegistry`]; a run that is not in
//!   memory (finished earlier, or run by another coordinator) is read back from storage.
//!
//! Without TLS (`--insecure`, loopback only) every peer is trusted; that mode exists for local
//! development and prints a warning where it is chosen.
//!
//! Every size a client sends is bounded on the server: whole requests per method, and how
//! many large launches are read at once, before tonic decodes them (`intake.rs`); each field
//! by the handlers, with the limits the CLI checks too (`sizes.rs`).
//!
//! The runs held here are in [`crate::registry`], below both faces. Files: `worker_bridge.rs` (`WorkerService`),
//! `client.rs` (`ClientService`), `snapshot.rs` (a run's live view on the wire), `intake.rs`
//! and `sizes.rs` (the bounds).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use flotilla_proto::ErrorKind;
use flotilla_proto::frag;
use flotilla_proto::link::CoordinatorEnd;
use flotilla_proto::tls::{self, Role, TlsFiles};
use flotilla_proto::v1::client_service_client::ClientServiceClient;
use flotilla_proto::v1::client_service_server::{ClientService, ClientServiceServer};
use flotilla_proto::v1::worker_service_server::{WorkerService, WorkerServiceServer};
use flotilla_proto::v1::{self, CoordinatorMessage, WorkerMessage, worker_message};
use futures::Stream;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::coordinator::Coordinator;
use crate::namespace::Scope;
use crate::report::Report;
use crate::run::{Control, Snapshot};
use crate::settings::{FetchFrom, RunSettings, SourceRef};
use crate::workflows::{AgentType, CarriedWorkflows, FoundWorkflow};
use crate::{LaunchRequest, history};

mod client;
#[cfg(test)]
mod fuzz;
mod intake;
#[cfg(test)]
mod links;
mod sizes;
mod snapshot;
mod worker_bridge;

pub use crate::registry::RunRegistry;
pub use client::check_run_id;
use client::*;
pub use intake::{ARRIVAL, BUDGET_BYTES, limit_of};
pub use sizes::check_launch;
pub use snapshot::SnapshotView;
use worker_bridge::*;
pub use worker_bridge::{StreamOf, bridge};

/// How the coordinator listens.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub listen: SocketAddr,
    /// `None`: plain text (development only).
    pub tls: Option<TlsFiles>,
    /// Handshake and idle timeouts, connection limit.
    pub limits: crate::listen::Limits,
    /// Base of session URLs (`http://host:port`).
    pub session_base: String,
    /// HTTP/2 keep-alive interval on every stream; the timeout is half again as long (a
    /// worker starved of CPU for a moment should not lose its link, and its attempts with it).
    pub keepalive: std::time::Duration,
    /// Signs session tokens for the pages (`None` without TLS).
    pub tokens: Option<crate::tokens::TokenKey>,
    /// Who may start what.
    pub policy: LaunchPolicy,
    /// The name other coordinators' certificates are checked for when a standby calls the
    /// leader (`--peer-name`); `None`: the host of the leader's advertised address.
    pub peer_name: Option<String>,
}

/// What a coordinator lets clients start.
#[derive(Clone)]
pub struct LaunchPolicy {
    /// Only saved workflows (pushed or bundled) run; inline scripts are refused (W46).
    pub saved_only: bool,
    /// Whether new runs are refused right now (W67); asked on every launch, so the switch
    /// can change while the coordinator runs. Runs in progress are never touched.
    pub disabled: Arc<dyn Fn() -> bool + Send + Sync>,
    /// Client certificate names that may push workflows (holders of a `coordinator`
    /// certificate always may); nobody else can change what `launch NAME` runs.
    pub publishers: Vec<String>,
    /// A push may take a bundled workflow's name.
    pub shadow_bundled: bool,
    /// Runs may name a source on the workers' own disks (`git+file://`, a path): the
    /// operator says its workers fetch them (`--allow-file-sources` on both).
    pub file_sources: bool,
}

impl Default for LaunchPolicy {
    fn default() -> Self {
        LaunchPolicy {
            saved_only: false,
            disabled: Arc::new(|| false),
            publishers: Vec::new(),
            shadow_bundled: false,
            file_sources: false,
        }
    }
}

impl std::fmt::Debug for LaunchPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchPolicy")
            .field("saved_only", &self.saved_only)
            .field("file_sources", &self.file_sources)
            .field("disabled", &(self.disabled)())
            .finish()
    }
}

/// Serves both services until `cancel` fires.
pub async fn serve(
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    opts: ServerOptions,
    cancel: CancellationToken,
) -> Result<(), String> {
    let secure = opts.tls.is_some();
    let workers = WorkerSvc {
        coordinator: coordinator.clone(),
        secure,
    };
    let tls_files = opts.tls.clone();
    let clients = ClientSvc {
        coordinator,
        registry,
        secure,
        session_base: opts.session_base.clone(),
        tokens: opts.tokens.clone(),
        tls: tls_files,
        to_leader: tokio::sync::Mutex::new(None),
        policy: opts.policy.clone(),
        peer_name: opts.peer_name.clone(),
    };
    // HTTP/2 pings find a frozen or cut-off worker's stream within two intervals.
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(opts.keepalive))
        .http2_keepalive_timeout(Some(opts.keepalive * 3 / 2));
    let router = builder
        .add_service(
            WorkerServiceServer::new(workers)
                .max_decoding_message_size(frag::MAX_FRAME_BYTES)
                .max_encoding_message_size(frag::MAX_FRAME_BYTES),
        )
        // What clients send is bounded per method, and large launches are read a few at a
        // time, before tonic decodes anything (`intake`).
        .add_service(intake::Intake::new(
            ClientServiceServer::new(clients)
                .max_decoding_message_size(crate::limits::LAUNCH_BYTES)
                .max_encoding_message_size(frag::MAX_MESSAGE_BYTES),
        ));
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| format!("cannot serve on {}: {e}", opts.listen))?;
    // TLS handshakes happen in `listen`, with a timeout, behind a connection limit.
    let served = match &opts.tls {
        Some(files) => {
            let config = files.rustls_server_config().map_err(|e| e.to_string())?;
            let incoming = crate::listen::tls(listener, config, opts.limits, cancel.clone());
            router
                .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
                .await
        }
        None => {
            let incoming = crate::listen::plain(listener, opts.limits, cancel.clone());
            router
                .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
                .await
        }
    };
    served.map_err(|e| format!("cannot serve on {}: {e}", opts.listen))
}
