//! Sources across namespaces and hostile changes (issue 28, cases 4, 5 and 11), on a real
//! fleet with mTLS: a client of another namespace, holding the first one's repository and
//! commit ids, is neither told they exist nor sent their objects, cannot build on them or
//! launch from them (raw RPCs, as a client bypassing the CLI would); an operator and the
//! namespace itself still can. An agent that leaves a commit whose trees reach `.git`, leave
//! the tree or hold backslashes has its change refused and named, and nothing of it reaches
//! the store, the head or the user's repository; a plain change of the same run merges.

use std::path::Path;
use std::process::{Command, Stdio};

use flotilla_proto::v1;
use flotilla_proto::v1::client_service_client::ClientServiceClient;
use flotilla_tests::cluster::Cluster;
use flotilla_tests::{commit_all, git};
use serde_json::Value;

type Client = ClientServiceClient<tonic::transport::Channel>;

fn client_of(c: &Cluster, who: &str) -> Client {
    let tls = flotilla_proto::tls::TlsFiles::in_dir(&c.pki(), who);
    ClientServiceClient::new(flotilla_proto::tls::channel(&c.url(), Some(&tls)).expect("channel"))
}

fn version() -> String {
    flotilla_proto::PROTOCOL_VERSION.into()
}

/// What `FetchSource` streamed: the bytes of data, and the error it ended with (or the
/// status it was refused with).
async fn fetched(client: &mut Client, ns: &str, repo: &str, commit: &str) -> (usize, String) {
    let asked = client
        .fetch_source(v1::FetchSourceRequest {
            protocol_version: version(),
            repo: repo.into(),
            commit: commit.into(),
            have_packs: Vec::new(),
            namespace: ns.into(),
        })
        .await;
    let mut stream = match asked {
        Ok(s) => s.into_inner(),
        Err(s) => return (0, format!("refused: {}", s.message())),
    };
    let mut bytes = 0;
    loop {
        match stream.message().await {
            Ok(Some(d)) => {
                bytes += d.data.len();
                if d.done {
                    return (bytes, d.error);
                }
            }
            Ok(None) => return (bytes, "the stream ended without done".into()),
            Err(s) => return (bytes, format!("refused: {}", s.message())),
        }
    }
}

async fn held(
    client: &mut Client,
    ns: &str,
    repo: &str,
    commits: &[&str],
) -> Result<Vec<String>, String> {
    client
        .source_have(v1::SourceHaveRequest {
            protocol_version: version(),
            repo: repo.into(),
            commits: commits.iter().map(|c| (*c).to_owned()).collect(),
            namespace: ns.into(),
        })
        .await
        .map(|r| r.into_inner().held)
        .map_err(|s| s.message().to_owned())
}

/// A launch that names its source itself (what a client bypassing the CLI sends).
async fn launch_naming(client: &mut Client, repo: &str, commit: &str) -> v1::LaunchReply {
    let settings = serde_json::json!({
        "backend": "exec",
        "source": { "repo": repo, "commit": commit, "origin": "someone else's" },
    });
    client
        .launch(v1::LaunchRequest {
            protocol_version: version(),
            script: "export const meta = { name: 'borrow', description: 'd' };\nreturn await agent('cat secret.txt');".into(),
            settings_json: settings.to_string(),
            ..v1::LaunchRequest::default()
        })
        .await
        .expect("an answer")
        .into_inner()
}

/// `git pack-objects --revs` of `revs` in `dir`.
fn pack(dir: &Path, revs: &str) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["pack-objects", "--revs", "--stdout", "-q"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(revs.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    out.stdout
}

fn wait_as(c: &Cluster, who: &str, run: &str) -> (i32, Value) {
    let out = c.client_as(who, &["wait", run, "--json"]);
    (out.code, out.json())
}

fn launch_json(c: &Cluster, dir: &Path, who: &str, script: &Path) -> Value {
    let out = c.client_as_in(
        dir,
        who,
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

#[test]
fn another_namespace_s_sources_are_never_confirmed_sent_built_on_or_launched() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    c.issue_client("alice", &["team-a"]);
    c.issue_client("bob", &["team-b"]);
    c.issue_client("ops", &["*"]);
    // Alice's repository, with a secret she has not committed (it travels in her snapshot).
    let repo = c.path().join("alice");
    flotilla_tests::git_repo(&repo);
    std::fs::write(repo.join("code.txt"), "shared code\n").unwrap();
    commit_all(&repo, "code");
    std::fs::write(repo.join("secret.txt"), "team a's secret\n").unwrap();
    let head = git(&repo, &["rev-parse", "HEAD"]).trim().to_owned();
    let script = c.path().join("edit.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'edit', description: 'changes a file' };\n\
         return await agent('echo edited >> code.txt; echo done');",
    )
    .unwrap();
    let launched = launch_json(&c, &repo, "alice", &script);
    let (src_repo, snapshot) = (
        launched["source"]["repo"].as_str().unwrap().to_owned(),
        launched["source"]["commit"].as_str().unwrap().to_owned(),
    );
    assert!(launched["source"]["uploaded_objects"].as_u64() > Some(0));
    let run = launched["run_id"].as_str().unwrap().to_owned();
    let (code, r) = wait_as(&c, "alice", &run);
    assert_eq!(code, 0, "{r}");
    let changes = c.client_as("alice", &["changes", &run, "--json"]);
    assert_eq!(changes.code, 0, "{changes:?}");
    let changes = changes.json();
    let change = changes["changes"][0]["commit"].as_str().unwrap().to_owned();

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut bob = client_of(&c, "bob");
        // Nothing is confirmed: not the snapshot, not the HEAD both clones share, not the
        // agent's change; asking in team-a's name is refused outright.
        for ns in ["", "team-b"] {
            let got = held(&mut bob, ns, &src_repo, &[&snapshot, &head, &change]).await;
            assert_eq!(got, Ok(Vec::new()), "bob asking in {ns:?}");
        }
        let e = held(&mut bob, "team-a", &src_repo, &[&snapshot])
            .await
            .unwrap_err();
        assert!(e.contains("team-b only"), "{e}");
        // Nothing is sent.
        for commit in [&snapshot, &head, &change] {
            for ns in ["", "team-b", "team-a"] {
                let (bytes, error) = fetched(&mut bob, ns, &src_repo, commit).await;
                assert_eq!(bytes, 0, "{ns:?} {commit}");
                assert!(
                    error.contains("no commit") || error.contains("team-b only"),
                    "{ns:?} {commit}: {error}"
                );
            }
        }
        // A launch naming them is refused as if they did not exist.
        for commit in [&snapshot, &head] {
            let reply = launch_naming(&mut bob, &src_repo, commit).await;
            assert_eq!(reply.status, "rejected", "{reply:?}");
            assert!(reply.error.contains("no commit"), "{}", reply.error);
        }
        // An upload that builds on alice's HEAD without sending it stays unusable.
        let clone = c.path().join("bob-clone");
        let cloned = Command::new("git")
            .args(["clone", "-q"])
            .arg(&repo)
            .arg(&clone)
            .output()
            .unwrap();
        assert!(cloned.status.success(), "{cloned:?}");
        std::fs::write(clone.join("bob.txt"), "bob's\n").unwrap();
        commit_all(&clone, "bob");
        let bobs = git(&clone, &["rev-parse", "HEAD"]).trim().to_owned();
        let thin = pack(&clone, &format!("{bobs}\n^{head}\n"));
        bob.put_source(tokio_stream::iter(vec![v1::SourceUpload {
            repo: src_repo.clone(),
            tip: bobs.clone(),
            prerequisites: vec![head.clone()],
            total_bytes: thin.len() as u64,
            data: thin,
            ..v1::SourceUpload::default()
        }]))
        .await
        .expect("stored, for what it is worth");
        assert_eq!(
            held(&mut bob, "", &src_repo, &[&bobs]).await,
            Ok(Vec::new())
        );
        let reply = launch_naming(&mut bob, &src_repo, &bobs).await;
        assert_eq!(reply.status, "rejected", "{reply:?}");
        // The operator and alice herself still get them.
        let mut ops = client_of(&c, "ops");
        let (bytes, error) = fetched(&mut ops, "team-a", &src_repo, &change).await;
        assert!(bytes > 0 && error.is_empty(), "{bytes} {error}");
        assert_eq!(
            held(&mut ops, "team-a", &src_repo, &[&snapshot]).await,
            Ok(vec![snapshot.clone()])
        );
        let mut alice = client_of(&c, "alice");
        let (bytes, error) = fetched(&mut alice, "", &src_repo, &snapshot).await;
        assert!(bytes > 0 && error.is_empty(), "{bytes} {error}");
    });

    // Bob launching from his own clone of the same project (same repository id) sends every
    // object himself: he borrows nothing of team a's.
    let clone = c.path().join("bob-clone");
    git(&clone, &["reset", "-q", "--hard", &head]);
    let bobs_run = launch_json(&c, &clone, "bob", &script);
    assert_eq!(bobs_run["source"]["repo"], src_repo.as_str());
    assert!(
        bobs_run["source"]["uploaded_objects"].as_u64() > Some(0),
        "{bobs_run}"
    );
    let (code, r) = wait_as(&c, "bob", bobs_run["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    // Alice's changes come home through her namespace; bob cannot apply her run.
    let fresh = c.path().join("alice-fresh");
    flotilla_tests::fresh_clone(&repo, &fresh);
    let applied = c.client_as_in(&fresh, "alice", &["apply", &run, "--merge"]);
    assert_eq!(applied.code, 0, "{applied:?}");
    assert_eq!(
        std::fs::read_to_string(fresh.join("secret.txt")).unwrap(),
        "team a's secret\n"
    );
    let bobs_fresh = c.path().join("bob-fresh");
    let cloned = Command::new("git")
        .args(["clone", "-q"])
        .arg(&repo)
        .arg(&bobs_fresh)
        .output()
        .unwrap();
    assert!(cloned.status.success(), "{cloned:?}");
    let refused = c.client_as_in(&bobs_fresh, "bob", &["apply", &run]);
    assert_ne!(refused.code, 0, "{refused:?}");
    assert!(
        refused.stderr.contains("namespace(s) team-b"),
        "{refused:?}"
    );
    assert_eq!(git(&bobs_fresh, &["branch", "--list", "flotilla/*"]), "");
}

/// `sh` that builds a commit on HEAD with the entries `extra` prints added to its tree (`$b` is
/// a hook script's blob, `$t` a tree `hooks/pre-commit` of it), moves HEAD to it (its files
/// left as they were) and prints it.
fn hostile_prompt(extra: &str) -> String {
    format!(
        "g='git -c user.name=h -c user.email=h@h'; \
         b=$(printf '#!/bin/sh\\necho pwned > /tmp/flotilla-pwned\\n' | $g hash-object -w --stdin); \
         t=$(printf '100755 blob %s\\tpre-commit\\n' $b | $g mktree); \
         t=$(printf '040000 tree %s\\thooks\\n' $t | $g mktree); \
         top=$( ($g ls-tree HEAD; {extra}) | $g mktree); \
         c=$($g commit-tree $top -p HEAD -m hostile); $g reset -q --soft $c; echo $c"
    )
}

#[test]
fn an_agent_s_commit_that_reaches_git_or_leaves_the_tree_is_refused_and_named() {
    // Sandboxed workers, as a fleet runs them.
    let c =
        Cluster::start_workers_with(1, 4, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    flotilla_tests::git_repo(&repo);
    std::fs::write(repo.join("code.txt"), "code\n").unwrap();
    commit_all(&repo, "code");
    let agents = [
        ("dotgit", r"printf '040000 tree %s\t.git\n' $t"),
        ("dotdot", r"printf '100644 blob %s\t..\n' $b"),
        (
            "backslash",
            r"printf '100644 blob %s\t%s\n' $b '..\..\evil'",
        ),
    ];
    let mut calls: Vec<String> = agents
        .iter()
        .map(|(label, entry)| {
            format!(
                "() => agent({}, {{ label: '{label}' }})",
                serde_json::to_string(&hostile_prompt(entry)).unwrap()
            )
        })
        .collect();
    calls.push(
        "() => agent('mkdir -p notes; echo fine > notes/plain.txt; echo plain', { label: 'plain' })"
            .into(),
    );
    let body = format!("return await parallel([{}]);", calls.join(",\n"));
    let script = flotilla_tests::write_workflow(c.path(), "hostile", "hostile commits", &body);
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
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    // Every result stands; each hostile agent's change is refused, by name, with why.
    let results = r["result"].as_array().unwrap();
    let hostile: Vec<String> = results[..3]
        .iter()
        .map(|v| v.as_str().unwrap().trim().to_owned())
        .collect();
    assert!(
        hostile.iter().all(|c| c.len() == 40),
        "each printed its commit: {r}"
    );
    let failures = flotilla_tests::failures(&r);
    for (label, _) in &agents {
        assert!(
            failures
                .iter()
                .any(|f| f.contains(&format!("agent \"{label}\"'s change was refused"))),
            "{label}: {failures:?}"
        );
    }
    assert!(
        failures.iter().any(|f| f.contains("backslash")),
        "{failures:?}"
    );
    assert_eq!(r["changes"]["refused"], 3, "{r}");
    assert_eq!(r["changes"]["merged"], 1, "{r}");
    let changes = c.client(&["changes", &run, "--json"]);
    assert_eq!(changes.code, 0, "{changes:?}");
    let changes = changes.json();
    for ch in changes["changes"].as_array().unwrap() {
        let label = ch["label"].as_str().unwrap();
        if label == "plain" {
            assert!(
                ch["head_after"].is_string() && ch["refused"].is_null(),
                "{ch}"
            );
        } else {
            assert!(
                ch["refused"].is_string() && ch["head_after"].is_null(),
                "{ch}"
            );
        }
    }
    let text = c.client(&["changes", &run]);
    assert_eq!(
        text.stdout.matches("refused:").count(),
        3,
        "{}",
        text.stdout
    );
    // Nothing of theirs is in the store.
    let store = c.path().join("store");
    for commit in &hostile {
        let found = walk(&store)
            .into_iter()
            .filter(|p| p.to_string_lossy().contains(commit.as_str()))
            .collect::<Vec<_>>();
        assert!(found.is_empty(), "{commit}: {found:?}");
    }
    // `apply --merge` brings the plain change and nothing of the others.
    let fresh = c.path().join("fresh");
    flotilla_tests::fresh_clone(&repo, &fresh);
    let applied = c.client_in(&fresh, &["apply", &run, "--merge"]);
    assert_eq!(applied.code, 0, "{applied:?}");
    assert_eq!(
        std::fs::read_to_string(fresh.join("notes/plain.txt")).unwrap(),
        "fine\n"
    );
    assert!(
        applied
            .stderr
            .matches("was refused by the coordinator")
            .count()
            == 3,
        "{applied:?}"
    );
    assert!(!fresh.join(".git/hooks/pre-commit").exists());
    assert!(!Path::new("/tmp/flotilla-pwned").exists());
    for commit in &hostile {
        let there = Command::new("git")
            .arg("-C")
            .arg(&fresh)
            .args(["cat-file", "-e", commit])
            .status()
            .unwrap();
        assert!(!there.success(), "{commit} reached the user's repository");
    }
    let branches = git(&fresh, &["branch", "--list", "flotilla/*"]);
    assert_eq!(
        branches.lines().count(),
        2,
        "the head and the plain agent's: {branches}"
    );
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

/// `flotilla apply` checks what it brings in itself: a commit with a backslash name that a
/// store holds and a run's journal names (planted there, past the coordinator's checks) is
/// refused, naming the agent, and no branch points at it.
#[test]
fn apply_refuses_a_hostile_commit_even_when_the_store_holds_one() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    flotilla_tests::git_repo(&repo);
    let script = flotilla_tests::write_workflow(
        c.path(),
        "plain",
        "one edit",
        "return await agent('echo fine > plain.txt; echo plain', { label: 'plain' });",
    );
    let out = c.client_in(
        &repo,
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--backend",
            "exec",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let launched = out.json();
    let run = launched["run_id"].as_str().unwrap().to_owned();
    let (src_repo, base) = (
        launched["source"]["repo"].as_str().unwrap().to_owned(),
        launched["source"]["commit"].as_str().unwrap().to_owned(),
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    // The planted commit: the source plus a file whose name holds backslashes.
    let blob = git_stdin(&repo, &["hash-object", "-w", "--stdin"], "planted\n");
    let mut top = git(&repo, &["ls-tree", &base]);
    top.push_str(&format!("100644 blob {blob}\t..\\..\\planted\n"));
    let tree = git_stdin(&repo, &["mktree"], &top);
    let planted = git_stdin(
        &repo,
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit-tree",
            &tree,
            "-p",
            &base,
            "-m",
            "planted",
        ],
        "",
    );
    let bytes = pack(&repo, &format!("{planted}\n^{base}\n"));
    let sha = {
        use ring::digest::{SHA256, digest};
        hex::encode(digest(&SHA256, &bytes))
    };
    let sources = c.path().join("store/sources").join(&src_repo);
    std::fs::create_dir_all(sources.join("packs")).unwrap();
    std::fs::create_dir_all(sources.join("commits")).unwrap();
    std::fs::write(sources.join(format!("packs/{sha}.pack")), &bytes).unwrap();
    std::fs::write(
        sources.join(format!("commits/{planted}.json")),
        serde_json::json!({ "pack": sha, "prerequisites": [base] }).to_string(),
    )
    .unwrap();
    let record = serde_json::json!({
        "index": 9, "key": "v1:planted:0", "label": "planted", "group": "", "result": "x",
        "attempts": 1,
        "change": { "commit": planted, "base": base, "files": [], "insertions": 0, "deletions": 0 },
    });
    std::fs::write(
        c.path()
            .join("store/runs")
            .join(&run)
            .join("calls/999999-00000001.jsonl"),
        format!("{record}\n"),
    )
    .unwrap();
    let fresh = c.path().join("fresh");
    let cloned = Command::new("git")
        .args(["clone", "-q"])
        .arg(&repo)
        .arg(&fresh)
        .output()
        .unwrap();
    assert!(cloned.status.success(), "{cloned:?}");
    let refused = c.client_in(&fresh, &["apply", &run, "--agent", "planted"]);
    assert_ne!(refused.code, 0, "{refused:?}");
    assert!(
        refused.stderr.contains("agent #9 \"planted\"") && refused.stderr.contains("backslash"),
        "{refused:?}"
    );
    assert_eq!(git(&fresh, &["branch", "--list", "flotilla/*"]), "");
    // The plain change still comes home.
    let applied = c.client_in(&fresh, &["apply", &run, "--agent", "plain"]);
    assert_eq!(applied.code, 0, "{applied:?}");
}

fn git_stdin(dir: &Path, args: &[&str], input: &str) -> String {
    use std::io::Write;
    let mut child = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "git {args:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
