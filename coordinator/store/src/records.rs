//! The JSON shapes Flotilla stores: the run manifest, completed-call records and run events.
//! They are read back by resume, `show` and (later) other coordinators, so fields are only
//! ever added, and readers ignore fields they do not know.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use flotilla_proto::settings::RunSettings;

/// `runs/{run}/run.json`: everything needed to reopen or resume a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub run_id: String,
    pub workflow: WorkflowInfo,
    pub script_sha256: String,
    /// Where the script came from (a path or a saved workflow's name), for display.
    #[serde(default)]
    pub script_origin: Option<String>,
    /// `args` as the launch gave them (JSON text, written as it is).
    #[serde(default)]
    pub args: Option<Box<serde_json::value::RawValue>>,
    pub settings: RunSettings,
    /// RFC 3339 time the run was created.
    pub created: String,
    #[serde(default)]
    pub parent_run_id: Option<String>,
    /// Owner generation that writes this run's segments.
    pub generation: u64,
    pub flotilla_version: String,
}

pub use flotilla_proto::wire::WorkflowInfo;

pub use flotilla_proto::usage::UsageRecord;

/// JSON kept as its text: checked to be JSON when it comes in, parsed only where something
/// looks into it (schema validation, the script's edge, a page). Results and transcript
/// events travel from the backend to the journal and the script as this.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RawJson(Box<serde_json::value::RawValue>);

/// Text [`RawJson::parse`] gives back because it is not JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotJson(pub String);

impl RawJson {
    /// `text` if it is JSON; otherwise it comes back ([`NotJson`]).
    pub fn parse(text: String) -> Result<RawJson, NotJson> {
        match serde_json::from_str::<&serde_json::value::RawValue>(&text) {
            Ok(_) => serde_json::value::RawValue::from_string(text)
                .map(RawJson)
                .map_err(|e| NotJson(e.to_string())),
            Err(_) => Err(NotJson(text)),
        }
    }

    /// `text` as a JSON string.
    pub fn string(text: &str) -> RawJson {
        RawJson(serde_json::value::to_raw_value(text).expect("a string is JSON"))
    }

    /// `text` if it is JSON, else `text` as a JSON string.
    pub fn or_string(text: String) -> RawJson {
        RawJson::parse(text).unwrap_or_else(|t| RawJson::string(&t.0))
    }

    /// Of a value.
    pub fn of(value: &Value) -> RawJson {
        RawJson(serde_json::value::to_raw_value(value).expect("a value is JSON"))
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// Parsed.
    pub fn value(&self) -> Value {
        serde_json::from_str(self.get()).unwrap_or(Value::Null)
    }
}

impl PartialEq for RawJson {
    fn eq(&self, other: &RawJson) -> bool {
        self.get() == other.get()
    }
}

/// One line of `runs/{run}/calls/*.jsonl`: an `agent()` call that completed with a value.
/// Calls that resolved `null` or rejected are not journaled, so they always run again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CallRecord {
    /// Start order of the call in its run (0-based): the order of `agent()` calls.
    pub index: u64,
    /// Content key: a hash of the normalized call spec plus its occurrence number.
    pub key: String,
    pub label: String,
    pub group: String,
    /// The value handed to the script (a string for text results), unless it is in `payload`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<RawJson>,
    /// sha256 of a large result stored under `payloads/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    #[serde(default)]
    pub usage: UsageRecord,
    pub attempts: u32,
    /// The run this result was first produced in, when it was served from a resume source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// What it changed in the run's source (fleet runs with a source).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub change: Option<ChangeRecord>,
}

/// One line of `runs/{run}/events/*.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EventRecord {
    /// Milliseconds since the run started.
    pub t: u64,
    #[serde(flatten)]
    pub event: RunEvent,
}

/// Things that happen in a run, in the order they happen.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RunEvent {
    Status {
        status: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    Group {
        title: String,
    },
    Log {
        line: String,
    },
    Failure {
        line: String,
    },
    /// A call's prompt, once, when the call is made (the session page shows it).
    Prompt {
        index: u64,
        prompt: String,
    },
    Call {
        index: u64,
        label: String,
        group: String,
        state: Mark,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attempt: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
    /// The run's end webhook was delivered, or given up (`--notify`).
    Notified {
        url: String,
        delivered: bool,
        attempts: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        status: Option<u16>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
}

pub use flotilla_proto::wire::ChangeRecord;

pub use flotilla_proto::wire::{AnswerRecord, Question, QuestionRecord};

#[cfg(test)]
mod raw_tests {
    use super::*;

    #[test]
    fn raw_json_is_checked_kept_as_written_and_read_back() {
        let r = RawJson::parse("{\"b\": 1,  \"a\": [true]}".into()).unwrap();
        assert_eq!(r.get(), "{\"b\": 1,  \"a\": [true]}", "kept as written");
        assert_eq!(r.value(), serde_json::json!({"b": 1, "a": [true]}));
        assert_eq!(RawJson::parse("not json".into()).unwrap_err().0, "not json");
        assert_eq!(
            RawJson::or_string("plain text".into()).get(),
            "\"plain text\""
        );
        let line = serde_json::to_string(&serde_json::json!({"x": 1})).unwrap();
        let back: RawJson = serde_json::from_str(&line).unwrap();
        assert_eq!(back, RawJson::of(&serde_json::json!({"x": 1})));
    }
}

/// What just happened to a call, as its run's event log spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mark {
    Queued,
    /// Served from the run it resumes.
    Cached,
    Running,
    Stalled,
    /// Rate limited: waits for the limit's reset.
    Waiting,
    Retrying,
    Restarted,
    /// Interrupted by a pause.
    Interrupted,
    Completed,
    Failed,
    /// Cut short by the run's stop or end (not a failure, W55).
    Cancelled,
    /// A mark written by a newer version.
    #[serde(other)]
    Other,
}

impl Mark {
    /// Its name as written in the events.
    pub fn as_str(self) -> &'static str {
        match self {
            Mark::Queued => "queued",
            Mark::Cached => "cached",
            Mark::Running => "running",
            Mark::Stalled => "stalled",
            Mark::Waiting => "waiting",
            Mark::Retrying => "retrying",
            Mark::Restarted => "restarted",
            Mark::Interrupted => "interrupted",
            Mark::Completed => "completed",
            Mark::Failed => "failed",
            Mark::Cancelled => "cancelled",
            Mark::Other => "other",
        }
    }
}
