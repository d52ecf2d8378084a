//! An agent's transcript as a conversation (its text as turns, each tool call folded with its
//! result, thinking folded) and a diff with its added and removed lines coloured. Everything
//! shown is escaped.

use std::fmt::Write;

use serde_json::Value;

use super::escape::esc;

/// A tool's input or output longer than this is cut on the page (the whole stays in
/// `flotilla logs`).
const MAX_SHOWN: usize = 20_000;

fn text_of(e: &Value, key: &str) -> String {
    match e.get(key) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => serde_json::to_string_pretty(other).unwrap_or_default(),
    }
}

fn cut(s: &str, at: usize) -> String {
    if s.chars().count() <= at {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(at).collect();
    out.push('…');
    out
}

/// A one-line glimpse of a tool's input for its folded summary.
fn glimpse(input: &str) -> String {
    let one: String = input.split_whitespace().collect::<Vec<_>>().join(" ");
    cut(&one, 120)
}

/// One attempt's transcript events as HTML turns.
pub(super) fn transcript(events: &[Value]) -> String {
    let mut out = String::from("<div class=turns>");
    // A tool call's result, found by the call's id (or, without ids, the next result).
    let mut used = vec![false; events.len()];
    for (i, e) in events.iter().enumerate() {
        if used[i] {
            continue;
        }
        let kind = e.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "text" | "assistant_text" => {
                let _ = write!(
                    out,
                    "<div class=\"turn said\"><div class=who>agent</div><div class=body>{}</div></div>",
                    esc(&cut(&text_of(e, "text"), MAX_SHOWN))
                );
            }
            "thinking" => {
                let _ = write!(
                    out,
                    "<details class=\"turn thinking\"><summary>thinking</summary><pre>{}</pre></details>",
                    esc(&cut(&text_of(e, "text"), MAX_SHOWN))
                );
            }
            "tool_call" => {
                let id = e.get("id").and_then(Value::as_str);
                let result = events.iter().enumerate().skip(i + 1).find(|(j, r)| {
                    !used[*j]
                        && r.get("type").and_then(Value::as_str) == Some("tool_result")
                        && (id.is_none() || r.get("id").and_then(Value::as_str) == id)
                });
                let input = text_of(e, "input");
                let (state, output) = match result {
                    Some((j, r)) => {
                        used[j] = true;
                        let failed = r.get("is_error").and_then(Value::as_bool) == Some(true);
                        (
                            if failed { "error" } else { "ok" },
                            Some(text_of(r, "output")),
                        )
                    }
                    None => ("no result", None),
                };
                let _ = write!(
                    out,
                    "<details class=\"turn tool {cls}\"><summary><b>{name}</b> <code>{glimpse}</code> <span class=state>{state}</span></summary>\
                     <div class=label>input</div><pre>{input}</pre>",
                    cls = state.replace(' ', "-"),
                    name = esc(&text_of(e, "name")),
                    glimpse = esc(&glimpse(&input)),
                    input = esc(&cut(&input, MAX_SHOWN)),
                );
                if let Some(o) = output {
                    let _ = write!(
                        out,
                        "<div class=label>result</div><pre>{}</pre>",
                        esc(&cut(&o, MAX_SHOWN))
                    );
                }
                out.push_str("</details>");
            }
            "tool_result" => {
                let _ = write!(
                    out,
                    "<details class=\"turn tool\"><summary>result <code>{}</code></summary><pre>{}</pre></details>",
                    esc(&text_of(e, "name")),
                    esc(&cut(&text_of(e, "output"), MAX_SHOWN))
                );
            }
            "result" => {
                let failed = e.get("is_error").and_then(Value::as_bool) == Some(true);
                let _ = write!(
                    out,
                    "<div class=\"turn end{}\"><div class=who>{}</div><div class=body>{}</div></div>",
                    if failed { " failed" } else { "" },
                    if failed {
                        "ended with an error"
                    } else {
                        "done"
                    },
                    esc(&cut(&text_of(e, "result"), MAX_SHOWN))
                );
            }
            _ => {
                let _ = write!(
                    out,
                    "<div class=\"turn note\">{}</div>",
                    esc(crate::history::transcript_line(e).trim())
                );
            }
        }
    }
    out.push_str("</div>");
    out
}

/// A unified diff with its files, hunks, additions and removals marked for colour.
pub(super) fn diff(d: &str) -> String {
    let mut out = String::with_capacity(d.len() + d.len() / 4);
    out.push_str("<pre class=diff>");
    for line in d.lines() {
        let class = if line.starts_with("diff --git") {
            Some("df")
        } else if line.starts_with("+++") || line.starts_with("---") {
            Some("dh")
        } else if line.starts_with("@@") {
            Some("dk")
        } else if line.starts_with('+') {
            Some("da")
        } else if line.starts_with('-') {
            Some("dr")
        } else {
            None
        };
        match class {
            Some(c) => {
                let _ = writeln!(out, "<span class={c}>{}</span>", esc(line));
            }
            None => {
                out.push_str(&esc(line));
                out.push('\n');
            }
        }
    }
    out.push_str("</pre>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_tool_call_folds_with_its_own_result_and_text_becomes_a_turn() {
        let events = vec![
            json!({"type": "text", "text": "Looking <now>"}),
            json!({"type": "tool_call", "id": "b", "name": "Read", "input": {"file": "x.rs"}}),
            json!({"type": "tool_call", "id": "a", "name": "Bash", "input": "ls"}),
            json!({"type": "tool_result", "id": "a", "output": "README", "is_error": true}),
            json!({"type": "tool_result", "id": "b", "output": "fn main"}),
            json!({"type": "result", "result": "all good"}),
        ];
        let html = transcript(&events);
        assert!(html.contains("Looking &lt;now&gt;"), "{html}");
        assert_eq!(
            html.matches("<details class=\"turn tool").count(),
            2,
            "{html}"
        );
        let bash = &html[html.find("<b>Bash</b>").unwrap()..];
        let bash = &bash[..bash.find("</details>").unwrap()];
        assert!(bash.contains("README") && bash.contains("error"), "{bash}");
        let read = &html[html.find("<b>Read</b>").unwrap()..];
        let read = &read[..read.find("</details>").unwrap()];
        assert!(read.contains("fn main") && read.contains(">ok<"), "{read}");
        assert!(html.contains("all good"));
    }

    #[test]
    fn a_diff_marks_additions_and_removals_and_escapes_them() {
        let html = diff("diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-<old>\n+new\n same");
        assert!(
            html.contains("<span class=dr>-&lt;old&gt;</span>"),
            "{html}"
        );
        assert!(html.contains("<span class=da>+new</span>"));
        assert!(html.contains("<span class=dh>+++ b/x</span>"));
        assert!(html.contains("<span class=dk>@@"));
        assert!(html.contains("\n same\n"));
    }
}
