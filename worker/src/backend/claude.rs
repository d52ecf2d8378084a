//! `claude-code`: one Claude Code CLI process per attempt (`spec/agent-backends.md` §1).
//!
//! The CLI runs non-interactively with stream-json in and out and host-controlled permissions:
//! `claude -p --input-format stream-json --output-format stream-json --verbose
//! --permission-prompt-tool stdio`. The prompt goes in as one user line on stdin; every
//! stdout line becomes a normalized transcript event; every permission request is answered
//! from the worker's policy (tools the call lists in `tools`, plus the worker's allow-list;
//! anything else is denied, never left hanging); the `result` line decides the outcome.
//! The process runs in its own process group in the call's working directory, with a config
//! directory of its own; cancel, stall and timeout kill the whole group.
//!
//! Credentials and endpoint come from the worker's environment (`ANTHROPIC_API_KEY` or
//! `ANTHROPIC_AUTH_TOKEN`, `ANTHROPIC_BASE_URL`), never from the script.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use flotilla_proto::v1::{self, FailureKind, ProgressKind};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use super::lines::{self, BoundedLines};
use tokio_util::sync::CancellationToken;

use super::procs::{GroupGuard, kill_group};
use super::seam::{AgentBackend, Events, Output, Submissions, Submitted, Task};
use super::session;
use crate::failure::Error;

/// The Claude Code CLI backend.
#[derive(Debug, Clone)]
pub struct ClaudeCode {
    /// The `claude` executable.
    pub bin: PathBuf,
    /// Tools every call may use without listing them (worker policy).
    pub allow: Vec<String>,
    /// `CLAUDE_CODE_MAX_RETRIES` for the CLI's own retries of API errors (the coordinator
    /// retries attempts too, so keep it low).
    pub max_retries: u32,
    /// How long a call waits after the CLI gave up on a rate limit (it does not say how long
    /// the limit lasts): `FLOTILLA_LIMIT_WAIT`, default 30 s.
    pub limit_wait: Duration,
    /// The model API's endpoint and credentials for an unsandboxed CLI (`ANTHROPIC_BASE_URL`,
    /// `ANTHROPIC_API_KEY`, `ANTHROPIC_AUTH_TOKEN`), as the worker was given them; a sandboxed
    /// one reaches the API through the worker's gateway instead.
    pub api_env: Vec<(String, String)>,
    /// An interrupted attempt's session is continued by the next (issue 33, 3); `false`
    /// (`FLOTILLA_SESSIONS=fresh`): every attempt starts over, as Claude Code's restarts do.
    pub sessions: bool,
    /// How often a running attempt's conversation is checkpointed to the coordinator, when
    /// the model took a turn since the last (`FLOTILLA_SESSION_CHECKPOINT`, 30 s by default,
    /// `off`): what the call's next attempt continues should this worker be lost.
    pub checkpoint_every: Option<Duration>,
}

impl ClaudeCode {
    /// From the environment: `FLOTILLA_CLAUDE_BIN` (default `claude` on `PATH`) and
    /// `FLOTILLA_ALLOW_TOOLS` (comma-separated).
    pub fn from_env() -> ClaudeCode {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// From the variables `get` gives (the same names as in the environment).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> ClaudeCode {
        let bin = get("FLOTILLA_CLAUDE_BIN")
            .filter(|b| !b.is_empty())
            .map_or_else(|| PathBuf::from("claude"), PathBuf::from);
        let allow = get("FLOTILLA_ALLOW_TOOLS")
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect();
        let limit_wait = get("FLOTILLA_LIMIT_WAIT")
            .and_then(|v| parse_wait(&v))
            .unwrap_or(Duration::from_secs(30));
        let api_env = [
            "ANTHROPIC_BASE_URL",
            "ANTHROPIC_API_KEY",
            "ANTHROPIC_AUTH_TOKEN",
        ]
        .into_iter()
        .filter_map(|k| get(k).map(|v| (k.to_owned(), v)))
        .collect();
        ClaudeCode {
            bin,
            allow,
            max_retries: 2,
            limit_wait,
            api_env,
            sessions: get("FLOTILLA_SESSIONS").as_deref() != Some("fresh"),
            checkpoint_every: match get("FLOTILLA_SESSION_CHECKPOINT").as_deref() {
                Some("off") => None,
                Some(v) => parse_wait(v).filter(|d| !d.is_zero()),
                None => Some(Duration::from_secs(30)),
            },
        }
    }

    fn args(&self, task: &Task, start: &session::Start) -> Vec<String> {
        let mut args: Vec<String> = [
            "-p",
            "--input-format",
            "stream-json",
            "--output-format",
            "stream-json",
            "--verbose",
            "--permission-prompt-tool",
            "stdio",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        // The session is kept in the attempt's config, for a next attempt to continue it.
        match start {
            session::Start::Fresh { id, .. } => args.extend(["--session-id".into(), id.clone()]),
            session::Start::Continue { id, .. } => args.extend(["--resume".into(), id.clone()]),
        }
        let s = &task.spec;
        if !s.model.is_empty() {
            args.extend(["--model".into(), s.model.clone()]);
        }
        if !s.effort.is_empty() {
            args.extend(["--effort".into(), s.effort.clone()]);
        }
        if let Some(schema) = &s.schema_json {
            args.extend(["--json-schema".into(), schema.clone()]);
        }
        if !s.tools.is_empty() {
            args.extend(["--tools".into(), s.tools.join(",")]);
        }
        // agentType (W21): a custom type travels with its definition; a built-in is named.
        if !s.agent_type.is_empty() {
            if let Ok(def) = serde_json::from_str::<Value>(&s.agent_def_json) {
                args.extend([
                    "--agents".into(),
                    json!({ s.agent_type.clone(): def }).to_string(),
                ]);
            }
            args.extend(["--agent".into(), s.agent_type.clone()]);
        }
        if let Some(wt) = task.worktree.as_ref() {
            args.extend([
                "--append-system-prompt".into(),
                format!(
                    "You are working in an isolated git worktree at {} on branch {}: a copy of the repository made for this task. Your changes stay in this worktree and do not touch the main checkout.",
                    wt.path.display(),
                    wt.branch
                ),
            ]);
        }
        args
    }
}

/// What the stream said, as the outcome needs it.
#[derive(Default)]
struct Seen {
    result: Option<Value>,
    tool_calls: u32,
    output_tokens: u64,
}

/// The answer to a control request of the CLI's: a tool it asks to use is allowed when the
/// call's `tools` or the worker's allow-list name it; any other request gets an error.
fn answer_control(line: &Value, allowed: &HashSet<String>, events: &Events, seen: &Seen) -> Value {
    let request_id = line.get("request_id").cloned().unwrap_or(Value::Null);
    let req = line.get("request").cloned().unwrap_or(Value::Null);
    if req.get("subtype").and_then(Value::as_str) != Some("can_use_tool") {
        // Unknown control requests get an error answer rather than silence.
        return json!({"type": "control_response", "response": {
            "subtype": "error", "request_id": request_id,
            "error": "not supported by this host"}});
    }
    let tool = req
        .get("tool_name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    let input = req.get("input").cloned().unwrap_or_else(|| json!({}));
    let allow = allowed.contains(&tool);
    events.transcript(json!({"type": "permission", "tool": tool, "allowed": allow}));
    events.progress(ProgressKind::Keepalive, seen.output_tokens);
    let response = if allow {
        json!({"behavior": "allow", "updatedInput": input})
    } else {
        let mut list: Vec<&String> = allowed.iter().collect();
        list.sort();
        json!({"behavior": "deny", "message": format!(
            "the tool {tool} is not allowed for this agent (allowed: {}); list it in the call's `tools` option or the worker's allow-list",
            if list.is_empty() { "none".to_owned() } else { list.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ") })})
    };
    json!({"type": "control_response", "response": {
        "subtype": "success", "request_id": request_id, "response": response}})
}

/// One stdout line: transcript event, progress, and a permission answer when asked.
fn on_line(
    line: &Value,
    allowed: &HashSet<String>,
    events: &Events,
    seen: &mut Seen,
) -> Option<Value> {
    let kind = line.get("type").and_then(Value::as_str).unwrap_or("");
    let subtype = line.get("subtype").and_then(Value::as_str).unwrap_or("");
    match (kind, subtype) {
        ("system", "init") => {
            events.transcript(json!({"type": "init", "backend": "claude-code",
                "session_id": line.get("session_id"), "model": line.get("model"),
                "cwd": line.get("cwd"), "version": line.get("claude_code_version")}));
            events.progress(ProgressKind::Keepalive, seen.output_tokens);
        }
        ("system", "api_retry") => {
            events.transcript(json!({"type": "retry", "attempt": line.get("attempt"),
                "error_status": line.get("error_status"), "error": line.get("error"),
                "retry_delay_ms": line.get("retry_delay_ms")}));
            events.progress(ProgressKind::Keepalive, seen.output_tokens);
        }
        ("system", "permission_denied") => {
            events.transcript(
                json!({"type": "permission_denied", "tool": line.get("tool_name"),
                "message": line.get("message")}),
            );
        }
        ("assistant", _) => {
            let content = line
                .pointer("/message/content")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if let Some(n) = line
                .pointer("/message/usage/output_tokens")
                .and_then(Value::as_u64)
            {
                seen.output_tokens += n;
            }
            for block in content {
                match block.get("type").and_then(Value::as_str).unwrap_or("") {
                    "text" => {
                        events.transcript(json!({"type": "text", "text": block.get("text")}));
                        events.progress(ProgressKind::ResponseStarted, seen.output_tokens);
                    }
                    "thinking" => {
                        events
                            .transcript(json!({"type": "thinking", "text": block.get("thinking")}));
                        events.progress(ProgressKind::Output, seen.output_tokens);
                    }
                    "tool_use" => {
                        seen.tool_calls += 1;
                        events.transcript(json!({"type": "tool_call", "id": block.get("id"),
                            "name": block.get("name"), "input": block.get("input")}));
                        events.progress(ProgressKind::ToolStarted, seen.output_tokens);
                    }
                    _ => {}
                }
            }
        }
        ("user", _) => {
            let content = line
                .pointer("/message/content")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for block in content {
                if block.get("type").and_then(Value::as_str) == Some("tool_result") {
                    let text = match block.get("content") {
                        Some(Value::String(s)) => s.clone(),
                        Some(other) => other.to_string(),
                        None => String::new(),
                    };
                    let head: String = text.chars().take(2000).collect();
                    events.transcript(
                        json!({"type": "tool_result", "id": block.get("tool_use_id"),
                        "is_error": block.get("is_error"), "output": head}),
                    );
                    events.progress(ProgressKind::ToolFinished, seen.output_tokens);
                }
            }
        }
        ("control_request", _) => return Some(answer_control(line, allowed, events, seen)),
        ("result", _) => {
            events.transcript(json!({"type": "result", "is_error": line.get("is_error"),
                "subtype": line.get("subtype"), "result": line.get("result"),
                "structured_output": line.get("structured_output"),
                "usage": line.get("usage"), "cost_usd": line.get("total_cost_usd"),
                "num_turns": line.get("num_turns"), "terminal_reason": line.get("terminal_reason"),
                "api_error_status": line.get("api_error_status"),
                "permission_denials": line.get("permission_denials")}));
            seen.result = Some(line.clone());
        }
        _ => {}
    }
    None
}

/// The model that wrote most of a `result` line's output (`modelUsage` is keyed by model
/// id); empty when the line does not say.
fn model_of(result: &Value) -> String {
    result
        .get("modelUsage")
        .and_then(Value::as_object)
        .and_then(|m| {
            m.iter()
                .max_by_key(|(_, u)| u.get("outputTokens").and_then(Value::as_u64))
                .map(|(id, _)| id.clone())
        })
        .unwrap_or_default()
}

/// Usage of a `result` line.
fn usage_of(result: &Value, tool_calls: u32) -> v1::Usage {
    let n = |p: &str| result.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    v1::Usage {
        input_tokens: n("/usage/input_tokens"),
        output_tokens: n("/usage/output_tokens"),
        cache_read_tokens: n("/usage/cache_read_input_tokens"),
        cache_write_tokens: n("/usage/cache_creation_input_tokens"),
        cost_usd: result
            .get("total_cost_usd")
            .and_then(Value::as_f64)
            .unwrap_or(0.0),
        tool_calls,
        disk_bytes: 0,
    }
}

/// `1500ms`, `2s`, `1m` or plain milliseconds.
fn parse_wait(v: &str) -> Option<Duration> {
    let v = v.trim();
    if let Some(ms) = v.strip_suffix("ms") {
        return ms.trim().parse().ok().map(Duration::from_millis);
    }
    if let Some(s) = v.strip_suffix('s') {
        return s.trim().parse::<f64>().ok().map(Duration::from_secs_f64);
    }
    if let Some(m) = v.strip_suffix('m') {
        return m
            .trim()
            .parse::<f64>()
            .ok()
            .map(|m| Duration::from_secs_f64(m * 60.0));
    }
    v.parse().ok().map(Duration::from_millis)
}

/// Classifies a `result` line with `is_error` (spec §1.10).
fn failure_of(result: &Value, limit_wait: Duration) -> Error {
    let status = result
        .get("api_error_status")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let subtype = result.get("subtype").and_then(Value::as_str).unwrap_or("");
    let text = result
        .get("result")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .or_else(|| result.get("errors").map(Value::to_string))
        .unwrap_or_else(|| "the agent failed".into());
    let message = format!("claude: {text}");
    match (status, subtype) {
        // A subscription's usage limit (W59) closes the gate for everyone until its reset;
        // an API rate limit or overload is the account's throttle.
        (429, _) if text.to_ascii_lowercase().contains("usage limit") => {
            Error::rate_limited(limit_wait, message)
        }
        (429 | 529, _) => Error::throttled(None, message),
        (500..=599, _) => Error::new(FailureKind::Retryable, message),
        (401 | 403, _) => Error::new(
            FailureKind::Terminal,
            format!("{message} (check ANTHROPIC_API_KEY / ANTHROPIC_AUTH_TOKEN on the worker)"),
        ),
        (_, "error_max_turns" | "error_max_budget_usd") => {
            Error::new(FailureKind::Terminal, message)
        }
        (0, _) if text.contains("overloaded") => Error::throttled(None, message),
        _ => Error::new(FailureKind::Terminal, message),
    }
}

/// Settings of the worker's environment a sandboxed CLI still gets (none is a secret).
const PASSED: &[&str] = &[
    "ANTHROPIC_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
    "CLAUDE_CODE_MAX_OUTPUT_TOKENS",
    "MAX_THINKING_TOKENS",
    "DISABLE_AUTOUPDATER",
    "DISABLE_TELEMETRY",
];

/// The directory of the npm package the CLI's executable belongs to (the nearest with a
/// `package.json`), else the executable's own directory: what the sandbox shows of it.
fn package_root(bin: &std::path::Path) -> PathBuf {
    let dir = bin.parent().unwrap_or(bin);
    // Only Claude Code's own package: never a project or home directory that happens to
    // hold a package.json.
    dir.ancestors()
        .take(4)
        .find(|d| {
            std::fs::read_to_string(d.join("package.json"))
                .is_ok_and(|p| p.contains("\"@anthropic-ai/claude-code\""))
        })
        .unwrap_or(dir)
        .to_owned()
}

#[async_trait::async_trait]
impl AgentBackend for ClaudeCode {
    fn name(&self) -> &'static str {
        "claude-code"
    }

    /// The same account as the `anthropic` backend's with this endpoint and key; without a
    /// key, the CLI's own sign-in (`login`).
    fn account(&self) -> Option<String> {
        let var = |k: &str| {
            self.api_env
                .iter()
                .find(|(n, v)| n == k && !v.is_empty())
                .map(|(_, v)| v.as_str())
        };
        let base = var("ANTHROPIC_BASE_URL").unwrap_or("https://api.anthropic.com");
        let key = var("ANTHROPIC_API_KEY")
            .or_else(|| var("ANTHROPIC_AUTH_TOKEN"))
            .unwrap_or("login");
        Some(super::seam::account_id("anthropic", base, Some(key)))
    }

    async fn run(
        &self,
        task: &Task,
        events: &Events,
        cancel: CancellationToken,
    ) -> Result<Output, Error> {
        let config = tempfile::Builder::new()
            .prefix("flotilla-claude-")
            .tempdir()
            .map_err(|e| {
                Error::new(
                    FailureKind::Retryable,
                    format!("cannot make a config dir: {e}"),
                )
            })?;
        let workdir = task.workdir()?;
        let start = if self.sessions {
            session::start(&task.spec, config.path(), &workdir)
        } else {
            session::Start::Fresh {
                id: session::new_id(),
                why: task.spec.session.as_ref().map(|_| {
                    "this worker starts every attempt over (FLOTILLA_SESSIONS=fresh)".into()
                }),
            }
        };
        if let Some(line) = start.line() {
            events.transcript(json!({"type": "session", "text": line}));
        }
        let run = self.run_with(task, events, cancel, config.path(), &start);
        let ran = match self.checkpoint_every.filter(|_| self.sessions) {
            Some(every) => {
                let at = (config.path(), workdir.as_path());
                let keep =
                    session::keep_checkpoints(every, at, start.id(), &task.spec.prompt, events);
                tokio::select! {
                    r = run => r,
                    never = keep => match never {},
                }
            }
            None => run.await,
        };
        // What it said and heard so far goes with a failure, for the next attempt to go on.
        ran.map_err(|mut e| {
            e.session = session::capture(config.path(), &workdir, start.id(), &task.spec.prompt)
                .map(Box::new);
            e
        })
    }
}

impl ClaudeCode {
    /// One attempt of the CLI with its config in `config`, started as `start` says.
    async fn run_with(
        &self,
        task: &Task,
        events: &Events,
        cancel: CancellationToken,
        config: &std::path::Path,
        start: &session::Start,
    ) -> Result<Output, Error> {
        // The attempt's key to the gateway lives as long as this attempt, and no longer.
        let (mut cmd, _token) = self.command(task, config, start)?;
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| {
            Error::new(
                FailureKind::Terminal,
                format!(
                    "cannot start {}: {e}; install Claude Code (npm install @anthropic-ai/claude-code) or set FLOTILLA_CLAUDE_BIN",
                    self.bin.display()
                ),
            )
        })?;
        let pgid = child.id();
        let _group = GroupGuard(pgid);
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| Error::new(FailureKind::Terminal, "claude has no stdin pipe"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| Error::new(FailureKind::Terminal, "claude has no stdout pipe"))?;
        let stderr = child
            .stderr
            .take()
            .ok_or_else(|| Error::new(FailureKind::Terminal, "claude has no stderr pipe"))?;
        let stderr_task = tokio::spawn(stderr_tail(stderr));
        let seen = match self
            .converse(task, events, (stdin, stdout), start, &cancel)
            .await
        {
            Ok(seen) => seen,
            Err(e) => {
                if e.kind == FailureKind::Cancelled {
                    kill_group(pgid);
                    let _ = child.wait().await;
                }
                return Err(e);
            }
        };
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
        kill_group(pgid);
        let tail = tokio::time::timeout(Duration::from_secs(2), stderr_task)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let Some(result) = seen.result else {
            let exit = match &status {
                Ok(Ok(s)) => s.code(),
                _ => None,
            };
            if let Some(e) = task
                .sandbox
                .setup_failure(exit, tail.last().map_or("", String::as_str))
            {
                return Err(e);
            }
            let code = match status {
                Ok(Ok(s)) => s.to_string(),
                _ => "no exit status".into(),
            };
            return Err(Error::new(
                FailureKind::Retryable,
                format!(
                    "claude ended ({code}) without a result line; its last stderr lines: {}",
                    tail.join(" | ")
                ),
            ));
        };
        self.output_of(task, events, &result, seen.tool_calls)
    }
}

impl ClaudeCode {
    /// The CLI's command for `task`, its config in `config_dir`: in a sandbox it reaches the
    /// model through the worker's gateway, with a key of this attempt's (returned: it stops
    /// working when dropped), and its config lives in its own home.
    fn command(
        &self,
        task: &Task,
        config_dir: &std::path::Path,
        start: &session::Start,
    ) -> Result<(tokio::process::Command, Option<crate::gateway::Token>), Error> {
        let mut env = vec![
            (
                "CLAUDE_CONFIG_DIR".to_owned(),
                config_dir.display().to_string(),
            ),
            (
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC".into(),
                "1".into(),
            ),
            (
                "CLAUDE_CODE_MAX_RETRIES".into(),
                self.max_retries.to_string(),
            ),
        ];
        let token = task.sandbox.api_token();
        let mut program = self.bin.clone().into_os_string();
        let mut jail = task.jail(Vec::new())?;
        if task.sandbox.is_on() {
            let bin = crate::sandbox::find_on_path(&self.bin.to_string_lossy())
                .and_then(|b| b.canonicalize().ok())
                .ok_or_else(|| {
                    Error::new(
                        FailureKind::Terminal,
                        format!(
                            "cannot find {}; install Claude Code (npm install @anthropic-ai/claude-code) or set FLOTILLA_CLAUDE_BIN",
                            self.bin.display()
                        ),
                    )
                })?;
            jail.mounts
                .push(crate::sandbox::Mount::Ro(package_root(&bin)));
            program = bin.into_os_string();
            // Its config (and its session) where the worker reads it after the sandbox ends.
            jail.mounts
                .push(crate::sandbox::Mount::Rw(config_dir.to_path_buf()));
            env.push(("ANTHROPIC_BASE_URL".into(), crate::sandbox::API_URL.into()));
            if let Some(t) = &token {
                env.push(("ANTHROPIC_API_KEY".into(), t.value.clone()));
            }
            for name in PASSED {
                if let Ok(v) = std::env::var(name) {
                    env.push(((*name).to_owned(), v));
                }
            }
            jail.api = true;
        } else {
            env.extend(self.api_env.iter().cloned());
        }
        jail.env.extend(env);
        let args: Vec<std::ffi::OsString> =
            self.args(task, start).into_iter().map(Into::into).collect();
        Ok((task.command(&program, &args, &jail), token))
    }

    /// One turn with the CLI: the prompt in, its stream-json lines out (each answered when
    /// it asks), until its result line or its end; closing stdin then ends it. A cancel is
    /// [`FailureKind::Cancelled`] (the caller kills the process group).
    async fn converse(
        &self,
        task: &Task,
        events: &Events,
        (mut stdin, stdout): (tokio::process::ChildStdin, tokio::process::ChildStdout),
        start: &session::Start,
        cancel: &CancellationToken,
    ) -> Result<Seen, Error> {
        // A continued session is told it was interrupted; its task is in the turns above.
        let said = match start {
            session::Start::Continue { .. } => session::CONTINUE_NOTE,
            session::Start::Fresh { .. } => task.spec.prompt.as_str(),
        };
        let first = json!({"type": "user", "message": {"role": "user", "content": said}});
        let write = |v: &Value| format!("{v}\n").into_bytes();
        let io_err = |e: std::io::Error| {
            Error::new(
                FailureKind::Retryable,
                format!("cannot talk to claude: {e}"),
            )
        };
        stdin.write_all(&write(&first)).await.map_err(io_err)?;
        let allowed: HashSet<String> = task
            .spec
            .tools
            .iter()
            .chain(self.allow.iter())
            .cloned()
            .collect();
        let mut seen = Seen::default();
        let mut lines = BoundedLines::new(stdout, lines::JSON_LINE_BYTES);
        loop {
            let next = tokio::select! {
                _ = cancel.cancelled() => {
                    events.transcript(json!({"type": "result", "is_error": true, "error": "cancelled"}));
                    return Err(Error::cancelled("the claude process group was killed"));
                }
                next = lines.next_line() => next,
            };
            let Ok(Some(line)) = next else { break };
            if line.cut {
                events.transcript(json!({"type": "stderr",
                    "text": format!("flotilla: a line of claude's output was longer than {} MiB and was cut", lines::JSON_LINE_BYTES >> 20)}));
            }
            let line = line.text;
            let Ok(value) = serde_json::from_str::<Value>(&line) else {
                events.transcript(json!({"type": "stdout", "text": line}));
                continue;
            };
            if let Some(answer) = on_line(&value, &allowed, events, &mut seen) {
                stdin.write_all(&write(&answer)).await.map_err(io_err)?;
            }
            if seen.result.is_some() {
                break;
            }
        }
        // One turn: closing stdin ends the CLI.
        drop(stdin);
        Ok(seen)
    }

    /// The attempt's output from the CLI's result line: its text, its structured output
    /// checked against the schema, its usage and model; or its failure.
    fn output_of(
        &self,
        task: &Task,
        events: &Events,
        result: &Value,
        tool_calls: u32,
    ) -> Result<Output, Error> {
        let usage = usage_of(result, tool_calls);
        if result.get("is_error").and_then(Value::as_bool) == Some(true) {
            let mut e = failure_of(result, self.limit_wait);
            e.usage = usage;
            return Err(e);
        }
        let text = result
            .get("result")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let json = match &task.schema {
            None => None,
            Some(schema) => Some(structured(task, schema, result, events).map_err(|mut e| {
                e.usage = usage;
                e
            })?),
        };
        Ok(Output {
            text,
            json,
            usage,
            change: None,
            model: model_of(result),
        })
    }
}

/// The last lines the CLI wrote on stderr (what a failure without a result line quotes).
async fn stderr_tail(stderr: tokio::process::ChildStderr) -> Vec<String> {
    let mut lines = BoundedLines::new(stderr, lines::STDERR_LINE_BYTES);
    let mut tail: Vec<String> = Vec::new();
    while let Ok(Some(line)) = lines.next_line().await {
        tail.push(line.text);
        if tail.len() > 20 {
            tail.remove(0);
        }
    }
    tail
}

/// The structured output of a result line, checked against the task's schema.
fn structured(
    task: &Task,
    schema: &Value,
    result: &Value,
    events: &Events,
) -> Result<Value, Error> {
    let mut subs = Submissions::new(schema, task.spec.schema_attempts.max(1))?;
    let Some(value) = result.get("structured_output").cloned() else {
        let mut e = subs.exhausted();
        e.message = format!(
            "claude finished without a structured output (it never called StructuredOutput): {}",
            e.message
        );
        return Err(e);
    };
    match subs.submit(value) {
        Ok(Submitted::Accepted(v)) => {
            events.structured_captured(&v);
            Ok(v)
        }
        Ok(Submitted::Retry(problem))
        | Err(Error {
            message: problem, ..
        }) => Err(Error::new(
            FailureKind::Schema,
            format!("claude's structured output does not match the schema: {problem}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_a_result_names_is_the_one_that_wrote_most() {
        let result = json!({"type": "result", "modelUsage": {
            "claude-haiku-4-5": {"inputTokens": 900, "outputTokens": 20},
            "claude-sonnet-4-5": {"inputTokens": 100, "outputTokens": 400},
        }});
        assert_eq!(model_of(&result), "claude-sonnet-4-5");
        assert_eq!(model_of(&json!({"type": "result"})), "");
    }
}
