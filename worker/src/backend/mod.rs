//! The `AgentBackend` seam: run one attempt of one `agent()` call.
//!
//! A backend receives a [`Task`], reports progress and transcript events through [`Events`]
//! while it works, and returns an [`Output`] or a classified [`Error`]. It must return soon
//! after its cancel token fires (and leave no process behind). Structured results go through
//! [`Submissions`], which validates each submission against the task's schema and counts them
//! (W13–W14), so every backend shares one retry rule.
//!
//! Implementations: [`echo::Echo`] (deterministic, `spec/echo-backend.md`),
//! [`exec::Exec`] (any command), [`claude::ClaudeCode`] (the Claude Code CLI),
//! [`anthropic::Anthropic`] (the Messages API) and [`openai::OpenAi`] (a chat-completions
//! API); a worker and the embedded mode both make them by name with [`by_name`]. The worker
//! runs each attempt through [`run_attempt`], so every transcript ends the same way whatever
//! the backend. Every backend passes the conformance suite (`conformance.rs`).

pub mod anthropic;
pub mod claude;
#[cfg(test)]
mod conformance;
pub mod echo;
pub mod exec;
mod http;
pub mod lines;
pub mod openai;
mod procs;
mod seam;
pub mod session;

use flotilla_proto::Problem;
use std::sync::Arc;

pub use crate::failure::Error;
pub use seam::{
    AgentBackend, EventSink, Events, Output, Submissions, Submitted, Task, account_id, run_attempt,
};

/// The backends this build offers, by name.
pub const NAMES: [&str; 5] = ["echo", "exec", "claude-code", "anthropic", "openai"];

/// The backend called `name`; `exec_cmd` is the exec backend's command. The HTTP and CLI
/// backends read their endpoints and keys from the environment.
pub fn by_name(name: &str, exec_cmd: Option<&str>) -> Result<Arc<dyn AgentBackend>, Problem> {
    // The HTTP backends' clients need a TLS provider (idempotent).
    flotilla_proto::tls::install_crypto_provider();
    Ok(match name {
        "echo" => Arc::new(echo::Echo),
        "claude-code" => Arc::new(claude::ClaudeCode::from_env()),
        "anthropic" => Arc::new(anthropic::Anthropic::from_env()),
        "openai" => Arc::new(openai::OpenAi::from_env()),
        "exec" => match exec_cmd {
            Some(cmd) => Arc::new(exec::Exec::new(cmd.to_owned())),
            None => return Err(Problem::invalid("--backend exec needs --exec-cmd CMD")),
        },
        other => {
            return Err(Problem::invalid(format!(
                "unknown backend {other:?}: this worker offers {}",
                NAMES.join(", ")
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_proto::v1::FailureKind;
    use serde_json::json;

    #[test]
    fn submissions_stop_at_the_limit_with_the_last_failure() {
        let schema =
            json!({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]});
        let mut s = Submissions::new(&schema, 3).unwrap();
        assert!(matches!(s.submit(json!({})).unwrap(), Submitted::Retry(_)));
        assert!(matches!(s.submit(json!({})).unwrap(), Submitted::Retry(_)));
        let e = s.submit(json!({})).unwrap_err();
        assert_eq!(e.kind, FailureKind::Schema);
        assert!(e.message.contains("retry cap (3)"), "{}", e.message);
        assert!(e.message.contains("required"), "{}", e.message);
    }

    #[test]
    fn a_valid_submission_is_accepted() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "string"}}});
        let mut s = Submissions::new(&schema, 5).unwrap();
        assert!(matches!(
            s.submit(json!({"a": 1})).unwrap(),
            Submitted::Retry(_)
        ));
        assert_eq!(
            s.submit(json!({"a": "x"})).unwrap(),
            Submitted::Accepted(json!({"a": "x"}))
        );
        assert_eq!(s.made(), 2);
    }
}
