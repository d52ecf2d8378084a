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
//! The merges happen in a bare repository in the coordinator's cache directory, filled from
//! the store's packs; new merge commits go back to the store as packs of their own, so any
//! coordinator and every worker can follow the head. The cache is only a cache.

use std::path::{Path, PathBuf};

use object_store::ObjectStoreExt;
use serde::{Deserialize, Serialize};
use tokio::process::Command;
use tokio::sync::{mpsc, watch};

use crate::source::SourceError;
use crate::store::Store;

/// What a call changed in its run's source, as journaled with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeRecord {
    /// The agent's commit, and the head it started from.
    pub commit: String,
    pub base: String,
    pub files: Vec<String>,
    pub insertions: u32,
    pub deletions: u32,
    /// The run head once this change was applied (`None`: it is not in the head).
    #[serde(default)]
    pub head_after: Option<String>,
    /// Files that conflicted with the head (the change stays on its own branch).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conflicts: Vec<String>,
    /// An isolated agent's change: on its branch only.
    #[serde(default)]
    pub isolated: bool,
}

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
/// sender; results come out on `done`; the watch follows the head.
pub fn spawn(
    store: Store,
    repo: String,
    start: String,
    cache: PathBuf,
    done: mpsc::UnboundedSender<Applied>,
) -> (mpsc::UnboundedSender<Apply>, watch::Receiver<String>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Apply>();
    let (head_tx, head_rx) = watch::channel(start);
    tokio::spawn(async move {
        let keeper = Keeper {
            store,
            repo: repo.clone(),
            bare: cache.join(format!("{repo}.git")),
        };
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
    repo: String,
    bare: PathBuf,
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
    async fn apply(&self, head: &str, a: &Apply) -> Result<ChangeRecord, SourceError> {
        let mut r = a.record.clone();
        if let Some(pack) = &a.pack {
            crate::source::put_pack(
                &self.store,
                &self.repo,
                &r.commit,
                vec![r.base.clone()],
                pack.clone(),
            )
            .await?;
        }
        r.head_after = None;
        r.conflicts.clear();
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
            let key = crate::store::keys::source_pack(&self.repo, &pack);
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
                .args(["index-pack", "--stdin"])
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
    repo: &str,
    base: &str,
    commit: &str,
    cache: &Path,
) -> Result<String, SourceError> {
    let keeper = Keeper {
        store: store.clone(),
        repo: repo.to_owned(),
        bare: cache.join(format!("{repo}.git")),
    };
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

/// A run's changes, as `flotilla changes` and `flotilla apply` read them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunChanges {
    pub run_id: String,
    pub source: Option<crate::settings::SourceRef>,
    /// The run head now: the source's commit with every merged change in.
    pub head: Option<String>,
    pub changes: Vec<AgentChange>,
}

/// One agent's change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentChange {
    pub index: u64,
    pub label: String,
    #[serde(flatten)]
    pub change: ChangeRecord,
}

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
        source,
        head,
        changes,
    })
}
