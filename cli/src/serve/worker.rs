//! `flotilla worker`: attach to a coordinator and run its assignments.

use super::{hostname, shutdown_signal};
use flotilla_proto::Problem;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use flotilla_worker::{AgentBackend, Worker, WorkerOptions};
use tokio_util::sync::CancellationToken;

use crate::client::*;
use crate::{config, fail_kind};

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
    /// Fetch URL sources with this worker's own git and ssh credentials (its home directory's
    /// keys, config and `.netrc`, the ssh agent, the system git config). Every namespace's
    /// launches may then name any repository those credentials reach; off by default, when
    /// URL sources are fetched anonymously.
    #[arg(long, env = "FLOTILLA_SOURCE_CREDENTIALS")]
    source_credentials: bool,
    /// Run every agent's processes in a bubblewrap sandbox (`on`, the default: the worker
    /// does not start without one) or not (`off`: agents can reach all this worker can).
    #[arg(long, env = "FLOTILLA_SANDBOX", value_name = "on|off")]
    sandbox: Option<String>,
    /// How an attempt's checkout of the run's source is made: `overlay` (a copy-on-write view
    /// of one tree per commit: made in constant time, its disk what the agent writes; the
    /// worker does not start if overlayfs is refused), `checkout` (a full checkout each) or
    /// `auto` (overlay where it works, said at start) [default: auto].
    #[arg(
        long,
        env = "FLOTILLA_WORKSPACES",
        value_name = "auto|overlay|checkout"
    )]
    workspaces: Option<String>,
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
    /// What one attempt may write to its checkout or scratch directory, in MiB: past it the
    /// attempt ends with a failure naming the quota, and its files go [default: 10240].
    #[arg(long, env = "FLOTILLA_DISK_MIB", value_name = "MIB")]
    disk_mib: Option<u64>,
    /// Longest the worker may take to make an attempt's workspace (fetch and check out the
    /// run's source) before its agent starts; the stall timeout does not run meanwhile, and
    /// past this the attempt fails as the worker's and goes again [default: 30m].
    #[arg(long, env = "FLOTILLA_MAX_PREPARE_TIME", value_name = "DUR")]
    max_prepare_time: Option<String>,
    /// Longest one attempt may run (a shorter `timeout` of the call wins); 0 for none
    /// [default: 4h].
    #[arg(long, env = "FLOTILLA_MAX_ATTEMPT_TIME", value_name = "DUR")]
    max_attempt_time: Option<String>,
    /// How attempts' memory and process limits are held: `auto` (a cgroup per attempt where
    /// this worker may make one, else rlimits) or `rlimits` [default: auto].
    #[arg(long, env = "FLOTILLA_LIMITS_VIA", value_name = "auto|rlimits")]
    limits_via: Option<String>,
    /// A label of this worker (`KEY=VALUE`, repeatable): agents whose `placement.labels` ask
    /// for it run only on workers that carry it (`gpu=h100`, `region=eu`, ...).
    #[arg(
        long = "label",
        env = "FLOTILLA_WORKER_LABELS",
        value_delimiter = ',',
        value_name = "KEY=VALUE"
    )]
    labels: Vec<String>,
    /// Input tokens per minute the provider account of this worker's key may take: the
    /// coordinator paces the starts of its calls to stay under it [default: not paced].
    #[arg(long, env = "FLOTILLA_ACCOUNT_ITPM", value_name = "TOKENS")]
    account_itpm: Option<u64>,
    /// Most requests at once through that account, whatever the adaptive window says
    /// [default: the window alone].
    #[arg(long, env = "FLOTILLA_ACCOUNT_CONCURRENCY", value_name = "N")]
    account_concurrency: Option<u32>,
    /// Backends whose model server keeps a prompt-prefix cache of its own for this worker (a
    /// self-hosted OpenAI-compatible server per machine, say `openai`; comma-separated): the
    /// coordinator sends calls that share a prefix back to the worker that served it.
    #[arg(
        long = "local-prefix-cache",
        env = "FLOTILLA_LOCAL_PREFIX_CACHE",
        value_delimiter = ',',
        value_name = "BACKEND"
    )]
    local_prefix_cache: Vec<String>,
    /// Operator listener: `GET /metrics` of this worker (slots, attempts, workspaces, its
    /// link) with no sign-in, for Prometheus. Bind it to a private address only your scraper
    /// reaches (it serves nothing else); sandboxed agents cannot reach it. Off unless given.
    #[arg(long, env = "FLOTILLA_METRICS_LISTEN")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// TOML file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    tls: TlsArgs,
}

/// A worker's settings, in layers: the config file, then the environment, then flags (clap
/// reads each flag's environment variable), then the defaults — checked before anything starts.
#[derive(Debug, Clone, PartialEq)]
struct Settings {
    coordinator: String,
    backends: Vec<String>,
    exec_cmd: Option<String>,
    slots: u32,
    workspace: PathBuf,
    max_result_mib: u64,
    allow_file_sources: bool,
    allow_source_hosts: Vec<String>,
    source_credentials: bool,
    /// `false`: `--sandbox off`.
    sandbox: bool,
    /// `--workspaces`: `auto`, `overlay` or `checkout`.
    workspaces: &'static str,
    allow_net: Vec<String>,
    limits: flotilla_worker::limits::Settings,
    /// `--limits-via rlimits`.
    rlimits: bool,
    /// `--account-itpm`, `--account-concurrency`.
    accounts: flotilla_worker::AccountLimits,
    /// `--label`s.
    labels: std::collections::BTreeMap<String, String>,
    /// `--metrics-listen`.
    metrics_listen: Option<std::net::SocketAddr>,
}

/// The first layer that has a list.
fn list(flag: &[String], file: &[String]) -> Vec<String> {
    if flag.is_empty() { file } else { flag }.to_vec()
}

impl Settings {
    fn layered(a: &WorkerArgs, file: &config::ConfigFile) -> Result<Settings, Problem> {
        let coordinator = a.coordinator.clone().or_else(|| file.coordinator.clone()).ok_or_else(|| {
            Problem::invalid("no coordinator: pass --coordinator https://host:port (or FLOTILLA_COORDINATOR, or `coordinator` in --config)")
        })?;
        let mut backends = list(&a.backends, &file.backends);
        if backends.is_empty() {
            backends = vec!["echo".into()];
        }
        let slots = a.slots.or(file.slots).unwrap_or(16);
        if slots == 0 {
            return Err(Problem::invalid("--slots must be at least 1"));
        }
        let limit_mib = (flotilla_proto::frag::MAX_MESSAGE_BYTES >> 20) as u64;
        let max_result_mib = a
            .max_result_mib
            .or(file.max_result_mib)
            .unwrap_or(limit_mib);
        if max_result_mib == 0 || max_result_mib > limit_mib {
            return Err(Problem::invalid(format!(
                "--max-result-mib must be between 1 and {limit_mib} (got {max_result_mib})"
            )));
        }
        let sandbox = match a
            .sandbox
            .as_deref()
            .or(file.sandbox.as_deref())
            .unwrap_or("on")
        {
            "on" | "bwrap" => true,
            "off" => false,
            other => {
                return Err(Problem::invalid(format!(
                    "--sandbox takes on or off (got {other:?})"
                )));
            }
        };
        let workspaces = match a
            .workspaces
            .as_deref()
            .or(file.workspaces.as_deref())
            .unwrap_or("auto")
        {
            "auto" => "auto",
            "overlay" => "overlay",
            "checkout" => "checkout",
            other => {
                return Err(Problem::invalid(format!(
                    "--workspaces takes auto, overlay or checkout (got {other:?})"
                )));
            }
        };
        let rlimits = match a.limits_via.as_deref().unwrap_or("auto") {
            "auto" => false,
            "rlimits" => true,
            other => {
                return Err(Problem::invalid(format!(
                    "--limits-via takes auto or rlimits (got {other:?})"
                )));
            }
        };
        Ok(Settings {
            coordinator,
            backends,
            exec_cmd: a.exec_cmd.clone().or_else(|| file.exec_cmd.clone()),
            slots,
            workspace: a
                .workspace
                .clone()
                .or_else(|| file.workspace.clone())
                .unwrap_or_else(|| {
                    dirs::data_dir()
                        .unwrap_or_else(std::env::temp_dir)
                        .join("flotilla")
                        .join("workspaces")
                }),
            max_result_mib,
            allow_file_sources: a.allow_file_sources || file.allow_file_sources == Some(true),
            allow_source_hosts: list(&a.allow_source_host, &file.allow_source_hosts),
            source_credentials: a.source_credentials || file.source_credentials == Some(true),
            sandbox,
            workspaces,
            allow_net: list(&a.allow_net, &file.allow_net),
            limits: Self::attempt_limits(a, file)?,
            rlimits,
            labels: config::parse_labels(&list(&a.labels, &file.worker_labels))?,
            metrics_listen: a.metrics_listen.or(file.metrics_listen),
            accounts: flotilla_worker::AccountLimits {
                itpm: a.account_itpm.or(file.account_itpm).unwrap_or(0),
                max_concurrent: a
                    .account_concurrency
                    .or(file.account_concurrency)
                    .unwrap_or(0),
                local_cache: {
                    let given = list(&a.local_prefix_cache, &file.local_prefix_cache);
                    // Backends that call a model server (echo and exec call none).
                    let served = ["openai", "anthropic", "claude-code"];
                    if let Some(b) = given.iter().find(|b| !served.contains(&b.as_str())) {
                        return Err(Problem::invalid(format!(
                            "--local-prefix-cache {b:?}: only a backend that calls a model server keeps a prefix cache; use one of {}",
                            served.join(", ")
                        )));
                    }
                    given
                },
            },
        })
    }

    /// What one attempt may use: memory, processes, `/tmp`, time.
    fn attempt_limits(
        a: &WorkerArgs,
        file: &config::ConfigFile,
    ) -> Result<flotilla_worker::limits::Settings, Problem> {
        let mut limits = flotilla_worker::limits::Settings::default();
        if let Some(m) = a.memory_mib.or(file.memory_mib) {
            limits.memory = (m > 0).then_some(m << 20);
        }
        if let Some(p) = a.max_procs.or(file.max_procs) {
            limits.procs = (p > 0).then_some(p);
        }
        if let Some(t) = a.tmp_mib.or(file.tmp_mib) {
            if t == 0 {
                return Err(Problem::invalid("--tmp-mib must be at least 1"));
            }
            limits.tmp = t << 20;
        }
        if let Some(d) = a.disk_mib.or(file.disk_mib) {
            if d == 0 {
                return Err(Problem::invalid(
                    "--disk-mib must be at least 1: an attempt needs room for its checkout",
                ));
            }
            limits.disk = Some(d << 20);
        }
        if let Some(p) = a
            .max_prepare_time
            .as_ref()
            .or(file.max_prepare_time.as_ref())
        {
            let d = config::parse_duration("--max-prepare-time", p)?;
            if d.is_zero() {
                return Err(Problem::invalid("--max-prepare-time must be longer than 0"));
            }
            limits.prepare = d;
        }
        if let Some(w) = a
            .max_attempt_time
            .as_ref()
            .or(file.max_attempt_time.as_ref())
        {
            let d = config::parse_duration("--max-attempt-time", w)?;
            limits.wall = (!d.is_zero()).then_some(d);
        }
        Ok(limits)
    }
}

/// The sandbox the settings ask for: bubblewrap (the worker does not start without it), or
/// none, said loudly.
async fn sandbox(s: &Settings) -> Result<flotilla_worker::sandbox::Sandbox, Problem> {
    if !s.sandbox {
        eprintln!(
            "flotilla worker: WARNING: {}",
            flotilla_worker::sandbox::OFF_WARNING
        );
        return Ok(flotilla_worker::sandbox::Sandbox::Off);
    }
    match crate::sandbox_with_api(s.allow_net.clone()).await {
        Ok(sb) => {
            eprintln!("flotilla worker: {}", sb.describe());
            Ok(sb)
        }
        Err(e) => Err(Problem::invalid(format!(
            "{e}\nagents run sandboxed by default: install bubblewrap (Debian: apt-get install bubblewrap) where unprivileged user namespaces are allowed, or start with --sandbox off to run them unconfined"
        ))),
    }
}

/// How source checkouts are made, said at start: copy-on-write views where overlayfs works
/// (refused outright with `--workspaces overlay`), else full checkouts.
fn layers(s: &Settings) -> Result<Option<flotilla_worker::layers::Layers>, Problem> {
    if s.workspaces == "checkout" {
        eprintln!(
            "flotilla worker: workspaces: a full checkout of the run's source per call (--workspaces checkout)"
        );
        return Ok(None);
    }
    let probed = std::env::current_exe()
        .map_err(|e| Problem::unavailable(format!("cannot find this binary: {e}")))
        .and_then(|bin| flotilla_worker::layers::Layers::probe(&bin, &s.workspace));
    match probed {
        Ok(l) => {
            eprintln!(
                "flotilla worker: workspaces: copy-on-write views (overlayfs) of one tree per commit under {}",
                s.workspace.display()
            );
            Ok(Some(l))
        }
        Err(e) if s.workspaces == "overlay" => Err(Problem::invalid(format!(
            "{e}
--workspaces overlay needs overlayfs in a user namespace (Linux 5.11 or later, user namespaces allowed, a workspace on a filesystem that holds user xattrs); start with --workspaces checkout to make full checkouts"
        ))),
        Err(e) => {
            eprintln!(
                "flotilla worker: workspaces: {e}; each call gets a full checkout of the run's source instead (slower to make, a whole copy on disk each)"
            );
            Ok(None)
        }
    }
}

pub async fn worker(mut a: WorkerArgs) -> i32 {
    let file = match config::load(a.config.as_deref()) {
        Ok(f) => f,
        Err(e) => return crate::refuse(e),
    };
    a.tls.fill(&file);
    let mut s = match Settings::layered(&a, &file) {
        Ok(s) => s,
        Err(e) => return crate::refuse(e),
    };
    let name = a.tls.name.clone().unwrap_or_else(hostname);
    let tls = match a.tls.files(&name, loopback_host(&host_of(&s.coordinator))) {
        Ok(t) => t,
        Err(e) => return crate::refuse(e),
    };
    // The workspace is the worker's alone: no other user of the machine reads its checkouts.
    if std::fs::create_dir_all(&s.workspace).is_ok() {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&s.workspace, std::fs::Permissions::from_mode(0o700));
    }
    // Absolute: views are mounted at, and name their layers by, paths under it.
    if let Ok(abs) = s.workspace.canonicalize() {
        s.workspace = abs;
    }
    let sandbox = match sandbox(&s).await {
        Ok(sb) => sb,
        Err(e) => return crate::refuse(e),
    };
    let layers = match layers(&s) {
        Ok(l) => l,
        Err(e) => return crate::refuse(e),
    };
    let limits = flotilla_worker::limits::Limits::detect_with(s.limits.clone(), s.rlimits);
    eprintln!("flotilla worker: {}", limits.describe());
    let groups = limits.clone();
    let sandbox_state = sandbox.clone();
    let backends: Result<Vec<Arc<dyn AgentBackend>>, flotilla_proto::Problem> = s
        .backends
        .iter()
        .map(|b| flotilla_worker::backend::by_name(b, s.exec_cmd.as_deref()))
        .collect();
    let backends = match backends {
        Ok(b) => b,
        Err(e) => return crate::refuse(e),
    };
    let worker = Worker::new(
        WorkerOptions {
            name: name.clone(),
            slots: s.slots,
            workspace: s.workspace.clone(),
            labels: s.labels.clone().into_iter().collect(),
            shared_workspace: false,
            max_result_bytes: (s.max_result_mib as usize) << 20,
            allow_file_sources: s.allow_file_sources,
            allow_source_hosts: s.allow_source_hosts.clone(),
            source_credentials: s.source_credentials,
            sandbox,
            limits,
            account_limits: s.accounts,
            layers,
        },
        backends,
    );
    let cancel = CancellationToken::new();
    eprintln!(
        "flotilla worker {name}: {} slots, coordinator {}",
        s.slots, s.coordinator
    );
    let opts = flotilla_worker::remote::RemoteOptions {
        endpoint: s.coordinator.clone(),
        tls,
        metrics_listen: s.metrics_listen,
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
            Err(e) => fail_kind(flotilla_proto::ErrorKind::Unavailable, e.to_string()),
        },
    };
    // Its cgroups and its sandbox's state go with it (those of a worker killed outright,
    // when the next one starts).
    groups.cleanup();
    sandbox_state.cleanup();
    code
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::testing::{args, file};

    #[test]
    fn flags_win_over_the_file_and_the_file_over_the_defaults() {
        let f = file(
            "coordinator = \"https://from-file:7443\"\nslots = 3\nbackends = [\"exec\"]\nexec_cmd = \"cat\"\nmemory_mib = 512\n",
        );
        let s = Settings::layered(&args(&["--slots", "9"]), &f).unwrap();
        assert_eq!(s.coordinator, "https://from-file:7443");
        assert_eq!(s.slots, 9, "the flag wins");
        assert_eq!(s.backends, ["exec"], "the file's list, no flag given");
        assert_eq!(s.limits.memory, Some(512 << 20));
        let s = Settings::layered(
            &args(&[
                "--coordinator",
                "https://flag:1",
                "--backend",
                "echo,claude-code",
            ]),
            &f,
        )
        .unwrap();
        assert_eq!(s.coordinator, "https://flag:1");
        assert_eq!(s.backends, ["echo", "claude-code"]);
        let d = Settings::layered(&args(&["--coordinator", "https://c:1"]), &file("")).unwrap();
        assert_eq!(d.slots, 16);
        assert_eq!(d.backends, ["echo"]);
        assert!(d.sandbox);
        assert_eq!(d.limits, flotilla_worker::limits::Settings::default());
    }

    #[test]
    fn bad_values_are_refused_by_the_flag_that_sets_them() {
        let c = ["--coordinator", "https://c:1"];
        let bad = |extra: &[&str]| {
            let flags: Vec<&str> = c.iter().chain(extra).copied().collect();
            Settings::layered(&args(&flags), &file("")).unwrap_err()
        };
        assert!(bad(&["--slots", "0"]).message.contains("--slots"));
        assert!(
            bad(&["--max-result-mib", "0"])
                .message
                .contains("--max-result-mib")
        );
        assert!(bad(&["--sandbox", "maybe"]).message.contains("--sandbox"));
        assert!(
            bad(&["--limits-via", "magic"])
                .message
                .contains("--limits-via")
        );
        assert!(bad(&["--tmp-mib", "0"]).message.contains("--tmp-mib"));
        assert!(
            bad(&["--max-attempt-time", "soon"])
                .message
                .contains("--max-attempt-time")
        );
        let none = Settings::layered(&args(&[]), &file("")).unwrap_err();
        assert!(none.message.contains("--coordinator"), "{none}");
        let off = Settings::layered(&args(&[c[0], c[1], "--memory-mib", "0"]), &file("")).unwrap();
        assert_eq!(off.limits.memory, None, "0 is no limit");
    }

    #[test]
    fn every_backend_name_is_known_and_exec_needs_its_command() {
        for name in flotilla_worker::backend::NAMES {
            assert!(
                flotilla_worker::backend::by_name(name, Some("cat")).is_ok(),
                "{name}"
            );
        }
        let e = flotilla_worker::backend::by_name("exec", None)
            .err()
            .unwrap();
        assert!(e.message.contains("--exec-cmd"), "{e}");
        let e = flotilla_worker::backend::by_name("gpt-pilot", None)
            .err()
            .unwrap();
        assert!(e.message.contains("echo, exec, claude-code"), "{e}");
    }
}
