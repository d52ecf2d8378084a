//! `isolation: 'worktree'` (W20): an attempt works in a fresh git worktree of the repository
//! that holds its working directory, on its own branch. Afterwards the worktree is removed if
//! the agent changed nothing, and kept (with its branch) otherwise.
//!
//! Outside a git repository (or without git) the attempt gets a fresh empty directory at the
//! same place instead, so a Claude Code script that asks for a worktree still runs, isolated.
//!
//! Worktrees live under `<workspace root>/.worktrees/<run>/<call>-<attempt>`, branches are
//! `flotilla/<run>/<call>-<attempt>`, so a retry never inherits a half-done attempt and a kept
//! worktree is never reused. Git's own commands do the work; adding and removing worktrees of
//! one repository is serialized in this process, since git locks its metadata for each.

use std::path::{Path, PathBuf};

use tokio::process::Command;
use tokio::sync::Mutex;

/// Serializes `git worktree add/remove` (they take repository-wide locks).
static GIT: Mutex<()> = Mutex::const_new(());

/// One attempt's worktree.
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
    /// The repository; `None` for a plain directory (no repository to branch from).
    repo: Option<PathBuf>,
}

/// What happened to a worktree after its attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finished {
    /// Nothing changed: worktree and branch are gone.
    Removed,
    /// The agent changed files or committed: both stay for the user.
    Kept,
}

/// Where an attempt's worktree (or plain directory) lives.
fn place(root: &Path, run_id: &str, call: u64, attempt: u32) -> PathBuf {
    root.join(".worktrees")
        .join(run_id)
        .join(format!("{call}-{attempt}"))
}

async fn git(dir: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .await
        .map_err(|e| format!("cannot run git: {e}; install git on the worker"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

impl Worktree {
    /// Makes the worktree of attempt `attempt` of call `call`, for an agent whose working
    /// directory would be `dir` (inside a git checkout under `root`).
    pub async fn create(
        root: &Path,
        dir: &Path,
        run_id: &str,
        call: u64,
        attempt: u32,
    ) -> Result<Worktree, String> {
        let repo = git(dir, &["rev-parse", "--show-toplevel"])
            .await
            .map(PathBuf::from)
            .map_err(|_| {
                format!(
                    "isolation: 'worktree' needs a git repository, and {} is not inside one; \
                     start the worker with --workspace set to a git checkout (or give a cwd inside one)",
                    dir.display()
                )
            })?;
        let repo = repo.canonicalize().unwrap_or(repo);
        // Branch from the default branch when the repository has a remote, else from HEAD (W20).
        let base = match git(
            &repo,
            &["rev-parse", "--verify", "-q", "refs/remotes/origin/HEAD^{commit}"],
        )
        .await
        {
            Ok(c) if !c.is_empty() => c,
            _ => git(&repo, &["rev-parse", "--verify", "-q", "HEAD^{commit}"])
                .await
                .map_err(|_| {
                    format!(
                        "isolation: 'worktree' needs a commit to branch from, and the repository at {} has none yet; commit something first",
                        repo.display()
                    )
                })?,
        };
        let path = place(root, run_id, call, attempt);
        let branch = format!("flotilla/{run_id}/{call}-{attempt}");
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        }
        {
            let _git = GIT.lock().await;
            // A leftover from a worker that died mid-attempt: take it away first.
            if path.exists() {
                let _ = git(
                    &repo,
                    &["worktree", "remove", "--force", &path.to_string_lossy()],
                )
                .await;
                let _ = std::fs::remove_dir_all(&path);
                let _ = git(&repo, &["worktree", "prune"]).await;
                let _ = git(&repo, &["branch", "-D", &branch]).await;
            }
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
            .map_err(|e| format!("git worktree add failed: {e}"))?;
        }
        let path = path.canonicalize().unwrap_or(path);
        let inside = dir
            .canonicalize()
            .ok()
            .and_then(|d| d.strip_prefix(&repo).ok().map(Path::to_path_buf))
            .unwrap_or_default();
        let workdir = path.join(inside);
        std::fs::create_dir_all(&workdir)
            .map_err(|e| format!("cannot create {}: {e}", workdir.display()))?;
        Ok(Worktree {
            path,
            workdir,
            branch,
            base,
            repo: Some(repo),
        })
    }

    /// Outside a repository: a fresh, empty directory of the attempt's own at the same
    /// place a worktree would be, so the agent is still isolated from every other one.
    pub fn plain(root: &Path, run_id: &str, call: u64, attempt: u32) -> Result<Worktree, String> {
        let path = place(root, run_id, call, attempt);
        if path.exists() {
            std::fs::remove_dir_all(&path)
                .map_err(|e| format!("cannot clear {}: {e}", path.display()))?;
        }
        std::fs::create_dir_all(&path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let path = path.canonicalize().unwrap_or(path);
        Ok(Worktree {
            workdir: path.clone(),
            path,
            branch: String::new(),
            base: String::new(),
            repo: None,
        })
    }

    /// Whether this is a git worktree (not a plain directory).
    pub fn is_git(&self) -> bool {
        self.repo.is_some()
    }

    /// Whether the agent left anything: a change to a tracked or untracked file, or a commit.
    pub async fn changed(&self) -> bool {
        if self.repo.is_none() {
            return std::fs::read_dir(&self.path).map_or(true, |mut d| d.next().is_some());
        }
        let dirty = git(&self.path, &["status", "--porcelain"])
            .await
            .map(|s| !s.is_empty())
            .unwrap_or(true);
        let moved = git(&self.path, &["rev-parse", "HEAD"])
            .await
            .map(|head| head != self.base)
            .unwrap_or(true);
        dirty || moved
    }

    /// Removes the worktree and its branch if nothing changed; keeps both otherwise.
    pub async fn finish(&self) -> Finished {
        if self.changed().await {
            return Finished::Kept;
        }
        let Some(repo) = &self.repo else {
            let _ = std::fs::remove_dir(&self.path);
            return Finished::Removed;
        };
        let _git = GIT.lock().await;
        let removed = git(
            repo,
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
            let _ = git(repo, &["worktree", "prune"]).await;
        }
        let _ = git(repo, &["branch", "-D", &self.branch]).await;
        Finished::Removed
    }
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
        let wt = Worktree::create(&root, &root.join("src"), "wf_a", 3, 1)
            .await
            .unwrap();
        assert!(wt.workdir.ends_with(".worktrees/wf_a/3-1/src"), "{wt:?}");
        assert_eq!(
            std::fs::read_to_string(wt.workdir.join("a.txt")).unwrap(),
            "a\n"
        );
        assert_eq!(wt.finish().await, Finished::Removed);
        assert!(!wt.path.exists());
        let branches = git(&root, &["branch", "--list", "flotilla/*"])
            .await
            .unwrap();
        assert!(branches.is_empty(), "{branches}");
    }

    #[tokio::test]
    async fn a_changed_worktree_is_kept_and_the_checkout_is_untouched() {
        let r = repo();
        let root = r.path().canonicalize().unwrap();
        let wt = Worktree::create(&root, &root, "wf_b", 0, 2).await.unwrap();
        std::fs::write(wt.workdir.join("new.txt"), "x").unwrap();
        assert_eq!(wt.finish().await, Finished::Kept);
        assert!(wt.path.join("new.txt").exists());
        assert!(!root.join("new.txt").exists());
        let branches = git(&root, &["branch", "--list", "flotilla/*"])
            .await
            .unwrap();
        assert!(branches.contains("flotilla/wf_b/0-2"), "{branches}");
    }

    #[tokio::test]
    async fn outside_a_repository_the_error_says_what_to_do() {
        let tmp = tempfile::tempdir().unwrap();
        let e = Worktree::create(tmp.path(), tmp.path(), "wf_c", 0, 1)
            .await
            .unwrap_err();
        assert!(e.contains("needs a git repository"), "{e}");
        assert!(e.contains("--workspace"), "{e}");
    }
}
