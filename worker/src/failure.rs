//! How one attempt failed: a [`FailureKind`] and a message, what the provider asked to wait,
//! and what the attempt used before it failed.
//!
//! A leaf: the backends, the sandbox and the source checkout all fail with it, without any of
//! them importing another.

use std::time::Duration;

use flotilla_proto::v1::{self, FailureKind};

/// A classified failure of one attempt.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    pub kind: FailureKind,
    pub message: String,
    pub retry_after: Option<Duration>,
    pub usage: v1::Usage,
    /// The agent's conversation so far, for the call's next attempt to continue.
    pub session: Option<Box<v1::Session>>,
}

impl Error {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            retry_after: None,
            usage: v1::Usage::default(),
            session: None,
        }
    }

    pub fn cancelled(reason: &str) -> Self {
        Error::new(FailureKind::Cancelled, format!("cancelled: {reason}"))
    }

    pub fn rate_limited(retry_after: Duration, message: impl Into<String>) -> Self {
        Error {
            retry_after: Some(retry_after),
            ..Error::new(FailureKind::RateLimited, message)
        }
    }

    /// The provider refused for rate or load (429, 529, overloaded): the call waits
    /// `retry_after` (the coordinator's backoff when `None`) and its account admits fewer.
    pub fn throttled(retry_after: Option<Duration>, message: impl Into<String>) -> Self {
        Error {
            retry_after,
            ..Error::new(FailureKind::Throttled, message)
        }
    }
}
