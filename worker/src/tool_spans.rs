//! An attempt's tool calls as trace spans, in the OpenTelemetry GenAI conventions: each
//! `tool_call` of its transcript opens an `execute_tool {name}` span under the attempt's, and
//! the `tool_result` with its id ends it (with `error.type` when the tool failed). What an
//! attempt leaves open ends with it, marked `unfinished`.

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::Value;

/// At most this many tool calls of one attempt are open at once as spans; an agent that
/// starts more without results gets no more spans (the transcript keeps them all).
const MOST_OPEN: usize = 256;

/// The open tool spans of one attempt.
#[derive(Default)]
pub struct ToolSpans {
    open: Mutex<HashMap<String, tracing::Span>>,
}

impl ToolSpans {
    /// Opens or ends a span for transcript event `ev` of the attempt whose span is `parent`.
    pub fn note(&self, parent: &tracing::Span, ev: &Value) {
        let (Some(kind), Some(id)) = (
            ev.get("type").and_then(Value::as_str),
            ev.get("id").and_then(Value::as_str),
        ) else {
            return;
        };
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        match kind {
            "tool_call" if open.len() < MOST_OPEN && !open.contains_key(id) => {
                let name = ev.get("name").and_then(Value::as_str).unwrap_or("tool");
                let span = tracing::info_span!(
                    parent: parent,
                    "tool",
                    otel.name = %format_args!("execute_tool {name}"),
                    otel.status_code = tracing::field::Empty,
                    gen_ai.operation.name = "execute_tool",
                    gen_ai.tool.name = %name,
                    gen_ai.tool.call.id = %id,
                    error.type = tracing::field::Empty,
                    flotilla.outcome = tracing::field::Empty,
                );
                open.insert(id.to_owned(), span);
            }
            "tool_result" => {
                if let Some(span) = open.remove(id) {
                    if ev.get("is_error").and_then(Value::as_bool) == Some(true) {
                        span.record("error.type", "tool_error");
                        span.record("otel.status_code", "error");
                        span.record("flotilla.outcome", "error");
                    } else {
                        span.record("flotilla.outcome", "ok");
                    }
                }
            }
            _ => {}
        }
    }

    /// Tool calls still open.
    pub fn open(&self) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for ToolSpans {
    fn drop(&mut self) {
        let open = self.open.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, span) in open.drain() {
            span.record("flotilla.outcome", "unfinished");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_result_ends_its_call_and_open_calls_are_bounded() {
        let t = ToolSpans::default();
        let parent = tracing::Span::none();
        t.note(
            &parent,
            &json!({"type": "tool_call", "id": "a", "name": "Bash"}),
        );
        t.note(
            &parent,
            &json!({"type": "tool_call", "id": "a", "name": "Bash"}),
        );
        t.note(&parent, &json!({"type": "tool_call", "name": "no id"}));
        assert_eq!(t.open(), 1);
        t.note(&parent, &json!({"type": "tool_result", "id": "nobody's"}));
        assert_eq!(t.open(), 1);
        t.note(
            &parent,
            &json!({"type": "tool_result", "id": "a", "is_error": true}),
        );
        assert_eq!(t.open(), 0);
        for i in 0..MOST_OPEN + 10 {
            t.note(
                &parent,
                &json!({"type": "tool_call", "id": i.to_string(), "name": "Read"}),
            );
        }
        assert_eq!(
            t.open(),
            MOST_OPEN,
            "a hostile agent cannot grow them without end"
        );
    }
}
