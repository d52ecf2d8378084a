//! `flotilla coordinator`: the gRPC face, the session pages, the store and the leases.

use super::shutdown_signal;
use flotilla_proto::Problem;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use flotilla_coordinator::host::Coordinator;
use flotilla_coordinator::host::EtcdLeaseStore;
use flotilla_coordinator::host::LeaseStore;
use flotilla_coordinator::host::MemoryLeaseStore;
use flotilla_coordinator::host::{self, RunRegistry, ServerOptions};
use flotilla_proto::tls::TlsFiles;
use tokio_util::sync::CancellationToken;

use crate::client::*;
use crate::{config, fail_kind};

#[derive(Debug, Args)]
pub struct CoordinatorArgs {
    /// gRPC address for workers and clients [default: 127.0.0.1:7443].
    #[arg(long, env = "FLOTILLA_LISTEN")]
    listen: Option<SocketAddr>,
    /// Address of the session pages (session URLs point here) [default: 127.0.0.1:7080].
    #[arg(long, env = "FLOTILLA_HTTP")]
    http: Option<SocketAddr>,
    /// Operator listener: `GET /metrics` of every namespace with no session token, for
    /// Prometheus and the autoscaler. Bind it to a private address only your scraper reaches
    /// (it serves nothing else: no run, page or control). Off unless given.
    #[arg(long, env = "FLOTILLA_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Serve the operator listener over mutual TLS with this coordinator's certificate: a
    /// scraper shows a certificate of the fleet's CA (Prometheus: `scheme: https` and a
    /// `tls_config` with its ca, cert and key).
    #[arg(long, env = "FLOTILLA_METRICS_TLS")]
    metrics_tls: bool,
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
    /// A run that has waited this long on its questions alone (`ask()`, no agent running) is
    /// parked: its script is set aside and it holds no thread until an answer or a question's
    /// deadline wakes it (`off`: never) [default: 30s].
    #[arg(long, env = "FLOTILLA_PARK_AFTER")]
    park_after: Option<String>,
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
    /// The models every run here may use (aliases such as sonnet, or model ids;
    /// comma-separated): a run's own --allowed-models are kept within them, and an agent
    /// asking for another model runs on a substitute, with a warning naming both.
    #[arg(
        long = "allowed-models",
        env = "FLOTILLA_ALLOWED_MODELS",
        value_delimiter = ',',
        value_name = "MODEL"
    )]
    allowed_models: Vec<String>,
    /// Let a push take the name of a bundled workflow (deep-research, code-review, ...).
    #[arg(long, env = "FLOTILLA_ALLOW_SHADOW_BUNDLED")]
    allow_shadow_bundled: bool,
    /// Accept runs whose source is a path on the workers' own disks (`git+file://` or a
    /// path): say so only when the workers were started with --allow-file-sources, which
    /// alone fetch them. Without it such a launch is refused with the fix.
    #[arg(long, env = "FLOTILLA_ALLOW_FILE_SOURCES")]
    allow_file_sources: bool,
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
    /// Connections one peer (an IPv4 address, an IPv6 /64) may hold open at once on each
    /// listener; past it its new ones are closed at once (raise it when many clients share
    /// an address, e.g. behind a proxy) [default: 256].
    #[arg(long, env = "FLOTILLA_MAX_CONNECTIONS_PER_PEER", value_name = "N")]
    max_connections_per_peer: Option<usize>,
    /// Longest a page request's headers may take to arrive, and then its body; a client that
    /// trickles them is cut off [default: 10s].
    #[arg(long, env = "FLOTILLA_READ_TIMEOUT", value_name = "DUR")]
    read_timeout: Option<String>,
    /// The name coordinators' certificates carry, checked when a standby calls the leader at
    /// its --advertise address (for addresses no certificate names, such as pod IPs)
    /// [default: the address's host].
    #[arg(long, env = "FLOTILLA_PEER_NAME", value_name = "NAME")]
    peer_name: Option<String>,
    /// The file with the secret (at least 16 bytes) that signs runs' end webhooks
    /// (`launch --notify URL`); without it (or FLOTILLA_NOTIFY_SECRET) such launches are
    /// refused.
    #[arg(long, env = "FLOTILLA_NOTIFY_SECRET_FILE", value_name = "FILE")]
    notify_secret_file: Option<PathBuf>,
    /// Delete runs older than this (`30d`) and the stored objects no other run uses, every
    /// --retention-every, while this coordinator leads [default: keep everything].
    #[arg(long, env = "FLOTILLA_RETENTION", value_name = "DUR")]
    retention: Option<String>,
    /// With --retention: keep failed and interrupted runs whatever their age.
    #[arg(long, env = "FLOTILLA_RETENTION_KEEP_FAILED")]
    retention_keep_failed: bool,
    /// How often the retention sweep runs [default: 24h].
    #[arg(long, env = "FLOTILLA_RETENTION_EVERY", value_name = "DUR")]
    retention_every: Option<String>,
    #[command(flatten)]
    tls: TlsArgs,
}

/// The listeners' limits from flags, then the config file, then the defaults.
fn listen_limits(
    a: &CoordinatorArgs,
    file: &config::ConfigFile,
) -> Result<flotilla_coordinator::host::ConnLimits, Problem> {
    let mut limits = flotilla_coordinator::host::ConnLimits::default();
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
    if let Some(n) = a.max_connections_per_peer.or(file.max_connections_per_peer) {
        limits.max_per_peer = n;
    }
    if let Some(s) = a.read_timeout.as_ref().or(file.read_timeout.as_ref()) {
        limits.read = config::parse_duration("--read-timeout", s)?;
    }
    if limits.handshake.is_zero()
        || limits.idle.is_zero()
        || limits.read.is_zero()
        || limits.max_connections == 0
        || limits.max_per_peer == 0
    {
        return Err(Problem::invalid(
            "--handshake-timeout, --idle-timeout, --read-timeout, --max-connections and --max-connections-per-peer must be above zero",
        ));
    }
    Ok(limits)
}

async fn lease_store(a: &Settings, own: Option<&TlsFiles>) -> Result<Arc<dyn LeaseStore>, Problem> {
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
                .ok_or(Problem::unavailable(
                    "an https:// etcd needs --etcd-ca (or the coordinator's --tls-dir)",
                ))?,
            cert: a
                .etcd_cert
                .clone()
                .or_else(|| own.map(|f| f.cert.clone()))
                .ok_or(Problem::unavailable("an https:// etcd needs --etcd-cert"))?,
            key: a
                .etcd_key
                .clone()
                .or_else(|| own.map(|f| f.key.clone()))
                .ok_or(Problem::unavailable("an https:// etcd needs --etcd-key"))?,
        };
        let host = host_of(&a.etcd[0]);
        Some(
            files
                .client_config(&host)
                .map_err(|e| Problem::unavailable(e.to_string()))?,
        )
    } else {
        None
    };
    let store = EtcdLeaseStore::connect(&a.etcd, tls)
        .await
        .map_err(|e| Problem::unavailable(e.to_string()))?;
    Ok(Arc::new(store))
}

/// A coordinator's settings, in layers: the config file, then the environment, then flags
/// (clap reads each flag's environment variable), then the defaults — checked before anything
/// starts.
#[derive(Debug, Clone)]
struct Settings {
    listen: SocketAddr,
    http: SocketAddr,
    /// The operator listener's address (`--metrics-listen`), if any.
    metrics_listen: Option<SocketAddr>,
    /// It asks for client certificates (`--metrics-tls`).
    metrics_tls: bool,
    store_url: String,
    etcd: Vec<String>,
    /// CA, certificate and key for an https:// etcd (the coordinator's own files if unset).
    etcd_ca: Option<PathBuf>,
    etcd_cert: Option<PathBuf>,
    etcd_key: Option<PathBuf>,
    worker_ttl: std::time::Duration,
    /// `--park-after` (`None`: off).
    park_after: Option<std::time::Duration>,
    /// `FLOTILLA_ADMISSION` (on unless `off`).
    admission: bool,
    /// `FLOTILLA_AFFINITY` (on unless `off`).
    affinity: bool,
    advertise: Option<String>,
    cache_dir: PathBuf,
    publishers: Vec<String>,
    allowed_models: Vec<String>,
    shadow_bundled: bool,
    saved_only: bool,
    file_sources: bool,
    limits: flotilla_coordinator::host::ConnLimits,
    peer_name: Option<String>,
    /// The retention policy and how often it runs, if any.
    retention: Option<(
        flotilla_coordinator::host::RetentionPolicy,
        std::time::Duration,
    )>,
    /// The namespaces' policies (`[namespaces.*]` in the config file).
    namespaces: flotilla_coordinator::host::Namespaces,
    /// What one attempt can use (`[attempt_usage]` in the config file).
    attempt_usage: flotilla_coordinator::host::UsageBounds,
}

/// The webhook signer: `--notify-secret-file`, else `FLOTILLA_NOTIFY_SECRET`.
fn notifier(
    a: &CoordinatorArgs,
    file: &config::ConfigFile,
) -> Result<Option<Arc<flotilla_coordinator::host::Notifier>>, Problem> {
    let Some(path) = a
        .notify_secret_file
        .as_ref()
        .or(file.notify_secret_file.as_ref())
    else {
        return config::notifier_from_env().map_err(|e| Problem::invalid(e.to_string()));
    };
    let secret = std::fs::read(path).map_err(|e| {
        Problem::invalid(format!(
            "cannot read --notify-secret-file {}: {e}",
            path.display()
        ))
    })?;
    let secret = secret.trim_ascii();
    flotilla_coordinator::host::Notifier::new(secret)
        .map(|n| Some(Arc::new(n)))
        .map_err(|e| Problem::invalid(format!("--notify-secret-file {}: {e}", path.display())))
}

/// `--retention` and its companions.
fn retention(
    a: &CoordinatorArgs,
    file: &config::ConfigFile,
) -> Result<
    Option<(
        flotilla_coordinator::host::RetentionPolicy,
        std::time::Duration,
    )>,
    Problem,
> {
    let Some(older) = a.retention.as_ref().or(file.retention.as_ref()) else {
        return Ok(None);
    };
    let older_than = config::parse_duration("--retention", older)?;
    if older_than < std::time::Duration::from_secs(1) {
        return Err(Problem::invalid(
            "--retention must be at least 1s; e.g. --retention 30d",
        ));
    }
    let every = match a.retention_every.as_ref().or(file.retention_every.as_ref()) {
        Some(e) => config::parse_duration("--retention-every", e)?,
        None => std::time::Duration::from_secs(24 * 3600),
    };
    if every < std::time::Duration::from_secs(1) {
        return Err(Problem::invalid(
            "--retention-every must be at least 1s; e.g. --retention-every 24h",
        ));
    }
    Ok(Some((
        flotilla_coordinator::host::RetentionPolicy {
            older_than,
            keep_failed: a.retention_keep_failed || file.retention_keep_failed.unwrap_or(false),
            dry_run: false,
        },
        every,
    )))
}

impl Settings {
    fn layered(a: &CoordinatorArgs, file: &config::ConfigFile) -> Result<Settings, Problem> {
        let pick = |flag: &Option<PathBuf>, from_file: &Option<PathBuf>| {
            flag.clone().or_else(|| from_file.clone())
        };
        Ok(Settings {
            listen: a
                .listen
                .or(file.listen)
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 7443))),
            http: a
                .http
                .or(file.http)
                .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 7080))),
            metrics_listen: a.metrics_listen.or(file.metrics_listen),
            metrics_tls: a.metrics_tls || file.metrics_tls.unwrap_or(false),
            store_url: config::store_url(a.store.clone().or_else(|| file.store.clone())),
            etcd: if a.etcd.is_empty() {
                file.etcd.clone()
            } else {
                a.etcd.clone()
            },
            etcd_ca: pick(&a.etcd_ca, &file.etcd_ca),
            etcd_cert: pick(&a.etcd_cert, &file.etcd_cert),
            etcd_key: pick(&a.etcd_key, &file.etcd_key),
            worker_ttl: worker_ttl(a.worker_ttl.as_ref().or(file.worker_ttl.as_ref()))?,
            park_after: match a.park_after.as_ref().or(file.park_after.as_ref()) {
                None => Some(std::time::Duration::from_secs(30)),
                Some(off) if off == "off" => None,
                Some(d) => Some(config::parse_duration("--park-after", d)?),
            },
            admission: config::admission_from_env()?,
            affinity: config::affinity_from_env()?,
            advertise: a.advertise.clone().or_else(|| file.advertise.clone()),
            cache_dir: pick(&a.cache_dir, &file.cache_dir).unwrap_or_else(|| {
                dirs::cache_dir()
                    .unwrap_or_else(std::env::temp_dir)
                    .join("flotilla")
                    .join("coordinator")
            }),
            publishers: if a.publishers.is_empty() {
                file.publishers.clone()
            } else {
                a.publishers.clone()
            },
            allowed_models: if a.allowed_models.is_empty() {
                file.available_models.clone()
            } else {
                a.allowed_models.clone()
            },
            shadow_bundled: a.allow_shadow_bundled || file.allow_shadow_bundled.unwrap_or(false),
            saved_only: a.saved_only || file.saved_only.unwrap_or(false),
            file_sources: a.allow_file_sources || file.allow_file_sources == Some(true),
            limits: listen_limits(a, file)?,
            retention: retention(a, file)?,
            peer_name: a.peer_name.clone().or_else(|| file.peer_name.clone()),
            namespaces: flotilla_coordinator::host::Namespaces::new(file.namespaces.clone())
                .map_err(|e| Problem::invalid(format!("the config file's [namespaces]: {e}")))?,
            attempt_usage: {
                let bounds = file.attempt_usage.clone();
                bounds.check().map_err(|e| {
                    Problem::invalid(format!("the config file's [attempt_usage]: {e}"))
                })?;
                bounds
            },
        })
    }
}

/// `--worker-ttl`: at least etcd's shortest lease.
fn worker_ttl(given: Option<&String>) -> Result<std::time::Duration, Problem> {
    let Some(s) = given else {
        return Ok(flotilla_coordinator::host::WORKER_LEASE_TTL);
    };
    let d = config::parse_duration("--worker-ttl", s)?;
    if d < std::time::Duration::from_secs(2) {
        return Err(Problem::invalid(
            "--worker-ttl must be at least 2s (etcd's shortest lease); e.g. --worker-ttl 10s",
        ));
    }
    Ok(d)
}

/// The key session tokens are signed with: derived from the coordinator's private key, so
/// coordinators sharing it accept each other's tokens and a restart signs nobody out. Without
/// TLS there is none, and the pages are served on loopback only.
fn token_key(
    tls: Option<&TlsFiles>,
    http: SocketAddr,
) -> Result<Option<flotilla_coordinator::host::TokenKey>, Problem> {
    match tls {
        Some(files) => std::fs::read(&files.key)
            .map(|secret| Some(flotilla_coordinator::host::TokenKey::derive(&secret)))
            .map_err(|e| Problem::invalid(format!("cannot read {}: {e}", files.key.display()))),
        None if http.ip().is_loopback() => Ok(None),
        None => Err(Problem::invalid(format!(
            "--insecure serves the session pages without sign-in, so only on loopback; use --http 127.0.0.1:{} (or TLS)",
            http.port()
        ))),
    }
}

/// With etcd, coordinators form a group: one leads, the others stand by and take over. `lost`
/// fires when this one's lease lapses.
async fn join_group(
    leases: &Arc<dyn flotilla_coordinator::host::LeaseStore>,
    s: &Settings,
    tls: bool,
    tenure: Arc<flotilla_coordinator::host::Tenure>,
) -> Result<Arc<flotilla_coordinator::host::Leadership>, Problem> {
    let advertise = s.advertise.clone().unwrap_or_else(|| {
        let scheme = if tls { "https" } else { "http" };
        format!("{scheme}://{}", s.listen)
    });
    let l = flotilla_coordinator::host::Leadership::join(
        leases.clone(),
        advertise.clone(),
        s.worker_ttl,
        tenure,
    )
    .await?;
    eprintln!("coordinator group member at {advertise} (one leads; the others stand by)");
    Ok(l)
}

/// Serves the group `l` for `coordinator` (built with `l` as its claims): its runs' owner
/// keys are released as they end.
fn serve_group(
    l: &Arc<flotilla_coordinator::host::Leadership>,
    coordinator: &Arc<Coordinator>,
    registry: &Arc<RunRegistry>,
    ttl: std::time::Duration,
    lost: CancellationToken,
    process: &Process,
) {
    let releaser = l.clone();
    let releases = process.tasks.clone();
    registry.on_end(Arc::new(move |run: String| {
        let l = releaser.clone();
        releases.spawn(async move { l.release(&run).await });
    }));
    l.serve(
        coordinator.clone(),
        registry.clone(),
        ttl,
        lost,
        &host::Tasks::over(process.tasks.clone(), process.cancel.clone()),
    );
}

/// The serving process's own tasks, waited for (a bounded while) before it exits, and the
/// token that tells them to stop.
struct Process {
    tasks: tokio_util::task::TaskTracker,
    cancel: CancellationToken,
}

/// Who may push, and whether launches are allowed: the disable switch is read again on every
/// launch (the environment, then the config file).
fn launch_policy(s: &Settings, config_path: Option<PathBuf>) -> host::LaunchPolicy {
    host::LaunchPolicy {
        publishers: s.publishers.clone(),
        shadow_bundled: s.shadow_bundled,
        saved_only: s.saved_only,
        file_sources: s.file_sources,
        disabled: Arc::new(move || {
            let file = config::load(config_path.as_deref()).unwrap_or_default();
            config::workflows_disabled(&file)
        }),
    }
}

pub async fn coordinator(mut a: CoordinatorArgs) -> i32 {
    let file = match config::load(a.config.as_deref()) {
        Ok(f) => f,
        Err(e) => return crate::refuse(e),
    };
    a.tls.fill(&file);
    let s = match Settings::layered(&a, &file) {
        Ok(s) => s,
        Err(e) => return crate::refuse(e),
    };
    let tls = match a.tls.files("coordinator", s.listen.ip().is_loopback()) {
        Ok(t) => t,
        Err(e) => return crate::refuse(e),
    };
    let tokens = match token_key(tls.as_ref(), s.http) {
        Ok(t) => t,
        Err(e) => return crate::refuse(e),
    };
    let store = match host::open_store(&s.store_url) {
        Ok(st) => st,
        Err(e) => return crate::refuse(e.into()),
    };
    // A store set up wrong stops the coordinator here, with the fix (exit 2: its settings;
    // exit 1: nothing answers), rather than failing each run.
    if let Err(e) = store.check().await {
        return crate::fail_kind(e.kind(), e.to_string());
    }
    // In a group, the store writes only while this coordinator's lease is sure to be held.
    let tenure = Arc::new(flotilla_coordinator::host::Tenure::open());
    let store = if s.etcd.is_empty() {
        store
    } else {
        store.gated(tenure.clone())
    };
    let leases = match lease_store(&s, tls.as_ref()).await {
        Ok(l) => l,
        Err(e) => return crate::refuse(e),
    };
    let leases: Arc<dyn flotilla_coordinator::host::LeaseStore> = if s.etcd.is_empty() {
        leases
    } else {
        flotilla_coordinator::host::GatedLeases::new(leases, tenure.clone())
    };
    let notifier = match notifier(&a, &file) {
        Ok(n) => n,
        Err(e) => return crate::refuse(e),
    };
    let group = if s.etcd.is_empty() {
        None
    } else {
        match join_group(&leases, &s, tls.is_some(), tenure).await {
            Ok(l) => Some(l),
            Err(e) => return crate::refuse(e),
        }
    };
    let coordinator = Arc::new(Coordinator::build(
        store,
        leases,
        flotilla_coordinator::host::CoordinatorOptions {
            dispatch: flotilla_coordinator::host::DispatchOptions {
                worker_ttl: s.worker_ttl,
                admission: s.admission,
                affinity: s.affinity,
                usage: s.attempt_usage.clone(),
                ..Default::default()
            },
            claims: group
                .clone()
                .map(|l| l as Arc<dyn flotilla_coordinator::host::RunClaims>),
            cache_dir: Some(s.cache_dir.clone()),
            notifier,
            allowed_models: s.allowed_models.clone(),
            namespaces: Some(s.namespaces.clone()),
            budget_pauses: true,
            answers_from_store: false,
            page_base: Some(format!("http://{}", s.http)),
            park_after: s.park_after,
        },
    ));
    let registry = Arc::new(RunRegistry::default());
    // A parked run is woken by adopting it again, here.
    registry.wake_with(coordinator.store().clone(), {
        let coordinator = coordinator.clone();
        Arc::new(move |run: String, owners| {
            let coordinator = coordinator.clone();
            Box::pin(async move {
                coordinator
                    .wake(&run, owners)
                    .await
                    .map_err(|r| flotilla_proto::Problem::new(r.kind, r.message))
            })
        })
    });
    let lost = CancellationToken::new();
    let process = Process {
        tasks: tokio_util::task::TaskTracker::new(),
        cancel: CancellationToken::new(),
    };
    if let Some(l) = &group {
        serve_group(
            l,
            &coordinator,
            &registry,
            s.worker_ttl,
            lost.clone(),
            &process,
        );
    }
    let opts = ServerOptions {
        listen: s.listen,
        tls,
        limits: s.limits,
        keepalive: s.worker_ttl / 3,
        tokens: tokens.clone(),
        session_base: format!("http://{}", s.http),
        policy: launch_policy(&s, a.config.clone()),
        peer_name: s.peer_name.clone(),
    };
    announce(&s, &opts);
    serve_until_stopped(coordinator, registry, &s, opts, lost, process).await
}

fn announce(s: &Settings, opts: &ServerOptions) {
    let leases_at = if s.etcd.is_empty() {
        "in memory".to_owned()
    } else {
        format!("in etcd at {}", s.etcd.join(","))
    };
    eprintln!(
        "flotilla coordinator listening on {} ({}), store {}, leases {leases_at}",
        s.listen,
        if opts.tls.is_some() {
            "mTLS"
        } else {
            "insecure"
        },
        s.store_url,
    );
    eprintln!(
        "session pages on http://{}/runs ({})",
        s.http,
        if opts.tokens.is_some() {
            "sign in with `flotilla token create`"
        } else {
            "no sign-in: --insecure"
        }
    );
    if let Some(at) = s.metrics_listen {
        if s.metrics_tls {
            eprintln!(
                "operator metrics on https://{at}/metrics (every namespace; a client certificate of the fleet's CA is asked)"
            );
        } else {
            eprintln!(
                "operator metrics on http://{at}/metrics (every namespace, no sign-in: only your scraper should reach this address)"
            );
        }
    }
}

/// Serves gRPC and the pages until a signal, a lost lease or a failed listener ends it.
async fn serve_until_stopped(
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    s: &Settings,
    opts: ServerOptions,
    lost: CancellationToken,
    process: Process,
) -> i32 {
    let Process { tasks, cancel } = process;
    let metrics_tls = match (s.metrics_tls, &opts.tls) {
        (false, _) => None,
        (true, Some(files)) => match files.rustls_server_config() {
            Ok(c) => Some(c),
            Err(e) => {
                return crate::refuse(Problem::invalid(format!(
                    "--metrics-tls: cannot use this coordinator's certificate: {e}"
                )));
            }
        },
        (true, None) => {
            return crate::refuse(Problem::invalid(
                "--metrics-tls serves with this coordinator's certificate: give --tls-dir (there is none with --insecure)",
            ));
        }
    };
    let pages = tasks.spawn(flotilla_coordinator::host::serve_pages(
        coordinator.clone(),
        registry.clone(),
        flotilla_coordinator::host::WebOptions {
            listen: s.http,
            auth: opts.tokens.clone(),
            limits: s.limits,
        },
        cancel.clone(),
    ));
    let metrics = s.metrics_listen.map(|at| {
        tasks.spawn(flotilla_coordinator::host::serve_metrics(
            coordinator.clone(),
            registry.clone(),
            at,
            s.limits,
            metrics_tls.clone(),
            cancel.clone(),
        ))
    });
    let metrics = async move {
        match metrics {
            Some(m) => m.await,
            None => std::future::pending().await,
        }
    };
    let serving = tasks.spawn(host::serve_grpc(
        coordinator.clone(),
        registry.clone(),
        opts,
        cancel.clone(),
    ));
    if let Some(n) = coordinator.notifier().cloned() {
        tasks.spawn(send_outbox(coordinator.clone(), n, cancel.clone()));
    }
    if let Some((policy, every)) = s.retention.clone() {
        tasks.spawn(retain(
            coordinator.clone(),
            registry.clone(),
            policy,
            every,
            cancel.clone(),
        ));
    }
    let ended = |r: Result<Result<(), flotilla_proto::Problem>, tokio::task::JoinError>| match r {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => crate::refuse(e),
        Err(e) => fail_kind(flotilla_proto::ErrorKind::Unavailable, e.to_string()),
    };
    let code = tokio::select! {
        _ = shutdown_signal() => {
            // In a group: hand over at once rather than leave the runs and workers waiting
            // for this coordinator's lease to lapse.
            if let Some(l) = coordinator.leadership() {
                l.resign(&lost).await;
            }
            0
        }
        _ = lost.cancelled() => after_lapse(&coordinator).await,
        r = serving => ended(r),
        r = pages => ended(r),
        r = metrics => ended(r),
    };
    cancel.cancel();
    tasks.close();
    let (served, dispatched) = tokio::join!(
        tokio::time::timeout(SHUTDOWN_DRAIN, tasks.wait()),
        coordinator.shutdown_and_wait(SHUTDOWN_DRAIN),
    );
    if served.is_err() || !dispatched {
        tracing::warn!(
            "some tasks were still running {} s after the coordinator was told to stop; it stops without them",
            SHUTDOWN_DRAIN.as_secs()
        );
    }
    code
}

/// How long a stopping coordinator waits for its tasks (the listeners, the pages, the
/// dispatcher's links, leases and key writes) to end.
const SHUTDOWN_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// A coordinator whose lease lapsed (a resignation ends otherwise). With another coordinator
/// leading, it stops as it always has: that one has its runs and workers, and this one,
/// restarted, stands by. With nobody leading — alone in its group, paused past its lease —
/// stopping would leave its runs waiting for someone to restart it, so it starts again in
/// its own place: the same binary, arguments, pid, listeners and log, with a fresh lease. It
/// campaigns, leads, and adopts its runs from storage as any successor does (journal sealed,
/// replayed as a new generation, the workers' attempts claimed), fenced as always: nothing of
/// the deposed tenure stays in memory to write.
async fn after_lapse(coordinator: &Coordinator) -> i32 {
    let holder = match coordinator.leadership() {
        Some(l) => l.seat_holder().await,
        None => Ok(None),
    };
    match holder {
        Ok(Some(leader)) => fail_kind(
            flotilla_proto::ErrorKind::Unavailable,
            format!(
                "this coordinator's lease in etcd lapsed, so another coordinator may own its runs now ({leader} leads); stopping (restart it to rejoin as a standby)"
            ),
        ),
        Err(e) => fail_kind(
            flotilla_proto::ErrorKind::Unavailable,
            format!(
                "this coordinator's lease in etcd lapsed, and etcd does not say who leads now ({e}); stopping (restart it to rejoin the group)"
            ),
        ),
        Ok(None) => {
            tracing::warn!(
                "this coordinator's lease in etcd lapsed and no other coordinator leads: starting again in its own place to campaign again (its runs are adopted from storage, as after any takeover)"
            );
            let e = start_again_in_place();
            fail_kind(
                flotilla_proto::ErrorKind::Unavailable,
                format!(
                    "cannot start this coordinator again in its own place ({e}); stopping (restart it to rejoin the group)"
                ),
            )
        }
    }
}

/// Replaces this process with a new run of its own binary and arguments (its pid, environment,
/// standard streams and log stay; every other descriptor closes, listeners included). Returns
/// only if that fails.
fn start_again_in_place() -> std::io::Error {
    use std::os::unix::process::CommandExt;
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| "flotilla".into());
    // The running binary itself, even if its file was replaced or removed since it started.
    std::process::Command::new("/proc/self/exe")
        .arg0(arg0)
        .args(args)
        .exec()
}

/// Webhooks an earlier coordinator did not finish, taken up while this one leads (at once,
/// then every few seconds: the outbox is one listing).
async fn send_outbox(
    coordinator: Arc<Coordinator>,
    notifier: Arc<flotilla_coordinator::host::Notifier>,
    cancel: CancellationToken,
) {
    loop {
        let leading = coordinator
            .leadership()
            .is_none_or(|l| *l.office().borrow());
        if leading && let Err(e) = notifier.resume(coordinator.store()).await {
            tracing::warn!(error = %e, "cannot read the webhook outbox; trying again");
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
        }
    }
}

/// The retention sweep, every `every` while this coordinator leads (a standby sweeps
/// nothing: the leader's sweep covers the shared store).
async fn retain(
    coordinator: Arc<Coordinator>,
    registry: Arc<RunRegistry>,
    policy: flotilla_coordinator::host::RetentionPolicy,
    every: std::time::Duration,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if coordinator
            .leadership()
            .is_some_and(|l| !*l.office().borrow())
        {
            continue;
        }
        match flotilla_coordinator::host::sweep(
            coordinator.store(),
            &policy,
            &registry.running_ids(),
        )
        .await
        {
            Ok(swept) => tracing::info!(
                runs = swept.runs.len(),
                kept = swept.kept.len(),
                payloads = swept.payloads,
                source_objects = swept.source_objects,
                bytes = swept.bytes,
                "retention: {}",
                crate::stored::swept_line(&swept)
            ),
            Err(e) => {
                tracing::warn!(error = %e, "retention: the sweep stopped; the next one goes on")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::testing::{args, file};

    #[test]
    fn flags_win_over_the_file_and_the_file_over_the_defaults() {
        let f = file(
            "listen = \"127.0.0.1:9000\"\netcd = [\"http://127.0.0.1:2379\"]\nworker_ttl = \"4s\"\npublishers = [\"ci\"]\nsaved_only = true\nmax_connections = 7\nmax_connections_per_peer = 3\nread_timeout = \"9s\"\n",
        );
        let s = Settings::layered(
            &args(&[
                "--worker-ttl",
                "6s",
                "--publisher",
                "ops",
                "--read-timeout",
                "4s",
            ]),
            &f,
        )
        .unwrap();
        assert_eq!(s.listen, "127.0.0.1:9000".parse().unwrap());
        assert_eq!(
            s.worker_ttl,
            std::time::Duration::from_secs(6),
            "the flag wins"
        );
        assert_eq!(s.publishers, ["ops"]);
        assert_eq!(s.etcd, ["http://127.0.0.1:2379"]);
        assert!(s.saved_only);
        assert_eq!(s.limits.max_connections, 7);
        assert_eq!(s.limits.max_per_peer, 3);
        assert_eq!(s.limits.read, std::time::Duration::from_secs(4));
        let d = Settings::layered(&args(&[]), &file("")).unwrap();
        assert_eq!(d.listen, "127.0.0.1:7443".parse().unwrap());
        assert_eq!(d.http, "127.0.0.1:7080".parse().unwrap());
        assert_eq!(d.worker_ttl, flotilla_coordinator::host::WORKER_LEASE_TTL);
        assert!(d.etcd.is_empty() && !d.saved_only && d.publishers.is_empty());
    }

    #[test]
    fn bad_values_are_refused_by_the_flag_that_sets_them() {
        let bad = |flags: &[&str]| Settings::layered(&args(flags), &file("")).unwrap_err();
        assert!(bad(&["--worker-ttl", "1s"]).message.contains("at least 2s"));
        assert!(
            bad(&["--worker-ttl", "later"])
                .message
                .contains("--worker-ttl")
        );
        assert!(
            bad(&["--max-connections", "0"])
                .message
                .contains("--max-connections")
        );
        assert!(
            bad(&["--idle-timeout", "nope"])
                .message
                .contains("--idle-timeout")
        );
        assert!(
            bad(&["--max-connections-per-peer", "0"])
                .message
                .contains("--max-connections-per-peer")
        );
        assert!(
            bad(&["--read-timeout", "0s"])
                .message
                .contains("--read-timeout")
        );
        let open = token_key(None, "0.0.0.0:7080".parse().unwrap()).unwrap_err();
        assert!(open.message.contains("only on loopback"), "{open}");
        assert!(
            token_key(None, "127.0.0.1:7080".parse().unwrap())
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn the_ceilings_of_one_attempt_s_usage_come_from_the_file_and_are_checked() {
        let s = Settings::layered(
            &args(&[]),
            &file("[attempt_usage]\ncontext_tokens = 2000000\nrequests_per_second = 0\n"),
        )
        .unwrap();
        assert_eq!(
            s.attempt_usage,
            flotilla_coordinator::host::UsageBounds {
                context_tokens: 2_000_000,
                requests_per_second: 0,
                ..Default::default()
            },
            "what the table leaves out keeps its default"
        );
        let bad = Settings::layered(
            &args(&[]),
            &file("[attempt_usage]\nusd_per_million_input = -1.0\n"),
        )
        .unwrap_err();
        assert!(
            bad.message.contains("[attempt_usage]")
                && bad.message.contains("usd_per_million_input"),
            "{bad}"
        );
        assert!(
            toml::from_str::<crate::config::ConfigFile>("[attempt_usage]\ntokens = 5\n").is_err(),
            "an unknown ceiling is refused"
        );
    }
}
