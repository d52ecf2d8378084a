//! A worker's copies of run sources: a bare repository per source repository, filled through
//! the coordinator link, and a checkout per call.
//!
//! Caches are per namespace (`.flotilla/caches/NAMESPACE/REPO.git` under the workspace root):
//! what one team's runs brought is never in another team's checkouts. No sandbox ever shows
//! a cache writable, and the worker makes each one its own again before it uses it (see
//! [`harden_cache`]): its git never reads configuration, hooks or attributes an agent wrote.
//!
//! Workers never touch storage: a worker that lacks a run's commit sends a `SourceRequest` on
//! its link, with the packs it applied already, and indexes each pack that comes back
//! (`git index-pack`), dependencies first. A warm worker transfers nothing for another run of
//! a commit it has. Sources fetched by URL (`git+URL#REF`) come with `git fetch` instead.
//!
//! Each call works in its own checkout (`git worktree add --detach`) at `{root}/{run}/{call}`,
//! which its attempts share (W58). The cache is only a cache: a checkout that fails on
//! missing or corrupt objects drops the repository and fetches it again, once.

use flotilla_proto::Problem;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_proto::v1::{self, FailureKind, WorkerMessage, worker_message};
use tokio::sync::mpsc;

use crate::failure::Error;
use crate::gateway::inward;
use crate::worktree::git;

/// Longest wait for the next piece of a source from the coordinator.
const QUIET: Duration = Duration::from_secs(120);
/// The worker acknowledges what it took of a source this often (the coordinator keeps at
/// most its window, 16 MiB, unacknowledged).
const ACK_EVERY: u64 = 4 << 20;
/// Longest `git fetch` of a URL source.
const FETCH_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The worker's source cache.
#[derive(Debug)]
pub struct Sources {
    root: PathBuf,
    next: AtomicU64,
    waiting: Mutex<HashMap<u64, mpsc::UnboundedSender<v1::SourceData>>>,
    repos: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    allow_file: bool,
    /// Hosts URL sources may name although they resolve to this machine or its link.
    allow_hosts: Vec<String>,
    /// URL sources are fetched with the worker's own credentials (else anonymously).
    credentials: bool,
    /// The largest result this worker sends (a change travels in it).
    max_result: usize,
    /// Checkouts are copy-on-write views of one tree per commit (else full checkouts).
    layers: Option<crate::layers::Layers>,
    /// Caches made the worker's own since it started.
    hardened: Mutex<std::collections::HashSet<PathBuf>>,
    /// Shared trees views use now (each view holds its tree's `Arc`).
    held: Mutex<HashMap<PathBuf, std::sync::Weak<()>>>,
}

impl Sources {
    /// The largest change this worker could send.
    pub fn max_change(&self) -> usize {
        self.max_result.min(flotilla_proto::frag::MAX_MESSAGE_BYTES)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A git failure of the worker itself (a full disk, say): the attempt may go elsewhere.
fn worker_error(what: &str, e: &impl std::fmt::Display) -> Error {
    let e = e.to_string();
    let full = e.contains("No space left on device") || e.contains("os error 28");
    let hint = if full {
        "; this worker's disk is full: free space under its --workspace, or give it a larger one"
    } else {
        ""
    };
    Error::new(FailureKind::Retryable, format!("{what}: {e}{hint}"))
}

fn plain(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
        && !s.starts_with('-')
        && !s.contains("..")
}

/// The host and port a network fetch URL names (`scheme://[user@]host[:port]/…` or scp-like
/// `[user@]host:path`).
fn url_host(url: &str) -> Option<(String, u16)> {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (scheme.to_ascii_lowercase(), rest),
        None => ("ssh".to_owned(), url),
    };
    let default = match scheme.as_str() {
        "https" => 443,
        "http" => 80,
        "git" => 9418,
        _ => 22,
    };
    let authority = if url.contains("://") {
        rest.split(['/', '?', '#']).next()?
    } else {
        rest.split_once(':')?.0
    };
    let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6.split_once(']')?;
        (h, after.strip_prefix(':').and_then(|p| p.parse().ok()))
    } else if url.contains("://") {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse().ok()),
            None => (authority, None),
        }
    } else {
        (authority, None)
    };
    (!host.is_empty()).then(|| (host.to_owned(), port.unwrap_or(default)))
}

/// Whether a fetch URL names this machine's disk (`file://`, or a plain path, which git
/// reads as one).
fn is_local(url: &str) -> bool {
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("file:") {
        return true;
    }
    match url.split_once("://") {
        Some((scheme, _)) => scheme.is_empty(),
        // `host:path` is ssh (scp form); anything else (`/srv/r`, `./r`, `r`) is a path.
        None => !url
            .split_once(':')
            .is_some_and(|(host, _)| !host.is_empty() && !host.contains('/')),
    }
}

/// What a cache's `config` says: nothing but what `git init --bare` writes (no remote, proxy,
/// ssh command, credential helper, filter, hook path or include).
const CACHE_CONFIG: &str =
    "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = true\n";

/// Makes the cache at `bare` the worker's own again: a plain directory (never a link), its
/// config [`CACHE_CONFIG`], no hooks, attributes or borrowed objects. Nothing an agent can
/// reach writes here; this holds it even for a cache written by an older version.
fn harden_cache(bare: &Path) -> Result<(), Problem> {
    if !std::fs::symlink_metadata(bare).is_ok_and(|m| m.is_dir()) {
        return Err(Problem::internal(format!(
            "{} is not a directory of the worker's",
            bare.display()
        )));
    }
    let config = bare.join("config");
    let plain = std::fs::symlink_metadata(&config).is_ok_and(|m| m.is_file() && m.len() < 4096)
        && std::fs::read_to_string(&config).is_ok_and(|c| c == CACHE_CONFIG);
    if !plain {
        let _ = std::fs::remove_file(&config);
        std::fs::write(&config, CACHE_CONFIG)
            .map_err(|e| Problem::internal(format!("cannot write {}: {e}", config.display())))?;
    }
    for extra in [
        "hooks",
        "info/attributes",
        "objects/info/alternates",
        "commondir",
    ] {
        let p = bare.join(extra);
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
            crate::workspace::remove_tree(&p);
        } else {
            let _ = std::fs::remove_file(&p);
        }
    }
    Ok(())
}

/// The directory of namespace `ns`'s caches: its name when that is a plain namespace name,
/// else a digest of it (so no name can climb or hide).
fn namespace_dir(ns: &str) -> String {
    let ns = if ns.is_empty() { "default" } else { ns };
    let plain = ns.len() <= 63
        && ns.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && ns
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.'));
    if plain {
        ns.to_owned()
    } else {
        use sha2::Digest;
        format!("ns-{}", hex::encode(sha2::Sha256::digest(ns.as_bytes())))
    }
}

impl Sources {
    /// A cache under `root` (the worker's workspace root); `allow_file`: URL sources may
    /// name this machine's own paths.
    pub fn new(root: &Path, allow_file: bool) -> Sources {
        Self::with_limit(root, allow_file, flotilla_proto::frag::MAX_MESSAGE_BYTES)
    }

    /// [`Sources::new`] for a worker whose results are at most `max_result` bytes.
    pub fn with_limit(root: &Path, allow_file: bool, max_result: usize) -> Sources {
        Sources {
            root: root.join(".flotilla").join("caches"),
            next: AtomicU64::new(1),
            waiting: Mutex::default(),
            repos: Mutex::default(),
            allow_file,
            allow_hosts: Vec::new(),
            credentials: false,
            max_result,
            layers: None,
            hardened: Mutex::default(),
            held: Mutex::default(),
        }
    }

    /// Holds the shared tree at `dir` for a view: the sweep leaves it while any view holds it.
    fn hold_tree(&self, dir: &Path) -> Arc<()> {
        let mut held = lock(&self.held);
        if let Some(h) = held.get(dir).and_then(std::sync::Weak::upgrade) {
            return h;
        }
        let h = Arc::new(());
        held.insert(dir.to_owned(), Arc::downgrade(&h));
        h
    }

    /// Removes the shared trees no view has used for `older_than` and none holds now (and
    /// what a worker that died left half made or half removed); how many went.
    pub fn sweep_trees(&self, older_than: Duration) -> usize {
        let now = flotilla_proto::clock::now();
        let old = |p: &Path| {
            std::fs::symlink_metadata(p)
                .and_then(|m| m.modified())
                .is_ok_and(|t| now.duration_since(t).is_ok_and(|age| age > older_than))
        };
        let mut gone = 0;
        for ns in subdirs(&self.root.with_file_name("trees")) {
            for repo in subdirs(&ns) {
                for tree in subdirs(&repo) {
                    if !old(&tree) {
                        continue;
                    }
                    // Half made or half removed by a worker that died: only this one's.
                    let half = tree.extension().is_some();
                    // Taken out of the way while no view can take hold of it: a view made
                    // after finds no tree and makes it again.
                    let out = {
                        let mut held = lock(&self.held);
                        if held.get(&tree).is_some_and(|h| h.strong_count() > 0) {
                            continue;
                        }
                        held.remove(&tree);
                        let to = tree.with_extension(format!("gone-{}", std::process::id()));
                        if half {
                            Some(tree.clone())
                        } else {
                            std::fs::rename(&tree, &to).is_ok().then_some(to)
                        }
                    };
                    if let Some(dir) = out {
                        crate::workspace::remove_tree(&dir);
                        gone += 1;
                    }
                }
                let _ = std::fs::remove_dir(&repo);
            }
            let _ = std::fs::remove_dir(&ns);
        }
        gone
    }

    /// Checkouts are views made by `layers` (see [`crate::layers`]).
    pub fn with_layers(mut self, layers: Option<crate::layers::Layers>) -> Sources {
        self.layers = layers;
        self
    }

    /// The shared tree of `commit` of `repo` for namespace `ns` (made from the cache `bare`
    /// the first time: a checkout of its own, swapped into place whole): the lower layer of
    /// every view of that commit on this worker.
    async fn tree(
        &self,
        bare: &Path,
        (ns, repo): (&str, &str),
        commit: &str,
    ) -> Result<PathBuf, Problem> {
        let dir = self.tree_dir((ns, repo), commit);
        let there = || {
            let made = std::fs::symlink_metadata(dir.join(".git")).is_ok_and(|m| m.is_dir());
            if made && let Ok(f) = std::fs::File::open(&dir) {
                // In use now: the sweep leaves it.
                let _ = f.set_modified(flotilla_proto::clock::now());
            }
            made
        };
        // Made already (it only ever appears whole): no lock.
        if there() {
            return Ok(dir);
        }
        let _held = self.repo_lock(&dir).lock_owned().await;
        if there() {
            return Ok(dir);
        }
        make_tree(bare, &dir, commit).await?;
        Ok(dir)
    }

    /// Where the shared tree of `commit` of `repo` for namespace `ns` is.
    fn tree_dir(&self, (ns, repo): (&str, &str), commit: &str) -> PathBuf {
        self.root
            .with_file_name("trees")
            .join(namespace_dir(ns))
            .join(repo)
            .join(commit)
    }

    /// A call's copy-on-write checkout at `dir` (see [`Sources::checkout`]).
    async fn view_checkout(
        &self,
        layers: &crate::layers::Layers,
        task: &v1::TaskSpec,
        dir: &Path,
        link: &mpsc::UnboundedSender<WorkerMessage>,
    ) -> Result<crate::worktree::Worktree, Error> {
        let failed = |e: &dyn std::fmt::Display| worker_error("cannot check out the source", &e);
        let partial = &task.source_partial;
        for round in 0..2 {
            let (bare, commit) = self.ensure(task, link, round > 0).await?;
            // The call's base: what a retry elsewhere starts from is the partial commit's
            // files over it.
            let base = if partial.is_empty() {
                commit.clone()
            } else {
                task.source_commit.clone()
            };
            // Held before it is looked for: no sweep takes it between.
            let hold = self.hold_tree(&self.tree_dir((&task.namespace, &task.source_repo), &base));
            let tree = match self
                .tree(&bare, (&task.namespace, &task.source_repo), &base)
                .await
            {
                Ok(t) => t,
                Err(e) if round == 0 => {
                    tracing::warn!(repo = %task.source_repo, error = %e, "the cached source is unusable; fetching it again");
                    let _ = std::fs::remove_file(bare.join("flotilla-packs"));
                    continue;
                }
                Err(e) => return Err(failed(&e)),
            };
            let view = layers.view(&tree, dir).holding(hold.clone());
            let mut wt =
                crate::worktree::Worktree::over(&bare, view, &base).map_err(|e| failed(&e))?;
            if wt.reused && (partial.is_empty() || wt.partial() == *partial) {
                return Ok(wt);
            }
            if partial.is_empty() {
                return Ok(wt);
            }
            // The call's latest leftovers came from an attempt elsewhere: its writes here
            // (if any) are behind them, and go.
            if wt.reused {
                wt.discard().await;
                let view = layers.view(&tree, dir).holding(hold.clone());
                wt = crate::worktree::Worktree::over(&bare, view, &base).map_err(|e| failed(&e))?;
            }
            let unpacked = async {
                wt.git(&["checkout", "-q", "--detach", partial]).await?;
                wt.unpack_partial(partial, &base).await
            };
            if let Err(e) = unpacked.await {
                wt.discard().await;
                return Err(failed(&e));
            }
            wt.reused = true;
            return Ok(wt);
        }
        Err(failed(&"giving up"))
    }

    /// Removes the caches of the layout before namespaces (`.flotilla/sources/REPO.git`,
    /// shared by every namespace, and so not trusted) under a worker's own workspace `root`:
    /// only bare repositories of that name, nothing else that may be there.
    pub fn remove_shared_caches(root: &Path) {
        let old = root.join(".flotilla").join("sources");
        let Ok(entries) = std::fs::read_dir(&old) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            let bare = e.file_type().is_ok_and(|t| t.is_dir())
                && p.extension().is_some_and(|x| x == "git")
                && p.join("HEAD").is_file()
                && p.join("objects").is_dir();
            if bare {
                crate::workspace::remove_tree(&p);
            }
        }
        let _ = std::fs::remove_dir(&old);
    }

    /// These hosts may be fetched from although they resolve to loopback or link-local
    /// addresses (`*`: any host).
    pub fn allowing_hosts(mut self, hosts: Vec<String>) -> Sources {
        self.allow_hosts = hosts;
        self
    }

    /// URL sources are fetched with the worker's own git and ssh credentials: any namespace
    /// may then name what they reach. Off (the default), they are fetched anonymously.
    pub fn with_credentials(mut self, on: bool) -> Sources {
        self.credentials = on;
        self
    }

    /// Refuses a network URL whose host is this machine or on its link (loopback,
    /// link-local, unspecified), unless the worker allows that host: a launcher must not
    /// point workers at their own services or a cloud metadata endpoint. `Ok`: the host, port
    /// and the addresses it checked, for git to connect to (never a second lookup of the
    /// name); none when the host is allowed by name.
    async fn check_host(
        &self,
        url: &str,
    ) -> Result<Option<(String, u16, Vec<std::net::IpAddr>)>, Error> {
        let Some((host, port)) = url_host(url) else {
            return Ok(None);
        };
        if self
            .allow_hosts
            .iter()
            .any(|h| h == "*" || h.eq_ignore_ascii_case(&host))
        {
            return Ok(None);
        }
        let addrs: Vec<std::net::SocketAddr> =
            match tokio::net::lookup_host((host.as_str(), port)).await {
                Ok(a) => a.collect(),
                Err(e) => {
                    return Err(Error::new(
                        FailureKind::Retryable,
                        format!("cannot resolve {host} for {url:?}: {e}"),
                    ));
                }
            };
        for addr in &addrs {
            if inward(addr.ip()) {
                return Err(Error::new(
                    FailureKind::Invalid,
                    format!(
                        "{url:?} names {host}, which is {}, an address of the worker itself or its link; start the worker with --allow-source-host {host} to fetch from it",
                        addr.ip()
                    ),
                ));
            }
        }
        Ok(Some((
            host,
            port,
            addrs.iter().map(std::net::SocketAddr::ip).collect(),
        )))
    }

    /// Whether a result of `text_len` bytes with `change` fits this worker's results: `Err`
    /// names the sizes.
    pub fn fits(&self, text_len: usize, change: &v1::Change) -> Result<(), Problem> {
        let len = text_len + change.pack.len() + (64 << 10);
        let limit = self.max_result.min(flotilla_proto::frag::MAX_MESSAGE_BYTES);
        if len <= limit {
            return Ok(());
        }
        Err(Problem::invalid(format!(
            "the agent's change is {} MiB of new objects, over the limit of {} MiB for one result (--max-result-mib)",
            change.pack.len().div_ceil(1 << 20),
            limit >> 20
        )))
    }

    /// Makes `fetch` anonymous: none of the worker's credentials reach it — not its home's
    /// git config, `.netrc` or ssh keys (ssh reads those from the account, so it is told
    /// `IdentityFile none`), not the ssh agent, not the system git config (where a credential
    /// helper may be set). The rest of the environment (a proxy, say) stays.
    fn anonymous(&self, fetch: &mut tokio::process::Command) -> Result<(), Error> {
        let home = self.root.join(".anonymous");
        std::fs::create_dir_all(&home)
            .map_err(|e| worker_error("cannot make the fetch's home", &e.to_string()))?;
        let known = home.join("known_hosts");
        fetch
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", &home)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env(
                "GIT_SSH_COMMAND",
                format!(
                    "ssh -F /dev/null -o IdentityFile=none -o IdentityAgent=none -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=accept-new -o UserKnownHostsFile={}",
                    known.display()
                ),
            )
            .env_remove("SSH_AUTH_SOCK")
            .env_remove("GIT_ASKPASS")
            .env_remove("SSH_ASKPASS")
            .env_remove("GIT_SSH")
            .env_remove("GIT_PROXY_COMMAND");
        Ok(())
    }

    /// A piece of a source the coordinator sent: to the request waiting for it.
    pub fn deliver(&self, d: v1::SourceData) {
        if let Some(tx) = lock(&self.waiting).get(&d.request) {
            let _ = tx.send(d);
        }
    }

    /// The cache of repository `repo` for runs of namespace `ns`: one per namespace, so one
    /// team's objects (uncommitted files of its snapshots included) are never borrowed by
    /// another team's checkouts.
    fn bare(&self, ns: &str, repo: &str) -> PathBuf {
        self.root
            .join(namespace_dir(ns))
            .join(format!("{repo}.git"))
    }

    fn repo_lock(&self, bare: &Path) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.repos)
            .entry(bare.display().to_string())
            .or_default()
            .clone()
    }

    /// The cached repository with `task`'s commit in it, and the commit's id.
    /// `again`: fetch the commit's packs even if the commit is there (its trees are not).
    async fn ensure(
        &self,
        task: &v1::TaskSpec,
        link: &mpsc::UnboundedSender<WorkerMessage>,
        again: bool,
    ) -> Result<(PathBuf, String), Error> {
        let repo = &task.source_repo;
        if !plain(repo) || repo.contains('/') {
            return Err(Error::new(
                FailureKind::Invalid,
                format!("{repo:?} does not name a source"),
            ));
        }
        let bare = self.bare(&task.namespace, repo);
        // A cache this worker made its own already, holding the commit: no lock (every
        // attempt of a commit checks it, a thousand at once among them).
        if !again
            && task.source_url.is_empty()
            && lock(&self.hardened).contains(&bare)
            && let Ok(commit) = call_commit(task)
            && git(&bare, &["cat-file", "-e", &format!("{commit}^{{tree}}")])
                .await
                .is_ok()
        {
            return Ok((bare, commit));
        }
        let _held = self.repo_lock(&bare).lock_owned().await;
        if !bare.join("HEAD").exists() {
            std::fs::create_dir_all(&bare)
                .map_err(|e| worker_error("cannot make the source cache", &e.to_string()))?;
            git(&bare, &["init", "--bare", "-q"])
                .await
                .map_err(|e| worker_error("cannot make the source cache", &e))?;
        }
        // Only the worker writes here; whatever a repository can make git run is never in it.
        harden_cache(&bare).map_err(|e| worker_error("cannot keep the source cache", &e))?;
        lock(&self.hardened).insert(bare.clone());
        if !task.source_url.is_empty() {
            let commit = self.fetch_url(&bare, task).await?;
            return Ok((bare, commit));
        }
        let commit = call_commit(task)?;
        // The commit and its root tree: a view's tree of files may be made already, but git
        // in it (and the change it sends) needs the objects.
        if !again
            && git(&bare, &["cat-file", "-e", &format!("{commit}^{{tree}}")])
                .await
                .is_ok()
        {
            return Ok((bare, commit));
        }
        self.fetch(&bare, (&task.namespace, repo), &commit, link)
            .await?;
        if git(&bare, &["cat-file", "-e", &format!("{commit}^{{tree}}")])
            .await
            .is_err()
        {
            // The packs we took for applied are not all there (a damaged cache): ask for all.
            tracing::warn!(repo, commit = %commit, "the source cache lost objects; fetching the whole chain again");
            let _ = std::fs::remove_file(bare.join("flotilla-packs"));
            self.fetch(&bare, (&task.namespace, repo), &commit, link)
                .await?;
        }
        git(&bare, &["cat-file", "-e", &format!("{commit}^{{tree}}")])
            .await
            .map_err(|_| {
                Error::new(
                    FailureKind::Retryable,
                    format!("the coordinator's packs did not hold commit {commit}"),
                )
            })?;
        Ok((bare, commit))
    }

    /// Fetches a URL source's ref into `bare` (the host checked, and its addresses pinned,
    /// first); the commit it names.
    async fn fetch_url(&self, bare: &Path, task: &v1::TaskSpec) -> Result<String, Error> {
        let rev = &task.source_commit;
        if !plain(rev) {
            return Err(Error::new(
                FailureKind::Invalid,
                format!("{rev:?} is not a ref to fetch"),
            ));
        }
        let url = &task.source_url;
        let local = is_local(url);
        if local && !self.allow_file {
            return Err(Error::new(
                FailureKind::Invalid,
                format!(
                    "{url:?} is a path on the worker: workers fetch only https, http, ssh and git URLs unless started with --allow-file-sources"
                ),
            ));
        }
        let checked = if local {
            None
        } else {
            self.check_host(url).await?
        };
        // An http(s) fetch goes to the addresses checked above, whatever the name
        // resolves to when git looks again.
        let pinned = match &checked {
            Some((host, port, ips))
                if !ips.is_empty() && url.to_ascii_lowercase().starts_with("http") =>
            {
                let list: Vec<String> = ips
                    .iter()
                    .map(|ip| match ip {
                        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
                        std::net::IpAddr::V4(v4) => v4.to_string(),
                    })
                    .collect();
                format!("http.curloptResolve={host}:{port}:{}", list.join(","))
            }
            _ => "http.curloptResolve=".to_owned(),
        };
        let file = if self.allow_file { "always" } else { "never" };
        let file_rule = format!("protocol.file.allow={file}");
        let args = [
            "-c",
            "protocol.allow=never",
            "-c",
            "protocol.https.allow=always",
            "-c",
            "protocol.http.allow=always",
            "-c",
            "protocol.ssh.allow=always",
            "-c",
            "protocol.git.allow=always",
            "-c",
            &file_rule,
            "-c",
            &pinned,
            // A redirect could lead where the host check did not look.
            "-c",
            "http.followRedirects=false",
            "-c",
            "http.lowSpeedLimit=1024",
            "-c",
            "http.lowSpeedTime=120",
            "fetch",
            "--quiet",
            "--no-recurse-submodules",
            "--",
            url,
            rev,
        ];
        let mut fetch = crate::worktree::git_command(bare);
        fetch.args(args);
        if !self.credentials {
            self.anonymous(&mut fetch)?;
        }
        let fetch = crate::worktree::run_git(&mut fetch);
        match tokio::time::timeout(FETCH_TIMEOUT, fetch).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                return Err(Error::new(
                    FailureKind::Retryable,
                    format!("cannot fetch {url}#{rev}: {e}"),
                ));
            }
            Err(_) => {
                return Err(Error::new(
                    FailureKind::Retryable,
                    format!(
                        "fetching {url}#{rev} took more than {} minutes",
                        FETCH_TIMEOUT.as_secs() / 60
                    ),
                ));
            }
        }
        let commit = git(bare, &["rev-parse", "FETCH_HEAD^{commit}"])
            .await
            .map_err(|e| worker_error("cannot read what was fetched", &e))?;
        Ok(commit)
    }

    /// Asks the coordinator for what `bare` lacks of `commit` of the namespace's repository
    /// and indexes each pack.
    async fn fetch(
        &self,
        bare: &Path,
        (namespace, repo): (&str, &str),
        commit: &str,
        link: &mpsc::UnboundedSender<WorkerMessage>,
    ) -> Result<(), Error> {
        let applied_file = bare.join("flotilla-packs");
        let applied: Vec<String> = std::fs::read_to_string(&applied_file)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = mpsc::unbounded_channel();
        lock(&self.waiting).insert(id, tx);
        struct Forget<'a>(&'a Sources, u64);
        impl Drop for Forget<'_> {
            fn drop(&mut self) {
                lock(&self.0.waiting).remove(&self.1);
            }
        }
        let _forget = Forget(self, id);
        let sent = link.send(WorkerMessage {
            msg: Some(worker_message::Msg::SourceRequest(v1::SourceRequest {
                id,
                repo: repo.to_owned(),
                commit: commit.to_owned(),
                have_packs: applied,
                acked: 0,
                namespace: namespace.to_owned(),
            })),
        });
        if sent.is_err() {
            return Err(Error::new(
                FailureKind::Retryable,
                "the coordinator link is gone",
            ));
        }
        // The pack being received: its file goes whatever happens (a full disk must not stay
        // full of a pack that never arrived).
        let mut current: Option<(String, tempfile::NamedTempFile)> = None;
        // What is written to disk so far, and what the coordinator was last told of it.
        let (mut received, mut told) = (0u64, 0u64);
        loop {
            let d = match tokio::time::timeout(QUIET, rx.recv()).await {
                Ok(Some(d)) => d,
                Ok(None) => {
                    return Err(Error::new(
                        FailureKind::Retryable,
                        "the source transfer was cut off",
                    ));
                }
                Err(_) => {
                    return Err(Error::new(
                        FailureKind::Retryable,
                        format!(
                            "the coordinator sent nothing of the source for {}s",
                            QUIET.as_secs()
                        ),
                    ));
                }
            };
            if !d.error.is_empty() {
                return Err(Error::new(
                    FailureKind::Terminal,
                    format!("the coordinator cannot send the source: {}", d.error),
                ));
            }
            if d.done {
                return Ok(());
            }
            if current.as_ref().is_none_or(|(p, _)| *p != d.pack) {
                let f = tempfile::Builder::new()
                    .prefix("incoming-")
                    .suffix(".pack")
                    .tempfile_in(bare)
                    .map_err(|e| worker_error("cannot write the source", &e.to_string()))?;
                current = Some((d.pack.clone(), f));
            }
            if let Some((_, f)) = current.as_mut() {
                use std::io::Write;
                f.write_all(&d.data)
                    .map_err(|e| worker_error("cannot write the source", &e.to_string()))?;
            }
            received += d.data.len() as u64;
            if received - told >= ACK_EVERY {
                told = received;
                let _ = link.send(WorkerMessage {
                    msg: Some(worker_message::Msg::SourceRequest(v1::SourceRequest {
                        id,
                        acked: received,
                        ..v1::SourceRequest::default()
                    })),
                });
            }
            if d.last_of_pack
                && let Some((pack, f)) = current.take()
            {
                let indexed = index_pack(bare, f.path()).await;
                drop(f);
                indexed.map_err(|e| worker_error("cannot index the source", &e))?;
                if plain(&d.tip) {
                    let _ = git(
                        bare,
                        &["update-ref", &format!("refs/flotilla/{}", d.tip), &d.tip],
                    )
                    .await;
                }
                use std::io::Write;
                let mut log = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&applied_file)
                    .map_err(|e| worker_error("cannot record the source", &e.to_string()))?;
                let _ = writeln!(log, "{pack}");
            }
        }
    }

    /// Makes (or finds, for a later attempt of the call) the call's checkout at `dir`.
    pub async fn checkout(
        &self,
        task: &v1::TaskSpec,
        dir: &Path,
        link: &mpsc::UnboundedSender<WorkerMessage>,
    ) -> Result<crate::worktree::Worktree, Error> {
        if let Some(layers) = &self.layers {
            return self.view_checkout(layers, task, dir, link).await;
        }
        for round in 0..2 {
            let (bare, commit) = self.ensure(task, link, round > 0).await?;
            let partial = &task.source_partial;
            if let Some(wt) = crate::worktree::Worktree::existing(&bare, dir).await {
                if partial.is_empty() || wt.partial() == *partial {
                    return Ok(wt);
                }
                // The call's latest leftovers came from an attempt elsewhere: this checkout
                // is behind them.
                wt.discard().await;
            }
            match crate::worktree::Worktree::detached(&bare, dir, &commit).await {
                Ok(mut wt) if !partial.is_empty() => {
                    wt.unpack_partial(partial, &task.source_commit)
                        .await
                        .map_err(|e| worker_error("cannot check out the source", &e))?;
                    wt.reused = true;
                    return Ok(wt);
                }
                Ok(wt) => return Ok(wt),
                Err(e) if round == 0 => {
                    // The cache is only a cache, but other calls' checkouts live on it: this
                    // call's directory goes, and every pack is fetched again (objects already
                    // there are kept; missing ones come back).
                    tracing::warn!(repo = %task.source_repo, error = %e, "the cached source is unusable; fetching it again");
                    let _held = self.repo_lock(&bare).lock_owned().await;
                    let _ = std::fs::remove_dir_all(dir);
                    let _ = crate::worktree::git_locked(&bare, &["worktree", "prune"]).await;
                    let _ = std::fs::remove_file(bare.join("flotilla-packs"));
                }
                Err(e) => {
                    // Nothing half made stays (on a full disk, it would keep it full).
                    let _ = std::fs::remove_dir_all(dir);
                    let _ = crate::worktree::git_locked(&bare, &["worktree", "prune"]).await;
                    return Err(worker_error("cannot check out the source", &e));
                }
            }
        }
        Err(worker_error("cannot check out the source", &"giving up"))
    }
}

/// The directories in `dir`.
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// The commit a task's checkout starts from: the run's, or an earlier attempt's leftovers
/// (which hold the call's base). `Err` names an id that is not one.
fn call_commit(task: &v1::TaskSpec) -> Result<String, Error> {
    let hex = |id: &str| !id.is_empty() && id.chars().all(|c| c.is_ascii_hexdigit());
    let partial = &task.source_partial;
    let bad = if !hex(&task.source_commit) {
        Some(&task.source_commit)
    } else if !partial.is_empty() && !hex(partial) {
        Some(partial)
    } else {
        None
    };
    if let Some(id) = bad {
        return Err(Error::new(
            FailureKind::Invalid,
            format!("{id:?} is not a commit id"),
        ));
    }
    Ok(if partial.is_empty() {
        task.source_commit.clone()
    } else {
        partial.clone()
    })
}

/// Makes the shared tree of `commit` of the (bare) repository `bare` at `dir`: a checkout of
/// its own that borrows the cache's objects, its git directory as plain as the worker makes a
/// checkout's, made beside and swapped into place whole (nothing half made is ever a tree).
pub async fn make_tree(bare: &Path, dir: &Path, commit: &str) -> Result<(), Problem> {
    let made = dir.with_extension(format!("tmp-{}", std::process::id()));
    crate::workspace::remove_tree(&made);
    let _ = std::fs::remove_file(made.with_extension("base"));
    let wt = crate::worktree::Worktree::detached(bare, &made, commit).await?;
    let _ = std::fs::remove_file(made.with_extension("base"));
    wt.sanitize();
    // Files written in the second the index was are "racily clean" to git: every view's
    // first `git status` would read them all again and write the index into the view. Once
    // that second is over, the index is written again, and none is.
    let into = flotilla_proto::clock::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    tokio::time::sleep(Duration::from_nanos(u64::from(
        1_000_000_000 - into.min(999_999_999),
    )))
    .await;
    git(&made, &["update-index", "-q", "--refresh"]).await?;
    crate::workspace::remove_tree(dir);
    std::fs::rename(&made, dir).map_err(|e| {
        crate::workspace::remove_tree(&made);
        Problem::internal(format!("cannot keep the tree {}: {e}", dir.display()))
    })
}

/// Indexes one received pack into `bare`.
async fn index_pack(bare: &Path, pack: &Path) -> Result<(), Problem> {
    let file = std::fs::File::open(pack).map_err(|e| Problem::internal(e.to_string()))?;
    let out = crate::worktree::git_command(bare)
        .args(["index-pack", "--stdin"])
        .stdin(file)
        .output()
        .await
        .map_err(|e| Problem::internal(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Problem::internal(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ))
    }
}

/// What an agent left in its checkout, as one commit on the commit it started from (its own
/// commits included) and the objects that commit adds; `None` when it changed nothing.
pub async fn change_of(
    wt: &crate::worktree::Worktree,
    spec: &v1::TaskSpec,
    (run, call): (&str, u64),
    limit: usize,
) -> Result<Option<v1::Change>, Error> {
    let failed = |e: String| worker_error("cannot record the agent's change", &e);
    if wt.surely_unchanged() {
        return Ok(None);
    }
    // Each git here is a process (in a view, one that mounts it): as few as can be.
    let dirty = wt.stage(None).await.map_err(|p| failed(p.into()))?;
    let head = wt
        .git(&["rev-parse", "HEAD", "HEAD^{tree}"])
        .await
        .map_err(|p| failed(p.into()))?;
    let (mut commit, head_tree) = head
        .split_once('\n')
        .map(|(c, t)| (c.to_owned(), t.to_owned()))
        .ok_or_else(|| failed(format!("git rev-parse said {head:?}")))?;
    let tree = match dirty {
        true => wt
            .git(&["write-tree"])
            .await
            .map_err(|p| failed(p.into()))?,
        false => head_tree.clone(),
    };
    // What differed may be back as HEAD has it once staged: then there is nothing to commit.
    if tree != head_tree {
        // The agent is the author: its label, and an address naming the run and call.
        let name: String = spec
            .label
            .chars()
            .filter(|c| !c.is_control() && !matches!(c, '<' | '>'))
            .take(80)
            .collect();
        let name = if name.trim().is_empty() {
            format!("agent {call}")
        } else {
            name
        };
        let email = format!("agent-{call}@{run}.flotilla");
        let message = format!("flotilla: agent {:?} (#{call}) of run {run}", spec.label);
        // A commit of the index's tree (`git commit` would look at every file of the
        // checkout again); HEAD moves to it as a commit would move it.
        let out = wt
            .command()
            .args(["commit-tree", &tree, "-p", &commit, "-m", &message])
            .env("GIT_AUTHOR_NAME", &name)
            .env("GIT_AUTHOR_EMAIL", &email)
            .env("GIT_COMMITTER_NAME", "flotilla")
            .env("GIT_COMMITTER_EMAIL", "flotilla@localhost")
            .output()
            .await
            .map_err(|e| failed(e.to_string()))?;
        if !out.status.success() {
            return Err(failed(
                String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            ));
        }
        commit = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        wt.git(&["update-ref", "HEAD", &commit])
            .await
            .map_err(|p| failed(p.into()))?;
    }
    if commit == wt.base {
        return Ok(None);
    }
    packed(wt, spec, commit, limit)
        .await
        .map(Some)
        .map_err(|p| failed(p.into()))
}

/// What an unfinished attempt left in its checkout, for the call's next attempt on any worker
/// (W58): a [`crate::worktree::Worktree::snapshot`] of it with the objects it adds to the
/// call's base. `None` when it left nothing. The checkout itself stays as the agent left it.
pub async fn partial_of(
    wt: &crate::worktree::Worktree,
    spec: &v1::TaskSpec,
    (run, call, attempt): (&str, u64, u32),
    limit: usize,
) -> Result<Option<v1::Change>, Problem> {
    if !wt.changed().await {
        return Ok(None);
    }
    let message = format!(
        "flotilla: what attempt {attempt} of agent {:?} (#{call}) of run {run} left",
        spec.label
    );
    let commit = wt.snapshot(&message).await?;
    let change = packed(wt, spec, commit, limit).await?;
    crate::worktree::mark_partial(&wt.path, &change.commit)?;
    Ok(Some(change))
}

/// `commit` of the checkout as a change: its files and line counts since the call's base,
/// and a pack of the objects it adds.
/// A pack over `limit` bytes is cut there (it is never sent: the caller sees it does not fit).
async fn packed(
    wt: &crate::worktree::Worktree,
    spec: &v1::TaskSpec,
    commit: String,
    limit: usize,
) -> Result<v1::Change, Problem> {
    let (mut files, mut insertions, mut deletions) = (Vec::new(), 0u32, 0u32);
    for line in wt
        .git(&["diff", "--numstat", &wt.base, &commit])
        .await?
        .lines()
    {
        let mut parts = line.splitn(3, '\t');
        let (ins, del, file) = (parts.next(), parts.next(), parts.next());
        insertions += ins.and_then(|n| n.parse().ok()).unwrap_or(0);
        deletions += del.and_then(|n| n.parse().ok()).unwrap_or(0);
        if let Some(f) = file {
            files.push(f.to_owned());
        }
    }
    let mut child = wt
        .repo_command()
        .args(["pack-objects", "--revs", "--stdout", "-q"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Problem::internal(e.to_string()))?;
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt;
        stdin
            .write_all(format!("{commit}\n^{}\n", wt.base).as_bytes())
            .await
            .map_err(|e| Problem::internal(e.to_string()))?;
    }
    // Read no more than fits: an agent that leaves gigabytes must not take the worker's
    // memory with them.
    let mut pack = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        use tokio::io::AsyncReadExt;
        stdout
            .take(limit as u64 + 1)
            .read_to_end(&mut pack)
            .await
            .map_err(|e| Problem::internal(e.to_string()))?;
    }
    if pack.len() > limit {
        let _ = child.kill().await;
        return Ok(v1::Change {
            repo: spec.source_repo.clone(),
            base: wt.base.clone(),
            commit,
            pack,
            files,
            insertions,
            deletions,
        });
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| Problem::internal(e.to_string()))?;
    if !out.status.success() {
        return Err(Problem::internal(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ));
    }
    let out = std::process::Output {
        stdout: pack,
        ..out
    };
    // Objects a sandboxed agent's commits made live in the checkout's git directory, which
    // goes with it: into the cache with them (index-pack checks each).
    let own = wt.host_admin().join("objects");
    if std::fs::read_dir(&own).is_ok_and(|mut d| d.next().is_some()) {
        let mut index = crate::worktree::git_command(wt.repo())
            .args(["index-pack", "--stdin"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| Problem::internal(e.to_string()))?;
        if let Some(mut stdin) = index.stdin.take() {
            use tokio::io::AsyncWriteExt;
            stdin
                .write_all(&out.stdout)
                .await
                .map_err(|e| Problem::internal(e.to_string()))?;
        }
        let indexed = index
            .wait_with_output()
            .await
            .map_err(|e| Problem::internal(e.to_string()))?;
        if !indexed.status.success() {
            return Err(Problem::internal(
                String::from_utf8_lossy(&indexed.stderr).trim().to_owned(),
            ));
        }
    }
    let _ = git(
        wt.repo(),
        &["update-ref", &format!("refs/flotilla/{commit}"), &commit],
    )
    .await;
    Ok(v1::Change {
        repo: spec.source_repo.clone(),
        base: wt.base.clone(),
        commit,
        pack: out.stdout,
        files,
        insertions,
        deletions,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_worker_fetches_no_path_of_its_own_disk_unless_allowed() {
        let root = tempfile::tempdir().unwrap();
        let upstream = root.path().join("upstream");
        std::fs::create_dir_all(&upstream).unwrap();
        git(&upstream, &["init", "-q", "-b", "main"]).await.unwrap();
        git(
            &upstream,
            &[
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "commit",
                "-q",
                "--allow-empty",
                "-m",
                "one",
            ],
        )
        .await
        .unwrap();
        let (link, _rx) = mpsc::unbounded_channel();
        for url in [
            format!("file://{}", upstream.display()),
            upstream.display().to_string(),
        ] {
            let task = v1::TaskSpec {
                source_repo: "abc123".into(),
                source_commit: "main".into(),
                source_url: url.clone(),
                ..Default::default()
            };
            let refused = Sources::new(root.path(), false)
                .ensure(&task, &link, false)
                .await
                .unwrap_err();
            assert_eq!(refused.kind, FailureKind::Invalid, "{url}");
            assert!(
                refused.message.contains("--allow-file-sources"),
                "{}",
                refused.message
            );
            let (_, commit) = Sources::new(root.path(), true)
                .ensure(&task, &link, false)
                .await
                .unwrap();
            assert_eq!(commit.len(), 40, "{url}: {commit}");
        }
    }

    #[tokio::test]
    async fn a_url_source_may_not_name_the_worker_itself_or_its_link_unless_allowed() {
        let root = tempfile::tempdir().unwrap();
        let (link, _rx) = mpsc::unbounded_channel();
        for url in [
            "http://127.0.0.1:2379/r.git",
            "https://169.254.169.254/latest/meta-data",
            "http://[::1]:8443/r.git",
            "http://[::ffff:127.0.0.1]/r.git",
            "git://0.0.0.0/r.git",
            "ssh://git@127.0.0.2:22/r.git",
            "git@127.0.0.1:team/r.git",
            "http://user:secret@localhost:1/r.git",
        ] {
            let task = v1::TaskSpec {
                source_repo: "abc123".into(),
                source_commit: "main".into(),
                source_url: url.into(),
                ..Default::default()
            };
            let refused = Sources::new(root.path(), false)
                .ensure(&task, &link, false)
                .await
                .unwrap_err();
            assert_eq!(refused.kind, FailureKind::Invalid, "{url}");
            assert!(
                refused.message.contains("--allow-source-host"),
                "{url}: {}",
                refused.message
            );
        }
        // Allowed by name: git is asked (and finds nothing listening there).
        let task = v1::TaskSpec {
            source_repo: "abc123".into(),
            source_commit: "main".into(),
            source_url: "http://127.0.0.1:1/r.git".into(),
            ..Default::default()
        };
        let failed = Sources::new(root.path(), false)
            .allowing_hosts(vec!["127.0.0.1".into()])
            .ensure(&task, &link, false)
            .await
            .unwrap_err();
        assert_eq!(failed.kind, FailureKind::Retryable, "{}", failed.message);
        assert!(
            failed.message.contains("cannot fetch"),
            "{}",
            failed.message
        );
    }

    /// What an agent could once write into a cache (issue 28: a repository under the shared
    /// cache with `core.gitProxy` set, and hooks) runs nothing when the worker fetches into
    /// it: the cache is made the worker's own first. The old layout's caches go.
    #[tokio::test]
    async fn a_cache_someone_else_wrote_runs_nothing_of_its_config_and_the_old_layout_goes() {
        let root = tempfile::tempdir().unwrap();
        let old = root.path().join(".flotilla/sources/abc123.git");
        git(
            root.path(),
            &["init", "-q", "--bare", old.to_str().unwrap()],
        )
        .await
        .unwrap();
        let other = root.path().join(".flotilla/sources/notes.txt");
        std::fs::write(&other, "someone's").unwrap();
        Sources::remove_shared_caches(root.path());
        assert!(
            !old.exists(),
            "the cache shared by every namespace is not trusted"
        );
        assert!(other.exists(), "nothing else there goes");
        let sources = Sources::new(root.path(), false).allowing_hosts(vec!["127.0.0.1".into()]);
        let sprung = root.path().join("sprung");
        let task = v1::TaskSpec {
            source_repo: "abc123".into(),
            source_commit: "main".into(),
            source_url: "git://127.0.0.1:9/r.git".into(),
            namespace: "team-b".into(),
            ..Default::default()
        };
        let bare = sources.bare(&task.namespace, &task.source_repo);
        assert!(bare.starts_with(root.path().join(".flotilla/caches/team-b")));
        std::fs::create_dir_all(bare.join("hooks")).unwrap();
        git(&bare, &["init", "--bare", "-q"]).await.unwrap();
        let proxy = root.path().join("proxy.sh");
        std::fs::write(&proxy, format!("#!/bin/sh\ntouch {}\n", sprung.display())).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&proxy, std::fs::Permissions::from_mode(0o755)).unwrap();
        for (key, value) in [
            ("core.gitProxy", proxy.display().to_string()),
            ("core.sshCommand", proxy.display().to_string()),
            ("core.fsmonitor", proxy.display().to_string()),
            ("credential.helper", format!("!{}", proxy.display())),
        ] {
            git(&bare, &["config", key, &value]).await.unwrap();
        }
        std::fs::write(
            bare.join("hooks/post-checkout"),
            "#!/bin/sh\ntouch sprung\n",
        )
        .unwrap();
        let (link, _rx) = mpsc::unbounded_channel();
        let failed = sources.ensure(&task, &link, false).await.unwrap_err();
        assert_eq!(failed.kind, FailureKind::Retryable, "{}", failed.message);
        assert!(!sprung.exists(), "the planted proxy never ran");
        assert_eq!(
            std::fs::read_to_string(bare.join("config")).unwrap(),
            CACHE_CONFIG
        );
        assert!(!bare.join("hooks").exists());
        // Another namespace's cache of the same repository is another directory.
        assert_ne!(sources.bare("team-a", "abc123"), bare);
        assert_eq!(namespace_dir(""), "default");
        assert!(namespace_dir("../x").starts_with("ns-"));
        assert!(namespace_dir(".hidden").starts_with("ns-"));
    }

    /// A URL source's fetch carries none of the worker's credentials unless the worker was
    /// started with them: its home's git config (a credential helper) and ssh keys stay out.
    #[tokio::test]
    async fn a_url_fetch_is_anonymous_unless_the_worker_lends_its_credentials() {
        let root = tempfile::tempdir().unwrap();
        let home = root.path().join("worker-home");
        std::fs::create_dir_all(&home).unwrap();
        std::fs::write(
            home.join(".gitconfig"),
            "[credential]\n\thelper = store --file=/worker/secrets\n",
        )
        .unwrap();
        let sources = Sources::new(root.path(), false);
        let helper = |anonymous: bool| {
            let mut c = crate::worktree::git_command(root.path());
            c.env("HOME", &home)
                .env("SSH_AUTH_SOCK", "/worker/agent.sock");
            if anonymous {
                sources.anonymous(&mut c).unwrap();
            }
            c.args(["config", "--get", "credential.helper"]);
            async move { crate::worktree::run_git(&mut c).await }
        };
        assert_eq!(
            helper(false).await.unwrap(),
            "store --file=/worker/secrets",
            "the worker's own config is there to lend"
        );
        assert!(
            helper(true).await.is_err(),
            "an anonymous fetch has none of it"
        );
        let mut env = tokio::process::Command::new("sh");
        env.env("SSH_AUTH_SOCK", "/worker/agent.sock");
        sources.anonymous(&mut env).unwrap();
        env.args([
            "-c",
            "printf '%s|%s' \"$GIT_SSH_COMMAND\" \"${SSH_AUTH_SOCK:-none}\"",
        ]);
        let out = env.output().await.unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(said.ends_with("|none"), "no ssh agent: {said}");
        assert!(
            said.contains("IdentityFile=none") && said.contains("IdentityAgent=none"),
            "{said}"
        );
    }

    #[test]
    fn a_fetch_url_names_its_host_and_port() {
        for (url, want) in [
            ("https://git.example/r.git", Some(("git.example", 443))),
            ("http://h:8080/r", Some(("h", 8080))),
            ("ssh://git@h/r.git", Some(("h", 22))),
            ("git://h/r", Some(("h", 9418))),
            ("git@h:team/r.git", Some(("h", 22))),
            ("https://u:p@[fe80::1]:444/r", Some(("fe80::1", 444))),
            ("https:///r", None),
        ] {
            let got = url_host(url);
            assert_eq!(got.as_ref().map(|(h, p)| (h.as_str(), *p)), want, "{url}");
        }
        assert!(inward("169.254.169.254".parse().unwrap()));
        assert!(inward("fe80::1".parse().unwrap()));
        assert!(!inward("10.0.0.1".parse().unwrap()));
        assert!(!inward("2001:db8::1".parse().unwrap()));
    }

    #[test]
    fn paths_and_file_urls_are_local_and_network_urls_are_not() {
        for url in [
            "file:///srv/r.git",
            "FILE:///srv/r.git",
            "/srv/r.git",
            "./r",
            "r.git",
            "://x",
        ] {
            assert!(is_local(url), "{url}");
        }
        for url in [
            "https://host/r.git",
            "ssh://git@host/r.git",
            "git@host:team/r.git",
            "git://host/r.git",
        ] {
            assert!(!is_local(url), "{url}");
        }
    }

    #[test]
    fn the_sweep_takes_old_unheld_trees_and_half_made_ones_and_leaves_the_rest() {
        let root = tempfile::tempdir().unwrap();
        let sources = Sources::new(root.path(), false);
        let tree = |name: &str| sources.tree_dir(("default", "r"), name);
        let long_ago = flotilla_proto::clock::now() - Duration::from_secs(7200);
        for name in ["old", "new", "held", "half.tmp-1"] {
            std::fs::create_dir_all(tree(name).join(".git")).unwrap();
            std::fs::write(tree(name).join("f"), "x").unwrap();
            if name != "new" {
                std::fs::File::open(tree(name))
                    .unwrap()
                    .set_modified(long_ago)
                    .unwrap();
            }
        }
        let hold = sources.hold_tree(&tree("held"));
        assert_eq!(sources.sweep_trees(Duration::from_secs(3600)), 2);
        for (name, kept) in [
            ("old", false),
            ("half.tmp-1", false),
            ("new", true),
            ("held", true),
        ] {
            assert_eq!(tree(name).exists(), kept, "{name}");
        }
        // Once no view holds it, it goes too; nothing of the swept is left beside.
        drop(hold);
        assert_eq!(sources.sweep_trees(Duration::from_secs(3600)), 1);
        let left: Vec<_> = std::fs::read_dir(tree("new").parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("new")]);
    }
}
