//! `ClientService`: launch, wait, status, stop, control, list runs and workers, tokens — what
//! `flotilla` and other clients ask a coordinator, forwarded to the leader when this one
//! does not lead.

use std::sync::Arc;

use flotilla_proto::ErrorKind;
use flotilla_proto::tls::{self, Role, TlsFiles};
use flotilla_proto::v1;
use flotilla_proto::v1::client_service_client::ClientServiceClient;
use flotilla_proto::v1::client_service_server::ClientService;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use super::options::LaunchPolicy;
use super::worker_bridge::{StreamOf, check_version};
use crate::coordinator::Coordinator;
use crate::namespace::Scope;
use crate::registry::RunRegistry;
use crate::report::Report;
use crate::run::Control;
use crate::settings::{FetchFrom, RunSettings, SourceRef};
use crate::workflows::{AgentType, CarriedWorkflows, FoundWorkflow};
use crate::{LaunchRequest, history};
use flotilla_local::sizes;
use flotilla_proto::wire::SnapshotView;

pub(super) struct ClientSvc {
    pub(super) coordinator: Arc<Coordinator>,
    pub(super) registry: Arc<RunRegistry>,
    pub(super) secure: bool,
    pub(super) session_base: String,
    pub(super) tokens: Option<crate::tokens::TokenKey>,
    /// This coordinator's TLS files (a standby calls the leader with them).
    pub(super) tls: Option<TlsFiles>,
    pub(super) to_leader:
        tokio::sync::Mutex<Option<(String, ClientServiceClient<tonic::transport::Channel>)>>,
    pub(super) policy: LaunchPolicy,
    /// The name the leader's certificate is checked for (`--peer-name`).
    pub(super) peer_name: Option<String>,
    /// The server's tasks: a source stream's sender is one.
    pub(super) tasks: tokio_util::task::TaskTracker,
}

/// Life of a session token when the caller does not say.
pub(super) const DEFAULT_TOKEN_TTL: std::time::Duration = std::time::Duration::from_secs(12 * 3600);

impl ClientSvc {
    /// A client of the leader when this coordinator is a standby; `None` when it leads (or
    /// runs alone).
    pub(super) async fn leader_client(
        &self,
    ) -> Result<Option<ClientServiceClient<tonic::transport::Channel>>, Status> {
        let Some(l) = self.coordinator.leadership() else {
            return Ok(None);
        };
        if l.holds_seat() {
            return Ok(None);
        }
        let addr = l.wait_for_leader(LEADER_WAIT).await.ok_or_else(|| {
            ErrorKind::Unavailable
                .status("no coordinator leads yet (is etcd reachable?); try again")
        })?;
        if l.holds_seat() {
            return Ok(None);
        }
        let mut cached = self.to_leader.lock().await;
        if let Some((a, c)) = cached.as_ref()
            && *a == addr
        {
            return Ok(Some(c.clone()));
        }
        let channel = tls::channel_as(&addr, self.tls.as_ref(), self.peer_name.as_deref())
            .map_err(|e| {
                ErrorKind::Unavailable.status(format!("cannot reach the leader at {addr}: {e}"))
            })?;
        let client = ClientServiceClient::new(channel);
        *cached = Some((addr, client.clone()));
        Ok(Some(client))
    }

    pub(super) fn authorize<T>(&self, req: &Request<T>, what: &str) -> Result<(), Status> {
        if self.secure {
            tls::require_role(req, &[Role::Client, Role::Coordinator], what)?;
        }
        Ok(())
    }

    /// The namespaces the caller may act in (see `namespace`), once it may `what` at all: a
    /// client's certificate says them; a coordinator forwarding for a client says the
    /// client's ([`ON_BEHALF`]), and one that says none (a coordinator of an older version,
    /// or a tool holding a coordinator's key) acts in `default` only; without TLS, all.
    pub(super) fn scope<T>(&self, req: &Request<T>, what: &str) -> Result<Scope, Status> {
        if !self.secure {
            return Ok(Scope::All);
        }
        let peer = tls::require_role(req, &[Role::Client, Role::Coordinator], what)?;
        if peer.role == Role::Coordinator {
            return Ok(Scope::from_organisation(
                req.metadata().get(ON_BEHALF).and_then(|v| v.to_str().ok()),
            ));
        }
        Ok(Scope::from_organisation(peer.organisation.as_deref()))
    }

    /// The namespace whose sources a source RPC reads or writes: `asked` (empty: the caller's
    /// first, as for a launch) when the caller's certificate names it. Sources are refused
    /// across namespaces exactly as launches are, and nothing says whether the other
    /// namespace holds anything.
    pub(super) fn source_namespace<T>(
        &self,
        req: &Request<T>,
        asked: &str,
        what: &str,
    ) -> Result<String, Status> {
        let scope = self.scope(req, what)?;
        let who = tls::peer_of(req).map_or_else(|_| "insecure".to_owned(), |p| p.name);
        scope
            .choose(asked, &who)
            .map_err(|e| ErrorKind::Denied.status(e))
    }

    /// The namespace of `run`: as this coordinator runs it, else as its manifest says.
    async fn namespace_of(&self, run: &str) -> Result<String, Status> {
        if let Some(ns) = self.registry.namespace(run) {
            return Ok(ns);
        }
        history::namespace_of(self.coordinator.store(), run)
            .await
            .map_err(|e| ErrorKind::Unavailable.status(format!("cannot read run {run}: {e}")))?
            .ok_or_else(|| {
                ErrorKind::NotFound
                    .status(format!("no run {run} on this coordinator or in its store"))
            })
    }

    /// Refuses a run outside the caller's namespaces as if it were not there.
    pub(super) async fn visible(&self, scope: &Scope, run: &str) -> Result<(), Status> {
        if scope == &Scope::All {
            return Ok(());
        }
        let ns = self.namespace_of(run).await?;
        if scope.may(&ns) {
            return Ok(());
        }
        Err(ErrorKind::NotFound.status(format!(
            "no run {run} in namespace(s) {} (the ones your certificate names)",
            scope.list()
        )))
    }

    /// Who is pushing a workflow, if they may: a `coordinator` certificate, or a client the
    /// operator listed as a publisher. (Without TLS, on loopback, anyone may.)
    pub(super) fn publisher<T>(&self, req: &Request<T>) -> Result<String, Status> {
        if !self.secure {
            return Ok("insecure".into());
        }
        let peer = tls::require_role(req, &[Role::Client, Role::Coordinator], "save workflows")?;
        if peer.role == Role::Coordinator || self.policy.publishers.contains(&peer.name) {
            return Ok(peer.name);
        }
        Err(ErrorKind::Denied.status(format!(
            "{} may not push workflows to this coordinator: a push changes what a namespace's `launch NAME` runs, so only the publishers its operator names may (`--publisher {}` or `publishers` in its config)",
            peer.name, peer.name
        )))
    }

    /// The namespace whose pushed workflows a push or a listing is about: `asked` when the
    /// caller's certificate names it (empty: its first, as for a launch). `*` names the
    /// fleet's (offered to every namespace after its own): any caller may list them, only an
    /// operator (`*`) or a coordinator may push there. A `coordinator` certificate that
    /// forwards for nobody is the operator's own tool here, and acts in every namespace.
    pub(super) fn workflow_namespace<T>(
        &self,
        req: &Request<T>,
        asked: &str,
        pushing: bool,
    ) -> Result<String, Status> {
        let what = if pushing {
            "push workflows"
        } else {
            "list workflows"
        };
        let mut scope = self.scope(req, what)?;
        let peer = tls::peer_of(req).ok();
        if peer.as_ref().is_some_and(|p| p.role == Role::Coordinator)
            && req.metadata().get(ON_BEHALF).is_none()
        {
            scope = Scope::All;
        }
        let who = peer.map_or_else(|| "insecure".to_owned(), |p| p.name);
        let asked = asked.trim();
        if asked == crate::saved::FLEET {
            if pushing && scope != Scope::All {
                return Err(ErrorKind::Denied.status(format!(
                    "certificate {who:?} may push to namespace(s) {} only: a push to '*' changes what every namespace's `launch NAME` runs, so only an operator's certificate (issued with `flotilla certs issue --namespace '*'`) may make one; push without --namespace '*'",
                    scope.list()
                )));
            }
            return Ok(crate::saved::FLEET.to_owned());
        }
        if crate::namespace::valid_name(asked) && !scope.may(asked) {
            let doing = if pushing { "push to" } else { "list" };
            return Err(ErrorKind::Denied.status(format!(
                "certificate {who:?} may act in namespace(s) {} only, not {asked:?}: {doing} your own without --namespace, or use a certificate issued with `flotilla certs issue --namespace {asked}`",
                scope.list()
            )));
        }
        scope
            .choose(asked, &who)
            .map_err(|e| ErrorKind::Denied.status(e))
    }

    pub(super) fn session_url(&self, run: &str) -> String {
        format!("{}/runs/{run}", self.session_base.trim_end_matches('/'))
    }

    pub(super) async fn stored_report(&self, run: &str) -> Result<Report, Status> {
        history::load_report(self.coordinator.store(), run)
            .await
            .map_err(|e| match e.kind() {
                ErrorKind::NotFound => ErrorKind::NotFound
                    .status(format!("no run {run} on this coordinator or in its store")),
                _ => ErrorKind::Unavailable.status(format!("cannot read run {run}: {e}")),
            })
    }

    /// A launch's run settings: none sent are the defaults; a source the workers would not
    /// fetch is refused now, not by each agent six times — the URL's form (every client, the
    /// CLI's checks or not) and, for a path on the workers' disks, whether this coordinator's
    /// operator says its workers fetch those.
    fn launch_settings(&self, settings_json: &str) -> Result<RunSettings, Status> {
        // None sent: the defaults, as for any field a client leaves out.
        let settings_json = match settings_json.trim() {
            "" => "{}",
            text => text,
        };
        let settings: RunSettings = serde_json::from_str(settings_json).map_err(|e| {
            ErrorKind::Invalid.status(format!(
                "run settings are not valid: {e}; send a JSON object of run settings, or none for the defaults"
            ))
        })?;
        if let Some(url) = settings.source.as_ref().and_then(|s| s.url.as_deref()) {
            let from = SourceRef::fetch_from(url)
                .map_err(|e| ErrorKind::Invalid.status(format!("invalid run settings: {e}")))?;
            if from == FetchFrom::WorkerDisk && !self.policy.file_sources {
                return Err(ErrorKind::Invalid.status(format!(
                    "source {url:?} is a path on the workers' own disks, which this coordinator does not accept: give an https, http, ssh or git URL, or launch from the repository without --source to send its code with the run; an operator whose workers run with --allow-file-sources can allow it with `flotilla coordinator --allow-file-sources` (allow_file_sources = true in its config file)"
                )));
            }
        }
        Ok(settings)
    }

    /// The run's namespace: the one `asked` for if the certificate names it, else (a resume)
    /// the parent's, else the certificate's first. A resumed run must be the caller's.
    async fn launch_namespace(
        &self,
        scope: &Scope,
        who: &str,
        mut asked: String,
        resume_from: &str,
    ) -> Result<String, Status> {
        if !resume_from.is_empty() {
            // An unknown run: the launch says there is nothing to resume.
            let parent = match self.registry.namespace(resume_from) {
                Some(ns) => Some(ns),
                None => history::namespace_of(self.coordinator.store(), resume_from)
                    .await
                    .map_err(|e| {
                        ErrorKind::Unavailable.status(format!("cannot read run {resume_from}: {e}"))
                    })?,
            };
            if let Some(ns) = parent {
                self.visible(scope, resume_from).await?;
                // A resume stays in its run's namespace: its calls served from the parent
                // are the parent's, prompts and all.
                if !asked.is_empty() && asked != ns {
                    return Err(ErrorKind::Denied.status(format!(
                        "run {resume_from} is in namespace {ns}, and a resume stays in its run's namespace: leave out --namespace {asked}"
                    )));
                }
                asked = ns;
            }
        }
        scope
            .choose(&asked, who)
            .map_err(|e| ErrorKind::Denied.status(e))
    }

    /// On a coordinator that runs saved workflows only: `r` runs the one it names, of the
    /// run's namespace `ns` (then the fleet's, then the bundled ones), and its nested
    /// `workflow()` calls reach only what this coordinator holds for `ns`.
    async fn saved_only(&self, r: &mut v1::LaunchRequest, ns: &str) -> Result<(), Status> {
        if r.saved_name.is_empty() {
            return Err(ErrorKind::Denied.status(
                "this coordinator runs saved workflows only: launch a pushed or bundled one by name (`flotilla workflows list --coordinator URL`); a publisher of this coordinator can push yours with `flotilla workflows push FILE`",
            ));
        }
        // Another namespace's name reads as one nobody pushed.
        let name = r.saved_name.trim_start_matches('/').to_owned();
        let found = match crate::saved::find(self.coordinator.store(), ns, &name)
            .await
            .map_err(|e| e.kind().status(e.to_string()))?
        {
            Some(w) => w,
            None => crate::bundled::find(&name).ok_or_else(|| {
                ErrorKind::NotFound.status(format!(
                    "no saved workflow {name:?} in namespace {ns} on this coordinator (`flotilla workflows list --coordinator URL` lists them); a publisher of this coordinator can push it with `flotilla workflows push FILE`"
                ))
            })?,
        };
        r.script = found.source;
        r.origin = found.origin;
        // Bundled ones are found after the pushed ones anyway.
        r.workflows = crate::saved::offered(self.coordinator.store(), ns)
            .await
            .map_err(|e| e.kind().status(e.to_string()))?
            .into_iter()
            .map(v1::SavedWorkflow::from)
            .collect();
        Ok(())
    }

    /// What a launch answers: its run, or why it was refused (nothing was stored then: no
    /// run id to hand out).
    fn launch_reply(
        &self,
        launched: Result<crate::run::RunHandle, crate::Rejected>,
    ) -> Result<Response<v1::LaunchReply>, Status> {
        match launched {
            Ok(handle) => {
                let run_id = handle.run_id.clone();
                let notes = handle.notes.clone();
                self.registry.track(handle);
                Ok(Response::new(v1::LaunchReply {
                    session_url: self.session_url(&run_id),
                    run_id,
                    status: "running".into(),
                    error: String::new(),
                    report_json: String::new(),
                    notes,
                    resend_source: false,
                }))
            }
            Err(rejected) => {
                let report =
                    Report::rejected("", rejected.workflow.clone(), rejected.message.clone());
                Ok(Response::new(v1::LaunchReply {
                    run_id: String::new(),
                    session_url: String::new(),
                    status: "rejected".into(),
                    error: rejected.message,
                    report_json: to_json(&report)?,
                    notes: Vec::new(),
                    resend_source: rejected.resend_source,
                }))
            }
        }
    }
}

/// A run id as a client names it: a plain name no longer than 128 characters (ids look like
/// `wf_1a2b3c4d-5e6`). Anything else is refused before it reaches the store, where it could
/// only fail slowly or name some other path.
pub fn check_run_id(run: &str) -> Result<(), Status> {
    flotilla_local::sizes::check_run_id(run).map_err(|p| ErrorKind::Invalid.status(p))
}

/// A failure of the connection rather than an answer.
pub(super) fn is_transport(s: &Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

pub(super) fn to_json<T: serde::Serialize>(v: &T) -> Result<String, Status> {
    serde_json::to_string(v).map_err(|e| ErrorKind::Internal.status(format!("cannot encode: {e}")))
}

/// The workflows and agent types a launch carries (W62–W64): what its nested `workflow()`
/// calls and its `agentType`s find.
fn carried(
    workflows: Vec<v1::SavedWorkflow>,
    definitions: Vec<v1::AgentDefinition>,
    builtin: std::collections::HashMap<String, String>,
) -> CarriedWorkflows {
    let mut types: Vec<AgentType> = definitions
        .into_iter()
        .map(|d| AgentType {
            model: (!d.model.is_empty()).then_some(d.model),
            description: (!d.description.is_empty()).then_some(d.description),
            prompt: Some(d.prompt),
            tools: d.tools,
            name: d.name,
        })
        .collect();
    for (name, model) in builtin {
        if !types.iter().any(|t| t.name == name) {
            let mut t = AgentType::builtin(&name);
            t.model = (!model.is_empty()).then_some(model);
            types.push(t);
        }
    }
    CarriedWorkflows {
        workflows: workflows.into_iter().map(FoundWorkflow::from).collect(),
        agent_types: types,
    }
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
        let scope = self.scope(&req, "launch runs")?;
        sizes::check_launch(req.get_ref()).map_err(|e| ErrorKind::Invalid.status(e))?;
        let who = tls::peer_of(&req).map_or_else(|_| "insecure".to_owned(), |p| p.name);
        if let Some(mut leader) = self.leader_client().await? {
            return leader.launch(forwarded(&scope, req.into_inner())).await;
        }
        let mut r = req.into_inner();
        check_version(&r.protocol_version)?;
        if !r.resume_from.is_empty() {
            check_run_id(&r.resume_from)?;
        }
        if (self.policy.disabled)() {
            return Err(ErrorKind::Conflict.status(
                "workflows are disabled on this coordinator (FLOTILLA_DISABLE_WORKFLOWS or disable_workflows in its config file): new runs are refused, runs in progress keep going",
            ));
        }
        let mut settings = self.launch_settings(&r.settings_json)?;
        let asked = std::mem::take(&mut settings.namespace);
        settings.namespace = self
            .launch_namespace(&scope, &who, asked, &r.resume_from)
            .await?;
        if self.policy.saved_only && !r.inherit {
            self.saved_only(&mut r, &settings.namespace).await?;
        }
        // Checked as JSON, kept as text: a value tree of 16 MiB of JSON can take ten times that.
        let args = match r.args_json.take() {
            None => None,
            Some(text) => {
                Some(serde_json::value::RawValue::from_string(text).map_err(|e| {
                    ErrorKind::Invalid.status(format!("args are not valid JSON: {e}"))
                })?)
            }
        };
        let resolver = carried(
            std::mem::take(&mut r.workflows),
            std::mem::take(&mut r.agent_definitions),
            std::mem::take(&mut r.agent_types),
        );
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
        self.launch_reply(launched)
    }

    async fn wait(&self, req: Request<v1::RunRef>) -> Result<Response<v1::ReportReply>, Status> {
        let scope = self.scope(&req, "read runs")?;
        let run = req.into_inner().run_id;
        check_run_id(&run)?;
        self.visible(&scope, &run).await?;
        // Across a failover the run moves: wait where it runs, and follow it.
        let mut adopting = 0u32;
        let report = loop {
            // An engine here that stopped without a report (this coordinator stepped down
            // while the run goes on elsewhere) is not waited on: the run is followed below.
            let rx = self
                .registry
                .lock()
                .get(&run)
                .map(|e| e.report.clone())
                .filter(|rx| rx.borrow().is_some() || rx.has_changed().is_ok());
            if let Some(mut rx) = rx {
                let shared = loop {
                    // The report as the engine shared it: serialized from there, not copied.
                    if let Some(r) = rx.borrow_and_update().clone() {
                        break Some(r);
                    }
                    if rx.changed().await.is_err() {
                        break None;
                    }
                };
                if let Some(r) = shared {
                    break r;
                }
                tracing::info!(
                    run,
                    "the run's engine here stopped without a report; following the run"
                );
            }
            if let Some(mut leader) = self.leader_client().await? {
                match leader
                    .wait(forwarded(
                        &scope,
                        v1::RunRef {
                            run_id: run.clone(),
                        },
                    ))
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
                break std::sync::Arc::new(report);
            }
            // Leading, and the run is live without us: it is about to be adopted.
            if self.coordinator.leadership().is_some() && adopting < 120 {
                adopting += 1;
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                continue;
            }
            return Err(ErrorKind::Conflict.status(format!(
                "run {run} is not running on this coordinator and has not finished; its owner may have died (resume it with `flotilla resume {run}`)"
            )));
        };
        Ok(Response::new(v1::ReportReply {
            report_json: to_json(&*report)?,
            finished: true,
        }))
    }

    async fn report(&self, req: Request<v1::RunRef>) -> Result<Response<v1::ReportReply>, Status> {
        let scope = self.scope(&req, "read runs")?;
        check_run_id(&req.get_ref().run_id)?;
        if !self.registry.lock().contains_key(&req.get_ref().run_id)
            && let Some(mut leader) = self.leader_client().await?
        {
            return leader.report(forwarded(&scope, req.into_inner())).await;
        }
        let run = req.into_inner().run_id;
        self.visible(&scope, &run).await?;
        // A run here answers from its engine (its calls as they stand: queued, running),
        // never from a rebuild of its stored events, which takes an unended call for ended.
        let report = match self.registry.live_report(&run).await {
            Some(r) => (*r).clone(),
            None => self.stored_report(&run).await?,
        };
        Ok(Response::new(v1::ReportReply {
            finished: report.status.is_final(),
            report_json: to_json(&report)?,
        }))
    }

    async fn status(&self, req: Request<v1::RunRef>) -> Result<Response<v1::StatusReply>, Status> {
        let scope = self.scope(&req, "read runs")?;
        check_run_id(&req.get_ref().run_id)?;
        if let Some(mut leader) = self.leader_client().await? {
            return leader.status(forwarded(&scope, req.into_inner())).await;
        }
        let run = req.into_inner().run_id;
        self.visible(&scope, &run).await?;
        let entry = self
            .registry
            .lock()
            .get(&run)
            .map(|e| (e.snapshot.borrow().clone(), e.report.borrow().is_some()));
        let (snap, finished) = entry.ok_or_else(|| {
            ErrorKind::NotFound.status(format!(
                "run {run} is not running on this coordinator; see `flotilla show {run}`"
            ))
        })?;
        let mut view = SnapshotView::from(&*snap);
        // Once ended, what its report says (the last snapshot may precede the end's).
        if let Some(summary) = self.registry.summary(&run) {
            view.summary = summary;
        }
        Ok(Response::new(v1::StatusReply {
            snapshot_json: to_json(&view)?,
            finished,
        }))
    }

    async fn stop(&self, req: Request<v1::RunRef>) -> Result<Response<v1::StopReply>, Status> {
        let scope = self.scope(&req, "stop runs")?;
        check_run_id(&req.get_ref().run_id)?;
        if let Some(mut leader) = self.leader_client().await? {
            return leader.stop(forwarded(&scope, req.into_inner())).await;
        }
        let who = asker(&req);
        let run = req.into_inner().run_id;
        self.visible(&scope, &run).await?;
        let stopper = self.registry.lock().get(&run).map(|e| e.stopper.clone());
        let stopped = stopper.is_some_and(|s| {
            let _ = s.send(Control::Note(format!(
                "[stop] {who} asked to stop the run (no reason given)"
            )));
            s.send(Control::Stop).is_ok()
        });
        if !stopped {
            return Err(
                ErrorKind::NotFound.status(format!("run {run} is not running on this coordinator"))
            );
        }
        Ok(Response::new(v1::StopReply { stopped }))
    }

    async fn list_runs(
        &self,
        req: Request<v1::ListRunsRequest>,
    ) -> Result<Response<v1::ListRunsReply>, Status> {
        let scope = self.scope(&req, "list runs")?;
        // The leader runs the live runs: it lists them as their engines have them. With no
        // leader to ask, the store's index says what it knows.
        let leader_known = self
            .coordinator
            .leadership()
            .is_some_and(|l| !l.holds_seat() && l.leader().is_some());
        if leader_known && let Ok(Some(mut leader)) = self.leader_client().await {
            match leader
                .list_runs(forwarded(&scope, req.get_ref().clone()))
                .await
            {
                Ok(r) => return Ok(r),
                Err(s) if is_transport(&s) => {}
                Err(s) => return Err(s),
            }
        }
        let text = req.into_inner().filter_json;
        let mut filter: crate::index::Filter = if text.trim().is_empty() {
            crate::index::Filter::default()
        } else {
            if text.len() > 64 << 10 {
                return Err(ErrorKind::Invalid.status(format!(
                    "the run filter is {} bytes; at most 64 KiB",
                    text.len()
                )));
            }
            serde_json::from_str(&text).map_err(|e| {
                ErrorKind::Invalid.status(format!("the run filter is not valid: {e}"))
            })?
        };
        if let Some(after) = &filter.after
            && (after.len() > 256 || after.contains('/') || after.starts_with('.'))
        {
            return Err(ErrorKind::Invalid.status(
                "the page token is not one a listing gave: pass the `next` of the page before",
            ));
        }
        filter.within = scope.names().map(<[String]>::to_vec);
        let page = crate::index::page_with(self.coordinator.store(), &filter, &*self.registry)
            .await
            .map_err(|e| ErrorKind::Unavailable.status(format!("cannot list runs: {e}")))?;
        Ok(Response::new(v1::ListRunsReply {
            runs_json: to_json(&page.runs)?,
            next: page.next.unwrap_or_default(),
        }))
    }

    async fn list_workers(
        &self,
        req: Request<v1::ListWorkersRequest>,
    ) -> Result<Response<v1::ListWorkersReply>, Status> {
        let scope = self.scope(&req, "list workers")?;
        if let Some(mut leader) = self.leader_client().await? {
            return leader
                .list_workers(forwarded(&scope, req.into_inner()))
                .await;
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
        let scope = self.scope(&req, "control runs")?;
        check_run_id(&req.get_ref().run_id)?;
        if let Some(mut leader) = self.leader_client().await? {
            return leader.control(forwarded(&scope, req.into_inner())).await;
        }
        let who = asker(&req);
        let v1::ControlRequest {
            run_id,
            action,
            agent,
            reason,
            budget_usd,
            question,
            answer_json,
            fresh,
        } = req.into_inner();
        let action = if action == "restart_agent" && fresh {
            "restart_agent_fresh".to_owned()
        } else {
            action
        };
        sizes::text("the action", &action)
            .and_then(|()| sizes::text("the agent", &agent))
            .map_err(|e| ErrorKind::Invalid.status(e))?;
        if reason.len() > crate::registry::MAX_REASON {
            return Err(ErrorKind::Invalid.status(format!(
                "the reason is {} bytes; keep it under {}",
                reason.len(),
                crate::registry::MAX_REASON
            )));
        }
        let answer = (action == "answer")
            .then(|| {
                sizes::text("the question", &question)?;
                sizes::answer(&answer_json)
            })
            .transpose()
            .map_err(|e| e.status())?;
        self.visible(&scope, &run_id).await?;
        if let Some(value) = answer {
            let message = self
                .registry
                .answer(&run_id, Some(question), value, &who)
                .await?;
            return Ok(Response::new(v1::ControlReply { message }));
        }
        let asked = crate::registry::Asked {
            by: &who,
            reason: &reason,
        };
        let message = self
            .registry
            .control(&run_id, &action, &agent, Some(budget_usd), asked)
            .await?;
        Ok(Response::new(v1::ControlReply { message }))
    }

    async fn changes(
        &self,
        req: Request<v1::RunRef>,
    ) -> Result<Response<v1::ChangesReply>, Status> {
        let scope = self.scope(&req, "read runs")?;
        let run = req.into_inner().run_id;
        check_run_id(&run)?;
        self.visible(&scope, &run).await?;
        // The journal is in the shared store: any coordinator of a group answers.
        let changes = crate::head::changes_of(self.coordinator.store(), &run)
            .await
            .map_err(|e| match e.kind() {
                ErrorKind::NotFound => ErrorKind::NotFound.status(e.to_string()),
                _ => ErrorKind::Unavailable.status(e.to_string()),
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
        let namespace =
            self.source_namespace(&req, &req.get_ref().namespace, "fetch run sources")?;
        let r = req.into_inner();
        check_version(&r.protocol_version)?;
        // A few chunks ahead of the client at most: the stream's own pace is the flow control.
        let (tx, rx) = mpsc::channel(8);
        let store = self.coordinator.store().clone();
        // Ends with the transfer, or when the client stops reading.
        self.tasks.spawn(async move {
            let req = v1::SourceRequest {
                id: 0,
                repo: r.repo,
                commit: r.commit,
                have_packs: r.have_packs,
                ..v1::SourceRequest::default()
            };
            crate::source::serve_to(store, &namespace, req, crate::source::Sink::Stream(tx)).await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn source_have(
        &self,
        req: Request<v1::SourceHaveRequest>,
    ) -> Result<Response<v1::SourceHaveReply>, Status> {
        let namespace =
            self.source_namespace(&req, &req.get_ref().namespace, "upload run sources")?;
        let r = req.into_inner();
        check_version(&r.protocol_version)?;
        if r.commits.len() > 10_000 {
            return Err(ErrorKind::Invalid.status("ask about at most 10,000 commits at once"));
        }
        // Not a repository id: nothing of it is held.
        let Ok(repo) = crate::source::Repo::new(&namespace, &r.repo) else {
            return Ok(Response::new(v1::SourceHaveReply::default()));
        };
        // Sources live in the shared store: any coordinator of a group answers.
        let held = crate::source::have(self.coordinator.store(), &repo, &r.commits)
            .await
            .map_err(|e| ErrorKind::Unavailable.status(format!("cannot read the store: {e}")))?;
        Ok(Response::new(v1::SourceHaveReply { held }))
    }

    async fn put_source(
        &self,
        req: Request<Streaming<v1::SourceUpload>>,
    ) -> Result<Response<v1::PutSourceReply>, Status> {
        let scope = self.scope(&req, "upload run sources")?;
        let who = tls::peer_of(&req).map_or_else(|_| "insecure".to_owned(), |p| p.name);
        let mut chunks = req.into_inner();
        let first = chunks
            .message()
            .await?
            .ok_or_else(|| ErrorKind::Invalid.status("an empty source upload"))?;
        let namespace = scope
            .choose(&first.namespace, &who)
            .map_err(|e| ErrorKind::Denied.status(e))?;
        let mut rx =
            crate::source::Receiver::start(self.coordinator.store().clone(), &namespace, &first)
                .await
                .map_err(|e| e.kind().status(e.to_string()))?;
        // A pack that fails part way is dropped from the store, not left half uploaded.
        let received = async {
            rx.push(&first.data)
                .await
                .map_err(|e| e.kind().status(e.to_string()))?;
            while let Some(chunk) = chunks.message().await? {
                rx.push(&chunk.data)
                    .await
                    .map_err(|e| e.kind().status(e.to_string()))?;
            }
            Ok::<_, Status>(())
        }
        .await;
        if let Err(e) = received {
            rx.abort().await;
            return Err(e);
        }
        let (pack, bytes) = rx
            .finish()
            .await
            .map_err(|e| e.kind().status(e.to_string()))?;
        tracing::info!(repo = %first.repo, namespace = %namespace, commit = %first.tip, pack = %pack, bytes, "stored a source pack");
        Ok(Response::new(v1::PutSourceReply { pack, bytes }))
    }

    async fn push_workflow(
        &self,
        req: Request<v1::PushWorkflowRequest>,
    ) -> Result<Response<v1::PushWorkflowReply>, Status> {
        let by = self.publisher(&req)?;
        sizes::text("the namespace", &req.get_ref().namespace)
            .map_err(|e| ErrorKind::Invalid.status(e))?;
        let ns = self.workflow_namespace(&req, &req.get_ref().namespace, true)?;
        let r = req.into_inner();
        check_version(&r.protocol_version)?;
        sizes::pushed(&r.source).map_err(|e| ErrorKind::Invalid.status(e))?;
        let rules = crate::saved::PushRules {
            shadow_bundled: self.policy.shadow_bundled,
        };
        let record = crate::saved::push(self.coordinator.store(), &ns, &r.source, &by, rules)
            .await
            .map_err(|e| e.kind().status(e.to_string()))?;
        tracing::info!(workflow = %record.name, namespace = %ns, by = %record.by,
            sha256 = %record.sha256, replaced = ?record.replaced, "workflow pushed");
        Ok(Response::new(v1::PushWorkflowReply {
            origin: crate::saved::origin(&ns, &record.name),
            replaced: record.replaced.is_some(),
            name: record.name,
            sha256: record.sha256,
            pushed_by: record.by,
            namespace: ns,
        }))
    }

    async fn list_workflows(
        &self,
        req: Request<v1::ListWorkflowsRequest>,
    ) -> Result<Response<v1::ListWorkflowsReply>, Status> {
        self.authorize(&req, "list workflows")?;
        sizes::text("the namespace", &req.get_ref().namespace)
            .map_err(|e| ErrorKind::Invalid.status(e))?;
        let ns = self.workflow_namespace(&req, &req.get_ref().namespace, false)?;
        check_version(&req.get_ref().protocol_version)?;
        let workflows = crate::saved::offered(self.coordinator.store(), &ns)
            .await
            .map_err(|e| e.kind().status(e.to_string()))?
            .into_iter()
            .map(v1::SavedWorkflow::from)
            .collect();
        Ok(Response::new(v1::ListWorkflowsReply {
            workflows,
            namespace: ns,
        }))
    }

    async fn transcripts(
        &self,
        req: Request<v1::TranscriptsRequest>,
    ) -> Result<Response<v1::TranscriptsReply>, Status> {
        let scope = self.scope(&req, "read runs")?;
        let r = req.into_inner();
        check_version(&r.protocol_version)?;
        check_run_id(&r.run_id)?;
        sizes::text("the agent", &r.agent).map_err(|e| ErrorKind::Invalid.status(e))?;
        self.visible(&scope, &r.run_id).await?;
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
                history::TranscriptError::NoAgent(m) => ErrorKind::NotFound.status(m),
                history::TranscriptError::Store(e) => {
                    ErrorKind::Unavailable.status(format!("cannot read the transcripts: {e}"))
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
        let scope = self.scope(&req, "create session tokens")?;
        let Some(key) = &self.tokens else {
            return Err(ErrorKind::Conflict
                .status("this coordinator runs --insecure: its pages need no token"));
        };
        let subject = tls::peer_of(&req)?.name;
        let ttl = match req.into_inner().ttl_secs {
            0 => DEFAULT_TOKEN_TTL,
            s => std::time::Duration::from_secs(s),
        };
        if ttl > crate::tokens::MAX_TOKEN_TTL {
            return Err(ErrorKind::Invalid
                .status("a session token lives at most 30 days; ask for a shorter --ttl"));
        }
        let token = key.issue_for(&subject, &scope, ttl);
        let claims = key
            .verify(&token)
            .map_err(|e| ErrorKind::Internal.status(format!("cannot issue a token: {e}")))?;
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

/// How long a standby waits for some coordinator to lead before it gives up on a request.
pub(super) const LEADER_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Metadata of a request a standby forwards to the leader: the namespaces of the client it
/// forwards for ([`Scope::encode`]). The leader reads it only from a `coordinator` peer.
pub(super) const ON_BEHALF: &str = "x-flotilla-scope";

/// `msg` as forwarded for a caller of `scope`.
/// Who sent a request, for a run's log: its client certificate's name (a coordinator's,
/// when one forwarded it), or "a client" without TLS.
fn asker<T>(req: &Request<T>) -> String {
    tls::peer_of(req).map_or_else(
        |_| "a client".to_owned(),
        |p| format!("{} (client)", p.name),
    )
}

pub(super) fn forwarded<T>(scope: &Scope, msg: T) -> Request<T> {
    let mut req = Request::new(msg);
    if let Ok(v) = scope.encode().parse() {
        req.metadata_mut().insert(ON_BEHALF, v);
    }
    req
}
