//! The call spec of one `agent()` call: its options, normalized, and its identity.
//!
//! - [`CallSpec::parse`] reads the options object a script passed. Known options are checked
//!   (a bad value rejects the call with a message naming the option); unknown options are
//!   ignored, so scripts written for Claude Code keep running (W22).
//! - [`CallSpec::content_hash`] hashes everything that decides what the agent does — prompt,
//!   backend, model, effort, agent type, schema, isolation, cwd, tools, timeout — and leaves
//!   out display-only options (`label`, `phase`). The call key is that hash plus the number
//!   of earlier calls with the same hash in the run ([`call_key`]), so identical calls in one
//!   run stay distinct.
//! - [`CallSpec::prefix_group`] is what two calls must share to share a prompt-cache prefix
//!   (W60): everything above except the prompt.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// Version tag of call keys; bump it only with a migration for stored journals.
pub const KEY_VERSION: &str = "v1";
/// Characters of the prompt used for a default label.
pub const LABEL_CHARS: usize = 60;
const EFFORTS: [&str; 5] = ["low", "medium", "high", "xhigh", "max"];

/// Why a call's options were refused; each message names the option and what it takes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    #[error("agent() options must be an object")]
    NotAnObject,
    #[error("agent() option `{option}` must be a string, got {got}")]
    NotAString {
        option: &'static str,
        got: &'static str,
    },
    #[error("agent() option `effort` must be one of {}, got {given:?}", EFFORTS.join(", "), given = .0)]
    Effort(String),
    #[error("agent() option isolation: 'remote' is unavailable; use 'worktree' or leave it out")]
    RemoteIsolation,
    #[error("agent() option `isolation` must be 'worktree', got {0:?}")]
    Isolation(String),
    #[error("agent() option `tools` must be a list of tool names, found {0}")]
    ToolName(&'static str),
    #[error("agent() option `tools` must be a list of tool names, got {0}")]
    Tools(&'static str),
    #[error(
        "agent() option `timeout` must be a positive number of milliseconds or a duration like '5m'"
    )]
    TimeoutNumber,
    #[error(
        "agent() option `timeout` {given:?} is not a duration ({reason}); use e.g. '90s' or '5m'"
    )]
    TimeoutDuration { given: String, reason: String },
    #[error("agent() option `timeout` must be milliseconds or a duration string, got {0}")]
    Timeout(&'static str),
    #[error(
        "agent() option `placement` must be {{ labels: {{ KEY: 'VALUE', ... }} }} (the labels a worker must carry): {0}"
    )]
    Placement(String),
}

impl SpecError {
    /// Every refusal is the script's to fix.
    pub fn kind(&self) -> flotilla_proto::ErrorKind {
        flotilla_proto::ErrorKind::Invalid
    }
}

/// The normalized options of one call.
#[derive(Debug, Clone, PartialEq)]
pub struct CallSpec {
    pub prompt: String,
    pub label: String,
    pub backend: String,
    pub model: String,
    pub effort: String,
    pub agent_type: String,
    pub schema: Option<Value>,
    pub isolation: String,
    pub cwd: String,
    pub tools: Vec<String>,
    pub timeout_ms: u64,
    /// Labels the worker must carry (`placement.labels`, EXT); not part of the call's key:
    /// where an agent runs does not change what it does.
    pub placement: std::collections::BTreeMap<String, String>,
    /// The options object as given, unknown options included.
    pub options: Map<String, Value>,
}

/// `placement: { labels: { KEY: 'VALUE' } }`, checked.
fn placement(v: Option<&Value>) -> Result<std::collections::BTreeMap<String, String>, SpecError> {
    let mut out = std::collections::BTreeMap::new();
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(out);
    };
    let Value::Object(p) = v else {
        return Err(SpecError::Placement(format!("got {}", json_kind(v))));
    };
    if let Some(other) = p.keys().find(|k| *k != "labels") {
        return Err(SpecError::Placement(format!("unknown key {other:?}")));
    }
    match p.get("labels") {
        None | Some(Value::Null) => {}
        Some(Value::Object(labels)) => {
            for (k, v) in labels {
                let Value::String(v) = v else {
                    return Err(SpecError::Placement(format!(
                        "label {k:?} must be a string, got {}",
                        json_kind(v)
                    )));
                };
                if !crate::settings::valid_label_key(k) || !crate::settings::valid_label_value(v) {
                    return Err(SpecError::Placement(format!(
                        "{k:?}={v:?} is not a label (keys: lower-case letters, digits, - _ . /; values: up to 256 printable characters)"
                    )));
                }
                out.insert(k.clone(), v.clone());
            }
        }
        Some(other) => {
            return Err(SpecError::Placement(format!(
                "labels must be an object, got {}",
                json_kind(other)
            )));
        }
    }
    Ok(out)
}

impl CallSpec {
    /// Reads a call's options. `backend` and `default_model` come from the run settings.
    pub fn parse(
        prompt: String,
        opts_json: &str,
        backend: &str,
        default_model: &str,
    ) -> Result<CallSpec, SpecError> {
        let options: Map<String, Value> = match serde_json::from_str(opts_json) {
            Ok(Value::Object(m)) => m,
            Ok(_) | Err(_) => return Err(SpecError::NotAnObject),
        };
        let string = |option: &'static str| -> Result<Option<String>, SpecError> {
            match options.get(option) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(SpecError::NotAString {
                    option,
                    got: json_kind(other),
                }),
            }
        };
        let label = string("label")?
            .filter(|l| !l.trim().is_empty())
            .unwrap_or_else(|| default_label(&prompt));
        let model = string("model")?
            .filter(|m| !m.is_empty() && m != "inherit")
            .unwrap_or_else(|| default_model.to_owned());
        let effort = string("effort")?.unwrap_or_default();
        if !effort.is_empty() && !EFFORTS.contains(&effort.as_str()) {
            return Err(SpecError::Effort(effort));
        }
        let agent_type = string("agentType")?.unwrap_or_default();
        let isolation = string("isolation")?.unwrap_or_default();
        match isolation.as_str() {
            "" | "worktree" => {}
            "remote" => return Err(SpecError::RemoteIsolation),
            other => return Err(SpecError::Isolation(other.to_owned())),
        }
        let cwd = string("cwd")?.unwrap_or_default();
        let tools = match options.get("tools") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => {
                let mut tools = Vec::with_capacity(items.len());
                for item in items {
                    match item {
                        Value::String(s) => tools.push(s.clone()),
                        other => return Err(SpecError::ToolName(json_kind(other))),
                    }
                }
                tools
            }
            Some(other) => return Err(SpecError::Tools(json_kind(other))),
        };
        let timeout_ms = match options.get("timeout") {
            None | Some(Value::Null) => 0,
            Some(Value::Number(n)) => match n.as_f64() {
                Some(ms) if ms > 0.0 && ms.is_finite() => ms.round() as u64,
                _ => return Err(SpecError::TimeoutNumber),
            },
            Some(Value::String(s)) => humantime::parse_duration(s)
                .map(|d| d.as_millis() as u64)
                .map_err(|e| SpecError::TimeoutDuration {
                    given: s.clone(),
                    reason: e.to_string(),
                })?,
            Some(other) => return Err(SpecError::Timeout(json_kind(other))),
        };
        let schema = match options.get("schema") {
            None | Some(Value::Null) => None,
            Some(s) => Some(s.clone()),
        };
        let placement = placement(options.get("placement"))?;
        Ok(CallSpec {
            prompt,
            label,
            placement,
            backend: backend.to_owned(),
            model,
            effort,
            agent_type,
            schema,
            isolation,
            cwd,
            tools,
            timeout_ms,
            options,
        })
    }

    /// What decides what the agent does besides its prompt, as the JSON that call keys hash:
    /// the same bytes as ever (keys in this order, compact), written without building a
    /// `Value` first (it runs once per call, a hundred thousand times on a big resume).
    fn identity_bytes(&self) -> Vec<u8> {
        #[derive(serde::Serialize)]
        struct Identity<'a> {
            backend: &'a str,
            model: &'a str,
            effort: &'a str,
            #[serde(rename = "agentType")]
            agent_type: &'a str,
            schema: Option<Value>,
            isolation: &'a str,
            cwd: &'a str,
            tools: Vec<&'a str>,
            timeout: u64,
        }
        let mut tools: Vec<&str> = self.tools.iter().map(String::as_str).collect();
        tools.sort_unstable();
        let id = Identity {
            backend: &self.backend,
            model: &self.model,
            effort: &self.effort,
            agent_type: &self.agent_type,
            schema: self.schema.as_ref().map(canonical),
            isolation: &self.isolation,
            cwd: &self.cwd,
            tools,
            timeout: self.timeout_ms,
        };
        serde_json::to_vec(&id).unwrap_or_default()
    }

    /// Hash of everything that decides what the agent does (not `label`, not `phase`).
    pub fn content_hash(&self) -> String {
        let mut h = Sha256::new();
        h.update(KEY_VERSION.as_bytes());
        h.update([0]);
        h.update(self.prompt.as_bytes());
        h.update([0]);
        h.update(self.identity_bytes());
        hex::encode(&h.finalize()[..16])
    }

    /// Hash of what calls must share to share a prompt-cache prefix (W60).
    pub fn prefix_group(&self) -> u64 {
        let digest = Sha256::digest(self.identity_bytes());
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(bytes)
    }
}

/// The call key of the `occurrence`-th (0-based) call with this content hash in a run.
pub fn call_key(content_hash: &str, occurrence: u32) -> String {
    format!("{KEY_VERSION}:{content_hash}:{occurrence}")
}

/// The default label: the first [`LABEL_CHARS`] characters of the prompt, whitespace collapsed.
pub fn default_label(prompt: &str) -> String {
    let collapsed = prompt.split_whitespace().collect::<Vec<_>>().join(" ");
    collapsed.chars().take(LABEL_CHARS).collect()
}

/// JSON with object keys sorted at every level, so equal schemas hash equally.
pub(crate) fn canonical(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<_> = m.keys().collect();
            keys.sort();
            let mut out = Map::new();
            for k in keys {
                out.insert(k.clone(), canonical(&m[k]));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_labels_are_read_checked_and_left_out_of_the_key() {
        let placed = spec(
            "p",
            r#"{"placement": {"labels": {"gpu": "h100", "region": "eu"}}}"#,
        );
        assert_eq!(
            placed.placement.get("gpu").map(String::as_str),
            Some("h100")
        );
        assert_eq!(placed.placement.len(), 2);
        assert_eq!(
            placed.content_hash(),
            spec("p", "{}").content_hash(),
            "where an agent runs does not change what it does"
        );
        for bad in [
            r#"{"placement": "gpu"}"#,
            r#"{"placement": {"labels": {"gpu": 1}}}"#,
            r#"{"placement": {"labels": ["gpu"]}}"#,
            r#"{"placement": {"label": {"gpu": "x"}}}"#,
            r#"{"placement": {"labels": {"GPU!": "x"}}}"#,
        ] {
            let e = CallSpec::parse("p".into(), bad, "echo", "").unwrap_err();
            assert!(e.to_string().contains("option `placement`"), "{bad}: {e}");
        }
    }

    fn spec(prompt: &str, opts: &str) -> CallSpec {
        CallSpec::parse(prompt.into(), opts, "echo", "").unwrap()
    }

    /// Call keys already in journals must keep matching: the identity is byte for byte the
    /// JSON object it has always been.
    #[test]
    fn the_identity_is_the_json_object_keys_were_always_hashed_from() {
        for opts in [
            "{}",
            r#"{"model": "opus", "effort": "high", "agentType": "reviewer", "isolation": "worktree", "cwd": "sub/dir", "tools": ["Write", "Bash", "Read"], "timeout": 90000, "schema": {"type": "object", "required": ["b", "a"], "properties": {"z": {"type": "string", "description": "quote \" and \u00e9"}, "a": {"type": "number"}}}}"#,
            r#"{"timeout": "2m", "schema": true}"#,
        ] {
            let s = spec("p", opts);
            let mut tools = s.tools.clone();
            tools.sort();
            let reference = serde_json::json!({
                "backend": s.backend,
                "model": s.model,
                "effort": s.effort,
                "agentType": s.agent_type,
                "schema": s.schema.as_ref().map(canonical),
                "isolation": s.isolation,
                "cwd": s.cwd,
                "tools": tools,
                "timeout": s.timeout_ms,
            })
            .to_string();
            assert_eq!(
                String::from_utf8(s.identity_bytes()).unwrap(),
                reference,
                "{opts}"
            );
        }
    }

    #[test]
    fn display_options_do_not_change_identity() {
        let a = spec("review x", r#"{"label": "one", "phase": "Scan"}"#);
        let b = spec(
            "review x",
            r#"{"label": "two", "phase": "Other", "unknownOption": 3}"#,
        );
        assert_eq!(a.content_hash(), b.content_hash());
        let c = spec("review x", r#"{"model": "opus"}"#);
        assert_ne!(a.content_hash(), c.content_hash());
        let d = spec("review y", "{}");
        assert_ne!(a.content_hash(), d.content_hash());
        assert_eq!(a.prefix_group(), d.prefix_group());
        assert_ne!(a.prefix_group(), c.prefix_group());
    }

    #[test]
    fn schema_key_order_does_not_matter() {
        let a = spec(
            "p",
            r#"{"schema": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}}"#,
        );
        let b = spec(
            "p",
            r#"{"schema": {"properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "type": "object"}}"#,
        );
        assert_eq!(a.content_hash(), b.content_hash());
    }

    #[test]
    fn bad_values_of_known_options_are_refused_by_name() {
        let refused = |opts: &str| CallSpec::parse("p".into(), opts, "echo", "").unwrap_err();
        let e = refused(r#"{"effort": "fast"}"#);
        assert_eq!(e, SpecError::Effort("fast".into()));
        assert!(
            e.to_string()
                .contains("`effort` must be one of low, medium"),
            "{e}"
        );
        assert_eq!(
            refused(r#"{"isolation": "remote"}"#),
            SpecError::RemoteIsolation
        );
        assert_eq!(
            refused(r#"{"isolation": "vm"}"#),
            SpecError::Isolation("vm".into())
        );
        assert_eq!(
            refused(r#"{"tools": "Bash"}"#),
            SpecError::Tools("a string")
        );
        assert_eq!(
            refused(r#"{"tools": ["Bash", 1]}"#),
            SpecError::ToolName("a number")
        );
        let e = refused(r#"{"model": 3}"#);
        assert_eq!(
            e,
            SpecError::NotAString {
                option: "model",
                got: "a number"
            }
        );
        assert_eq!(
            e.to_string(),
            "agent() option `model` must be a string, got a number"
        );
        assert_eq!(refused(r#"{"timeout": -1}"#), SpecError::TimeoutNumber);
        assert!(matches!(
            refused(r#"{"timeout": "soon"}"#),
            SpecError::TimeoutDuration { .. }
        ));
        assert_eq!(
            refused(r#"{"timeout": true}"#),
            SpecError::Timeout("a boolean")
        );
        assert_eq!(refused("[1]"), SpecError::NotAnObject);
        assert_eq!(e.kind(), flotilla_proto::ErrorKind::Invalid);
        assert_eq!(spec("p", r#"{"timeout": "2s"}"#).timeout_ms, 2000);
        assert_eq!(spec("p", r#"{"timeout": 150}"#).timeout_ms, 150);
    }

    #[test]
    fn default_label_collapses_whitespace_and_truncates() {
        assert_eq!(default_label("  find\n\n bugs\tin  x "), "find bugs in x");
        let long = "a ".repeat(100);
        assert_eq!(default_label(&long).chars().count(), LABEL_CHARS);
        assert_eq!(spec("hello world", "{}").label, "hello world");
        assert_eq!(spec("hello", r#"{"label": "mine"}"#).label, "mine");
    }

    #[test]
    fn keys_carry_version_and_occurrence() {
        let h = spec("p", "{}").content_hash();
        assert_eq!(call_key(&h, 0), format!("v1:{h}:0"));
        assert_ne!(call_key(&h, 0), call_key(&h, 1));
    }
}
