//! `flotilla changes RUN` and `flotilla apply RUN`: what a fleet run's agents changed in its
//! source, and bringing it into the local repository as branches.
//!
//! Both ask the coordinator (no storage credentials needed): `Changes` lists each agent's
//! change and the run head; `FetchSource` streams the packs of a commit's chain from the
//! run's namespace, which are indexed into the local repository (`git index-pack` with git's
//! fsck) before branches `flotilla/RUN/head` and `flotilla/RUN/INDEX` point at them. Every
//! tree a commit adds over its base is read first ([`flotilla_local::vet`]): a name that
//! leaves the tree or reaches `.git` refuses it, whatever the coordinator's store holds. A
//! change the coordinator refused is shown with its reason and never fetched. `--merge`
//! merges the head into the current branch, refusing a dirty tree or a conflict with the
//! command that resolves it.

use flotilla_proto::Problem;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;
use flotilla_proto::v1;
use flotilla_proto::wire::RunChanges;

use crate::client::{ClientArgs, rpc_fail};
use crate::fail_kind;

#[derive(Debug, Args)]
pub struct ChangesArgs {
    run_id: String,
    /// Only this agent (its index or label).
    #[arg(long)]
    agent: Option<String>,
    /// Show each change's diff (fetches the run's objects into this repository, no branches).
    #[arg(long)]
    diff: bool,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    remote: ClientArgs,
}

impl ChangesArgs {
    pub fn json(&self) -> bool {
        self.json
    }
}

#[derive(Debug, Args)]
pub struct ApplyArgs {
    run_id: String,
    /// Only this agent's change (its index or label) besides the head.
    #[arg(long)]
    agent: Option<String>,
    /// Merge the run head into the current branch (refused with a dirty tree).
    #[arg(long)]
    merge: bool,
    #[command(flatten)]
    remote: ClientArgs,
}

type Client = v1::client_service_client::ClientServiceClient<tonic::transport::Channel>;

fn git(dir: &Path, args: &[&str]) -> Result<String, Problem> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .map_err(|e| Problem::internal(format!("cannot run git: {e}")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim_end().to_owned())
    } else {
        Err(Problem::internal(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ))
    }
}

/// `head` with each of `submodules` (plain files in it) replaced by the link your HEAD has at
/// that path (or by nothing, where it has none), as a commit on `head`; and the submodules
/// whose files the run changed since `snapshot`.
fn relinked(
    local: &Path,
    head: &str,
    snapshot: &str,
    submodules: &[String],
) -> Result<(String, Vec<String>), Problem> {
    let tmp = tempfile::tempdir()
        .map_err(|e| Problem::internal(format!("cannot make a temporary index: {e}")))?;
    let index = tmp.path().join("index");
    let run = |args: &[&str]| -> Result<String, Problem> {
        let out = Command::new("git")
            .arg("-C")
            .arg(local)
            .args(args)
            .env("GIT_INDEX_FILE", &index)
            .env("GIT_LITERAL_PATHSPECS", "1")
            .env("GIT_TERMINAL_PROMPT", "0")
            .output()
            .map_err(|e| Problem::internal(format!("cannot run git: {e}")))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim_end().to_owned())
        } else {
            Err(Problem::internal(format!(
                "git {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
    };
    let mut touched = Vec::new();
    run(&["read-tree", head])?;
    for path in submodules {
        if !run(&["diff", "--name-only", snapshot, head, "--", path])?.is_empty() {
            touched.push(path.clone());
        }
        run(&[
            "rm",
            "--cached",
            "-r",
            "-q",
            "-f",
            "--ignore-unmatch",
            "--",
            path,
        ])?;
        let mine = run(&["ls-tree", "HEAD", "--", path])?;
        if let Some(rest) = mine.strip_prefix("160000 commit ")
            && let Some((link, _)) = rest.split_once('\t')
        {
            run(&[
                "update-index",
                "--add",
                "--cacheinfo",
                &format!("160000,{link},{path}"),
            ])?;
        }
    }
    let tree = run(&["write-tree"])?;
    let commit = run(&[
        "-c",
        "user.name=flotilla",
        "-c",
        "user.email=flotilla@localhost",
        "commit-tree",
        &tree,
        "-p",
        head,
        "-m",
        "flotilla: the run's head with your submodule links",
    ])?;
    Ok((commit, touched))
}

async fn changes_of(client: &mut Client, run: &str) -> Result<RunChanges, i32> {
    let reply = client
        .changes(v1::RunRef { run_id: run.into() })
        .await
        .map_err(|s| rpc_fail(&s))?
        .into_inner();
    serde_json::from_str(&reply.changes_json).map_err(|e| {
        fail_kind(
            flotilla_proto::ErrorKind::Unavailable,
            format!("the coordinator's answer is not readable: {e}"),
        )
    })
}

fn pick<'a>(
    c: &'a RunChanges,
    agent: Option<&str>,
) -> Result<Vec<&'a flotilla_proto::wire::AgentChange>, Problem> {
    let Some(agent) = agent else {
        return Ok(c.changes.iter().collect());
    };
    let found: Vec<_> = c
        .changes
        .iter()
        .filter(|a| a.label == agent || a.index.to_string() == agent)
        .collect();
    if found.is_empty() {
        return Err(Problem::invalid(format!(
            "no agent {agent:?} of run {} changed files",
            c.run_id
        )));
    }
    Ok(found)
}

/// The local repository the objects go into.
fn local_repo() -> Result<PathBuf, Problem> {
    let cwd = std::env::current_dir().map_err(|e| Problem::invalid(e.to_string()))?;
    git(&cwd, &["rev-parse", "--show-toplevel"])
        .map(PathBuf::from)
        .map_err(|_| {
            Problem::invalid(
                "run this inside a git repository (a clone of the run's source) to bring its changes in",
            )
        })
}

/// Fetches what `repo` lacks of `commit`'s chain through the coordinator, from the sources
/// of the run's namespace.
async fn fetch(
    client: &mut Client,
    local: &Path,
    run: &RunChanges,
    source_repo: &str,
    commit: &str,
) -> Result<u64, Problem> {
    if git(local, &["cat-file", "-e", &format!("{commit}^{{commit}}")]).is_ok() {
        return Ok(0);
    }
    let mut stream = client
        .fetch_source(v1::FetchSourceRequest {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            repo: source_repo.into(),
            commit: commit.into(),
            have_packs: Vec::new(),
            namespace: run.namespace.clone(),
        })
        .await
        .map_err(|s| crate::client::call_problem(&s).context("cannot fetch the run's objects"))?
        .into_inner();
    let tmp = tempfile::tempdir().map_err(|e| Problem::internal(e.to_string()))?;
    let mut bytes = 0u64;
    let mut current: Option<(String, std::fs::File, PathBuf)> = None;
    while let Some(d) = stream
        .message()
        .await
        .map_err(|s| crate::client::call_problem(&s))?
    {
        if !d.error.is_empty() {
            return Err(Problem::unavailable(format!(
                "the coordinator cannot send the run's objects: {}",
                d.error
            )));
        }
        if d.done {
            break;
        }
        if current.as_ref().is_none_or(|(p, ..)| *p != d.pack) {
            let path = tmp.path().join(format!("{}.pack", d.pack));
            let f =
                std::fs::File::create(&path).map_err(|e| Problem::unavailable(e.to_string()))?;
            current = Some((d.pack.clone(), f, path));
        }
        if let Some((_, f, _)) = current.as_mut() {
            use std::io::Write;
            f.write_all(&d.data)
                .map_err(|e| Problem::unavailable(e.to_string()))?;
            bytes += d.data.len() as u64;
        }
        if d.last_of_pack
            && let Some((_, f, path)) = current.take()
        {
            drop(f);
            let out = Command::new("git")
                .arg("-C")
                .arg(local)
                .args(["index-pack", flotilla_local::vet::SOURCE_FSCK, "--stdin"])
                .stdin(std::fs::File::open(&path).map_err(|e| Problem::unavailable(e.to_string()))?)
                .output()
                .map_err(|e| Problem::unavailable(e.to_string()))?;
            if !out.status.success() {
                return Err(Problem::unavailable(format!(
                    "cannot index the run's objects: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
        }
    }
    git(local, &["cat-file", "-e", &format!("{commit}^{{commit}}")]).map_err(|_| {
        Problem::unavailable(format!(
            "the coordinator's objects did not hold commit {commit}"
        ))
    })?;
    Ok(bytes)
}

/// Refuses `commit` (of `whose`) when a tree it adds over `base` holds a name that leaves the
/// tree or reaches `.git`: the coordinator refuses such changes, and this holds even if a
/// store it reads holds one.
async fn vetted(local: &Path, whose: &str, commit: &str, base: &str) -> Result<(), Problem> {
    let bases: Vec<&str> = [base]
        .into_iter()
        .filter(|b| git(local, &["cat-file", "-e", &format!("{b}^{{commit}}")]).is_ok())
        .collect();
    match flotilla_local::vet::new_trees(local, &[], commit, &bases).await {
        Ok(None) => Ok(()),
        Ok(Some(why)) => Err(Problem::denied(format!(
            "{whose} (commit {}) adds {why}: refused, nothing was applied; tell the run's owner, and do not check it out",
            &commit[..commit.len().min(12)]
        ))),
        Err(e) => Err(Problem::denied(format!(
            "cannot check commit {commit}: {e}"
        ))),
    }
}

pub async fn changes(a: ChangesArgs) -> i32 {
    let mut client = match a.remote.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    let c = match changes_of(&mut client, &a.run_id).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let picked = match pick(&c, a.agent.as_deref()) {
        Ok(p) => p,
        Err(e) => return crate::refuse(e),
    };
    if a.json {
        let mut v = serde_json::to_value(&c).unwrap_or_default();
        v["changes"] = serde_json::to_value(&picked).unwrap_or_default();
        println!("{v}");
        return 0;
    }
    let Some(src) = &c.source else {
        eprintln!(
            "run {} has no source: its agents worked in scratch directories",
            c.run_id
        );
        return 0;
    };
    println!(
        "run {}  source {}  head {}",
        c.run_id,
        crate::term::clean(&src.origin),
        c.head.as_deref().map_or("-", |h| &h[..h.len().min(12)])
    );
    let local = if a.diff {
        match local_repo() {
            Ok(l) => Some(l),
            Err(e) => return crate::refuse(e),
        }
    } else {
        None
    };
    for ch in &picked {
        let r = &ch.change;
        let status = if let Some(why) = &r.refused {
            format!("refused: {}", crate::term::clean(why))
        } else if r.isolated {
            "on its branch".to_owned()
        } else if !r.conflicts.is_empty() {
            format!("conflicted ({})", r.conflicts.join(", "))
        } else if r.head_after.is_some() {
            "in the head".to_owned()
        } else {
            "not applied".to_owned()
        };
        println!(
            "  #{:<4} {:<30} {} files +{} -{}  {status}  branch flotilla/{}/{}",
            ch.index,
            crate::term::clean(&ch.label),
            r.files.len(),
            r.insertions,
            r.deletions,
            c.run_id,
            ch.index
        );
        if let Some(local) = &local {
            if r.refused.is_some() {
                continue;
            }
            if let Err(e) = fetch(&mut client, local, &c, &src.repo, &r.commit).await {
                return crate::refuse(e);
            }
            if let Err(e) = vetted(local, &ch.label, &r.commit, &r.base).await {
                return crate::refuse(e);
            }
            match git(local, &["diff", &r.base, &r.commit]) {
                Ok(d) => println!("{}", crate::term::clean_text(&d)),
                Err(e) => return crate::refuse(e),
            }
        }
    }
    if !picked.is_empty() && !a.diff {
        eprintln!(
            "bring them in with `flotilla apply {}` (add --merge to merge the head into your branch)",
            c.run_id
        );
    }
    0
}

pub async fn apply(a: ApplyArgs) -> i32 {
    let mut client = match a.remote.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    let c = match changes_of(&mut client, &a.run_id).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let Some(src) = c.source.clone() else {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            format!("run {} has no source, so nothing to apply", c.run_id),
        );
    };
    let local = match local_repo() {
        Ok(l) => l,
        Err(e) => return crate::refuse(e),
    };
    let picked = match pick(&c, a.agent.as_deref()) {
        Ok(p) => p,
        Err(e) => return crate::refuse(e),
    };
    let head = c.head.clone().unwrap_or_else(|| src.commit.clone());
    let wanted = wanted_of(&c, &picked, &head, &src.commit);
    let mut fetched = 0u64;
    for w in &wanted {
        match fetch(&mut client, &local, &c, &src.repo, &w.commit).await {
            Ok(n) => fetched += n,
            Err(e) => return crate::refuse(e),
        }
    }
    // Nothing is pointed at, let alone merged, until every commit passes.
    for w in &wanted {
        if let Err(e) = vetted(&local, &w.whose, &w.commit, &w.base).await {
            return crate::refuse(e);
        }
    }
    for w in &wanted {
        if let Err(e) = git(&local, &["branch", "-f", &w.branch, &w.commit]) {
            return fail_kind(
                flotilla_proto::ErrorKind::Unavailable,
                format!("cannot set branch {}: {e}", w.branch),
            );
        }
        println!("{} -> {}", w.branch, &w.commit[..w.commit.len().min(12)]);
    }
    eprintln!(
        "fetched {} KiB from the coordinator",
        fetched.div_ceil(1024)
    );
    if a.merge
        && let Err(e) = merge_head(&local, &c, &src, &head)
    {
        return crate::refuse(e);
    }
    0
}

/// A branch `apply` points at a commit it fetched and vetted.
struct Wanted {
    branch: String,
    commit: String,
    /// Whose it is, as a refusal names it.
    whose: String,
    /// What it was made on (its new trees are those over this).
    base: String,
}

/// The branches `apply` sets: the run's head, and each picked agent's change that the
/// coordinator did not refuse (a refused one is said and skipped).
fn wanted_of(
    c: &RunChanges,
    picked: &[&flotilla_proto::wire::AgentChange],
    head: &str,
    base: &str,
) -> Vec<Wanted> {
    let mut wanted = vec![Wanted {
        branch: format!("flotilla/{}/head", c.run_id),
        commit: head.to_owned(),
        whose: "the run's head".to_owned(),
        base: base.to_owned(),
    }];
    for ch in picked {
        if let Some(why) = &ch.change.refused {
            eprintln!(
                "agent #{} {:?}: its change was refused by the coordinator ({}); nothing of it is applied",
                ch.index,
                crate::term::clean(&ch.label),
                crate::term::clean(why)
            );
            continue;
        }
        wanted.push(Wanted {
            branch: format!("flotilla/{}/{}", c.run_id, ch.index),
            commit: ch.change.commit.clone(),
            whose: format!("agent #{} {:?}", ch.index, crate::term::clean(&ch.label)),
            base: ch.change.base.clone(),
        });
    }
    wanted
}

/// `apply --merge`: the run's head merged into the current branch (refused with a dirty
/// tree; with submodules, the head with the user's submodule links put back).
fn merge_head(
    local: &Path,
    c: &RunChanges,
    src: &flotilla_proto::settings::SourceRef,
    head: &str,
) -> Result<(), Problem> {
    let dirty = git(local, &["status", "--porcelain", "--untracked-files=no"]).unwrap_or_default();
    if !dirty.is_empty() {
        return Err(Problem::invalid(format!(
            "your working tree has uncommitted changes; commit or stash them (`git stash`), then `flotilla apply {} --merge` again (or `git merge flotilla/{}/head`)",
            c.run_id, c.run_id
        )));
    }
    let mut branch = format!("flotilla/{}/head", c.run_id);
    if !src.submodules.is_empty() {
        // The head holds the submodules as plain files: what merges is the head with your
        // branch's submodule links put back; edits inside them stay on the head branch.
        let (commit, touched) = relinked(local, head, &src.commit, &src.submodules)?;
        if !touched.is_empty() {
            eprintln!(
                "agents changed files inside submodules {}: not merged (a submodule is its own repository); see them with `git diff {} {branch} -- {}` and apply them inside each submodule",
                touched.join(", "),
                &src.commit[..src.commit.len().min(12)],
                touched.join(" ")
            );
        }
        let linked = format!("flotilla/{}/head-linked", c.run_id);
        git(local, &["branch", "-f", &linked, &commit])
            .map_err(|e| Problem::unavailable(format!("cannot set branch {linked}: {e}")))?;
        branch = linked;
    }
    let message = format!("Merge the changes of flotilla run {}", c.run_id);
    if let Err(e) = git(local, &["merge", "--no-edit", "-m", &message, &branch]) {
        let _ = git(local, &["merge", "--abort"]);
        return Err(Problem::unavailable(format!(
            "the run's head does not merge cleanly into your branch ({e}); merge it by hand: `git merge {branch}`"
        )));
    }
    println!("merged {branch} into the current branch");
    Ok(())
}
