//! What the gRPC faces are built from: how the coordinator listens ([`ServerOptions`]) and
//! what it lets clients start ([`LaunchPolicy`]).

use std::net::SocketAddr;
use std::sync::Arc;

use flotilla_proto::tls::TlsFiles;

/// How the coordinator listens.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub listen: SocketAddr,
    /// `None`: plain text (development only).
    pub tls: Option<TlsFiles>,
    /// Handshake and idle timeouts, connection limit.
    pub limits: crate::listen::ConnLimits,
    /// Base of session URLs (`http://host:port`).
    pub session_base: String,
    /// HTTP/2 keep-alive interval on every stream; the timeout is half again as long (a
    /// worker starved of CPU for a moment should not lose its link, and its attempts with it).
    pub keepalive: std::time::Duration,
    /// Signs session tokens for the pages (`None` without TLS).
    pub tokens: Option<crate::tokens::TokenKey>,
    /// Who may start what.
    pub policy: LaunchPolicy,
    /// The name other coordinators' certificates are checked for when a standby calls the
    /// leader (`--peer-name`); `None`: the host of the leader's advertised address.
    pub peer_name: Option<String>,
}

/// What a coordinator lets clients start.
#[derive(Clone)]
pub struct LaunchPolicy {
    /// Only saved workflows (pushed or bundled) run; inline scripts are refused (W46).
    pub saved_only: bool,
    /// Whether new runs are refused right now (W67); asked on every launch, so the switch
    /// can change while the coordinator runs. Runs in progress are never touched.
    pub disabled: Arc<dyn Fn() -> bool + Send + Sync>,
    /// Client certificate names that may push workflows (holders of a `coordinator`
    /// certificate always may); nobody else can change what `launch NAME` runs.
    pub publishers: Vec<String>,
    /// A push may take a bundled workflow's name.
    pub shadow_bundled: bool,
    /// Runs may name a source on the workers' own disks (`git+file://`, a path): the
    /// operator says its workers fetch them (`--allow-file-sources` on both).
    pub file_sources: bool,
}

impl Default for LaunchPolicy {
    fn default() -> Self {
        LaunchPolicy {
            saved_only: false,
            disabled: Arc::new(|| false),
            publishers: Vec::new(),
            shadow_bundled: false,
            file_sources: false,
        }
    }
}

impl std::fmt::Debug for LaunchPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchPolicy")
            .field("saved_only", &self.saved_only)
            .field("file_sources", &self.file_sources)
            .field("disabled", &(self.disabled)())
            .finish()
    }
}
