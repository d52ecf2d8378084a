//! [`Problem`]: an error that says what went wrong and of which [`ErrorKind`] it is, for code
//! whose failures are a message to a person (a bad option, a file too large, a git command
//! that failed). The kind travels with the message, so whoever shows it — a gRPC status, a page,
//! the CLI's exit status and `--json` code — maps it the one way [`ErrorKind`] does, and never
//! has to guess it from the text.

use crate::ErrorKind;

/// What went wrong, said for a person, and its kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub kind: ErrorKind,
    pub message: String,
}

impl Problem {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Problem {
        Problem {
            kind,
            message: message.into(),
        }
    }

    /// The request as given is wrong (a bad option, too large, not allowed by its shape).
    pub fn invalid(message: impl Into<String>) -> Problem {
        Problem::new(ErrorKind::Invalid, message)
    }

    /// Something this process needs failed; trying again later may work.
    pub fn unavailable(message: impl Into<String>) -> Problem {
        Problem::new(ErrorKind::Unavailable, message)
    }

    /// The thing asked for is not there.
    pub fn not_found(message: impl Into<String>) -> Problem {
        Problem::new(ErrorKind::NotFound, message)
    }

    /// The caller may not do this.
    pub fn denied(message: impl Into<String>) -> Problem {
        Problem::new(ErrorKind::Denied, message)
    }

    /// Something failed that should not have (a tool this process runs, a bug).
    pub fn internal(message: impl Into<String>) -> Problem {
        Problem::new(ErrorKind::Internal, message)
    }

    /// The same problem with `context` said first (`context: message`).
    pub fn context(self, context: impl std::fmt::Display) -> Problem {
        Problem {
            message: format!("{context}: {}", self.message),
            ..self
        }
    }

    /// Its gRPC status.
    pub fn status(&self) -> tonic::Status {
        self.kind.status(self.message.clone())
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Problem {}

impl From<Problem> for tonic::Status {
    fn from(p: Problem) -> tonic::Status {
        p.kind.status(p.message)
    }
}

/// Where only words go on (a log line, a report's error text), the message.
impl From<Problem> for String {
    fn from(p: Problem) -> String {
        p.message
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_keeps_its_kind_through_context_and_onto_the_wire() {
        let p = Problem::not_found("no run wf_x").context("status");
        assert_eq!(p.kind, ErrorKind::NotFound);
        assert_eq!(p.to_string(), "status: no run wf_x");
        let s: tonic::Status = p.clone().into();
        assert_eq!(s.code(), tonic::Code::NotFound);
        assert_eq!(s.message(), "status: no run wf_x");
        assert_eq!(ErrorKind::of_call(&s), ErrorKind::NotFound);
        assert_eq!(String::from(p), "status: no run wf_x");
        assert_eq!(Problem::invalid("x").kind.exit_code(), 2);
        assert_eq!(Problem::unavailable("x").kind.exit_code(), 1);
    }
}
