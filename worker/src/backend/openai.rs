//! `openai`: any OpenAI-compatible chat completions server (`spec/agent-backends.md`).
//!
//! One attempt is one streamed `POST {base}/chat/completions` with
//! `stream_options.include_usage` (more when a structured answer fails validation: the
//! validation message goes back as a user turn, up to the call's schema-attempt limit). Schema
//! results use `response_format: json_schema`. Errors: 429 waits (`retry-after`), 5xx retries,
//! 4xx is terminal.
//!
//! From the worker's environment: `OPENAI_API_KEY`, `OPENAI_BASE_URL` (with its `/v1`; default
//! the public API) and `OPENAI_MODEL` (used when the call names no model).

use flotilla_proto::v1::{self, FailureKind, ProgressKind};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::seam::{AgentBackend, Events, Output, Submissions, Submitted, Task};
use crate::failure::Error;

const SYSTEM: &str = "You are an agent working on one task of a larger workflow. Do the task you are given and answer with the result only.";

/// The OpenAI-compatible backend.
#[derive(Clone)]
pub struct OpenAi {
    client: reqwest::Client,
    base: String,
    key: Option<String>,
    model: String,
}

impl std::fmt::Debug for OpenAi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAi")
            .field("base", &self.base)
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl OpenAi {
    pub fn from_env() -> OpenAi {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// From the variables `get` gives (the same names as in the environment).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> OpenAi {
        let var = |k: &str| get(k).filter(|v| !v.is_empty());
        OpenAi {
            client: super::http::client(),
            base: var("OPENAI_BASE_URL")
                .unwrap_or_else(|| "https://api.openai.com/v1".into())
                .trim_end_matches('/')
                .to_owned(),
            key: var("OPENAI_API_KEY"),
            model: var("OPENAI_MODEL").unwrap_or_else(|| "gpt-4o-mini".into()),
        }
    }

    async fn turn(
        &self,
        body: &Value,
        events: &Events,
        sent: &mut u64,
    ) -> Result<(String, v1::Usage), Error> {
        let mut req = self
            .client
            .post(format!("{}/chat/completions", self.base))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(k) = &self.key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let mut resp = req.send().await.map_err(|e| {
            Error::new(
                FailureKind::Retryable,
                format!("openai: cannot reach {}: {e}", self.base),
            )
        })?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(super::http::failure("openai", resp, "OPENAI_API_KEY").await);
        }
        let mut text = String::new();
        let mut usage = v1::Usage::default();
        let mut buf = String::new();
        let mut started = false;
        while let Some(chunk) = resp.chunk().await.map_err(|e| {
            Error::new(
                FailureKind::Retryable,
                format!("openai: the stream broke: {e}"),
            )
        })? {
            buf.push_str(&String::from_utf8_lossy(&chunk));
            super::http::check_event_size("openai", buf.len())?;
            while let Some(end) = buf.find('\n') {
                let line: String = buf.drain(..=end).collect();
                let Some(data) = line.trim().strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" || data.is_empty() {
                    continue;
                }
                let Ok(ev) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if !started {
                    started = true;
                    events.progress(ProgressKind::ResponseStarted, *sent);
                }
                if let Some(t) = ev
                    .pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
                {
                    text.push_str(t);
                    *sent += 1;
                    events.progress(ProgressKind::Output, *sent);
                }
                if let Some(u) = ev.get("usage").filter(|u| !u.is_null()) {
                    let n = |p: &str| u.pointer(p).and_then(Value::as_u64).unwrap_or(0);
                    let cached = n("/prompt_tokens_details/cached_tokens");
                    usage.input_tokens = n("/prompt_tokens").saturating_sub(cached);
                    usage.cache_read_tokens = cached;
                    usage.output_tokens = n("/completion_tokens");
                }
            }
        }
        Ok((text, usage))
    }
}

#[async_trait::async_trait]
impl AgentBackend for OpenAi {
    fn name(&self) -> &'static str {
        "openai"
    }

    fn uses_directory(&self) -> bool {
        false
    }

    fn account(&self) -> Option<String> {
        Some(super::seam::account_id(
            "openai",
            &self.base,
            self.key.as_deref(),
        ))
    }

    async fn run(
        &self,
        task: &Task,
        events: &Events,
        cancel: CancellationToken,
    ) -> Result<Output, Error> {
        let model = if task.spec.model.is_empty() {
            self.model.clone()
        } else {
            task.spec.model.clone()
        };
        let mut subs = match &task.schema {
            Some(s) => Some(Submissions::new(s, task.spec.schema_attempts.max(1))?),
            None => None,
        };
        let (continued, line) = super::session::messages_to_continue(&task.spec, "openai");
        if let Some(line) = line {
            events.transcript(json!({"type": "session", "text": line}));
        }
        let mut messages = continued.unwrap_or_else(|| {
            vec![
                json!({"role": "system", "content": SYSTEM}),
                json!({"role": "user", "content": task.spec.prompt}),
            ]
        });
        // What it said and heard goes with a failure, for the next attempt to go on.
        let kept = |messages: &[Value], mut e: Error| {
            e.session = super::session::of_messages("openai", messages, &task.spec.prompt);
            e
        };
        events.transcript(json!({"type": "init", "backend": "openai", "model": model}));
        let mut total = v1::Usage::default();
        let mut sent = 0u64;
        loop {
            let mut body = json!({"model": model, "messages": messages, "stream": true,
                "stream_options": {"include_usage": true}});
            if let Some(schema) = &task.schema {
                body["response_format"] = json!({"type": "json_schema",
                    "json_schema": {"name": "result", "schema": schema}});
            }
            let reply = tokio::select! {
                _ = cancel.cancelled() => {
                    let mut e = Error::cancelled("the request was dropped");
                    e.usage = total;
                    return Err(kept(&messages, e));
                }
                r = self.turn(&body, events, &mut sent) => r,
            };
            let (text, usage) = match reply {
                Ok(r) => r,
                Err(mut e) => {
                    e.usage = total;
                    return Err(kept(&messages, e));
                }
            };
            total.input_tokens += usage.input_tokens;
            total.output_tokens += usage.output_tokens;
            total.cache_read_tokens += usage.cache_read_tokens;
            events.transcript(json!({"type": "text", "text": text}));
            let Some(subs) = subs.as_mut() else {
                events.transcript(json!({"type": "result", "is_error": false,
                    "usage": {"input_tokens": total.input_tokens, "output_tokens": total.output_tokens}}));
                return Ok(Output {
                    text,
                    json: None,
                    usage: total,
                    change: None,
                    model: model.clone(),
                });
            };
            let value: Value =
                serde_json::from_str(text.trim()).unwrap_or(Value::String(text.clone()));
            match subs.submit(value) {
                Ok(Submitted::Accepted(v)) => {
                    events.structured_captured(&v);
                    return Ok(Output {
                        text: v.to_string(),
                        json: Some(v),
                        usage: total,
                        change: None,
                        model: model.clone(),
                    });
                }
                Ok(Submitted::Retry(problem)) => {
                    events.transcript(
                        json!({"type": "tool_result", "is_error": true, "output": problem}),
                    );
                    messages.push(json!({"role": "assistant", "content": text}));
                    messages.push(json!({"role": "user", "content": format!(
                        "Your answer does not match the required JSON schema: {problem}. Answer again with JSON only.")}));
                    // What the next attempt continues should this worker be lost.
                    if let Some(s) =
                        super::session::of_messages("openai", &messages, &task.spec.prompt)
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
