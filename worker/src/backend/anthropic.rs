//! `anthropic`: the Messages API directly (`spec/agent-backends.md` §2–3).
//!
//! One attempt is one streamed `POST /v1/messages` (more when a structured output fails
//! validation: the validation message goes back as an error `tool_result`, up to the call's
//! schema-attempt limit). Text results are the concatenated text blocks; schema results come
//! from a forced `StructuredOutput` tool. Prompt caching is explicit: breakpoints on the system
//! block and on the end of the user turn, with a TTL of `5m` or `1h`
//! (`FLOTILLA_CACHE_TTL`). Usage includes cache reads and writes; cost comes from a price table
//! by model family. 429 and 529 (and `overloaded_error` mid-stream) are throttles: the call
//! waits `retry-after` and the account admits fewer; other 5xx answers are retried by the
//! coordinator; auth and request errors are terminal.
//!
//! Credentials and endpoint come from the worker's environment: `ANTHROPIC_API_KEY` (or
//! `ANTHROPIC_AUTH_TOKEN`) and `ANTHROPIC_BASE_URL` (default the public API).

use flotilla_proto::v1::{self, FailureKind, ProgressKind};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::seam::{AgentBackend, Events, Output, Submissions, Submitted, Task};
use crate::failure::Error;

/// Model used when neither the call nor the run names one.
pub const DEFAULT_MODEL: &str = "claude-sonnet-4-5";
const SYSTEM: &str = "You are an agent working on one task of a larger workflow. Do the task you are given and answer with the result only.";

/// The Messages API backend.
#[derive(Clone)]
pub struct Anthropic {
    client: reqwest::Client,
    base: String,
    key: Option<String>,
    bearer: Option<String>,
    cache_ttl: Option<String>,
    max_tokens: u32,
    /// The alias overrides the worker was given (`ANTHROPIC_DEFAULT_SONNET_MODEL`, ...).
    aliases: Vec<(String, String)>,
}

impl std::fmt::Debug for Anthropic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the credentials.
        f.debug_struct("Anthropic")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl Anthropic {
    /// From the worker's environment.
    pub fn from_env() -> Anthropic {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// From the variables `get` gives (the same names as in the environment).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Anthropic {
        let var = |k: &str| get(k).filter(|v| !v.is_empty());
        Anthropic {
            client: super::http::client(),
            base: var("ANTHROPIC_BASE_URL")
                .unwrap_or_else(|| "https://api.anthropic.com".into())
                .trim_end_matches('/')
                .to_owned(),
            key: var("ANTHROPIC_API_KEY"),
            bearer: var("ANTHROPIC_AUTH_TOKEN"),
            cache_ttl: var("FLOTILLA_CACHE_TTL").filter(|t| t == "1h"),
            max_tokens: 8192,
            aliases: [
                "ANTHROPIC_MODEL",
                "ANTHROPIC_DEFAULT_SONNET_MODEL",
                "ANTHROPIC_DEFAULT_OPUS_MODEL",
                "ANTHROPIC_DEFAULT_HAIKU_MODEL",
            ]
            .into_iter()
            .filter_map(|k| var(k).map(|v| (k.to_owned(), v)))
            .collect(),
        }
    }

    /// The model id (and beta) a task's model names.
    fn model_of(&self, model: &str) -> (String, Option<&'static str>) {
        resolve_alias(model, &|k| {
            self.aliases
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
        })
    }

    fn cache(&self) -> Value {
        match &self.cache_ttl {
            Some(ttl) => json!({"type": "ephemeral", "ttl": ttl}),
            None => json!({"type": "ephemeral"}),
        }
    }

    fn body(&self, task: &Task, messages: &[Value]) -> Value {
        let model = self.model_of(&task.spec.model).0;
        let mut body = json!({
            "model": model,
            "max_tokens": self.max_tokens,
            "stream": true,
            "system": [{"type": "text", "text": SYSTEM, "cache_control": self.cache()}],
            "messages": messages,
        });
        if let Some(schema) = &task.schema {
            body["tools"] = json!([{
                "name": "StructuredOutput",
                "description": "Return your final answer in the requested structured format. Call this tool exactly once.",
                "input_schema": schema,
            }]);
            body["tool_choice"] = json!({"type": "tool", "name": "StructuredOutput"});
        }
        body
    }
}

/// The model id an alias names on the Messages API, and the beta it needs: `sonnet`, `opus`
/// and `haiku` (as Claude Code spells them, with `[1m]` for the 1M-token context), each
/// overridable as Claude Code does (`ANTHROPIC_DEFAULT_SONNET_MODEL`, ...); anything else is
/// a model id already.
pub fn resolve_alias(
    model: &str,
    get: &dyn Fn(&str) -> Option<String>,
) -> (String, Option<&'static str>) {
    let (base, beta) = match model.strip_suffix("[1m]") {
        Some(b) => (b, Some(LONG_CONTEXT_BETA)),
        None => (model, None),
    };
    let (var, default) = match base {
        "" | "default" | "inherit" => ("ANTHROPIC_MODEL", DEFAULT_MODEL),
        "sonnet" => ("ANTHROPIC_DEFAULT_SONNET_MODEL", "claude-sonnet-4-5"),
        "opus" => ("ANTHROPIC_DEFAULT_OPUS_MODEL", "claude-opus-4-1"),
        "haiku" => ("ANTHROPIC_DEFAULT_HAIKU_MODEL", "claude-haiku-4-5"),
        id => return (id.to_owned(), beta),
    };
    (
        get(var)
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| default.to_owned()),
        beta,
    )
}

/// The beta header value of the 1M-token context window.
const LONG_CONTEXT_BETA: &str = "context-1m-2025-08-07";

/// One streamed reply.
#[derive(Default)]
struct Reply {
    text: String,
    tool_id: Option<String>,
    tool_json: String,
    usage: v1::Usage,
    stop: String,
}

/// Price per million tokens (input, output) by model family; cache reads cost a tenth of
/// input, cache writes 1.25× (5 minutes) or 2× (1 hour).
fn prices(model: &str) -> (f64, f64) {
    if model.contains("opus") {
        (15.0, 75.0)
    } else if model.contains("haiku") {
        (1.0, 5.0)
    } else {
        (3.0, 15.0)
    }
}

fn cost(model: &str, u: &v1::Usage, one_hour: bool) -> f64 {
    let (i, o) = prices(model);
    let write = if one_hour { 2.0 } else { 1.25 };
    (u.input_tokens as f64 * i
        + u.output_tokens as f64 * o
        + u.cache_read_tokens as f64 * i * 0.1
        + u.cache_write_tokens as f64 * i * write)
        / 1e6
}

impl Anthropic {
    /// Sends one request and reads its stream.
    async fn turn(
        &self,
        body: &Value,
        beta: Option<&str>,
        events: &Events,
        sent: &mut u64,
    ) -> Result<Reply, Error> {
        let mut req = self
            .client
            .post(format!("{}/v1/messages", self.base))
            .header("anthropic-version", "2023-06-01")
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(b) = beta {
            req = req.header("anthropic-beta", b);
        }
        if let Some(k) = &self.key {
            req = req.header("x-api-key", k);
        } else if let Some(t) = &self.bearer {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let mut resp = req.send().await.map_err(|e| {
            Error::new(
                FailureKind::Retryable,
                format!("anthropic: cannot reach {}: {e}", self.base),
            )
        })?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(super::http::failure("anthropic", resp, "ANTHROPIC_API_KEY").await);
        }
        let mut reply = Reply::default();
        let mut buf = String::new();
        loop {
            let chunk = resp.chunk().await.map_err(|e| {
                Error::new(
                    FailureKind::Retryable,
                    format!("anthropic: the stream broke: {e}"),
                )
            })?;
            let Some(chunk) = chunk else { break };
            buf.push_str(&String::from_utf8_lossy(&chunk));
            super::http::check_event_size("anthropic", buf.len())?;
            while let Some(end) = buf.find("\n\n") {
                let frame: String = buf.drain(..end + 2).collect();
                let data: String = frame
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim)
                    .collect();
                if data.is_empty() {
                    continue;
                }
                let Ok(ev) = serde_json::from_str::<Value>(&data) else {
                    continue;
                };
                self.on_event(&ev, &mut reply, events, sent)?;
            }
        }
        Ok(reply)
    }

    fn on_event(
        &self,
        ev: &Value,
        reply: &mut Reply,
        events: &Events,
        sent: &mut u64,
    ) -> Result<(), Error> {
        let n = |p: &str| ev.pointer(p).and_then(Value::as_u64).unwrap_or(0);
        match ev.get("type").and_then(Value::as_str).unwrap_or("") {
            "message_start" => {
                reply.usage.input_tokens = n("/message/usage/input_tokens");
                reply.usage.cache_read_tokens = n("/message/usage/cache_read_input_tokens");
                reply.usage.cache_write_tokens = n("/message/usage/cache_creation_input_tokens");
                events.progress(ProgressKind::ResponseStarted, *sent);
            }
            "content_block_start" => {
                let block = ev.get("content_block").cloned().unwrap_or(Value::Null);
                if block.get("type").and_then(Value::as_str) == Some("tool_use") {
                    reply.tool_id = block.get("id").and_then(Value::as_str).map(str::to_owned);
                }
            }
            "content_block_delta" => match ev.pointer("/delta/type").and_then(Value::as_str) {
                Some("text_delta") => {
                    let t = ev
                        .pointer("/delta/text")
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    reply.text.push_str(t);
                    *sent += 1;
                    events.progress(ProgressKind::Output, *sent);
                }
                Some("input_json_delta") => {
                    let t = ev
                        .pointer("/delta/partial_json")
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    reply.tool_json.push_str(t);
                    *sent += 1;
                    events.progress(ProgressKind::Output, *sent);
                }
                _ => {}
            },
            "message_delta" => {
                reply.usage.output_tokens = n("/usage/output_tokens");
                reply.stop = ev
                    .pointer("/delta/stop_reason")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
            }
            "error" => {
                let kind = ev
                    .pointer("/error/type")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let msg = ev
                    .pointer("/error/message")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let message = format!("anthropic: {kind}: {msg}");
                return Err(match kind {
                    "overloaded_error" | "rate_limit_error" => Error::throttled(None, message),
                    "api_error" => Error::new(FailureKind::Retryable, message),
                    _ => Error::new(FailureKind::Terminal, message),
                });
            }
            _ => {}
        }
        Ok(())
    }
}

fn add(total: &mut v1::Usage, u: &v1::Usage) {
    total.input_tokens += u.input_tokens;
    total.output_tokens += u.output_tokens;
    total.cache_read_tokens += u.cache_read_tokens;
    total.cache_write_tokens += u.cache_write_tokens;
    total.cost_usd += u.cost_usd;
    total.tool_calls += u.tool_calls;
}

#[async_trait::async_trait]
impl AgentBackend for Anthropic {
    fn name(&self) -> &'static str {
        "anthropic"
    }

    fn uses_directory(&self) -> bool {
        false
    }

    fn account(&self) -> Option<String> {
        Some(super::seam::account_id(
            "anthropic",
            &self.base,
            self.key.as_deref().or(self.bearer.as_deref()),
        ))
    }

    async fn run(
        &self,
        task: &Task,
        events: &Events,
        cancel: CancellationToken,
    ) -> Result<Output, Error> {
        if self.key.is_none() && self.bearer.is_none() {
            return Err(Error::new(
                FailureKind::Terminal,
                "the anthropic backend needs ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN) in the worker's environment",
            ));
        }
        let (model, beta) = self.model_of(&task.spec.model);
        let mut subs = match &task.schema {
            Some(s) => Some(Submissions::new(s, task.spec.schema_attempts.max(1))?),
            None => None,
        };
        let (continued, line) = super::session::messages_to_continue(&task.spec, "anthropic");
        if let Some(line) = line {
            events.transcript(json!({"type": "session", "text": line}));
        }
        let mut messages = continued.unwrap_or_else(|| {
            vec![json!({"role": "user", "content": [
                {"type": "text", "text": task.spec.prompt, "cache_control": self.cache()}]})]
        });
        // What it said and heard goes with a failure, for the next attempt to go on.
        let kept = |messages: &[Value], mut e: Error| {
            e.session = super::session::of_messages("anthropic", messages, &task.spec.prompt);
            e
        };
        let mut total = v1::Usage::default();
        let mut sent = 0u64;
        events.transcript(json!({"type": "init", "backend": "anthropic", "model": model}));
        loop {
            let body = self.body(task, &messages);
            let reply = tokio::select! {
                _ = cancel.cancelled() => {
                    let mut e = Error::cancelled("the request was dropped");
                    e.usage = total;
                    return Err(kept(&messages, e));
                }
                r = self.turn(&body, beta, events, &mut sent) => r,
            };
            let mut reply = match reply {
                Ok(r) => r,
                Err(mut e) => {
                    e.usage = total;
                    return Err(kept(&messages, e));
                }
            };
            reply.usage.cost_usd = cost(&model, &reply.usage, self.cache_ttl.is_some());
            add(&mut total, &reply.usage);
            if !reply.text.is_empty() {
                events.transcript(json!({"type": "text", "text": reply.text}));
            }
            let Some(subs) = subs.as_mut() else {
                events.transcript(json!({"type": "result", "is_error": false, "usage": {
                    "input_tokens": total.input_tokens, "output_tokens": total.output_tokens,
                    "cache_read": total.cache_read_tokens, "cache_write": total.cache_write_tokens},
                    "cost_usd": total.cost_usd}));
                return Ok(Output {
                    text: reply.text,
                    json: None,
                    usage: total,
                    change: None,
                    model: model.clone(),
                });
            };
            let Some(id) = reply.tool_id.clone() else {
                let mut e = subs.exhausted();
                e.usage = total;
                return Err(e);
            };
            total.tool_calls += 1;
            let input: Value = serde_json::from_str(&reply.tool_json).unwrap_or(Value::Null);
            events.transcript(
                json!({"type": "tool_call", "name": "StructuredOutput", "input": input}),
            );
            match subs.submit(input.clone()) {
                Ok(Submitted::Accepted(v)) => {
                    events.structured_captured(&v);
                    events.transcript(json!({"type": "result", "is_error": false,
                        "structured_output": v, "cost_usd": total.cost_usd}));
                    return Ok(Output {
                        text: v.to_string(),
                        json: Some(v),
                        usage: total,
                        change: None,
                        model: model.clone(),
                    });
                }
                Ok(Submitted::Retry(problem)) => {
                    // The validation message goes back; the model gets another turn.
                    events.transcript(
                        json!({"type": "tool_result", "is_error": true, "output": problem}),
                    );
                    messages.push(json!({"role": "assistant", "content": [
                        {"type": "tool_use", "id": id, "name": "StructuredOutput", "input": input}]}));
                    messages.push(json!({"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": id, "is_error": true,
                         "content": format!("Output does not match the required schema: {problem}")}]}));
                    // What the next attempt continues should this worker be lost.
                    if let Some(s) =
                        super::session::of_messages("anthropic", &messages, &task.spec.prompt)
                    {
                        events.checkpoint(*s);
                    }
                }
                Err(mut e) => {
                    e.usage = total;
                    return Err(e);
                }
            }
        }
    }
}
