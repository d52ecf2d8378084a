//! `flotilla ui`: the session pages over a store (the local one by default) on loopback, for as
//! long as it runs — every run there, finished or going on in another `flotilla run` process
//! (read from the store and followed live), without `--serve` on each run.

use std::net::SocketAddr;
use std::sync::Arc;

use clap::Args;
use flotilla_coordinator::host::{self, Coordinator, MemoryLeaseStore};
use tokio_util::sync::CancellationToken;

use crate::{config, fail_kind};

/// Where `flotilla ui` listens unless told.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7780";

#[derive(Debug, Args)]
pub struct UiArgs {
    /// Object store URL (file:///path, s3://bucket/prefix) [default: the local store, where
    /// `flotilla run` keeps its runs].
    #[arg(long, env = "FLOTILLA_STORE")]
    store: Option<String>,
    /// A loopback address to serve the pages on (port 0: any free port).
    #[arg(long, default_value = DEFAULT_LISTEN, env = "FLOTILLA_UI_LISTEN")]
    listen: SocketAddr,
}

/// Serves the pages until interrupted (Ctrl-C or SIGTERM); the exit status.
pub async fn ui(a: UiArgs) -> i32 {
    if !a.listen.ip().is_loopback() {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            format!(
                "--listen {}: flotilla ui serves this machine only; give a loopback address such as {DEFAULT_LISTEN} (a fleet's coordinator serves pages to others, with sign-in)",
                a.listen
            ),
        );
    }
    let url = config::store_url(a.store);
    let store = match host::open_store(&url) {
        Ok(s) => s,
        Err(e) => return crate::refuse(e.into()),
    };
    if let Err(e) = store.check().await {
        return crate::refuse(e.into());
    }
    let listener = match tokio::net::TcpListener::bind(a.listen).await {
        Ok(l) => l,
        Err(e) => {
            return fail_kind(
                flotilla_proto::ErrorKind::Unavailable,
                format!(
                    "cannot serve on {}: {e} (another flotilla ui? choose another --listen)",
                    a.listen
                ),
            );
        }
    };
    let Ok(at) = listener.local_addr() else {
        return fail_kind(flotilla_proto::ErrorKind::Internal, "no local address");
    };
    // Nothing runs here: the pages read the store, and follow runs of other processes there.
    let coordinator = Arc::new(Coordinator::build(
        store,
        MemoryLeaseStore::new(),
        host::CoordinatorOptions::default(),
    ));
    let registry = Arc::new(host::RunRegistry::default());
    // As for `run --serve`: loopback `Host` and a random key only the printed URL carries,
    // so no web page elsewhere can read the runs through the reader's browser.
    let key = host::new_page_key();
    eprintln!("flotilla ui: http://{at}/runs?key={key}");
    eprintln!("(the runs of {url}; Ctrl-C to quit)");
    let app = host::pages_router(
        coordinator.clone(),
        registry,
        host::Access::Keyed {
            port: at.port(),
            key,
        },
    );
    let listener = host::Limited::new(listener, host::ConnLimits::default());
    let stop = CancellationToken::new();
    let server = tokio::spawn(host::serve_pages_router(listener, app, stop.clone()));
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(t) => t,
        Err(e) => {
            return fail_kind(
                flotilla_proto::ErrorKind::Internal,
                format!("cannot watch for SIGTERM: {e}"),
            );
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    stop.cancel();
    let _ = server.await;
    coordinator.shutdown();
    0
}
