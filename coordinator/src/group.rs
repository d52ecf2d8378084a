//! What a coordinator in a group claims on runs before it runs them (ownership, a resume's
//! hold on the run it resumes), and why a claim is refused.
//!
//! Below both the coordinator, which claims through [`RunClaims`], and the leader
//! ([`crate::leader::Leadership`]), which implements it over etcd: the coordinator does not
//! import the leader, which holds the coordinator.

use std::sync::Arc;

use crate::lease;

/// Why the fleet would not let this coordinator own, or resume, a run.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("run {run} is owned by another coordinator")]
    OwnedElsewhere { run: String },
    #[error(
        "run {run} is still live on the fleet (its coordinator runs it, or will adopt it); stop it with `flotilla stop {run}` and wait for its report, then resume"
    )]
    StillLive { run: String },
    #[error(
        "run {run} is being resumed already, by run {by}; wait for it to end (`flotilla wait {by}`) or stop it, or resume {by} instead"
    )]
    BeingResumed { run: String, by: String },
    #[error("{doing}: {source}")]
    Etcd {
        doing: String,
        #[source]
        source: lease::Error,
    },
}

impl ClaimError {
    pub fn kind(&self) -> flotilla_proto::ErrorKind {
        match self {
            ClaimError::Etcd { .. } => flotilla_proto::ErrorKind::Unavailable,
            _ => flotilla_proto::ErrorKind::Conflict,
        }
    }
}

/// The claims a coordinator in a group makes on runs.
#[async_trait::async_trait]
pub trait RunClaims: Send + Sync {
    /// Records this coordinator as the owner of `run`, which it is about to start.
    async fn own(&self, run: &str) -> Result<(), ClaimError>;
    /// Holds `parent` for `run`, which resumes it: no other run resumes it meanwhile.
    async fn claim_resume(&self, parent: &str, run: &str) -> Result<(), ClaimError>;
    /// Lets go of the hold [`RunClaims::claim_resume`] took (the resume did not start).
    async fn release_resume(&self, parent: &str, run: &str);
    /// The claims as `Any`, so the group's own type can be had back where it is known.
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
}
