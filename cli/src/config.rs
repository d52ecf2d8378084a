//! Run configuration: a TOML file, then `FLOTILLA_*` environment variables, then flags.
//!
//! Every run setting has a flag (`--stall-timeout 300ms`), an environment variable
//! (`FLOTILLA_STALL_TIMEOUT=300ms`) and a config key (`stall_timeout = "300ms"`). Durations
//! accept `300ms`, `5s`, `3m` (or plain milliseconds).

use flotilla_proto::Problem;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use flotilla_proto::settings::{ReplayMode, RunSettings};
use serde::Deserialize;

/// Settings flags shared by commands that start runs. Counts take negative numbers as values
/// (so `--concurrency -1` is told it must be at least 1, not that `-1` is an unknown flag).
#[derive(Debug, Clone, Args, Default)]
#[command(allow_negative_numbers = true)]
pub struct SettingFlags {
    /// Agent backend: claude-code, anthropic, openai, exec (a command per agent) or echo (a
    /// deterministic dry run) [default: claude-code when the claude CLI is on PATH, else
    /// anthropic when ANTHROPIC_API_KEY is set, else refused with these choices].
    #[arg(long, env = "FLOTILLA_BACKEND")]
    pub backend: Option<String>,
    /// Command the exec backend runs per agent (`sh -c CMD`; prompt on stdin).
    #[arg(long, env = "FLOTILLA_EXEC_CMD", value_name = "CMD")]
    pub exec_cmd: Option<String>,
    /// Default model for agents that name none (else $CLAUDE_CODE_SUBAGENT_MODEL).
    #[arg(long, env = "FLOTILLA_MODEL")]
    pub model: Option<String>,
    /// Use --model for every agent, whatever it asks for (also CLAUDE_CODE_SUBAGENT_MODEL_FORCE=1).
    #[arg(long)]
    pub force_model: bool,
    /// Object store URL: file:///path (default: the user data directory) or memory://.
    #[arg(long, env = "FLOTILLA_STORE")]
    pub store: Option<String>,
    /// Replay rule on resume: content (default) or prefix (Claude Code's ordered prefix).
    #[arg(long, env = "FLOTILLA_REPLAY")]
    pub replay: Option<String>,
    /// Agents of the run that run at once (default 16).
    #[arg(long, env = "FLOTILLA_CONCURRENCY", value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency: Option<u32>,
    /// Restart an attempt with no progress for this long (default 180s).
    #[arg(long, env = "FLOTILLA_STALL_TIMEOUT", value_name = "DUR")]
    pub stall_timeout: Option<String>,
    /// Attempts per agent, stall restarts included (default 6).
    #[arg(long, env = "FLOTILLA_ATTEMPTS", value_parser = clap::value_parser!(u32).range(1..))]
    pub attempts: Option<u32>,
    /// Structured-output submissions per agent (default 5).
    #[arg(long, env = "FLOTILLA_SCHEMA_ATTEMPTS", value_parser = clap::value_parser!(u32).range(1..))]
    pub schema_attempts: Option<u32>,
    /// agent() calls per run (default 1000).
    #[arg(long, env = "FLOTILLA_MAX_AGENTS", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_agents: Option<u64>,
    /// Attempts beyond each agent's first that the whole run may make, opt-in; once spent, a
    /// failing agent fails instead of trying again, as its last attempt would have (a stall
    /// still rejects with STALLED). Throttles (429, 529) and usage-limit waits are not
    /// retries. Default: none, every agent gets its attempts, as under Claude Code.
    #[arg(long, env = "FLOTILLA_RETRY_BUDGET", value_name = "N")]
    pub retry_budget: Option<u64>,
    /// The models agents may run on (aliases such as sonnet, or model ids; comma-separated):
    /// an agent asking for another runs on --model when that is allowed, else on the first,
    /// with a warning naming both (Claude Code's availableModels).
    #[arg(
        long,
        env = "FLOTILLA_ALLOWED_MODELS",
        value_delimiter = ',',
        value_name = "MODEL"
    )]
    pub allowed_models: Vec<String>,
    /// Output-token budget of the run (`budget.total`).
    #[arg(long, env = "FLOTILLA_BUDGET", value_name = "TOKENS")]
    pub budget: Option<u64>,
    /// Money ceiling of the run in US dollars: on a coordinator the run pauses there until
    /// `flotilla budget` raises it; `flotilla run` refuses new agents and stops running ones.
    #[arg(long, env = "FLOTILLA_BUDGET_USD", value_name = "DOLLARS")]
    pub budget_usd: Option<f64>,
    /// At the money ceiling, interrupt the running agents too (their work is kept for when
    /// the run goes on) instead of letting them finish.
    #[arg(long)]
    pub budget_interrupt: bool,
    /// Prefix-cache stagger cap (default 5000ms; 0 turns it off).
    #[arg(long, env = "FLOTILLA_STAGGER", value_name = "DUR")]
    pub stagger: Option<String>,
    /// Memory limit of the script, in MiB (default 512).
    #[arg(long, env = "FLOTILLA_SCRIPT_MEMORY", value_name = "MIB")]
    pub script_memory: Option<u64>,
    /// CPU time the script may use between awaits (default 10s).
    #[arg(long, env = "FLOTILLA_SCRIPT_CPU", value_name = "DUR")]
    pub script_cpu: Option<String>,
    /// How long an agent waits for an attached worker that offers its backend and model
    /// before it fails with that reason (default 10m).
    #[arg(long, env = "FLOTILLA_WORKER_WAIT", value_name = "DUR")]
    pub worker_wait: Option<String>,
    /// How long one agent may wait out its provider's throttles (429, 529) in all before it
    /// fails (default 15m).
    #[arg(long, env = "FLOTILLA_THROTTLE_WAIT", value_name = "DUR")]
    pub throttle_wait: Option<String>,
    /// Directory searched first for saved workflows (repeatable).
    #[arg(long = "workflows-dir", value_name = "DIR")]
    pub workflows_dirs: Vec<PathBuf>,
    /// Root of the agents' working directories.
    #[arg(long, env = "FLOTILLA_WORKSPACE", value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// POST the run's end here (signed with FLOTILLA_NOTIFY_SECRET embedded, or the
    /// coordinator's --notify-secret-file), retried with backoff.
    #[arg(long, env = "FLOTILLA_NOTIFY", value_name = "URL")]
    pub notify: Option<String>,
    /// A label of the run, for finding it again (`flotilla runs --label KEY=VALUE`;
    /// repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// The namespace the run belongs to (on a fleet: one your certificate names; default:
    /// its first). Its quotas, weight and model policy are the coordinator's for it.
    #[arg(long, env = "FLOTILLA_NAMESPACE", value_name = "NS")]
    pub namespace: Option<String>,
}

/// The webhook signer of `FLOTILLA_NOTIFY_SECRET`, if it is set.
pub fn notifier_from_env()
-> anyhow::Result<Option<std::sync::Arc<flotilla_coordinator::host::Notifier>>> {
    match std::env::var("FLOTILLA_NOTIFY_SECRET") {
        Ok(secret) if !secret.is_empty() => {
            let n = flotilla_coordinator::host::Notifier::new(secret.as_bytes())
                .map_err(|e| anyhow::anyhow!("FLOTILLA_NOTIFY_SECRET: {e}"))?;
            Ok(Some(std::sync::Arc::new(n)))
        }
        _ => Ok(None),
    }
}

/// `KEY=VALUE` labels as flags give them, checked; an error names the bad one and the form.
pub fn parse_labels(
    given: &[String],
) -> Result<std::collections::BTreeMap<String, String>, Problem> {
    use flotilla_proto::settings::{MAX_LABELS, valid_label_key, valid_label_value};
    let mut out = std::collections::BTreeMap::new();
    for l in given {
        let (k, v) = l.split_once('=').ok_or_else(|| {
            Problem::invalid(format!(
                "--label {l:?} is not KEY=VALUE, e.g. --label team=payments"
            ))
        })?;
        if !valid_label_key(k) {
            return Err(Problem::invalid(format!(
                "--label {l:?}: the key must be 1 to 63 lower-case letters, digits, - _ . or /, starting with a letter or digit"
            )));
        }
        if !valid_label_value(v) {
            return Err(Problem::invalid(format!(
                "--label {l:?}: the value must be at most 256 printable characters"
            )));
        }
        out.insert(k.to_owned(), v.to_owned());
    }
    if out.len() > MAX_LABELS {
        return Err(Problem::invalid(format!(
            "at most {MAX_LABELS} labels per run"
        )));
    }
    Ok(out)
}

/// The TOML config file. Every field is optional; flags and environment win.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Agent backend (`claude-code`, `anthropic`, `openai`, `exec`, `echo`).
    pub backend: Option<String>,
    /// Command of the exec backend.
    pub exec_cmd: Option<String>,
    /// Default model.
    pub model: Option<String>,
    /// Use `model` for every agent.
    pub force_model: Option<bool>,
    /// Object store URL.
    pub store: Option<String>,
    /// Replay rule on resume (`content`, `prefix`).
    pub replay: Option<String>,
    /// Agents of a run that run at once.
    pub concurrency: Option<u32>,
    /// Stall timeout (`300ms`, `3m`).
    pub stall_timeout: Option<String>,
    /// Attempts per agent.
    pub attempts: Option<u32>,
    /// Structured-output submissions per agent.
    pub schema_attempts: Option<u32>,
    /// agent() calls per run.
    pub max_agents: Option<u64>,
    /// Retries the whole run may make.
    pub retry_budget: Option<u64>,
    /// The models agents may run on (also a coordinator's policy for every run);
    /// `allowed_models`, the flag's name, is the same key.
    #[serde(default, alias = "allowed_models")]
    pub available_models: Vec<String>,
    /// Output-token budget per run.
    pub budget: Option<u64>,
    /// Money ceiling per run, in US dollars.
    pub budget_usd: Option<f64>,
    /// At the money ceiling, interrupt running agents too.
    pub budget_interrupt: Option<bool>,
    /// Prefix-cache stagger cap.
    pub stagger: Option<String>,
    /// Script memory limit in MiB.
    pub script_memory: Option<u64>,
    /// Script CPU limit between awaits.
    pub script_cpu: Option<String>,
    /// How long an agent waits for a worker that offers its backend (`10m`).
    pub worker_wait: Option<String>,
    /// How long one agent waits out throttles.
    pub throttle_wait: Option<String>,
    /// Saved-workflow directories searched first (`workflows_dir`, the flag's name, too).
    #[serde(default, alias = "workflows_dir")]
    pub workflows_dirs: Vec<PathBuf>,
    /// Root of the agents' working directories.
    pub workspace: Option<PathBuf>,
    /// The namespace runs belong to (`--namespace`).
    pub namespace: Option<String>,
    /// The runs' labels, `KEY=VALUE` (`--label`; `label` is the same key).
    #[serde(default, alias = "label")]
    pub labels: Vec<String>,

    // ---- fleet commands (coordinator, worker, launch, wait, ...) ----
    /// Coordinator address for workers and clients (`https://host:port`).
    pub coordinator: Option<String>,
    /// Directory with `ca.crt` and `NAME.crt`/`NAME.key`.
    pub tls_dir: Option<PathBuf>,
    /// Identity in `tls_dir` to use.
    pub name: Option<String>,
    /// Certificate, key and CA files (instead of `tls_dir` + `name`).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: Option<PathBuf>,
    /// Plain text on loopback (development only).
    pub insecure: Option<bool>,
    /// Coordinator: gRPC listen address.
    pub listen: Option<std::net::SocketAddr>,
    /// Coordinator: session page address.
    pub http: Option<std::net::SocketAddr>,
    /// Coordinator and worker: the operator listener's address (`/metrics`, no sign-in).
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Coordinator: serve the operator listener over mutual TLS.
    pub metrics_tls: Option<bool>,
    /// Coordinator: etcd endpoints.
    #[serde(default)]
    pub etcd: Vec<String>,
    /// Coordinator: TLS files for an https:// etcd.
    pub etcd_ca: Option<PathBuf>,
    pub etcd_cert: Option<PathBuf>,
    pub etcd_key: Option<PathBuf>,
    /// Coordinator: TTL of each worker's liveness lease (`10s`).
    pub worker_ttl: Option<String>,
    /// Coordinator: a run waiting on its questions alone this long is parked (`30s`, `off`).
    pub park_after: Option<String>,
    /// Coordinator: the address other coordinators and clients reach it at.
    pub advertise: Option<String>,
    /// Coordinator: where runs' changes are merged (a git cache of run sources).
    pub cache_dir: Option<PathBuf>,
    /// Coordinator: longest a TLS handshake may take (`10s`).
    pub handshake_timeout: Option<String>,
    /// Coordinator: a connection idle this long either way is closed (`5m`).
    pub idle_timeout: Option<String>,
    /// Coordinator: connections open at once on each listener.
    pub max_connections: Option<usize>,
    /// Coordinator: connections one peer (an IPv4 address, an IPv6 /64) may hold open at
    /// once on each listener.
    pub max_connections_per_peer: Option<usize>,
    /// Coordinator: longest a page request's headers, and then its body, may take (`10s`).
    pub read_timeout: Option<String>,
    /// Coordinator: the name other coordinators' certificates are checked for.
    pub peer_name: Option<String>,
    /// POST each run's end to this URL (`--notify`).
    pub notify: Option<String>,
    /// Coordinator: the file with the secret that signs webhooks.
    pub notify_secret_file: Option<PathBuf>,
    /// Coordinator: delete runs older than this (`30d`), as `flotilla gc` does, every
    /// `retention_every`.
    pub retention: Option<String>,
    /// Coordinator: keep failed and interrupted runs whatever their age.
    pub retention_keep_failed: Option<bool>,
    /// Coordinator: how often the retention sweep runs (`24h`).
    pub retention_every: Option<String>,
    /// Worker: backends it offers.
    #[serde(default)]
    pub backends: Vec<String>,
    /// Worker: attempts at once.
    pub slots: Option<u32>,
    /// Worker: the largest result one agent may return, in MiB (at most 256); a bigger one
    /// fails its call.
    pub max_result_mib: Option<u64>,
    /// Worker: `git+file://` and local-path sources may be fetched (off: a launcher could
    /// otherwise read repositories on the worker's disk). Coordinator: runs with such a
    /// source are accepted (off: refused at launch, as its workers would not fetch them).
    pub allow_file_sources: Option<bool>,
    /// Worker: hosts URL sources may name although they resolve to loopback or link-local
    /// addresses (`*`: any).
    #[serde(default)]
    pub allow_source_hosts: Vec<String>,
    /// Worker: URL sources are fetched with the worker's own git and ssh credentials (every
    /// namespace may then name what they reach); off: anonymously.
    pub source_credentials: Option<bool>,
    /// Worker: `on` (bubblewrap, the default) or `off`.
    pub sandbox: Option<String>,
    /// Worker: how source checkouts are made: `auto`, `overlay` or `checkout`.
    pub workspaces: Option<String>,
    /// Worker: hosts sandboxed agents may reach (HOST or HOST:PORT).
    #[serde(default)]
    pub allow_net: Vec<String>,
    /// Worker: per-attempt limits (see `flotilla worker --help`).
    pub memory_mib: Option<u64>,
    pub max_procs: Option<u64>,
    pub tmp_mib: Option<u64>,
    pub disk_mib: Option<u64>,
    pub max_prepare_time: Option<String>,
    pub max_attempt_time: Option<String>,
    /// Worker: its labels (`KEY=VALUE`), for agents' `placement.labels`.
    #[serde(default)]
    pub worker_labels: Vec<String>,
    /// Worker: its provider account's input tokens per minute and requests at once.
    pub account_itpm: Option<u64>,
    pub account_concurrency: Option<u32>,
    /// Worker: backends whose model server keeps a prefix cache local to it.
    #[serde(default)]
    pub local_prefix_cache: Vec<String>,
    /// Refuse new runs (W67); runs in progress keep going. A coordinator re-reads it on
    /// every launch.
    pub disable_workflows: Option<bool>,
    /// Coordinator: clients (certificate names) that may push workflows.
    #[serde(default)]
    pub publishers: Vec<String>,
    /// Coordinator: a push may take a bundled workflow's name.
    pub allow_shadow_bundled: Option<bool>,
    /// Coordinator: run only saved workflows (its own, pushed ones, bundled ones, or those a
    /// client carries by name); inline scripts are refused (W46).
    pub saved_only: Option<bool>,
    /// Coordinator: each namespace's weight, quotas and model policy (`[namespaces.NAME]`;
    /// `[namespaces."*"]` for the ones not named).
    #[serde(default)]
    pub namespaces: std::collections::BTreeMap<String, flotilla_coordinator::host::NamespacePolicy>,
    /// Coordinator: what one attempt can use (`[attempt_usage]`: the largest context window,
    /// output per request, requests at once and per second, the dearest prices, disk). A
    /// worker's usage report above it is clipped (and logged), and only the clipped figures
    /// count against runs' budgets and namespaces' quotas.
    #[serde(default)]
    pub attempt_usage: flotilla_coordinator::host::UsageBounds,
}

/// Reads a config file (`--config`), or an empty one.
pub fn load(path: Option<&Path>) -> Result<ConfigFile, Problem> {
    read_config(path)
}

/// The namespace a fleet launch asks for: `flag` (`--namespace`, FLOTILLA_NAMESPACE), else the
/// config file's; empty: the certificate's first, as the coordinator chooses it.
pub fn asked_namespace(flag: Option<&str>, config: Option<&Path>) -> Result<String, Problem> {
    Ok(match flag {
        Some(ns) => ns.to_owned(),
        None => read_config(config)?.namespace.unwrap_or_default(),
    })
}

/// Everything `flotilla run` needs, validated.
#[derive(Debug, Clone)]
pub struct ResolvedRun {
    pub source: String,
    pub origin: String,
    pub args: Option<serde_json::Value>,
    pub settings: RunSettings,
    pub resume: Option<String>,
    pub store_url: String,
    pub workspace: PathBuf,
    pub exec_cmd: Option<String>,
    pub workflows_dirs: Vec<PathBuf>,
    pub cwd: PathBuf,
    /// The saved workflow's name when the run was asked for by name (not by path).
    pub saved_name: Option<String>,
    /// Why the backend is the one it is, when nothing named it (it was found on this
    /// machine); shown in the plan and said once before the run.
    pub backend_chosen: Option<String>,
}

/// The backend a run uses when no flag, config key or `meta.backend` names one:
/// `FLOTILLA_DEFAULT_BACKEND`, else `claude-code` when the `claude` CLI is here
/// (`FLOTILLA_CLAUDE_BIN`, else on `PATH`), else `anthropic` when `ANTHROPIC_API_KEY` is set;
/// else none, with the choices. The second value says why, when it was found here.
pub fn default_backend() -> Result<(String, Option<String>), Problem> {
    if let Some(b) = env_default_backend()? {
        return Ok((b, None));
    }
    let claude = match std::env::var_os("FLOTILLA_CLAUDE_BIN") {
        Some(bin) => Path::new(&bin)
            .is_file()
            .then_some("FLOTILLA_CLAUDE_BIN names the claude CLI"),
        None => on_path("claude").then_some("the claude CLI is on PATH"),
    };
    if let Some(why) = claude {
        return Ok(("claude-code".into(), Some(why.into())));
    }
    if std::env::var_os("ANTHROPIC_API_KEY").is_some_and(|k| !k.is_empty()) {
        return Ok(("anthropic".into(), Some("ANTHROPIC_API_KEY is set".into())));
    }
    Err(Problem::invalid(
        "no agent backend: the claude CLI is not on PATH and ANTHROPIC_API_KEY is not set; pass --backend claude-code (install Claude Code), --backend anthropic (set ANTHROPIC_API_KEY), --backend openai, --backend exec --exec-cmd CMD, or --backend echo for a dry run that calls no model",
    ))
}

/// `FLOTILLA_DEFAULT_BACKEND`, checked, if it is set.
fn env_default_backend() -> Result<Option<String>, Problem> {
    match std::env::var("FLOTILLA_DEFAULT_BACKEND") {
        Ok(b) if !b.trim().is_empty() => match b.trim() {
            b @ ("echo" | "exec" | "claude-code" | "anthropic" | "openai") => {
                Ok(Some(b.to_owned()))
            }
            other => Err(Problem::invalid(format!(
                "FLOTILLA_DEFAULT_BACKEND={other:?} is not a backend: use echo, exec, claude-code, anthropic or openai"
            ))),
        },
        _ => Ok(None),
    }
}

/// Whether an executable file called `name` is in a directory of `PATH`.
pub(crate) fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|dir| {
            std::fs::metadata(dir.join(name))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// Parses a duration: `300ms`, `5s`, `3m`, `1h`, or a plain number of milliseconds.
pub fn parse_duration(what: &str, s: &str) -> Result<Duration, Problem> {
    let s = s.trim();
    if let Ok(ms) = s.parse::<u64>() {
        return Ok(Duration::from_millis(ms));
    }
    humantime::parse_duration(s).map_err(|e| {
        Problem::invalid(format!(
            "{what} {s:?} is not a duration ({e}); use e.g. 300ms, 5s or 3m"
        ))
    })
}

fn read_config(path: Option<&Path>) -> Result<ConfigFile, Problem> {
    let Some(path) = path else {
        return Ok(ConfigFile::default());
    };
    let text = flotilla_local::reads::read_file(
        path,
        flotilla_local::reads::SMALL_FILE_BYTES,
        "config file",
    )?;
    parse_config(&text, &path.display().to_string())
}

/// Reads a config file's text; `origin` names it in the error.
pub fn parse_config(text: &str, origin: &str) -> Result<ConfigFile, Problem> {
    toml::from_str(text)
        .map_err(|e| Problem::invalid(format!("config file {origin} is invalid: {e}")))
}

/// The default store: `file://` under the user's data directory.
pub fn default_store() -> String {
    let base = dirs::data_dir()
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(std::env::temp_dir);
    format!("file://{}", base.join("flotilla").display())
}

/// Turns a store flag into a URL; a bare path becomes `file://` (made absolute).
pub fn store_url(flag: Option<String>) -> String {
    match flag {
        None => default_store(),
        // `file:`, `s3:bucket`: a URL with its slashes missing, not a directory name; the
        // store refuses it and says what a store URL looks like.
        Some(s) if s.contains("://") || looks_like_a_scheme(&s) => s,
        Some(path) => {
            let p = PathBuf::from(&path);
            let abs = if p.is_absolute() {
                p
            } else {
                std::env::current_dir().unwrap_or_default().join(p)
            };
            format!("file://{}", abs.display())
        }
    }
}

fn looks_like_a_scheme(s: &str) -> bool {
    match s.split_once(':') {
        Some((scheme, _)) => {
            !scheme.is_empty()
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '+')
                && scheme
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic())
        }
        None => false,
    }
}

/// Settings merged from file, environment and flags, plus the embedded-mode knobs.
#[derive(Debug, Clone)]
pub struct Merged {
    pub settings: RunSettings,
    pub exec_cmd: Option<String>,
    pub store: Option<String>,
    pub workspace: Option<PathBuf>,
}

/// Merges file, environment and flags into run settings.
pub fn settings_from(
    flags: &SettingFlags,
    file: &ConfigFile,
    local: bool,
) -> Result<Merged, Problem> {
    let mut s = RunSettings::default();
    let pick_s = |f: &Option<String>, c: &Option<String>| f.clone().or_else(|| c.clone());
    if let Some(b) = pick_s(&flags.backend, &file.backend) {
        s.backend = b;
    }
    // W18: --model / FLOTILLA_MODEL / config, else Claude Code's CLAUDE_CODE_SUBAGENT_MODEL.
    if let Some(m) = pick_s(&flags.model, &file.model).or_else(|| {
        std::env::var("CLAUDE_CODE_SUBAGENT_MODEL")
            .ok()
            .filter(|m| !m.is_empty())
    }) {
        s.model = m;
    }
    s.force_model = flags.force_model
        || file.force_model.unwrap_or(false)
        || std::env::var("CLAUDE_CODE_SUBAGENT_MODEL_FORCE").is_ok_and(|v| v == "1" || v == "true");
    if let Some(r) = pick_s(&flags.replay, &file.replay) {
        s.replay = r
            .parse::<ReplayMode>()
            .map_err(|e| Problem::invalid(e.to_string()))?;
    }
    if let Some(v) = flags.concurrency.or(file.concurrency) {
        s.concurrency = v;
    }
    s.labels = parse_labels(if flags.labels.is_empty() {
        &file.labels
    } else {
        &flags.labels
    })?;
    if let Some(ns) = pick_s(&flags.namespace, &file.namespace) {
        s.namespace = ns;
    }
    s.notify = pick_s(&flags.notify, &file.notify);
    if let Some(url) = &s.notify {
        flotilla_proto::names::check_notify_url(url)?;
    }
    if let Some(v) = pick_s(&flags.stall_timeout, &file.stall_timeout) {
        s.stall_timeout_ms = parse_duration("--stall-timeout", &v)?.as_millis() as u64;
    }
    if let Some(v) = flags.attempts.or(file.attempts) {
        s.attempts = v;
    }
    if let Some(v) = flags.schema_attempts.or(file.schema_attempts) {
        s.schema_attempts = v;
    }
    s.retry_budget = flags.retry_budget.or(file.retry_budget);
    s.allowed_models = if flags.allowed_models.is_empty() {
        file.available_models.clone()
    } else {
        flags.allowed_models.clone()
    };
    s.allowed_models.retain(|m| !m.trim().is_empty());
    if let Some(v) = flags.max_agents.or(file.max_agents) {
        s.max_agents = v;
    }
    if let Some(v) = flags.budget.or(file.budget) {
        s.budget_tokens = Some(v);
    }
    if let Some(v) = flags.budget_usd.or(file.budget_usd) {
        s.budget_usd = Some(v);
    }
    s.budget_interrupts = flags.budget_interrupt || file.budget_interrupt.unwrap_or(false);
    if let Some(v) = pick_s(&flags.stagger, &file.stagger) {
        s.stagger_ms = parse_duration("--stagger", &v)?.as_millis() as u64;
    }
    if let Some(v) = flags.script_memory.or(file.script_memory) {
        s.script_memory_mb = v;
    }
    if let Some(v) = pick_s(&flags.script_cpu, &file.script_cpu) {
        s.script_cpu_ms = parse_duration("--script-cpu", &v)?.as_millis() as u64;
    }
    if let Some(v) = pick_s(&flags.throttle_wait, &file.throttle_wait) {
        s.throttle_wait_ms = parse_duration("--throttle-wait", &v)?.as_millis() as u64;
    }
    if let Some(v) = pick_s(&flags.worker_wait, &file.worker_wait) {
        s.worker_wait_ms = parse_duration("--worker-wait", &v)?.as_millis() as u64;
    }
    match s.backend.as_str() {
        "echo" | "exec" | "claude-code" | "anthropic" | "openai" => {}
        other => {
            return Err(Problem::invalid(format!(
                "unknown backend {other:?}: use --backend echo, exec, claude-code, anthropic or openai"
            )));
        }
    }
    let exec_cmd = pick_s(&flags.exec_cmd, &file.exec_cmd);
    if local && s.backend == "exec" && exec_cmd.as_deref().is_none_or(|c| c.trim().is_empty()) {
        return Err(Problem::invalid(
            "--backend exec needs --exec-cmd CMD: the command each agent runs (prompt on stdin, result on stdout)",
        ));
    }
    s.validate().map_err(|e| Problem::invalid(e.to_string()))?;
    Ok(Merged {
        settings: s,
        exec_cmd,
        store: pick_s(&flags.store, &file.store),
        workspace: flags.workspace.clone().or_else(|| file.workspace.clone()),
    })
}

/// Run settings a workflow's `meta` suggests (W02 extension): `concurrency`, `budget`
/// (output tokens), `budgetUsd`, `backend` and `model`, each used only where neither a flag,
/// a `FLOTILLA_*` variable nor the config file set it. Other `meta` keys are ignored.
fn meta_defaults(
    s: &mut RunSettings,
    meta: &serde_json::Value,
    flags: &SettingFlags,
    file: &ConfigFile,
) -> Result<(), Problem> {
    let bad = |key: &str, want: &str| {
        Problem::invalid(format!(
            "the workflow's meta.{key} must be {want}; fix the script's meta or pass --{key} to override"
        ))
    };
    if flags.concurrency.is_none()
        && file.concurrency.is_none()
        && let Some(v) = meta.get("concurrency")
    {
        s.concurrency = v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad("concurrency", "a whole number"))?;
    }
    if flags.budget.is_none()
        && file.budget.is_none()
        && let Some(v) = meta.get("budget")
    {
        s.budget_tokens = Some(
            v.as_u64()
                .ok_or_else(|| bad("budget", "a whole number of output tokens"))?,
        );
    }
    if flags.budget_usd.is_none()
        && file.budget_usd.is_none()
        && let Some(v) = meta.get("budgetUsd")
    {
        s.budget_usd = Some(
            v.as_f64()
                .ok_or_else(|| bad("budgetUsd", "a number of dollars"))?,
        );
    }
    if flags.backend.is_none()
        && file.backend.is_none()
        && let Some(v) = meta.get("backend")
    {
        let b = v.as_str().ok_or_else(|| bad("backend", "a backend name"))?;
        match b {
            // An exec backend needs a command the script cannot give; keep the default then.
            "exec" if flags.exec_cmd.is_none() && file.exec_cmd.is_none() => {}
            "echo" | "exec" | "claude-code" | "anthropic" | "openai" => s.backend = b.to_owned(),
            other => {
                return Err(bad(
                    "backend",
                    &format!("echo, exec, claude-code, anthropic or openai, not {other:?}"),
                ));
            }
        }
    }
    if s.model.is_empty()
        && let Some(v) = meta.get("model")
    {
        s.model = v
            .as_str()
            .ok_or_else(|| bad("model", "a model name"))?
            .to_owned();
    }
    s.validate().map_err(|e| Problem::invalid(e.to_string()))
}

/// Whether new runs are refused (W67): `FLOTILLA_DISABLE_WORKFLOWS=1` (or Claude Code's
/// `CLAUDE_CODE_DISABLE_WORKFLOWS=1`), or `disable_workflows = true` in the config file.
pub fn workflows_disabled(file: &ConfigFile) -> bool {
    let env = [
        "FLOTILLA_DISABLE_WORKFLOWS",
        "CLAUDE_CODE_DISABLE_WORKFLOWS",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|s| s == "1" || s.eq_ignore_ascii_case("true")));
    env || file.disable_workflows.unwrap_or(false)
}

/// The refusal when workflows are disabled.
pub const DISABLED: &str = "workflows are disabled here (FLOTILLA_DISABLE_WORKFLOWS or disable_workflows in the config file); runs already in progress keep going; unset it to start new runs";

/// Reads the script, args and settings of `flotilla run`.
pub fn resolve_run(args: &crate::RunArgs) -> Result<ResolvedRun, Problem> {
    resolve_run_with(args, &[], true)
}

/// Like [`resolve_run`], with the workflows saved on a coordinator (found after the user's
/// project and personal ones, before the bundled ones). `local`: the run happens in this
/// process (a fleet's workers bring their own `--exec-cmd`).
pub fn resolve_run_with(
    args: &crate::RunArgs,
    server: &[flotilla_local::workflows::FoundWorkflow],
    local: bool,
) -> Result<ResolvedRun, Problem> {
    let file = read_config(args.config.as_deref())?;
    if workflows_disabled(&file) {
        return Err(Problem::invalid(DISABLED));
    }
    let Merged {
        settings,
        exec_cmd,
        store,
        workspace,
    } = settings_from(&args.settings, &file, local)?;
    let store_url = store_url(store);
    let cwd = std::env::current_dir()
        .map_err(|e| Problem::invalid(format!("cannot read the working directory: {e}")))?;
    let mut workflows_dirs = args.settings.workflows_dirs.clone();
    workflows_dirs.extend(file.workflows_dirs.iter().cloned());

    let json_args = match (&args.args, &args.args_file) {
        (Some(text), _) => Some(serde_json::from_str(text).map_err(|e| {
            Problem::invalid(format!(
                "--args is not valid JSON ({e}); pass e.g. --args '{{\"dir\":\"src\"}}'"
            ))
        })?),
        (None, Some(path)) => {
            let text = flotilla_local::reads::read_file(
                path,
                flotilla_local::reads::ARGS_BYTES,
                "--args-file",
            )?;
            Some(serde_json::from_str(&text).map_err(|e| {
                Problem::invalid(format!(
                    "--args-file {} is not valid JSON: {e}",
                    path.display()
                ))
            })?)
        }
        (None, None) => None,
    };

    let path = PathBuf::from(&args.script);
    // `/name` is Claude Code's way to call a saved workflow (W63), not an absolute path.
    let slash_name = args
        .script
        .strip_prefix('/')
        .is_some_and(|rest| !rest.is_empty() && !rest.contains('/'));
    let by_path = !args.by_name
        && (path.exists()
            || args.script.ends_with(".js")
            || (args.script.contains('/') && !slash_name));
    let saved_name = (!by_path).then(|| args.script.trim_start_matches('/').to_owned());
    let (source, origin) = if by_path {
        let source =
            flotilla_local::reads::read_file(&path, flotilla_local::reads::SCRIPT_BYTES, "script")?;
        (source, path.display().to_string())
    } else {
        // A saved workflow's name: project and personal first, then the coordinator's,
        // then the bundled ones.
        let resolver = flotilla_local::workflows::DirResolver::standard(&cwd, &workflows_dirs);
        let name = args.script.trim_start_matches('/');
        let found = match resolver
            .find_saved(name)
            .map_err(|e| Problem::new(e.kind(), e.to_string()))?
        {
            Some(f) => f,
            None => match server.iter().find(|w| w.name == name) {
                Some(f) => f.clone(),
                None => flotilla_local::workflows::WorkflowResolver::resolve(
                    &resolver,
                    &flotilla_local::workflows::WorkflowRef::Name(name.to_owned()),
                )
                .map_err(|e| Problem::new(e.kind(), e.to_string()))?,
            },
        };
        (found.source, found.origin)
    };
    let mut settings = settings;
    let mut meta_backend = false;
    if let Ok(meta) = flotilla_script::text::read_meta(&source) {
        meta_defaults(&mut settings, &meta.raw, &args.settings, &file)?;
        meta_backend = meta.raw.get("backend").is_some();
    }
    // Nothing named a backend: here, the one this machine has, or a refusal with the choices;
    // on a fleet, what its workers offer matters, not this machine: the coordinator chooses
    // among them (an empty backend asks it to) unless FLOTILLA_DEFAULT_BACKEND says.
    let mut backend_chosen = None;
    if args.settings.backend.is_none() && file.backend.is_none() && !meta_backend {
        if local {
            let (backend, why) = default_backend()?;
            settings.backend = backend;
            backend_chosen = why;
        } else {
            settings.backend = env_default_backend()?.unwrap_or_default();
        }
    }
    // Agents work where the run was started, as Claude Code's do: the repository root when
    // inside one, else this directory; --workspace DIR says otherwise.
    let workspace = workspace.unwrap_or_else(|| {
        flotilla_local::workflows::repo_root(&cwd).unwrap_or_else(|| cwd.clone())
    });
    Ok(ResolvedRun {
        source,
        origin,
        args: json_args,
        settings,
        resume: args.resume.clone(),
        store_url,
        workspace,
        exec_cmd,
        workflows_dirs,
        cwd,
        saved_name,
        backend_chosen,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_accept_units_and_plain_milliseconds() {
        assert_eq!(
            parse_duration("x", "300ms").unwrap(),
            Duration::from_millis(300)
        );
        assert_eq!(parse_duration("x", "5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("x", "3m").unwrap(), Duration::from_secs(180));
        assert_eq!(
            parse_duration("x", "250").unwrap(),
            Duration::from_millis(250)
        );
        assert!(
            parse_duration("--stall-timeout", "soon")
                .unwrap_err()
                .message
                .contains("--stall-timeout")
        );
    }

    #[test]
    fn flags_override_the_config_file() {
        let flags = SettingFlags {
            concurrency: Some(4),
            stall_timeout: Some("300ms".into()),
            ..SettingFlags::default()
        };
        let file: ConfigFile =
            toml::from_str("concurrency = 9\nattempts = 3\nstagger = \"0\"").unwrap();
        let s = settings_from(&flags, &file, true).unwrap().settings;
        assert_eq!(s.concurrency, 4);
        assert_eq!(s.attempts, 3);
        assert_eq!(s.stagger_ms, 0);
        assert_eq!(s.stall_timeout_ms, 300);
        assert!(toml::from_str::<ConfigFile>("concurency = 1").is_err());
    }

    /// The config file's keys are the flags in snake_case: every flag that sets a run (and
    /// every client identity flag) is a key the file takes, with the same meaning.
    #[test]
    fn every_setting_flag_is_a_config_key_in_snake_case() {
        use clap::Args as _;
        let cmd = crate::client::ClientArgs::augment_args(SettingFlags::augment_args(
            clap::Command::new("flags"),
        ));
        let mut checked = 0;
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else {
                continue;
            };
            let key = long.replace('-', "_");
            // Any value: only whether the key is known is asked here.
            if let Err(e) = toml::from_str::<ConfigFile>(&format!("{key} = 0")) {
                assert!(
                    !e.to_string().contains("unknown field"),
                    "--{long} has no config key {key}: {e}"
                );
            }
            checked += 1;
        }
        assert!(checked > 30, "{checked}");
        // The same meaning under the flag's name.
        let file: ConfigFile = toml::from_str(
            "allowed_models = [\"sonnet\"]\nlabel = [\"team=payments\"]\nworkflows_dir = [\"wf\"]",
        )
        .unwrap();
        let m = settings_from(&SettingFlags::default(), &file, true).unwrap();
        assert_eq!(m.settings.allowed_models, ["sonnet"]);
        assert_eq!(
            m.settings.labels.get("team").map(String::as_str),
            Some("payments")
        );
        assert_eq!(file.workflows_dirs, [PathBuf::from("wf")]);
    }

    #[test]
    fn exec_needs_a_command_and_unknown_backends_are_named() {
        let flags = SettingFlags {
            backend: Some("exec".into()),
            ..SettingFlags::default()
        };
        let e = settings_from(&flags, &ConfigFile::default(), true).unwrap_err();
        assert!(e.message.contains("--exec-cmd"), "{e}");
        let flags = SettingFlags {
            backend: Some("gpt".into()),
            ..SettingFlags::default()
        };
        let e = settings_from(&flags, &ConfigFile::default(), true).unwrap_err();
        assert!(e.message.contains("unknown backend \"gpt\""), "{e}");
    }

    #[test]
    fn the_sample_config_in_deploy_is_valid() {
        let file: ConfigFile =
            toml::from_str(include_str!("../../deploy/flotilla.example.toml")).unwrap();
        let s = settings_from(&SettingFlags::default(), &file, true)
            .unwrap()
            .settings;
        assert_eq!(
            s,
            RunSettings::default(),
            "the sample documents the defaults"
        );
    }
}

/// Property-based fuzzing of the config parser (`tools/fuzz` runs it long).
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    const VALID: &str = "coordinator = \"https://10.0.0.1:7443\"\nbackend = \"echo\"\nconcurrency = 8\n\
        budget_usd = 2.5\nstore = \"s3://runs/team\"\netcd = [\"http://10.0.0.2:2379\"]\n\
        stall_timeout = \"5m\"\ndisable_workflows = false\n";

    proptest! {
        #[test]
        fn any_text_is_answered_without_a_panic(text in "\\PC{0,300}") {
            let _ = parse_config(&text, "fuzz.toml");
        }

        #[test]
        fn a_damaged_config_is_answered_and_its_error_names_the_file(
            cuts in prop::collection::vec((0usize..VALID.len(), "[=\\[\\]\"'#\\n a-z0-9.]{1,4}"), 1..5),
        ) {
            let mut text = VALID.to_owned();
            for (at, piece) in cuts {
                text.insert_str(at.min(text.len()), &piece);
            }
            if let Err(e) = parse_config(&text, "fuzz.toml") {
                prop_assert!(e.message.contains("fuzz.toml"), "{}", e);
            }
        }
    }

    #[test]
    fn the_valid_config_parses() {
        let c = parse_config(VALID, "fuzz.toml").unwrap();
        assert_eq!(c.concurrency, Some(8));
    }
}

/// `FLOTILLA_ADMISSION`: `on` (the default) or `off` (no admission per provider account:
/// calls go as slots and concurrency allow).
/// `FLOTILLA_AFFINITY`: prefix affinity on (the default) or `off`.
pub fn affinity_from_env() -> Result<bool, Problem> {
    match std::env::var("FLOTILLA_AFFINITY").as_deref() {
        Err(_) | Ok("" | "on") => Ok(true),
        Ok("off") => Ok(false),
        Ok(other) => Err(Problem::invalid(format!(
            "FLOTILLA_AFFINITY takes on or off (got {other:?})"
        ))),
    }
}

pub fn admission_from_env() -> Result<bool, Problem> {
    match std::env::var("FLOTILLA_ADMISSION").as_deref() {
        Err(_) | Ok("" | "on") => Ok(true),
        Ok("off") => Ok(false),
        Ok(other) => Err(Problem::invalid(format!(
            "FLOTILLA_ADMISSION takes on or off (got {other:?})"
        ))),
    }
}
