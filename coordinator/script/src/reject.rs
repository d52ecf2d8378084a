//! Why an `agent()` (or a combinator, or `workflow()`) call rejects: the `code` of the error
//! the script catches (W24). One list for the Rust side and the prelude, which gets it as
//! `host.codes` and throws only codes from it.

/// The code of a rejected call, as the script sees it in `e.code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectCode {
    /// A structured result never validated within the submission limit.
    SchemaFailed,
    /// The call's `schema` is not a JSON Schema this runtime accepts.
    SchemaInvalid,
    InvalidOption,
    InvalidPrompt,
    InvalidArgument,
    /// The backend says the task cannot run as asked (unknown agent type, bad cwd, …).
    InvalidAgent,
    UnknownAgentType,
    /// Every attempt stalled (W58).
    Stalled,
    /// The run's `--max-agents` is reached.
    AgentCap,
    BudgetExceeded,
    /// The prompt and options are too big for one call.
    TooLarge,
    /// `parallel()`/`pipeline()` over more items than a run takes at once.
    TooManyItems,
    WorkflowNotFound,
    WorkflowSyntax,
    WorkflowNested,
    /// A nondeterministic builtin (W07).
    Nondeterministic,
    /// The run's namespace has used up a daily quota (agents, tokens or money).
    QuotaExceeded,
}

impl RejectCode {
    pub const ALL: [RejectCode; 17] = [
        RejectCode::SchemaFailed,
        RejectCode::SchemaInvalid,
        RejectCode::InvalidOption,
        RejectCode::InvalidPrompt,
        RejectCode::InvalidArgument,
        RejectCode::InvalidAgent,
        RejectCode::UnknownAgentType,
        RejectCode::Stalled,
        RejectCode::AgentCap,
        RejectCode::BudgetExceeded,
        RejectCode::TooLarge,
        RejectCode::TooManyItems,
        RejectCode::WorkflowNotFound,
        RejectCode::WorkflowSyntax,
        RejectCode::WorkflowNested,
        RejectCode::Nondeterministic,
        RejectCode::QuotaExceeded,
    ];

    /// As the script sees it.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectCode::SchemaFailed => "SCHEMA_FAILED",
            RejectCode::SchemaInvalid => "SCHEMA_INVALID",
            RejectCode::InvalidOption => "INVALID_OPTION",
            RejectCode::InvalidPrompt => "INVALID_PROMPT",
            RejectCode::InvalidArgument => "INVALID_ARGUMENT",
            RejectCode::InvalidAgent => "INVALID_AGENT",
            RejectCode::UnknownAgentType => "UNKNOWN_AGENT_TYPE",
            RejectCode::Stalled => "STALLED",
            RejectCode::AgentCap => "AGENT_CAP",
            RejectCode::BudgetExceeded => "BUDGET_EXCEEDED",
            RejectCode::TooLarge => "TOO_LARGE",
            RejectCode::TooManyItems => "TOO_MANY_ITEMS",
            RejectCode::WorkflowNotFound => "WORKFLOW_NOT_FOUND",
            RejectCode::WorkflowSyntax => "WORKFLOW_SYNTAX",
            RejectCode::WorkflowNested => "WORKFLOW_NESTED",
            RejectCode::Nondeterministic => "NONDETERMINISTIC",
            RejectCode::QuotaExceeded => "QUOTA_EXCEEDED",
        }
    }
}

impl std::fmt::Display for RejectCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_the_prelude_throws_is_one_of_these_and_each_is_spelled_once() {
        let prelude = include_str!("prelude.js");
        let known: std::collections::HashSet<&str> =
            RejectCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            known.len(),
            RejectCode::ALL.len(),
            "two codes share a spelling"
        );
        let mut used = 0;
        for part in prelude.split("CODES.").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || *c == '_')
                .collect();
            assert!(
                known.contains(name.as_str()),
                "prelude.js throws {name}, which is not a RejectCode"
            );
            used += 1;
        }
        assert!(
            used >= 8,
            "the prelude takes its codes from CODES ({used} uses)"
        );
        // No code spelled out as a literal there any more.
        for c in RejectCode::ALL {
            assert!(
                !prelude.contains(&format!("'{}'", c.as_str())),
                "prelude.js spells {c} itself"
            );
        }
    }
}
