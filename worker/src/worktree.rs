//! `isolation: 'worktree'` (W20): an agent works in a git worktree of the repository that
//! holds its working directory, on a branch of its own. Afterwards the worktree is removed if
//! the agent changed nothing, and kept (with its branch) otherwise.
//!
//! One worktree per call, at `<git common dir>/flotilla/worktrees/<run>/<call>` on branch
//! `flotilla/<run>/<call>` (W20: named from the run and the agent's index): inside the
//! repository's git directory, so it never shows in the user's tree, and shared by the
//! call's attempts, so a restarted attempt keeps what an earlier one wrote (W58). Outside a
//! repository there is no worktree: the call fails with the reason. Git's own commands do
//! the work; adding and removing worktrees is serialized in this process, since git locks
//! its metadata for each.

use flotilla_proto::Problem;
use std::path::{Path, PathBuf};

use tokio::process::Command;
use tokio::sync::Mutex;

/// Serializes `git worktree add/remove` (they take repository-wide locks).
static GIT: Mutex<()> = Mutex::const_new(());

/// At most this many paths an agent wrote in a view are named to the worker's git; past
/// that it looks at the whole checkout.
const TOUCHED_MOST: usize = 2000;

/// Longest the worker's git on a checkout may take.
const GIT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);
/// Longest `git worktree add/remove/prune` may hold [`GIT`] (what another checkout's git
/// directory holds must never wedge every checkout of the worker).
const LOCKED_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// [`git`] for a command run holding [`GIT`], cut off after [`LOCKED_TIMEOUT`].
pub(crate) async fn git_locked(dir: &Path, args: &[&str]) -> Result<String, Problem> {
    tokio::time::timeout(LOCKED_TIMEOUT, git(dir, args))
        .await
        .map_err(|_| {
            Problem::internal(format!(
                "git {} took more than {} s",
                args.join(" "),
                LOCKED_TIMEOUT.as_secs()
            ))
        })?
}

/// What a source checkout's `.git/config` says once its agent is gone: what `git init` writes.
///
/// Stat data is compared as `core.checkStat = minimal` (mtime seconds, size, mode): inside a
/// sandbox the agent's uid is not the worker's that checked the files out, and a shared tree's
/// files have another device number through a view; a full comparison would make the first
/// `git status` read every file.
const CHECKOUT_CONFIG: &str = "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n\tlogallrefupdates = true\n\tcheckStat = minimal\n\ttrustctime = false\n";

/// One call's worktree.
#[derive(Debug, Clone)]
pub struct Worktree {
    /// The worktree's top directory.
    pub path: PathBuf,
    /// Where the agent works: the same place inside the worktree as its working directory
    /// was inside the repository.
    pub workdir: PathBuf,
    pub branch: String,
    /// The commit it started from.
    pub base: String,
    /// An earlier attempt of the call made it (and may have left work in it).
    pub reused: bool,
    repo: PathBuf,
    /// The worktree's own git directory (`<common>/worktrees/<name>`), found from the
    /// repository's side: every git command on the checkout names it, so a `.git` file the
    /// agent rewrote (to a directory with hooks or filters of its choosing) is never read.
    admin: PathBuf,
    /// A copy-on-write checkout (a view of a shared tree mounted at `path` only for the
    /// processes that work in it): `None` for a checkout on disk.
    view: Option<crate::layers::View>,
}

/// What happened to a worktree after its attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finished {
    /// Nothing changed: worktree and branch are gone.
    Removed,
    /// The agent changed files or committed: both stay for the user.
    Kept,
}

/// `git -C dir` with hooks, an fsmonitor command and the `ext::` transport off, no
/// terminal prompts, killed when dropped.
pub(crate) fn git_command(dir: &Path) -> Command {
    hardened(Command::new("git"), dir)
}

/// `git` (as `c`) run in `dir`, with what a repository could make it run turned off, and
/// no automatic gc or maintenance (a shared cache is not the agent's to repack).
fn hardened(mut c: Command, dir: &Path) -> Command {
    c.arg("-C")
        .arg(dir)
        .args([
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "core.fsmonitor=false",
            "-c",
            "gc.auto=0",
            "-c",
            "maintenance.auto=false",
        ])
        .args(["-c", "protocol.ext.allow=never"])
        // Nested repositories (submodules, or one an agent made) are read for their commit
        // only: no `git status` is started inside one, whose config would be the agent's.
        .args([
            "-c",
            "diff.ignoreSubmodules=dirty",
            "-c",
            "submodule.recurse=false",
            "-c",
            "status.submoduleSummary=false",
        ])
        .env("GIT_TERMINAL_PROMPT", "0")
        .kill_on_drop(true);
    c
}

/// Runs git in `dir`: its trimmed stdout, or its stderr as the error. What an agent can
/// write in its checkout never runs here: hooks and an fsmonitor command are off, and a
/// git killed by a timeout (the future dropped) dies with it.
pub(crate) async fn git(dir: &Path, args: &[&str]) -> Result<String, Problem> {
    run(git_command(dir).args(args)).await
}

/// A git command's trimmed stdout, or its stderr as the error.
pub(crate) async fn run_git(c: &mut Command) -> Result<String, Problem> {
    run(c).await
}

/// A git command's trimmed stdout, or its stderr as the error.
async fn run(c: &mut Command) -> Result<String, Problem> {
    let out = c.output().await.map_err(|e| {
        Problem::internal(format!("cannot run git: {e}; install git on the worker"))
    })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(Problem::internal(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ))
    }
}

/// The git directory of the worktree at `path` of the repository `repo`: the entry of
/// `<common>/worktrees` whose `gitdir` names `path/.git`.
async fn admin_dir(repo: &Path, path: &Path) -> Option<PathBuf> {
    let common = git(repo, &["rev-parse", "--git-common-dir"]).await.ok()?;
    let common = repo.join(common);
    let want = path.canonicalize().ok()?.join(".git");
    for entry in std::fs::read_dir(common.join("worktrees")).ok()?.flatten() {
        // Only a plain file, and only its start: what an agent left there (a FIFO, a link
        // to /dev/zero) must not hang or exhaust the worker.
        let gitdir = entry.path().join("gitdir");
        if !std::fs::symlink_metadata(&gitdir).is_ok_and(|m| m.is_file() && m.len() < 4096) {
            continue;
        }
        let Ok(named) = std::fs::read_to_string(&gitdir) else {
            continue;
        };
        let named = PathBuf::from(named.trim());
        let named = match named.parent().and_then(|p| p.canonicalize().ok()) {
            Some(dir) => dir.join(".git"),
            None => named,
        };
        if named == want {
            return Some(entry.path());
        }
    }
    None
}

/// git on the checkout at `path` whose git directory is `admin`: never the one its `.git`
/// file names, with the common directory named too (an agent may rewrite `admin/commondir`),
/// and the objects an agent's commits made in a sandbox (`admin/objects`) in view.
fn command_in(
    admin: &Path,
    path: &Path,
    mounts: &[crate::sandbox::Mount],
    view: Option<&crate::layers::View>,
) -> Command {
    let view = view.map(|v| v.prefix(None)).unwrap_or_default();
    let mut c = hardened(crate::sandbox::worker_git(mounts, &view), path);
    c.arg(format!("--git-dir={}", admin.display()))
        .arg(format!("--work-tree={}", path.display()));
    pin_common(&mut c, admin);
    c
}

/// What the worker's git on a source checkout at `path` (a repository of its own) sees when
/// it runs sandboxed: the checkout, and the cache's objects it borrows (`objects`, as the
/// worker knows them, never as the checkout's alternates file says), read-only.
fn own_jail(objects: &Path, path: &Path) -> Vec<crate::sandbox::Mount> {
    use crate::sandbox::Mount;
    vec![Mount::Ro(objects.to_owned()), Mount::Rw(path.to_owned())]
}

/// What the worker's git on the checkout at `path` (git directory `admin`) sees when it runs
/// sandboxed: the repository (its config, hooks and info read-only, so nothing there is ever
/// the agent's) and the checkout.
fn jailed(admin: &Path, path: &Path) -> Vec<crate::sandbox::Mount> {
    use crate::sandbox::Mount;
    let common = common_of(admin).unwrap_or(admin).to_owned();
    vec![
        Mount::Rw(common.clone()),
        Mount::RoIfThere(common.join("config")),
        Mount::RoIfThere(common.join("hooks")),
        Mount::RoIfThere(common.join("info")),
        Mount::Rw(path.to_owned()),
    ]
}

/// The common git directory of the worktree whose own git directory is `admin`
/// (`<common>/worktrees/NAME`).
fn common_of(admin: &Path) -> Option<&Path> {
    admin.parent().and_then(Path::parent)
}

/// Names `admin`'s common directory (`<common>/worktrees/NAME`) and its own objects for `c`.
fn pin_common(c: &mut Command, admin: &Path) {
    if admin.file_name() == Some(std::ffi::OsStr::new(".git")) {
        // A repository of its own: nothing shared to pin.
        return;
    }
    if let Some(common) = common_of(admin) {
        c.env("GIT_COMMON_DIR", common);
    }
    let own = admin.join("objects");
    if own.is_dir() {
        c.env("GIT_ALTERNATE_OBJECT_DIRECTORIES", own);
    }
}

/// Runs git on the checkout at `path` whose git directory is `admin` (see [`command_in`]).
async fn git_in(
    admin: &Path,
    path: &Path,
    mounts: &[crate::sandbox::Mount],
    view: Option<&crate::layers::View>,
    args: &[&str],
) -> Result<String, Problem> {
    let mut c = command_in(admin, path, mounts, view);
    tokio::time::timeout(GIT_TIMEOUT, run(c.args(args)))
        .await
        .map_err(|_| {
            Problem::internal(format!(
                "git {} took more than {} minutes",
                args.first().unwrap_or(&""),
                GIT_TIMEOUT.as_secs() / 60
            ))
        })?
}

fn plain_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with('.')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// The top of the git repository `dir` is in.
async fn repo_of(dir: &Path) -> Result<PathBuf, Problem> {
    let repo = git(dir, &["rev-parse", "--show-toplevel"])
        .await
        .map(PathBuf::from)
        .map_err(|_| {
            Problem::invalid(format!(
                "isolation: 'worktree' needs a git repository, and {} is not inside one; run from a git checkout (or pass --workspace DIR with one), or drop the isolation option",
                dir.display()
            ))
        })?;
    Ok(repo.canonicalize().unwrap_or(repo))
}

/// What a new worktree branches from: the default branch when the repository has a remote,
/// else HEAD (W20).
async fn base_commit(repo: &Path) -> Result<String, Problem> {
    match git(
        repo,
        &["rev-parse", "--verify", "-q", "refs/remotes/origin/HEAD^{commit}"],
    )
    .await
    {
        Ok(c) if !c.is_empty() => Ok(c),
        _ => git(repo, &["rev-parse", "--verify", "-q", "HEAD^{commit}"])
            .await
            .map_err(|_| {
                Problem::invalid(format!(
                    "isolation: 'worktree' needs a commit to branch from, and the repository at {} has none yet; commit something first",
                    repo.display()
                ))
            }),
    }
}

impl Worktree {
    /// The worktree of call `call` for an agent whose working directory would be `dir`
    /// (inside a git repository): made, or the one an earlier attempt left.
    pub async fn create(dir: &Path, run_id: &str, call: u64) -> Result<Worktree, Problem> {
        if !plain_name(run_id) {
            return Err(Problem::invalid(format!(
                "run id {run_id:?} cannot name a branch"
            )));
        }
        let repo = repo_of(dir).await?;
        let common = git(&repo, &["rev-parse", "--git-common-dir"]).await?;
        let common = repo.join(common);
        let common = common.canonicalize().unwrap_or(common);
        let path = common
            .join("flotilla")
            .join("worktrees")
            .join(run_id)
            .join(call.to_string());
        let branch = format!("flotilla/{run_id}/{call}");
        let inside = dir
            .canonicalize()
            .ok()
            .and_then(|d| d.strip_prefix(&repo).ok().map(Path::to_path_buf))
            .unwrap_or_default();
        let _git = GIT.lock().await;
        // An earlier attempt of this call: its worktree, with whatever it wrote.
        let earlier = match path.is_dir() {
            true => admin_dir(&repo, &path).await,
            false => None,
        };
        if let Some(admin) = earlier
            && git_in(
                &admin,
                &path,
                &jailed(&admin, &path),
                None,
                &["rev-parse", "--abbrev-ref", "HEAD"],
            )
            .await
            .as_deref()
                == Ok(branch.as_str())
        {
            // The commit it started from, as its first attempt wrote it down.
            let base = std::fs::read_to_string(base_file(&path))
                .map(|b| b.trim().to_owned())
                .unwrap_or_default();
            let workdir = path.join(&inside);
            std::fs::create_dir_all(&workdir).map_err(|e| {
                Problem::invalid(format!("cannot create {}: {e}", workdir.display()))
            })?;
            return Ok(Worktree {
                path,
                workdir,
                branch,
                base,
                reused: true,
                repo,
                admin,
                view: None,
            });
        }
        let base = base_commit(&repo).await?;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| {
                Problem::invalid(format!("cannot create {}: {e}", parent.display()))
            })?;
        }
        // A leftover of a worker that died mid-attempt: take it away first.
        if path.exists() {
            let _ = git(
                &repo,
                &["worktree", "remove", "--force", &path.to_string_lossy()],
            )
            .await;
            let _ = std::fs::remove_dir_all(&path);
            let _ = git(&repo, &["worktree", "prune"]).await;
        }
        let _ = git(&repo, &["branch", "-D", &branch]).await;
        git(
            &repo,
            &[
                "worktree",
                "add",
                "--quiet",
                "-b",
                &branch,
                &path.to_string_lossy(),
                &base,
            ],
        )
        .await
        .map_err(|e| Problem::invalid(format!("git worktree add failed: {e}")))?;
        std::fs::write(base_file(&path), &base).map_err(|e| {
            Problem::invalid(format!("cannot write {}: {e}", base_file(&path).display()))
        })?;
        let path = path.canonicalize().unwrap_or(path);
        let admin = admin_dir(&repo, &path).await.ok_or_else(|| {
            Problem::invalid(format!("git made no worktree at {}", path.display()))
        })?;
        let workdir = path.join(inside);
        std::fs::create_dir_all(&workdir)
            .map_err(|e| Problem::invalid(format!("cannot create {}: {e}", workdir.display())))?;
        Ok(Worktree {
            path,
            workdir,
            branch,
            base,
            reused: false,
            repo,
            admin,
            view: None,
        })
    }

    /// Removes the worktree whatever it holds (its commits stay in the repository).
    pub async fn discard(&self) {
        if let Some(view) = &self.view {
            view.remove();
        } else if self.own_repo() {
            let _ = std::fs::remove_dir_all(&self.path);
        } else {
            let _git = GIT.lock().await;
            if git_locked(
                &self.repo,
                &[
                    "worktree",
                    "remove",
                    "--force",
                    &self.path.to_string_lossy(),
                ],
            )
            .await
            .is_err()
            {
                let _ = std::fs::remove_dir_all(&self.path);
                let _ = git_locked(&self.repo, &["worktree", "prune"]).await;
            }
        }
        let _ = std::fs::remove_file(base_file(&self.path));
        let _ = std::fs::remove_file(partial_file(&self.path));
        crate::workspace::prune_above(&self.path);
    }

    /// The repository the worktree belongs to.
    pub fn repo(&self) -> &Path {
        &self.repo
    }

    /// [`Worktree::finish_as`] with a plain message.
    pub async fn finish(&self) -> Finished {
        self.finish_as("flotilla: the agent's change").await
    }

    /// A checkout of `commit` of the (bare) repository `repo` at `dir`, on no branch: a run
    /// source's checkout for one call. It is a repository of its own that borrows the
    /// cache's objects (`objects/info/alternates`): what its agent writes in its `.git`
    /// (config, hooks, objects of its commits) is its own, and never touches the cache.
    pub async fn detached(repo: &Path, dir: &Path, commit: &str) -> Result<Worktree, Problem> {
        if let Some(parent) = dir.parent() {
            crate::workspace::make_dirs(parent).map_err(|e| {
                Problem::internal(format!("cannot create {}: {e}", parent.display()))
            })?;
        }
        // An empty directory in the way (a scratch directory of an earlier version).
        let _ = std::fs::remove_dir(dir);
        let objects =
            PathBuf::from(git(repo, &["rev-parse", "--absolute-git-dir"]).await?).join("objects");
        let made = async {
            git(
                dir.parent().unwrap_or(dir),
                &["init", "-q", &dir.to_string_lossy()],
            )
            .await?;
            let admin = dir.join(".git");
            std::fs::write(
                admin.join("objects").join("info").join("alternates"),
                format!("{}\n", objects.display()),
            )
            .map_err(|e| Problem::internal(format!("cannot write {}: {e}", admin.display())))?;
            // The files, from the cache's objects (the worker's git, on a directory no agent
            // has had yet).
            git(dir, &["checkout", "-q", "--detach", commit]).await
        };
        if let Err(e) = made.await {
            let _ = std::fs::remove_dir_all(dir);
            return Err(e);
        }
        std::fs::write(base_file(dir), commit).map_err(|e| {
            Problem::internal(format!("cannot write {}: {e}", base_file(dir).display()))
        })?;
        let path = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
        Ok(Worktree {
            workdir: path.clone(),
            admin: path.join(".git"),
            path,
            branch: String::new(),
            base: commit.to_owned(),
            reused: false,
            repo: repo.to_owned(),
            view: None,
        })
    }

    /// A copy-on-write checkout of `base` of the (bare) repository `repo`: `view`, over the
    /// shared tree of `base`, with what an earlier attempt of the call wrote when it is there
    /// (`reused`) and was of the same base.
    pub fn over(repo: &Path, view: crate::layers::View, base: &str) -> Result<Worktree, Problem> {
        let earlier = std::fs::read_to_string(base_file(&view.at)).is_ok_and(|b| b.trim() == base);
        if !earlier {
            // Writes over another base (or half made) are not this call's to keep.
            view.remove();
            let _ = std::fs::remove_file(partial_file(&view.at));
        }
        let reused = view.make()? && earlier;
        std::fs::write(base_file(&view.at), base).map_err(|e| {
            Problem::internal(format!(
                "cannot write {}: {e}",
                base_file(&view.at).display()
            ))
        })?;
        let path = view.at.clone();
        Ok(Worktree {
            workdir: path.clone(),
            admin: path.join(".git"),
            path,
            branch: String::new(),
            base: base.to_owned(),
            reused,
            repo: repo.to_owned(),
            view: Some(view),
        })
    }

    /// A source checkout's directories (a view's three, or the checkout on disk) moved out
    /// of the way at once (`{call}.gone-…`, beside them; the workspace sweep takes any a
    /// worker left), for the caller to remove; its base and partial records removed. `None`
    /// for a worktree of the user's repository (see [`Worktree::discard`]).
    pub fn set_aside(&self) -> Option<Vec<PathBuf>> {
        let dirs = match &self.view {
            Some(view) => vec![&view.upper, &view.work, &view.at],
            None if self.own_repo() => vec![&self.path],
            None => return None,
        };
        let stamp = flotilla_proto::clock::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut gone = Vec::new();
        for (i, dir) in dirs.into_iter().enumerate() {
            let to = self.path.with_extension(format!("gone-{stamp}-{i}"));
            match std::fs::rename(dir, &to) {
                Ok(()) => gone.push(to),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                // Where it cannot move, it goes where it is.
                Err(_) => gone.push(dir.clone()),
            }
        }
        let _ = std::fs::remove_file(base_file(&self.path));
        let _ = std::fs::remove_file(partial_file(&self.path));
        Some(gone)
    }

    /// The copy-on-write view this checkout is, if it is one.
    pub fn view(&self) -> Option<&crate::layers::View> {
        self.view.as_ref()
    }

    /// Where what the attempts wrote is on the worker's disk: a view's upper directory, or
    /// the checkout itself.
    pub fn writes(&self) -> &Path {
        self.view.as_ref().map_or(&self.path, |v| &v.upper)
    }

    /// The checkout's git directory as the worker's own file operations reach it: in a
    /// view, in its upper directory (what is written there shows in the view; it may not be
    /// there yet).
    pub(crate) fn host_admin(&self) -> PathBuf {
        match &self.view {
            Some(v) => v.upper.join(".git"),
            None => self.admin.clone(),
        }
    }

    /// The checkout an earlier attempt of the call made at `dir`, if it is there (a
    /// repository of its own: its `.git` a directory, not something an agent put there).
    pub async fn existing(repo: &Path, dir: &Path) -> Option<Worktree> {
        let path = dir.canonicalize().ok()?;
        if !std::fs::symlink_metadata(path.join(".git")).is_ok_and(|m| m.is_dir()) {
            return None;
        }
        let base = std::fs::read_to_string(base_file(&path))
            .ok()?
            .trim()
            .to_owned();
        Some(Worktree {
            workdir: path.clone(),
            admin: path.join(".git"),
            path,
            branch: String::new(),
            base,
            reused: true,
            repo: repo.to_owned(),
            view: None,
        })
    }

    /// Runs git on this checkout (its own git directory named, see [`Worktree::admin`]).
    pub async fn git(&self, args: &[&str]) -> Result<String, Problem> {
        git_in(
            &self.admin,
            &self.path,
            &self.mounts(),
            self.view.as_ref(),
            args,
        )
        .await
    }

    /// A git command on this checkout, to add arguments, input or environment to.
    pub fn command(&self) -> Command {
        command_in(&self.admin, &self.path, &self.mounts(), self.view.as_ref())
    }

    /// What the worker's git on this checkout sees when it runs sandboxed.
    fn mounts(&self) -> Vec<crate::sandbox::Mount> {
        if self.own_repo() {
            own_jail(&self.repo.join("objects"), &self.path)
        } else {
            jailed(&self.admin, &self.path)
        }
    }

    /// A git command on the repository, seeing the objects of this checkout's agent too.
    pub fn repo_command(&self) -> Command {
        if self.own_repo() {
            return self.command();
        }
        let mut c = hardened(
            crate::sandbox::worker_git(&jailed(&self.admin, &self.path), &[]),
            &self.repo,
        );
        pin_common(&mut c, &self.admin);
        c
    }

    /// A source checkout: a repository of its own (not a worktree of `repo`).
    pub fn own_repo(&self) -> bool {
        self.admin == self.path.join(".git")
    }

    /// Makes the checkout's git directory plain again once its agent is gone: anything in
    /// it that is not a regular file or a directory (a link to a file of the worker's, a
    /// FIFO that would hang git) goes, and so does worktree-only config.
    pub fn sanitize(&self) {
        let admin = self.host_admin();
        // A view's git directory is the worker's shared tree's where the agent wrote
        // nothing; what it wrote goes (a deletion too: the tree's shows again) or is made
        // plain.
        if self.view.is_some() && std::fs::symlink_metadata(&admin).is_err() {
            return;
        }
        // Never a link to somewhere else: then there is nothing here to clean (and the
        // worker's git on it fails).
        if !std::fs::symlink_metadata(&admin).is_ok_and(|m| m.is_dir()) {
            let _ = std::fs::remove_file(&admin);
            return;
        }
        let mut todo = vec![admin.clone()];
        while let Some(dir) = todo.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                let Ok(t) = e.file_type() else { continue };
                if t.is_dir() {
                    todo.push(e.path());
                } else if !t.is_file() {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let _ = std::fs::remove_file(admin.join("config.worktree"));
        if self.own_repo() {
            // A repository of its own has no business naming another git directory, and it
            // borrows the cache's objects, nothing else. Its config and attributes are the
            // agent's to write, so they go back to what the worker made: no filter, diff or
            // merge driver, fsmonitor, proxy, signing program or include an agent put there
            // runs in the worker's own git on the checkout.
            let _ = std::fs::remove_file(admin.join("commondir"));
            let _ = std::fs::remove_file(admin.join("gitdir"));
            let config = admin.join("config");
            let written = std::fs::symlink_metadata(&config);
            if written.as_ref().is_ok_and(|m| m.is_dir()) {
                crate::workspace::remove_tree(&config);
            }
            // In a view, the shared tree's config stands where the agent wrote none.
            if self.view.is_none() || written.is_ok() {
                let _ = std::fs::remove_file(&config);
                let _ = std::fs::write(&config, CHECKOUT_CONFIG);
            }
            for dir in ["info", "hooks", "modules"] {
                crate::workspace::remove_tree(&admin.join(dir));
            }
            let info = admin.join("objects").join("info");
            if std::fs::symlink_metadata(&info).is_ok_and(|m| m.is_dir()) {
                let _ = std::fs::write(
                    info.join("alternates"),
                    format!("{}\n", self.repo.join("objects").display()),
                );
            }
        }
    }

    /// The checkout's own git directory (`<common>/worktrees/NAME`).
    pub fn admin(&self) -> &Path {
        &self.admin
    }

    /// The repository's common git directory.
    pub fn common_dir(&self) -> PathBuf {
        common_of(&self.admin).map_or_else(|| self.repo.clone(), Path::to_owned)
    }

    /// Whether the agent left anything: a change to a tracked or untracked file, or a commit.
    pub async fn changed(&self) -> bool {
        if self.surely_unchanged() {
            return false;
        }
        let dirty = self
            .differs(None)
            .await
            .map(|d| !d.is_empty())
            .unwrap_or(true);
        let moved = self
            .git(&["rev-parse", "HEAD"])
            .await
            .map(|head| head != self.base)
            .unwrap_or(true);
        dirty || moved
    }

    /// A view whose agent wrote no file and moved no HEAD: it changed nothing, and no git
    /// needs to run to know it.
    pub fn surely_unchanged(&self) -> bool {
        self.view.as_ref().is_some_and(|v| {
            !v.wrote_files()
                && std::fs::symlink_metadata(v.upper.join(".git").join("HEAD")).is_err()
        })
    }

    /// What git must look at for what the agent changed: in a view, the paths it wrote
    /// ([`crate::layers::View::touched`]) and those its index (`index`, or the checkout's)
    /// stages against HEAD; `None` for all of the checkout.
    async fn touched(&self, index: Option<&Path>) -> Option<Vec<String>> {
        let view = self.view.as_ref()?;
        let mut paths = view.touched(TOUCHED_MOST)?;
        // The index is the shared tree's (the commit's) until the agent's git wrote one.
        if std::fs::symlink_metadata(view.upper.join(".git").join("index")).is_ok() {
            let staged = [
                "diff-index",
                "--cached",
                "--name-only",
                "-z",
                "--no-renames",
                "HEAD",
            ];
            paths.extend(self.git_z(&staged, index, None).await.ok()?);
        }
        (paths.len() <= TOUCHED_MOST).then_some(paths)
    }

    /// git on the checkout with `-z` output, split at its NULs: with the index `index` (or
    /// the checkout's), pathspecs taken literally, `input` on its stdin, and no index
    /// refreshed on the way (a view's would be copied up for nothing).
    async fn git_z(
        &self,
        args: &[&str],
        index: Option<&Path>,
        input: Option<Vec<u8>>,
    ) -> Result<Vec<String>, Problem> {
        use tokio::io::AsyncWriteExt;
        let mut c = self.command();
        c.args(args)
            .env("GIT_LITERAL_PATHSPECS", "1")
            .env("GIT_OPTIONAL_LOCKS", "0")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if let Some(i) = index {
            c.env("GIT_INDEX_FILE", i);
        }
        let run = async {
            let mut child = c.spawn().map_err(|e| {
                Problem::internal(format!("cannot run git: {e}; install git on the worker"))
            })?;
            // Its stdin closes once written (a git that exits early closes its end: its
            // status says why).
            if let Some(mut stdin) = child.stdin.take()
                && let Some(bytes) = input
            {
                let _ = stdin.write_all(&bytes).await;
            }
            child
                .wait_with_output()
                .await
                .map_err(|e| Problem::internal(format!("cannot run git: {e}")))
        };
        let out = tokio::time::timeout(GIT_TIMEOUT, run).await.map_err(|_| {
            Problem::internal(format!(
                "git {} took more than {} minutes",
                args.first().unwrap_or(&""),
                GIT_TIMEOUT.as_secs() / 60
            ))
        })??;
        if !out.status.success() {
            return Err(Problem::internal(
                String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            ));
        }
        Ok(out
            .stdout
            .split(|b| *b == 0)
            .filter(|r| !r.is_empty())
            .map(|r| String::from_utf8_lossy(r).into_owned())
            .collect())
    }

    /// `git status` of the checkout against the index `index` (or its own), one `XY path`
    /// per entry (every untracked file named, no renames), looking only at what the agent
    /// touched when that is known ([`Worktree::touched`]).
    async fn differs(&self, index: Option<&Path>) -> Result<Vec<String>, Problem> {
        let mut args = vec![
            "status",
            "--porcelain=v1",
            "-z",
            "--untracked-files=all",
            "--no-renames",
        ];
        let touched = self.touched(index).await;
        match &touched {
            Some(paths) if paths.is_empty() => return Ok(Vec::new()),
            Some(paths) => {
                args.push("--");
                args.extend(paths.iter().map(String::as_str));
            }
            None => {}
        }
        self.git_z(&args, index, None).await
    }

    /// `git add -A` into the index `index` (or the checkout's own), of exactly the paths
    /// whose files differ from it ([`Worktree::differs`]); whether anything differs from
    /// HEAD at all.
    pub async fn stage(&self, index: Option<&Path>) -> Result<bool, Problem> {
        let differs = self.differs(index).await?;
        // `XY path`: Y is the file against the index (`?` untracked); a path only staged
        // (Y blank) is in the index as it should be already.
        let add: Vec<&str> = differs
            .iter()
            .filter(|r| r.len() > 3 && r.as_bytes()[1] != b' ')
            .map(|r| &r[3..])
            .collect();
        if !add.is_empty() {
            let list = add.join("\0").into_bytes();
            let args = ["add", "-A", "--pathspec-from-file=-", "--pathspec-file-nul"];
            self.git_z(&args, index, Some(list)).await?;
        }
        Ok(!differs.is_empty())
    }

    /// A commit of everything in the checkout now (tracked, untracked, and what the agent
    /// committed) on its HEAD, made through a scratch index: the agent's index and files stay
    /// as they are. Its parent is HEAD, so a checkout of it can be put back as uncommitted
    /// changes (`git reset HEAD^`).
    pub async fn snapshot(&self, message: &str) -> Result<String, Problem> {
        let host_admin = self.host_admin();
        std::fs::create_dir_all(&host_admin)
            .map_err(|e| Problem::internal(format!("cannot make a scratch index: {e}")))?;
        let index = tempfile::Builder::new()
            .prefix("flotilla-index-")
            .tempfile_in(&host_admin)
            .map_err(|e| Problem::internal(format!("cannot make a scratch index: {e}")))?;
        let current = match &self.view {
            Some(v) => v.host_file(Path::new(".git/index")),
            None => Some(self.admin.join("index")),
        };
        match current.map(|i| std::fs::copy(i, index.path())) {
            Some(Ok(_)) | None => {}
            Some(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
            Some(Err(e)) => {
                return Err(Problem::internal(format!(
                    "cannot copy the checkout's index: {e}"
                )));
            }
        }
        // Where git sees it: in a view, through the view.
        let index_at = match index.path().file_name() {
            Some(name) if self.view.is_some() => self.admin.join(name),
            _ => index.path().to_owned(),
        };
        let run = |args: Vec<&str>| {
            let mut c = self.command();
            c.args(&args)
                .env("GIT_INDEX_FILE", &index_at)
                .env("GIT_AUTHOR_NAME", "flotilla")
                .env("GIT_AUTHOR_EMAIL", "flotilla@localhost")
                .env("GIT_COMMITTER_NAME", "flotilla")
                .env("GIT_COMMITTER_EMAIL", "flotilla@localhost");
            async move {
                let out = c
                    .output()
                    .await
                    .map_err(|e| Problem::internal(e.to_string()))?;
                if out.status.success() {
                    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
                } else {
                    Err(Problem::internal(
                        String::from_utf8_lossy(&out.stderr).trim().to_owned(),
                    ))
                }
            }
        };
        self.stage(Some(&index_at)).await?;
        let tree = run(vec!["write-tree"]).await?;
        run(vec!["commit-tree", &tree, "-p", "HEAD", "-m", message]).await
    }

    /// Puts the files of `partial` (a [`Worktree::snapshot`] an attempt elsewhere made) into
    /// this checkout of it as uncommitted changes on its parent, and records `base` as the
    /// commit the call started from.
    pub async fn unpack_partial(&mut self, partial: &str, base: &str) -> Result<(), Problem> {
        self.git(&["reset", "-q", "HEAD^"]).await?;
        std::fs::write(base_file(&self.path), base).map_err(|e| {
            Problem::internal(format!(
                "cannot write {}: {e}",
                base_file(&self.path).display()
            ))
        })?;
        mark_partial(&self.path, partial)?;
        self.base = base.to_owned();
        Ok(())
    }

    /// The earlier attempt's leftovers this checkout holds (see [`mark_partial`]).
    pub fn partial(&self) -> String {
        std::fs::read_to_string(partial_file(&self.path))
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    }

    /// Removes the worktree and its branch if nothing changed. Otherwise what the agent left
    /// uncommitted becomes a commit on its branch (`message`, by "flotilla"), so the branch
    /// holds the agent's whole change, and both stay.
    pub async fn finish_as(&self, message: &str) -> Finished {
        if self.changed().await {
            let dirty = self
                .git(&["status", "--porcelain"])
                .await
                .is_ok_and(|s| !s.is_empty());
            if dirty {
                let committed = async {
                    self.git(&["add", "-A"]).await?;
                    self.git(&[
                        "-c",
                        "user.name=flotilla",
                        "-c",
                        "user.email=flotilla@localhost",
                        "commit",
                        "-q",
                        "--no-verify",
                        "-m",
                        message,
                    ])
                    .await
                }
                .await;
                if let Err(e) = committed {
                    tracing::warn!(worktree = %self.path.display(), error = %e, "cannot commit the agent's change; it stays uncommitted in its worktree");
                }
            }
            return Finished::Kept;
        }
        let _git = GIT.lock().await;
        let removed = git_locked(
            &self.repo,
            &[
                "worktree",
                "remove",
                "--force",
                &self.path.to_string_lossy(),
            ],
        )
        .await;
        if removed.is_err() {
            let _ = std::fs::remove_dir_all(&self.path);
            let _ = git_locked(&self.repo, &["worktree", "prune"]).await;
        }
        if !self.branch.is_empty() {
            let _ = git(&self.repo, &["branch", "-D", &self.branch]).await;
        }
        let _ = std::fs::remove_file(base_file(&self.path));
        // The directories above it go once empty (its run's).
        crate::workspace::prune_above(&self.path);
        Finished::Removed
    }
}

/// Beside a worktree: the last partial commit of its leftovers sent to the coordinator (or
/// unpacked into it). A later attempt told to start from another one does not reuse it.
fn partial_file(path: &Path) -> PathBuf {
    path.with_extension("partial")
}

/// Records that the checkout at `path` holds what partial commit `commit` holds.
pub fn mark_partial(path: &Path, commit: &str) -> Result<(), Problem> {
    std::fs::write(partial_file(path), commit).map_err(|e| {
        Problem::internal(format!(
            "cannot write {}: {e}",
            partial_file(path).display()
        ))
    })
}

/// Beside a worktree: the commit it started from (so a later attempt of the call knows).
fn base_file(path: &Path) -> PathBuf {
    path.with_extension("base")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(dir: &Path, args: &[&str]) {
        let ok = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .output()
            .unwrap();
        assert!(ok.status.success(), "{args:?}: {ok:?}");
    }

    fn repo() -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        sh(tmp.path(), &["init", "-q", "-b", "main"]);
        std::fs::create_dir_all(tmp.path().join("src")).unwrap();
        std::fs::write(tmp.path().join("src/a.txt"), "a\n").unwrap();
        sh(tmp.path(), &["add", "."]);
        sh(
            tmp.path(),
            &[
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "commit",
                "-q",
                "-m",
                "one",
            ],
        );
        tmp
    }

    #[tokio::test]
    async fn an_unchanged_worktree_is_removed_with_its_branch() {
        let r = repo();
        let root = r.path().canonicalize().unwrap();
        let wt = Worktree::create(&root.join("src"), "wf_a", 3)
            .await
            .unwrap();
        assert!(
            wt.workdir.ends_with(".git/flotilla/worktrees/wf_a/3/src"),
            "{wt:?}"
        );
        assert_eq!(
            std::fs::read_to_string(wt.workdir.join("a.txt")).unwrap(),
            "a\n"
        );
        assert_eq!(wt.finish().await, Finished::Removed);
        assert!(!wt.path.exists());
        assert!(
            !wt.path.parent().unwrap().exists(),
            "nothing of the run is left"
        );
        let branches = git(&root, &["branch", "--list", "flotilla/*"])
            .await
            .unwrap();
        assert!(branches.is_empty(), "{branches}");
        assert_eq!(git(&root, &["status", "--porcelain"]).await.unwrap(), "");
    }

    #[tokio::test]
    async fn a_changed_worktree_is_kept_reused_by_the_next_attempt_and_the_checkout_is_untouched() {
        let r = repo();
        let root = r.path().canonicalize().unwrap();
        let wt = Worktree::create(&root, "wf_b", 0).await.unwrap();
        std::fs::write(wt.workdir.join("new.txt"), "x").unwrap();
        assert_eq!(wt.finish().await, Finished::Kept);
        assert!(wt.path.join("new.txt").exists());
        assert!(!root.join("new.txt").exists());
        // The branch holds the change, committed.
        let files = git(
            &root,
            &["show", "--name-only", "--format=", "flotilla/wf_b/0"],
        )
        .await
        .unwrap();
        assert_eq!(files, "new.txt");
        assert_eq!(
            git(&root, &["status", "--porcelain"]).await.unwrap(),
            "",
            "the user's tree shows nothing"
        );
        let branches = git(&root, &["branch", "--list", "flotilla/*"])
            .await
            .unwrap();
        assert!(branches.contains("flotilla/wf_b/0"), "{branches}");
        // A restarted attempt finds what the first one wrote (W58), and knows it changed.
        let again = Worktree::create(&root, "wf_b", 0).await.unwrap();
        assert!(again.reused);
        assert!(again.workdir.join("new.txt").exists());
        assert_eq!(again.base, wt.base);
        assert_eq!(again.finish().await, Finished::Kept);
    }

    #[tokio::test]
    async fn outside_a_repository_the_error_says_what_to_do() {
        let tmp = tempfile::tempdir().unwrap();
        let e = Worktree::create(tmp.path(), "wf_c", 0).await.unwrap_err();
        assert!(e.message.contains("needs a git repository"), "{e}");
        assert!(e.message.contains("--workspace"), "{e}");
        assert_eq!(
            std::fs::read_dir(tmp.path()).unwrap().count(),
            0,
            "nothing is made"
        );
    }
}
