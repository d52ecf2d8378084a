//! What every page handler shares: the pages' state ([`Web`]), who they answer ([`Access`])
//! and the one map from an error's kind to its HTTP status. Of `web` it names only the live
//! parts' cache, which names nothing of it.

use std::sync::Arc;

use axum::http::StatusCode;
use flotilla_proto::ErrorKind;

use crate::coordinator::Coordinator;
use crate::registry::RunRegistry;
use crate::tokens::TokenKey;

/// Who the pages answer.
#[derive(Debug, Clone)]
pub enum Access {
    /// Session tokens from `flotilla token create` (the fleet).
    Tokens(TokenKey),
    /// A page on loopback without sign-in (an `--insecure` coordinator): only requests whose
    /// `Host` is this address, so a web page elsewhere cannot reach it by DNS rebinding.
    Loopback { port: u16 },
    /// `flotilla run --serve`: loopback `Host` only, and the run's random key, which the
    /// printed URL carries (`?key=`) and the first visit keeps in a cookie.
    Keyed { port: u16, key: String },
}

impl Access {
    pub(super) fn tokens(&self) -> Option<&TokenKey> {
        match self {
            Access::Tokens(k) => Some(k),
            _ => None,
        }
    }
}

/// What every page handler is given: the coordinator, its runs, and who may see them.
#[derive(Clone)]
pub(super) struct Web {
    pub(super) coordinator: Arc<Coordinator>,
    pub(super) registry: Arc<RunRegistry>,
    pub(super) access: Access,
    /// Run pages' live parts, rendered once per tick for all their readers.
    pub(super) live: Arc<super::live_cache::LiveCache>,
}

/// The HTTP status of an error of `kind` (the one map is [`ErrorKind`]).
pub(super) fn http(kind: ErrorKind) -> StatusCode {
    StatusCode::from_u16(kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}
