//! mTLS identities: loading certificates, building tonic TLS configs, and reading who a peer
//! is from its certificate.
//!
//! A Flotilla certificate names its holder in the subject CN and its role in the subject OU
//! (`coordinator`, `worker` or `client`); `flotilla certs` makes them. The coordinator accepts
//! only clients that present a certificate signed by its CA (client auth required), and each
//! service checks the role: only `worker` certificates may attach as workers, only `client`
//! (or `coordinator`) certificates may launch.
//!
//! The workspace uses one rustls crypto provider, ring; [`install_crypto_provider`] must run
//! before any TLS config is built (every binary's `main` calls it).

use crate::Problem;
use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// Installs ring as the process-wide rustls provider (idempotent).
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// What a certificate allows its holder to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Coordinator,
    Worker,
    Client,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Coordinator => "coordinator",
            Role::Worker => "worker",
            Role::Client => "client",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = crate::Problem;
    fn from_str(s: &str) -> Result<Self, Problem> {
        match s {
            "coordinator" => Ok(Role::Coordinator),
            "worker" => Ok(Role::Worker),
            "client" => Ok(Role::Client),
            other => Err(Problem::invalid(format!(
                "unknown role {other:?}: use coordinator, worker or client"
            ))),
        }
    }
}

/// A TLS problem, with the file and the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} {path} is not usable: {reason}; {hint}")]
    Invalid {
        what: &'static str,
        path: PathBuf,
        reason: String,
        hint: &'static str,
    },
    #[error("cannot read {what} {path}: {source}; {hint}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
        hint: String,
    },
}

/// The CA, certificate and key files of one identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// The files `flotilla certs` writes for `name` into `dir`.
    pub fn in_dir(dir: &Path, name: &str) -> TlsFiles {
        TlsFiles {
            ca: dir.join("ca.crt"),
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
        }
    }

    fn read(&self, what: &'static str, path: &Path) -> Result<Vec<u8>, Error> {
        std::fs::read(path).map_err(|source| Error::Read {
            what,
            path: path.to_owned(),
            source,
            hint: match what {
                "CA certificate" => {
                    "create a development CA with `flotilla certs init --dir DIR`".to_owned()
                }
                _ => "issue one with `flotilla certs issue --dir DIR --name NAME --role ROLE`, or pass --cert/--key".to_owned(),
            },
        })
    }

    fn identity(&self) -> Result<Identity, Error> {
        let cert = self.read("certificate", &self.cert)?;
        let key = self.read("private key", &self.key)?;
        Ok(Identity::from_pem(cert, key))
    }

    fn ca_cert(&self) -> Result<Certificate, Error> {
        Ok(Certificate::from_pem(
            self.read("CA certificate", &self.ca)?,
        ))
    }

    /// Server side: our identity, and client certificates required, signed by our CA.
    pub fn server_config(&self) -> Result<ServerTlsConfig, Error> {
        Ok(ServerTlsConfig::new()
            .identity(self.identity()?)
            .client_ca_root(self.ca_cert()?))
    }

    /// The same as [`TlsFiles::server_config`], as a rustls config for a listener that does its
    /// own handshakes (with a timeout; see the coordinator's `listen`): client certificates
    /// required and signed by our CA, HTTP/2 by ALPN.
    pub fn rustls_server_config(&self) -> Result<std::sync::Arc<rustls::ServerConfig>, Error> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        const FIX: &str =
            "make the files again with `flotilla certs init` and `flotilla certs issue`";
        let invalid = |what: &'static str, path: &Path, reason: String| Error::Invalid {
            what,
            path: path.to_owned(),
            reason,
            hint: FIX,
        };
        let ca = self.read("CA certificate", &self.ca)?;
        let cert = self.read("certificate", &self.cert)?;
        let key = self.read("private key", &self.key)?;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&ca) {
            let c = c.map_err(|e| invalid("CA certificate", &self.ca, e.to_string()))?;
            roots
                .add(c)
                .map_err(|e| invalid("CA certificate", &self.ca, e.to_string()))?;
        }
        let chain = CertificateDer::pem_slice_iter(&cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid("certificate", &self.cert, e.to_string()))?;
        let key = PrivateKeyDer::from_pem_slice(&key)
            .map_err(|e| invalid("private key", &self.key, e.to_string()))?;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.into(),
            provider.clone(),
        )
        .build()
        .map_err(|e| invalid("CA certificate", &self.ca, e.to_string()))?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("certificate", &self.cert, e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| invalid("certificate", &self.cert, e.to_string()))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(std::sync::Arc::new(config))
    }

    /// Client side: trust our CA, present our identity, expect the server to be `domain`.
    pub fn client_config(&self, domain: &str) -> Result<ClientTlsConfig, Error> {
        Ok(ClientTlsConfig::new()
            .ca_certificate(self.ca_cert()?)
            .identity(self.identity()?)
            .domain_name(domain))
    }
}

/// Who is calling: the CN and role of the certificate it presented, and its organisation
/// (the namespaces a client acts in: `team-a,team-b`, or `*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
    pub role: Role,
    pub organisation: Option<String>,
}

/// Reads the peer's identity from its leaf certificate (DER).
pub fn peer_from_der(der: &[u8]) -> Result<Peer, Problem> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| Problem::denied(format!("the client certificate cannot be parsed: {e}")))?;
    let subject = cert.subject();
    let name = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_owned)
        .ok_or(Problem::denied(
            "the client certificate has no common name (CN)",
        ))?;
    let role = subject
        .iter_organizational_unit()
        .next()
        .and_then(|ou| ou.as_str().ok())
        .ok_or(Problem::denied("the client certificate carries no Flotilla role (OU); issue it with `flotilla certs issue --role ...`"))?
        .parse::<Role>()?;
    let organisation = subject
        .iter_organization()
        .next()
        .and_then(|o| o.as_str().ok())
        .map(str::to_owned);
    Ok(Peer {
        name,
        role,
        organisation,
    })
}

/// The peer of a request; `Unauthenticated` when it presented no usable certificate.
pub fn peer_of<T>(req: &tonic::Request<T>) -> Result<Peer, tonic::Status> {
    let certs = req.peer_certs().ok_or_else(|| {
        tonic::Status::unauthenticated(
            "no client certificate: connect with a certificate signed by the coordinator's CA (--tls-dir)",
        )
    })?;
    let leaf = certs
        .first()
        .ok_or_else(|| tonic::Status::unauthenticated("no client certificate was presented"))?;
    peer_from_der(leaf.as_ref()).map_err(tonic::Status::unauthenticated)
}

/// Checks that the peer has one of `allowed` roles.
pub fn require_role<T>(
    req: &tonic::Request<T>,
    allowed: &[Role],
    what: &str,
) -> Result<Peer, tonic::Status> {
    let peer = peer_of(req)?;
    if allowed.contains(&peer.role) {
        Ok(peer)
    } else {
        Err(tonic::Status::permission_denied(format!(
            "certificate {:?} has role {} and may not {what} (needs {})",
            peer.name,
            peer.role.as_str(),
            allowed
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(" or ")
        )))
    }
}

/// A lazily connecting channel to a coordinator at `endpoint` (`https://host:port`, or
/// `http://` without TLS). The server name checked against its certificate is the host part.
pub fn channel(
    endpoint: &str,
    tls: Option<&TlsFiles>,
) -> Result<tonic::transport::Channel, Problem> {
    channel_as(endpoint, tls, None)
}

/// Like [`channel`], verifying the server's certificate for `server_name` instead of the
/// address's host (peers reached at addresses no certificate can name, such as pod IPs).
pub fn channel_as(
    endpoint: &str,
    tls: Option<&TlsFiles>,
    server_name: Option<&str>,
) -> Result<tonic::transport::Channel, Problem> {
    use std::time::Duration;
    let mut ep = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .map_err(|_| {
            Problem::invalid(format!(
                "invalid coordinator address {endpoint:?}: use https://host:port"
            ))
        })?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true);
    let scheme_https = endpoint.starts_with("https://");
    match tls {
        Some(files) => {
            if !scheme_https {
                return Err(Problem::invalid(format!(
                    "coordinator address {endpoint:?} is not https://; TLS needs https:// (or pass --insecure for plain text on loopback)"
                )));
            }
            let host = match server_name {
                Some(name) => name.to_owned(),
                None => ep.uri().host().map(str::to_owned).ok_or_else(|| {
                    Problem::invalid(format!("coordinator address {endpoint:?} has no host"))
                })?,
            };
            ep = ep
                .tls_config(
                    files
                        .client_config(&host)
                        .map_err(|e| Problem::invalid(e.to_string()))?,
                )
                .map_err(|e| {
                    Problem::invalid(format!("invalid TLS configuration for {endpoint}: {e}"))
                })?;
        }
        None => {
            if scheme_https {
                return Err(Problem::invalid(format!(
                    "coordinator address {endpoint:?} is https:// but no certificate was given; pass --tls-dir"
                )));
            }
        }
    }
    Ok(ep.connect_lazy())
}

/// Every message in an error's source chain, joined: transport errors hide their cause
/// (a refused connection, a rejected certificate) several sources deep.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = s.source();
    }
    parts.join(": ")
}

/// Whether a failed call means the TLS handshake was refused (a certificate the other side
/// does not trust, or no certificate), as opposed to the peer being unreachable.
pub fn is_tls_rejection(status: &tonic::Status) -> bool {
    let chain = error_chain(status).to_ascii_lowercase();
    chain.contains("certificate")
        || chain.contains("alert")
        || chain.contains("unknownca")
        || chain.contains("handshake")
}

/// Whether a failed call looks like the server hanging up right after the TLS handshake,
/// which is how TLS 1.3 reports a client certificate the server does not accept (the client
/// finishes its side of the handshake before the server checks the certificate).
pub fn looks_like_rejected_client_cert(status: &tonic::Status) -> bool {
    let chain = error_chain(status).to_ascii_lowercase();
    chain.contains("operation was canceled")
        || chain.contains("connection closed")
        || chain.contains("broken pipe")
        || chain.contains("connection reset")
}

/// What a failed call's status says, without tonic's debug form: its message, then each
/// cause in its source chain (a refused connection is several sources deep), once each.
pub fn status_chain(status: &tonic::Status) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut add = |text: String| {
        let text = text.trim().to_owned();
        if !text.is_empty() && !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
    };
    add(status.message().to_owned());
    let mut cur = std::error::Error::source(status);
    while let Some(s) = cur {
        add(s.to_string());
        cur = s.source();
    }
    parts.join(": ")
}

/// Whether a call this process made failed before the peer heard it: no connection (refused,
/// a name that does not resolve, a timeout) or no handshake (TLS refused either way, a peer
/// that does not speak gRPC). Such a status is made here, from a transport error (a status a
/// peer sent has no source); a connection that broke in the middle of a reply had reached it.
pub fn not_reached(status: &tonic::Status) -> bool {
    let made_here = std::error::Error::source(status).is_some();
    let code = matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    );
    made_here
        && code
        && !error_chain(status)
            .to_ascii_lowercase()
            .contains("error reading a body")
}

/// A user-facing explanation of a failed call to a coordinator.
pub fn explain(status: &tonic::Status) -> String {
    explain_at(status, None)
}

/// Like [`explain`], naming the coordinator's `address` when it is known: what failed, and
/// what to check.
pub fn explain_at(status: &tonic::Status, address: Option<&str>) -> String {
    let chain = status_chain(status);
    let lower = error_chain(status).to_ascii_lowercase();
    let at = address.map(|a| format!(" at {a}")).unwrap_or_default();
    let with = address
        .map(|a| format!(" with the coordinator at {a}"))
        .unwrap_or_default();
    let address_flags =
        "the address (--coordinator, FLOTILLA_COORDINATOR or `coordinator` in --config)";
    // A reply had begun: the connection was up, so this is no handshake refusal.
    if lower.contains("error reading a body") {
        format!("the connection to the coordinator{at} broke in the middle of a reply ({chain})")
    } else if lower.contains("not valid for name") {
        format!(
            "the coordinator's certificate does not name the address it was reached at: reach it by a name its certificate holds, issue it with that address (`flotilla certs issue --host`), or, for a coordinator reaching its group's leader, give it `--peer-name` with a name the certificate holds ({chain})"
        )
    } else if is_tls_rejection(status) || looks_like_rejected_client_cert(status) {
        format!(
            "the TLS handshake failed{with} — the certificate is not signed by the CA the other side trusts, or none was sent; check --tls-dir (or --cert, --key, --ca) against the CA the coordinator uses ({chain})"
        )
    } else if lower.contains("h2 protocol error")
        || lower.contains("http2 error")
        || lower.contains("frame with invalid size")
    {
        format!(
            "the coordinator{at} did not speak the expected protocol — it probably uses TLS: connect with https:// and --tls-dir ({chain})"
        )
    } else if lower.contains("connection refused") {
        format!(
            "cannot reach the coordinator{at}: nothing accepts connections there; check that the coordinator runs and listens there (its --listen), and {address_flags} ({chain})"
        )
    } else if lower.contains("dns error") || lower.contains("failed to lookup") {
        format!(
            "cannot reach the coordinator{at}: its host name does not resolve; check {address_flags} ({chain})"
        )
    } else if lower.contains("timed out") || lower.contains("deadline") {
        format!(
            "cannot reach the coordinator{at}: it did not answer in time; check that it runs, that no firewall is in the way, and {address_flags} ({chain})"
        )
    } else if not_reached(status) {
        format!(
            "cannot reach the coordinator{at}; check that it runs, that this machine reaches it, and {address_flags} ({chain})"
        )
    } else {
        chain
    }
}

#[cfg(test)]
mod explain_tests {
    #[test]
    fn a_certificate_for_another_name_is_called_that_not_an_untrusted_one() {
        let wrong = tonic::Status::unavailable(
            "invalid peer certificate: certificate not valid for name \"localhost\"; certificate is only valid for IpAddress(127.0.0.1)",
        );
        let why = super::explain(&wrong);
        assert!(
            why.starts_with("the coordinator's certificate does not name the address"),
            "{why}"
        );
        assert!(why.contains("--peer-name"), "{why}");
    }

    #[test]
    fn a_connection_that_broke_mid_reply_is_not_called_a_certificate_problem() {
        let broke = tonic::Status::unknown(
            "h2 protocol error: error reading a body from connection: stream closed because of a broken pipe",
        );
        let why = super::explain(&broke);
        assert!(
            why.starts_with("the connection to the coordinator broke"),
            "{why}"
        );
        let refused =
            tonic::Status::unknown("transport error: connection closed before message completed");
        assert!(super::explain(&refused).contains("TLS handshake failed"));
    }
}
