//! `flotilla bench source`: what sending a run's code costs, against git doing the same alone.
//!
//! On a generated repository (`--files` files, about `--mb` MB of history over `--commits`
//! commits), in one process, each figure against its baseline:
//! - **first upload**: snapshot + pack of the whole history + storing it the way the
//!   coordinator does, against `git bundle create --all`;
//! - **relaunch after a one-file change**: the bytes sent, against the whole repository's pack;
//! - **warm checkout**: a call's checkout from a worker's cache (`Worktree::detached`, then
//!   discarded), against a plain `git worktree add` and remove;
//! - **cold first attempt**: a new cache from the pack plus the checkout, against
//!   `git clone --no-local`;
//! - **view ready**: a call's copy-on-write checkout (`Worktree::over` on the commit's shared
//!   tree) until a process started in it has read a file, against `git worktree add` (the
//!   shared tree itself is made once per commit, and reported);
//! - **one-file edit**: the disk (blocks) an attempt that appends to one file takes beyond the
//!   shared tree;
//! - **at once**: `--attempts` views made together, each with a process that edits one file
//!   and stays: until all are ready, and the disk they take in all;
//! - **change read**: the worker reading a one-file edit as a change once the agent is done
//!   (`source::change_of`: commit and pack) in a view, where git looks only at what the agent
//!   wrote, against a full checkout of the same commit (its index fresh).
//!
//! Times are medians over `--rounds`; ratios are this over the baseline.

use flotilla_proto::Problem;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use clap::Args;
use serde::Serialize;

#[derive(Debug, Args)]
pub struct SourceArgs {
    /// Files in the generated repository.
    #[arg(long, default_value_t = 20_000)]
    files: usize,
    /// About how much history to generate, in MB (spread over --commits commits).
    #[arg(long, default_value_t = 100)]
    mb: usize,
    #[arg(long, default_value_t = 5)]
    commits: usize,
    /// Measured rounds of each (the median is reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Views made and held at once for the last figure (0: not measured).
    #[arg(long, default_value_t = 1000)]
    attempts: usize,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    files: usize,
    history_bytes: u64,
    pack_bytes: u64,
    first_upload_ms: f64,
    bundle_ms: f64,
    first_upload_ratio: f64,
    relaunch_bytes: u64,
    relaunch_fraction: f64,
    warm_checkout_ms: f64,
    worktree_add_ms: f64,
    warm_checkout_ratio: f64,
    cold_attempt_ms: f64,
    clone_ms: f64,
    cold_attempt_ratio: f64,
    #[serde(flatten)]
    views: Option<Views>,
}

/// The copy-on-write checkout's figures (none where overlayfs is refused).
#[derive(Debug, Serialize)]
struct Views {
    /// The shared tree of the commit, made once per worker.
    tree_ms: f64,
    tree_bytes: u64,
    view_ready_ms: f64,
    /// `git worktree add` over view ready.
    view_speedup: f64,
    edit_disk_bytes: u64,
    /// A one-file edit read as a change, in a view and in a full checkout.
    change_ms: f64,
    change_checkout_ms: f64,
    /// The full checkout's over the view's.
    change_speedup: f64,
    at_once: usize,
    at_once_ms: f64,
    at_once_disk_bytes: u64,
}

fn sh(dir: &Path, args: &[&str]) -> Result<String, Problem> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_AUTHOR_NAME", "bench")
        .env("GIT_AUTHOR_EMAIL", "bench@localhost")
        .env("GIT_COMMITTER_NAME", "bench")
        .env("GIT_COMMITTER_EMAIL", "bench@localhost")
        .output()
        .map_err(|e| Problem::internal(e.to_string()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(Problem::internal(format!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// Files of pseudo-random text, changed in part by each later commit.
pub(crate) fn generate(
    dir: &Path,
    files: usize,
    mb: usize,
    commits: usize,
) -> Result<u64, Problem> {
    sh(dir, &["init", "-q", "-b", "main"])?;
    // The first commit writes every file, each later one a fifth of them: about `mb` in all.
    let writes = files.max(1) + (commits.max(1) - 1) * (files / 5);
    let per_file = (mb << 20) / writes.max(1);
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut total = 0u64;
    for c in 0..commits.max(1) {
        let changed = if c == 0 { files } else { files / 5 };
        for i in 0..changed {
            let f = if c == 0 { i } else { (i * 7 + c * 13) % files };
            let path = dir.join(format!("d{:03}/f{f:05}.txt", f / 100));
            if let Some(p) = path.parent() {
                std::fs::create_dir_all(p).map_err(|e| Problem::internal(e.to_string()))?;
            }
            let mut body = String::with_capacity(per_file + 32);
            while body.len() < per_file.max(16) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                body.push_str(&format!("{x:016x}\n"));
            }
            total += body.len() as u64;
            std::fs::write(&path, body).map_err(|e| Problem::internal(e.to_string()))?;
        }
        sh(dir, &["add", "-A"])?;
        sh(dir, &["commit", "-q", "-m", &format!("commit {c}")])?;
    }
    Ok(total)
}

async fn measure(a: &SourceArgs) -> Result<Report, Problem> {
    let tmp = tempfile::tempdir().map_err(|e| Problem::internal(e.to_string()))?;
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(&repo).map_err(|e| Problem::internal(e.to_string()))?;
    let history = generate(&repo, a.files, a.mb, a.commits)?;
    let rounds = a.rounds.max(1);
    let store_url = format!("file://{}", tmp.path().join("store").display());
    let store = flotilla_coordinator::store::open(&store_url)
        .map_err(|e| Problem::internal(e.to_string()))?;

    // First upload against a bundle of everything.
    let (mut up, mut bundle) = (Vec::new(), Vec::new());
    let mut pack_bytes = 0;
    let mut snap = None;
    for r in 0..rounds {
        let t = Instant::now();
        let s = crate::source::snapshot(&repo)?
            .ok_or(Problem::internal("the generated repository is not one"))?;
        let (pack, bytes) = crate::source::build_pack(&s, &[])?;
        let data = std::fs::read(pack.path()).map_err(|e| Problem::internal(e.to_string()))?;
        let stored = flotilla_coordinator::source::Repo::new("", &format!("{}-{r}", s.repo))
            .map_err(|e| Problem::internal(e.to_string()))?;
        flotilla_coordinator::source::put_pack(&store, &stored, &s.commit, vec![], data)
            .await
            .map_err(|e| Problem::internal(e.to_string()))?;
        up.push(ms(t));
        pack_bytes = bytes;
        snap = Some(s);
        let out = tmp.path().join(format!("all-{r}.bundle"));
        let t = Instant::now();
        sh(
            &repo,
            &["bundle", "create", "-q", &out.to_string_lossy(), "--all"],
        )?;
        bundle.push(ms(t));
    }
    let snap = snap.ok_or(Problem::internal("no rounds"))?;

    // A relaunch after one file changed.
    let first = sh(&repo, &["ls-files"])?
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned();
    std::fs::write(repo.join(&first), "changed\n").map_err(|e| Problem::internal(e.to_string()))?;
    let s2 = crate::source::snapshot(&repo)?
        .ok_or(Problem::internal("the generated repository is not one"))?;
    let (_, relaunch_bytes) = crate::source::build_pack(&s2, std::slice::from_ref(&snap.commit))?;
    sh(&repo, &["checkout", "-q", "--", &first])?;

    // A warm worker's cache: the whole pack indexed once.
    let bare = tmp.path().join("cache.git");
    sh(
        tmp.path(),
        &["init", "--bare", "-q", &bare.to_string_lossy()],
    )?;
    let (pack, _) = crate::source::build_pack(&snap, &[])?;
    index_pack(&bare, pack.path())?;
    let (warm, add) = warm_rounds(tmp.path(), &bare, &snap.commit, rounds).await?;

    // A cold worker: a new cache from the pack, then the checkout; against a clone.
    let (mut cold, mut clone) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let cache = tmp.path().join(format!("cold-{r}.git"));
        let t = Instant::now();
        sh(
            tmp.path(),
            &["init", "--bare", "-q", &cache.to_string_lossy()],
        )?;
        index_pack(&cache, pack.path())?;
        let dir = tmp.path().join(format!("cold-wt-{r}"));
        flotilla_worker::worktree::Worktree::detached(&cache, &dir, &snap.commit).await?;
        cold.push(ms(t));
        let dir = tmp.path().join(format!("clone-{r}"));
        let t = Instant::now();
        let out = Command::new("git")
            .args(["clone", "-q", "--no-local"])
            .arg(&repo)
            .arg(&dir)
            .output()
            .map_err(|e| Problem::internal(e.to_string()))?;
        if !out.status.success() {
            return Err(Problem::internal(
                String::from_utf8_lossy(&out.stderr).into_owned(),
            ));
        }
        clone.push(ms(t));
    }
    let (up, bundle) = (median(up), median(bundle));
    let (cold, clone) = (median(cold), median(clone));
    let views = match std::env::current_exe()
        .map_err(|e| Problem::internal(e.to_string()))
        .and_then(|bin| flotilla_worker::layers::Layers::probe(&bin, tmp.path()))
    {
        Ok(layers) => Some(views(a, &layers, tmp.path(), &bare, &snap.commit, add).await?),
        Err(e) => {
            eprintln!("no view figures: {e}");
            None
        }
    };
    Ok(Report {
        files: a.files,
        history_bytes: history,
        pack_bytes,
        first_upload_ms: up,
        bundle_ms: bundle,
        first_upload_ratio: up / bundle,
        relaunch_bytes,
        relaunch_fraction: relaunch_bytes as f64 / pack_bytes.max(1) as f64,
        warm_checkout_ms: warm,
        worktree_add_ms: add,
        warm_checkout_ratio: warm / add,
        cold_attempt_ms: cold,
        clone_ms: clone,
        cold_attempt_ratio: cold / clone,
        views,
    })
}

/// Bytes the files and directories under `dir` take on disk (their blocks), never through a
/// link.
fn blocks(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut todo = vec![dir.to_owned()];
    while let Some(p) = todo.pop() {
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        total += m.blocks() * 512;
        if m.is_dir()
            && let Ok(d) = std::fs::read_dir(&p)
        {
            todo.extend(d.flatten().map(|e| e.path()));
        }
    }
    total
}

/// A process in `wt`'s view running `sh -c script` (standard output piped).
fn in_view(wt: &flotilla_worker::worktree::Worktree, script: &str) -> tokio::process::Command {
    let view = wt.view().map(|v| v.prefix(None)).unwrap_or_default();
    let mut c = tokio::process::Command::new(&view[0]);
    c.args(&view[1..])
        .args(["sh", "-c", script])
        .current_dir(&wt.path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    c
}

/// The view figures (see the module's head): `add` is `git worktree add`'s median.
async fn views(
    a: &SourceArgs,
    layers: &flotilla_worker::layers::Layers,
    tmp: &Path,
    bare: &Path,
    commit: &str,
    add: f64,
) -> Result<Views, Problem> {
    use flotilla_worker::worktree::Worktree;
    let failed = |e: std::io::Error| Problem::internal(e.to_string());
    let tree = tmp.join("trees").join(commit);
    std::fs::create_dir_all(tmp.join("trees")).map_err(failed)?;
    let t = Instant::now();
    flotilla_worker::source::make_tree(bare, &tree, commit).await?;
    let tree_ms = ms(t);
    let file = "d000/f00000.txt";
    let views = tmp.join("views");
    let mut ready = Vec::new();
    for r in 0..a.rounds.max(1) {
        let t = Instant::now();
        let wt = Worktree::over(
            bare,
            layers.view(&tree, &views.join(format!("r{r}"))),
            commit,
        )?;
        let out = in_view(&wt, &format!("cat {file} > /dev/null"))
            .output()
            .await
            .map_err(failed)?;
        ready.push(ms(t));
        if !out.status.success() {
            return Err(Problem::internal(format!(
                "a view could not be read: {out:?}"
            )));
        }
        wt.discard().await;
    }
    let view_ready_ms = median(ready);
    // One attempt that edits one file.
    let wt = Worktree::over(bare, layers.view(&tree, &views.join("edit")), commit)?;
    in_view(&wt, &format!("echo edited >> {file}"))
        .output()
        .await
        .map_err(failed)?;
    let v = wt.view().ok_or(Problem::internal("not a view"))?;
    let edit_disk_bytes = blocks(&v.upper) + blocks(&v.work) + blocks(&v.at);
    wt.discard().await;
    let (change_ms, change_checkout_ms) = change_rounds(a, layers, tmp, bare, commit).await?;
    // Many at once, each holding its edit.
    let t = Instant::now();
    let mut held = Vec::new();
    let mut made = Vec::new();
    for i in 0..a.attempts {
        let wt = Worktree::over(
            bare,
            layers.view(&tree, &views.join(format!("many-{i}"))),
            commit,
        )?;
        let child = in_view(
            &wt,
            &format!("echo edited >> {file} && echo ready && exec sleep 3600"),
        )
        .spawn()
        .map_err(failed)?;
        held.push(child);
        made.push(wt);
    }
    for child in &mut held {
        use tokio::io::AsyncBufReadExt;
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            tokio::io::BufReader::new(out)
                .read_line(&mut line)
                .await
                .map_err(failed)?;
        }
        if line.trim() != "ready" {
            return Err(Problem::internal("a view held at once never got ready"));
        }
    }
    let at_once_ms = ms(t);
    let at_once_disk_bytes = made
        .iter()
        .filter_map(|wt| wt.view())
        .map(|v| blocks(&v.upper) + blocks(&v.work) + blocks(&v.at))
        .sum();
    for mut child in held {
        let _ = child.kill().await;
    }
    for wt in made {
        wt.discard().await;
    }
    Ok(Views {
        tree_ms,
        tree_bytes: blocks(&tree),
        view_ready_ms,
        view_speedup: add / view_ready_ms,
        edit_disk_bytes,
        change_ms,
        change_checkout_ms,
        change_speedup: change_checkout_ms / change_ms,
        at_once: a.attempts,
        at_once_ms,
        at_once_disk_bytes,
    })
}

/// Medians of the time the worker takes to read a one-file edit as a change: in a view of the
/// commit's shared tree (at `tmp/trees/COMMIT`), and in a full checkout of it.
async fn change_rounds(
    a: &SourceArgs,
    layers: &flotilla_worker::layers::Layers,
    tmp: &Path,
    bare: &Path,
    commit: &str,
) -> Result<(f64, f64), Problem> {
    use flotilla_worker::worktree::Worktree;
    let failed = |e: std::io::Error| Problem::internal(e.to_string());
    let file = "d000/f00000.txt";
    let tree = tmp.join("trees").join(commit);
    let spec = flotilla_proto::v1::TaskSpec::default();
    let (mut viewed, mut checked_out) = (Vec::new(), Vec::new());
    for r in 0..a.rounds.max(1) {
        let wt = Worktree::over(
            bare,
            layers.view(&tree, &tmp.join("views").join(format!("change-{r}"))),
            commit,
        )?;
        in_view(&wt, &format!("echo edited >> {file}"))
            .output()
            .await
            .map_err(failed)?;
        let t = Instant::now();
        let change = flotilla_worker::source::change_of(&wt, &spec, ("wf_bench", 0), 1 << 30)
            .await
            .map_err(|e| Problem::internal(e.message))?;
        viewed.push(ms(t));
        wt.discard().await;
        let full = Worktree::detached(bare, &tmp.join(format!("change-wt-{r}")), commit).await?;
        // Its index written once the second of the checkout is over, as the worker's trees
        // are: git trusts what it recorded of every file.
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        full.git(&["update-index", "-q", "--refresh"]).await?;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(full.path.join(file))
            .map_err(failed)?;
        std::io::Write::write_all(&mut f, b"edited\n").map_err(failed)?;
        let t = Instant::now();
        let baseline = flotilla_worker::source::change_of(&full, &spec, ("wf_bench", 0), 1 << 30)
            .await
            .map_err(|e| Problem::internal(e.message))?;
        checked_out.push(ms(t));
        full.discard().await;
        let files = |c: &Option<flotilla_proto::v1::Change>| c.as_ref().map(|c| c.files.clone());
        if files(&change) != Some(vec![file.to_owned()]) || files(&change) != files(&baseline) {
            return Err(Problem::internal(format!(
                "the one-file edit was read as {:?} in a view and {:?} in a checkout",
                files(&change),
                files(&baseline)
            )));
        }
    }
    Ok((median(viewed), median(checked_out)))
}

pub async fn run(a: SourceArgs) -> i32 {
    match measure(&a).await {
        Ok(r) if a.json => {
            println!("{}", serde_json::to_string(&r).unwrap_or_default());
            0
        }
        Ok(r) => {
            println!(
                "source of {} files ({} MB of history, a {} MB pack):\n  first upload        {:>8.0} ms vs git bundle create --all {:>8.0} ms  ({:.2}x)\n  relaunch, one file  {:>8} bytes = {:.4}% of the repository\n  warm checkout       {:>8.1} ms vs git worktree add        {:>8.1} ms  ({:.2}x)\n  cold first attempt  {:>8.0} ms vs git clone --no-local    {:>8.0} ms  ({:.2}x)",
                r.files,
                r.history_bytes >> 20,
                r.pack_bytes >> 20,
                r.first_upload_ms,
                r.bundle_ms,
                r.first_upload_ratio,
                r.relaunch_bytes,
                r.relaunch_fraction * 100.0,
                r.warm_checkout_ms,
                r.worktree_add_ms,
                r.warm_checkout_ratio,
                r.cold_attempt_ms,
                r.clone_ms,
                r.cold_attempt_ratio
            );
            if let Some(v) = &r.views {
                println!(
                    "  view ready          {:>8.1} ms vs git worktree add        {:>8.1} ms  ({:.0}x faster; the commit's shared tree: {:.0} ms once, {} MB)\n  one-file edit       {:>8} bytes of disk beyond the shared tree\n  change read         {:>8.1} ms vs in a full checkout       {:>8.1} ms  ({:.1}x faster)\n  {} at once          {:>8.0} ms until all ready, {} MB of disk beyond the shared tree",
                    v.view_ready_ms,
                    r.worktree_add_ms,
                    v.view_speedup,
                    v.tree_ms,
                    v.tree_bytes >> 20,
                    v.edit_disk_bytes,
                    v.change_ms,
                    v.change_checkout_ms,
                    v.change_speedup,
                    v.at_once,
                    v.at_once_ms,
                    v.at_once_disk_bytes >> 20
                );
            }
            0
        }
        Err(e) => crate::refuse(e),
    }
}

/// Indexes `pack` into the bare repository `cache` (what a worker does with a pack it got).
fn index_pack(cache: &Path, pack: &Path) -> Result<(), Problem> {
    let out = Command::new("git")
        .arg("-C")
        .arg(cache)
        .args(["index-pack", "--stdin"])
        .stdin(std::fs::File::open(pack).map_err(|e| Problem::internal(e.to_string()))?)
        .output()
        .map_err(|e| Problem::internal(e.to_string()))?;
    if !out.status.success() {
        return Err(Problem::internal(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    Ok(())
}

/// A warm worker's checkout of `commit` from `bare`, against `git worktree add` alone:
/// the medians over `rounds`, in milliseconds.
async fn warm_rounds(
    tmp: &Path,
    bare: &Path,
    commit: &str,
    rounds: usize,
) -> Result<(f64, f64), Problem> {
    let (mut warm, mut add) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let dir = tmp.join(format!("wt-{r}"));
        let t = Instant::now();
        let wt = flotilla_worker::worktree::Worktree::detached(bare, &dir, commit).await?;
        wt.discard().await;
        warm.push(ms(t));
        let dir = tmp.join(format!("plain-{r}"));
        let t = Instant::now();
        sh(
            bare,
            &[
                "worktree",
                "add",
                "-q",
                "--detach",
                &dir.to_string_lossy(),
                commit,
            ],
        )?;
        sh(
            bare,
            &["worktree", "remove", "--force", &dir.to_string_lossy()],
        )?;
        add.push(ms(t));
    }
    Ok((median(warm), median(add)))
}
