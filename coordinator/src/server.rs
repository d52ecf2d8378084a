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

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

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
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::coordinator::Coordinator;
use crate::report::{Report, RunStatus};
use crate::run::{AgentAction, Control, RunHandle, Snapshot};
use crate::settings::RunSettings;
use crate::workflows::{AgentType, CarriedWorkflows, FoundWorkflow};
use crate::{LaunchRequest, history};

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
    /// HTTP/2 keep-alive interval and timeout on every stream.
    pub keepalive: std::time::Duration,
    /// Signs session tokens for the pages (`None` without TLS).
    pub tokens: Option<crate::web::TokenKey>,
    /// Who may start what.
    pub policy: LaunchPolicy,
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
}

impl Default for LaunchPolicy {
    fn default() -> Self {
        LaunchPolicy {
            saved_only: false,
            disabled: Arc::new(|| false),
            publishers: Vec::new(),
            shadow_bundled: false,
        }
    }
}

impl std::fmt::Debug for LaunchPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchPolicy")
            .field("saved_only", &self.saved_only)
            .field("disabled", &(self.disabled)())
            .finish()
    }
}

/// How long a standby waits for some coordinator to lead before it gives up on a request.
const LEADER_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The runs this coordinator is running (or has finished since it started).
#[derive(Default)]
pub struct RunRegistry {
    runs: Mutex<HashMap<String, RunEntry>>,
    /// Called with a run's id once its report is stored.
    on_end: std::sync::OnceLock<Arc<dyn Fn(String) + Send + Sync>>,
}

impl std::fmt::Debug for RunRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunRegistry").finish_non_exhaustive()
    }
}

struct RunEntry {
    snapshot: watch::Receiver<Arc<Snapshot>>,
    stopper: mpsc::UnboundedSender<Control>,
    report: watch::Receiver<Option<Arc<Report>>>,
}

impl RunRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, RunEntry>> {
        self.runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Every run this process tracks: its snapshot and whether it has ended.
    pub fn all(&self) -> Vec<(Arc<Snapshot>, bool)> {
        self.lock()
            .values()
            .map(|e| (e.snapshot.borrow().clone(), e.report.borrow().is_some()))
            .collect()
    }

    /// The live snapshot of a run this coordinator runs, and its report once it has ended.
    pub fn live(&self, run: &str) -> Option<(Arc<Snapshot>, Option<Arc<Report>>)> {
        self.lock()
            .get(run)
            .map(|e| (e.snapshot.borrow().clone(), e.report.borrow().clone()))
    }

    /// The report of a run this coordinator runs: the final one once it has ended, else the
    /// report as it stands now (calls that have not ended show `queued` or `running`).
    pub async fn live_report(&self, run: &str) -> Option<Arc<Report>> {
        let (stopper, done) = {
            let runs = self.lock();
            let e = runs.get(run)?;
            (e.stopper.clone(), e.report.borrow().clone())
        };
        if let Some(r) = done {
            return Some(r);
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        stopper.send(Control::Report(tx)).ok()?;
        match rx.await {
            Ok(r) => Some(Arc::new(r)),
            // It ended meanwhile: its final report is there now.
            Err(_) => self.lock().get(run).and_then(|e| e.report.borrow().clone()),
        }
    }

    /// Pauses or resumes a run, stops it, or stops or restarts one of its agents (W54–W56):
    /// the one path the client API and the session page share. `action` is `pause`,
    /// `resume`, `stop`, `stop_agent` or `restart_agent`.
    pub async fn control(&self, run_id: &str, action: &str, agent: &str) -> Result<String, Status> {
        let stopper = self.lock().get(run_id).map(|e| {
            let finished = e.report.borrow().is_some();
            let paused = e.snapshot.borrow().status == Some(RunStatus::Paused);
            (e.stopper.clone(), finished, paused, e.snapshot.clone())
        });
        let Some((stopper, false, paused, mut snapshot)) = stopper else {
            return Err(Status::not_found(format!(
                "run {run_id} is not running on this coordinator"
            )));
        };
        let gone = || Status::not_found(format!("run {run_id} has ended"));
        match action {
            "stop" => {
                stopper.send(Control::Stop).map_err(|_| gone())?;
                Ok(format!("stopping {run_id}"))
            }
            "pause" | "resume" => {
                let pause = action == "pause";
                if pause == paused {
                    return Err(Status::failed_precondition(format!(
                        "run {run_id} is {} already",
                        if paused { "paused" } else { "running" }
                    )));
                }
                stopper.send(Control::Pause(pause)).map_err(|_| gone())?;
                // Answer once the run shows it, so a second request sees the new state.
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                    loop {
                        let now = snapshot.borrow_and_update().status == Some(RunStatus::Paused);
                        if now == pause || snapshot.changed().await.is_err() {
                            break;
                        }
                    }
                })
                .await;
                Ok(format!(
                    "{} {run_id}",
                    if pause { "paused" } else { "resumed" }
                ))
            }
            "stop_agent" | "restart_agent" => {
                if agent.is_empty() {
                    return Err(Status::invalid_argument(
                        "name the agent: its index (as `flotilla status` shows) or its label",
                    ));
                }
                let action = if action == "stop_agent" {
                    AgentAction::Stop
                } else {
                    AgentAction::Restart
                };
                let (tx, rx) = tokio::sync::oneshot::channel();
                stopper
                    .send(Control::Agent {
                        action,
                        agent: agent.to_owned(),
                        reply: tx,
                    })
                    .map_err(|_| gone())?;
                rx.await
                    .map_err(|_| gone())?
                    .map_err(Status::failed_precondition)
            }
            other => Err(Status::invalid_argument(format!(
                "unknown action {other:?}: use pause, resume, stop, stop_agent or restart_agent"
            ))),
        }
    }

    /// Waits for a tracked run's final report (`None` for a run this process does not track).
    pub async fn wait_report(&self, run: &str) -> Option<Arc<Report>> {
        let mut rx = self.lock().get(run)?.report.clone();
        loop {
            if let Some(r) = rx.borrow_and_update().clone() {
                return Some(r);
            }
            rx.changed().await.ok()?;
        }
    }

    /// Sets what happens when a tracked run ends (once).
    pub fn on_end(&self, f: Arc<dyn Fn(String) + Send + Sync>) {
        let _ = self.on_end.set(f);
    }

    /// Tracks a launched run until it ends.
    pub fn track(&self, handle: RunHandle) {
        let (report_tx, report_rx) = watch::channel(None);
        let entry = RunEntry {
            snapshot: handle.snapshot.clone(),
            stopper: handle.stopper(),
            report: report_rx,
        };
        let run_id = handle.run_id.clone();
        self.lock().insert(run_id.clone(), entry);
        let on_end = self.on_end.get().cloned();
        tokio::spawn(async move {
            let report = handle.wait().await;
            let _ = report_tx.send(Some(Arc::new(report)));
            if let Some(f) = on_end {
                f(run_id);
            }
        });
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
    };
    // HTTP/2 pings find a frozen or cut-off worker's stream within two intervals.
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(opts.keepalive))
        .http2_keepalive_timeout(Some(opts.keepalive));
    let router = builder
        .add_service(
            WorkerServiceServer::new(workers)
                .max_decoding_message_size(frag::MAX_FRAME_BYTES)
                .max_encoding_message_size(frag::MAX_FRAME_BYTES),
        )
        .add_service(
            ClientServiceServer::new(clients)
                .max_decoding_message_size(frag::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(frag::MAX_MESSAGE_BYTES),
        );
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

fn check_version(theirs: &str) -> Result<(), Status> {
    if flotilla_proto::protocol_compatible(theirs) {
        Ok(())
    } else {
        Err(Status::failed_precondition(format!(
            "protocol version {theirs:?} is not compatible with this coordinator's {}; upgrade the older side",
            flotilla_proto::PROTOCOL_VERSION
        )))
    }
}

struct WorkerSvc {
    coordinator: Arc<Coordinator>,
    secure: bool,
}

type StreamOf<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl WorkerService for WorkerSvc {
    type AttachStream = StreamOf<CoordinatorMessage>;

    async fn attach(
        &self,
        req: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let name = if self.secure {
            Some(tls::require_role(&req, &[Role::Worker], "attach as a worker")?.name)
        } else {
            None
        };
        if let Some(l) = self.coordinator.leadership()
            && !l.is_leader()
        {
            return Err(Status::unavailable(format!(
                "this coordinator is a standby; the leader is {}",
                l.leader().unwrap_or_else(|| "not known yet".into())
            )));
        }
        let mut inbound = req.into_inner();
        // The first message must be a compatible Hello.
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("the worker closed its stream before Hello"))?;
        let Some(worker_message::Msg::Hello(mut hello)) = first.msg else {
            return Err(Status::invalid_argument(
                "a worker stream must start with Hello",
            ));
        };
        check_version(&hello.protocol_version)?;
        if let Some(name) = name {
            // A worker is known by its certificate, whatever it calls itself.
            hello.name = name;
        }
        tracing::info!(worker = %hello.name, slots = hello.slots, "worker attached");
        let hello_name = hello.name.clone();
        let (to_worker_tx, to_worker_rx) = mpsc::unbounded_channel();
        let (from_worker_tx, from_worker_rx) = mpsc::unbounded_channel();
        let _ = from_worker_tx.send(WorkerMessage {
            msg: Some(worker_message::Msg::Hello(hello)),
        });
        self.coordinator.dispatch().attach(CoordinatorEnd {
            tx: to_worker_tx,
            rx: from_worker_rx,
        });
        let worker = hello_name;
        tokio::spawn(async move {
            let mut pieces = frag::Reassembler::default();
            loop {
                match inbound.message().await {
                    Ok(Some(msg)) => match pieces.push(msg) {
                        Ok(Some(msg)) => {
                            if from_worker_tx.send(msg).is_err() {
                                break;
                            }
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!(worker = %worker, error = %e, "dropped a message from the worker");
                        }
                    },
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(worker = %worker, error = %e, "worker stream ended");
                        break;
                    }
                }
            }
            // Dropping the sender tells the dispatcher the worker is gone.
        });
        // Big assignments go out in fragments (see `frag`); the run engine refuses an
        // agent() call too big to send at all before it is queued.
        let frames_rx = frag::splitting(to_worker_rx, "worker");
        let out = UnboundedReceiverStream::new(frames_rx).map(Ok);
        Ok(Response::new(Box::pin(out)))
    }
}

struct ClientSvc {
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    secure: bool,
    session_base: String,
    tokens: Option<crate::web::TokenKey>,
    /// This coordinator's TLS files (a standby calls the leader with them).
    tls: Option<TlsFiles>,
    to_leader: tokio::sync::Mutex<Option<(String, ClientServiceClient<tonic::transport::Channel>)>>,
    policy: LaunchPolicy,
}

/// Life of a session token when the caller does not say.
const DEFAULT_TOKEN_TTL: std::time::Duration = std::time::Duration::from_secs(12 * 3600);

impl ClientSvc {
    /// A client of the leader when this coordinator is a standby; `None` when it leads (or
    /// runs alone).
    async fn leader_client(
        &self,
    ) -> Result<Option<ClientServiceClient<tonic::transport::Channel>>, Status> {
        let Some(l) = self.coordinator.leadership() else {
            return Ok(None);
        };
        if l.is_leader() {
            return Ok(None);
        }
        let addr = l.wait_for_leader(LEADER_WAIT).await.ok_or_else(|| {
            Status::unavailable("no coordinator leads yet (is etcd reachable?); try again")
        })?;
        if l.is_leader() {
            return Ok(None);
        }
        let mut cached = self.to_leader.lock().await;
        if let Some((a, c)) = cached.as_ref()
            && *a == addr
        {
            return Ok(Some(c.clone()));
        }
        let channel = tls::channel(&addr, self.tls.as_ref())
            .map_err(|e| Status::unavailable(format!("cannot reach the leader at {addr}: {e}")))?;
        let client = ClientServiceClient::new(channel);
        *cached = Some((addr, client.clone()));
        Ok(Some(client))
    }

    fn authorize<T>(&self, req: &Request<T>, what: &str) -> Result<(), Status> {
        if self.secure {
            tls::require_role(req, &[Role::Client, Role::Coordinator], what)?;
        }
        Ok(())
    }

    /// Who is pushing a workflow, if they may: a `coordinator` certificate, or a client the
    /// operator listed as a publisher. (Without TLS, on loopback, anyone may.)
    fn publisher<T>(&self, req: &Request<T>) -> Result<String, Status> {
        if !self.secure {
            return Ok("insecure".into());
        }
        let peer = tls::require_role(req, &[Role::Client, Role::Coordinator], "save workflows")?;
        if peer.role == Role::Coordinator || self.policy.publishers.contains(&peer.name) {
            return Ok(peer.name);
        }
        Err(Status::permission_denied(format!(
            "{} may not push workflows to this coordinator: a push changes what everyone's `launch NAME` runs, so only the publishers its operator names may (`--publisher {}` or `publishers` in its config)",
            peer.name, peer.name
        )))
    }

    fn session_url(&self, run: &str) -> String {
        format!("{}/runs/{run}", self.session_base.trim_end_matches('/'))
    }

    async fn stored_report(&self, run: &str) -> Result<Report, Status> {
        history::load_report(self.coordinator.store(), run)
            .await
            .map_err(|e| match e.kind() {
                flotilla_proto::ErrorKind::NotFound => {
                    Status::not_found(format!("no run {run} on this coordinator or in its store"))
                }
                _ => Status::unavailable(format!("cannot read run {run}: {e}")),
            })
    }
}

/// A failure of the connection rather than an answer.
fn is_transport(s: &Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, Status> {
    serde_json::to_string(v).map_err(|e| Status::internal(format!("cannot encode: {e}")))
}

#[tonic::async_trait]
impl ClientService for ClientSvc {
    async fn ping(&self, req: Request<v1::PingRequest>) -> Result<Response<v1::PingReply>, Status> {
        self.authorize(&req, "ping")?;
        Ok(Response::new(v1::PingReply {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
        }))
    }

    async fn launch(
        &self,
        req: Request<v1::LaunchRequest>,
    ) -> Result<Response<v1::LaunchReply>, Status> {
        self.authorize(&req, "launch runs")?;
        if let Some(mut leader) = self.leader_client().await? {
            return leader.launch(req.into_inner()).await;
        }
        let mut r = req.into_inner();
        check_version(&r.protocol_version)?;
        if (self.policy.disabled)() {
            return Err(Status::failed_precondition(
                "workflows are disabled on this coordinator (FLOTILLA_DISABLE_WORKFLOWS or disable_workflows in its config file): new runs are refused, runs in progress keep going",
            ));
        }
        if self.policy.saved_only && !r.inherit {
            if r.saved_name.is_empty() {
                return Err(Status::permission_denied(
                    "this coordinator runs saved workflows only: launch a pushed or bundled one by name (`flotilla workflows list --coordinator URL`); a publisher of this coordinator can push yours with `flotilla workflows push FILE`",
                ));
            }
            let name = r.saved_name.trim_start_matches('/').to_owned();
            let found = match crate::saved::get(self.coordinator.store(), &name)
                .await
                .map_err(Status::unavailable)?
            {
                Some(w) => w,
                None => crate::bundled::find(&name).ok_or_else(|| {
                    Status::not_found(format!(
                        "no saved workflow {name:?} on this coordinator (`flotilla workflows list --coordinator URL` lists them); a publisher of this coordinator can push it with `flotilla workflows push FILE`"
                    ))
                })?,
            };
            r.script = found.source;
            r.origin = found.origin;
            // Nested workflow() calls, too, reach only what this coordinator holds: the
            // pushed workflows (bundled ones are found after them anyway).
            r.workflows = crate::saved::list(self.coordinator.store())
                .await
                .map_err(Status::unavailable)?
                .into_iter()
                .map(v1::SavedWorkflow::from)
                .collect();
        }
        let settings: RunSettings = serde_json::from_str(&r.settings_json)
            .map_err(|e| Status::invalid_argument(format!("run settings are not valid: {e}")))?;
        let args =
            match &r.args_json {
                None => None,
                Some(text) => Some(serde_json::from_str(text).map_err(|e| {
                    Status::invalid_argument(format!("args are not valid JSON: {e}"))
                })?),
            };
        let resolver = CarriedWorkflows {
            workflows: r.workflows.into_iter().map(FoundWorkflow::from).collect(),
            agent_types: {
                let mut types: Vec<AgentType> = r
                    .agent_definitions
                    .into_iter()
                    .map(|d| AgentType {
                        model: (!d.model.is_empty()).then_some(d.model),
                        description: (!d.description.is_empty()).then_some(d.description),
                        prompt: Some(d.prompt),
                        tools: d.tools,
                        name: d.name,
                    })
                    .collect();
                for (name, model) in r.agent_types {
                    if !types.iter().any(|t| t.name == name) {
                        let mut t = AgentType::builtin(&name);
                        t.model = (!model.is_empty()).then_some(model);
                        types.push(t);
                    }
                }
                types
            },
        };
        let launched = self
            .coordinator
            .launch(LaunchRequest {
                source: r.script,
                origin: (!r.origin.is_empty()).then_some(r.origin),
                args,
                settings,
                resume_from: (!r.resume_from.is_empty()).then_some(r.resume_from),
                inherit: r.inherit,
                resolver: Arc::new(resolver),
            })
            .await;
        match launched {
            Ok(handle) => {
                let run_id = handle.run_id.clone();
                self.registry.track(handle);
                Ok(Response::new(v1::LaunchReply {
                    session_url: self.session_url(&run_id),
                    run_id,
                    status: "running".into(),
                    error: String::new(),
                    report_json: String::new(),
                }))
            }
            Err(rejected) => {
                // Nothing was stored: no run id to hand out.
                let report =
                    Report::rejected("", rejected.workflow.clone(), rejected.message.clone());
                Ok(Response::new(v1::LaunchReply {
                    run_id: String::new(),
                    session_url: String::new(),
                    status: "rejected".into(),
                    error: rejected.message,
                    report_json: to_json(&report)?,
                }))
            }
        }
    }

    async fn wait(&self, req: Request<v1::RunRef>) -> Result<Response<v1::ReportReply>, Status> {
        self.authorize(&req, "read runs")?;
        let run = req.into_inner().run_id;
        // Across a failover the run moves: wait where it runs, and follow it.
        let mut adopting = 0u32;
        let report = loop {
            let rx = self.registry.lock().get(&run).map(|e| e.report.clone());
            if let Some(mut rx) = rx {
                break loop {
                    if let Some(r) = rx.borrow_and_update().clone() {
                        break (*r).clone();
                    }
                    if rx.changed().await.is_err() {
                        return Err(Status::internal("the run ended without a report"));
                    }
                };
            }
            if let Some(mut leader) = self.leader_client().await? {
                match leader
                    .wait(v1::RunRef {
                        run_id: run.clone(),
                    })
                    .await
                {
                    Ok(r) => return Ok(r),
                    Err(s) if is_transport(&s) => {
                        tracing::info!(run, error = %s, "lost the leader while waiting; following the run");
                        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                        continue;
                    }
                    Err(s) => return Err(s),
                }
            }
            let report = self.stored_report(&run).await?;
            if report.status.is_final() {
                break report;
            }
            // Leading, and the run is live without us: it is about to be adopted.
            if self.coordinator.leadership().is_some() && adopting < 120 {
                adopting += 1;
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                continue;
            }
            return Err(Status::failed_precondition(format!(
                "run {run} is not running on this coordinator and has not finished; its owner may have died (resume it with `flotilla resume {run}`)"
            )));
        };
        Ok(Response::new(v1::ReportReply {
            report_json: to_json(&report)?,
            finished: true,
        }))
    }

    async fn report(&self, req: Request<v1::RunRef>) -> Result<Response<v1::ReportReply>, Status> {
        self.authorize(&req, "read runs")?;
        if !self.registry.lock().contains_key(&req.get_ref().run_id)
            && let Some(mut leader) = self.leader_client().await?
        {
            return leader.report(req.into_inner()).await;
        }
        let run = req.into_inner().run_id;
        let done = self
            .registry
            .lock()
            .get(&run)
            .map(|e| e.report.borrow().clone());
        let report = match done {
            Some(Some(r)) => (*r).clone(),
            _ => self.stored_report(&run).await?,
        };
        Ok(Response::new(v1::ReportReply {
            finished: report.status.is_final(),
            report_json: to_json(&report)?,
        }))
    }

    async fn status(&self, req: Request<v1::RunRef>) -> Result<Response<v1::StatusReply>, Status> {
        self.authorize(&req, "read runs")?;
        if let Some(mut leader) = self.leader_client().await? {
            return leader.status(req.into_inner()).await;
        }
        let run = req.into_inner().run_id;
        let entry = self
            .registry
            .lock()
            .get(&run)
            .map(|e| (e.snapshot.borrow().clone(), e.report.borrow().is_some()));
        let (snap, finished) = entry.ok_or_else(|| {
            Status::not_found(format!(
                "run {run} is not running on this coordinator; see `flotilla show {run}`"
            ))
        })?;
        Ok(Response::new(v1::StatusReply {
            snapshot_json: to_json(&SnapshotView::from(&*snap))?,
            finished,
        }))
    }

    async fn stop(&self, req: Request<v1::RunRef>) -> Result<Response<v1::StopReply>, Status> {
        self.authorize(&req, "stop runs")?;
        if let Some(mut leader) = self.leader_client().await? {
            return leader.stop(req.into_inner()).await;
        }
        let run = req.into_inner().run_id;
        let stopper = self.registry.lock().get(&run).map(|e| e.stopper.clone());
        let stopped = stopper.is_some_and(|s| s.send(Control::Stop).is_ok());
        if !stopped {
            return Err(Status::not_found(format!(
                "run {run} is not running on this coordinator"
            )));
        }
        Ok(Response::new(v1::StopReply { stopped }))
    }

    async fn list_runs(
        &self,
        req: Request<v1::ListRunsRequest>,
    ) -> Result<Response<v1::ListRunsReply>, Status> {
        self.authorize(&req, "list runs")?;
        let runs = history::list_runs(self.coordinator.store())
            .await
            .map_err(|e| Status::unavailable(format!("cannot list runs: {e}")))?;
        Ok(Response::new(v1::ListRunsReply {
            runs_json: to_json(&runs)?,
        }))
    }

    async fn list_workers(
        &self,
        req: Request<v1::ListWorkersRequest>,
    ) -> Result<Response<v1::ListWorkersReply>, Status> {
        self.authorize(&req, "list workers")?;
        if let Some(mut leader) = self.leader_client().await? {
            return leader.list_workers(req.into_inner()).await;
        }
        let workers = self
            .coordinator
            .dispatch()
            .workers()
            .await
            .into_iter()
            .map(|w| v1::WorkerInfo {
                name: w.name,
                slots: w.slots,
                busy: w.busy,
                backends: w.backends,
                models: w.models,
                labels: w.labels.into_iter().collect(),
                attached: w.attached,
            })
            .collect();
        Ok(Response::new(v1::ListWorkersReply { workers }))
    }

    async fn control(
        &self,
        req: Request<v1::ControlRequest>,
    ) -> Result<Response<v1::ControlReply>, Status> {
        self.authorize(&req, "control runs")?;
        if let Some(mut leader) = self.leader_client().await? {
            return leader.control(req.into_inner()).await;
        }
        let v1::ControlRequest {
            run_id,
            action,
            agent,
        } = req.into_inner();
        let message = self.registry.control(&run_id, &action, &agent).await?;
        Ok(Response::new(v1::ControlReply { message }))
    }

    async fn changes(
        &self,
        req: Request<v1::RunRef>,
    ) -> Result<Response<v1::ChangesReply>, Status> {
        self.authorize(&req, "read runs")?;
        let run = req.into_inner().run_id;
        // The journal is in the shared store: any coordinator of a group answers.
        let changes = crate::head::changes_of(self.coordinator.store(), &run)
            .await
            .map_err(|e| match e.kind() {
                flotilla_proto::ErrorKind::NotFound => Status::not_found(e.to_string()),
                _ => Status::unavailable(e.to_string()),
            })?;
        Ok(Response::new(v1::ChangesReply {
            changes_json: to_json(&changes)?,
        }))
    }

    type FetchSourceStream = StreamOf<v1::SourceData>;

    async fn fetch_source(
        &self,
        req: Request<v1::FetchSourceRequest>,
    ) -> Result<Response<Self::FetchSourceStream>, Status> {
        self.authorize(&req, "fetch run sources")?;
        let r = req.into_inner();
        check_version(&r.protocol_version)?;
        // A few chunks ahead of the client at most: the stream's own pace is the flow control.
        let (tx, rx) = mpsc::channel(8);
        let store = self.coordinator.store().clone();
        tokio::spawn(async move {
            let req = v1::SourceRequest {
                id: 0,
                repo: r.repo,
                commit: r.commit,
                have_packs: r.have_packs,
                acked: 0,
            };
            crate::source::serve_to(store, req, crate::source::Sink::Stream(tx)).await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn source_have(
        &self,
        req: Request<v1::SourceHaveRequest>,
    ) -> Result<Response<v1::SourceHaveReply>, Status> {
        self.authorize(&req, "upload run sources")?;
        let r = req.into_inner();
        check_version(&r.protocol_version)?;
        if r.commits.len() > 10_000 {
            return Err(Status::invalid_argument(
                "ask about at most 10,000 commits at once",
            ));
        }
        // Sources live in the shared store: any coordinator of a group answers.
        let held = crate::source::have(self.coordinator.store(), &r.repo, &r.commits)
            .await
            .map_err(|e| Status::unavailable(format!("cannot read the store: {e}")))?;
        Ok(Response::new(v1::SourceHaveReply { held }))
    }

    async fn put_source(
        &self,
        req: Request<Streaming<v1::SourceUpload>>,
    ) -> Result<Response<v1::PutSourceReply>, Status> {
        self.authorize(&req, "upload run sources")?;
        let mut chunks = req.into_inner();
        let first = chunks
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("an empty source upload"))?;
        let mut rx = crate::source::Receiver::start(self.coordinator.store().clone(), &first)
            .await
            .map_err(Status::invalid_argument)?;
        // A pack that fails part way is dropped from the store, not left half uploaded.
        let received = async {
            rx.push(&first.data)
                .await
                .map_err(Status::invalid_argument)?;
            while let Some(chunk) = chunks.message().await? {
                rx.push(&chunk.data)
                    .await
                    .map_err(Status::invalid_argument)?;
            }
            Ok::<_, Status>(())
        }
        .await;
        if let Err(e) = received {
            rx.abort().await;
            return Err(e);
        }
        let (pack, bytes) = rx.finish().await.map_err(Status::unavailable)?;
        tracing::info!(repo = %first.repo, commit = %first.tip, pack = %pack, bytes, "stored a source pack");
        Ok(Response::new(v1::PutSourceReply { pack, bytes }))
    }

    async fn push_workflow(
        &self,
        req: Request<v1::PushWorkflowRequest>,
    ) -> Result<Response<v1::PushWorkflowReply>, Status> {
        let by = self.publisher(&req)?;
        let r = req.into_inner();
        check_version(&r.protocol_version)?;
        let rules = crate::saved::PushRules {
            shadow_bundled: self.policy.shadow_bundled,
        };
        let record = crate::saved::push(self.coordinator.store(), &r.source, &by, rules)
            .await
            .map_err(Status::invalid_argument)?;
        tracing::info!(workflow = %record.name, by = %record.by, sha256 = %record.sha256,
            replaced = ?record.replaced, "workflow pushed");
        Ok(Response::new(v1::PushWorkflowReply {
            origin: crate::saved::origin(&record.name),
            replaced: record.replaced.is_some(),
            name: record.name,
            sha256: record.sha256,
            pushed_by: record.by,
        }))
    }

    async fn list_workflows(
        &self,
        req: Request<v1::ListWorkflowsRequest>,
    ) -> Result<Response<v1::ListWorkflowsReply>, Status> {
        self.authorize(&req, "list workflows")?;
        check_version(&req.get_ref().protocol_version)?;
        let workflows = crate::saved::list(self.coordinator.store())
            .await
            .map_err(Status::unavailable)?
            .into_iter()
            .map(v1::SavedWorkflow::from)
            .collect();
        Ok(Response::new(v1::ListWorkflowsReply { workflows }))
    }

    async fn transcripts(
        &self,
        req: Request<v1::TranscriptsRequest>,
    ) -> Result<Response<v1::TranscriptsReply>, Status> {
        self.authorize(&req, "read runs")?;
        let r = req.into_inner();
        check_version(&r.protocol_version)?;
        // Transcripts are in the shared store: any coordinator of a group can answer.
        let report = match self.registry.live_report(&r.run_id).await {
            Some(rep) => (*rep).clone(),
            None => self.stored_report(&r.run_id).await?,
        };
        let agent = (!r.agent.is_empty()).then_some(r.agent.as_str());
        let attempt = (r.attempt > 0).then_some(r.attempt);
        let found = history::transcripts(self.coordinator.store(), &report, agent, attempt)
            .await
            .map_err(|e| match e {
                history::TranscriptError::NoAgent(m) => Status::not_found(m),
                history::TranscriptError::Store(e) => {
                    Status::unavailable(format!("cannot read the transcripts: {e}"))
                }
            })?;
        Ok(Response::new(v1::TranscriptsReply {
            agents_json: found.iter().map(to_json).collect::<Result<Vec<_>, _>>()?,
        }))
    }

    async fn create_token(
        &self,
        req: Request<v1::CreateTokenRequest>,
    ) -> Result<Response<v1::CreateTokenReply>, Status> {
        self.authorize(&req, "create session tokens")?;
        let Some(key) = &self.tokens else {
            return Err(Status::failed_precondition(
                "this coordinator runs --insecure: its pages need no token",
            ));
        };
        let subject = tls::peer_of(&req)?.name;
        let ttl = match req.into_inner().ttl_secs {
            0 => DEFAULT_TOKEN_TTL,
            s => std::time::Duration::from_secs(s),
        };
        if ttl > crate::web::MAX_TOKEN_TTL {
            return Err(Status::invalid_argument(
                "a session token lives at most 30 days; ask for a shorter --ttl",
            ));
        }
        let token = key.issue(&subject, ttl);
        let claims = key
            .verify(&token)
            .map_err(|e| Status::internal(format!("cannot issue a token: {e}")))?;
        Ok(Response::new(v1::CreateTokenReply {
            login_url: format!(
                "{}/login?token={token}",
                self.session_base.trim_end_matches('/')
            ),
            token,
            subject,
            expires_unix: claims.exp,
        }))
    }
}

/// The parts of a live snapshot a client shows.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SnapshotView {
    pub run_id: String,
    pub workflow: String,
    pub status: Option<RunStatus>,
    pub elapsed_ms: u64,
    pub agents: u64,
    pub done: u64,
    pub failed: u64,
    pub running: u64,
    pub cached: u64,
    pub output_tokens: u64,
    pub logs: Vec<String>,
    pub groups: Vec<(String, u64, u64)>,
    /// The rest of the live snapshot, for `flotilla watch`.
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub waiting: Option<String>,
    /// Per group: title, total, done, failed, running, output tokens.
    #[serde(default)]
    pub group_detail: Vec<(String, u64, u64, u64, u64, u64)>,
}

impl SnapshotView {
    /// The live snapshot again (what the terminal progress view draws).
    pub fn to_snapshot(&self) -> Snapshot {
        Snapshot {
            run_id: self.run_id.clone(),
            workflow: crate::store::records::WorkflowInfo {
                name: self.workflow.clone(),
                description: self.description.clone(),
            },
            status: self.status,
            elapsed_ms: self.elapsed_ms,
            groups: self
                .group_detail
                .iter()
                .map(|(title, total, done, failed, running, output_tokens)| {
                    crate::run::GroupProgress {
                        title: title.clone(),
                        total: *total,
                        done: *done,
                        failed: *failed,
                        running: *running,
                        output_tokens: *output_tokens,
                    }
                })
                .collect(),
            logs: Arc::new(self.logs.clone()),
            agents: self.agents,
            done: self.done,
            failed: self.failed,
            running: self.running,
            cached: self.cached,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            waiting: self.waiting.clone(),
            since: None,
        }
    }
}

impl SnapshotView {
    /// The same view of a run that ended, from its report.
    pub fn from_report(r: &Report) -> SnapshotView {
        let groups = r
            .groups
            .iter()
            .map(|g| {
                let ended = r
                    .agents
                    .iter()
                    .filter(|a| a.group == g.title && a.status != "running")
                    .count() as u64;
                (g.title.clone(), ended, g.agents.len() as u64)
            })
            .collect();
        SnapshotView {
            run_id: r.run_id.clone(),
            workflow: r.workflow.name.clone(),
            status: Some(r.status),
            elapsed_ms: r.usage.duration_ms,
            agents: r.usage.agents,
            done: r.agents.iter().filter(|a| a.status == "completed").count() as u64,
            failed: r.usage.errors,
            running: 0,
            cached: r.usage.cached,
            output_tokens: r.usage.output_tokens,
            logs: r.logs.clone(),
            description: r.workflow.description.clone(),
            input_tokens: r.usage.input_tokens,
            waiting: None,
            group_detail: r
                .groups
                .iter()
                .map(|g| {
                    let of = |st: &str| {
                        r.agents
                            .iter()
                            .filter(|a| a.group == g.title && a.status == st)
                            .count() as u64
                    };
                    let tokens = r
                        .agents
                        .iter()
                        .filter(|a| a.group == g.title)
                        .map(|a| a.output_tokens)
                        .sum();
                    (
                        g.title.clone(),
                        g.agents.len() as u64,
                        of("completed"),
                        of("failed"),
                        0,
                        tokens,
                    )
                })
                .collect(),
            groups,
        }
    }
}

impl From<&Snapshot> for SnapshotView {
    fn from(s: &Snapshot) -> Self {
        SnapshotView {
            run_id: s.run_id.clone(),
            workflow: s.workflow.name.clone(),
            status: s.status,
            elapsed_ms: s.elapsed_now_ms(),
            agents: s.agents,
            done: s.done,
            failed: s.failed,
            running: s.running,
            cached: s.cached,
            output_tokens: s.output_tokens,
            logs: s.logs.iter().cloned().collect(),
            groups: s
                .groups
                .iter()
                .map(|g| (g.title.clone(), g.done + g.failed, g.total))
                .collect(),
            description: s.workflow.description.clone(),
            input_tokens: s.input_tokens,
            waiting: s.waiting.clone(),
            group_detail: s
                .groups
                .iter()
                .map(|g| {
                    (
                        g.title.clone(),
                        g.total,
                        g.done,
                        g.failed,
                        g.running,
                        g.output_tokens,
                    )
                })
                .collect(),
        }
    }
}
