//! Workspaces at fleet scale (issue 32): a call's checkout is a copy-on-write view (overlayfs)
//! of one shared tree per (namespace, commit) on its worker, its writes in an upper directory
//! of its own. Its change arrives as a full checkout's would; a hostile agent can neither
//! write the shared tree nor see another call's writes; where overlayfs is refused, the
//! worker says so and makes full checkouts. Runs one at a time with the other cluster tests.

use std::path::{Path, PathBuf};
use std::process::Command;

use flotilla_tests::cluster::Cluster;
use flotilla_tests::{commit_all, git};

fn launch(c: &Cluster, repo: &Path, script: &Path) -> String {
    let out = c.client_in(
        repo,
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--backend",
            "exec",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    out.json()["run_id"].as_str().unwrap().to_owned()
}

/// Every kind of file a change can touch: edited, deleted, renamed, made executable, a
/// directory deleted whole, one replaced, a file and a directory that swap kinds, one taken
/// out of the index only, and an ignore rule.
fn repo_of_every_kind(dir: &Path) {
    flotilla_tests::git_repo(dir);
    for (f, body) in [
        ("edit.txt", "one\n"),
        ("gone.txt", "gone\n"),
        ("moved.txt", "moved\n"),
        ("run.sh", "echo run\n"),
        ("target.txt", "target\n"),
        ("dir/a.txt", "a\n"),
        ("dir/deeper/b.txt", "b\n"),
        ("keep/x.txt", "x\n"),
        ("swap.txt", "swap\n"),
        ("swapdir/s.txt", "s\n"),
        ("uncached.txt", "u\n"),
        (".gitignore", "*.log\n"),
    ] {
        let p = dir.join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, body).unwrap();
    }
    commit_all(dir, "every kind");
}

/// What the agent does to it (and what kind of filesystem it works on, printed).
const EDITS: &str = "echo two >> edit.txt; rm gone.txt; mv moved.txt renamed.txt; chmod +x run.sh; \
    ln -s target.txt link; mkdir -p new/deeper && echo fresh > new/deeper/file.txt; rm -rf dir; \
    rm -rf keep && mkdir keep && echo y > keep/y.txt; echo noise > build.log; \
    rm swap.txt && mkdir swap.txt && echo inner > swap.txt/inner.txt; \
    rm -rf swapdir && echo now-a-file > swapdir; git rm -q --cached uncached.txt; \
    stat -f -c %T .";

/// Runs [`EDITS`] on a cluster of one worker started with `worker_args`, applies the run's
/// change to a fresh clone of the repository, and returns the clone's tree (`git ls-tree -r`:
/// modes, kinds, ids and paths) with what the agent printed.
fn edit_and_apply(worker_args: &[&str]) -> (String, String, Cluster) {
    let mut args = vec!["--backend", "exec", "--exec-cmd", "sh"];
    args.extend_from_slice(worker_args);
    let c = Cluster::start_workers_with(1, 1, &args, Vec::new());
    let repo = c.path().join("repo");
    repo_of_every_kind(&repo);
    let script = c.path().join("edit.js");
    std::fs::write(
        &script,
        format!(
            "export const meta = {{ name: 'edit', description: 'every kind of change' }};\n\
             return await agent({EDITS:?}, {{ label: 'editor' }});"
        ),
    )
    .unwrap();
    let run = launch(&c, &repo, &script);
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["changes"]["merged"], 1, "{r}");
    let printed = r["result"].as_str().unwrap_or_default().trim().to_owned();
    let fresh = c.path().join("fresh");
    flotilla_tests::fresh_clone(&repo, &fresh);
    let applied = c.client_in(&fresh, &["apply", &run, "--merge"]);
    assert_eq!(applied.code, 0, "{applied:?}");
    (git(&fresh, &["ls-tree", "-r", "HEAD"]), printed, c)
}

fn worker_log(c: &Cluster) -> String {
    std::fs::read_to_string(c.path().join("worker-0.log")).unwrap_or_default()
}

#[test]
fn a_change_made_in_a_copy_on_write_checkout_arrives_exactly_as_a_full_checkout_s_would() {
    let (viewed, fs, c) = edit_and_apply(&["--workspaces", "overlay"]);
    // The agent worked in a view, and the worker said so at start.
    assert_eq!(fs, "overlayfs", "the agent's directory was a view");
    assert!(
        worker_log(&c).contains("workspaces: copy-on-write views (overlayfs)"),
        "{}",
        worker_log(&c)
    );
    drop(c);
    let (checked_out, fs, c) = edit_and_apply(&["--workspaces", "checkout"]);
    assert_ne!(fs, "overlayfs", "a full checkout is a directory on disk");
    assert!(
        worker_log(&c).contains("a full checkout of the run's source per call"),
        "{}",
        worker_log(&c)
    );
    assert_eq!(viewed, checked_out, "the same change, file for file");
    // And it is the change the agent made: each kind, by mode and path.
    let entries: Vec<(String, String)> = viewed
        .lines()
        .map(|l| {
            let (meta, path) = l.split_once('\t').unwrap();
            (path.to_owned(), meta.split(' ').next().unwrap().to_owned())
        })
        .collect();
    let mode = |p: &str| {
        entries
            .iter()
            .find(|(q, _)| q == p)
            .map(|(_, m)| m.as_str())
    };
    assert_eq!(mode("edit.txt"), Some("100644"));
    assert_eq!(mode("renamed.txt"), Some("100644"));
    assert_eq!(mode("run.sh"), Some("100755"), "the mode travels");
    assert_eq!(mode("link"), Some("120000"), "a symlink travels as one");
    assert_eq!(mode("new/deeper/file.txt"), Some("100644"));
    assert_eq!(mode("keep/y.txt"), Some("100644"));
    assert_eq!(
        mode("swap.txt/inner.txt"),
        Some("100644"),
        "a file became a directory"
    );
    assert_eq!(mode("swapdir"), Some("100644"), "a directory became a file");
    assert_eq!(
        mode("uncached.txt"),
        Some("100644"),
        "a file still there is in the change, whatever the index says"
    );
    for gone in [
        "swap.txt",
        "swapdir/s.txt",
        "gone.txt",
        "moved.txt",
        "dir/a.txt",
        "dir/deeper/b.txt",
        "keep/x.txt",
        "build.log",
    ] {
        assert_eq!(mode(gone), None, "{gone} is not in the head: {viewed}");
    }
    let fresh = c.path().join("fresh");
    assert_eq!(
        std::fs::read_to_string(fresh.join("edit.txt")).unwrap(),
        "one\ntwo\n"
    );
    assert_eq!(
        std::fs::read_link(fresh.join("link")).unwrap(),
        PathBuf::from("target.txt")
    );
}

/// The shared trees on worker 0 of `c`: every `.flotilla/trees/NAMESPACE/REPO/COMMIT`.
fn trees(c: &Cluster) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let root = c.path().join("ws-0/.flotilla/trees");
    for ns in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        for repo in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
            for commit in std::fs::read_dir(repo.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                out.push(commit.path());
            }
        }
    }
    out
}

#[test]
fn a_hostile_agent_cannot_write_the_shared_tree_nor_see_another_call_s_writes() {
    let c = Cluster::start_workers_with(
        1,
        2,
        &[
            "--backend",
            "exec",
            "--exec-cmd",
            "sh",
            "--workspaces",
            "overlay",
        ],
        Vec::new(),
    );
    let repo = c.path().join("repo");
    flotilla_tests::git_repo(&repo);
    std::fs::write(repo.join("victim.txt"), "original\n").unwrap();
    commit_all(&repo, "victim");
    // The first agent writes a secret into its checkout; the second, at the same time, looks
    // for it and for the shared tree the view is made of (its path is in the mount table),
    // and tries to write, unmount and remount its way to them.
    let probe = r#"
        me=$(pwd); lower=$(sed -n 's/.*lowerdir=\([^,]*\).*/\1/p' /proc/self/mountinfo | head -n1)
        upper=$(sed -n 's/.*upperdir=\([^,]*\).*/\1/p' /proc/self/mountinfo | head -n1)
        echo "lower:$lower"
        [ -n "$lower" ] && { ls "$lower" >/dev/null 2>&1 && echo "SEEN lower"; echo x > "$lower/victim.txt" 2>/dev/null && echo "WROTE lower"; }
        [ -n "$upper" ] && { ls "$upper" >/dev/null 2>&1 && echo "SEEN upper"; ls "$(dirname "$upper")" 2>/dev/null | grep -q upper && echo "SEEN uppers"; }
        ls "$(dirname "$me")" | grep -v "^$(basename "$me")$" && echo "SEEN siblings"
        shard=$(dirname "$me"); ls "$(dirname "$shard")" 2>/dev/null | grep -qv "^$(basename "$shard")$" && echo "SEEN shards"
        cat ../0/secret.txt ../0.upper/secret.txt ../../s00/0/secret.txt ../../s00/0.upper/secret.txt 2>/dev/null && echo "SEEN secret"
        umount "$me" 2>/dev/null && echo "UNMOUNTED"
        mount -t overlay overlay -o lowerdir=/ /mnt 2>/dev/null && echo "MOUNTED"
        mkdir -p /tmp/u /tmp/w /tmp/m
        for bin in /run/flotilla/flotilla flotilla; do
          "$bin" workspace-mount --lower "$lower" --upper /tmp/u --work /tmp/w --at /tmp/m -- ls /tmp/m 2>/dev/null && echo "MOUNTED a view"
        done
        echo hostile > victim.txt; cat victim.txt"#;
    let script = c.path().join("hostile.js");
    std::fs::write(
        &script,
        format!(
            "export const meta = {{ name: 'hostile', description: 'looks where it should not' }};\n\
             return await parallel([\n\
               () => agent('echo hidden > secret.txt; sleep 2; cat secret.txt', {{ label: 'owner' }}),\n\
               () => agent({probe:?}, {{ label: 'prober' }}),\n\
             ]);"
        ),
    )
    .unwrap();
    let run = launch(&c, &repo, &script);
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"][0], "hidden", "{r}");
    let seen = r["result"][1].as_str().unwrap_or_else(|| panic!("{r}"));
    assert!(
        seen.contains("lower:/") && seen.contains(".flotilla/trees/default/"),
        "the probe found the tree's path (and it is the namespace's own): {seen}"
    );
    for bad in ["SEEN", "WROTE", "UNMOUNTED", "MOUNTED"] {
        assert!(!seen.contains(bad), "{bad} in {seen}");
    }
    // Its own write went to its own view.
    assert!(seen.ends_with("hostile"), "{seen}");
    // The shared tree is as the worker made it.
    let made = trees(&c);
    assert_eq!(made.len(), 1, "{made:?}");
    assert_eq!(
        std::fs::read_to_string(made[0].join("victim.txt")).unwrap(),
        "original\n"
    );
    assert_eq!(git(&made[0], &["status", "--porcelain"]), "");
}

#[test]
fn where_overlayfs_is_refused_the_worker_says_so_and_makes_full_checkouts() {
    // No user namespaces for the worker (a kernel that refuses them, say): it runs in one
    // whose limit of further namespaces is 0. Then it has no sandbox either.
    let wrap: Vec<String> = [
        "unshare",
        "--user",
        "--map-root-user",
        "sh",
        "-c",
        "echo 0 > /proc/sys/user/max_user_namespaces && exec \"$@\"",
        "sh",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let mut c = Cluster::start_workers_with(
        0,
        1,
        &["--backend", "exec", "--exec-cmd", "sh", "--sandbox", "off"],
        Vec::new(),
    );
    // Asked for views outright, it does not start, and says why and what to do.
    let refused = Command::new(&wrap[0])
        .args(&wrap[1..])
        .arg(&c.bin)
        .args(["worker", "--coordinator", &c.worker_url(), "--tls-dir"])
        .arg(c.pki())
        .arg("--workspace")
        .arg(c.path().join("ws-refused"))
        .args(["--sandbox", "off", "--workspaces", "overlay"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    assert!(
        said.contains("overlayfs is refused here") && said.contains("--workspaces checkout"),
        "{said}"
    );
    c.worker_wrap = wrap;
    c.issue_worker(0);
    c.start_worker(0, 1);
    c.wait_for_workers(1);
    let log = worker_log(&c);
    assert!(
        log.contains("overlayfs is refused here") && log.contains("each call gets a full checkout"),
        "{log}"
    );
    let repo = c.path().join("repo");
    repo_of_every_kind(&repo);
    let script = c.path().join("edit.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'edit', description: 'an edit' };\n\
         return await agent('echo two >> edit.txt; rm gone.txt; stat -f -c %T .', { label: 'editor' });",
    )
    .unwrap();
    let run = launch(&c, &repo, &script);
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_ne!(
        r["result"].as_str().map(str::trim),
        Some("overlayfs"),
        "{r}"
    );
    assert_eq!(r["changes"]["merged"], 1, "{r}");
}

#[test]
fn agents_that_work_in_no_directory_cost_the_worker_no_checkout_and_no_fetch() {
    let c = Cluster::start_workers_with(1, 4, &[], Vec::new());
    let repo = c.path().join("repo");
    repo_of_every_kind(&repo);
    let script = c.path().join("echo.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'echo', description: 'echo agents from a repository' };\n\
         return (await parallel(Array.from({ length: 8 }, (_, i) => () => agent('hi ' + i)))).length;",
    )
    .unwrap();
    let out = c.client_in(
        &repo,
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--backend",
            "echo",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains("source:"),
        "the launch sent its source: {out:?}"
    );
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 8, "{r}");
    // No directory of the run, no tree, not even the source's objects: nothing asked for.
    let ws = c.path().join("ws-0");
    assert!(!ws.join(&run).exists(), "{run} made a directory");
    assert!(!ws.join(".flotilla/trees").exists());
    assert!(!ws.join(".flotilla/caches/default").exists());
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap_or_default();
    assert!(!log.contains("sent a source"), "{log}");
}
