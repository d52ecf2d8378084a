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

use flotilla_proto::Problem;
use std::sync::Arc;

use flotilla_proto::frag;
use flotilla_proto::v1::client_service_server::ClientServiceServer;
use flotilla_proto::v1::worker_service_server::WorkerServiceServer;
use tokio_util::sync::CancellationToken;

use crate::coordinator::Coordinator;

mod client;
#[cfg(test)]
mod fuzz;
mod intake;
#[cfg(test)]
mod links;
mod options;
mod snapshot;
mod worker_bridge;

pub use crate::registry::RunRegistry;
pub use client::check_run_id;
use client::*;
pub use flotilla_local::sizes::check_launch;
pub use intake::{ARRIVAL, BUDGET_BYTES, limit_of};
pub use options::{LaunchPolicy, ServerOptions};
pub use snapshot::SnapshotView;
use worker_bridge::*;
pub use worker_bridge::{StreamOf, bridge};

/// Serves both services until `cancel` fires.
pub async fn serve(
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    opts: ServerOptions,
    cancel: CancellationToken,
) -> Result<(), Problem> {
    let secure = opts.tls.is_some();
    // The server's own tasks (listeners, handshakes, worker streams' readers, source
    // streams), waited for once it stops serving.
    let tasks = tokio_util::task::TaskTracker::new();
    let workers = WorkerSvc {
        coordinator: coordinator.clone(),
        secure,
        tasks: tasks.clone(),
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
        tasks: tasks.clone(),
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
                .max_decoding_message_size(crate::reads::LAUNCH_BYTES)
                .max_encoding_message_size(frag::MAX_MESSAGE_BYTES),
        ));
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|e| Problem::unavailable(format!("cannot serve on {}: {e}", opts.listen)))?;
    // TLS handshakes happen in `listen`, with a timeout, behind a connection limit.
    let served = match &opts.tls {
        Some(files) => {
            let config = files
                .rustls_server_config()
                .map_err(|e| Problem::unavailable(e.to_string()))?;
            let incoming =
                crate::listen::tls(listener, config, opts.limits, cancel.clone(), &tasks);
            router
                .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
                .await
        }
        None => {
            let incoming = crate::listen::plain(listener, opts.limits, cancel.clone(), &tasks);
            router
                .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
                .await
        }
    };
    // Its connections are closed: what they started ends with them (a bounded while).
    tasks.close();
    if tokio::time::timeout(SERVER_DRAIN, tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            running = tasks.len(),
            "some of the gRPC server's tasks were still running {} s after it stopped serving",
            SERVER_DRAIN.as_secs()
        );
    }
    served.map_err(|e| Problem::unavailable(format!("cannot serve on {}: {e}", opts.listen)))
}

/// How long a server that stopped serving waits for its tasks.
const SERVER_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);
