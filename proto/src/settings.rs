//! Run settings: the knobs of one run (spec/echo-backend.md, "Run settings that tests set").
//! Every field is an ordinary run option: a CLI flag, a config key and a launch-request field.
//! They are stored in the run's manifest, so a resumed or reopened run knows how it ran.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Longest stall timeout accepted.
pub const MAX_STALL_TIMEOUT_MS: u64 = 7 * 24 * 3600 * 1000;
/// Longest prefix-stagger cap accepted.
pub const MAX_STAGGER_MS: u64 = 3600 * 1000;
/// Longest CPU slice a script may be given.
pub const MAX_SCRIPT_CPU_MS: u64 = 3600 * 1000;
/// Largest script memory limit, in MiB (the script runtime is one thread of the
/// coordinator; more than this is a typo, not a workflow).
pub const MAX_SCRIPT_MEMORY_MB: u64 = 16 * 1024;
/// How long a call waits for a worker that offers its backend, by default.
pub const DEFAULT_WORKER_WAIT_MS: u64 = 10 * 60 * 1000;

/// A run setting that cannot be used; each message names the setting and what it takes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingsError {
    #[error("unknown replay mode {0:?}: use content or prefix")]
    Replay(String),
    #[error("concurrency must be at least 1")]
    Concurrency,
    #[error("--budget-usd must be a positive amount of dollars, e.g. --budget-usd 5")]
    BudgetUsd,
    #[error("attempts must be at least 1")]
    Attempts,
    #[error("schema attempts must be at least 1")]
    SchemaAttempts,
    #[error("the stall timeout must be longer than 0")]
    NoStallTimeout,
    #[error("the stall timeout must be at most 7 days")]
    StallTimeout,
    #[error("the stagger cap must be at most 1 hour (0 turns it off)")]
    Stagger,
    #[error("the script CPU limit must be longer than 0")]
    NoScriptCpu,
    #[error("the script CPU limit must be at most 1 hour")]
    ScriptCpu,
    #[error("the script memory limit must be at least 8 MiB")]
    ScriptMemoryLow,
    #[error(
        "the script memory limit must be at most {MAX_SCRIPT_MEMORY_MB} MiB (16 GiB); the script only orchestrates, agents do the work"
    )]
    ScriptMemoryHigh,
    #[error("the worker wait must be longer than 0")]
    NoWorkerWait,
    #[error("a backend must be named (e.g. echo or exec)")]
    NoBackend,
    #[error("{0}")]
    Notify(String),
    #[error("a run carries at most {MAX_LABELS} labels")]
    Labels,
    #[error(
        "--namespace {0:?} is not a namespace name: 1 to 63 lower-case letters, digits, - _ and ."
    )]
    Namespace(String),
    #[error(
        "label {0:?} is not KEY=VALUE with a key of lower-case letters, digits, - _ . and / (at most 63) and a value of at most 256 printable characters"
    )]
    Label(String),
    #[error("source repository {0:?} is not an id (letters, digits, - and _)")]
    SourceRepo(String),
    #[error("source submodule path {0:?} is not a path inside the repository")]
    Submodule(String),
    #[error("source commit {0:?} is not a full commit id (40 or 64 hex digits)")]
    SourceCommit(String),
    #[error("source URL {url:?} cannot be fetched: {why}")]
    SourceUrl { url: String, why: String },
    #[error("source ref {0:?} is not a branch, tag or commit name")]
    SourceRef(String),
    #[error("source repository {repo:?} is not the id of {url:?}; leave it to the launcher")]
    NotTheUrlsRepo { repo: String, url: String },
}

impl SettingsError {
    /// Every one is the caller's to fix.
    pub fn kind(&self) -> crate::ErrorKind {
        crate::ErrorKind::Invalid
    }

    /// Whether it is about the run's source (what a launcher sent, not what a user typed).
    pub fn is_source(&self) -> bool {
        matches!(
            self,
            SettingsError::SourceRepo(_)
                | SettingsError::Submodule(_)
                | SettingsError::SourceCommit(_)
                | SettingsError::SourceUrl { .. }
                | SettingsError::SourceRef(_)
                | SettingsError::NotTheUrlsRepo { .. }
        )
    }
}

/// How a resumed run reuses the results of its source run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayMode {
    /// Every call whose content key has a completed result in the source is served from it,
    /// whatever the order (fixes W77, W86).
    #[default]
    Content,
    /// Claude Code's ordered-prefix rule (W51): calls are matched in start order; the first
    /// call that differs or has no completed result, and every call after it, runs again.
    Prefix,
}

impl std::str::FromStr for ReplayMode {
    type Err = SettingsError;
    fn from_str(s: &str) -> Result<Self, SettingsError> {
        match s {
            "content" => Ok(ReplayMode::Content),
            "prefix" => Ok(ReplayMode::Prefix),
            other => Err(SettingsError::Replay(other.to_owned())),
        }
    }
}

/// The settings of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunSettings {
    /// Backend that runs the agents (`echo`, `exec`, ...).
    pub backend: String,
    /// Model used when `agent()` and its agent type name none (empty: the backend's default).
    pub model: String,
    /// Use `model` for every call, whatever the call or its agent type asks for
    /// (`CLAUDE_CODE_SUBAGENT_MODEL_FORCE=1`).
    pub force_model: bool,
    /// Agents of this run that run at once; more calls queue (W38).
    pub concurrency: u32,
    /// An attempt with no progress for this long is restarted (W58).
    pub stall_timeout_ms: u64,
    /// Attempts per agent, counting stall restarts and retries (W58).
    pub attempts: u32,
    /// Structured-output submissions per attempt before the call rejects (W14).
    pub schema_attempts: u32,
    /// `agent()` calls per run, nested workflows included (W40).
    pub max_agents: u64,
    /// Output-token budget of the run (`budget.total`, W35); `None`: no budget.
    pub budget_tokens: Option<u64>,
    /// Money ceiling of the run in US dollars: once its attempts have cost this much, a run
    /// on a coordinator is paused until the ceiling is raised (`flotilla budget`); a
    /// `flotilla run` refuses new agents and stops running ones (`BUDGET_EXCEEDED`).
    pub budget_usd: Option<f64>,
    /// At the money ceiling, a coordinator's run interrupts its running agents too (what
    /// they wrote is kept for when it goes on, W58) instead of letting them finish.
    pub budget_interrupts: bool,
    /// Longest hold of the prefix-cache stagger (W60); 0 turns it off.
    pub stagger_ms: u64,
    /// Replay rule when the run resumes another.
    pub replay: ReplayMode,
    /// Memory limit of the script runtime, in MiB.
    pub script_memory_mb: u64,
    /// CPU time the script may use between two awaits, in milliseconds.
    pub script_cpu_ms: u64,
    /// How long a call waits for an attached worker that offers its backend and model before
    /// it fails with the reason (no such worker, not merely all busy).
    pub worker_wait_ms: u64,
    /// The code the agents work on (fleet runs): a commit of a repository whose objects are
    /// in the store, or one the workers fetch themselves. `None`: a scratch directory per
    /// agent (and, embedded, the run's own directory).
    pub source: Option<SourceRef>,
    /// The run's labels (`--label KEY=VALUE`), for finding it again (`flotilla runs --label`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// A URL the run's end is POSTed to, signed (`--notify`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notify: Option<String>,
    /// Attempts beyond each agent's first that the whole run may make (`--retry-budget`,
    /// opt-in); `None`: no such bound, every agent gets its attempts as under Claude Code
    /// (W23/W58). Once spent, a failing agent fails as its last attempt would have, with the
    /// same cause and code. Throttles and usage-limit waits are not retries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_budget: Option<u64>,
    /// How long one agent may wait out throttles (429, 529) in all before it fails.
    pub throttle_wait_ms: u64,
    /// The models agents may run on (Claude Code's `availableModels`: aliases such as
    /// `sonnet` or model ids); empty: any. An agent that asks for another runs on a
    /// substitute, and the report warns, naming both (W18).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allowed_models: Vec<String>,
    /// The namespace the run belongs to (see `namespace`); empty: `default`. A coordinator
    /// sets it from the caller's certificate, whatever the client sent.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Labels every worker that runs one of its agents must carry: its namespace's, fixed at
    /// launch (an agent's own `placement` labels add to them and cannot change them).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub pinned_labels: BTreeMap<String, String>,
    /// What its agents' tokens cost, by model or family: its namespace's price table, fixed at
    /// launch; a model not in it costs what the backend says.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub prices: BTreeMap<String, crate::usage::Price>,
}

/// Whether `model` is one `allowed` names: the same, or of the same family (an alias such as
/// `sonnet` allows `claude-sonnet-4-5`, and the other way round).
pub fn model_allowed(allowed: &str, model: &str) -> bool {
    let family = |a: &str, id: &str| {
        !a.is_empty() && a.chars().all(|c| c.is_ascii_alphabetic()) && id.contains(a)
    };
    let (allowed, model) = (
        allowed.trim_end_matches("[1m]"),
        model.trim_end_matches("[1m]"),
    );
    allowed == model || family(allowed, model) || family(model, allowed)
}

/// How long an agent waits out throttles unless the run says.
pub const DEFAULT_THROTTLE_WAIT_MS: u64 = 15 * 60 * 1000;

/// The most labels a run carries.
pub const MAX_LABELS: usize = 32;

/// Whether `key` is a label key: 1 to 63 of lower-case letters, digits, `-`, `_`, `.` and
/// `/`, starting with a letter or digit.
pub fn valid_label_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 63
        && key.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && key.chars().all(|c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.' | '/')
        })
}

/// Whether `value` is a label value: at most 256 printable characters.
pub fn valid_label_value(value: &str) -> bool {
    value.chars().count() <= 256 && !value.chars().any(char::is_control)
}

/// A run's source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceRef {
    /// The repository's id in the store (from its root commit), or of a URL.
    pub repo: String,
    /// The commit the agents start from: a snapshot of the client's tree, or a fetched ref.
    pub commit: String,
    /// A repository the workers fetch themselves (`git+URL#REF`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Where it came from, for display (a path and branch, or the URL).
    #[serde(default)]
    pub origin: String,
    /// Submodules that travel as plain files in the snapshot (`--submodules`), by path.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub submodules: Vec<String>,
}

impl Default for RunSettings {
    fn default() -> Self {
        RunSettings {
            backend: "echo".into(),
            model: String::new(),
            force_model: false,
            concurrency: 16,
            stall_timeout_ms: 180_000,
            attempts: 6,
            schema_attempts: 5,
            max_agents: 1000,
            budget_tokens: None,
            budget_usd: None,
            budget_interrupts: false,
            stagger_ms: 5000,
            replay: ReplayMode::Content,
            script_memory_mb: 512,
            script_cpu_ms: 10_000,
            worker_wait_ms: DEFAULT_WORKER_WAIT_MS,
            source: None,
            labels: BTreeMap::new(),
            notify: None,
            retry_budget: None,
            throttle_wait_ms: DEFAULT_THROTTLE_WAIT_MS,
            allowed_models: Vec::new(),
            namespace: String::new(),
            pinned_labels: BTreeMap::new(),
            prices: BTreeMap::new(),
        }
    }
}

impl RunSettings {
    /// Checks the settings; the error names the setting and the fix.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.backend.is_empty() {
            return Err(SettingsError::NoBackend);
        }
        self.validate_but_backend()
    }

    /// [`RunSettings::validate`] but for the backend: a fleet launch that names none gets
    /// one its coordinator's workers offer ([`crate::Coordinator::launch`]).
    pub fn validate_but_backend(&self) -> Result<(), SettingsError> {
        let checks = [
            (self.concurrency == 0, SettingsError::Concurrency),
            (
                self.budget_usd.is_some_and(|b| !(b > 0.0 && b.is_finite())),
                SettingsError::BudgetUsd,
            ),
            (self.attempts == 0, SettingsError::Attempts),
            (self.schema_attempts == 0, SettingsError::SchemaAttempts),
            (self.stall_timeout_ms == 0, SettingsError::NoStallTimeout),
            (
                self.stall_timeout_ms > MAX_STALL_TIMEOUT_MS,
                SettingsError::StallTimeout,
            ),
            (self.stagger_ms > MAX_STAGGER_MS, SettingsError::Stagger),
            (
                self.script_cpu_ms > MAX_SCRIPT_CPU_MS,
                SettingsError::ScriptCpu,
            ),
            (self.script_memory_mb < 8, SettingsError::ScriptMemoryLow),
            (
                self.script_memory_mb > MAX_SCRIPT_MEMORY_MB,
                SettingsError::ScriptMemoryHigh,
            ),
            (self.worker_wait_ms == 0, SettingsError::NoWorkerWait),
            (self.script_cpu_ms == 0, SettingsError::NoScriptCpu),
        ];
        if let Some((_, e)) = checks.into_iter().find(|(bad, _)| *bad) {
            return Err(e);
        }
        if let Some(source) = &self.source {
            source.validate()?;
        }
        if let Some(url) = &self.notify {
            crate::names::check_notify_url(url).map_err(|p| SettingsError::Notify(p.into()))?;
        }
        if self.labels.len() > MAX_LABELS {
            return Err(SettingsError::Labels);
        }
        if !self.namespace.is_empty() && !crate::names::valid_namespace(&self.namespace) {
            return Err(SettingsError::Namespace(self.namespace.clone()));
        }
        for (k, v) in &self.labels {
            if !valid_label_key(k) || !valid_label_value(v) {
                return Err(SettingsError::Label(k.clone()));
            }
        }
        Ok(())
    }
}

/// Where the workers fetch a `git+URL` source from, as their git reads the URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchFrom {
    /// An https, http, ssh (`ssh://`, `git+ssh://`, scp-like `[user@]host:path`) or git URL.
    Network,
    /// `file://…` or a path: a worker's own disk, fetched only by workers started with
    /// `--allow-file-sources`, and accepted only by a coordinator that says so.
    WorkerDisk,
}

/// The schemes the workers fetch (their git allows no other transport).
const NETWORK_SCHEMES: [&str; 6] = ["https", "http", "ssh", "git", "git+ssh", "ssh+git"];

/// A URL's host (or user) as ssh and git read it: a name, an address or a bracketed IPv6
/// literal, never anything an ssh command line could take for an option.
fn plain_host(h: &str) -> bool {
    let name = |h: &str| {
        !h.is_empty()
            && !h.starts_with('-')
            && h.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
    };
    match h.strip_prefix('[').and_then(|v6| v6.strip_suffix(']')) {
        Some(v6) => {
            !v6.is_empty()
                && v6
                    .chars()
                    .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
        }
        None => name(h),
    }
}

impl SourceRef {
    /// Whether the workers can fetch `url`, and from where: a URL source's check at launch
    /// (on the client and again on the coordinator, which a client need not be). Refused:
    /// schemes other than [`NETWORK_SCHEMES`] and `file` (`ftp://` would fail every agent on
    /// the workers), git's remote helpers (`ext::`, `fd::`), anything starting with `-`
    /// (git and ssh would read an option: `--upload-pack=…`, `-oProxyCommand=…`), a host
    /// or user ssh could read as an option, control characters and URLs over 4096 bytes.
    /// Each refusal says why and what to give instead.
    pub fn fetch_from(url: &str) -> Result<FetchFrom, SettingsError> {
        let refuse = |why: String| {
            Err(SettingsError::SourceUrl {
                url: url.to_owned(),
                why,
            })
        };
        let example = "give git+URL#REF, e.g. git+https://host/repo.git#main";
        if url.is_empty() {
            return refuse(format!("it is empty; {example}"));
        }
        if url.len() > 4096 {
            return refuse(format!("it is longer than 4096 bytes; {example}"));
        }
        if url.chars().any(char::is_control) {
            return refuse(
                "it holds a control character (a newline, a tab, NUL…); remove it".into(),
            );
        }
        if url.starts_with('-') {
            return refuse(format!(
                "it starts with -, which git reads as an option; {example}"
            ));
        }
        // `helper::address`: git runs `git-remote-helper` (`ext::` runs any command).
        let scheme_len = url
            .char_indices()
            .take_while(|&(i, c)| {
                c.is_ascii_alphabetic()
                    || (i > 0 && (c.is_ascii_digit() || matches!(c, '+' | '-' | '.')))
            })
            .count();
        if url[scheme_len..].starts_with("::") {
            return refuse(format!(
                "{:?} makes git run a remote helper on the workers, which they never do; give an https, http, ssh or git URL",
                &url[..scheme_len + 2]
            ));
        }
        if url.to_ascii_lowercase().starts_with("file:") {
            return Ok(FetchFrom::WorkerDisk);
        }
        if let Some((scheme, rest)) = url.split_once("://") {
            if !NETWORK_SCHEMES.contains(&scheme) {
                return refuse(format!(
                    "workers fetch https, http, ssh and git URLs, not {scheme}://; give e.g. git+https://host/repo.git#main (a repository on the workers' own disks is git+file:///path)"
                ));
            }
            let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
            let (user, host_port) = match authority.rsplit_once('@') {
                Some((u, h)) => (Some(u), h),
                None => (None, authority),
            };
            let host = match host_port.strip_prefix('[') {
                Some(v6) => match v6.split_once(']') {
                    Some((h, _)) => &host_port[..h.len() + 2],
                    None => host_port,
                },
                None => host_port.split(':').next().unwrap_or(""),
            };
            if host.is_empty() {
                return refuse(format!("it names no host; {example}"));
            }
            if !plain_host(host) {
                return refuse(format!(
                    "its host {host:?} is not a host name or address (letters, digits, . - _, or [an IPv6 address]; not starting with -); {example}"
                ));
            }
            if let Some(u) = user
                && (u.starts_with('-') || u.chars().any(char::is_whitespace))
            {
                return refuse(format!(
                    "its user {u:?} starts with - or holds a space, which ssh would misread; give the account's plain name"
                ));
            }
            return Ok(FetchFrom::Network);
        }
        // scp-like `[user@]host:path` when a `:` comes before any `/`; anything else is a path.
        match url.split_once(':') {
            Some((before, path)) if !before.contains('/') => {
                let (user, host) = match before.rsplit_once('@') {
                    Some((u, h)) => (Some(u), h),
                    None => (None, before),
                };
                let user_ok = user.is_none_or(|u| {
                    !u.is_empty() && !u.starts_with('-') && !u.chars().any(char::is_whitespace)
                });
                if !plain_host(host) || !user_ok {
                    return refuse(format!(
                        "{before:?} is not a host for git's user@host:path form (letters, digits, . - _; not starting with -); {example}"
                    ));
                }
                if path.starts_with('-') {
                    return refuse(format!(
                        "its path {path:?} starts with -, which the server's git would read as an option; give the repository's path"
                    ));
                }
                Ok(FetchFrom::Network)
            }
            _ => Ok(FetchFrom::WorkerDisk),
        }
    }

    /// The repository id a URL source has (what every launcher computes from the URL).
    pub fn url_repo(url: &str) -> String {
        use sha2::Digest;
        hex::encode(&sha2::Sha256::digest(url.as_bytes())[..16])
    }

    /// Checks what workers will be told to fetch or check out.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if !crate::names::valid_source_id(&self.repo) || self.repo.starts_with('-') {
            return Err(SettingsError::SourceRepo(self.repo.clone()));
        }
        for path in &self.submodules {
            let plain = !path.is_empty()
                && path.len() <= 4096
                && !path.starts_with('/')
                && !path.chars().any(char::is_control)
                && path
                    .split('/')
                    .all(|c| !c.is_empty() && c != "." && c != "..");
            if !plain || self.url.is_some() {
                return Err(SettingsError::Submodule(path.clone()));
            }
        }
        match &self.url {
            None => {
                let hex = self.commit.chars().all(|c| c.is_ascii_hexdigit());
                if !hex || !matches!(self.commit.len(), 40 | 64) {
                    return Err(SettingsError::SourceCommit(self.commit.clone()));
                }
            }
            Some(url) => {
                Self::fetch_from(url)?;
                let rev = &self.commit;
                let plain = !rev.is_empty()
                    && rev.len() <= 256
                    && !rev.starts_with('-')
                    && !rev.contains("..")
                    && rev
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
                if !plain {
                    return Err(SettingsError::SourceRef(rev.clone()));
                }
                if self.repo != Self::url_repo(url) {
                    return Err(SettingsError::NotTheUrlsRepo {
                        repo: self.repo.clone(),
                        url: url.clone(),
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn an_allowed_model_names_itself_its_family_or_its_alias() {
        assert!(model_allowed("sonnet", "sonnet"));
        assert!(model_allowed("sonnet", "claude-sonnet-4-5"));
        assert!(model_allowed("claude-sonnet-4-5", "sonnet"));
        assert!(model_allowed("sonnet", "sonnet[1m]"));
        assert!(!model_allowed("opus", "claude-sonnet-4-5"));
        assert!(!model_allowed("claude-sonnet-4-5", "claude-sonnet-4-0"));
        assert!(!model_allowed("", "sonnet"));
    }

    use super::*;

    fn with(source: SourceRef) -> Result<(), SettingsError> {
        RunSettings {
            source: Some(source),
            ..RunSettings::default()
        }
        .validate()
    }

    #[test]
    fn a_source_names_a_full_commit_or_a_plain_ref_of_its_own_url() {
        let snap = |repo: &str, commit: &str| SourceRef {
            repo: repo.into(),
            commit: commit.into(),
            url: None,
            origin: String::new(),
            submodules: Vec::new(),
        };
        let c40 = "a".repeat(40);
        assert_eq!(with(snap("0123abcd", &c40)), Ok(()));
        assert_eq!(with(snap("0123abcd", &"b".repeat(64))), Ok(()));
        for (repo, commit) in [
            ("../x", c40.as_str()),
            ("-x", c40.as_str()),
            ("", c40.as_str()),
            ("r", "HEAD"),
            ("r", "abc"),
            ("r", &"g".repeat(40)),
        ] {
            let e = with(snap(repo, commit)).unwrap_err();
            assert!(e.is_source(), "{repo} {commit}: {e}");
            assert!(e.to_string().starts_with("source "), "{repo} {commit}: {e}");
        }
        let url = |url: &str, rev: &str| SourceRef {
            repo: SourceRef::url_repo(url),
            commit: rev.into(),
            url: Some(url.into()),
            origin: String::new(),
            submodules: Vec::new(),
        };
        assert_eq!(with(url("https://h/r.git", "main")), Ok(()));
        assert_eq!(with(url("https://h/r.git", "release/1.2")), Ok(()));
        for (u, rev) in [
            ("https://h/r.git", "--upload-pack=x"),
            ("https://h/r.git", "a..b"),
            ("https://h/r.git", "a b"),
            ("--upload-pack=x", "main"),
            ("https://h/r\n.git", "main"),
        ] {
            assert!(with(url(u, rev)).is_err_and(|e| e.is_source()), "{u} {rev}");
        }
        let mut sub = snap("0123abcd", &c40);
        sub.submodules = vec!["vendor/lib".into()];
        assert_eq!(with(sub.clone()), Ok(()));
        for bad in ["", "/etc", "a/../b", "a//b", "x\n"] {
            sub.submodules = vec![bad.into()];
            assert_eq!(with(sub.clone()), Err(SettingsError::Submodule(bad.into())));
        }
        // A URL source under another repository's id (its cache on the workers) is refused.
        let mut other = url("https://h/r.git", "main");
        other.repo = "0123abcd".into();
        assert!(matches!(
            with(other),
            Err(SettingsError::NotTheUrlsRepo { .. })
        ));
    }

    #[test]
    fn a_source_url_is_fetched_over_the_network_from_a_worker_s_disk_or_refused() {
        for url in [
            "https://h/r.git",
            "http://h:8080/r",
            "ssh://git@h/r.git",
            "git+ssh://h/r",
            "git://h/r",
            "git@h:team/r.git",
            "h:r.git",
            "https://u:p@[fe80::1]:444/r",
        ] {
            assert_eq!(SourceRef::fetch_from(url), Ok(FetchFrom::Network), "{url}");
        }
        for url in [
            "file:///srv/r.git",
            "FILE:///srv/r",
            "file:r",
            "/srv/r.git",
            "./r",
            "r.git",
        ] {
            assert_eq!(
                SourceRef::fetch_from(url),
                Ok(FetchFrom::WorkerDisk),
                "{url}"
            );
        }
        for (url, says) in [
            ("ftp://h/r", "not ftp://"),
            ("HTTPS://h/r", "not HTTPS://"),
            ("://h/r", "not ://"),
            ("ext::sh -c id", "\"ext::\" makes git run a remote helper"),
            ("fd::0", "remote helper"),
            ("transport+x.y::addr", "remote helper"),
            ("--upload-pack=id", "starts with -"),
            ("-h:r", "starts with -"),
            ("ssh://-oProxyCommand=id/r", "host \"-oProxyCommand=id\""),
            ("ssh://-u@h/r", "user \"-u\""),
            ("ssh://h%2d/r", "host"),
            ("ssh://[::1/r", "host"),
            ("git@-oProxyCommand=id:r", "not a host"),
            ("@h:r", "not a host"),
            (":r", "not a host"),
            ("h:-r", "its path \"-r\""),
            ("https:///r", "names no host"),
            ("https://h/r\n", "control character"),
            ("", "empty"),
        ] {
            let e = SourceRef::fetch_from(url).expect_err(url);
            assert!(e.is_source(), "{url}");
            let e = e.to_string();
            assert!(
                e.contains(says) && e.contains("cannot be fetched"),
                "{url}: {e}"
            );
        }
        let long = format!("https://h/{}", "a".repeat(4096));
        assert!(SourceRef::fetch_from(&long).is_err());
    }

    #[test]
    fn each_bad_setting_is_named() {
        let bad = |f: fn(&mut RunSettings)| {
            let mut s = RunSettings::default();
            f(&mut s);
            s.validate().unwrap_err()
        };
        assert_eq!(RunSettings::default().validate(), Ok(()));
        assert_eq!(bad(|s| s.concurrency = 0), SettingsError::Concurrency);
        assert_eq!(bad(|s| s.budget_usd = Some(-1.0)), SettingsError::BudgetUsd);
        assert_eq!(
            bad(|s| s.budget_usd = Some(f64::NAN)),
            SettingsError::BudgetUsd
        );
        assert_eq!(bad(|s| s.attempts = 0), SettingsError::Attempts);
        assert_eq!(
            bad(|s| s.stall_timeout_ms = 0),
            SettingsError::NoStallTimeout
        );
        assert_eq!(
            bad(|s| s.script_memory_mb = 4),
            SettingsError::ScriptMemoryLow
        );
        assert_eq!(bad(|s| s.script_cpu_ms = 0), SettingsError::NoScriptCpu);
        assert_eq!(bad(|s| s.backend.clear()), SettingsError::NoBackend);
        assert_eq!(
            "fast".parse::<ReplayMode>(),
            Err(SettingsError::Replay("fast".into()))
        );
        assert_eq!(bad(|s| s.attempts = 0).kind(), crate::ErrorKind::Invalid);
    }
}
