//! Agents work on the user's code (issue 12): in the embedded mode, where the run was started,
//! as Claude Code's agents do; worktree agents on branches of their own.

use std::path::Path;

use flotilla_tests::{Env, agent, commit_all, git, run_with_timeout};

/// A repository with a tracked file, then an uncommitted edit to it, an untracked file and
/// an ignored one; `flotilla run` is started from its `sub/` directory.
fn user_repo(env: &Env) -> std::path::PathBuf {
    let repo = env.path().join("repo");
    flotilla_tests::git_repo(&repo);
    std::fs::create_dir_all(repo.join("sub")).unwrap();
    std::fs::write(repo.join(".gitignore"), "ignored.log\n").unwrap();
    std::fs::write(repo.join("sub/tracked.txt"), "v1\n").unwrap();
    commit_all(&repo, "two");
    std::fs::write(repo.join("sub/tracked.txt"), "v2, not committed\n").unwrap();
    std::fs::write(repo.join("untracked.txt"), "new\n").unwrap();
    std::fs::write(repo.join("ignored.log"), "noise\n").unwrap();
    repo.canonicalize().unwrap()
}

/// `flotilla run` from `dir` with no `--workspace` (the harness sets one; this removes it).
fn run_in(env: &Env, dir: &Path, args: &[&str]) -> serde_json::Value {
    let mut cmd = env.command(args, &[]);
    cmd.current_dir(dir).env_remove("FLOTILLA_WORKSPACE");
    let out = run_with_timeout(cmd, flotilla_tests::COMMAND_TIMEOUT);
    assert_eq!(out.code, 0, "{out:?}");
    out.json()
}

#[test]
fn embedded_agents_work_in_the_repository_the_run_started_in() {
    let env = Env::new();
    let repo = user_repo(&env);
    let script = env.script("look", "return await agent('look around');");
    let r = run_in(
        &env,
        &repo.join("sub"),
        &[
            "run",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--backend",
            "exec",
            "--exec-cmd",
            "pwd; git status --porcelain; ls",
        ],
    );
    let seen = r["result"].as_str().unwrap();
    let mut lines = seen.lines();
    assert_eq!(
        lines.next(),
        Some(repo.to_str().unwrap()),
        "the repository root: {seen}"
    );
    assert!(
        seen.contains(" M sub/tracked.txt"),
        "the uncommitted edit: {seen}"
    );
    assert!(
        seen.contains("?? untracked.txt"),
        "the untracked file: {seen}"
    );
    assert!(seen.lines().any(|l| l == "sub"), "the tracked tree: {seen}");
    // Nothing of the run is left in the user's tree.
    let status = git(&repo, &["status", "--porcelain", "--ignored"]);
    let mut status: Vec<&str> = status.lines().collect();
    status.sort_unstable();
    assert_eq!(
        status,
        [" M sub/tracked.txt", "!! ignored.log", "?? untracked.txt"]
    );
}

#[test]
fn embedded_worktree_agents_get_branches_of_their_own_and_leave_nothing_else() {
    let env = Env::new();
    let repo = user_repo(&env);
    let script = env.script(
        "wt",
        "return await parallel([\n\
           () => agent('edit', { isolation: 'worktree', label: 'editor' }),\n\
           () => agent('look', { isolation: 'worktree', label: 'looker' }),\n\
           () => agent('plain', { label: 'in the tree' }),\n\
         ]);",
    );
    let r = run_in(
        &env,
        &repo,
        &[
            "run",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--backend",
            "exec",
            "--exec-cmd",
            "p=$(cat); if [ \"$p\" = edit ]; then echo changed >> README; fi; pwd",
        ],
    );
    let run = r["run_id"].as_str().unwrap();
    let worktrees = repo.join(".git/flotilla/worktrees").join(run);
    assert_eq!(r["result"][0], worktrees.join("0").to_str().unwrap(), "{r}");
    assert_eq!(r["result"][2], repo.to_str().unwrap(), "{r}");
    assert_eq!(agent(&r, "looker")["status"], "completed");
    // The editor's change is a commit on its branch; the looker left no branch.
    let branches = git(
        &repo,
        &[
            "branch",
            "--list",
            "flotilla/*",
            "--format=%(refname:short)",
        ],
    );
    assert_eq!(branches.trim(), format!("flotilla/{run}/0"), "{branches}");
    let diff = git(
        &repo,
        &["diff", "main", &format!("flotilla/{run}/0"), "--", "README"],
    );
    assert!(diff.contains("+changed"), "{diff}");
    assert!(!worktrees.join("1").exists());
    // The user's tree and files are as they were.
    assert_eq!(
        std::fs::read_to_string(repo.join("README")).unwrap(),
        "main checkout\n"
    );
    let status = git(&repo, &["status", "--porcelain"]);
    let mut status: Vec<&str> = status.lines().collect();
    status.sort_unstable();
    assert_eq!(status, [" M sub/tracked.txt", "?? untracked.txt"]);
}

#[test]
fn cwd_is_relative_to_the_repository_and_stays_inside_it() {
    let env = Env::new();
    let repo = user_repo(&env);
    let script = env.script(
        "cwd",
        "const here = await agent('x', { cwd: 'sub' });\n\
         let out; try { await agent('y', { cwd: '../..' }); out = 'ran'; } catch (e) { out = e.code; }\n\
         return [here, out];",
    );
    let r = run_in(
        &env,
        &repo,
        &[
            "run",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--backend",
            "exec",
            "--exec-cmd",
            "pwd",
        ],
    );
    assert_eq!(r["result"][0], repo.join("sub").to_str().unwrap(), "{r}");
    assert_eq!(r["result"][1], "INVALID_AGENT", "{r}");
}

#[test]
fn the_source_benchmark_runs_and_reports_its_figures() {
    let env = Env::new();
    let out = env.flotilla(&[
        "bench", "source", "--files", "300", "--mb", "4", "--rounds", "1", "--json",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    for k in [
        "first_upload_ratio",
        "warm_checkout_ratio",
        "cold_attempt_ratio",
    ] {
        assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {r}");
    }
    assert!(r["relaunch_fraction"].as_f64().unwrap() < 0.01, "{r}");
    assert!(r["history_bytes"].as_u64().unwrap() > 3 << 20, "{r}");
}
