//! The worker loop: one link to a coordinator, many attempts at once.
//!
//! The worker says `Hello` (backends, models, labels, slots), then runs every `Assignment` it
//! receives as a task of its own, streaming progress, transcript chunks and finally one
//! `Outcome` per assignment. A `Cancel` fires the attempt's cancel token; the backend kills
//! what it started and the outcome reports `Cancelled`. When the link closes, every attempt
//! is cancelled and awaited before `run` returns.
//!
//! Invariant: every assignment gets exactly one outcome (that is how the coordinator gets its
//! slot back), and the outcome is sent after the attempt's last transcript chunk.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_proto::link::Link;
use flotilla_proto::v1::{
    self, Assignment, CoordinatorMessage, FailureKind, Hello, ProgressKind, WorkerMessage,
    coordinator_message, outcome, worker_message,
};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backend::{AgentBackend, Error, EventSink, Events, Task};
use crate::workspace::Workspace;

/// Transcript events are sent in chunks of at most this many events.
const TRANSCRIPT_CHUNK: usize = 64;

/// Options of one worker.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Name announced in `Hello` (informational; remote workers are known by certificate).
    pub name: String,
    /// Attempts this worker runs at once.
    pub slots: u32,
    /// Root of all per-call working directories.
    pub workspace: std::path::PathBuf,
    /// Free-form labels announced to the scheduler.
    pub labels: HashMap<String, String>,
}

/// A worker with its backends.
pub struct Worker {
    opts: WorkerOptions,
    backends: HashMap<&'static str, Arc<dyn AgentBackend>>,
    default_backend: &'static str,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("opts", &self.opts)
            .field("backends", &self.backends.keys().collect::<Vec<_>>())
            .finish()
    }
}

type AttemptId = (String, u64, u32);

impl Worker {
    /// A worker whose default backend is the first one given.
    pub fn new(opts: WorkerOptions, backends: Vec<Arc<dyn AgentBackend>>) -> Self {
        let default_backend = backends.first().map_or("", |b| b.name());
        let backends = backends.into_iter().map(|b| (b.name(), b)).collect();
        Worker {
            opts,
            backends,
            default_backend,
        }
    }

    /// Serves one link until it closes or `cancel` fires.
    pub async fn run(&self, link: Link, cancel: CancellationToken) {
        let Link { tx, mut rx } = link;
        let mut models: Vec<String> = self.backends.values().flat_map(|b| b.models()).collect();
        models.sort();
        models.dedup();
        let mut backends: Vec<String> = self.backends.keys().map(|s| (*s).to_owned()).collect();
        backends.sort();
        let hello = Hello {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.to_owned(),
            name: self.opts.name.clone(),
            backends,
            models,
            labels: self.opts.labels.clone(),
            slots: self.opts.slots,
        };
        if tx
            .send(WorkerMessage {
                msg: Some(worker_message::Msg::Hello(hello)),
            })
            .is_err()
        {
            return;
        }

        let workspace = Workspace::new(&self.opts.workspace);
        let tracker = TaskTracker::new();
        let running: Arc<Mutex<HashMap<AttemptId, CancellationToken>>> = Arc::default();
        loop {
            let msg = tokio::select! {
                _ = cancel.cancelled() => break,
                msg = rx.recv() => msg,
            };
            let Some(CoordinatorMessage { msg: Some(msg) }) = msg else {
                if msg.is_none() {
                    break;
                }
                continue;
            };
            match msg {
                coordinator_message::Msg::Welcome(w) => {
                    tracing::debug!(worker = %self.opts.name, id = %w.worker_id, "attached");
                }
                coordinator_message::Msg::Assign(a) => {
                    let id: AttemptId = (a.run_id.clone(), a.call, a.attempt);
                    let token = cancel.child_token();
                    lock(&running).insert(id.clone(), token.clone());
                    let backend = self.backend_for(&a);
                    let tx = tx.clone();
                    let running = running.clone();
                    let workspace = workspace.clone();
                    tracker.spawn(async move {
                        let outcome = run_attempt(a, backend, workspace, tx.clone(), token).await;
                        lock(&running).remove(&id);
                        let _ = tx.send(WorkerMessage {
                            msg: Some(worker_message::Msg::Outcome(outcome)),
                        });
                    });
                }
                coordinator_message::Msg::Cancel(c) => {
                    let id: AttemptId = (c.run_id, c.call, c.attempt);
                    if let Some(token) = lock(&running).get(&id) {
                        tracing::debug!(run = %id.0, call = id.1, attempt = id.2, reason = %c.reason, "cancel");
                        token.cancel();
                    }
                }
            }
        }
        for token in lock(&running).values() {
            token.cancel();
        }
        tracker.close();
        tracker.wait().await;
    }

    fn backend_for(&self, a: &Assignment) -> Result<Arc<dyn AgentBackend>, Error> {
        let name = a
            .task
            .as_ref()
            .map(|t| t.backend.as_str())
            .filter(|b| !b.is_empty())
            .unwrap_or(self.default_backend);
        self.backends.get(name).cloned().ok_or_else(|| {
            let mut known: Vec<_> = self.backends.keys().copied().collect();
            known.sort_unstable();
            Error::new(
                FailureKind::Invalid,
                format!(
                    "this worker has no backend {name:?} (it has: {})",
                    known.join(", ")
                ),
            )
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn run_attempt(
    a: Assignment,
    backend: Result<Arc<dyn AgentBackend>, Error>,
    workspace: Workspace,
    tx: mpsc::UnboundedSender<WorkerMessage>,
    cancel: CancellationToken,
) -> v1::Outcome {
    let sink = Arc::new(LinkSink {
        tx,
        run_id: a.run_id.clone(),
        call: a.call,
        attempt: a.attempt,
        buffer: Mutex::new(Vec::new()),
    });
    let events = Events::new(sink.clone());
    let spec = a.task.clone().unwrap_or_default();
    let result = match backend {
        Err(e) => Err(e),
        Ok(backend) => match parse_schema(&spec) {
            Err(e) => Err(e),
            Ok(schema) => {
                let task = Task {
                    run_id: a.run_id.clone(),
                    call: a.call,
                    attempt: a.attempt,
                    call_key: a.call_key.clone(),
                    spec: spec.clone(),
                    schema,
                    workspace,
                };
                if spec.timeout_ms > 0 {
                    // On timeout the attempt is cancelled the normal way, so the backend kills
                    // what it started before the outcome is sent.
                    let limit = Duration::from_millis(spec.timeout_ms);
                    let token = cancel.child_token();
                    let run = backend.run(&task, &events, token.clone());
                    tokio::pin!(run);
                    tokio::select! {
                        r = &mut run => r,
                        _ = tokio::time::sleep(limit) => {
                            token.cancel();
                            let _ = run.await;
                            Err(Error::new(
                                FailureKind::Timeout,
                                format!("agent timed out after {}", humanize(limit)),
                            ))
                        }
                    }
                } else {
                    backend.run(&task, &events, cancel.clone()).await
                }
            }
        },
    };
    sink.flush();
    let (result, usage) = match result {
        Ok(out) => (
            outcome::Result::Completed(v1::Completed {
                text: out.text,
                json: out.json.map(|v| v.to_string()),
            }),
            out.usage,
        ),
        Err(e) => (
            outcome::Result::Failure(v1::Failure {
                kind: e.kind as i32,
                message: e.message,
                retry_after_ms: e.retry_after.map_or(0, |d| d.as_millis() as u64),
            }),
            e.usage,
        ),
    };
    v1::Outcome {
        run_id: a.run_id,
        call: a.call,
        attempt: a.attempt,
        result: Some(result),
        usage: Some(usage),
        fence: a.fence,
    }
}

fn parse_schema(spec: &v1::TaskSpec) -> Result<Option<Value>, Error> {
    spec.schema_json
        .as_deref()
        .map(serde_json::from_str)
        .transpose()
        .map_err(|e| {
            Error::new(
                FailureKind::Invalid,
                format!("task schema is not JSON: {e}"),
            )
        })
}

fn humanize(d: Duration) -> String {
    if d.as_millis() < 1000 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

struct LinkSink {
    tx: mpsc::UnboundedSender<WorkerMessage>,
    run_id: String,
    call: u64,
    attempt: u32,
    buffer: Mutex<Vec<String>>,
}

impl LinkSink {
    fn flush(&self) {
        let events = std::mem::take(&mut *lock(&self.buffer));
        if events.is_empty() {
            return;
        }
        let _ = self.tx.send(WorkerMessage {
            msg: Some(worker_message::Msg::Transcript(v1::TranscriptChunk {
                run_id: self.run_id.clone(),
                call: self.call,
                attempt: self.attempt,
                events,
            })),
        });
    }
}

impl EventSink for LinkSink {
    fn progress(&self, kind: ProgressKind, output_tokens: u64, detail: String) {
        let _ = self.tx.send(WorkerMessage {
            msg: Some(worker_message::Msg::Progress(v1::Progress {
                run_id: self.run_id.clone(),
                call: self.call,
                attempt: self.attempt,
                kind: kind as i32,
                output_tokens,
                detail,
            })),
        });
    }

    fn transcript(&self, event: Value) {
        let full = {
            let mut buffer = lock(&self.buffer);
            buffer.push(event.to_string());
            buffer.len() >= TRANSCRIPT_CHUNK
        };
        if full {
            self.flush();
        }
    }
}
