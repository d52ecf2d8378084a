//! The hostile tenant (issue 28): a client of one namespace and its agents go at everything a
//! fleet shares — the worker's workspace, its source caches, its git, its disk, the model
//! gateway, the kernel under the sandbox — and get nothing of another namespace or of the
//! worker, while the fleet keeps serving. Each test names the rows of ARCHITECTURE.md's
//! trust-boundary table it holds. (Sources on the coordinator, change packs, sizes, the page
//! listener, workers and MCP have their own modules: cluster_tenant_sources, cluster_bounds,
//! cluster_workers, launch_checks, mcp.) Runs one at a time with the other cluster tests.

use std::path::{Path, PathBuf};

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::cluster::Cluster;
use flotilla_tests::{Output, commit_all, git};
use proptest::strategy::{Strategy, ValueTree};
use serde_json::Value;

/// `launch SCRIPT --json EXTRA...` as client `who`, from `dir` (its repository is the run's
/// source unless `extra` says otherwise): the run id.
fn launch(c: &Cluster, dir: &Path, who: &str, name: &str, body: &str, extra: &[&str]) -> String {
    let script = flotilla_tests::write_workflow(c.path(), name, "hostile tenant", body);
    let mut args = vec!["launch", script.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    flotilla_tests::launched_run_id(&c.client_as_in(dir, who, &args))
}

/// `wait RUN --json` as `who`: exit code and report.
fn wait(c: &Cluster, who: &str, run: &str) -> (i32, Value) {
    let out: Output = c.client_as(who, &["wait", run, "--json"]);
    (out.code, out.json())
}

/// A repository with one committed file.
fn repo(dir: &Path) {
    flotilla_tests::git_repo(dir);
    std::fs::write(dir.join("code.txt"), "code\n").unwrap();
    commit_all(dir, "code");
}

use flotilla_tests::eventually;

/// The script of a run whose agents each run `probe` with one of `cwds`, as JSON: every
/// agent's text, or `REJECTED code message` when its call is refused.
fn probes_script(probe: &str, cwds: &[String]) -> String {
    format!(
        "const cwds = {};\n\
         return await parallel(cwds.map((cwd, i) => async () => {{\n\
           try {{ return 'CWD ' + JSON.stringify(cwd) + '\\n' + await agent({}, {{ cwd, label: 'probe ' + i }}); }}\n\
           catch (e) {{ return 'REJECTED ' + JSON.stringify(cwd) + ' ' + e.code + ' ' + e.message; }}\n\
         }}));\n",
        serde_json::to_string(cwds).unwrap(),
        Value::String(probe.to_owned()),
    )
}

/// Python that makes the kernel calls a sandbox escape starts with and prints each result
/// and errno.
const SYSCALLS: &str = r#"import ctypes
l = ctypes.CDLL(None, use_errno=True)
for n, nr, a in (("mount", 165, (b"none", b"/tmp", b"tmpfs", 0, 0)), ("unshare", 272, (0x10000000,)), ("keyctl", 250, (0, 0, 0, 0)), ("bpf", 321, (0, 0, 0))):
    r = l.syscall(nr, *a)
    print("SYSCALL", n, r, ctypes.get_errno())
"#;

/// What a hostile agent tries from wherever it is put: where it is, team A's files by every
/// path it can name, the objects its checkout borrows, the worker's caches, planting a cache
/// of its own, and the kernel calls a sandbox escape starts with.
fn hostile_probe(ws: &Path, a_scratch: &Path) -> String {
    let ws = ws.display();
    let a_scratch = a_scratch.display();
    format!(
        "echo \"PWD $(pwd)\"; echo \"CALL $FLOTILLA_CALL\"; \
         ls -aR . 2>/dev/null | head -400; \
         cat {a_scratch}/note.txt 2>/dev/null; ls -a {ws} {ws}/.flotilla {ws}/.flotilla/caches {ws}/.flotilla/caches/team-a 2>/dev/null; \
         grep -rsI 'OF-TEAM-A' / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr --exclude-dir=dev 2>/dev/null | head; \
         (git cat-file --batch-all-objects --batch 2>/dev/null | grep -a 'OF-TEAM-A') ; \
         (mkdir -p .flotilla/caches/team-b/planted.git && echo '[core] gitProxy = /bin/false' > .flotilla/caches/team-b/planted.git/config) 2>/dev/null; \
         (mkdir -p {ws}/.flotilla/caches/team-b/planted.git && echo pwned > {ws}/.flotilla/caches/team-b/planted.git/config && echo PLANTED) 2>/dev/null; \
         python3 -c '{SYSCALLS}'; \
         echo END"
    )
}

/// Rows: the agent's directory (`cwd`), the worker's workspace root, the worker's source
/// caches (per namespace, never agent-writable), the sandbox's kernel surface (seccomp).
///
/// Team A works from its repository with a file it has not committed, and keeps a scratch
/// file in a run without a source; team B, on the same worker, launches from a clone of the
/// same repository (so the same repository id) and from no repository at all, with agents
/// put at every `cwd` a hostile script would try, fixed ones and ones built by proptest.
#[test]
fn a_hostile_agent_of_one_namespace_reaches_nothing_of_another_or_of_the_worker() {
    let c =
        Cluster::start_workers_with(1, 8, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    c.issue_client("alice", &["team-a"]);
    c.issue_client("bob", &["team-b"]);
    let ws = c.path().join("ws-0");
    let a_repo = c.path().join("a-repo");
    repo(&a_repo);
    std::fs::write(
        a_repo.join("draft.txt"),
        "SECRET-OF-TEAM-A, not committed\n",
    )
    .unwrap();
    // Alice's run brings her snapshot (the draft included) to the worker's cache.
    let run_a = launch(
        &c,
        &a_repo,
        "alice",
        "draft",
        "return await agent('cat draft.txt');",
        &["--backend", "exec"],
    );
    let (code, r) = wait(&c, "alice", &run_a);
    assert_eq!(code, 0, "{r}");
    assert!(
        r["result"]
            .as_str()
            .unwrap_or("")
            .contains("SECRET-OF-TEAM-A"),
        "{r}"
    );
    // Alice keeps a scratch file in a run without a source while Bob probes.
    let scratch_a = launch(
        &c,
        c.path(),
        "alice",
        "scratch",
        "return await agent('echo SCRATCH-OF-TEAM-A > note.txt; sleep 120; echo slept');",
        &["--backend", "exec", "--source", "none"],
    );
    let a_note = flotilla_tests::call_dir(&ws, &scratch_a, 0).join("note.txt");
    assert!(
        eventually(60, || a_note.exists()),
        "alice's agent writes its note at {}",
        a_note.display()
    );
    // Bob: a clone of the same repository (the draft is not in it).
    let b_repo = c.path().join("b-repo");
    git(
        c.path(),
        &[
            "clone",
            "-q",
            a_repo.to_str().unwrap(),
            b_repo.to_str().unwrap(),
        ],
    );
    assert!(!b_repo.join("draft.txt").exists());
    let mut cwds: Vec<String> = [
        "",
        ".",
        "./",
        "x/..",
        "a/./..",
        ".flotilla",
        ".flotilla/sources",
        ".flotilla/caches/team-a",
        "..",
        "../..",
        "/",
        "/tmp",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    // And what proptest builds of the pieces an escape is made of.
    let piece = proptest::prop_oneof![
        proptest::strategy::Just("..".to_owned()),
        proptest::strategy::Just(".".to_owned()),
        proptest::strategy::Just("".to_owned()),
        proptest::strategy::Just(".flotilla".to_owned()),
        proptest::strategy::Just("caches".to_owned()),
        proptest::strategy::Just("%2e%2e".to_owned()),
        proptest::strategy::Just("~".to_owned()),
        "[a-z]{1,4}",
    ];
    let built = proptest::collection::vec(piece, 1..5)
        .prop_map(|parts| parts.join("/"))
        .prop_flat_map(|p| {
            proptest::prop_oneof![
                proptest::strategy::Just(p.clone()),
                proptest::strategy::Just(format!("/{p}")),
                proptest::strategy::Just(format!("{p}/"))
            ]
        });
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for _ in 0..20 {
        cwds.push(built.new_tree(&mut runner).unwrap().current());
    }
    let probe = hostile_probe(&ws, a_note.parent().unwrap());
    let body = probes_script(&probe, &cwds);
    let (mut leaked, mut unrefused) = (Vec::new(), Vec::new());
    for (extra, dir) in [
        (vec!["--backend", "exec"], b_repo.clone()),
        (
            vec!["--backend", "exec", "--source", "none"],
            c.path().to_path_buf(),
        ),
    ] {
        let run_b = launch(&c, &dir, "bob", "probe", &body, &extra);
        let (code, r) = wait(&c, "bob", &run_b);
        assert_eq!(code, 0, "{r}");
        let results = r["result"].as_array().unwrap_or_else(|| panic!("{r}"));
        assert_eq!(results.len(), cwds.len(), "{r}");
        let mut ran = 0;
        for text in results {
            let text = text.as_str().unwrap_or_else(|| panic!("{r}"));
            // (What it "planted" where the workspace is landed in its own sandbox's /tmp
            // when the workspace is under /tmp, as here: the worker's side is checked below.)
            if text.contains("OF-TEAM-A") {
                leaked.push(text.to_owned());
            }
            if text.starts_with("REJECTED") {
                // Refused as an option or a directory: it says which cwd and why.
                assert!(text.contains("cwd") || text.contains("INVALID"), "{text}");
                continue;
            }
            ran += 1;
            assert!(text.trim_end().ends_with("END"), "{text}");
            // Where it ran: inside its own call's directory, whatever the cwd.
            let pwd = text
                .lines()
                .find_map(|l| l.strip_prefix("PWD "))
                .unwrap_or_else(|| panic!("{text}"));
            let call = text
                .lines()
                .find_map(|l| l.strip_prefix("CALL "))
                .unwrap_or_else(|| panic!("{text}"));
            let call: u64 = call.trim().parse().unwrap_or_else(|_| panic!("{text}"));
            let own = flotilla_tests::call_dir(&ws.canonicalize().unwrap(), &run_b, call);
            assert!(
                Path::new(pwd).starts_with(&own),
                "an agent of call {call} worked in {pwd}, outside {}: {text}",
                own.display()
            );
            // Each kernel call refused with EPERM.
            let calls: Vec<&str> = text.lines().filter(|l| l.starts_with("SYSCALL ")).collect();
            assert_eq!(calls.len(), 4, "{text}");
            unrefused.extend(
                calls
                    .into_iter()
                    .filter(|l| !l.ends_with(" -1 1"))
                    .map(str::to_owned),
            );
        }
        assert!(ran >= 4, "the plain cwds run: {r}");
    }
    assert!(
        leaked.is_empty(),
        "team A's files reached team B: {leaked:#?}"
    );
    assert!(
        unrefused.is_empty(),
        "kernel calls not refused: {unrefused:?}"
    );
    // Nothing Bob planted is where the worker keeps its caches.
    let caches = ws.join(".flotilla/caches");
    assert!(!caches.join("team-b/planted.git").exists());
    for team in std::fs::read_dir(&caches).unwrap().flatten() {
        for cache in std::fs::read_dir(team.path()).unwrap().flatten() {
            let config = std::fs::read_to_string(cache.path().join("config")).unwrap();
            assert!(!config.contains("gitProxy"), "{config}");
        }
    }
    // Alice's note is as she left it; her run ends when she stops it, and the fleet serves on.
    assert_eq!(
        std::fs::read_to_string(&a_note).unwrap(),
        "SCRATCH-OF-TEAM-A\n"
    );
    assert_eq!(c.client_as("alice", &["stop", &scratch_a]).code, 0);
    let (_, r) = wait(&c, "alice", &scratch_a);
    assert_ne!(r["status"], "running", "{r}");
    let again = launch(
        &c,
        &a_repo,
        "alice",
        "again",
        "return await agent('cat code.txt');",
        &["--backend", "exec"],
    );
    let (code, r) = wait(&c, "alice", &again);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "code", "{r}");
}

/// Rows: the checkout's git directory, the worker's own git on a checkout. The agent writes
/// a clean filter, a signing program and an ssh command into its checkout's `.git/config`
/// and marks its files for the filter; the worker's `git add` and `commit` of its change run
/// none of them, and the change comes home as the agent wrote it.
#[test]
fn the_worker_s_git_runs_nothing_an_agent_put_in_its_checkout_s_git_directory() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let src = c.path().join("repo");
    repo(&src);
    let trap = "git config filter.pwn.clean 'sed s/apple/bpple/'; git config filter.pwn.smudge cat; \
                git config filter.pwn.required true; echo '*.txt filter=pwn' > .gitattributes; \
                git config commit.gpgsign true; git config gpg.program false; \
                git config core.sshCommand false; git config core.fsmonitor false; \
                mkdir -p .git/info; echo '*.txt filter=pwn' > .git/info/attributes; \
                echo apple > fruit.txt; echo set";
    let run = launch(
        &c,
        &src,
        "client",
        "trap",
        &format!(
            "return await agent({}, {{ timeout: 5000 }});",
            Value::String(trap.into())
        ),
        &["--backend", "exec"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "set", "{r}");
    assert_eq!(r["changes"]["merged"], 1, "the change came home: {r}");
    let applied = c.client_in(&src, &["apply", &run, "--merge"]);
    assert_eq!(applied.code, 0, "{applied:?}");
    assert_eq!(
        std::fs::read_to_string(src.join("fruit.txt")).unwrap(),
        "apple\n",
        "the agent's filter never rewrote its change"
    );
}

/// Row: the attempt's disk (its checkout or scratch directory). An agent that writes past
/// the worker's `--disk-mib` ends with a failure naming the quota, its directory goes, and
/// the worker serves on; a run's scratch directories go when its calls end.
#[test]
fn an_attempt_over_its_disk_quota_fails_naming_it_and_nothing_it_wrote_stays() {
    let c = Cluster::start_workers_with(
        1,
        4,
        &["--backend", "exec", "--exec-cmd", "sh", "--disk-mib", "64"],
        Vec::new(),
    );
    let ws = c.path().join("ws-0");
    let src = c.path().join("repo");
    repo(&src);
    let body = "const [big, small] = await parallel([\n\
                  () => agent('dd if=/dev/zero of=big bs=1M count=300 2>/dev/null; echo wrote', { label: 'big' }),\n\
                  () => agent('echo small > small.txt; echo fine', { label: 'small' }),\n\
                ]);\n\
                return { big, small };";
    for (extra, dir) in [
        (vec!["--backend", "exec", "--source", "none"], c.path()),
        (vec!["--backend", "exec"], src.as_path()),
    ] {
        let run = launch(&c, dir, "client", "disk", body, &extra);
        let (code, r) = c.wait(&run);
        assert_eq!(code, 0, "{r}");
        assert_eq!(r["result"]["small"], "fine", "{r}");
        assert_eq!(r["result"]["big"], Value::Null, "{r}");
        let failures = flotilla_tests::failures(&r).join("\n");
        assert!(
            failures.contains("disk quota") && failures.contains("--disk-mib"),
            "{failures}"
        );
        // Nothing of the run stays on the worker: the failed call's directory and the
        // finished one's alike.
        assert!(
            !ws.join(&run).exists(),
            "{:?}",
            std::fs::read_dir(ws.join(&run))
                .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
        );
    }
    let again = launch(
        &c,
        c.path(),
        "client",
        "again",
        "return await agent('echo on');",
        &["--backend", "exec", "--source", "none"],
    );
    let (code, r) = c.wait(&again);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "on", "{r}");
}

/// Row: the model gateway. The real `claude` CLI's Bash tool, holding its attempt's token,
/// asks the gateway for paths that a normalising client would turn into the provider's Files
/// and organization APIs; each is refused there, and the provider (the fake) never sees them.
#[test]
fn the_gateway_passes_the_real_cli_s_model_calls_and_no_other_path() {
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    let mut env = fake.env();
    env.push((
        "FLOTILLA_CLAUDE_BIN".into(),
        crate::claude::claude_bin().to_str().unwrap().to_owned(),
    ));
    let c = Cluster::start_workers_with(1, 2, &["--backend", "claude-code"], env);
    let src = c.path().join("repo");
    repo(&src);
    std::fs::write(
        src.join("probe.py"),
        r#"import http.client, os
key = os.environ.get('ANTHROPIC_API_KEY', '')
for path in ['/v1/models/../files', '/v1/models/%2e%2e/files', '/v1/models/../organizations/me',
             '/v1/models/%2E%2E/%2E%2E/v1/files', '/v1//files', '/v1/models/x/../../files?limit=1',
             '/v1/files', '/v1/messages/batches']:
    c = http.client.HTTPConnection('127.0.0.1', 47119, timeout=20)
    c.request('GET', path, headers={'x-api-key': key})
    print('GATEWAY', c.getresponse().status, path)
"#,
    )
    .unwrap();
    commit_all(&src, "probe");
    let run = launch(
        &c,
        &src,
        "client",
        "gateway",
        "return await agent('probe the gateway [[bash:python3 probe.py]]', { tools: ['Bash'] });",
        &["--stagger", "0", "--backend", "claude-code"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    // The fake answers with what the tool said.
    let seen = r["result"]
        .as_str()
        .unwrap_or_else(|| panic!("{r}"))
        .to_owned();
    let answers: Vec<&str> = seen
        .split("GATEWAY ")
        .skip(1)
        .map(|s| s.get(..3).unwrap_or(""))
        .collect();
    assert!(answers.len() >= 8, "the probe ran: {seen}");
    assert!(answers.iter().all(|s| *s == "403"), "{answers:?}");
    let paths: Vec<String> = fake.requests().into_iter().map(|s| s.path).collect();
    assert!(
        paths
            .iter()
            .all(|p| p.starts_with("/v1/messages") && !p.contains("batches")),
        "only model calls reached the provider: {paths:?}"
    );
    assert!(!paths.is_empty(), "the CLI's own model calls went through");
}

/// Row: the worker's sandbox (its setup). A worker whose agents' sandbox cannot start their
/// program fails the attempt as its own failure, not the agent's, and the call goes again.
#[test]
fn a_sandbox_that_cannot_start_the_agent_is_the_worker_s_failure_and_the_call_goes_again() {
    // The real bubblewrap, told to show a path that is not there once the worker has
    // checked it can make a sandbox (its probe runs `true`): each agent's sandbox fails.
    let dir = tempfile::tempdir().unwrap();
    let bwrap = dir.path().join("bwrap");
    let found = std::process::Command::new("sh")
        .args(["-c", "command -v bwrap"])
        .output()
        .unwrap();
    let real = PathBuf::from(String::from_utf8_lossy(&found.stdout).trim());
    assert!(real.is_absolute(), "bubblewrap is installed: {found:?}");
    std::fs::write(
        &bwrap,
        format!(
            "#!/bin/sh\ncase \" $* \" in *\" -- true \"*) exec {real} \"$@\";; esac\nexec {real} --ro-bind /no/such/path /nowhere \"$@\"\n",
            real = real.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&bwrap, std::fs::Permissions::from_mode(0o755)).unwrap();
    let c = Cluster::start_workers_with(
        1,
        2,
        &["--backend", "exec", "--exec-cmd", "sh"],
        vec![("FLOTILLA_BWRAP".into(), bwrap.display().to_string())],
    );
    let run = launch(
        &c,
        c.path(),
        "client",
        "broken",
        "return await agent('anything');",
        &["--backend", "exec", "--source", "none"],
    );
    let (code, r) = c.wait(&run);
    // Its one agent failed: the run completed with nothing completed.
    assert_eq!(code, flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED, "{r}");
    let failures = flotilla_tests::failures(&r).join("\n");
    assert!(
        failures.contains("could not make the agent's sandbox")
            && failures.contains("bwrap: Can't find source path /no/such/path"),
        "{failures}"
    );
    assert!(
        flotilla_tests::agents(&r)[0]["attempts"]
            .as_u64()
            .unwrap_or(0)
            > 1,
        "the call went again: {r}"
    );
}

/// Row: files the worker keeps (its sandbox's state). A worker stopped with SIGTERM removes
/// its sandbox's directory; one killed outright leaves it, and the next worker removes it.
#[test]
fn a_stopped_worker_leaves_no_sandbox_state_and_a_killed_one_s_is_swept() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::start_workers_with(
        1,
        2,
        &["--backend", "echo"],
        vec![("TMPDIR".into(), tmp.path().display().to_string())],
    );
    let states = |pid: u32| -> Vec<PathBuf> {
        std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("flotilla-sandbox-{pid}-")))
            })
            .collect()
    };
    let first = c.worker_pid(0);
    assert_eq!(
        states(first).len(),
        1,
        "the worker's sandbox keeps its state there"
    );
    assert!(c.stop_worker(0).success());
    assert!(states(first).is_empty(), "a stopped worker leaves nothing");
    c.start_worker(0, 2);
    let second = c.worker_pid(0);
    assert!(eventually(30, || states(second).len() == 1));
    c.signal_worker(0, "-9");
    assert_eq!(
        states(second).len(),
        1,
        "killed outright, it could not tidy"
    );
    c.start_worker(0, 2);
    let third = c.worker_pid(0);
    assert!(eventually(30, || states(third).len() == 1));
    assert!(states(second).is_empty(), "the next worker swept it");
}

/// Row: `isolation: 'worktree'` on a worker. Without a run source there is no repository of
/// the run's on a worker: an agent asking for a worktree is refused, even when the worker's
/// workspace root is a repository (as an agent could once make it, with filters of its own
/// that `git worktree add` would run outside any sandbox).
#[test]
fn a_fleet_agent_gets_no_worktree_of_the_worker_s_own_directories() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let ws = c.path().join("ws-0");
    repo(&ws);
    let run = launch(
        &c,
        c.path(),
        "client",
        "worktree",
        "try { return await agent('echo inside', { isolation: 'worktree' }); } catch (e) { return 'REJECTED ' + e.code + ' ' + e.message; }",
        &["--backend", "exec", "--source", "none"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    let text = r["result"].as_str().unwrap_or_else(|| panic!("{r}"));
    assert!(
        text.starts_with("REJECTED") && text.contains("needs the run's source"),
        "{text}"
    );
    let worktrees = git(&ws, &["worktree", "list"]);
    assert_eq!(worktrees.lines().count(), 1, "{worktrees}");
}
