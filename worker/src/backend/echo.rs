//! The deterministic `echo` backend, exactly as `spec/echo-backend.md` fixes it.
//!
//! - Text result: the prompt as passed. Structured result: [`fill`] of the schema, submitted
//!   through [`Submissions`] like a model's structured output.
//! - Usage: input tokens = characters of the prompt, output tokens = characters of the text
//!   result or of the compact JSON of the structured result. Attempts that end without an
//!   answer (fail, stall, rate limit, cancel) report zero.
//! - Control markers anywhere in the prompt: `[[fail]]`, `[[stall]]`, `[[stall:N]]`,
//!   `[[invalid]]`, `[[invalid:N]]`, `[[sleep:MS]]`, `[[ratelimit:N]]`. Counting for the
//!   `:N` forms uses the attempt number the coordinator assigns, so it holds across workers
//!   and coordinator restarts.

use std::time::Duration;

use flotilla_proto::v1::{FailureKind, ProgressKind, Usage};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use super::seam::{AgentBackend, Events, Output, Submissions, Submitted, Task, chars};
use crate::failure::Error;

/// How long a rate-limited echo attempt asks the caller to wait.
pub const RATE_LIMIT_RETRY_AFTER: Duration = Duration::from_millis(200);
/// Interval of keep-alive progress events while a `[[sleep:MS]]` wait runs.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_millis(50);

/// The echo backend.
#[derive(Debug, Default, Clone)]
pub struct Echo;

/// Control markers found in a prompt.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Markers {
    pub fail: bool,
    /// `Some(None)`: every attempt stalls; `Some(Some(n))`: the first n attempts stall.
    pub stall: Option<Option<u32>>,
    /// `Some(None)`: every submission is `{}`; `Some(Some(n))`: the first n are.
    pub invalid: Option<Option<u32>>,
    pub sleep_ms: Option<u64>,
    pub ratelimit: Option<u32>,
}

impl Markers {
    /// Reads every `[[name]]` / `[[name:N]]` marker of a prompt; unknown markers are ignored.
    pub fn parse(prompt: &str) -> Markers {
        let mut m = Markers::default();
        let mut rest = prompt;
        while let Some(start) = rest.find("[[") {
            let after = &rest[start + 2..];
            let Some(end) = after.find("]]") else { break };
            let body = &after[..end];
            let (name, arg) = match body.split_once(':') {
                Some((n, a)) => (n.trim(), a.trim().parse::<u64>().ok()),
                None => (body.trim(), None),
            };
            let small = |a: Option<u64>| a.map(|v| u32::try_from(v).unwrap_or(u32::MAX));
            match (name, body.contains(':')) {
                ("fail", false) => m.fail = true,
                ("stall", false) => m.stall = Some(None),
                ("stall", true) if arg.is_some() => m.stall = Some(small(arg)),
                ("invalid", false) => m.invalid = Some(None),
                ("invalid", true) if arg.is_some() => m.invalid = Some(small(arg)),
                ("sleep", true) if arg.is_some() => m.sleep_ms = arg,
                ("ratelimit", true) if arg.is_some() => m.ratelimit = small(arg),
                _ => {}
            }
            rest = &after[end + 2..];
        }
        m
    }

    fn stalls(&self, attempt: u32) -> bool {
        match self.stall {
            Some(None) => true,
            Some(Some(n)) => attempt <= n,
            None => false,
        }
    }

    fn invalid_submission(&self, submission: u32) -> bool {
        match self.invalid {
            Some(None) => true,
            Some(Some(n)) => submission <= n,
            None => false,
        }
    }
}

#[async_trait::async_trait]
impl AgentBackend for Echo {
    fn name(&self) -> &'static str {
        "echo"
    }

    fn uses_directory(&self) -> bool {
        false
    }

    async fn run(
        &self,
        task: &Task,
        events: &Events,
        cancel: CancellationToken,
    ) -> Result<Output, Error> {
        let prompt = &task.spec.prompt;
        let markers = Markers::parse(prompt);
        events.transcript(json!({
            "type": "init",
            "backend": "echo",
            "model": task.spec.model,
            "attempt": task.attempt,
        }));

        if let Some(n) = markers.ratelimit
            && task.attempt <= n
        {
            events.transcript(json!({"type": "retry", "reason": "rate_limited",
                "retry_after_ms": RATE_LIMIT_RETRY_AFTER.as_millis() as u64}));
            return Err(Error::rate_limited(
                RATE_LIMIT_RETRY_AFTER,
                "rate limited, retry after 200 ms",
            ));
        }
        if markers.stalls(task.attempt) {
            // Emit nothing and never finish: only the stall watchdog (or a cancel) ends this.
            cancel.cancelled().await;
            return Err(Error::cancelled("stalled attempt"));
        }
        if let Some(ms) = markers.sleep_ms {
            sleep_with_keepalive(Duration::from_millis(ms), events, &cancel).await?;
        }
        if markers.fail {
            events.transcript(json!({"type": "result", "is_error": true,
                "error": "terminal API error (echo [[fail]])"}));
            return Err(Error::new(
                FailureKind::Terminal,
                "terminal API error: the echo backend was told to fail ([[fail]])",
            ));
        }

        events.progress(ProgressKind::ResponseStarted, 0);
        let input_tokens = chars(prompt);
        let Some(schema) = &task.schema else {
            events.transcript(json!({"type": "assistant_text", "text": prompt}));
            let usage = Usage {
                input_tokens,
                output_tokens: chars(prompt),
                ..Usage::default()
            };
            events.progress(ProgressKind::Output, usage.output_tokens);
            events.transcript(json!({"type": "result", "is_error": false,
                "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}}));
            return Ok(Output {
                text: prompt.clone(),
                json: None,
                usage,
                change: None,
                model: String::new(),
            });
        };

        let mut submissions = Submissions::new(schema, task.spec.schema_attempts)?;
        if let Some(n) = largest_min_items(schema)
            && n > MAX_FILL_ITEMS
        {
            return Err(Error::new(
                FailureKind::Invalid,
                format!(
                    "the echo backend fills at most {MAX_FILL_ITEMS} array items, but the schema asks for minItems {n}"
                ),
            ));
        }
        let filled = fill(schema, prompt);
        loop {
            let number = submissions.made() + 1;
            let submission = if markers.invalid_submission(number) {
                Value::Object(Map::new())
            } else {
                filled.clone()
            };
            events.transcript(json!({"type": "tool_call", "name": "StructuredOutput",
                "input": submission, "submission": number}));
            match submissions.submit(submission) {
                Ok(Submitted::Accepted(value)) => {
                    events.structured_captured(&value);
                    let text = value.to_string();
                    let usage = Usage {
                        input_tokens,
                        output_tokens: chars(&text),
                        ..Usage::default()
                    };
                    events.progress(ProgressKind::Output, usage.output_tokens);
                    events.transcript(json!({"type": "result", "is_error": false,
                        "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}}));
                    return Ok(Output {
                        text,
                        json: Some(value),
                        usage,
                        change: None,
                        model: String::new(),
                    });
                }
                Ok(Submitted::Retry(problem)) => {
                    events.progress(ProgressKind::Output, 0);
                    events.transcript(json!({"type": "tool_result", "name": "StructuredOutput",
                        "is_error": true, "output": problem}));
                }
                Err(e) => {
                    events.transcript(
                        json!({"type": "result", "is_error": true, "error": e.message}),
                    );
                    return Err(e);
                }
            }
        }
    }
}

async fn sleep_with_keepalive(
    total: Duration,
    events: &Events,
    cancel: &CancellationToken,
) -> Result<(), Error> {
    let deadline = tokio::time::Instant::now() + total;
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Ok(());
        }
        let step = (deadline - now).min(KEEPALIVE_INTERVAL);
        tokio::select! {
            _ = cancel.cancelled() => return Err(Error::cancelled("cancelled while sleeping")),
            _ = tokio::time::sleep(step) => {}
        }
        if tokio::time::Instant::now() < deadline {
            events.progress(ProgressKind::Keepalive, 0);
        }
    }
}

/// Largest array the echo backend builds for a `minItems`.
pub const MAX_FILL_ITEMS: u64 = 100_000;

/// The largest `minItems` anywhere in a schema.
fn largest_min_items(schema: &Value) -> Option<u64> {
    match schema {
        Value::Object(m) => {
            let own = m.get("minItems").and_then(Value::as_u64);
            m.values().filter_map(largest_min_items).chain(own).max()
        }
        Value::Array(items) => items.iter().filter_map(largest_min_items).max(),
        _ => None,
    }
}

/// The structured result echo submits for `schema` (spec/echo-backend.md, "Structured result").
pub fn fill(schema: &Value, prompt: &str) -> Value {
    fill_at(schema, prompt, "")
}

fn fill_at(schema: &Value, prompt: &str, path: &str) -> Value {
    let Value::Object(s) = schema else {
        // `true` / `{}`-like schemas: no type, no properties, no items → string.
        return Value::String(path.to_owned());
    };
    if let Some(c) = s.get("const") {
        return c.clone();
    }
    if let Some(Value::Array(members)) = s.get("enum")
        && let Some(first) = members.first()
    {
        return first.clone();
    }
    let ty = match s.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .or_else(|| ts.iter().filter_map(Value::as_str).next())
            .unwrap_or("string")
            .to_owned(),
        _ if s.contains_key("properties") => "object".to_owned(),
        _ if s.contains_key("items") => "array".to_owned(),
        _ => {
            if let Some(Value::Array(alts)) = s.get("anyOf").or_else(|| s.get("oneOf"))
                && let Some(first) = alts.first()
            {
                return fill_at(first, prompt, path);
            }
            "string".to_owned()
        }
    };
    match ty.as_str() {
        "object" => {
            let mut out = Map::new();
            if let Some(Value::Object(props)) = s.get("properties") {
                for (key, sub) in props {
                    let child = if path.is_empty() {
                        key.clone()
                    } else {
                        format!("{path}.{key}")
                    };
                    let value = if key == "echo" && is_string_schema(sub) {
                        Value::String(prompt.to_owned())
                    } else {
                        fill_at(sub, prompt, &child)
                    };
                    out.insert(key.clone(), value);
                }
            }
            Value::Object(out)
        }
        "array" => {
            let mut n = s.get("minItems").and_then(Value::as_u64).unwrap_or(2);
            if let Some(max) = s.get("maxItems").and_then(Value::as_u64) {
                n = n.min(max);
            }
            let item = s.get("items").cloned().unwrap_or(Value::Object(Map::new()));
            (0..n)
                .map(|i| fill_at(&item, prompt, &format!("{path}[{i}]")))
                .collect()
        }
        "integer" | "number" => s
            .get("minimum")
            .cloned()
            .filter(Value::is_number)
            .unwrap_or(json!(1)),
        "boolean" => Value::Bool(false),
        "null" => Value::Null,
        _ => Value::String(path.to_owned()),
    }
}

fn is_string_schema(schema: &Value) -> bool {
    match schema.get("type") {
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .is_some_and(|t| t == "string"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_read_anywhere_in_the_prompt() {
        let m =
            Markers::parse("a [[fail]] b [[stall:2]] [[invalid]] [[sleep:150]] [[ratelimit:3]]");
        assert!(m.fail);
        assert_eq!(m.stall, Some(Some(2)));
        assert_eq!(m.invalid, Some(None));
        assert_eq!(m.sleep_ms, Some(150));
        assert_eq!(m.ratelimit, Some(3));
        assert_eq!(
            Markers::parse("plain [[unknown]] [[sleep]]"),
            Markers::default()
        );
        assert_eq!(Markers::parse("[[stall]]").stall, Some(None));
        assert_eq!(Markers::parse("[[invalid:4]]").invalid, Some(Some(4)));
    }

    #[test]
    fn fill_follows_the_spec() {
        let schema = json!({
            "type": "object",
            "properties": {
                "files": {"type": "array", "items": {"type": "string"}},
                "reason": {"type": "string"},
                "bugs": {"type": "array", "minItems": 3, "maxItems": 2,
                          "items": {"type": "object", "properties": {"where": {"type": "string"}, "line": {"type": "integer", "minimum": 7}}}},
                "count": {"type": "number"},
                "ok": {"type": "boolean"},
                "nothing": {"type": "null"},
                "kind": {"enum": ["bug", "style"]},
                "fixed": {"const": 42},
                "maybe": {"type": ["null", "integer"]},
                "echo": {"type": "string"},
                "nested": {"properties": {"deep": {"items": {}}}}
            }
        });
        let v = fill(&schema, "the prompt");
        assert_eq!(
            v,
            json!({
                "files": ["files[0]", "files[1]"],
                "reason": "reason",
                "bugs": [{"where": "bugs[0].where", "line": 7}, {"where": "bugs[1].where", "line": 7}],
                "count": 1,
                "ok": false,
                "nothing": null,
                "kind": "bug",
                "fixed": 42,
                "maybe": 1,
                "echo": "the prompt",
                "nested": {"deep": ["nested.deep[0]", "nested.deep[1]"]}
            })
        );
        // Declaration order is kept.
        let keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys[0], "files");
        assert_eq!(keys[10], "nested");
    }
}
