//! The coordinator service: launches runs and owns the dispatcher.
//!
//! [`Coordinator::launch`] checks a script before anything is stored — `meta`, module loading,
//! determinism, syntax, settings, the resume source — so a refused launch leaves no trace and
//! says why (W46). Then it stores the manifest and the script, starts the script thread and the
//! run engine, and returns a [`RunHandle`].

use flotilla_proto::Problem;
use std::sync::Arc;

use bytes::Bytes;
use flotilla_proto::ErrorKind;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::lease::LeaseStore;
use crate::run::resume::{ResumeError, ResumeSource};
use crate::run::{self, EngineInit, RunHandle};
use crate::sched::{self, DispatchHandle};
use crate::script::{self, ScriptInput, ScriptLimits, ScriptShared, runtime, text};
use crate::settings::RunSettings;
use crate::store::records::{Manifest, WorkflowInfo};
use crate::store::{Store, journal, keys};
use crate::workflows::WorkflowResolver;

/// A launch that was refused; nothing was stored.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct Rejected {
    pub message: String,
    pub kind: ErrorKind,
    /// The workflow's name and description, when its `meta` could be read.
    pub workflow: WorkflowInfo,
    /// The run's source was removed by retention while this launch was on its way: the
    /// launcher sends it again and launches again (`LaunchReply.resend_source`).
    pub resend_source: bool,
}

impl Rejected {
    fn invalid(message: impl Into<String>, workflow: WorkflowInfo) -> Self {
        Rejected {
            message: message.into(),
            kind: ErrorKind::Invalid,
            workflow,
            resend_source: false,
        }
    }
}

/// What to run.
pub struct LaunchRequest {
    /// The script's source text.
    pub source: String,
    /// Where it came from (a path or a saved workflow's name), for display.
    pub origin: Option<String>,
    /// `args` (W34) as checked JSON text, kept as text to the script (a parsed tree of it can
    /// take ten times its size); `None` is `undefined`.
    pub args: Option<Box<serde_json::value::RawValue>>,
    pub settings: RunSettings,
    /// Run to resume from (W51).
    pub resume_from: Option<String>,
    /// With `resume_from`: an empty `source`, absent `args` and the settings (all but the
    /// replay mode) come from the stored run.
    pub inherit: bool,
    pub resolver: Arc<dyn WorkflowResolver>,
}

/// What a coordinator is built with: its policy, fixed for its life.
#[derive(Default)]
pub struct CoordinatorOptions {
    /// The dispatcher's (the worker lease TTL, admission, affinity, usage bounds).
    pub dispatch: sched::DispatchOptions,
    /// With coordinators sharing etcd: makes this coordinator's claims on runs (its
    /// [`Leadership`](crate::leader::Leadership), joined before the coordinator is built).
    pub claims: Option<Arc<dyn crate::group::RunClaims>>,
    /// Where run heads are merged (`--cache-dir`); a temporary directory if `None`.
    pub cache_dir: Option<std::path::PathBuf>,
    /// Signs and sends runs' end webhooks (`--notify`); `None`: a run that asks is refused.
    pub notifier: Option<Arc<crate::notify::Notifier>>,
    /// The operator's allowed models (`--allowed-models`; empty: any).
    pub allowed_models: Vec<String>,
    /// The namespaces' policies (`[namespaces.*]`); their daily use is kept in the store.
    /// `None`: every run weighs the same and nothing is counted.
    pub namespaces: Option<crate::namespace::Namespaces>,
    /// A run at its money budget is held until `flotilla budget` raises it (a served
    /// coordinator), instead of stopping its agents (`flotilla run`, where nobody can).
    pub budget_pauses: bool,
    /// Its runs also take answers to their questions (`ask()`) from the store, where
    /// `flotilla answer` without a coordinator writes them (embedded).
    pub answers_from_store: bool,
    /// Where its pages are served (`http://host:port`), for the links webhooks carry.
    pub page_base: Option<String>,
    /// A run waiting on questions alone this long is parked ([`crate::run::EngineInit::park_after`]).
    pub park_after: Option<std::time::Duration>,
}

/// A launch that passed its checks: its script prepared, its workflow, the body the
/// runtime runs and what the launch is told besides.
struct Checked {
    prepared: text::Prepared,
    workflow: WorkflowInfo,
    body: String,
    notes: Vec<String>,
}

/// The coordinator.
pub struct Coordinator {
    store: Store,
    dispatch: DispatchHandle,
    leases: Arc<dyn LeaseStore>,
    cancel: CancellationToken,
    /// Its runs' tasks and its quotas': stopped and waited for on shutdown.
    tasks: crate::tasks::Tasks,
    generation: u64,
    /// With coordinators sharing etcd: every run is recorded and owned before it starts.
    leadership: Option<Arc<dyn crate::group::RunClaims>>,
    /// Where run heads are merged (a git cache).
    cache_dir: std::path::PathBuf,
    /// Signs and sends runs' end webhooks (`--notify`); `None`, a run that asks is refused.
    notifier: Option<Arc<crate::notify::Notifier>>,
    /// The operator's allowed models (`--allowed-models`): every run's allowed models are
    /// within them (empty: no policy).
    model_policy: Vec<String>,
    /// The namespaces' policies and daily use (`[namespaces.*]`); `None`: every run weighs
    /// the same and nothing is counted.
    quotas: Option<Arc<crate::namespace::Quotas>>,
    /// See [`CoordinatorOptions::budget_pauses`].
    budget_pauses: bool,
    answers_from_store: bool,
    page_base: Option<String>,
    park_after: Option<std::time::Duration>,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl Coordinator {
    /// Starts a coordinator over a store and a lease store, with the default options.
    pub fn new(store: Store, leases: Arc<dyn LeaseStore>) -> Self {
        Self::build(store, leases, CoordinatorOptions::default())
    }

    /// Starts a coordinator with its options: everything it is told is here, once.
    pub fn build(store: Store, leases: Arc<dyn LeaseStore>, opts: CoordinatorOptions) -> Self {
        let cancel = CancellationToken::new();
        let dispatch = sched::spawn_with(
            leases.clone(),
            opts.dispatch,
            Some(store.clone()),
            cancel.child_token(),
        );
        let tasks = crate::tasks::Tasks::new(cancel.child_token());
        let quotas = opts
            .namespaces
            .map(|n| crate::namespace::Quotas::new(n, Some(store.clone()), tasks.clone()));
        Coordinator {
            store,
            dispatch,
            leases,
            tasks,
            cancel,
            generation: 1,
            leadership: opts.claims,
            cache_dir: opts
                .cache_dir
                .unwrap_or_else(|| std::env::temp_dir().join("flotilla-coordinator-cache")),
            notifier: opts.notifier,
            model_policy: opts.allowed_models,
            quotas,
            budget_pauses: opts.budget_pauses,
            answers_from_store: opts.answers_from_store,
            page_base: opts.page_base,
            park_after: opts.park_after,
        }
    }

    /// Where run heads are merged and diffed.
    pub fn cache_dir(&self) -> std::path::PathBuf {
        self.cache_dir.clone()
    }

    /// A run's allowed models under the operator's: the run's own that the operator allows,
    /// else the operator's.
    fn within_policy(&self, run: &mut Vec<String>) {
        if !self.model_policy.is_empty() {
            within(run, &self.model_policy);
        }
    }

    /// The namespaces' policies and daily use, when set.
    pub fn quotas(&self) -> Option<&Arc<crate::namespace::Quotas>> {
        self.quotas.as_ref()
    }

    /// Fixes the run's namespace's policy into its settings (whatever a client sent for its
    /// labels and prices): refused when a daily quota of the namespace is used up.
    async fn namespace_policy(&self, settings: &mut RunSettings) -> Result<(), Problem> {
        settings.namespace = crate::namespace::effective(&settings.namespace).to_owned();
        let Some(quotas) = self.quotas.as_ref() else {
            settings.pinned_labels.clear();
            settings.prices.clear();
            return Ok(());
        };
        quotas
            .check(&settings.namespace)
            .await
            .map_err(|e| Problem::denied(e.to_string()))?;
        let policy = quotas.policy(&settings.namespace);
        settings.pinned_labels = policy.labels;
        settings.prices = policy.prices;
        if settings.model.is_empty()
            && let Some(m) = policy.default_model
        {
            settings.model = m;
        }
        if !policy.allowed_models.is_empty() {
            within(&mut settings.allowed_models, &policy.allowed_models);
        }
        Ok(())
    }

    /// What signs and sends the runs' end webhooks, if set.
    pub fn notifier(&self) -> Option<&Arc<crate::notify::Notifier>> {
        self.notifier.as_ref()
    }

    /// The claims this coordinator makes on runs, when it is in a group.
    pub fn claims(&self) -> Option<&Arc<dyn crate::group::RunClaims>> {
        self.leadership.as_ref()
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn dispatch(&self) -> &DispatchHandle {
        &self.dispatch
    }

    pub fn leases(&self) -> &Arc<dyn LeaseStore> {
        &self.leases
    }

    /// Fills what `req` leaves out from the stored run `parent`.
    async fn inherit(&self, req: &mut LaunchRequest, parent: &str) -> Result<(), Rejected> {
        let not_found = |what: String| Rejected {
            message: what,
            kind: ErrorKind::NotFound,
            workflow: WorkflowInfo::default(),
            resend_source: false,
        };
        let unavailable = |e: crate::store::Error| Rejected {
            message: format!("cannot read run {parent}: {e}"),
            kind: e.kind(),
            workflow: WorkflowInfo::default(),
            resend_source: false,
        };
        let manifest = self
            .store
            .get(&crate::store::keys::manifest(parent))
            .await
            .map_err(unavailable)?
            .ok_or_else(|| {
                not_found(format!(
                    "nothing to resume: no run {parent} in {}",
                    self.store.url
                ))
            })?;
        let manifest: Manifest = serde_json::from_slice(&manifest)
            .map_err(|e| not_found(format!("run {parent} has an unreadable manifest: {e}")))?;
        if req.source.is_empty() {
            let script = self
                .store
                .get(&crate::store::keys::script(parent))
                .await
                .map_err(unavailable)?
                .ok_or_else(|| {
                    not_found(format!(
                        "run {parent} has no stored script; pass --script FILE"
                    ))
                })?;
            req.source = String::from_utf8_lossy(&script).into_owned();
            req.origin = manifest.script_origin.clone();
        }
        if req.args.is_none() {
            req.args = manifest.args.clone();
        }
        let replay = req.settings.replay;
        // The namespace is the caller's (the API chose it), not the parent's.
        let namespace = std::mem::take(&mut req.settings.namespace);
        req.settings = manifest.settings.clone();
        req.settings.replay = replay;
        req.settings.namespace = namespace;
        // The money budget it was last given, if raised after its launch.
        if let Some(usd) = self.raised_budget(parent).await {
            req.settings.budget_usd = Some(usd);
        }
        if req
            .resolver
            .carried()
            .is_some_and(|c| c.workflows.is_empty() && c.agent_types.is_empty())
            && let Some(stored) = self.load_carried(parent).await
        {
            req.resolver = Arc::new(stored);
        }
        Ok(())
    }

    /// The workflows a run's launching client carried, if it stored any.
    async fn load_carried(&self, run: &str) -> Option<crate::workflows::CarriedWorkflows> {
        let body = self.store.get(&keys::carried(run)).await.ok()??;
        serde_json::from_slice(&body).ok()
    }

    /// W52: a run is not resumed while attempts of it still run somewhere (two copies would
    /// run side by side). Its attempt keys say so; they go when its agents end or their
    /// workers' leases lapse.
    async fn refuse_while_alive(&self, parent: &str) -> Result<(), Rejected> {
        let prefix = format!("{}{parent}/", crate::lease::keys::ATTEMPTS);
        let alive = self.leases.list(&prefix).await.map_err(|e| Rejected {
            message: format!("cannot check whether run {parent} still runs: {e}"),
            kind: e.kind(),
            workflow: WorkflowInfo::default(),
            resend_source: false,
        })?;
        if alive.is_empty() {
            return Ok(());
        }
        Err(Rejected {
            message: format!(
                "run {parent} still has {} agent(s) running; stop it (`flotilla stop {parent}`) and wait for them to end, then resume",
                alive.len()
            ),
            kind: ErrorKind::Conflict,
            workflow: WorkflowInfo::default(),
            resend_source: false,
        })
    }

    /// Takes the new run `run`, and the run it resumes, for this process (W52). With etcd the
    /// fleet's ownership keys do it ([`crate::group::RunClaims::claim_resume`]); otherwise
    /// owner records in the store ([`crate::owner`]), so two processes sharing a store never
    /// drive one run or resume one run twice at once.
    async fn take_owners(
        &self,
        run: &str,
        parent: Option<&str>,
        workflow: &WorkflowInfo,
    ) -> Result<Vec<crate::owner::Held>, Rejected> {
        let refused = |message: String, kind: ErrorKind| Rejected {
            message,
            kind,
            workflow: workflow.clone(),
            resend_source: false,
        };
        if let Some(l) = self.leadership.as_ref() {
            if let Some(parent) = parent {
                l.claim_resume(parent, run)
                    .await
                    .map_err(|e| refused(e.to_string(), e.kind()))?;
            }
            return Ok(Vec::new());
        }
        let mut held = Vec::new();
        // A run that is not stored has nothing to hold (the resume is refused next).
        let stored = match parent {
            Some(p) => self
                .store
                .get(&keys::manifest(p))
                .await
                .map_err(|e| refused(e.to_string(), e.kind()))?
                .is_some(),
            None => false,
        };
        if let Some(parent) = parent.filter(|_| stored) {
            match crate::owner::take(&self.store, parent, run, &self.tasks).await {
                Ok(h) => held.push(h),
                Err(crate::owner::TakeError::Held(m)) => {
                    return Err(refused(m, ErrorKind::Conflict));
                }
                Err(e) => return Err(refused(e.to_string(), ErrorKind::Unavailable)),
            }
        }
        match crate::owner::take(&self.store, run, run, &self.tasks).await {
            Ok(h) => held.push(h),
            Err(e) => {
                for h in held {
                    h.release().await;
                }
                return Err(refused(e.to_string(), ErrorKind::Unavailable));
            }
        }
        Ok(held)
    }

    /// Stops the dispatcher and every worker link.
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }

    /// [`Coordinator::shutdown`], then waits at most `within` for the dispatcher's tasks
    /// (its key writer, watches, worker leases, links and source streams) and its runs'
    /// (engines, dropped where they stand, then their journals, logs and head keepers, which
    /// write what they were given) to end; whether they all did.
    pub async fn shutdown_and_wait(&self, within: std::time::Duration) -> bool {
        self.shutdown();
        let (dispatched, ran) =
            tokio::join!(self.dispatch.stopped(within), self.tasks.stopped(within));
        dispatched && ran
    }

    /// How many tasks of its runs (engines, journals, logs, head keepers) and its quotas are
    /// running.
    pub fn run_tasks_running(&self) -> usize {
        self.tasks.running()
    }

    /// Checks and starts a run.
    pub async fn launch(&self, mut req: LaunchRequest) -> Result<RunHandle, Rejected> {
        let Checked {
            prepared,
            workflow,
            body,
            notes,
        } = self.checked(&mut req).await?;
        let args_json = req.args.as_ref().map(|a| a.get().to_owned());
        let run_id = new_run_id();
        // W52: one process drives a run, and a run is resumed by one run at a time.
        let owners = self
            .take_owners(&run_id, req.resume_from.as_deref(), &workflow)
            .await?;
        let resume = match self.resume_source(&req, &workflow).await {
            Ok(r) => r,
            Err(e) => {
                self.let_go(owners, &req, &run_id).await;
                return Err(e);
            }
        };
        let manifest = Manifest {
            run_id: run_id.clone(),
            workflow: workflow.clone(),
            script_sha256: hex::encode(Sha256::digest(req.source.as_bytes())),
            script_origin: req.origin.clone(),
            args: req.args.clone(),
            settings: req.settings.clone(),
            created: humantime::format_rfc3339_millis(flotilla_proto::clock::now()).to_string(),
            parent_run_id: req.resume_from.clone(),
            generation: self.generation,
            flotilla_version: env!("CARGO_PKG_VERSION").into(),
        };
        if let Err((e, swept)) = self.store_run(&req, &manifest).await {
            // Nothing runs: let go of what was taken, so the run can be resumed.
            self.let_go(owners, &req, &run_id).await;
            if swept {
                // The run never was: what was written of it goes (the client sends the
                // launch again, with its source).
                self.unwrite(&manifest).await;
            }
            return Err(e);
        }
        let phases = prepared
            .meta
            .phases
            .iter()
            .map(|p| p.title.clone())
            .collect();
        let generation = self.generation;
        let mut handle = self.start_engine(StartEngine {
            run_id,
            workflow,
            phases,
            body,
            args_json,
            settings: req.settings,
            generation,
            resolver: req.resolver,
            resume,
            parent_run_id: req.resume_from,
            owners,
            indexed: crate::index::created(&manifest),
            logs_before: Vec::new(),
            kept: Default::default(),
        })?;
        handle.notes = notes;
        Ok(handle)
    }

    /// A launch checked before anything is taken or written: its script, its settings under
    /// the operator's and its namespace's policy, its backend (chosen when it names none).
    async fn checked(&self, req: &mut LaunchRequest) -> Result<Checked, Rejected> {
        if let (true, Some(parent)) = (req.inherit, req.resume_from.clone()) {
            self.inherit(req, &parent).await?;
        }
        if let Some(parent) = &req.resume_from {
            self.refuse_while_alive(parent).await?;
        }
        let prepared = text::prepare(&req.source)
            .map_err(|e| Rejected::invalid(e.to_string(), WorkflowInfo::default()))?;
        let workflow = WorkflowInfo {
            name: prepared.meta.name.clone(),
            description: prepared.meta.description.clone(),
        };
        // A launch that names no backend gets one the attached workers offer (below).
        req.settings.validate_but_backend().map_err(|e| {
            Rejected::invalid(format!("invalid run settings: {e}"), workflow.clone())
        })?;
        self.within_policy(&mut req.settings.allowed_models);
        self.namespace_policy(&mut req.settings)
            .await
            .map_err(|p| Rejected {
                kind: p.kind,
                message: p.message,
                workflow: workflow.clone(),
                resend_source: false,
            })?;
        if req.settings.notify.is_some() && self.notifier.as_ref().is_none() {
            return Err(Rejected::invalid(
                "--notify needs a secret to sign the webhook with, and none is set here: give the coordinator --notify-secret-file FILE (embedded: set FLOTILLA_NOTIFY_SECRET)".to_owned(),
                workflow.clone(),
            ));
        }
        let body = script::runnable_body(&prepared);
        runtime::check_syntax(&body).map_err(|e| Rejected::invalid(e.message, workflow.clone()))?;
        let mut notes = Vec::new();
        if req.settings.backend.is_empty() {
            let (backend, note) = self
                .choose_backend(&req.settings)
                .await
                .map_err(|m| Rejected::invalid(m, workflow.clone()))?;
            req.settings.backend = backend;
            notes.push(note);
        }
        notes.extend(self.unoffered(&req.settings).await);
        Ok(Checked {
            prepared,
            workflow,
            body,
            notes,
        })
    }

    /// The journal a resume is served from (W51), if the launch resumes a run.
    async fn resume_source(
        &self,
        req: &LaunchRequest,
        workflow: &WorkflowInfo,
    ) -> Result<Option<ResumeSource>, Rejected> {
        let Some(parent) = &req.resume_from else {
            return Ok(None);
        };
        match ResumeSource::load(&self.store, parent).await {
            Ok((_, src)) => Ok(Some(src)),
            Err(e @ (ResumeError::NoSuchRun { .. } | ResumeError::NoResults { .. })) => {
                Err(Rejected {
                    message: e.to_string(),
                    kind: ErrorKind::NotFound,
                    workflow: workflow.clone(),
                    resend_source: false,
                })
            }
            Err(ResumeError::Store(e)) => Err(Rejected {
                message: format!("cannot read the run to resume: {e}"),
                kind: e.kind(),
                workflow: workflow.clone(),
                resend_source: false,
            }),
        }
    }

    /// Lets go of what a launch that does not run took: its owner keys and its claim on
    /// the run it resumes.
    async fn let_go(&self, owners: Vec<crate::owner::Held>, req: &LaunchRequest, run_id: &str) {
        for h in owners {
            h.release().await;
        }
        if let (Some(l), Some(parent)) = (self.leadership.as_ref(), &req.resume_from) {
            l.release_resume(parent, run_id).await;
        }
    }

    /// Writes the run: its script, manifest and index entry; checks its source is still
    /// whole (else refused with `resend_source`, and `true`: what was written must go);
    /// keeps the workflows it carries; owns it in a group.
    async fn store_run(
        &self,
        req: &LaunchRequest,
        manifest: &Manifest,
    ) -> Result<(), (Rejected, bool)> {
        let (run_id, workflow) = (&manifest.run_id, &manifest.workflow);
        let store_err = |e: crate::store::Error| {
            let refused = Rejected {
                message: format!("cannot store the run: {e}"),
                kind: e.kind(),
                workflow: workflow.clone(),
                resend_source: false,
            };
            (refused, false)
        };
        self.store
            .put_create(&keys::script(run_id), Bytes::from(req.source.clone()))
            .await
            .map_err(store_err)?;
        let manifest_body = serde_json::to_vec_pretty(manifest).map_err(|e| {
            let refused =
                Rejected::invalid(format!("cannot encode the manifest: {e}"), workflow.clone());
            (refused, false)
        })?;
        self.store
            .put_create(&keys::manifest(run_id), Bytes::from(manifest_body))
            .await
            .map_err(store_err)?;
        crate::index::record(&self.store, &crate::index::created(manifest))
            .await
            .map_err(store_err)?;
        // The run now holds its source against retention; the source must still be there (a
        // sweep may have taken it since the client asked whether it was held), and be its
        // namespace's: another namespace's repository and commit ids find nothing, as ids
        // nobody uploaded.
        if let Some(src) = &req.settings.source
            && src.url.is_none()
            && let Err(e) = match crate::source::Repo::new(&req.settings.namespace, &src.repo) {
                Ok(repo) => crate::source::complete(&self.store, &repo, &src.commit).await,
                Err(e) => Err(e),
            }
        {
            let refused = Rejected {
                message: format!("{e} ({})", crate::source::SWEPT_WHILE_LAUNCHING),
                kind: e.kind(),
                workflow: workflow.clone(),
                resend_source: true,
            };
            return Err((refused, true));
        }
        if let Some(carried) = req.resolver.carried()
            && (!carried.workflows.is_empty() || !carried.agent_types.is_empty())
        {
            let body = serde_json::to_vec(&carried).map_err(|e| {
                let refused = Rejected::invalid(
                    format!("cannot encode the carried workflows: {e}"),
                    workflow.clone(),
                );
                (refused, false)
            })?;
            self.store
                .put_create(&keys::carried(run_id), Bytes::from(body))
                .await
                .map_err(store_err)?;
        }
        if let Some(l) = self.leadership.as_ref() {
            l.own(run_id).await.map_err(|e| {
                let refused = Rejected {
                    message: e.to_string(),
                    kind: e.kind(),
                    workflow: workflow.clone(),
                    resend_source: false,
                };
                (refused, false)
            })?;
        }
        Ok(())
    }

    /// Removes what was written of a run that never was.
    async fn unwrite(&self, manifest: &Manifest) {
        let run_id = &manifest.run_id;
        let _ = crate::index::forget(&self.store, &crate::index::created(manifest)).await;
        if let Ok(objects) = self.store.list_all(&keys::run_dir(run_id)).await {
            for o in objects {
                let _ = self.store.delete(&o.location).await;
            }
        }
        self.store.prune_empty_dirs(&keys::run_dir(run_id));
    }

    /// The backend of a launch that names none: of those the attached workers offer, the
    /// first in the order a machine's own default follows (claude-code, anthropic, openai,
    /// exec, echo; others after) that one of them offers with the run's model and labels
    /// (else the first offered at all, and [`Coordinator::unoffered`] says why none runs it);
    /// and a note saying which and why. With no worker attached there is nothing to choose
    /// from: refused, naming the fix. A run keeps the backend it was launched with, so
    /// workers that attach later never change it.
    async fn choose_backend(&self, settings: &RunSettings) -> Result<(String, String), Problem> {
        const PREFERRED: [&str; 5] = ["claude-code", "anthropic", "openai", "exec", "echo"];
        let rank = |b: &str| {
            PREFERRED
                .iter()
                .position(|p| *p == b)
                .unwrap_or(PREFERRED.len())
        };
        let mut offered: Vec<String> = self
            .dispatch
            .workers()
            .await
            .into_iter()
            .filter(|w| w.attached)
            .flat_map(|w| w.backends)
            .collect();
        offered.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| a.cmp(b)));
        offered.dedup();
        let Some(first) = offered.first().cloned() else {
            return Err(Problem::invalid(
                "the launch names no backend and no worker is attached to this coordinator to choose one from: pass --backend NAME (one your workers will offer; --backend echo for a dry run), or start a worker first (`flotilla workers` lists the attached ones)",
            ));
        };
        let mut chosen = first;
        for b in &offered {
            if self.dispatch.offered(probe(settings, b)).await.is_ok() {
                chosen.clone_from(b);
                break;
            }
        }
        let note = format!(
            "backend {chosen} (chosen by the coordinator: the launch named none, and its attached workers offer {}; pass --backend to choose, --backend echo for a dry run)",
            offered.join(", ")
        );
        Ok((chosen, note))
    }

    /// When no attached worker offers the run's backend with its model and its namespace's
    /// labels: why, and what happens. The run is not refused for it (workers attach and leave:
    /// an autoscaled fleet starts them for the work, a worker restarts); its agents wait up to
    /// its `--worker-wait` for one, then fail with that reason, as the status shows meanwhile.
    async fn unoffered(&self, settings: &RunSettings) -> Option<String> {
        let why = self
            .dispatch
            .offered(probe(settings, &settings.backend))
            .await
            .err()?;
        Some(format!(
            "{why}; the run's agents wait up to {} for one to attach, then fail with this reason (`flotilla workers` lists the attached ones; --worker-wait sets the wait)",
            humantime::format_duration(std::time::Duration::from_millis(settings.worker_wait_ms))
        ))
    }

    /// The money budget run `run_id` was given after its launch (`flotilla budget`), if any.
    async fn raised_budget(&self, run_id: &str) -> Option<f64> {
        let body = self.store.get(&keys::budget(run_id)).await.ok()??;
        let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
        v["usd"].as_f64().filter(|u| u.is_finite() && *u > 0.0)
    }

    /// Takes over a run whose owner is gone (failover): replays its stored script from the
    /// top as the same run, under a new generation; every call in its journal is served from
    /// there, the rest are dispatched again.
    pub async fn adopt(&self, run_id: &str) -> Result<RunHandle, Rejected> {
        self.adopt_holding(run_id, None).await
    }

    /// Wakes a run this coordinator parked: adopts it, the engine holding `owners` (the
    /// records the parked run held) and its log so far heading its log.
    pub async fn wake(
        &self,
        run_id: &str,
        owners: Vec<crate::owner::Held>,
    ) -> Result<RunHandle, Rejected> {
        self.adopt_holding(run_id, Some(owners)).await
    }

    /// The manifest of run `run_id`, which this coordinator adopts, with the money budget it
    /// was given after its launch.
    async fn adopted_manifest(&self, run_id: &str) -> Result<Manifest, Rejected> {
        let manifest = self
            .store
            .get(&keys::manifest(run_id))
            .await
            .map_err(|e| unreadable(run_id, "the manifest", e))?
            .ok_or_else(|| Rejected {
                message: format!("no run {run_id} in {}", self.store.url),
                kind: ErrorKind::NotFound,
                workflow: WorkflowInfo::default(),
                resend_source: false,
            })?;
        let mut manifest: Manifest = serde_json::from_slice(&manifest).map_err(|e| {
            Rejected::invalid(
                format!("run {run_id} has an unreadable manifest: {e}"),
                WorkflowInfo::default(),
            )
        })?;
        // A money budget given after the launch holds the adopted run as it held the first.
        if let Some(usd) = self.raised_budget(run_id).await {
            manifest.settings.budget_usd = Some(usd);
        }
        Ok(manifest)
    }

    /// [`Coordinator::adopt`]; `woken`: the owners of a parked run being woken.
    async fn adopt_holding(
        &self,
        run_id: &str,
        woken: Option<Vec<crate::owner::Held>>,
    ) -> Result<RunHandle, Rejected> {
        let unavailable = |what: &str, e| unreadable(run_id, what, e);
        let manifest = self.adopted_manifest(run_id).await?;
        let source = self
            .store
            .get(&keys::script(run_id))
            .await
            .map_err(|e| unavailable("the script", e))?
            .ok_or_else(|| {
                Rejected::invalid(
                    format!("run {run_id} has no stored script"),
                    manifest.workflow.clone(),
                )
            })?;
        let source = String::from_utf8_lossy(&source).into_owned();
        let prepared = text::prepare(&source)
            .map_err(|e| Rejected::invalid(e.to_string(), manifest.workflow.clone()))?;
        let body = script::runnable_body(&prepared);
        let args_json = manifest.args.as_ref().map(|a| a.get().to_owned());
        let generation = journal::next_generation(&self.store, run_id)
            .await
            .map_err(|e| unavailable("the segments", e))?
            .max(manifest.generation + 1);
        // The history this coordinator takes over is what it lists now, sealed before it
        // reads or runs anything: a segment the previous one still delivers later (it froze
        // with a write on its way) is never read, since its calls run again here.
        let segments = journal::segments(&self.store, run_id)
            .await
            .map_err(|e| unavailable("the journal", e))?;
        match journal::seal(&self.store, run_id, generation, &segments).await {
            Ok(true) => {}
            Ok(false) => {
                return Err(Rejected {
                    message: format!(
                        "run {run_id} was taken over as generation {generation} by another coordinator"
                    ),
                    kind: ErrorKind::Conflict,
                    workflow: manifest.workflow.clone(),
                    resend_source: false,
                });
            }
            Err(e) => return Err(unavailable("the journal seal", e)),
        }
        let read = journal::read_segments(&self.store, segments)
            .await
            .map_err(|e| unavailable("the journal", e))?;
        let warning = read.summary();
        let resume = (!read.calls.is_empty()).then(|| {
            let mut src = ResumeSource::from_records(run_id, read.calls);
            src.warnings
                .extend(warning.map(|w| format!("[resume] {w}")));
            src
        });
        // A resume keeps its claim on the run it resumes across the failover.
        if let (Some(l), Some(parent)) = (self.leadership.as_ref(), &manifest.parent_run_id)
            && let Err(e) = l.claim_resume(parent, run_id).await
        {
            tracing::warn!(run = run_id, parent = %parent, error = %e, "an adopted resume could not claim the run it resumes");
        }
        let mut settings = manifest.settings.clone();
        settings.replay = crate::settings::ReplayMode::Content;
        if let Some(q) = self.quotas.as_ref() {
            q.ready(&settings.namespace).await;
        }
        let phases = prepared
            .meta
            .phases
            .iter()
            .map(|p| p.title.clone())
            .collect();
        tracing::info!(
            run = run_id,
            generation,
            cached = resume.as_ref().map_or(0, ResumeSource::len),
            "adopting a run whose owner is gone"
        );
        // A woken run's log so far heads its log (a failover's adoption does not read it: a big
        // run's events are many).
        let logs_before = match &woken {
            Some(_) => logs_of(&self.store, run_id).await,
            None => Vec::new(),
        };
        self.start_engine(StartEngine {
            run_id: run_id.to_owned(),
            workflow: manifest.workflow.clone(),
            phases,
            body,
            args_json,
            settings,
            generation,
            resolver: Arc::new(self.load_carried(run_id).await.unwrap_or_default()),
            resume,
            parent_run_id: manifest.parent_run_id.clone(),
            owners: woken.unwrap_or_default(),
            indexed: crate::index::created(&manifest),
            logs_before,
            kept: sched::kept::load(&self.store, run_id).await,
        })
    }

    fn start_engine(&self, s: StartEngine) -> Result<RunHandle, Rejected> {
        let shared = Arc::new(ScriptShared::default());
        let (ops_tx, ops_rx) = mpsc::unbounded_channel();
        let input = ScriptInput {
            body: s.body,
            args_json: s.args_json,
            budget_total: s.settings.budget_tokens,
            limits: ScriptLimits {
                memory_bytes: (s.settings.script_memory_mb as usize) << 20,
                cpu: std::time::Duration::from_millis(s.settings.script_cpu_ms),
                ..ScriptLimits::default()
            },
        };
        let (reply_tx, _thread) =
            runtime::spawn(input, ops_tx, shared.clone()).map_err(|e| Rejected {
                message: format!("cannot start the script thread: {e}"),
                kind: ErrorKind::Internal,
                workflow: s.workflow.clone(),
                resend_source: false,
            })?;
        let script_path = Some(self.store.display_path(&keys::script(&s.run_id)));
        let init = EngineInit {
            run_id: s.run_id,
            workflow: s.workflow,
            phases: s.phases,
            settings: s.settings,
            store: self.store.clone(),
            generation: s.generation,
            dispatch: self.dispatch.clone(),
            resolver: s.resolver,
            resume: s.resume,
            shared,
            script_path,
            parent_run_id: s.parent_run_id,
            write_result: true,
            owners: s.owners,
            cache_dir: Some(self.cache_dir()),
            indexed: Some(s.indexed),
            notifier: self.notifier.as_ref().cloned(),
            quotas: self.quotas.clone(),
            tasks: self.tasks.clone(),
            budget_pauses: self.budget_pauses,
            answers_from_store: self.answers_from_store,
            page_base: self.page_base.clone(),
            park_after: self.park_after,
            logs_before: s.logs_before,
            kept: s.kept,
        };
        Ok(run::start(
            init,
            ops_rx,
            Box::new(move |r| {
                let _ = reply_tx.send(r);
            }),
        ))
    }
}

/// What [`Coordinator::start_engine`] needs.
struct StartEngine {
    run_id: String,
    workflow: WorkflowInfo,
    phases: Vec<String>,
    body: String,
    args_json: Option<String>,
    settings: RunSettings,
    generation: u64,
    resolver: Arc<dyn WorkflowResolver>,
    resume: Option<ResumeSource>,
    parent_run_id: Option<String>,
    owners: Vec<crate::owner::Held>,
    /// The run's index entry, rewritten when it ends.
    indexed: crate::index::Entry,
    /// Its log before this engine (an adopted run's earlier generations').
    logs_before: Vec<String>,
    /// What its interrupted calls left their next attempts (an adopted run's).
    kept: std::collections::HashMap<String, flotilla_proto::v1::KeptLeftovers>,
}

/// Why run `run_id` cannot be adopted: `what` of it cannot be read from the store.
fn unreadable(run_id: &str, what: &str, e: crate::store::Error) -> Rejected {
    Rejected {
        message: format!("cannot read {what} of run {run_id}: {e}"),
        kind: e.kind(),
        workflow: WorkflowInfo::default(),
        resend_source: false,
    }
}

/// The log of run `run` so far, from its stored events (an adopted run's earlier generations'
/// lines, which head its log on the coordinator that adopts it).
async fn logs_of(store: &Store, run: &str) -> Vec<String> {
    journal::read_events(store, run)
        .await
        .unwrap_or_default()
        .into_iter()
        .filter_map(|e| match e.event {
            crate::store::records::RunEvent::Log { line } => Some(line),
            _ => None,
        })
        .collect()
}

/// A task as the run's agents that name no model or labels of their own ask for it: `backend`,
/// the run's model, its namespace's pinned labels.
fn probe(settings: &RunSettings, backend: &str) -> flotilla_proto::v1::TaskSpec {
    flotilla_proto::v1::TaskSpec {
        backend: backend.to_owned(),
        model: settings.model.clone(),
        placement_labels: settings
            .pinned_labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        ..Default::default()
    }
}

/// `run`'s allowed models kept to those `policy` allows (all of `policy` when none is left).
fn within(run: &mut Vec<String>, policy: &[String]) {
    run.retain(|m| policy.iter().any(|p| crate::settings::model_allowed(p, m)));
    if run.is_empty() {
        run.extend_from_slice(policy);
    }
}

pub use crate::ids::new_run_id;

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_proto::wire::RunStatus;

    #[test]
    fn run_ids_have_the_claude_code_shape() {
        let id = new_run_id();
        assert_eq!(id.len(), 3 + 8 + 1 + 3, "{id}");
        assert!(id.starts_with("wf_"));
        assert_eq!(&id[11..12], "-");
        assert_ne!(id, new_run_id());
    }

    fn echo_worker(c: &Coordinator, name: &str) -> tempfile::TempDir {
        let workspace = tempfile::tempdir().unwrap();
        let worker = flotilla_worker::Worker::new(
            flotilla_worker::WorkerOptions::unsandboxed(name, 8, workspace.path().into()),
            vec![Arc::new(flotilla_worker::backend::echo::Echo)],
        );
        let (link, end) = flotilla_worker::link_pair();
        c.dispatch.attach(end);
        tokio::spawn(async move { worker.run(link, CancellationToken::new()).await });
        workspace
    }

    /// Issue 30: the dispatcher's tasks are tracked — a worker's link, its lease, the key
    /// writer, the watches — and a coordinator shut down waits for every one of them to end.
    #[tokio::test]
    async fn a_coordinator_shut_down_waits_for_every_task_of_its_dispatcher() {
        let c = Coordinator::new(
            crate::store::open("memory://").unwrap(),
            crate::lease::memory::MemoryLeaseStore::new(),
        );
        let _w = echo_worker(&c, "w0");
        let attached = std::time::Instant::now();
        while !c.dispatch.workers().await.iter().any(|w| w.attached) {
            assert!(
                attached.elapsed() < std::time::Duration::from_secs(10),
                "the worker never attached"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let run = c.launch(launch_with("echo", "default")).await.unwrap();
        assert_eq!(run.wait().await.status, RunStatus::Completed);
        // The key writer, two watches, the worker's link and its lease at least.
        assert!(
            c.dispatch.tasks_running() >= 5,
            "{} tasks",
            c.dispatch.tasks_running()
        );
        assert!(
            c.shutdown_and_wait(std::time::Duration::from_secs(10))
                .await,
            "{} tasks still running",
            c.dispatch.tasks_running()
        );
        assert_eq!(c.dispatch.tasks_running(), 0);
    }

    /// Issue 30, 4: a coordinator that stops stops its runs too, as a crash would leave them
    /// (nothing more is written for them, their end is not announced), and waits until the
    /// writers they started are done: the run reads back as interrupted, to be resumed.
    #[tokio::test]
    async fn a_coordinator_shut_down_stops_its_runs_and_waits_for_their_tasks() {
        let store = crate::store::open("memory://").unwrap();
        let c = Coordinator::new(store.clone(), crate::lease::memory::MemoryLeaseStore::new());
        // No worker: its agent waits for one for ever.
        let mut req = launch_with("echo", "default");
        req.source =
            "export const meta = { name: 'n', description: 'd' };\nreturn await agent('x');".into();
        let run = c.launch(req).await.unwrap();
        let run_id = run.run_id.clone();
        let mut snapshot = run.snapshot.clone();
        let registry = Arc::new(crate::registry::RunRegistry::default());
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        registry.on_end(Arc::new({
            let ended = ended.clone();
            move |_| ended.store(true, std::sync::atomic::Ordering::SeqCst)
        }));
        registry.track(run);
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            snapshot.wait_for(|s| s.summary.queued == 1),
        )
        .await
        .expect("the agent was never queued")
        .unwrap();
        // The engine, its journal, event and transcript logs, and the registry's wait.
        assert!(
            c.run_tasks_running() >= 5,
            "{} run tasks",
            c.run_tasks_running()
        );
        assert!(
            c.shutdown_and_wait(std::time::Duration::from_secs(10))
                .await,
            "{} run tasks still running",
            c.run_tasks_running()
        );
        assert_eq!(c.run_tasks_running(), 0);
        assert!(registry.wait_report(&run_id).await.is_none());
        assert!(
            !ended.load(std::sync::atomic::Ordering::SeqCst),
            "a run its coordinator stopped was announced as ended"
        );
        let report = crate::history::load_report(&store, &run_id).await.unwrap();
        assert_eq!(report.status, RunStatus::Interrupted);
    }

    fn launch_with(backend: &str, namespace: &str) -> LaunchRequest {
        LaunchRequest {
            source: "export const meta = { name: 'n', description: 'd' };\nreturn 1;".into(),
            origin: None,
            args: None,
            settings: RunSettings {
                backend: backend.into(),
                namespace: namespace.into(),
                ..RunSettings::default()
            },
            resume_from: None,
            inherit: false,
            resolver: Arc::new(crate::workflows::NoWorkflows),
        }
    }

    /// Issue 29: a launch that names no backend gets one the attached workers offer, and says
    /// so; with no worker attached there is none to choose, and it is refused with the fix. A
    /// backend, or a namespace's labels, that no attached worker offers is said at once in
    /// the launch's notes; the run is not refused for it (a worker may attach yet).
    #[tokio::test]
    async fn a_launch_gets_a_backend_the_workers_offer_and_hears_at_once_what_none_offers() {
        let mut eu = crate::namespace::Policy::default();
        eu.labels.insert("region".into(), "eu".into());
        let c = Coordinator::build(
            crate::store::open("memory://").unwrap(),
            crate::lease::memory::MemoryLeaseStore::new(),
            CoordinatorOptions {
                namespaces: Some(
                    crate::namespace::Namespaces::new([("payments".to_owned(), eu)].into())
                        .unwrap(),
                ),
                ..Default::default()
            },
        );
        let refused = c
            .launch(launch_with("", "default"))
            .await
            .map(|_| ())
            .expect_err("no worker, nothing to choose from");
        assert!(
            refused.message.contains("no worker is attached")
                && refused.message.contains("pass --backend NAME"),
            "{}",
            refused.message
        );
        let _w = echo_worker(&c, "w0");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !c.dispatch.workers().await.iter().any(|w| w.attached) {
            assert!(
                std::time::Instant::now() < deadline,
                "the worker never attached"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }

        let chosen = c
            .launch(launch_with("", "default"))
            .await
            .expect("launched");
        assert_eq!(chosen.notes.len(), 1, "{:?}", chosen.notes);
        assert!(
            chosen.notes[0].starts_with("backend echo (chosen by the coordinator"),
            "{:?}",
            chosen.notes
        );
        assert_eq!(chosen.wait().await.status, RunStatus::Completed);

        let named = c
            .launch(launch_with("echo", "default"))
            .await
            .expect("launched");
        assert!(named.notes.is_empty(), "{:?}", named.notes);

        let unoffered = c
            .launch(launch_with("exec", "default"))
            .await
            .expect("launched");
        assert_eq!(unoffered.notes.len(), 1, "{:?}", unoffered.notes);
        assert!(
            unoffered.notes[0].starts_with(
                "no attached worker offers backend \"exec\" (the 1 attached offer echo)"
            ) && unoffered.notes[0].contains("wait up to 10m"),
            "{:?}",
            unoffered.notes
        );
        unoffered.stop();

        // The namespace pins region=eu, which the only worker does not carry.
        let pinned = c
            .launch(launch_with("", "payments"))
            .await
            .expect("launched");
        assert_eq!(pinned.notes.len(), 2, "{:?}", pinned.notes);
        assert!(
            pinned.notes[0].starts_with("backend echo"),
            "{:?}",
            pinned.notes
        );
        assert!(
            pinned.notes[1].contains("carries the labels region=eu"),
            "{:?}",
            pinned.notes
        );
        pinned.stop();
    }

    /// A coordinator frozen with a journal write past its gate (checked while its tenure
    /// held) delivers that write after its successor took the run over and ran those calls
    /// again. The successor's seal keeps the late segment out of the run's history: every
    /// call counts once.
    #[tokio::test]
    async fn a_journal_write_a_frozen_coordinator_delivers_late_is_not_read() {
        use object_store::memory::InMemory;
        const CALLS: u64 = 6;
        let raw: Arc<dyn object_store::ObjectStore> = Arc::new(InMemory::new());
        let faulty = crate::store::faulty::FaultyStore::new(raw.clone());
        let tenure = Arc::new(crate::lease::Tenure::open());
        let zombie = Coordinator::new(
            Store::over("memory://", faulty.clone(), None).gated(tenure.clone()),
            crate::lease::memory::MemoryLeaseStore::new(),
        );
        let _w0 = echo_worker(&zombie, "w0");
        let handle = zombie
            .launch(LaunchRequest {
                source: format!(
                    "export const meta = {{ name: 'late', description: 'd' }};\n\
                     return (await parallel(Array.from({{ length: {CALLS} }}, (_, i) => () => agent('job ' + i + ' [[sleep:300]]')))).length;"
                ),
                origin: None,
                args: None,
                settings: RunSettings {
                    stagger_ms: 0,
                    ..RunSettings::default()
                },
                resume_from: None,
                inherit: false,
                resolver: Arc::new(crate::workflows::NoWorkflows),
            })
            .await
            .expect("launched");
        let run = handle.run_id.clone();
        // The agents sleep; their results' segment passes the gate and is then held, as a
        // write on its way when the process froze.
        faulty.hold_writes(&format!("runs/{run}/calls/"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while faulty.held() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "no journal write was held"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // Frozen past its lease: deposed, and its successor takes the run over.
        tenure.end();
        zombie.shutdown();
        let successor = Coordinator::new(
            Store::over("memory://", raw.clone(), None),
            crate::lease::memory::MemoryLeaseStore::new(),
        );
        let _w1 = echo_worker(&successor, "w1");
        let report = successor.adopt(&run).await.expect("adopted").wait().await;
        assert_eq!(report.status, RunStatus::Completed, "{:?}", report.error);
        assert_eq!(report.result, serde_json::json!(CALLS));
        // The zombie wakes: its write lands now, after the successor's own.
        faulty.release();
        let store = Store::over("memory://", raw, None);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let listed = store.list_objects(&keys::calls_dir(&run)).await.unwrap();
            if listed.iter().any(|k| k.as_ref().contains("/000001-")) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the late write never landed"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let mut seen = std::collections::BTreeMap::<u64, usize>::new();
        for c in journal::read_calls(&store, &run).await.unwrap() {
            *seen.entry(c.index).or_default() += 1;
        }
        assert_eq!(
            seen,
            (0..CALLS).map(|i| (i, 1)).collect(),
            "every call once in the run's history"
        );
        // A second takeover reads the same history (the first seal's segments and the
        // successor's), and may not take a generation already sealed.
        let again = journal::segments(&store, &run).await.unwrap();
        assert!(
            again.iter().all(|k| !k.as_ref().contains("/000001-")),
            "{again:?}"
        );
        assert!(!journal::seal(&store, &run, 2, &again).await.unwrap());
    }

    /// A launch whose source commit is no longer whole in the store by the time its run is
    /// recorded (retention swept its pack after the client was told it was held) is refused
    /// with the words a client sends the launch again on, and leaves no run behind.
    #[tokio::test]
    async fn a_launch_whose_source_was_swept_meanwhile_is_refused_and_leaves_no_run() {
        let store = crate::store::open("memory://").unwrap();
        let commit = "c0".repeat(20);
        let (repo, commit) = ("r0", commit.as_str());
        let record = crate::source::CommitRecord {
            pack: "ab".repeat(32),
            prerequisites: Vec::new(),
        };
        store
            .put_overwrite(
                &keys::source_commit("default", repo, commit),
                Bytes::from(serde_json::to_vec(&record).unwrap()),
            )
            .await
            .unwrap();
        let coordinator =
            Coordinator::new(store.clone(), crate::lease::memory::MemoryLeaseStore::new());
        let mut settings = RunSettings::default();
        settings.source = Some(crate::settings::SourceRef {
            repo: repo.into(),
            commit: commit.into(),
            url: None,
            origin: "here".into(),
            submodules: Vec::new(),
        });
        let refused = coordinator
            .launch(LaunchRequest {
                source: "export const meta = { name: 'swept', description: 'd' };\nreturn 1;"
                    .into(),
                origin: None,
                args: None,
                settings,
                resume_from: None,
                inherit: false,
                resolver: Arc::new(crate::workflows::NoWorkflows),
            })
            .await
            .map(|_| ())
            .expect_err("refused");
        assert!(refused.resend_source, "{}", refused.message);
        assert!(
            refused
                .message
                .contains(crate::source::SWEPT_WHILE_LAUNCHING),
            "{}",
            refused.message
        );
        assert!(refused.message.contains(commit), "{}", refused.message);
        let runs = crate::index::page(&store, &crate::index::Filter::default())
            .await
            .unwrap();
        assert!(runs.runs.is_empty(), "{:?}", runs.runs);
        assert!(
            store.list_prefixes(&keys::runs()).await.unwrap().is_empty(),
            "nothing of the run is left"
        );
    }
}
