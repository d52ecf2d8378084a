//! The `exec` backend: any command as an agent.
//!
//! Each attempt runs `sh -c CMD` in the call's working directory, in a new process group.
//! The prompt arrives on stdin (then stdin is closed); the call's options arrive in
//! environment variables (`FLOTILLA_*`, see [`Exec::env_for`]). Stdout is the result — parsed
//! as JSON and validated when the call has a schema. Stderr lines go to the transcript. Any
//! output counts as progress for the stall watchdog. A non-zero exit is a terminal failure
//! (the call resolves to `null`); exit status 75 (`EX_TEMPFAIL`) asks for a retry.
//!
//! Invariant: when an attempt ends — normally, cancelled, or stalled — its process group and
//! every descendant are killed ([`super::procs`]), so nothing the command started outlives it.

use std::process::Stdio;
use std::time::Duration;

use flotilla_proto::v1::{FailureKind, ProgressKind, Usage};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::lines::{self, BoundedLines};
use super::procs::{GroupGuard, kill_group};
use super::seam::{AgentBackend, Events, Output, Submissions, Submitted, Task, chars};
use crate::failure::Error;

/// Exit status a command uses to ask for another attempt.
pub const EXIT_RETRY: i32 = 75;

/// The exec backend.
#[derive(Debug, Clone)]
pub struct Exec {
    command: String,
}

impl Exec {
    /// `command` is run with `sh -c`.
    pub fn new(command: impl Into<String>) -> Self {
        Exec {
            command: command.into(),
        }
    }

    /// The environment a command sees for a task.
    pub fn env_for(task: &Task, workdir: &std::path::Path) -> Vec<(String, String)> {
        let s = &task.spec;
        vec![
            ("FLOTILLA_RUN_ID".into(), task.run_id.clone()),
            ("FLOTILLA_CALL".into(), task.call.to_string()),
            ("FLOTILLA_CALL_KEY".into(), task.call_key.clone()),
            ("FLOTILLA_ATTEMPT".into(), task.attempt.to_string()),
            ("FLOTILLA_LABEL".into(), s.label.clone()),
            ("FLOTILLA_GROUP".into(), s.group.clone()),
            ("FLOTILLA_MODEL".into(), s.model.clone()),
            ("FLOTILLA_EFFORT".into(), s.effort.clone()),
            ("FLOTILLA_AGENT_TYPE".into(), s.agent_type.clone()),
            ("FLOTILLA_ISOLATION".into(), s.isolation.clone()),
            ("FLOTILLA_TOOLS".into(), s.tools.join(",")),
            (
                "FLOTILLA_SCHEMA".into(),
                s.schema_json.clone().unwrap_or_default(),
            ),
            ("FLOTILLA_OPTIONS".into(), s.options_json.clone()),
            ("FLOTILLA_WORKDIR".into(), workdir.display().to_string()),
        ]
    }
}

fn too_much_output() -> Error {
    Error::new(
        FailureKind::Terminal,
        format!(
            "the exec command wrote more than {} MiB to stdout (its result); it was stopped — have it write large output to files and print a summary",
            lines::EXEC_STDOUT_BYTES >> 20
        ),
    )
}

#[async_trait::async_trait]
impl AgentBackend for Exec {
    fn name(&self) -> &'static str {
        "exec"
    }

    async fn run(
        &self,
        task: &Task,
        events: &Events,
        cancel: CancellationToken,
    ) -> Result<Output, Error> {
        let workdir = task.workdir()?;
        let jail = task.jail(Self::env_for(task, &workdir))?;
        let mut cmd = task.command(
            "sh".as_ref(),
            &["-c".into(), self.command.clone().into()],
            &jail,
        );
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| {
            Error::new(
                FailureKind::Terminal,
                format!("cannot start exec command {:?}: {e}", self.command),
            )
        })?;
        let pgid = child.id();
        // Whatever way this attempt ends — even if its future is dropped — the group dies.
        let _group = GroupGuard(pgid);
        events.transcript(
            json!({"type": "init", "backend": "exec", "command": self.command,
            "workdir": workdir.display().to_string(), "pid": pgid, "attempt": task.attempt}),
        );

        // Feed the prompt and close stdin, without blocking on a command that never reads it.
        if let Some(mut stdin) = child.stdin.take() {
            let prompt = task.spec.prompt.clone().into_bytes();
            tokio::spawn(async move {
                let _ = stdin.write_all(&prompt).await;
                let _ = stdin.shutdown().await;
            });
        }
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| Error::new(FailureKind::Terminal, "exec command has no stdout pipe"))?;
        let stderr = child
            .stderr
            .take()
            .ok_or_else(|| Error::new(FailureKind::Terminal, "exec command has no stderr pipe"))?;

        // Its stdout is its result: at most EXEC_STDOUT_BYTES of it are kept; past that the
        // command is stopped (`overflow` fires).
        let collected = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let overflow = CancellationToken::new();
        let stdout_task = tokio::spawn(read_stdout(
            stdout,
            collected.clone(),
            overflow.clone(),
            events.clone(),
        ));
        let stderr_task = tokio::spawn(stderr_last(stderr, events.clone()));

        let status = tokio::select! {
            status = child.wait() => status,
            _ = overflow.cancelled() => {
                kill_group(pgid);
                let _ = child.wait().await;
                stderr_task.abort();
                events.transcript(json!({"type": "result", "is_error": true, "error": "too much output"}));
                return Err(too_much_output());
            }
            _ = cancel.cancelled() => {
                kill_group(pgid);
                let _ = child.wait().await;
                stdout_task.abort();
                stderr_task.abort();
                events.transcript(json!({"type": "result", "is_error": true, "error": "cancelled"}));
                return Err(Error::cancelled("the command's process group was killed"));
            }
        };
        // The command is done: whatever it left running in its group goes too, which also
        // closes pipes a straggler might hold open.
        kill_group(pgid);
        // It may have died of the pipe its flood of output broke.
        if overflow.is_cancelled() {
            stderr_task.abort();
            events.transcript(
                json!({"type": "result", "is_error": true, "error": "too much output"}),
            );
            return Err(too_much_output());
        }
        let status = status.map_err(|e| {
            Error::new(
                FailureKind::Terminal,
                format!("cannot wait for exec command: {e}"),
            )
        })?;
        // A process outside the group may still hold stdout open; what the command wrote
        // before it exited is its answer either way.
        if tokio::time::timeout(Duration::from_secs(5), stdout_task)
            .await
            .is_err()
        {
            events.transcript(json!({"type": "stderr",
                "text": "flotilla: stdout stayed open after the command exited (a background process outside its group?); using what was written"}));
        }
        let stdout = std::mem::take(
            &mut *collected
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let last_stderr = tokio::time::timeout(Duration::from_secs(5), stderr_task)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let text = String::from_utf8_lossy(&stdout).into_owned();

        if !status.success() {
            return Err(failed_exit(task, events, status, &last_stderr));
        }
        output_of(task, events, &text)
    }
}

/// Keeps what the command writes on stdout, at most [`lines::EXEC_STDOUT_BYTES`]: past that
/// `overflow` fires (and the caller stops the command).
async fn read_stdout(
    mut stdout: tokio::process::ChildStdout,
    sink: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    overflow: CancellationToken,
    events: Events,
) {
    let mut chunk = [0u8; 8192];
    loop {
        match stdout.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut out = sink
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if out.len() + n > lines::EXEC_STDOUT_BYTES {
                    overflow.cancel();
                    return;
                }
                out.extend_from_slice(&chunk[..n]);
                drop(out);
                events.progress(ProgressKind::Output, 0);
            }
        }
    }
}

/// Each line the command writes on stderr goes to the transcript; the last one is kept (a
/// failure quotes it).
async fn stderr_last(stderr: tokio::process::ChildStderr, events: Events) -> String {
    let mut lines = BoundedLines::new(stderr, lines::STDERR_LINE_BYTES);
    let mut last = String::new();
    while let Ok(Some(line)) = lines.next_line().await {
        events.progress(ProgressKind::Output, 0);
        events.transcript(json!({"type": "stderr", "text": line.text}));
        last = line.text;
    }
    last
}

/// Why a command that exited unsuccessfully failed: its sandbox could not start, it asked
/// for a retry ([`EXIT_RETRY`]), or it failed.
fn failed_exit(
    task: &Task,
    events: &Events,
    status: std::process::ExitStatus,
    last_stderr: &str,
) -> Error {
    if let Some(e) = task.sandbox.setup_failure(status.code(), last_stderr) {
        events.transcript(json!({"type": "result", "is_error": true, "error": e.message}));
        return e;
    }
    let code = status
        .code()
        .map_or_else(|| "a signal".to_owned(), |c| format!("status {c}"));
    let detail = if last_stderr.is_empty() {
        String::new()
    } else {
        format!(": {last_stderr}")
    };
    let kind = if status.code() == Some(EXIT_RETRY) {
        FailureKind::Retryable
    } else {
        FailureKind::Terminal
    };
    events.transcript(json!({"type": "result", "is_error": true, "exit": status.code()}));
    Error::new(kind, format!("exec command exited with {code}{detail}"))
}

/// A successful command's output: its stdout less one trailing newline, checked against the
/// schema when the call has one (one submission per attempt: a command cannot read
/// validation feedback).
fn output_of(task: &Task, events: &Events, text: &str) -> Result<Output, Error> {
    let text = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(text)
        .to_owned();
    let usage = Usage {
        input_tokens: chars(&task.spec.prompt),
        output_tokens: chars(&text),
        ..Usage::default()
    };
    events.transcript(json!({"type": "assistant_text", "text": text}));
    let Some(schema) = &task.schema else {
        events.transcript(json!({"type": "result", "is_error": false, "exit": 0}));
        return Ok(Output {
            text,
            json: None,
            usage,
            change: None,
            model: String::new(),
        });
    };
    let parsed: Value = serde_json::from_str(text.trim()).map_err(|e| {
        Error::new(
            FailureKind::Schema,
            format!("exec output is not JSON, but the call has a schema: {e}"),
        )
    })?;
    let mut submissions = Submissions::new(schema, 1)?;
    match submissions.submit(parsed)? {
        Submitted::Accepted(value) => {
            events.structured_captured(&value);
            events.transcript(json!({"type": "result", "is_error": false, "exit": 0}));
            Ok(Output {
                text,
                json: Some(value),
                usage,
                change: None,
                model: String::new(),
            })
        }
        Submitted::Retry(problem) => Err(Error::new(
            FailureKind::Schema,
            format!("exec output does not match the schema {problem}"),
        )),
    }
}
