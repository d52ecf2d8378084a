//! A fleet run's *head*: the commit of its source that agents start from, with the changes of
//! the agents that finished before merged in (design.md, "Sources and workspaces").
//!
//! One keeper per run applies changes one at a time, in the order calls finish:
//! - the change's pack goes to the store first (so a journaled change is never lost);
//! - an agent that started from the current head fast-forwards it; one that started earlier
//!   is merged (`git merge-tree --write-tree`, no working tree, deterministic commit dates);
//! - a conflict leaves the head as it was: the change stays on its own (the run reports a
//!   failure line naming the agent, its branch and the files); isolated agents'
//!   (`isolation: 'worktree'`) changes never enter the head.
//!
//! The merges happen in a bare repository in the coordinator's cache directory, one per
//! namespace and repository (`{cache}/namespaces/{ns}/{repo}.git`), filled from that
//! namespace's packs; new merge commits go back to the store as packs of their own, so any
//! coordinator and every worker can follow the head. The cache is only a cache.
//!
//! **Invariant:** an agent's change enters the store, the head or the cache only once it is
//! vetted ([`crate::vet`]): its pack is indexed into a quarantine beside the cache with git's
//! strict fsck (every link must resolve in the pack or the run's own source), and every tree
//! it adds over its base is read for names that leave the tree or reach `.git`. A change that
//! fails is *refused*: its call's result stands, its record says why (`refused`, which
//! `flotilla changes` shows), and nothing of it is stored. It is filed under the run's own
//! namespace and repository, whatever repository the worker's message names.

use std::path::{Path, PathBuf};

use object_store::ObjectStoreExt;
use tokio::process::Command;
use tokio::sync::{mpsc, watch};

use crate::source::{Repo, SourceError};
use crate::store::Store;

pub use crate::store::records::ChangeRecord;

/// A change to apply.
#[derive(Debug)]
pub struct Apply {
    pub call: u64,
    pub label: String,
    pub record: ChangeRecord,
    /// The objects the change adds, when they are not in the store yet.
    pub pack: Option<Vec<u8>>,
}

/// The outcome of one `Apply`.
#[derive(Debug)]
pub struct Applied {
    pub call: u64,
    pub result: Result<ChangeRecord, SourceError>,
}

/// Starts the keeper of a run whose source is `repo` at `start`. Changes go in on the returned
/// sender; results come out on `done`; the watch follows the head. It runs among `tasks`
/// until the sender is dropped.
pub fn spawn(
    store: Store,
    repo: Repo,
    start: String,
    cache: PathBuf,
    done: mpsc::UnboundedSender<Applied>,
    tasks: &tokio_util::task::TaskTracker,
) -> (mpsc::UnboundedSender<Apply>, watch::Receiver<String>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Apply>();
    let (head_tx, head_rx) = watch::channel(start);
    tasks.spawn(async move {
        let keeper = Keeper::new(store, repo, &cache);
        while let Some(a) = rx.recv().await {
            let head = head_tx.borrow().clone();
            let result = keeper.apply(&head, &a).await;
            if let Ok(r) = &result
                && let Some(h) = &r.head_after
            {
                head_tx.send_replace(h.clone());
            }
            if done
                .send(Applied {
                    call: a.call,
                    result,
                })
                .is_err()
            {
                return;
            }
        }
    });
    (tx, head_rx)
}

struct Keeper {
    store: Store,
    repo: Repo,
    bare: PathBuf,
}

/// The cache of namespace `repo.namespace`'s repository `repo.id` under `cache`.
fn bare_of(cache: &Path, repo: &Repo) -> PathBuf {
    cache
        .join("namespaces")
        .join(&repo.namespace)
        .join(format!("{}.git", repo.id))
}

/// A commit id as git writes one (SHA-1 or SHA-256).
fn is_commit_id(s: &str) -> bool {
    matches!(s.len(), 40 | 64) && s.chars().all(|c| c.is_ascii_hexdigit())
}

async fn git(
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<(bool, String), SourceError> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .envs(env.iter().copied())
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .await
        .map_err(SourceError::NoGit)?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if out.status.success() || out.status.code() == Some(1) {
        Ok((out.status.success(), text))
    } else {
        Err(SourceError::Git {
            args: args.join(" "),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

async fn ok(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<String, SourceError> {
    match git(dir, args, env).await? {
        (true, out) => Ok(out),
        (false, _) => Err(SourceError::Git {
            args: args.join(" "),
            stderr: "it answered no".into(),
        }),
    }
}

impl Keeper {
    fn new(store: Store, repo: Repo, cache: &Path) -> Keeper {
        let bare = bare_of(cache, &repo);
        Keeper { store, repo, bare }
    }

    async fn apply(&self, head: &str, a: &Apply) -> Result<ChangeRecord, SourceError> {
        let mut r = a.record.clone();
        r.head_after = None;
        r.conflicts.clear();
        // Refused once (a journaled record served again): refused still.
        if r.refused.is_some() {
            return Ok(r);
        }
        if let Some(pack) = &a.pack {
            if let Some(why) = self.vet(&r, pack).await? {
                tracing::warn!(repo = %self.repo, call = a.call, commit = %r.commit, reason = %why, "refused an agent's change");
                r.refused = Some(why);
                return Ok(r);
            }
            crate::source::put_pack(
                &self.store,
                &self.repo,
                &r.commit,
                vec![r.base.clone()],
                pack.clone(),
            )
            .await?;
        }
        if r.isolated {
            return Ok(r);
        }
        if r.base == head {
            r.head_after = Some(r.commit.clone());
            return Ok(r);
        }
        self.ensure(head).await?;
        self.ensure(&r.commit).await?;
        let (clean, out) = git(
            &self.bare,
            &[
                "merge-tree",
                "--write-tree",
                "--name-only",
                "--no-messages",
                head,
                &r.commit,
            ],
            &[],
        )
        .await?;
        let mut lines = out.lines();
        let tree = lines.next().unwrap_or_default().to_owned();
        if !clean {
            r.conflicts = lines
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect();
            return Ok(r);
        }
        // The merge's date is the change's, so the same merges give the same head.
        let date = ok(
            &self.bare,
            &["log", "-1", "--format=@%ct +0000", &r.commit],
            &[],
        )
        .await?;
        let message = format!("flotilla: merge agent {:?} (#{})", a.label, a.call);
        let env = [
            ("GIT_AUTHOR_NAME", "flotilla"),
            ("GIT_AUTHOR_EMAIL", "flotilla@localhost"),
            ("GIT_COMMITTER_NAME", "flotilla"),
            ("GIT_COMMITTER_EMAIL", "flotilla@localhost"),
            ("GIT_AUTHOR_DATE", date.as_str()),
            ("GIT_COMMITTER_DATE", date.as_str()),
        ];
        let merged = ok(
            &self.bare,
            &[
                "commit-tree",
                &tree,
                "-p",
                head,
                "-p",
                &r.commit,
                "-m",
                &message,
            ],
            &env,
        )
        .await?;
        // The merge commit (and any tree it made) goes to the store before it becomes the head.
        let pack = pack_objects(&self.bare, &merged, &[head, &r.commit]).await?;
        crate::source::put_pack(
            &self.store,
            &self.repo,
            &merged,
            vec![head.to_owned(), r.commit.clone()],
            pack,
        )
        .await?;
        let _ = ok(
            &self.bare,
            &["update-ref", &format!("refs/flotilla/{merged}"), &merged],
            &[],
        )
        .await;
        r.head_after = Some(merged);
        Ok(r)
    }

    /// Why the change `r`, whose objects are `pack`, may not enter the run (`None`: it may,
    /// and its objects are now in the cache). `Err`: the check itself could not be made.
    async fn vet(&self, r: &ChangeRecord, pack: &[u8]) -> Result<Option<String>, SourceError> {
        if !is_commit_id(&r.commit) || !is_commit_id(&r.base) {
            return Ok(Some(format!(
                "it names no commit ({:?} on {:?})",
                r.commit.chars().take(80).collect::<String>(),
                r.base.chars().take(80).collect::<String>()
            )));
        }
        match self.ensure(&r.base).await {
            Ok(()) => {}
            Err(SourceError::NoCommit { .. } | SourceError::NotACommit(_)) => {
                return Ok(Some(format!(
                    "it starts from commit {}, which is not in this run's source",
                    r.base
                )));
            }
            Err(e) => return Err(e),
        }
        // Indexed beside the cache, never into it, until it passes.
        let quarantine = tempfile::Builder::new()
            .prefix("quarantine-")
            .tempdir_in(&self.bare)
            .map_err(SourceError::Cache)?;
        let objects = quarantine.path().join("objects");
        std::fs::create_dir_all(objects.join("pack")).map_err(SourceError::Cache)?;
        let file = quarantine.path().join("incoming.pack");
        std::fs::write(&file, pack).map_err(SourceError::Cache)?;
        let own = self.bare.join("objects");
        let env = [
            ("GIT_OBJECT_DIRECTORY", objects.as_os_str()),
            ("GIT_ALTERNATE_OBJECT_DIRECTORIES", own.as_os_str()),
        ];
        let out = Command::new("git")
            .arg("-C")
            .arg(&self.bare)
            .args(["index-pack", crate::vet::CHANGE_FSCK, "--stdin"])
            .envs(env)
            .stdin(std::fs::File::open(&file).map_err(SourceError::Cache)?)
            .output()
            .await
            .map_err(SourceError::NoGit)?;
        if !out.status.success() {
            return Ok(Some(format!(
                "git's fsck refused its objects: {}",
                crate::vet::first_error(&out.stderr)
            )));
        }
        let has = Command::new("git")
            .arg("-C")
            .arg(&self.bare)
            .args(["cat-file", "-e", &format!("{}^{{commit}}", r.commit)])
            .envs(env)
            .output()
            .await
            .map_err(SourceError::NoGit)?;
        if !has.status.success() {
            return Ok(Some(format!("its objects do not hold commit {}", r.commit)));
        }
        let env: Vec<(&str, &std::ffi::OsStr)> = env.to_vec();
        match crate::vet::new_trees(&self.bare, &env, &r.commit, &[&r.base]).await {
            Ok(Some(why)) => return Ok(Some(format!("its commit adds {why}"))),
            Ok(None) => {}
            Err(stderr) => {
                return Err(SourceError::Git {
                    args: format!("rev-list {}", r.commit),
                    stderr: stderr.into(),
                });
            }
        }
        // Passed: its pack joins the cache (its index last, which is what git looks for).
        let mut files: Vec<PathBuf> = std::fs::read_dir(objects.join("pack"))
            .map_err(SourceError::Cache)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        files.sort_by_key(|p| p.extension().is_some_and(|e| e == "idx"));
        let into = own.join("pack");
        std::fs::create_dir_all(&into).map_err(SourceError::Cache)?;
        for f in files {
            if let Some(name) = f.file_name() {
                std::fs::rename(&f, into.join(name)).map_err(SourceError::Cache)?;
            }
        }
        Ok(None)
    }

    /// Makes `commit` present in the cache, from the store's packs. Keepers of runs of the
    /// same repository and the session page's diffs share the cache: one fills it at a time.
    async fn ensure(&self, commit: &str) -> Result<(), SourceError> {
        let lock = {
            static CACHES: std::sync::Mutex<
                std::collections::BTreeMap<PathBuf, std::sync::Arc<tokio::sync::Mutex<()>>>,
            > = std::sync::Mutex::new(std::collections::BTreeMap::new());
            CACHES
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .entry(self.bare.clone())
                .or_default()
                .clone()
        };
        let _filling = lock.lock().await;
        if !self.bare.join("HEAD").exists() {
            std::fs::create_dir_all(&self.bare).map_err(SourceError::Cache)?;
            ok(&self.bare, &["init", "--bare", "-q"], &[]).await?;
        }
        if ok(
            &self.bare,
            &["cat-file", "-e", &format!("{commit}^{{commit}}")],
            &[],
        )
        .await
        .is_ok()
        {
            return Ok(());
        }
        for (pack, tip) in crate::source::chain(&self.store, &self.repo, commit).await? {
            let key = self.repo.pack(&pack);
            // Streamed to a file of its own (a pack can be gigabytes), then indexed.
            let tmp = tempfile::Builder::new()
                .prefix("incoming-")
                .suffix(".pack")
                .tempfile_in(&self.bare)
                .map_err(SourceError::Cache)?;
            let got = match self.store.inner.get(&key).await {
                Ok(got) => got,
                Err(object_store::Error::NotFound { .. }) => {
                    return Err(SourceError::MissingPack(pack));
                }
                Err(source) => return Err(SourceError::ReadPack { pack, source }),
            };
            {
                use futures::StreamExt;
                use std::io::Write;
                let mut out = tmp.as_file();
                let mut stream = got.into_stream();
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.map_err(|source| SourceError::ReadPack {
                        pack: pack.clone(),
                        source,
                    })?;
                    out.write_all(&chunk).map_err(SourceError::Cache)?;
                }
            }
            let file = tmp.reopen().map_err(SourceError::Cache)?;
            let out = Command::new("git")
                .arg("-C")
                .arg(&self.bare)
                .args(["index-pack", crate::vet::SOURCE_FSCK, "--stdin"])
                .stdin(file)
                .output()
                .await
                .map_err(SourceError::NoGit)?;
            drop(tmp);
            if !out.status.success() {
                return Err(SourceError::Git {
                    args: format!("index-pack (source pack {pack})"),
                    stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
                });
            }
            let _ = ok(
                &self.bare,
                &["update-ref", &format!("refs/flotilla/{tip}"), &tip],
                &[],
            )
            .await;
        }
        Ok(())
    }
}

/// Longest diff a page shows.
pub const MAX_DIFF_BYTES: usize = 512 << 10;

/// The diff from `base` to `commit` of source `repo`, with the objects read from the store
/// into the cache at `cache` (cut at [`MAX_DIFF_BYTES`], with a note).
pub async fn diff(
    store: &Store,
    repo: &Repo,
    base: &str,
    commit: &str,
    cache: &Path,
) -> Result<String, SourceError> {
    let keeper = Keeper::new(store.clone(), repo.clone(), cache);
    keeper.ensure(base).await?;
    keeper.ensure(commit).await?;
    let mut text = ok(&keeper.bare, &["diff", "--stat", "-p", base, commit], &[]).await?;
    if text.len() > MAX_DIFF_BYTES {
        let mut end = MAX_DIFF_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("\n… (cut here; `flotilla changes RUN --diff` shows it all)");
    }
    Ok(text)
}

/// `commit` and what it adds over `not`, as one pack.
async fn pack_objects(repo: &Path, commit: &str, not: &[&str]) -> Result<Vec<u8>, SourceError> {
    let mut child = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["pack-objects", "--revs", "--stdout", "-q"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(SourceError::NoGit)?;
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt;
        let mut revs = format!("{commit}\n");
        for n in not {
            revs.push_str(&format!("^{n}\n"));
        }
        stdin
            .write_all(revs.as_bytes())
            .await
            .map_err(|e| SourceError::Git {
                args: "pack-objects".into(),
                stderr: e.to_string(),
            })?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| SourceError::Git {
            args: "pack-objects".into(),
            stderr: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(SourceError::Git {
            args: "pack-objects".into(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(out.stdout)
}

pub use flotilla_proto::wire::{AgentChange, RunChanges};

/// Reads a run's changes from its manifest and journal (journal order is apply order).
pub async fn changes_of(store: &Store, run: &str) -> Result<RunChanges, crate::store::Error> {
    let key = crate::store::keys::manifest(run);
    let body = store
        .get(&key)
        .await?
        .ok_or_else(|| crate::store::Error::NotFound {
            what: format!("run {run}"),
            url: store.url.clone(),
        })?;
    let manifest: crate::store::records::Manifest =
        serde_json::from_slice(&body).map_err(|e| crate::store::Error::Corrupt {
            key: key.to_string(),
            reason: e.to_string(),
        })?;
    let source = manifest.settings.source.clone();
    let mut head = source.as_ref().map(|s| s.commit.clone());
    let mut changes = Vec::new();
    for c in crate::store::journal::read_calls(store, run).await? {
        let Some(change) = c.change else { continue };
        if let Some(h) = &change.head_after {
            head = Some(h.clone());
        }
        changes.push(AgentChange {
            index: c.index,
            label: c.label,
            change,
        });
    }
    changes.sort_by_key(|c| c.index);
    Ok(RunChanges {
        run_id: run.to_owned(),
        namespace: crate::namespace::effective(&manifest.settings.namespace).to_owned(),
        source,
        head,
        changes,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::process::Stdio;

    fn git_in(dir: &Path, args: &[&str], input: Option<&[u8]>) -> String {
        use std::io::Write;
        let mut child = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@t")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@t")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.unwrap_or_default()).unwrap();
        drop(stdin);
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// A commit on `base` of `dir` that adds a file at `path` (components joined by `/`, each
    /// written into its tree as it is: `..`, `.git`, backslashes and all).
    fn commit_adding(dir: &Path, base: &str, path: &str) -> String {
        let blob = git_in(
            dir,
            &["hash-object", "-w", "--stdin"],
            Some(b"#!/bin/sh\necho pwned\n"),
        );
        let parts: Vec<&str> = path.split('/').collect();
        let (file, dirs) = parts.split_last().unwrap();
        let mut entry = format!("100755 blob {blob}\t{file}\n");
        for d in dirs.iter().rev() {
            let tree = git_in(dir, &["mktree"], Some(entry.as_bytes()));
            entry = format!("040000 tree {tree}\t{d}\n");
        }
        let mut top = git_in(dir, &["ls-tree", base], None);
        top.push('\n');
        top.push_str(&entry);
        let tree = git_in(dir, &["mktree"], Some(top.as_bytes()));
        git_in(dir, &["commit-tree", &tree, "-p", base, "-m", path], None)
    }

    fn pack_of(dir: &Path, commit: &str, not: &str) -> Vec<u8> {
        let revs = format!("{commit}\n^{not}\n");
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(["pack-objects", "--revs", "--stdout", "-q"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(revs.as_bytes())?;
                c.wait_with_output()
            })
            .unwrap();
        assert!(out.status.success());
        out.stdout
    }

    fn change(commit: &str, base: &str) -> ChangeRecord {
        ChangeRecord {
            commit: commit.into(),
            base: base.into(),
            files: Vec::new(),
            insertions: 0,
            deletions: 0,
            head_after: None,
            conflicts: Vec::new(),
            isolated: false,
            refused: None,
        }
    }

    /// An agent's change whose trees hold names that leave the tree or reach `.git` (git's
    /// own fsck catches some, the name check the rest), whose pack leaves out objects, or
    /// that starts from a commit of no source of the run's, is refused with the reason: not
    /// stored, not in the head, not in the cache. A plain change after them goes in.
    #[tokio::test]
    async fn a_hostile_change_is_refused_with_its_reason_and_a_plain_one_goes_in() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        git_in(&src, &["init", "-q", "-b", "main"], None);
        std::fs::write(src.join("a.txt"), "one\n").unwrap();
        git_in(&src, &["add", "."], None);
        git_in(&src, &["commit", "-q", "-m", "one"], None);
        let base = git_in(&src, &["rev-parse", "HEAD"], None);
        let store = crate::store::open("memory://").unwrap();
        let repo = Repo::new("team-a", "r1").unwrap();
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(&src)
            .args(["pack-objects", "--revs", "--stdout", "-q", "--all"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        crate::source::put_pack(&store, &repo, &base, vec![], out.stdout)
            .await
            .unwrap();
        let cache = tmp.path().join("cache");
        let (done_tx, mut done) = mpsc::unbounded_channel();
        let (tx, head) = spawn(
            store.clone(),
            repo.clone(),
            base.clone(),
            cache,
            done_tx,
            &tokio_util::task::TaskTracker::new(),
        );
        let mut hostile: Vec<(String, Vec<u8>, &str)> = Vec::new();
        for (path, why) in [
            (".git/hooks/pre-commit", "fsck"),
            (".GIT/config", "fsck"),
            ("git~1/hooks/post-checkout", "fsck"),
            ("..", "fsck"),
            ("../outside", "fsck"),
            ("deep/./x", "fsck"),
            ("deep/er/.git/config", "fsck"),
            ("a\\b", "backslash"),
            ("..\\..\\evil", "backslash"),
            ("ok/a\\b/c", "backslash"),
        ] {
            let commit = commit_adding(&src, &base, path);
            hostile.push((commit.clone(), pack_of(&src, &commit, &base), why));
        }
        // A pack that leaves out the blob its tree needs.
        let blob = git_in(&src, &["hash-object", "-w", "--stdin"], Some(b"not sent"));
        let top = format!(
            "{}\n100644 blob {blob}\tmissing.txt\n",
            git_in(&src, &["ls-tree", &base], None)
        );
        let tree = git_in(&src, &["mktree"], Some(top.as_bytes()));
        let lacking = git_in(
            &src,
            &["commit-tree", &tree, "-p", &base, "-m", "lacking"],
            None,
        );
        let mut pack = Vec::new();
        {
            let revs = format!("{lacking}\n{tree}\n");
            let out = std::process::Command::new("git")
                .arg("-C")
                .arg(&src)
                .args(["pack-objects", "--stdout", "-q"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .and_then(|mut c| {
                    use std::io::Write;
                    c.stdin.take().unwrap().write_all(revs.as_bytes())?;
                    c.wait_with_output()
                })
                .unwrap();
            pack.extend(out.stdout);
        }
        hostile.push((lacking, pack, "fsck"));
        // A change on a commit this namespace never uploaded.
        let other = tmp.path().join("other");
        std::fs::create_dir_all(&other).unwrap();
        git_in(&other, &["init", "-q"], None);
        std::fs::write(other.join("b.txt"), "b\n").unwrap();
        git_in(&other, &["add", "."], None);
        git_in(&other, &["commit", "-q", "-m", "other"], None);
        let other_base = git_in(&other, &["rev-parse", "HEAD"], None);
        std::fs::write(other.join("c.txt"), "c\n").unwrap();
        git_in(&other, &["add", "."], None);
        git_in(&other, &["commit", "-q", "-m", "c"], None);
        let elsewhere = git_in(&other, &["rev-parse", "HEAD"], None);
        let elsewhere_pack = pack_of(&other, &elsewhere, &other_base);
        for (i, (commit, pack, why)) in hostile.iter().enumerate() {
            tx.send(Apply {
                call: i as u64,
                label: format!("hostile {i}"),
                record: change(commit, &base),
                pack: Some(pack.clone()),
            })
            .unwrap();
            let got = done.recv().await.unwrap().result.unwrap();
            let reason = got.refused.clone().unwrap_or_default();
            let expected = if *why == "fsck" { "fsck" } else { "backslash" };
            assert!(reason.contains(expected), "#{i} {commit}: {got:?}");
            assert_eq!(got.head_after, None);
            assert!(
                crate::source::chain(&store, &repo, commit).await.is_err(),
                "#{i} is not stored"
            );
        }
        tx.send(Apply {
            call: 90,
            label: "elsewhere".into(),
            record: change(&elsewhere, &other_base),
            pack: Some(elsewhere_pack),
        })
        .unwrap();
        let got = done.recv().await.unwrap().result.unwrap();
        assert!(
            got.refused
                .as_deref()
                .unwrap_or_default()
                .contains("not in this run's source"),
            "{got:?}"
        );
        assert_eq!(*head.borrow(), base, "the head never moved");
        // A journaled refusal served again stays refused, and is not applied.
        tx.send(Apply {
            call: 91,
            label: "served".into(),
            record: got.clone(),
            pack: None,
        })
        .unwrap();
        let again = done.recv().await.unwrap().result.unwrap();
        assert_eq!((again.refused, again.head_after), (got.refused, None));
        // A plain change fast-forwards the head, and is stored under the run's namespace.
        let plain = commit_adding(&src, &base, "notes/fine.txt");
        tx.send(Apply {
            call: 92,
            label: "plain".into(),
            record: change(&plain, &base),
            pack: Some(pack_of(&src, &plain, &base)),
        })
        .unwrap();
        let got = done.recv().await.unwrap().result.unwrap();
        assert_eq!((got.refused, got.head_after), (None, Some(plain.clone())));
        assert_eq!(*head.borrow(), plain);
        assert!(crate::source::complete(&store, &repo, &plain).await.is_ok());
        let elsewhere_ns = Repo::new("team-b", "r1").unwrap();
        assert!(
            crate::source::chain(&store, &elsewhere_ns, &plain)
                .await
                .is_err()
        );
    }
}
