//! Fleet commands: `coordinator`, `worker`, and the client commands `launch`, `wait`,
//! `status`, `stop`, `workers` that talk to a coordinator over gRPC + mTLS.
//!
//! Identity: `--tls-dir DIR` with `--name NAME` picks `DIR/NAME.crt`, `DIR/NAME.key` and
//! `DIR/ca.crt` (defaults: `coordinator` for the coordinator, the host name for a worker,
//! `client` for client commands); `--cert/--key/--ca` name files directly. `--insecure` turns
//! TLS off and is accepted only on loopback addresses.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use flotilla_coordinator::lease::LeaseStore;
use flotilla_coordinator::lease::etcd::EtcdLeaseStore;
use flotilla_coordinator::lease::memory::MemoryLeaseStore;
use flotilla_coordinator::server::{self, RunRegistry, ServerOptions, SnapshotView};
use flotilla_coordinator::workflows::{DirResolver, FoundWorkflow, WorkflowResolver};
use flotilla_coordinator::{Coordinator, Report, store};
use flotilla_proto::tls::TlsFiles;
use flotilla_proto::v1::client_service_client::ClientServiceClient;
use flotilla_proto::v1::{self};
use flotilla_worker::backend::{echo::Echo, exec::Exec};
use flotilla_worker::{AgentBackend, Worker, WorkerOptions};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::{config, fail, print_report};

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

    /// The identity files, or `None` with --insecure on a loopback address.
    pub fn files(
        &self,
        default_name: &str,
        addr_is_loopback: bool,
    ) -> Result<Option<TlsFiles>, String> {
        if self.insecure {
            if !addr_is_loopback {
                return Err("--insecure is allowed only on loopback addresses (127.0.0.1, ::1, localhost); use --tls-dir elsewhere".into());
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
                format!("no {flag}: pass --tls-dir DIR (from `flotilla certs`) or --{flag}, or --insecure for loopback development")
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

fn loopback_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h == "localhost"
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn host_of(url: &str) -> String {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let authority = rest.split('/').next().unwrap_or(rest);
    match authority.rsplit_once(':') {
        Some((h, _)) => h.to_owned(),
        None => authority.to_owned(),
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "worker".into())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

// ---- coordinator ---------------------------------------------------------------------------

#[derive(Debug, Args)]
pub struct CoordinatorArgs {
    /// gRPC address for workers and clients [default: 127.0.0.1:7443].
    #[arg(long, env = "FLOTILLA_LISTEN")]
    listen: Option<SocketAddr>,
    /// Address of the session pages (session URLs point here) [default: 127.0.0.1:7080].
    #[arg(long, env = "FLOTILLA_HTTP")]
    http: Option<SocketAddr>,
    /// TOML file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    /// Object store URL (file:///path, memory://).
    #[arg(long, env = "FLOTILLA_STORE")]
    store: Option<String>,
    /// etcd endpoints for leases (http://host:2379 or https://; comma-separated). Without it,
    /// leases live in this process's memory.
    #[arg(long, env = "FLOTILLA_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// CA, certificate and key for an https:// etcd (default: the coordinator's own files).
    #[arg(long, env = "FLOTILLA_ETCD_CA")]
    etcd_ca: Option<PathBuf>,
    #[arg(long, env = "FLOTILLA_ETCD_CERT")]
    etcd_cert: Option<PathBuf>,
    #[arg(long, env = "FLOTILLA_ETCD_KEY")]
    etcd_key: Option<PathBuf>,
    /// TTL of each worker's liveness lease: a worker cut off this long loses its attempts to
    /// other workers; one that comes back sooner keeps them [default: 10s].
    #[arg(long, env = "FLOTILLA_WORKER_TTL")]
    worker_ttl: Option<String>,
    /// With --etcd: the address other coordinators forward requests to
    /// [default: https://LISTEN].
    #[arg(long, env = "FLOTILLA_ADVERTISE")]
    advertise: Option<String>,
    /// Run saved workflows only (pushed with `flotilla workflows push`, or bundled): launches
    /// of inline scripts are refused.
    #[arg(long, env = "FLOTILLA_SAVED_ONLY")]
    saved_only: bool,
    /// A client (by certificate name) that may push workflows; repeatable. Holders of a
    /// `coordinator` certificate always may; nobody else.
    #[arg(
        long = "publisher",
        env = "FLOTILLA_PUBLISHERS",
        value_delimiter = ',',
        value_name = "NAME"
    )]
    publishers: Vec<String>,
    /// Let a push take the name of a bundled workflow (deep-research, code-review, ...).
    #[arg(long, env = "FLOTILLA_ALLOW_SHADOW_BUNDLED")]
    allow_shadow_bundled: bool,
    /// Where the coordinator merges runs' changes and renders their diffs (a git cache of
    /// run sources; only a cache) [default: the user cache directory].
    #[arg(long, env = "FLOTILLA_CACHE_DIR", value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Longest a TLS handshake may take before the connection is closed [default: 10s].
    #[arg(long, env = "FLOTILLA_HANDSHAKE_TIMEOUT", value_name = "DUR")]
    handshake_timeout: Option<String>,
    /// A connection with no traffic either way for this long is closed [default: 5m].
    #[arg(long, env = "FLOTILLA_IDLE_TIMEOUT", value_name = "DUR")]
    idle_timeout: Option<String>,
    /// Connections open at once on each listener (gRPC, pages); past it new ones are closed
    /// at once [default: 4096].
    #[arg(long, env = "FLOTILLA_MAX_CONNECTIONS", value_name = "N")]
    max_connections: Option<usize>,
    #[command(flatten)]
    tls: TlsArgs,
}

/// The listeners' limits from flags, then the config file, then the defaults.
fn listen_limits(
    a: &CoordinatorArgs,
    file: &config::ConfigFile,
) -> Result<flotilla_coordinator::listen::Limits, String> {
    let mut limits = flotilla_coordinator::listen::Limits::default();
    if let Some(s) = a
        .handshake_timeout
        .as_ref()
        .or(file.handshake_timeout.as_ref())
    {
        limits.handshake = config::parse_duration("--handshake-timeout", s)?;
    }
    if let Some(s) = a.idle_timeout.as_ref().or(file.idle_timeout.as_ref()) {
        limits.idle = config::parse_duration("--idle-timeout", s)?;
    }
    if let Some(n) = a.max_connections.or(file.max_connections) {
        limits.max_connections = n;
    }
    if limits.handshake.is_zero() || limits.idle.is_zero() || limits.max_connections == 0 {
        return Err(
            "--handshake-timeout, --idle-timeout and --max-connections must be above zero".into(),
        );
    }
    Ok(limits)
}

async fn lease_store(
    a: &CoordinatorArgs,
    own: Option<&TlsFiles>,
) -> Result<Arc<dyn LeaseStore>, String> {
    if a.etcd.is_empty() {
        return Ok(MemoryLeaseStore::new());
    }
    let https = a.etcd.iter().any(|e| e.starts_with("https://"));
    let tls = if https {
        let files = TlsFiles {
            ca: a
                .etcd_ca
                .clone()
                .or_else(|| own.map(|f| f.ca.clone()))
                .ok_or("an https:// etcd needs --etcd-ca (or the coordinator's --tls-dir)")?,
            cert: a
                .etcd_cert
                .clone()
                .or_else(|| own.map(|f| f.cert.clone()))
                .ok_or("an https:// etcd needs --etcd-cert")?,
            key: a
                .etcd_key
                .clone()
                .or_else(|| own.map(|f| f.key.clone()))
                .ok_or("an https:// etcd needs --etcd-key")?,
        };
        let host = host_of(&a.etcd[0]);
        Some(files.client_config(&host).map_err(|e| e.to_string())?)
    } else {
        None
    };
    let store = EtcdLeaseStore::connect(&a.etcd, tls)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Arc::new(store))
}

pub async fn coordinator(mut a: CoordinatorArgs) -> i32 {
    let file = match config::load(a.config.as_deref()) {
        Ok(f) => f,
        Err(e) => return fail(2, e),
    };
    a.tls.fill(&file);
    let listen = a
        .listen
        .or(file.listen)
        .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 7443)));
    let http = a
        .http
        .or(file.http)
        .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 7080)));
    if a.store.is_none() {
        a.store.clone_from(&file.store);
    }
    if a.etcd.is_empty() {
        a.etcd.clone_from(&file.etcd);
    }
    for (flag, from_file) in [
        (&mut a.etcd_ca, &file.etcd_ca),
        (&mut a.etcd_cert, &file.etcd_cert),
        (&mut a.etcd_key, &file.etcd_key),
    ] {
        if flag.is_none() {
            flag.clone_from(from_file);
        }
    }
    let tls = match a.tls.files("coordinator", listen.ip().is_loopback()) {
        Ok(t) => t,
        Err(e) => return fail(2, e),
    };
    let limits = match listen_limits(&a, &file) {
        Ok(l) => l,
        Err(e) => return fail(2, e),
    };
    let url = config::store_url(a.store.clone());
    let store = match store::open(&url) {
        Ok(s) => s,
        Err(e) => return fail(2, e),
    };
    if let Err(e) = store.check().await {
        return fail(1, format!("the store does not answer: {e}"));
    }
    let leases = match lease_store(&a, tls.as_ref()).await {
        Ok(l) => l,
        Err(e) => return fail(1, e),
    };
    let worker_ttl = match a.worker_ttl.clone().or(file.worker_ttl.clone()) {
        None => flotilla_coordinator::sched::WORKER_LEASE_TTL,
        Some(s) => match config::parse_duration("--worker-ttl", &s) {
            Ok(d) if d >= std::time::Duration::from_secs(2) => d,
            Ok(_) => {
                return fail(
                    2,
                    "--worker-ttl must be at least 2s (etcd's shortest lease); e.g. --worker-ttl 10s",
                );
            }
            Err(e) => return fail(2, e),
        },
    };
    let coordinator = Arc::new(Coordinator::with_options(
        store,
        leases,
        flotilla_coordinator::sched::DispatchOptions {
            worker_ttl,
            ..Default::default()
        },
    ));
    coordinator.set_cache_dir(
        a.cache_dir
            .clone()
            .or_else(|| file.cache_dir.clone())
            .unwrap_or_else(|| {
                dirs::cache_dir()
                    .unwrap_or_else(std::env::temp_dir)
                    .join("flotilla")
                    .join("coordinator")
            }),
    );
    // Session tokens are signed with a key derived from the coordinator's private key, so
    // coordinators sharing it accept each other's tokens and a restart signs nobody out.
    let tokens = match &tls {
        Some(files) => match std::fs::read(&files.key) {
            Ok(secret) => Some(flotilla_coordinator::web::TokenKey::derive(&secret)),
            Err(e) => return fail(2, format!("cannot read {}: {e}", files.key.display())),
        },
        None => {
            if !http.ip().is_loopback() {
                return fail(
                    2,
                    format!(
                        "--insecure serves the session pages without sign-in, so only on loopback; use --http 127.0.0.1:{} (or TLS)",
                        http.port()
                    ),
                );
            }
            None
        }
    };
    let registry = Arc::new(RunRegistry::default());
    let cancel = CancellationToken::new();
    // With etcd, coordinators form a group: one leads, the others stand by and take over.
    let lost = CancellationToken::new();
    if !a.etcd.is_empty() {
        let advertise = a
            .advertise
            .clone()
            .or_else(|| file.advertise.clone())
            .unwrap_or_else(|| {
                let scheme = if tls.is_some() { "https" } else { "http" };
                format!("{scheme}://{listen}")
            });
        match flotilla_coordinator::leader::Leadership::start(
            coordinator.clone(),
            registry.clone(),
            coordinator.leases().clone(),
            advertise.clone(),
            worker_ttl,
            lost.clone(),
        )
        .await
        {
            Ok(l) => {
                let releaser = l.clone();
                registry.on_end(Arc::new(move |run: String| {
                    let l = releaser.clone();
                    tokio::spawn(async move { l.release(&run).await });
                }));
                coordinator.set_leadership(l);
                eprintln!(
                    "coordinator group member at {advertise} (one leads; the others stand by)"
                );
            }
            Err(e) => return fail(1, e),
        }
    }
    // The disable switch is read again on every launch: the environment, then the config file.
    let config_path = a.config.clone();
    let mut publishers = a.publishers.clone();
    if publishers.is_empty() {
        publishers.clone_from(&file.publishers);
    }
    let policy = flotilla_coordinator::server::LaunchPolicy {
        publishers,
        shadow_bundled: a.allow_shadow_bundled || file.allow_shadow_bundled.unwrap_or(false),
        saved_only: a.saved_only || file.saved_only.unwrap_or(false),
        disabled: Arc::new(move || {
            let file = config::load(config_path.as_deref()).unwrap_or_default();
            config::workflows_disabled(&file)
        }),
    };
    let opts = ServerOptions {
        listen,
        tls,
        limits,
        keepalive: worker_ttl / 3,
        tokens: tokens.clone(),
        session_base: format!("http://{http}"),
        policy,
    };
    let leases_at = if a.etcd.is_empty() {
        "in memory".to_owned()
    } else {
        format!("in etcd at {}", a.etcd.join(","))
    };
    eprintln!(
        "flotilla coordinator listening on {} ({}), store {url}, leases {leases_at}",
        listen,
        if opts.tls.is_some() {
            "mTLS"
        } else {
            "insecure"
        },
    );
    eprintln!(
        "session pages on http://{http}/runs ({})",
        if tokens.is_some() {
            "sign in with `flotilla token create`"
        } else {
            "no sign-in: --insecure"
        }
    );
    let pages = tokio::spawn(flotilla_coordinator::web::serve(
        coordinator.clone(),
        registry.clone(),
        flotilla_coordinator::web::WebOptions {
            listen: http,
            auth: tokens,
            limits,
        },
        cancel.clone(),
    ));
    let serving = tokio::spawn(server::serve(
        coordinator.clone(),
        registry,
        opts,
        cancel.clone(),
    ));
    tokio::select! {
        _ = shutdown_signal() => {
            cancel.cancel();
        }
        _ = lost.cancelled() => {
            cancel.cancel();
            coordinator.shutdown();
            return fail(1, "this coordinator's lease in etcd lapsed, so another coordinator may own its runs now; stopping (restart it to rejoin as a standby)");
        }
        r = serving => {
            cancel.cancel();
            coordinator.shutdown();
            return match r {
                Ok(Ok(())) => 0,
                Ok(Err(e)) => fail(1, e),
                Err(e) => fail(1, e),
            };
        }
        r = pages => {
            cancel.cancel();
            coordinator.shutdown();
            return match r {
                Ok(Ok(())) => 0,
                Ok(Err(e)) => fail(1, e),
                Err(e) => fail(1, e),
            };
        }
    }
    coordinator.shutdown();
    0
}

// ---- worker -------------------------------------------------------------------------------

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Coordinator address (https://host:port).
    #[arg(long, env = "FLOTILLA_COORDINATOR")]
    coordinator: Option<String>,
    /// Backends this worker offers (echo, exec); repeatable [default: echo].
    #[arg(long = "backend", env = "FLOTILLA_BACKENDS", value_delimiter = ',')]
    backends: Vec<String>,
    /// Command of the exec backend.
    #[arg(long, env = "FLOTILLA_EXEC_CMD")]
    exec_cmd: Option<String>,
    /// Attempts this worker runs at once [default: 16].
    #[arg(long, env = "FLOTILLA_SLOTS")]
    slots: Option<u32>,
    /// Root of the agents' working directories.
    #[arg(long, env = "FLOTILLA_WORKSPACE")]
    workspace: Option<PathBuf>,
    /// The largest result one agent may return, in MiB; a bigger one fails its call with
    /// its size [default and most: 256].
    #[arg(long, env = "FLOTILLA_MAX_RESULT_MIB", value_name = "MIB")]
    max_result_mib: Option<u64>,
    /// Let runs name `git+file://` (or local path) sources, which this worker then reads
    /// from its own disk. Off by default: only https, http, ssh and git URLs are fetched.
    #[arg(long, env = "FLOTILLA_ALLOW_FILE_SOURCES")]
    allow_file_sources: bool,
    /// Hosts a URL source may name although they resolve to this machine or its link
    /// (loopback, link-local: a cloud metadata service, say), comma-separated; `*` for any.
    /// Off by default, so a launcher cannot point workers at their own services.
    #[arg(
        long,
        env = "FLOTILLA_ALLOW_SOURCE_HOSTS",
        value_delimiter = ',',
        value_name = "HOST"
    )]
    allow_source_host: Vec<String>,
    /// Run every agent's processes in a bubblewrap sandbox (`on`, the default: the worker
    /// does not start without one) or not (`off`: agents can reach all this worker can).
    #[arg(long, env = "FLOTILLA_SANDBOX", value_name = "on|off")]
    sandbox: Option<String>,
    /// Hosts sandboxed agents may reach besides the model API, through the worker's proxy:
    /// HOST (any port) or HOST:PORT, comma-separated. Everything else is refused.
    #[arg(
        long,
        env = "FLOTILLA_ALLOW_NET",
        value_delimiter = ',',
        value_name = "HOST[:PORT]"
    )]
    allow_net: Vec<String>,
    /// Memory one attempt's processes may use, in MiB; 0 for no limit [default: 4096].
    #[arg(long, env = "FLOTILLA_MEMORY_MIB", value_name = "MIB")]
    memory_mib: Option<u64>,
    /// Processes one attempt may run at once; 0 for no limit [default: 1024].
    #[arg(long, env = "FLOTILLA_MAX_PROCS", value_name = "N")]
    max_procs: Option<u64>,
    /// Size of a sandboxed attempt's private /tmp, in MiB [default: 1024].
    #[arg(long, env = "FLOTILLA_TMP_MIB", value_name = "MIB")]
    tmp_mib: Option<u64>,
    /// Longest one attempt may run (a shorter `timeout` of the call wins); 0 for none
    /// [default: 4h].
    #[arg(long, env = "FLOTILLA_MAX_ATTEMPT_TIME", value_name = "DUR")]
    max_attempt_time: Option<String>,
    /// How attempts' memory and process limits are held: `auto` (a cgroup per attempt where
    /// this worker may make one, else rlimits) or `rlimits` [default: auto].
    #[arg(long, env = "FLOTILLA_LIMITS_VIA", value_name = "auto|rlimits")]
    limits_via: Option<String>,
    /// TOML file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    tls: TlsArgs,
}

pub async fn worker(mut a: WorkerArgs) -> i32 {
    let file = match config::load(a.config.as_deref()) {
        Ok(f) => f,
        Err(e) => return fail(2, e),
    };
    a.tls.fill(&file);
    let Some(coordinator) = a.coordinator.clone().or_else(|| file.coordinator.clone()) else {
        return fail(
            2,
            "no coordinator: pass --coordinator https://host:port (or FLOTILLA_COORDINATOR, or `coordinator` in --config)",
        );
    };
    if a.backends.is_empty() {
        a.backends = if file.backends.is_empty() {
            vec!["echo".into()]
        } else {
            file.backends.clone()
        };
    }
    if a.exec_cmd.is_none() {
        a.exec_cmd.clone_from(&file.exec_cmd);
    }
    if a.workspace.is_none() {
        a.workspace.clone_from(&file.workspace);
    }
    let slots = a.slots.or(file.slots).unwrap_or(16);
    let name = a.tls.name.clone().unwrap_or_else(hostname);
    let tls = match a.tls.files(&name, loopback_host(&host_of(&coordinator))) {
        Ok(t) => t,
        Err(e) => return fail(2, e),
    };
    if slots == 0 {
        return fail(2, "--slots must be at least 1");
    }
    let limit_mib = (flotilla_proto::frag::MAX_MESSAGE_BYTES >> 20) as u64;
    let max_result_mib = a
        .max_result_mib
        .or(file.max_result_mib)
        .unwrap_or(limit_mib);
    if max_result_mib == 0 || max_result_mib > limit_mib {
        return fail(
            2,
            format!("--max-result-mib must be between 1 and {limit_mib} (got {max_result_mib})"),
        );
    }
    let workspace = a.workspace.clone().unwrap_or_else(|| {
        dirs::data_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("flotilla")
            .join("workspaces")
    });
    // The workspace is the worker's alone: no other user of the machine reads its checkouts.
    if std::fs::create_dir_all(&workspace).is_ok() {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&workspace, std::fs::Permissions::from_mode(0o700));
    }
    let sandbox = match a
        .sandbox
        .as_deref()
        .or(file.sandbox.as_deref())
        .unwrap_or("on")
    {
        "on" | "bwrap" => match crate::sandbox_with_api(if a.allow_net.is_empty() {
            file.allow_net.clone()
        } else {
            a.allow_net.clone()
        })
        .await
        {
            Ok(s) => {
                eprintln!("flotilla worker: {}", s.describe());
                s
            }
            Err(e) => {
                return fail(
                    2,
                    format!(
                        "{e}\nagents run sandboxed by default: install bubblewrap (Debian: apt-get install bubblewrap) where unprivileged user namespaces are allowed, or start with --sandbox off to run them unconfined"
                    ),
                );
            }
        },
        "off" => {
            eprintln!(
                "flotilla worker: WARNING: {}",
                flotilla_worker::sandbox::OFF_WARNING
            );
            flotilla_worker::sandbox::Sandbox::Off
        }
        other => return fail(2, format!("--sandbox takes on or off (got {other:?})")),
    };
    let mut settings = flotilla_worker::limits::Settings::default();
    if let Some(m) = a.memory_mib.or(file.memory_mib) {
        settings.memory = (m > 0).then_some(m << 20);
    }
    if let Some(p) = a.max_procs.or(file.max_procs) {
        settings.procs = (p > 0).then_some(p);
    }
    if let Some(t) = a.tmp_mib.or(file.tmp_mib) {
        if t == 0 {
            return fail(2, "--tmp-mib must be at least 1");
        }
        settings.tmp = t << 20;
    }
    if let Some(w) = a.max_attempt_time.clone().or(file.max_attempt_time.clone()) {
        match crate::config::parse_duration("--max-attempt-time", &w) {
            Ok(d) => settings.wall = (!d.is_zero()).then_some(d),
            Err(e) => return fail(2, e),
        }
    }
    let rlimits = match a.limits_via.as_deref().unwrap_or("auto") {
        "auto" => false,
        "rlimits" => true,
        other => {
            return fail(
                2,
                format!("--limits-via takes auto or rlimits (got {other:?})"),
            );
        }
    };
    let limits = flotilla_worker::limits::Limits::detect_with(settings, rlimits);
    eprintln!("flotilla worker: {}", limits.describe());
    let groups = limits.clone();
    let mut backends: Vec<Arc<dyn AgentBackend>> = Vec::new();
    for b in &a.backends {
        match b.as_str() {
            "echo" => backends.push(Arc::new(Echo)),
            "claude-code" => backends.push(Arc::new(
                flotilla_worker::backend::claude::ClaudeCode::from_env(),
            )),
            "anthropic" => backends.push(Arc::new(
                flotilla_worker::backend::anthropic::Anthropic::from_env(),
            )),
            "openai" => backends.push(Arc::new(
                flotilla_worker::backend::openai::OpenAi::from_env(),
            )),
            "exec" => match &a.exec_cmd {
                Some(cmd) => backends.push(Arc::new(Exec::new(cmd.clone()))),
                None => return fail(2, "--backend exec needs --exec-cmd CMD"),
            },
            other => {
                return fail(
                    2,
                    format!(
                        "unknown backend {other:?}: this worker offers echo, exec, claude-code, anthropic and openai"
                    ),
                );
            }
        }
    }
    let worker = Worker::new(
        WorkerOptions {
            name: name.clone(),
            slots,
            workspace,
            labels: Default::default(),
            shared_workspace: false,
            max_result_bytes: (max_result_mib as usize) << 20,
            allow_file_sources: a.allow_file_sources || file.allow_file_sources == Some(true),
            allow_source_hosts: if a.allow_source_host.is_empty() {
                file.allow_source_hosts.clone()
            } else {
                a.allow_source_host.clone()
            },
            sandbox,
            limits,
        },
        backends,
    );
    let cancel = CancellationToken::new();
    eprintln!("flotilla worker {name}: {slots} slots, coordinator {coordinator}");
    let opts = flotilla_worker::remote::RemoteOptions {
        endpoint: coordinator,
        tls,
    };
    let serving = flotilla_worker::remote::serve(worker, opts, cancel.clone());
    tokio::pin!(serving);
    let code = tokio::select! {
        _ = shutdown_signal() => {
            cancel.cancel();
            let _ = serving.await;
            0
        }
        r = &mut serving => match r {
            Ok(()) => 0,
            Err(e) => fail(1, e),
        },
    };
    // Its cgroups go with it (those of a worker killed outright, when the next one starts).
    groups.cleanup();
    code
}

// ---- clients ------------------------------------------------------------------------------

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
    ) -> Result<ClientServiceClient<Channel>, String> {
        let mut tls = self.tls.clone();
        tls.fill(file);
        let coordinator = self
            .coordinator
            .clone()
            .or_else(|| file.coordinator.clone())
            .ok_or("no coordinator: pass --coordinator https://host:port (or FLOTILLA_COORDINATOR, or `coordinator` in --config)")?;
        let files = tls.files("client", loopback_host(&host_of(&coordinator)))?;
        let channel = flotilla_proto::tls::channel(&coordinator, files.as_ref())?;
        // Reports with big results come back whole: the limits are explicit, both ways.
        Ok(ClientServiceClient::new(channel)
            .max_decoding_message_size(flotilla_proto::frag::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(flotilla_proto::frag::MAX_MESSAGE_BYTES))
    }

    pub fn client(&self) -> Result<ClientServiceClient<Channel>, String> {
        self.client_with(&config::ConfigFile::default())
    }
}

/// Prints a failed call the way every client command does; returns the exit status.
pub fn rpc_fail(s: &tonic::Status) -> i32 {
    let (code, msg) = rpc_error(s);
    fail(code, msg)
}

/// A status error as a user reads it, with its exit code.
fn rpc_error(s: &tonic::Status) -> (i32, String) {
    let code = match s.code() {
        tonic::Code::NotFound | tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition => 2,
        _ => 1,
    };
    let msg = match s.code() {
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
            format!("the coordinator refused this client: {}", s.message())
        }
        tonic::Code::Unavailable
        | tonic::Code::Unknown
        | tonic::Code::Internal
        | tonic::Code::Cancelled => flotilla_proto::tls::explain(s),
        _ => s.message().to_owned(),
    };
    (code, msg)
}

#[derive(Debug, Args)]
pub struct LaunchArgs {
    #[command(flatten)]
    run: crate::RunArgs,
    #[command(flatten)]
    remote: ClientArgs,
    /// The code the agents work on: `auto` (the repository you launch from, with its
    /// uncommitted and untracked files; none outside one), `none` (a scratch directory per
    /// agent), or `git+URL#REF` (a repository the workers fetch themselves).
    #[arg(long, env = "FLOTILLA_SOURCE", value_name = "auto|none|git+URL#REF")]
    source: Option<String>,
    /// The most a launch sends of the repository's objects, in MiB [default: 2048].
    #[arg(long, env = "FLOTILLA_MAX_SOURCE_MIB", value_name = "MIB")]
    max_source_mib: Option<u64>,
    /// Send checked-out submodules' files with the source (as plain files in its snapshot);
    /// without it they are recorded by commit and their directories stay empty.
    #[arg(long, env = "FLOTILLA_SUBMODULES")]
    submodules: bool,
}

pub async fn launch(a: LaunchArgs) -> i32 {
    if a.run.serve.is_some() {
        return fail(
            2,
            "--serve is for `flotilla run`; on the fleet the coordinator serves every run's page at its --http address",
        );
    }
    let file = match config::load(a.run.config.as_deref()) {
        Ok(f) => f,
        Err(e) => return fail(2, e),
    };
    let mut client = match a.remote.client_with(&file) {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    // A name may be a workflow saved on the coordinator.
    let server = if std::path::Path::new(&a.run.script).exists() || a.run.script.ends_with(".js") {
        Vec::new()
    } else {
        match client
            .list_workflows(v1::ListWorkflowsRequest {
                protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            })
            .await
        {
            Ok(r) => r
                .into_inner()
                .workflows
                .into_iter()
                .map(FoundWorkflow::from)
                .collect(),
            Err(s) => return rpc_fail(&s),
        }
    };
    let resolved = match config::resolve_run_with(&a.run, &server, false) {
        Ok(r) => r,
        Err(e) => return fail(2, e),
    };
    if let crate::approve::Decision::Exit(code) =
        crate::approve::gate(&resolved, a.run.yes, a.run.plan)
    {
        return code;
    }
    let dirs = DirResolver::standard(&resolved.cwd, &resolved.workflows_dirs);
    let workflows = dirs
        .list()
        .into_iter()
        .filter_map(|(path, meta)| {
            let meta = meta.ok()?;
            let source = flotilla_coordinator::limits::read_file(
                &path,
                flotilla_coordinator::limits::SCRIPT_BYTES,
                "workflow",
            )
            .ok()?;
            Some(v1::SavedWorkflow {
                name: meta.name,
                source,
                origin: path.display().to_string(),
            })
        })
        .collect::<Vec<_>>();
    // The coordinator's own saved workflows come after the caller's, for `workflow(name)`.
    let mut workflows = workflows;
    for w in server {
        if !workflows.iter().any(|c| c.name == w.name) {
            workflows.push(w.into());
        }
    }
    let types = dirs.agent_types();
    let agent_definitions = types
        .iter()
        .filter_map(|t| {
            Some(v1::AgentDefinition {
                prompt: t.prompt.clone()?,
                name: t.name.clone(),
                model: t.model.clone().unwrap_or_default(),
                description: t.description.clone().unwrap_or_default(),
                tools: t.tools.clone(),
            })
        })
        .collect();
    let agent_types = types
        .into_iter()
        .map(|t| (t.name, t.model.unwrap_or_default()))
        .collect();
    let mut resolved = resolved;
    let sent = match send_source(&mut client, &a, &resolved.cwd).await {
        Ok(s) => s,
        Err(e) => return fail(2, e),
    };
    resolved.settings.source = sent.as_ref().map(|(s, _)| s.clone());
    let settings_json = match serde_json::to_string(&resolved.settings) {
        Ok(s) => s,
        Err(e) => return fail(1, e),
    };
    let req = v1::LaunchRequest {
        protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
        script: resolved.source,
        origin: resolved.origin,
        args_json: resolved.args.map(|v| v.to_string()),
        settings_json,
        resume_from: resolved.resume.unwrap_or_default(),
        workflows,
        agent_types,
        agent_definitions,
        inherit: false,
        saved_name: resolved.saved_name.clone().unwrap_or_default(),
    };
    match client.launch(req).await {
        Ok(r) => {
            let reply = r.into_inner();
            if a.run.json && reply.status != "rejected" {
                let mut v = serde_json::json!({"run_id": reply.run_id, "session_url": reply.session_url, "status": reply.status});
                if let Some((src, up)) = &sent {
                    v["source"] = serde_json::json!({
                        "repo": src.repo, "commit": src.commit, "origin": src.origin,
                        "uploaded_bytes": up.bytes, "uploaded_objects": up.objects,
                    });
                }
                println!("{v}");
                return 0;
            }
            print_launched(reply, a.run.json, None)
        }
        Err(s) => rpc_fail(&s),
    }
}

/// Decides the run's source and sends what the store lacks of it (`--source`).
async fn send_source(
    client: &mut ClientServiceClient<tonic::transport::Channel>,
    a: &LaunchArgs,
    cwd: &std::path::Path,
) -> Result<
    Option<(
        flotilla_coordinator::settings::SourceRef,
        crate::source::Uploaded,
    )>,
    String,
> {
    use crate::source::{Choice, Uploaded};
    match crate::source::parse_choice(a.source.as_deref())? {
        Choice::None => Ok(None),
        Choice::Url { url, rev } => Ok(Some((
            crate::source::url_source(&url, &rev),
            Uploaded::default(),
        ))),
        Choice::Auto => {
            let Some(snap) = crate::source::snapshot_with(cwd, a.submodules)? else {
                eprintln!(
                    "source: {} is not in a git repository, so the agents get scratch directories (--source none); launch from a checkout to send its code",
                    cwd.display()
                );
                return Ok(None);
            };
            for note in crate::source::notes(&snap) {
                eprintln!("source: {note}");
            }
            let max = a.max_source_mib.unwrap_or(2048).saturating_mul(1 << 20);
            let up = crate::source::upload(client, &snap, max).await?;
            eprintln!(
                "source: {} at {} ({})",
                crate::term::clean(&snap.origin),
                &snap.commit[..snap.commit.len().min(12)],
                if up.bytes == 0 {
                    "the coordinator has it already".to_owned()
                } else {
                    format!(
                        "sent {} objects, {} KiB",
                        up.objects,
                        up.bytes.div_ceil(1024)
                    )
                }
            );
            Ok(Some((
                flotilla_coordinator::settings::SourceRef {
                    repo: snap.repo,
                    commit: snap.commit,
                    url: None,
                    origin: snap.origin,
                    submodules: snap.submodules,
                },
                up,
            )))
        }
    }
}

/// Prints what a launch answered (the rejected report with `--json`, or the new run);
/// returns the exit status. `resumes`: the run it resumes, if any.
fn print_launched(reply: v1::LaunchReply, json: bool, resumes: Option<&str>) -> i32 {
    if reply.status == "rejected" {
        if json {
            println!("{}", reply.report_json);
        }
        return fail(2, reply.error);
    }
    if json {
        let mut v = serde_json::json!({"run_id": reply.run_id, "session_url": reply.session_url, "status": reply.status});
        if let Some(parent) = resumes {
            v["resumed_from"] = parent.into();
        }
        println!("{v}");
    } else if let Some(parent) = resumes {
        println!(
            "run {}  session {}  (resumes {parent})",
            reply.run_id, reply.session_url
        );
    } else {
        println!("run {}  session {}", reply.run_id, reply.session_url);
    }
    0
}

#[derive(Debug, Args)]
pub struct RunRefArgs {
    run_id: String,
    #[arg(long)]
    json: bool,
    /// TOML file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    remote: ClientArgs,
}

impl RunRefArgs {
    fn client(&self) -> Result<ClientServiceClient<Channel>, String> {
        self.remote
            .client_with(&config::load(self.config.as_deref())?)
    }
}

pub async fn wait(a: RunRefArgs) -> i32 {
    let mut client = match a.client() {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    match client.wait(v1::RunRef { run_id: a.run_id }).await {
        Ok(r) => match serde_json::from_str::<Report>(&r.into_inner().report_json) {
            Ok(report) => print_report(&report, a.json),
            Err(e) => fail(
                1,
                format!("the coordinator sent a report this client cannot read: {e}"),
            ),
        },
        Err(s) => rpc_fail(&s),
    }
}

/// `flotilla logs RUN --coordinator URL`: transcripts through the coordinator, which reads
/// its own store.
pub async fn logs_remote(
    remote: ClientArgs,
    run: &str,
    agent: Option<&str>,
    attempt: Option<u32>,
    json: bool,
) -> i32 {
    let mut client = match remote.client() {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    let reply = client
        .transcripts(v1::TranscriptsRequest {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            run_id: run.to_owned(),
            agent: agent.unwrap_or_default().to_owned(),
            attempt: attempt.unwrap_or(0),
        })
        .await;
    let reply = match reply {
        Ok(r) => r.into_inner(),
        Err(s) if s.code() == tonic::Code::NotFound => return fail(2, s.message()),
        Err(s) => return rpc_fail(&s),
    };
    let mut found = Vec::with_capacity(reply.agents_json.len());
    for a in &reply.agents_json {
        match serde_json::from_str::<flotilla_coordinator::history::AgentTranscript>(a) {
            Ok(t) => found.push(t),
            Err(e) => {
                return fail(
                    1,
                    format!("the coordinator sent a transcript this client cannot read: {e}"),
                );
            }
        }
    }
    crate::stored::print_transcripts(&found, json)
}

/// Follows a run on a coordinator: progress bars on a terminal, plain lines otherwise, then
/// the report (as `run` prints it).
pub async fn watch(a: RunRefArgs) -> i32 {
    use std::io::IsTerminal;
    let mut client = match a.client() {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    let bars = !a.json && std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
    let mode = crate::progress::Mode::pick(bars, !bars && !a.json);
    let (tx, rx) =
        tokio::sync::watch::channel(Arc::new(flotilla_coordinator::run::Snapshot::default()));
    let view = crate::progress::start(mode, rx);
    let run = v1::RunRef {
        run_id: a.run_id.clone(),
    };
    loop {
        match client.status(run.clone()).await {
            Ok(r) => match serde_json::from_str::<SnapshotView>(&r.into_inner().snapshot_json) {
                Ok(s) => {
                    let ended = s.status.is_some_and(|st| st.is_final());
                    let _ = tx.send(Arc::new(s.to_snapshot()));
                    if ended {
                        break;
                    }
                }
                Err(e) => {
                    view.finish().await;
                    return fail(
                        1,
                        format!("the coordinator sent a status this client cannot read: {e}"),
                    );
                }
            },
            // Not running there (ended before, or elsewhere): the report says the rest.
            Err(s) if s.code() == tonic::Code::NotFound => break,
            Err(s) => {
                view.finish().await;
                return rpc_fail(&s);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    view.finish().await;
    match client.wait(run).await {
        Ok(r) => match serde_json::from_str::<Report>(&r.into_inner().report_json) {
            Ok(report) => print_report(&report, a.json),
            Err(e) => fail(
                1,
                format!("the coordinator sent a report this client cannot read: {e}"),
            ),
        },
        Err(s) => rpc_fail(&s),
    }
}

pub async fn status(a: RunRefArgs) -> i32 {
    let mut client = match a.client() {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    match client
        .status(v1::RunRef {
            run_id: a.run_id.clone(),
        })
        .await
    {
        Ok(r) => {
            let r = r.into_inner();
            if a.json {
                println!("{}", r.snapshot_json);
                return 0;
            }
            match serde_json::from_str::<SnapshotView>(&r.snapshot_json) {
                Ok(s) => {
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(
                        out,
                        "{} {} · {}/{} agents done · {} running · {} failed · {} tokens · {} ms",
                        s.run_id,
                        s.status.map_or("running", |st| st.as_str()),
                        s.done,
                        s.agents,
                        s.running,
                        s.failed,
                        s.output_tokens,
                        s.elapsed_ms
                    );
                    for (title, done, total) in &s.groups {
                        let _ = writeln!(
                            out,
                            "  [{}] {done}/{total}",
                            if title.is_empty() {
                                "(no phase)"
                            } else {
                                title
                            }
                        );
                    }
                    0
                }
                Err(e) => fail(1, e),
            }
        }
        Err(s) => rpc_fail(&s),
    }
}

#[derive(Debug, Args)]
pub struct AgentRefArgs {
    #[command(flatten)]
    run: RunRefArgs,
    /// One agent of the run: its index (as `flotilla show` lists them) or its label.
    #[arg(long)]
    agent: Option<String>,
}

#[derive(Debug, Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    run: RunRefArgs,
    /// Run this script instead of the stored one (an edited version).
    #[arg(long, value_name = "FILE")]
    script: Option<PathBuf>,
    /// `args` for the script as JSON [default: the stored run's].
    #[arg(long)]
    args: Option<String>,
    /// content (reuse any completed call with the same key) or prefix (W51's ordered rule).
    #[arg(long, default_value = "content")]
    replay: String,
}

/// `flotilla resume RUN`: a paused run on the coordinator goes on; any other run (ended,
/// stopped, or run by a coordinator that is gone) starts again as a new run that reuses
/// its completed calls.
pub async fn resume(a: ResumeArgs) -> i32 {
    let mut client = match a.run.client() {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    if a.script.is_none() && a.args.is_none() {
        match client
            .control(v1::ControlRequest {
                run_id: a.run.run_id.clone(),
                action: "resume".into(),
                agent: String::new(),
            })
            .await
        {
            Ok(r) => {
                eprintln!("{}", r.into_inner().message);
                return 0;
            }
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => return rpc_fail(&s),
        }
    }
    let script = match &a.script {
        None => String::new(),
        Some(p) => match flotilla_coordinator::limits::read_file(
            p,
            flotilla_coordinator::limits::SCRIPT_BYTES,
            "script",
        ) {
            Ok(s) => s,
            Err(e) => return fail(2, e),
        },
    };
    if let Some(args) = &a.args
        && let Err(e) = serde_json::from_str::<serde_json::Value>(args)
    {
        return fail(2, format!("--args is not valid JSON: {e}"));
    }
    let replay = match a.replay.parse() {
        Ok(m) => m,
        Err(e) => return fail(2, e),
    };
    let settings = flotilla_coordinator::RunSettings {
        replay,
        ..Default::default()
    };
    let settings_json = match serde_json::to_string(&settings) {
        Ok(s) => s,
        Err(e) => return fail(1, e),
    };
    match client
        .launch(v1::LaunchRequest {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            script,
            origin: a
                .script
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            args_json: a.args.clone(),
            settings_json,
            resume_from: a.run.run_id.clone(),
            workflows: Vec::new(),
            agent_types: Default::default(),
            agent_definitions: Vec::new(),
            saved_name: String::new(),
            inherit: true,
        })
        .await
    {
        Ok(r) => print_launched(r.into_inner(), a.run.json, Some(&a.run.run_id)),
        Err(s) => rpc_fail(&s),
    }
}

/// `pause` / `resume` a run.
pub async fn control(a: RunRefArgs, action: &str) -> i32 {
    control_call(&a, action, "").await
}

async fn control_call(a: &RunRefArgs, action: &str, agent: &str) -> i32 {
    let mut client = match a.client() {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    match client
        .control(v1::ControlRequest {
            run_id: a.run_id.clone(),
            action: action.to_owned(),
            agent: agent.to_owned(),
        })
        .await
    {
        Ok(r) => {
            let msg = r.into_inner().message;
            if a.json {
                println!("{}", serde_json::json!({ "message": msg }));
            } else {
                eprintln!("{msg}");
            }
            0
        }
        Err(s) => rpc_fail(&s),
    }
}

pub async fn restart(a: AgentRefArgs) -> i32 {
    let Some(agent) = a.agent.as_deref() else {
        return fail(
            2,
            "name the agent to restart: --agent INDEX or --agent LABEL",
        );
    };
    control_call(&a.run, "restart_agent", agent).await
}

pub async fn stop(a: AgentRefArgs) -> i32 {
    if let Some(agent) = a.agent.as_deref() {
        return control_call(&a.run, "stop_agent", agent).await;
    }
    let a = a.run;
    let mut client = match a.client() {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    match client
        .stop(v1::RunRef {
            run_id: a.run_id.clone(),
        })
        .await
    {
        Ok(_) => {
            eprintln!("stopping {}", a.run_id);
            0
        }
        Err(s) => rpc_fail(&s),
    }
}

#[derive(Debug, clap::Subcommand)]
pub enum TokenCommand {
    /// Issue a session token to your client certificate and print a sign-in link.
    Create(TokenArgs),
}

#[derive(Debug, Args)]
pub struct TokenArgs {
    /// How long the token lives (at most 30d) [default: 12h].
    #[arg(long)]
    ttl: Option<String>,
    /// Print {token, login_url, subject, expires_unix} as JSON.
    #[arg(long)]
    json: bool,
    /// TOML file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    remote: ClientArgs,
}

pub async fn token_create(a: TokenArgs) -> i32 {
    let ttl_secs = match a.ttl.as_deref().map(|t| config::parse_duration("--ttl", t)) {
        None => 0,
        Some(Ok(d)) if d.as_secs() > 0 => d.as_secs(),
        Some(Ok(_)) => return fail(2, "--ttl must be at least 1s; e.g. --ttl 12h"),
        Some(Err(e)) => return fail(2, e),
    };
    let mut client = match config::load(a.config.as_deref()).and_then(|f| a.remote.client_with(&f))
    {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    match client
        .create_token(v1::CreateTokenRequest { ttl_secs })
        .await
    {
        Ok(r) => {
            let r = r.into_inner();
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"token": r.token, "login_url": r.login_url, "subject": r.subject, "expires_unix": r.expires_unix})
                );
            } else {
                println!("{}", r.login_url);
                eprintln!(
                    "open the link to sign in as {} (or send `Authorization: Bearer <token>`); it expires at {}",
                    r.subject,
                    humantime::format_rfc3339_seconds(
                        std::time::UNIX_EPOCH + std::time::Duration::from_secs(r.expires_unix)
                    )
                );
            }
            0
        }
        Err(s) => rpc_fail(&s),
    }
}

#[derive(Debug, Args)]
pub struct WorkersArgs {
    #[arg(long)]
    json: bool,
    /// TOML file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    remote: ClientArgs,
}

pub async fn workers(a: WorkersArgs) -> i32 {
    let mut client = match config::load(a.config.as_deref()).and_then(|f| a.remote.client_with(&f))
    {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    match client.list_workers(v1::ListWorkersRequest {}).await {
        Ok(r) => {
            let workers = r.into_inner().workers;
            if a.json {
                let v: Vec<serde_json::Value> = workers
                    .iter()
                    .map(|w| serde_json::json!({"name": w.name, "state": if w.attached { "attached" } else { "cut off" }, "slots": w.slots, "busy": w.busy, "backends": w.backends, "models": w.models, "labels": w.labels}))
                    .collect();
                println!("{}", serde_json::Value::Array(v));
            } else if workers.is_empty() {
                eprintln!("no workers attached");
            } else {
                println!(
                    "{:<32} {:<9} {:>5} {:>5}  BACKENDS",
                    "WORKER", "STATE", "SLOTS", "BUSY"
                );
                for w in workers {
                    println!(
                        "{:<32} {:<9} {:>5} {:>5}  {}",
                        w.name,
                        if w.attached { "attached" } else { "cut off" },
                        w.slots,
                        w.busy,
                        w.backends.join(",")
                    );
                }
            }
            0
        }
        Err(s) => rpc_fail(&s),
    }
}

/// `flotilla runs --coordinator URL`: the coordinator's store, listed by the coordinator.
pub async fn list_remote(remote: ClientArgs, json: bool) -> i32 {
    let mut client = match remote.client() {
        Ok(c) => c,
        Err(e) => return fail(2, e),
    };
    match client.list_runs(v1::ListRunsRequest {}).await {
        Ok(r) => {
            let text = r.into_inner().runs_json;
            if json {
                println!("{text}");
                return 0;
            }
            let runs: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap_or_default();
            println!(
                "{:<18} {:<10} {:<7} {:<21} WORKFLOW",
                "RUN", "STATUS", "AGENTS", "CREATED"
            );
            for r in runs {
                println!(
                    "{:<18} {:<10} {:<7} {:<21} {}",
                    r["run_id"].as_str().unwrap_or(""),
                    r["status"].as_str().unwrap_or(""),
                    r["agents"],
                    r["created"].as_str().unwrap_or(""),
                    crate::term::clean(r["workflow"].as_str().unwrap_or(""))
                );
            }
            0
        }
        Err(s) => rpc_fail(&s),
    }
}
