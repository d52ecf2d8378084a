//! The embedded mode: coordinator and one in-process worker in this process, leases in
//! memory, storage from a URL (the local disk by default).
//!
//! The worker is attached through the same link messages a remote worker uses.

use std::sync::Arc;

use flotilla_coordinator::host;
use flotilla_coordinator::host::MemoryLeaseStore;
use flotilla_coordinator::host::{Coordinator, LaunchRequest};
use flotilla_local::workflows::DirResolver;
use flotilla_proto::wire::Report;
use flotilla_worker::{AgentBackend, Worker, WorkerOptions, link_pair};
use tokio_util::sync::CancellationToken;

use crate::config::ResolvedRun;
use crate::progress;

/// A coordinator with an in-process worker.
pub struct Embedded {
    pub coordinator: Arc<Coordinator>,
    cancel: CancellationToken,
}

impl Embedded {
    /// Starts a coordinator on `store_url` and one worker with `slots` slots.
    pub fn start(
        store_url: &str,
        slots: u32,
        workspace: std::path::PathBuf,
        exec_cmd: Option<&str>,
    ) -> anyhow::Result<Embedded> {
        Self::start_sandboxed(
            store_url,
            slots,
            workspace,
            exec_cmd,
            flotilla_worker::sandbox::Sandbox::Off,
        )
    }

    /// [`Embedded::start`] with the agents' processes in `sandbox`.
    pub fn start_sandboxed(
        store_url: &str,
        slots: u32,
        workspace: std::path::PathBuf,
        exec_cmd: Option<&str>,
        sandbox: flotilla_worker::sandbox::Sandbox,
    ) -> anyhow::Result<Embedded> {
        // Every backend of the build (exec only with its command).
        let backends: Vec<Arc<dyn AgentBackend>> = flotilla_worker::backend::NAMES
            .iter()
            .filter_map(|name| flotilla_worker::backend::by_name(name, exec_cmd).ok())
            .collect();
        let admission = crate::config::admission_from_env().map_err(anyhow::Error::msg)?;
        Self::start_parts(store_url, slots, workspace, backends, sandbox, admission)
    }

    /// An embedded coordinator and worker with these backends, admission per provider
    /// account on or off.
    pub fn start_parts(
        store_url: &str,
        slots: u32,
        workspace: std::path::PathBuf,
        backends: Vec<Arc<dyn AgentBackend>>,
        sandbox: flotilla_worker::sandbox::Sandbox,
        admission: bool,
    ) -> anyhow::Result<Embedded> {
        Self::start_shaped(
            store_url,
            (slots, workspace, backends, sandbox),
            admission,
            |_| {},
        )
    }

    /// [`Embedded::start_parts`], with the worker's options changed by `shape` first (a bench
    /// that runs its worker as a fleet worker would: scratch directories, limits).
    pub fn start_shaped(
        store_url: &str,
        (slots, workspace, backends, sandbox): (
            u32,
            std::path::PathBuf,
            Vec<Arc<dyn AgentBackend>>,
            flotilla_worker::sandbox::Sandbox,
        ),
        admission: bool,
        shape: impl FnOnce(&mut WorkerOptions),
    ) -> anyhow::Result<Embedded> {
        let store = host::open_store(store_url)?;
        let coordinator = Arc::new(Coordinator::build(
            store,
            MemoryLeaseStore::new(),
            flotilla_coordinator::host::CoordinatorOptions {
                dispatch: flotilla_coordinator::host::DispatchOptions {
                    fixed_fleet: true,
                    admission,
                    ..Default::default()
                },
                // Runs' end webhooks are signed with the user's secret, if they set one.
                notifier: crate::config::notifier_from_env()?,
                // `flotilla answer` from another terminal writes into the store.
                answers_from_store: true,
                ..Default::default()
            },
        ));
        let mut opts = WorkerOptions {
            name: "local".into(),
            slots,
            workspace,
            labels: Default::default(),
            shared_workspace: true,
            max_result_bytes: flotilla_proto::frag::MAX_MESSAGE_BYTES,
            // Embedded, the launcher is the machine's user: their own paths are theirs.
            allow_file_sources: true,
            // The user's own machine: whatever the user's git reaches.
            allow_source_hosts: vec!["*".into()],
            // And with the user's own credentials.
            source_credentials: true,
            sandbox,
            limits: flotilla_worker::limits::Limits::default(),
            account_limits: Default::default(),
            // The user's own directory: no source checkouts to make.
            layers: None,
        };
        shape(&mut opts);
        let worker = Worker::new(opts, backends);
        let (link, end) = link_pair();
        coordinator.dispatch().attach(end);
        let cancel = CancellationToken::new();
        let token = cancel.child_token();
        tokio::spawn(async move { worker.run(link, token).await });
        Ok(Embedded {
            coordinator,
            cancel,
        })
    }

    pub fn shutdown(&self) {
        self.cancel.cancel();
        self.coordinator.shutdown();
    }
}

/// Runs one workflow to its end, showing progress, and returns its report.
pub async fn run(
    r: ResolvedRun,
    mode: progress::Mode,
    serve: Option<std::net::SocketAddr>,
    sandbox: flotilla_worker::sandbox::Sandbox,
) -> anyhow::Result<Report> {
    let embedded = Embedded::start_sandboxed(
        &r.store_url,
        r.settings.concurrency,
        r.workspace.clone(),
        r.exec_cmd.as_deref(),
        sandbox,
    )?;
    // A store set up wrong (a missing bucket, refused credentials, nothing at the endpoint)
    // is said now, with its fix, rather than as the run's first failed write.
    if let Err(e) = embedded.coordinator.store().check().await {
        embedded.shutdown();
        return Err(e.into());
    }
    let notifies = r.settings.notify.is_some();
    let resolver = Arc::new(DirResolver::standard(&r.cwd, &r.workflows_dirs));
    let launched = embedded
        .coordinator
        .launch(LaunchRequest {
            source: r.source,
            origin: Some(r.origin),
            args: r
                .args
                .as_ref()
                .and_then(|a| serde_json::value::to_raw_value(a).ok()),
            settings: r.settings,
            resume_from: r.resume,
            inherit: false,
            resolver,
        })
        .await;
    let handle = match launched {
        Ok(h) => h,
        Err(rejected) => {
            embedded.shutdown();
            // Nothing was stored, so there is no run id to give.
            return Ok(Report::rejected("", rejected.workflow, rejected.message));
        }
    };
    let view = progress::start(mode, handle.snapshot.clone());
    let stopper = handle.stopper();
    let run_id = handle.run_id.clone();
    let run_for_signal = run_id.clone();
    // With --serve, the session page of this run on loopback (no sign-in: local only).
    let registry = Arc::new(flotilla_coordinator::host::RunRegistry::default());
    let pages = CancellationToken::new();
    let mut served = None;
    let mut handle = Some(handle);
    if let Some(addr) = serve {
        // Tracked before the page is up, so its first request finds the run.
        if let Some(h) = handle.take() {
            registry.track(h);
        }
        served = Some(serve_page(addr, &embedded, &registry, &run_id, &pages).await?);
    }
    // SIGINT (Ctrl-C) and SIGTERM (docker stop, systemd, Kubernetes) both stop the run the
    // same way: its report is stored and it can be resumed. A second one quits at once.
    let interrupts = tokio::spawn(stop_on_signal(stopper, run_for_signal));
    let report = if let Some(handle) = handle {
        handle.wait().await
    } else {
        let report = registry
            .wait_report(&run_id)
            .await
            .map(|r| (*r).clone())
            .ok_or_else(|| anyhow::anyhow!("the run ended without a report"))?;
        // Open pages get the final state before the server goes.
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        report
    };
    pages.cancel();
    if let Some(s) = served {
        let _ = s.await;
    }
    interrupts.abort();
    view.finish().await;
    let mut report = report;
    if notifies && let Some(n) = embedded.coordinator.notifier() {
        // The webhook goes out before this process ends (its retries included).
        n.drain(std::time::Duration::from_secs(120)).await;
        report.notify =
            flotilla_coordinator::host::delivery_of(embedded.coordinator.store(), &run_id).await;
    }
    embedded.shutdown();
    Ok(report)
}

/// Serves the session page of `run` on loopback `addr` (no sign-in: local only) until
/// `pages` is cancelled.
async fn serve_page(
    addr: std::net::SocketAddr,
    embedded: &Embedded,
    registry: &Arc<flotilla_coordinator::host::RunRegistry>,
    run: &str,
    pages: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot serve the session page on {addr}: {e}"))?;
    let at = listener.local_addr()?;
    // Loopback alone is not enough (any web page can aim a browser at 127.0.0.1): the page
    // checks Host and wants this run's random key, which only its URL carries.
    let key = flotilla_coordinator::host::new_page_key();
    eprintln!("session page: http://{at}/runs/{run}?key={key}");
    let app = flotilla_coordinator::host::pages_router(
        embedded.coordinator.clone(),
        registry.clone(),
        flotilla_coordinator::host::Access::Keyed {
            port: at.port(),
            key,
        },
    );
    // The fleet's listener limits and read timeouts: a slow client costs one connection for
    // a bounded time here too.
    let listener = flotilla_coordinator::host::Limited::new(
        listener,
        flotilla_coordinator::host::ConnLimits::default(),
    );
    Ok(tokio::spawn(
        flotilla_coordinator::host::serve_pages_router(listener, app, pages.clone()),
    ))
}

/// SIGINT (Ctrl-C) and SIGTERM (docker stop, systemd, Kubernetes) both stop the run the same
/// way: its report is stored and it can be resumed. A second one quits at once.
async fn stop_on_signal(
    stopper: tokio::sync::mpsc::UnboundedSender<flotilla_coordinator::host::Control>,
    run: String,
) {
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        return;
    };
    let first = tokio::select! {
        r = tokio::signal::ctrl_c() => r.is_ok().then_some(130),
        r = term.recv() => r.map(|()| 143),
    };
    let Some(code) = first else { return };
    eprintln!(
        "stopping the run (its report is stored; resume it with --resume {run}); signal again to quit at once"
    );
    let _ = stopper.send(flotilla_coordinator::host::Control::Stop);
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    std::process::exit(code);
}
