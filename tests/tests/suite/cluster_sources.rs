//! The user's code on the fleet (issue 12): a launch sends the repository it runs in as a
//! snapshot, only what the store lacks; workers fetch it through their coordinator link, keep
//! it in a cache, and give every call its own checkout. Runs one at a time with the other
//! cluster tests.

use std::path::Path;
use std::process::Command;

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::cluster::Cluster;
use flotilla_tests::{commit_all, git};

/// A repository of about 2 MB: 200 files of pseudo-random text, a tracked file with an
/// uncommitted edit, an untracked file and an ignored one.
fn user_repo(dir: &Path) -> u64 {
    flotilla_tests::git_repo(dir);
    std::fs::create_dir_all(dir.join("bulk")).unwrap();
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut total = 0u64;
    for i in 0..200 {
        let mut body = String::new();
        while body.len() < 10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            body.push_str(&format!("{x:016x}\n"));
        }
        total += body.len() as u64;
        std::fs::write(dir.join(format!("bulk/f{i:03}.txt")), body).unwrap();
    }
    std::fs::write(dir.join(".gitignore"), "*.log\n").unwrap();
    std::fs::write(dir.join("sub/tracked.txt"), "committed\n").unwrap();
    commit_all(dir, "bulk");
    std::fs::write(dir.join("sub/tracked.txt"), "edited, not committed\n").unwrap();
    std::fs::write(dir.join("untracked.txt"), "untracked\n").unwrap();
    std::fs::write(dir.join("noise.log"), "ignored\n").unwrap();
    total
}

fn launch(c: &Cluster, repo: &Path, script: &Path) -> serde_json::Value {
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
    out.json()
}

fn sent_lines(c: &Cluster) -> Vec<String> {
    std::fs::read_to_string(c.path().join("coordinator.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("sent a source"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_launch_sends_its_repository_once_and_every_call_works_in_a_checkout_of_it() {
    // The prompt is a shell script the exec agent runs.
    let c =
        Cluster::start_workers_with(2, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    let size = user_repo(&repo);
    let status_before = git(&repo, &["status", "--porcelain"]);
    let script = c.path().join("look.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'look', description: 'reads the code' };\n\
         return await parallel([0, 1, 2].map(i => () => agent(\n\
           'pwd; cat sub/tracked.txt; cat untracked.txt; ls bulk | wc -l; test -e noise.log && echo IGNORED; echo call ' + i)));",
    )
    .unwrap();
    // Over --max-source: refused before anything is sent, with the size.
    let out = c.client_in(
        &repo,
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--backend",
            "exec",
            "--max-source-mib",
            "0",
        ],
    );
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("more than --max-source"), "{out:?}");
    assert!(
        !c.path().join("store/sources").exists(),
        "nothing was stored"
    );
    let first = launch(&c, &repo, &script);
    let up = first["source"]["uploaded_bytes"].as_u64().unwrap();
    assert!(up > 0, "{first}");
    let run = first["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let results = r["result"].as_array().unwrap();
    let mut dirs = Vec::new();
    for (i, res) in results.iter().enumerate() {
        let text = res.as_str().unwrap_or_else(|| panic!("{r}"));
        let mut lines = text.lines();
        let pwd = lines.next().unwrap().to_owned();
        assert!(
            pwd.contains(&run) && pwd.contains("ws-"),
            "a checkout per call on a worker: {text}"
        );
        assert!(
            text.contains("edited, not committed"),
            "the uncommitted edit: {text}"
        );
        assert!(text.contains("untracked\n"), "the untracked file: {text}");
        assert!(text.contains("200"), "the tracked tree: {text}");
        assert!(!text.contains("IGNORED"), "ignored files stay home: {text}");
        assert!(text.ends_with(&format!("call {i}")), "{text}");
        dirs.push(pwd);
    }
    dirs.sort();
    dirs.dedup();
    assert_eq!(dirs.len(), 3, "every call has its own checkout: {dirs:?}");
    // Unchanged checkouts are gone after their calls.
    for d in &dirs {
        assert!(!Path::new(d).exists(), "{d} was left behind");
    }
    // The user's repository is as it was.
    assert_eq!(git(&repo, &["status", "--porcelain"]), status_before);
    assert!(git(&repo, &["branch", "--list"]).lines().count() == 1);

    // The same tree again: nothing to send, and warm workers fetch nothing.
    let before = sent_lines(&c).len();
    let second = launch(&c, &repo, &script);
    assert_eq!(second["source"]["uploaded_bytes"], 0, "{second}");
    assert_eq!(second["source"]["commit"], first["source"]["commit"]);
    let (code, _) = c.wait(second["run_id"].as_str().unwrap());
    assert_eq!(code, 0);
    let after: Vec<String> = sent_lines(&c).into_iter().skip(before).collect();
    assert!(after.is_empty(), "a warm worker asked again: {after:?}");

    // One file changes: well under 1% of the repository goes up.
    std::fs::write(repo.join("sub/tracked.txt"), "edited again\n").unwrap();
    let third = launch(&c, &repo, &script);
    let up3 = third["source"]["uploaded_bytes"].as_u64().unwrap();
    assert!(
        up3 > 0 && up3 * 100 < size,
        "{up3} bytes of a {size}-byte repository"
    );
    let (code, r) = c.wait(third["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    assert!(
        r["result"][0].as_str().unwrap().contains("edited again"),
        "{r}"
    );
}

#[test]
fn a_git_url_source_is_fetched_by_the_workers_and_outside_a_repository_there_is_none() {
    // A path on the worker's own disk is fetched only by a worker that allows it, on a
    // coordinator whose operator says its workers do.
    let c = Cluster::start_configured(
        1,
        2,
        &["--allow-file-sources"],
        &[
            "--backend",
            "exec",
            "--exec-cmd",
            "sh",
            "--allow-file-sources",
        ],
    );
    let repo = c.path().join("upstream");
    user_repo(&repo);
    let script = c.path().join("cat.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'cat', description: 'reads the code' };\n\
         const text = await agent('cat sub/tracked.txt; ls bulk | wc -l');\n\
         await agent('echo more >> sub/tracked.txt; echo edited', { label: 'edit' });\n\
         return text;",
    )
    .unwrap();
    // A URL the workers fetch themselves (here a path on this machine): the committed tree.
    let source = format!("git+file://{}#main", repo.display());
    let out = c.client(&[
        "launch",
        script.to_str().unwrap(),
        "--json",
        "--backend",
        "exec",
        "--source",
        &source,
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    let (code, r) = c.wait(out.json()["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    let text = r["result"].as_str().unwrap_or_else(|| panic!("{r}"));
    assert!(
        text.starts_with("committed\n") && text.contains("200"),
        "{text}"
    );
    // An edit of a URL source has nowhere to go: the run says so.
    let failures = flotilla_tests::failures(&r);
    assert!(
        failures
            .iter()
            .any(|l| l.contains("\"edit\" changed 1 file(s)") && l.contains("not kept")),
        "{failures:?}"
    );
    // Outside a repository: no source, said on stderr; the agent gets a scratch directory.
    let elsewhere = tempfile::tempdir().unwrap();
    let out = c.client_in(
        elsewhere.path(),
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--backend",
            "exec",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("not in a git repository"), "{out:?}");
    let (code, r) = c.wait(out.json()["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "0", "an empty scratch directory: {r}");
}

/// A clean repository (so a fresh clone has exactly what the run started from).
fn clean_repo(dir: &Path) {
    flotilla_tests::git_repo(dir);
    std::fs::create_dir_all(dir.join("notes")).unwrap();
    std::fs::write(dir.join("notes/keep.txt"), "kept\n").unwrap();
    std::fs::write(dir.join("same.txt"), "zero\n").unwrap();
    commit_all(dir, "notes");
}

#[test]
fn later_agents_see_earlier_agents_edits_and_apply_brings_them_home() {
    let c =
        Cluster::start_workers_with(3, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    clean_repo(&repo);
    let script = c.path().join("stages.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'stages', description: 'write, then read' };\n\
         return await pipeline(['a', 'b', 'c'],\n\
           x => agent('echo ' + x + ' >> notes/' + x + '.txt; echo wrote', { label: 'write ' + x }),\n\
           (prev, x) => agent('cat notes/' + x + '.txt notes/keep.txt', { label: 'read ' + x }));",
    )
    .unwrap();
    let out = launch(&c, &repo, &script);
    let run = out["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    // Stage 2 ran on the head with stage 1's edits merged in, on whichever worker.
    assert_eq!(
        r["result"],
        serde_json::json!(["a\nkept", "b\nkept", "c\nkept"]),
        "{r}"
    );
    assert_eq!(r["changes"]["merged"], 3, "{r}");
    assert_eq!(r["changes"]["apply"], format!("flotilla apply {run}"));
    let changes = c.client(&["changes", &run, "--json"]);
    assert_eq!(changes.code, 0, "{changes:?}");
    let changes = changes.json();
    let list = changes["changes"].as_array().unwrap();
    assert_eq!(
        list.len(),
        3,
        "the writers changed files, the readers did not: {changes}"
    );
    assert!(
        list.iter().all(|ch| ch["head_after"].is_string()),
        "{changes}"
    );
    // The session page shows each agent's diff and the run's.
    let t = c.client(&["token", "create", "--json"]);
    assert_eq!(t.code, 0, "{t:?}");
    let token = t.json()["token"].as_str().unwrap().to_owned();
    let bearer = format!("Bearer {token}");
    let auth = [("Authorization", bearer.as_str())];
    let writer = list[0]["index"].as_u64().unwrap();
    let page =
        flotilla_tests::http_get(c.http_port, &format!("/runs/{run}/agents/{writer}"), &auth);
    assert_eq!(page.status, 200, "{page:?}");
    assert!(
        page.body.contains("merged into the run head"),
        "{}",
        page.body
    );
    assert!(page.body.contains("notes/"), "{}", page.body);
    let whole = flotilla_tests::http_get(c.http_port, &format!("/runs/{run}/diff"), &auth);
    assert_eq!(whole.status, 200, "{whole:?}");
    for f in ["notes/a.txt", "notes/b.txt", "notes/c.txt"] {
        assert!(whole.body.contains(f), "{f} in {}", whole.body);
    }
    // A fresh clone of the user's repository gets exactly the run's files.
    let fresh = c.path().join("fresh");
    flotilla_tests::fresh_clone(&repo, &fresh);
    let applied = c.client_in(&fresh, &["apply", &run, "--merge"]);
    assert_eq!(applied.code, 0, "{applied:?}");
    for (f, want) in [
        ("notes/a.txt", "a\n"),
        ("notes/b.txt", "b\n"),
        ("notes/c.txt", "c\n"),
        ("notes/keep.txt", "kept\n"),
        ("same.txt", "zero\n"),
    ] {
        assert_eq!(std::fs::read_to_string(fresh.join(f)).unwrap(), want, "{f}");
    }
    let branches = git(
        &fresh,
        &[
            "branch",
            "--list",
            "flotilla/*",
            "--format=%(refname:short)",
        ],
    );
    assert!(
        branches.contains(&format!("flotilla/{run}/head")),
        "{branches}"
    );
    assert_eq!(git(&fresh, &["status", "--porcelain"]), "");
}

#[test]
fn two_agents_that_edit_the_same_line_lose_nothing() {
    let c =
        Cluster::start_workers_with(2, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    clean_repo(&repo);
    let script = c.path().join("race.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'race', description: 'two edits of one line' };\n\
         return await parallel([\n\
           () => agent('echo one > same.txt; sleep 0.5; echo done', { label: 'first' }),\n\
           () => agent('echo two > same.txt; sleep 0.5; echo done', { label: 'second' }),\n\
         ]);",
    )
    .unwrap();
    let out = launch(&c, &repo, &script);
    let run = out["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        serde_json::json!(["done", "done"]),
        "both results stand: {r}"
    );
    let failures = flotilla_tests::failures(&r);
    let line = failures
        .iter()
        .find(|f| f.contains("conflict with the run's head"))
        .unwrap_or_else(|| panic!("no conflict line: {r}"));
    assert!(
        line.contains("same.txt") && line.contains(&format!("flotilla/{run}/")),
        "{line}"
    );
    let changes = c.client(&["changes", &run, "--json"]).json();
    let list = changes["changes"].as_array().unwrap();
    assert_eq!(list.len(), 2, "{changes}");
    let in_head: Vec<_> = list
        .iter()
        .filter(|c| c["head_after"].is_string())
        .collect();
    let conflicted: Vec<_> = list.iter().filter(|c| c["conflicts"].is_array()).collect();
    assert_eq!((in_head.len(), conflicted.len()), (1, 1), "{changes}");
    // Both are in the user's repository after apply: the head, and the other on its branch.
    let applied = c.client_in(&repo, &["apply", &run]);
    assert_eq!(applied.code, 0, "{applied:?}");
    let head_text = git(&repo, &["show", &format!("flotilla/{run}/head:same.txt")]);
    let other = conflicted[0]["index"].as_u64().unwrap();
    let other_text = git(
        &repo,
        &["show", &format!("flotilla/{run}/{other}:same.txt")],
    );
    let mut both = [head_text.trim().to_owned(), other_text.trim().to_owned()];
    both.sort();
    assert_eq!(both, ["one", "two"]);
}

#[test]
fn a_resume_reapplies_the_journaled_changes_instead_of_running_their_agents_again() {
    let c =
        Cluster::start_workers_with(2, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    clean_repo(&repo);
    let writers = "const w = await parallel(['a', 'b', 'c'].map(x => () => agent('echo ' + x + ' > notes/' + x + '.txt; echo ' + x, { label: 'write ' + x })));";
    let first = c.path().join("first.js");
    std::fs::write(
        &first,
        format!(
            "export const meta = {{ name: 'w', description: 'writers' }};\n{writers}\nreturn w;"
        ),
    )
    .unwrap();
    let out = launch(&c, &repo, &first);
    let parent = out["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&parent);
    assert_eq!(code, 0, "{r}");
    // The same writers and one more: the three come from the journal, their changes are
    // applied to the new run's head again, and only the new agent runs.
    let second = c.path().join("second.js");
    std::fs::write(
        &second,
        format!("export const meta = {{ name: 'w', description: 'writers' }};\n{writers}\nconst more = await agent('echo $(ls notes)', {{ label: 'list' }});\nreturn [w, more];"),
    )
    .unwrap();
    let out = c.client_in(
        &repo,
        &[
            "launch",
            second.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--backend",
            "exec",
            "--resume",
            &parent,
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let child = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&child);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["usage"]["cached"], 3, "{r}");
    assert_eq!(r["usage"]["dispatched"], 1, "{r}");
    assert_eq!(
        r["result"][1], "a.txt b.txt c.txt keep.txt",
        "the new agent saw the journaled changes: {r}"
    );
    let changes = c.client(&["changes", &child, "--json"]).json();
    assert_eq!(changes["changes"].as_array().unwrap().len(), 3, "{changes}");
    let parent_head = c.client(&["changes", &parent, "--json"]).json()["head"].clone();
    let applied = c.client_in(&repo, &["apply", &child]);
    assert_eq!(applied.code, 0, "{applied:?}");
    let tree = |rev: &str| git(&repo, &["rev-parse", &format!("{rev}^{{tree}}")]);
    let applied = c.client_in(&repo, &["apply", &parent]);
    assert_eq!(applied.code, 0, "{applied:?}");
    assert_eq!(
        tree(&format!("flotilla/{child}/head")),
        tree(parent_head.as_str().unwrap()),
        "the resumed head has the same files as the first run's"
    );
}

#[test]
fn the_real_claude_cli_edits_a_file_on_a_worker_and_apply_brings_it_back() {
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    let mut env = fake.env();
    env.push((
        "FLOTILLA_CLAUDE_BIN".into(),
        crate::claude::claude_bin().to_str().unwrap().to_owned(),
    ));
    let c = Cluster::start_workers_with(1, 2, &["--backend", "claude-code"], env);
    let repo = c.path().join("repo");
    clean_repo(&repo);
    let script = c.path().join("fix.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'fix', description: 'an agent edits the code' };\n\
         return await agent('fix it [[bash:echo fixed by the agent > same.txt && echo edited]]', { tools: ['Bash'], label: 'fixer' });",
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
            "claude-code",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "tool said: edited", "{r}");
    assert_eq!(r["changes"]["merged"], 1, "{r}");
    let applied = c.client_in(&repo, &["apply", &run, "--merge"]);
    assert_eq!(applied.code, 0, "{applied:?}");
    assert_eq!(
        std::fs::read_to_string(repo.join("same.txt")).unwrap(),
        "fixed by the agent\n"
    );
    let author = git(
        &repo,
        &["log", "-1", "--format=%an", &format!("flotilla/{run}/0")],
    );
    assert_eq!(author.trim(), "fixer", "the agent is the change's author");
}

#[test]
fn a_run_adopted_after_its_coordinator_is_killed_ends_with_every_change_once() {
    use std::time::{Duration, Instant};
    let etcd = flotilla_tests::services::Etcd::start();
    let s3 = flotilla_tests::services::S3::start();
    let url = format!("s3://{}/sources", s3.bucket);
    let mut c = Cluster::start_group_with(
        2,
        2,
        etcd.endpoint(),
        (url, s3.env()),
        &["--backend", "exec", "--exec-cmd", "sh"],
    );
    let repo = c.path().join("repo");
    clean_repo(&repo);
    let script = c.path().join("many.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'many', description: 'writers' };\n\
         return await parallel(Array.from({ length: 12 }, (_, i) => () =>\n\
           agent('echo ' + i + ' > notes/n' + i + '.txt; sleep 0.4; echo ' + i, { label: 'w' + i })));",
    )
    .unwrap();
    let standby = c.standby_url();
    let out = c.client_at_in(
        &standby,
        &repo,
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--backend",
            "exec",
            "--concurrency",
            "2",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.journal(&run).len() < 4 {
        assert!(Instant::now() < deadline, "calls were never journaled");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut leader = c.take_coordinator().unwrap();
    leader.kill().unwrap();
    leader.wait().unwrap();
    let before = c.journal(&run).len();
    assert!(before < 12, "the kill came too late ({before} done)");
    let out = c.client_at(&standby, &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    assert_eq!(r["result"].as_array().unwrap().len(), 12, "{r}");
    assert_eq!(
        r["usage"]["cached"].as_u64().unwrap() + r["usage"]["dispatched"].as_u64().unwrap(),
        12,
        "{r}"
    );
    assert!(
        r["usage"]["cached"].as_u64().unwrap() >= before as u64,
        "journaled changes were run again: {r}"
    );
    assert_eq!(
        r["changes"]["merged"], 12,
        "every change is in the head once: {r}"
    );
    // The head has exactly the files an uninterrupted run leaves.
    let fresh = c.path().join("fresh");
    flotilla_tests::fresh_clone(&repo, &fresh);
    let applied = c.client_at_in(&standby, &fresh, &["apply", &run, "--merge"]);
    assert_eq!(applied.code, 0, "{applied:?}");
    for i in 0..12 {
        assert_eq!(
            std::fs::read_to_string(fresh.join(format!("notes/n{i}.txt"))).unwrap(),
            format!("{i}\n")
        );
    }
    let files = git(&fresh, &["ls-files", "notes"]);
    assert_eq!(files.lines().count(), 13, "{files}");
}

#[test]
fn a_worker_whose_source_cache_is_damaged_fetches_it_again() {
    let c =
        Cluster::start_workers_with(1, 1, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    clean_repo(&repo);
    let script = c.path().join("cat.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'cat', description: 'reads' };\nreturn await agent('cat notes/keep.txt');",
    )
    .unwrap();
    let (code, r) = c.wait(launch(&c, &repo, &script)["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    // Every object of the cache goes; its record of applied packs stays.
    // The worker's caches of the default namespace.
    let sources = c.path().join("ws-0/.flotilla/caches/default");
    let cache = std::fs::read_dir(&sources)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    for f in std::fs::read_dir(cache.join("objects/pack")).unwrap() {
        std::fs::remove_file(f.unwrap().path()).unwrap();
    }
    assert!(cache.join("flotilla-packs").exists());
    let (code, r) = c.wait(launch(&c, &repo, &script)["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "kept", "{r}");
    assert_eq!(
        r["agents"][0]["attempts"], 1,
        "fetched again within the attempt: {r}"
    );
    // Worse: the commits are there but their trees are not, so the checkout itself fails.
    let listed = git(
        &cache,
        &[
            "cat-file",
            "--batch-all-objects",
            "--batch-check=%(objecttype) %(objectname)",
        ],
    );
    let commits: Vec<(String, Vec<u8>)> = listed
        .lines()
        .filter_map(|l| l.strip_prefix("commit "))
        .map(|id| {
            let body = Command::new("git")
                .arg("-C")
                .arg(&cache)
                .args(["cat-file", "commit", id])
                .output()
                .unwrap();
            assert!(body.status.success(), "{body:?}");
            (id.to_owned(), body.stdout)
        })
        .collect();
    assert!(!commits.is_empty(), "{listed}");
    for f in std::fs::read_dir(cache.join("objects/pack")).unwrap() {
        std::fs::remove_file(f.unwrap().path()).unwrap();
    }
    for (id, body) in &commits {
        let mut put = Command::new("git")
            .arg("-C")
            .arg(&cache)
            .args(["hash-object", "-t", "commit", "-w", "--stdin"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        put.stdin.take().unwrap().write_all(body).unwrap();
        let written = put.wait_with_output().unwrap();
        assert_eq!(String::from_utf8_lossy(&written.stdout).trim(), id);
    }
    let (code, r) = c.wait(launch(&c, &repo, &script)["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "kept", "{r}");
    assert_eq!(
        r["agents"][0]["attempts"], 1,
        "checked out again within the attempt: {r}"
    );
    // A checkout fails on the missing trees; a view (whose tree of files is made already)
    // finds them missing in the cache before it is made.
    let log = std::fs::read_to_string(c.path().join("worker-0.log")).unwrap_or_default();
    assert!(
        log.contains("the cached source is unusable")
            || log.contains("the source cache lost objects"),
        "{log}"
    );
}

#[test]
fn an_agent_that_repoints_its_checkout_s_git_runs_nothing_on_the_worker() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    clean_repo(&repo);
    let marker = c.path().join("ran-on-the-worker");
    // The agent's checkout is a repository of its own: it writes a clean filter, an
    // fsmonitor and a hook that run a command into its git config, and edits a file. The
    // worker's git on the checkout runs in a sandbox of its own, so none of them reaches the
    // worker; the change is still recorded.
    let m = marker.display();
    let prompt = format!(
        "printf '[filter \"x\"]\\n\\tclean = sh -c \"touch {m}; cat\"\\n[core]\\n\\tfsmonitor = touch {m}\\n' >> .git/config && \
         mkdir -p .git/hooks && printf '#!/bin/sh\\ntouch {m}\\n' > .git/hooks/post-commit && chmod +x .git/hooks/post-commit && \
         echo '* filter=x' > .gitattributes && \
         echo edited >> same.txt && echo done"
    );
    let script = c.path().join("evil.js");
    std::fs::write(
        &script,
        format!(
            "export const meta = {{ name: 'evil', description: 'repoints .git' }};\n\
             return await agent({prompt:?}, {{ label: 'evil' }});"
        ),
    )
    .unwrap();
    let out = launch(&c, &repo, &script);
    let run = out["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "done", "{r}");
    assert!(
        !marker.exists(),
        "a command of the agent's git directory ran on the worker"
    );
    // Its edit still came back (its own git directory is only a file of its tree).
    let changes = c.client_in(&repo, &["changes", &run, "--json"]);
    assert_eq!(changes.code, 0, "{changes:?}");
    assert!(changes.stdout.contains("same.txt"), "{changes:?}");
}

#[test]
fn a_change_too_big_to_send_fails_its_call_and_keeps_its_checkout() {
    let c = Cluster::start_workers_with(
        1,
        1,
        &[
            "--backend",
            "exec",
            "--exec-cmd",
            "sh",
            "--max-result-mib",
            "1",
        ],
        Vec::new(),
    );
    let repo = c.path().join("repo");
    clean_repo(&repo);
    let script = c.path().join("big.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'big', description: 'writes 3 MiB of noise' };\n\
         return await agent('head -c 3000000 /dev/urandom > noise.bin; echo wrote', { label: 'noise' });",
    )
    .unwrap();
    let (code, r) = c.wait(launch(&c, &repo, &script)["run_id"].as_str().unwrap());
    // Its one agent failed: the run completed with nothing completed.
    assert_eq!(code, flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED, "{r}");
    let failures = flotilla_tests::failures(&r);
    let line = failures
        .iter()
        .find(|l| l.contains("\"noise\""))
        .unwrap_or_else(|| panic!("{r}"));
    assert!(line.contains("over the limit of 1 MiB"), "{line}");
    let kept = line
        .split("what it wrote stays at ")
        .nth(1)
        .and_then(|rest| rest.split(" on this worker").next())
        .unwrap_or_else(|| panic!("{line}"));
    let noise = Path::new(kept).join("noise.bin");
    assert_eq!(
        std::fs::metadata(&noise).map(|m| m.len()).ok(),
        Some(3_000_000),
        "{line}"
    );
}

#[test]
fn a_source_bigger_than_the_transfer_window_reaches_the_worker() {
    let c =
        Cluster::start_workers_with(1, 1, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    clean_repo(&repo);
    // 40 MiB that does not compress: more than twice the 16 MiB the coordinator sends ahead
    // of the worker's acknowledgments.
    let mut noise = vec![0u8; 40 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in noise.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    std::fs::write(repo.join("noise.bin"), &noise).unwrap();
    commit_all(&repo, "noise");
    let script = c.path().join("size.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'size', description: 'sizes the noise' };\n\
         return await agent('wc -c < noise.bin');",
    )
    .unwrap();
    let (code, r) = c.wait(launch(&c, &repo, &script)["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"].as_str().map(str::trim), Some("41943040"), "{r}");
}

#[test]
fn a_call_that_fails_for_good_leaves_no_checkout_and_one_that_succeeds_none_either() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    clean_repo(&repo);
    let script = c.path().join("fail.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'fail', description: 'edits, then fails' };\n\
         const a = await agent('echo half > half.txt; exit 3', { label: 'fails' });\n\
         const b = await agent('echo whole > whole.txt; echo ok', { label: 'works' });\n\
         return [a, b];",
    )
    .unwrap();
    let run = launch(&c, &repo, &script)["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"][1], "ok", "{r}");
    assert!(r["result"][0].is_null(), "{r}");
    for call in [0, 1] {
        let dir = flotilla_tests::call_dir(&c.path().join("ws-0"), &run, call);
        assert!(!dir.exists(), "{} is left on the worker", dir.display());
    }
}

/// A small tmpfs mounted over a directory for one test (unmounted when dropped).
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(dir: &Path, size: &str) -> SmallDisk {
        std::fs::create_dir_all(dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "this test mounts a small tmpfs and needs root (CAP_SYS_ADMIN): {out:?}"
        );
        SmallDisk(dir.to_owned())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_worker_whose_disk_fills_fails_the_attempt_with_the_reason_and_keeps_serving() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    // The worker's whole workspace (its source cache included) on 16 MiB.
    let disk = c.path().join("ws-0");
    let _small = SmallDisk::mount(&disk, "16m");
    let big = c.path().join("big");
    clean_repo(&big);
    let mut noise = vec![0u8; 24 << 20];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for b in noise.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    std::fs::write(big.join("noise.bin"), &noise).unwrap();
    commit_all(&big, "noise");
    let script = c.path().join("read.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'read', description: 'reads' };\n\
         return await agent('cat notes/keep.txt', { label: 'reader' });",
    )
    .unwrap();
    let out = c.client_in(
        &big,
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--backend",
            "exec",
            "--attempts",
            "2",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let (code, r) = c.wait(out.json()["run_id"].as_str().unwrap());
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert!(r["result"].is_null(), "{r}");
    let failures = flotilla_tests::failures(&r);
    assert!(
        failures
            .iter()
            .any(|l| l.contains("\"reader\"") && l.contains("disk is full")),
        "{failures:?}"
    );
    // Nothing of the pack that did not fit is left, and the same worker serves the next run.
    let leftovers: Vec<_> = walk(&disk)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains("incoming-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let small = c.path().join("small");
    clean_repo(&small);
    let (code, r) = c.wait(launch(&c, &small, &script)["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "kept", "{r}");
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

#[test]
fn with_submodules_their_files_travel_and_apply_keeps_the_links() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let lib = c.path().join("lib");
    flotilla_tests::git_repo(&lib);
    std::fs::write(lib.join("lib.txt"), "library\n").unwrap();
    commit_all(&lib, "lib");
    let repo = c.path().join("repo");
    clean_repo(&repo);
    git(
        &repo,
        &[
            "-c",
            "protocol.file.allow=always",
            "submodule",
            "add",
            "-q",
            lib.to_str().unwrap(),
            "vendor/lib",
        ],
    );
    commit_all(&repo, "add lib");
    let link = git(&repo, &["ls-tree", "HEAD", "--", "vendor/lib"]);
    assert!(link.starts_with("160000 commit "), "{link}");
    // An uncommitted edit inside the submodule travels too.
    std::fs::write(repo.join("vendor/lib/lib.txt"), "library\nlocal edit\n").unwrap();
    let script = c.path().join("sub.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'sub', description: 'reads and edits a submodule' };\n\
         return await agent('cat vendor/lib/lib.txt; echo top >> same.txt; echo sub >> vendor/lib/lib.txt', { label: 'both' });",
    )
    .unwrap();
    // Without --submodules the directory is empty on the worker, and the launch says so.
    let ls = c.path().join("ls.js");
    std::fs::write(
        &ls,
        "export const meta = { name: 'ls', description: 'lists' };\n\
         return await agent('ls -A vendor/lib | wc -l');",
    )
    .unwrap();
    let out = c.client_in(
        &repo,
        &[
            "launch",
            ls.to_str().unwrap(),
            "--json",
            "--backend",
            "exec",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("pass --submodules"), "{out:?}");
    let (code, r) = c.wait(out.json()["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"].as_str().map(str::trim), Some("0"), "{r}");
    // With it, its files (and the uncommitted edit) are there.
    let out = c.client_in(
        &repo,
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--backend",
            "exec",
            "--submodules",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stderr
            .contains("submodules vendor/lib travel as plain files"),
        "{out:?}"
    );
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "library\nlocal edit", "{r}");
    // Apply: the top-level edit merges, the submodule link is the user's, and the edit
    // inside the submodule is named, not merged.
    std::fs::write(repo.join("vendor/lib/lib.txt"), "library\n").unwrap();
    let applied = c.client_in(&repo, &["apply", &run, "--merge"]);
    assert_eq!(applied.code, 0, "{applied:?}");
    assert!(
        applied.stderr.contains("inside submodules vendor/lib"),
        "{applied:?}"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("same.txt")).unwrap(),
        "zero\ntop\n"
    );
    assert_eq!(git(&repo, &["ls-tree", "HEAD", "--", "vendor/lib"]), link);
    assert_eq!(
        git(&repo, &["status", "--porcelain"]),
        "",
        "nothing stray in the user's tree"
    );
    let head = format!("flotilla/{run}/head");
    let inside = git(&repo, &["show", &format!("{head}:vendor/lib/lib.txt")]);
    assert_eq!(inside, "library\nlocal edit\nsub\n");
}

/// The checkout directories of `run` on worker `i` that hold `file` (in any of the run's
/// shards).
fn checkouts_with(c: &Cluster, i: usize, run: &str, file: &str) -> Vec<std::path::PathBuf> {
    let dir = c.path().join(format!("ws-{i}")).join(run);
    let entries = |d: &std::path::Path| {
        std::fs::read_dir(d)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect::<Vec<_>>()
    };
    entries(&dir)
        .iter()
        .flat_map(|shard| entries(shard))
        .filter(|p| p.join(file).exists())
        .collect()
}

#[test]
fn a_retry_on_another_worker_starts_from_what_the_interrupted_attempt_left() {
    let mut c =
        Cluster::start_workers_with(2, 1, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    flotilla_tests::git_repo(&repo);
    std::fs::write(repo.join("base.txt"), "base\n").unwrap();
    commit_all(&repo, "base");
    // The first attempt leaves a file and a draft, then hangs; a later one finishes the work
    // it finds.
    let script = c.path().join("resume.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'resume', description: 'incremental retries' };\n\
         return await agent('if [ -e progress.txt ]; then echo second >> progress.txt; echo resumed in $(pwd); \
         echo on $(stat -f -c %T .); cat progress.txt draft.txt; git status --porcelain; else echo first > progress.txt; echo draft > draft.txt; \
         echo tracked >> base.txt; sleep 600; fi', { label: 'worker' });\n",
    )
    .unwrap();
    let launched = launch(&c, &repo, &script);
    let run = launched["run_id"].as_str().unwrap().to_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let first = loop {
        if let Some(i) = (0..2).find(|&i| !checkouts_with(&c, i, &run, "draft.txt").is_empty()) {
            // Written through a copy-on-write view: the draft is in the call's writes.
            let found = checkouts_with(&c, i, &run, "draft.txt");
            assert!(
                found
                    .iter()
                    .all(|p| p.extension().is_some_and(|e| e == "upper")),
                "the first attempt worked in a view: {found:?}"
            );
            break i;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the first attempt never wrote its draft"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    // That worker is stopped (a deploy, a scale-down): it interrupts the attempt and sends
    // what it left with the interruption; the other worker picks the call up from there.
    c.signal_worker(first, "-TERM");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let text = r["result"].as_str().unwrap_or_else(|| panic!("{r}"));
    let other = format!("ws-{}", 1 - first);
    assert!(
        text.contains("resumed in") && text.contains(&other),
        "the retry ran on the other worker: {text}"
    );
    assert!(
        text.contains("first\nsecond\ndraft\n"),
        "it found the first attempt's files: {text}"
    );
    assert!(
        text.contains("on overlayfs"),
        "the retry worked in a view: {text}"
    );
    // As on Claude Code's disk: what the first attempt wrote is there uncommitted.
    for line in [" M base.txt", "?? draft.txt", "?? progress.txt"] {
        assert!(text.contains(line), "{line:?} in {text}");
    }
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap();
    assert!(
        log.contains("the next attempt starts from what this one left"),
        "{log}"
    );
    // The call's change is the whole work, both attempts', and comes home as such.
    let fresh = c.path().join("fresh");
    flotilla_tests::fresh_clone(&repo, &fresh);
    let applied = c.client_in(&fresh, &["apply", &run, "--merge"]);
    assert_eq!(applied.code, 0, "{applied:?}");
    for (f, want) in [
        ("progress.txt", "first\nsecond\n"),
        ("draft.txt", "draft\n"),
        ("base.txt", "base\ntracked\n"),
    ] {
        assert_eq!(std::fs::read_to_string(fresh.join(f)).unwrap(), want, "{f}");
    }

    // A stall: the watchdog interrupts the attempt, and the restart waits for what it left
    // before it goes (to whichever worker is free).
    c.start_worker(first, 1);
    c.wait_for_workers(2);
    std::fs::write(
        &script,
        "export const meta = { name: 'stall', description: 'a stalled attempt' };\n\
         return await agent('if [ -e progress.txt ]; then echo second >> progress.txt; cat progress.txt; \
         else echo first > progress.txt; sleep 600; fi', { label: 'staller' });\n",
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
            "exec",
            "--stall-timeout",
            "1s",
            "--attempts",
            "2",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "first\nsecond", "{r}");
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap();
    assert!(
        log.lines()
            .any(|l| l.contains(&run)
                && l.contains("the next attempt starts from what this one left")),
        "{log}"
    );
}

/// A commit whose pack left the store (retention swept it, or someone deleted it) is not
/// "held": the next launch from the same checkout sends it again and its agents read the
/// code, where before the launch was told the store had it and its agents found no source.
#[test]
fn a_commit_whose_pack_is_gone_is_sent_again_by_the_next_launch() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    flotilla_tests::git_repo(&repo);
    std::fs::write(repo.join("code.txt"), "the user's code\n").unwrap();
    commit_all(&repo, "code");
    let script = c.path().join("read.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'read', description: 'reads the code' };\n\
         return await agent('cat code.txt');",
    )
    .unwrap();
    let first = launch(&c, &repo, &script);
    assert!(
        first["source"]["uploaded_objects"].as_u64() > Some(0),
        "{first}"
    );
    let (code, r) = c.wait(first["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    // Every pack of the store goes; the commit records stay.
    let mut packs = Vec::new();
    for entry in walk(&c.path().join("store/sources")) {
        if entry.extension().is_some_and(|e| e == "pack") {
            packs.push(entry);
        }
    }
    assert!(!packs.is_empty());
    for p in &packs {
        std::fs::remove_file(p).unwrap();
    }
    let second = launch(&c, &repo, &script);
    assert!(
        second["source"]["uploaded_objects"].as_u64() > Some(0),
        "the commit is sent again: {second}"
    );
    let (code, r) = c.wait(second["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "the user's code", "{r}");
}

/// Issue 29: on a fleet, making an attempt's workspace (fetching and checking out a large
/// source) takes longer than the run's stall timeout; that is not the agent making no
/// progress, so no attempt is restarted as stalled and every agent runs once.
#[test]
fn making_a_workspace_slower_than_the_stall_timeout_is_not_a_stall() {
    let c =
        Cluster::start_workers_with(1, 4, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    flotilla_tests::git_repo(&repo);
    for d in 0..100 {
        let dir = repo.join(format!("pkg{d}"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in 0..200 {
            std::fs::write(dir.join(format!("f{f}.txt")), format!("{d} {f}\n")).unwrap();
        }
    }
    commit_all(&repo, "twenty thousand files");
    let script = c.path().join("quick.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'quick', description: 'quick agents on a big tree' };\n\
         return await parallel(Array.from({ length: 4 }, (_, i) => () => agent('cat pkg' + i + '/f0.txt', { label: 'a' + i })));",
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
            "exec",
            "--stall-timeout",
            "300ms",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        serde_json::json!(["0 0", "1 0", "2 0", "3 0"]),
        "{r}"
    );
    for a in r["agents"].as_array().unwrap() {
        assert_eq!(a["attempts"], 1, "no attempt was restarted as stalled: {r}");
    }
}
