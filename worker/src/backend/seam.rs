//! The backend seam: what a backend is given ([`Task`]), what it implements
//! ([`AgentBackend`]), where its events go ([`Events`]) and what it returns ([`Output`]), with
//! the structured-output submissions every backend counts the same way. It names no backend.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flotilla_proto::schema::Validator;
use flotilla_proto::v1::{self, FailureKind, ProgressKind};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::failure::Error;
use crate::workspace::Workspace;

/// One attempt as a backend sees it.
#[derive(Debug, Clone)]
pub struct Task {
    pub run_id: String,
    pub call: u64,
    pub attempt: u32,
    pub call_key: String,
    pub spec: v1::TaskSpec,
    /// Parsed `spec.schema_json`, when the task asks for a structured result.
    pub schema: Option<Value>,
    pub workspace: Workspace,
    /// The attempt's git worktree, with `isolation: 'worktree'` (made before the backend runs).
    pub worktree: Option<crate::worktree::Worktree>,
    /// Where the agent's processes run.
    pub sandbox: crate::sandbox::Sandbox,
    /// The attempt's memory and process limits.
    pub limits: std::sync::Arc<crate::limits::Attempt>,
    /// Size of the sandbox's `/tmp`.
    pub tmp_size: u64,
    /// The attempt's W3C trace context (`TRACEPARENT`), when the run is traced: what the
    /// agent's processes emit of their own telemetry nests under the attempt.
    pub trace_parent: Option<String>,
}

impl Task {
    /// The directory the agent works in, created on first use: its call's own directory (or
    /// `cwd` inside it), the shared workspace (embedded), or the matching place inside its
    /// checkout or worktree.
    pub fn workdir(&self) -> Result<PathBuf, Error> {
        if let Some(wt) = &self.worktree {
            return Ok(wt.workdir.clone());
        }
        self.workspace
            .dir_for(&self.run_id, self.call, &self.spec.cwd)
            .map_err(|e| Error::new(FailureKind::Invalid, e))
    }

    /// What the attempt's sandbox shows: its checkout (or call directory) read-write, the
    /// checkout's repository read-only but for the checkout's own git directory, `env`.
    pub fn jail(&self, env: Vec<(String, String)>) -> Result<crate::sandbox::Jail, Error> {
        let workdir = self.workdir()?;
        let mut jail = crate::sandbox::Jail {
            workdir: workdir.clone(),
            env,
            tmp_size: self.tmp_size,
            ..Default::default()
        };
        if let Some(tp) = &self.trace_parent {
            jail.env.push(("TRACEPARENT".into(), tp.clone()));
        }
        match &self.worktree {
            Some(wt) if wt.own_repo() => {
                use crate::sandbox::Mount;
                // A source checkout is a repository of its own: it and the cache's objects it
                // borrows (read-only) are all there is.
                jail.mounts.extend([
                    Mount::Ro(wt.repo().join("objects")),
                    Mount::Rw(wt.path.clone()),
                ]);
                // A copy-on-write checkout is mounted for the agent's processes alone, and
                // they start where `cwd` is in it (made there if missing).
                if let Some(view) = wt.view() {
                    let cwd = wt
                        .workdir
                        .strip_prefix(&wt.path)
                        .ok()
                        .and_then(Path::to_str)
                        .filter(|c| !c.is_empty());
                    jail.view = Some((view.prefix(cwd), wt.path.clone()));
                }
            }
            Some(wt) => {
                let common = wt.common_dir();
                let own = wt.admin().join("objects");
                std::fs::create_dir_all(&own).map_err(|e| {
                    Error::new(
                        FailureKind::Retryable,
                        format!("cannot make {}: {e}", own.display()),
                    )
                })?;
                use crate::sandbox::Mount;
                // The repository read-only, other checkouts' git directories hidden, this
                // one's read-write, and its agent's objects in it.
                jail.mounts.extend([
                    Mount::Ro(common.clone()),
                    Mount::Hide(common.join("worktrees")),
                    Mount::Rw(wt.path.clone()),
                    Mount::Rw(wt.admin().to_owned()),
                ]);
                jail.env.extend([
                    ("GIT_OBJECT_DIRECTORY".into(), own.display().to_string()),
                    (
                        "GIT_ALTERNATE_OBJECT_DIRECTORIES".into(),
                        common.join("objects").display().to_string(),
                    ),
                ]);
            }
            None if self.workspace.is_shared() => {
                use crate::sandbox::Mount;
                // The user's repository, but what their own git and flotilla would run.
                let root = self.workspace.root();
                jail.mounts.extend([
                    Mount::Rw(root.to_owned()),
                    Mount::RoIfThere(root.join(".git").join("hooks")),
                    Mount::RoIfThere(root.join(".git").join("config")),
                    Mount::RoIfThere(root.join(".git").join("info")),
                    Mount::RoIfThere(root.join(".flotilla")),
                ]);
            }
            // Its call's own directory, wherever in it `cwd` starts the agent.
            None => jail.mounts.push(crate::sandbox::Mount::Rw(
                self.workspace
                    .call_dir(&self.run_id, self.call)
                    .and_then(|d| d.canonicalize().ok())
                    .unwrap_or(workdir),
            )),
        }
        Ok(jail)
    }

    /// `program args` as this attempt's process (see [`crate::sandbox::Sandbox::command`]).
    pub fn command(
        &self,
        program: &std::ffi::OsStr,
        args: &[std::ffi::OsString],
        jail: &crate::sandbox::Jail,
    ) -> tokio::process::Command {
        let mut jail = jail.clone();
        jail.prefix = self.limits.prefix();
        self.sandbox.command(program, args, &jail)
    }
}

/// What a successful attempt produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Output {
    pub text: String,
    pub json: Option<Value>,
    pub usage: v1::Usage,
    /// What the agent changed in the run's source (filled by the worker, not the backend).
    pub change: Option<v1::Change>,
    /// The model it ran on as the backend resolved it (an alias's model id); empty when the
    /// backend cannot tell.
    pub model: String,
}

/// A provider account's id: `PROVIDER@HOST#FINGERPRINT`, where the fingerprint is the first
/// 8 hex digits of the key's SHA-256 (never the key), or `none` without one. Workers with the
/// same endpoint and key name the same account.
pub fn account_id(provider: &str, base_url: &str, secret: Option<&str>) -> String {
    use sha2::Digest;
    let rest = base_url.split_once("://").map_or(base_url, |(_, r)| r);
    let host = rest.split('/').next().unwrap_or(rest);
    let fingerprint = secret.map_or_else(
        || "none".to_owned(),
        |k| hex::encode(&sha2::Sha256::digest(k.as_bytes())[..4]),
    );
    format!("{provider}@{host}#{fingerprint}")
}

/// The backend seam.
#[async_trait::async_trait]
pub trait AgentBackend: Send + Sync + 'static {
    /// The name tasks use to pick this backend (`echo`, `exec`, ...).
    fn name(&self) -> &'static str;

    /// Models this backend can run; empty means any model name is accepted.
    fn models(&self) -> Vec<String> {
        Vec::new()
    }

    /// The provider account its calls go through ([`account_id`]), for the coordinator's
    /// admission; `None` for backends that call no provider (echo, exec).
    fn account(&self) -> Option<String> {
        None
    }

    /// Whether its agents work in a directory. A backend that only talks to a provider (echo,
    /// anthropic, openai) says no: then an attempt without a checkout has no scratch
    /// directory to watch, measure or remove, and the worker touches no file for it.
    fn uses_directory(&self) -> bool {
        true
    }

    /// Runs one attempt. Must return soon after `cancel` fires.
    async fn run(
        &self,
        task: &Task,
        events: &Events,
        cancel: CancellationToken,
    ) -> Result<Output, Error>;
}

/// Runs one attempt of `backend`: its transcript always ends with a `result` event saying how
/// the attempt ended (added here when the backend did not end with one, or ended with one that
/// says otherwise: a CLI whose session succeeded although its result failed the schema).
pub async fn run_attempt(
    backend: &dyn AgentBackend,
    task: &Task,
    events: &Events,
    cancel: CancellationToken,
) -> Result<Output, Error> {
    let tail = Arc::new(Tail {
        inner: events.inner.clone(),
        ended: std::sync::Mutex::new(None),
    });
    let outcome = backend.run(task, &Events::new(tail.clone()), cancel).await;
    let said = *tail.ended.lock().unwrap_or_else(|e| e.into_inner());
    if said != Some(outcome.is_err()) {
        events.transcript(match &outcome {
            Ok(_) => serde_json::json!({"type": "result", "is_error": false}),
            Err(e) => serde_json::json!({"type": "result", "is_error": true, "error": e.message}),
        });
    }
    outcome
}

/// Passes events on and remembers whether the last transcript event was a `result`, and
/// whether it said the attempt failed.
struct Tail {
    inner: Arc<dyn EventSink>,
    ended: std::sync::Mutex<Option<bool>>,
}

impl EventSink for Tail {
    fn progress(&self, kind: ProgressKind, output_tokens: u64, detail: String) {
        self.inner.progress(kind, output_tokens, detail);
    }

    fn checkpoint(&self, session: v1::Session) {
        self.inner.checkpoint(session);
    }

    fn transcript(&self, event: Value) {
        let result = (event.get("type").and_then(Value::as_str) == Some("result")).then(|| {
            event
                .get("is_error")
                .and_then(Value::as_bool)
                .unwrap_or(false)
        });
        *self.ended.lock().unwrap_or_else(|e| e.into_inner()) = result;
        self.inner.transcript(event);
    }
}

/// Where a running attempt sends progress and transcript events.
#[derive(Clone)]
pub struct Events {
    inner: Arc<dyn EventSink>,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").finish_non_exhaustive()
    }
}

/// Receiver of one attempt's events (the worker's link, or a test's buffer).
pub trait EventSink: Send + Sync {
    fn progress(&self, kind: ProgressKind, output_tokens: u64, detail: String);
    fn transcript(&self, event: Value);
    /// A checkpoint of the agent's conversation so far (issue 33, 3); a sink that does not
    /// keep them drops it.
    fn checkpoint(&self, _session: v1::Session) {}
}

impl Events {
    pub fn new(sink: Arc<dyn EventSink>) -> Self {
        Events { inner: sink }
    }

    /// Reports progress; any progress resets the coordinator's stall timer.
    pub fn progress(&self, kind: ProgressKind, output_tokens: u64) {
        self.inner.progress(kind, output_tokens, String::new());
    }

    /// Sends a checkpoint of the agent's conversation so far, for the call's next attempt
    /// should this one be lost with its worker.
    pub fn checkpoint(&self, session: v1::Session) {
        self.inner.checkpoint(session);
    }

    /// Reports that a valid structured output was captured.
    pub fn structured_captured(&self, value: &Value) {
        self.inner
            .progress(ProgressKind::StructuredCaptured, 0, value.to_string());
    }

    /// Appends one normalized event to the attempt's transcript.
    pub fn transcript(&self, event: Value) {
        self.inner.transcript(event);
    }
}

/// Counts and validates the structured-output submissions of one attempt.
#[derive(Debug)]
pub struct Submissions {
    validator: Validator,
    limit: u32,
    made: u32,
    last_error: Option<String>,
}

/// What happened to one submission.
#[derive(Debug, PartialEq)]
pub enum Submitted {
    /// Valid: this is the result.
    Accepted(Value),
    /// Invalid, and the agent may try again; the message is the validation feedback.
    Retry(String),
}

impl Submissions {
    /// Compiles the schema; `limit` is the number of submissions allowed (at least 1).
    pub fn new(schema: &Value, limit: u32) -> Result<Self, Error> {
        let validator = Validator::new(schema).map_err(|e| Error::new(FailureKind::Invalid, e))?;
        Ok(Submissions {
            validator,
            limit: limit.max(1),
            made: 0,
            last_error: None,
        })
    }

    /// Validates one submission. Fails with a `Schema` error once the limit is used up.
    pub fn submit(&mut self, value: Value) -> Result<Submitted, Error> {
        self.made += 1;
        match self.validator.validate(&value) {
            Ok(()) => Ok(Submitted::Accepted(value)),
            Err(problem) => {
                let problem = problem.message;
                self.last_error = Some(problem.clone());
                if self.made >= self.limit {
                    Err(self.exhausted())
                } else {
                    Ok(Submitted::Retry(problem))
                }
            }
        }
    }

    /// Submissions made so far.
    pub fn made(&self) -> u32 {
        self.made
    }

    /// The error for an agent that stopped without a valid submission.
    pub fn exhausted(&self) -> Error {
        let message = match &self.last_error {
            Some(last) if self.made >= self.limit => format!(
                "structured output retry cap ({}) exceeded: the last submission failed validation {last}",
                self.limit
            ),
            Some(last) => format!(
                "the agent finished without a valid structured output after {} submission(s); last failure {last}",
                self.made
            ),
            None => "the agent finished without submitting a structured output".to_owned(),
        };
        Error::new(FailureKind::Schema, message)
    }
}

/// Counts characters (Unicode scalar values), the echo backend's token unit.
pub(crate) fn chars(s: &str) -> u64 {
    s.chars().count() as u64
}
