//! `flotilla-proto`: everything both ends of a Flotilla connection must agree on.
//!
//! - [`v1`]: the generated protocol (`proto/flotilla.proto`): the worker stream messages and
//!   the `WorkerService`. The embedded mode passes the same messages over in-process channels.
//! - [`frag`]: the size limits of the worker stream, and the fragments big messages travel in.
//! - [`schema`]: the JSON Schema rules of structured results (W13–W15): preflight of a schema
//!   before any agent starts, and validation of a submission. The coordinator preflights, the
//!   worker validates each submission; both use this module so they cannot disagree.
//! - [`wire`]: the JSON shapes that cross the wire besides the messages: the run report and
//!   a run's live view.
//! - [`ErrorKind`]: the small classification every crate's errors map to, and the one place
//!   where a kind becomes an exit status or (later) a `tonic::Code`.
//!
//! Start with `proto/flotilla.proto`.

pub mod clock;
pub mod exposition;
pub mod frag;
pub mod histogram;
pub mod link;
pub mod names;
mod problem;
pub mod schema;
pub mod settings;
pub mod tls;
pub mod usage;
pub mod wire;
pub use problem::Problem;

/// What became of the process's trace export (`flotilla_trace_*` in its metrics).
pub mod traces {
    use std::sync::atomic::AtomicU64;

    /// Batches of spans the OTLP exporter could not deliver, and the spans in them.
    pub static EXPORT_FAILURES: AtomicU64 = AtomicU64::new(0);
    pub static SPANS_DROPPED: AtomicU64 = AtomicU64::new(0);
    /// Spans delivered.
    pub static SPANS_EXPORTED: AtomicU64 = AtomicU64::new(0);
    /// An OTLP meter provider is installed: the OpenTelemetry instruments are worth recording
    /// (otherwise their attributes are not even made).
    pub static METRICS_ON: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}

/// Which build this process runs, for `--version` and the `build_info` metrics.
pub mod build {
    use std::sync::OnceLock;

    static COMMIT: OnceLock<&'static str> = OnceLock::new();

    /// The binary records its commit at startup (its build script reads it from git).
    pub fn set_commit(commit: &'static str) {
        let _ = COMMIT.set(commit);
    }

    /// The commit, or `unknown` (built outside a git checkout, or a library's tests).
    pub fn commit() -> &'static str {
        COMMIT
            .get()
            .copied()
            .filter(|c| !c.is_empty())
            .unwrap_or("unknown")
    }
}

/// Generated protocol types, version 1.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    tonic::include_proto!("flotilla.v1");
}

impl v1::FailureKind {
    /// The kind as the `class` label of the attempt counters (coordinator and worker).
    pub fn class(self) -> &'static str {
        use v1::FailureKind as K;
        match self {
            K::Unspecified | K::Terminal => "terminal",
            K::Retryable => "transient",
            K::RateLimited => "rate_limited",
            K::Schema => "schema",
            K::Invalid => "invalid",
            K::Cancelled => "cancelled",
            K::Timeout => "timeout",
            K::Throttled => "throttled",
            K::Setup => "setup",
        }
    }
}

/// Version of the worker protocol spoken by this build. The coordinator refuses a worker
/// whose major version differs.
pub const PROTOCOL_VERSION: &str = "1.3";

/// Returns true when a peer speaking `theirs` can talk to this build.
pub fn protocol_compatible(theirs: &str) -> bool {
    let major = |v: &str| v.split('.').next().map(str::to_owned);
    major(theirs).is_some() && major(theirs) == major(PROTOCOL_VERSION)
}

/// The coarse class of an error, shared by every crate: it decides retries, exit statuses and
/// (for the network API) status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The thing asked for does not exist (a run, a saved workflow).
    NotFound,
    /// It exists but is in a state that forbids the request.
    Conflict,
    /// A dependency is down; retrying later can succeed.
    Unavailable,
    /// The caller's lease or attempt is no longer current.
    Fenced,
    /// The request itself is wrong (bad script, bad flag, bad option).
    Invalid,
    /// The caller may not do this (its certificate's role, a token that does not verify).
    Denied,
    /// A bug or an unexpected failure.
    Internal,
    /// The peer was not reached: no connection, or no handshake (refused, no such host, timed
    /// out, a certificate either side would not take). Nothing was asked of it, so nothing
    /// happened there. Made only where a call is sent; on the wire it is `Unavailable`.
    Unreachable,
}

impl ErrorKind {
    /// Its name in JSON (`error.code` of a refusal a command prints with `--json`).
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Fenced => "fenced",
            ErrorKind::Invalid => "invalid",
            ErrorKind::Denied => "denied",
            ErrorKind::Internal => "internal",
            ErrorKind::Unreachable => "unreachable",
        }
    }

    /// Whether retrying the same request later can succeed.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::Unavailable | ErrorKind::Unreachable)
    }

    /// The process exit status a CLI command uses for an error of this kind: 2 for requests
    /// that were refused as given (fix the request), 3 when the coordinator was not reached
    /// (nothing happened there: check the address, that it runs, the certificates), 1
    /// otherwise (0 and 1 are also a run's completed and failed).
    pub fn exit_code(self) -> i32 {
        match self {
            ErrorKind::Invalid | ErrorKind::NotFound | ErrorKind::Conflict => 2,
            ErrorKind::Unreachable => 3,
            _ => 1,
        }
    }

    /// The gRPC status code of this kind.
    pub fn grpc_code(self) -> tonic::Code {
        match self {
            ErrorKind::NotFound => tonic::Code::NotFound,
            ErrorKind::Conflict => tonic::Code::FailedPrecondition,
            ErrorKind::Unavailable | ErrorKind::Unreachable => tonic::Code::Unavailable,
            ErrorKind::Fenced => tonic::Code::Aborted,
            ErrorKind::Invalid => tonic::Code::InvalidArgument,
            ErrorKind::Denied => tonic::Code::PermissionDenied,
            ErrorKind::Internal => tonic::Code::Internal,
        }
    }

    /// A gRPC status of this kind saying `message`.
    pub fn status(self, message: impl Into<String>) -> tonic::Status {
        tonic::Status::new(self.grpc_code(), message)
    }

    /// The HTTP status code of this kind.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorKind::NotFound => 404,
            ErrorKind::Conflict | ErrorKind::Fenced => 409,
            ErrorKind::Unavailable | ErrorKind::Unreachable => 503,
            ErrorKind::Invalid => 400,
            ErrorKind::Denied => 403,
            ErrorKind::Internal => 500,
        }
    }

    /// The kind of a failed call this process made: `Unreachable` when the peer never heard
    /// it ([`tls::not_reached`]), else the kind of the status it sent.
    pub fn of_call(status: &tonic::Status) -> ErrorKind {
        if tls::not_reached(status) {
            ErrorKind::Unreachable
        } else {
            ErrorKind::from_grpc(status.code())
        }
    }

    /// The kind of a gRPC status a peer sent (a transport failure is `Unavailable`; see
    /// [`ErrorKind::of_call`] for a call this process made).
    pub fn from_grpc(code: tonic::Code) -> ErrorKind {
        use tonic::Code;
        match code {
            Code::NotFound => ErrorKind::NotFound,
            Code::FailedPrecondition | Code::AlreadyExists => ErrorKind::Conflict,
            Code::Aborted => ErrorKind::Fenced,
            Code::InvalidArgument | Code::OutOfRange => ErrorKind::Invalid,
            Code::PermissionDenied | Code::Unauthenticated => ErrorKind::Denied,
            Code::Unavailable
            | Code::Unknown
            | Code::Cancelled
            | Code::DeadlineExceeded
            | Code::ResourceExhausted => ErrorKind::Unavailable,
            _ => ErrorKind::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_major_must_match() {
        assert!(protocol_compatible("1.0"));
        assert!(protocol_compatible("1.7"));
        assert!(!protocol_compatible("2.0"));
        assert!(!protocol_compatible(""));
    }

    #[test]
    fn every_kind_goes_through_grpc_and_back_unchanged() {
        for k in [
            ErrorKind::NotFound,
            ErrorKind::Conflict,
            ErrorKind::Unavailable,
            ErrorKind::Fenced,
            ErrorKind::Invalid,
            ErrorKind::Denied,
            ErrorKind::Internal,
        ] {
            let s = k.status("why");
            assert_eq!(ErrorKind::from_grpc(s.code()), k, "{k:?}");
            assert_eq!(ErrorKind::of_call(&s), k, "a status a peer sent: {k:?}");
            assert_eq!(s.message(), "why");
            assert!((400..600).contains(&k.http_status()), "{k:?}");
        }
        assert_eq!(
            ErrorKind::from_grpc(tonic::Code::Unknown),
            ErrorKind::Unavailable,
            "a broken connection is worth retrying"
        );
        assert_eq!(ErrorKind::Conflict.exit_code(), 2);
        assert_eq!(ErrorKind::Denied.exit_code(), 1);
        // Made only where a call is sent: whoever hears of it over the wire hears Unavailable.
        let s = ErrorKind::Unreachable.status("why");
        assert_eq!(ErrorKind::from_grpc(s.code()), ErrorKind::Unavailable);
    }

    /// A call to a port nothing listens on never reaches a peer: its own kind and exit status
    /// (not a failed run's 1, not a refused request's 2), and words without tonic's debug form
    /// that say what to check.
    #[tokio::test]
    async fn a_call_that_reaches_no_coordinator_is_unreachable_and_says_what_to_check() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let channel = tls::channel(&address, None).unwrap();
        let mut client = v1::client_service_client::ClientServiceClient::new(channel);
        let status = client
            .ping(v1::PingRequest::default())
            .await
            .expect_err("nothing listens there");
        assert_eq!(ErrorKind::of_call(&status), ErrorKind::Unreachable);
        assert_eq!(ErrorKind::Unreachable.exit_code(), 3);
        assert_eq!(ErrorKind::Unreachable.name(), "unreachable");
        let said = tls::explain_at(&status, Some(&address));
        assert!(
            said.starts_with(&format!("cannot reach the coordinator at {address}")),
            "{said}"
        );
        assert!(said.contains("check that the coordinator runs"), "{said}");
        for debug in ["tonic::", "ConnectError(", "Os {", "code: '"] {
            assert!(!said.contains(debug), "{debug}: {said}");
        }
    }

    #[test]
    fn refused_requests_exit_with_two() {
        assert_eq!(ErrorKind::Invalid.exit_code(), 2);
        assert_eq!(ErrorKind::NotFound.exit_code(), 2);
        assert_eq!(ErrorKind::Internal.exit_code(), 1);
        assert!(ErrorKind::Unavailable.is_retryable());
        assert!(!ErrorKind::Invalid.is_retryable());
    }
}
