//! The client commands that talk to a coordinator over gRPC + mTLS (`launch`, `wait`,
//! `status`, `stop`, `workers`, ...), and the identity flags every fleet command shares.
//!
//! Identity: `--tls-dir DIR` with `--name NAME` picks `DIR/NAME.crt`, `DIR/NAME.key` and
//! `DIR/ca.crt` (defaults: `coordinator` for the coordinator, the host name for a worker,
//! `client` for client commands); `--cert/--key/--ca` name files directly. `--insecure` turns
//! TLS off and is accepted only on loopback addresses.

use flotilla_proto::Problem;
use std::path::PathBuf;

use clap::Args;
use flotilla_proto::ErrorKind;
use flotilla_proto::tls::TlsFiles;
use flotilla_proto::v1::client_service_client::ClientServiceClient;
use tonic::transport::Channel;

use crate::config;

pub mod agents;
mod answer;
pub mod changes;
pub mod context;
mod fleet;
mod launch;
mod runs;
pub mod workflows;

pub use answer::*;
pub use fleet::*;
pub use launch::*;
pub use runs::*;

/// Identity flags shared by every fleet command.
#[derive(Debug, Args, Clone, Default)]
pub struct TlsArgs {
    /// Directory with ca.crt and NAME.crt/NAME.key (from `flotilla certs`).
    #[arg(long, env = "FLOTILLA_TLS_DIR", value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// Which identity in --tls-dir to use.
    #[arg(long, env = "FLOTILLA_NAME")]
    pub name: Option<String>,
    /// Certificate file (instead of --tls-dir/--name).
    #[arg(long, env = "FLOTILLA_CERT")]
    pub cert: Option<PathBuf>,
    /// Private key file.
    #[arg(long, env = "FLOTILLA_KEY")]
    pub key: Option<PathBuf>,
    /// CA certificate file.
    #[arg(long, env = "FLOTILLA_CA")]
    pub ca: Option<PathBuf>,
    /// Plain text without TLS (loopback development only).
    #[arg(long, env = "FLOTILLA_INSECURE")]
    pub insecure: bool,
}

impl TlsArgs {
    /// Fills what flags and environment left unset from a config file.
    pub fn fill(&mut self, file: &config::ConfigFile) {
        if self.tls_dir.is_none() {
            self.tls_dir.clone_from(&file.tls_dir);
        }
        if self.name.is_none() {
            self.name.clone_from(&file.name);
        }
        if self.cert.is_none() {
            self.cert.clone_from(&file.cert);
        }
        if self.key.is_none() {
            self.key.clone_from(&file.key);
        }
        if self.ca.is_none() {
            self.ca.clone_from(&file.ca);
        }
        self.insecure |= file.insecure.unwrap_or(false);
    }

    /// Fills what flags, environment and config left unset from a context.
    pub fn fill_from(&mut self, ctx: &context::Context) {
        if self.tls_dir.is_none() && self.cert.is_none() {
            self.tls_dir.clone_from(&ctx.tls_dir);
        }
        if self.name.is_none() {
            self.name.clone_from(&ctx.name);
        }
        self.insecure |= ctx.insecure;
    }

    /// The identity files, or `None` with --insecure on a loopback address.
    pub fn files(
        &self,
        default_name: &str,
        addr_is_loopback: bool,
    ) -> Result<Option<TlsFiles>, Problem> {
        if self.insecure {
            if !addr_is_loopback {
                return Err(Problem::invalid(
                    "--insecure is allowed only on loopback addresses (127.0.0.1, ::1, localhost); use --tls-dir elsewhere",
                ));
            }
            eprintln!(
                "warning: --insecure: no TLS, no authentication; anyone on this machine can connect"
            );
            return Ok(None);
        }
        let name = self.name.clone().unwrap_or_else(|| default_name.to_owned());
        let from_dir = self.tls_dir.as_ref().map(|d| TlsFiles::in_dir(d, &name));
        let pick = |given: &Option<PathBuf>, from: Option<PathBuf>, flag: &str| {
            given.clone().or(from).ok_or_else(|| {
                Problem::invalid(format!("no {flag}: pass --tls-dir DIR (from `flotilla certs`) or --{flag}, or --insecure for loopback development"))
            })
        };
        Ok(Some(TlsFiles {
            ca: pick(&self.ca, from_dir.as_ref().map(|f| f.ca.clone()), "ca")?,
            cert: pick(
                &self.cert,
                from_dir.as_ref().map(|f| f.cert.clone()),
                "cert",
            )?,
            key: pick(&self.key, from_dir.as_ref().map(|f| f.key.clone()), "key")?,
        }))
    }
}

pub(crate) fn loopback_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h == "localhost"
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

pub(crate) fn host_of(url: &str) -> String {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let authority = rest.split('/').next().unwrap_or(rest);
    match authority.rsplit_once(':') {
        Some((h, _)) => h.to_owned(),
        None => authority.to_owned(),
    }
}

/// Where a finished or running run is read from: a store, or a coordinator.
#[derive(Debug, Args, Clone)]
pub struct ReadFrom {
    /// Object store URL (file:///path, s3://bucket/prefix).
    #[arg(long, env = "FLOTILLA_STORE")]
    pub store: Option<String>,
    /// Ask this coordinator instead of reading a store (no storage credentials needed; a
    /// run it runs shows its live state).
    #[arg(long, env = "FLOTILLA_COORDINATOR")]
    pub coordinator: Option<String>,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// Where the coordinator is and who we are.
#[derive(Debug, Args, Clone)]
pub struct ClientArgs {
    /// Coordinator address (https://host:port).
    #[arg(long, env = "FLOTILLA_COORDINATOR")]
    pub coordinator: Option<String>,
    #[command(flatten)]
    pub tls: TlsArgs,
}

impl ClientArgs {
    /// A client, with what flags and environment left unset taken from `file`.
    pub fn client_with(
        &self,
        file: &config::ConfigFile,
    ) -> Result<ClientServiceClient<Channel>, Problem> {
        let mut tls = self.tls.clone();
        tls.fill(file);
        let coordinator = match self
            .coordinator
            .clone()
            .or_else(|| file.coordinator.clone())
        {
            Some(c) => c,
            // Nothing names one: the current context does, with its identity.
            None => match context::Contexts::load()?.chosen()? {
                Some((_, ctx)) => {
                    tls.fill_from(&ctx);
                    ctx.coordinator
                }
                None => {
                    return Err(Problem::invalid(
                        "no coordinator: pass --coordinator https://host:port (or FLOTILLA_COORDINATOR, or `coordinator` in --config), or make a context current (`flotilla context use NAME`; `flotilla dev` makes one)",
                    ));
                }
            },
        };
        let files = tls.files("client", loopback_host(&host_of(&coordinator)))?;
        // Named by whatever this process's calls to it say when they fail.
        let _ = COORDINATOR.set(coordinator.clone());
        let channel = flotilla_proto::tls::channel(&coordinator, files.as_ref())?;
        // Reports with big results come back whole: the limits are explicit, both ways.
        Ok(ClientServiceClient::new(channel)
            .max_decoding_message_size(flotilla_proto::frag::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(flotilla_proto::frag::MAX_MESSAGE_BYTES))
    }

    pub fn client(&self) -> Result<ClientServiceClient<Channel>, Problem> {
        self.client_with(&config::ConfigFile::default())
    }
}

/// The coordinator this process's client commands talk to, once a client for it is made: a
/// call that fails names it.
static COORDINATOR: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Prints a failed call the way every client command does; returns the exit status. Every
/// client command's failed call comes here (or through [`rpc_error`]), so a coordinator that
/// cannot be reached is said one way, with one exit status, everywhere.
pub fn rpc_fail(s: &tonic::Status) -> i32 {
    crate::refuse(call_problem(s))
}

/// A failed call as a user reads it, with its kind: `Unreachable` when the coordinator never
/// heard it (what to check: the address, that it runs, the certificates), else the kind of
/// what it answered.
pub(crate) fn rpc_error(s: &tonic::Status) -> (ErrorKind, String) {
    let kind = ErrorKind::of_call(s);
    let at = COORDINATOR.get().map(String::as_str);
    let msg = match s.code() {
        _ if kind == ErrorKind::Unreachable => flotilla_proto::tls::explain_at(s, at),
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
            format!("the coordinator refused this client: {}", s.message())
        }
        tonic::Code::Unavailable
        | tonic::Code::Unknown
        | tonic::Code::Internal
        | tonic::Code::Cancelled => flotilla_proto::tls::explain_at(s, at),
        _ => s.message().to_owned(),
    };
    (kind, msg)
}

/// A failed call as a [`Problem`](flotilla_proto::Problem) of its kind (see [`rpc_error`]).
pub(crate) fn call_problem(s: &tonic::Status) -> flotilla_proto::Problem {
    let (kind, message) = rpc_error(s);
    flotilla_proto::Problem::new(kind, message)
}

#[derive(Debug, Args)]
pub struct RunRefArgs {
    run_id: String,
    #[arg(long)]
    json: bool,
    /// With --json: list every agent of the report (by default at most 1000, those that
    /// did not complete first).
    #[arg(long)]
    full: bool,
    /// TOML file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    remote: ClientArgs,
}

impl RunRefArgs {
    pub fn json(&self) -> bool {
        self.json
    }
}

impl AgentRefArgs {
    pub fn json(&self) -> bool {
        self.run.json
    }
}

impl RunRefArgs {
    fn client(&self) -> Result<ClientServiceClient<Channel>, Problem> {
        self.remote
            .client_with(&config::load(self.config.as_deref())?)
    }
}

#[derive(Debug, Args)]
pub struct AgentRefArgs {
    #[command(flatten)]
    run: RunRefArgs,
    /// One agent of the run: its index (as `flotilla show` lists them) or its label.
    #[arg(long)]
    agent: Option<String>,
    /// Why: kept, with who asked, in the run's log and events.
    #[arg(long)]
    reason: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct RestartArgs {
    #[command(flatten)]
    pub agent: AgentRefArgs,
    /// The new attempt starts over, instead of continuing the conversation the interrupted
    /// one leaves (claude-code, anthropic and openai agents continue by default).
    #[arg(long)]
    pub fresh: bool,
}

#[derive(clap::Args, Debug)]
pub struct PauseArgs {
    #[command(flatten)]
    run: RunRefArgs,
    /// Why: kept, with who asked, in the run's log and events.
    #[arg(long)]
    reason: Option<String>,
}

impl PauseArgs {
    pub fn json(&self) -> bool {
        self.run.json
    }
}

#[derive(clap::Args, Debug)]
pub struct BudgetArgs {
    #[command(flatten)]
    run: RunRefArgs,
    /// The run's money budget from now on, in dollars (what its attempts may cost in all).
    #[arg(long, value_parser = positive_dollars)]
    usd: f64,
    /// Why: kept, with who asked, in the run's log and events.
    #[arg(long)]
    reason: Option<String>,
}

impl BudgetArgs {
    pub fn json(&self) -> bool {
        self.run.json
    }
}

fn positive_dollars(s: &str) -> Result<f64, Problem> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(Problem::invalid(format!(
            "{s:?} is not a money budget: give a positive number of dollars, e.g. --usd 5"
        ))),
    }
}
