//! Fleet defects found by trying the landed build as a new user and a hostile one would
//! (issue 11): each test here failed before its fix. Runs one at a time with the other
//! cluster tests (.config/nextest.toml).

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::cluster::Cluster;
use flotilla_tests::{agent, failures};

#[test]
fn a_stall_restart_on_etcd_leaves_the_fleet_dispatching() {
    let etcd = flotilla_tests::services::Etcd::start();
    let c = Cluster::start_with(2, 4, Some(etcd.endpoint()));
    // One agent stalls once and is restarted (its old key deleted and the new one put in
    // one batch), next to one that stalls on every attempt.
    let run = c.launch(
        "stall-etcd",
        "const r = await parallel([\n\
           () => agent('once [[stall:1]]', { label: 'once' }),\n\
           () => agent('always [[stall]]', { label: 'always' }),\n\
           () => agent('fine', { label: 'fine' }),\n\
         ]);\n\
         return r;",
        &[
            "--stagger",
            "0",
            "--stall-timeout",
            "300ms",
            "--attempts",
            "3",
        ],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        serde_json::json!(["once [[stall:1]]", null, "fine"])
    );
    assert_eq!(agent(&r, "once")["attempts"], 2, "{r}");
    assert_eq!(agent(&r, "always")["attempts"], 3, "{r}");
    assert!(
        failures(&r)
            .iter()
            .any(|f| f.contains("stalled on all 3 attempts")),
        "{r}"
    );
    // The coordinator goes on dispatching: a later run completes too.
    let next = c.launch(
        "after-stall",
        "return await agent('after');",
        &["--stagger", "0"],
    );
    let (code, r) = c.wait(&next);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "after");
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap_or_default();
    assert!(
        !log.contains("duplicate key"),
        "etcd refused a batch:\n{log}"
    );
}

#[test]
fn prompts_and_results_over_four_mib_cross_the_fleet_and_an_oversized_one_fails_only_its_call() {
    let c = Cluster::start_workers_with(1, 4, &["--max-result-mib", "8"], Vec::new());
    // The echo agent answers with its prompt: 6 MiB each way, then one over the worker's
    // result limit, next to small ones on the same link.
    let run = c.launch(
        "big",
        "const big = 'x'.repeat(6 * 1024 * 1024);\n\
         const huge = 'y'.repeat(10 * 1024 * 1024);\n\
         const r = await parallel([\n\
           () => agent(big, { label: 'big' }),\n\
           () => agent(huge, { label: 'huge' }),\n\
           () => agent('small', { label: 'small' }),\n\
         ]);\n\
         return r.map(x => x === null ? null : x.length);",
        &["--stagger", "0"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        serde_json::json!([6 * 1024 * 1024, null, 5]),
        "{}",
        r["failures"]
    );
    assert_eq!(agent(&r, "big")["status"], "completed");
    assert_eq!(agent(&r, "big")["attempts"], 1, "the link never dropped");
    let huge = agent(&r, "huge");
    assert_eq!(huge["status"], "failed");
    assert_eq!(huge["attempts"], 1);
    let why = huge["error"].as_str().unwrap();
    assert!(
        why.contains("10.0 MiB") && why.contains("over the limit of 8.0 MiB"),
        "{why}"
    );
    // The worker kept its one link all along, and serves the next run.
    let log = std::fs::read_to_string(c.path().join("worker-0.log")).unwrap_or_default();
    assert_eq!(
        log.matches("attached to the coordinator").count(),
        1,
        "{log}"
    );
    let next = c.launch(
        "after-big",
        "return await agent('after');",
        &["--stagger", "0"],
    );
    let (code, r) = c.wait(&next);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "after");
}

/// Reads until the peer closes (or resets) the connection; `false` if it is still open after
/// `within`.
fn closed_by_peer(s: &mut std::net::TcpStream, within: std::time::Duration) -> bool {
    use std::io::Read;
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn connections_that_never_handshake_or_go_idle_are_closed_and_the_limit_holds() {
    use std::time::Duration;
    let c = Cluster::start_coordinator_with(
        1,
        2,
        &[
            "--handshake-timeout",
            "1s",
            "--idle-timeout",
            "2s",
            "--max-connections",
            "40",
        ],
    );
    // Plain TCP connections that never start TLS, more than the limit allows.
    let mut silent: Vec<std::net::TcpStream> = (0..60)
        .filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", c.port)).ok())
        .collect();
    assert!(silent.len() >= 40, "{} connected", silent.len());
    for s in &mut silent {
        assert!(
            closed_by_peer(s, Duration::from_secs(20)),
            "a connection that never started TLS stayed open"
        );
    }
    // The same on the session pages: an idle connection is closed.
    let mut idle = std::net::TcpStream::connect(("127.0.0.1", c.http_port)).unwrap();
    assert!(closed_by_peer(&mut idle, Duration::from_secs(20)));
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap_or_default();
    for line in [
        "did not finish its TLS handshake in time",
        "connection limit reached",
        "sent and received nothing for the idle timeout",
    ] {
        assert!(log.contains(line), "no {line:?} in the log:\n{log}");
    }
    // Real clients and workers get through.
    let out = c.client(&["workers", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let run = c.launch(
        "after-flood",
        "return await agent('after');",
        &["--stagger", "0"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
}

#[test]
fn pushing_a_workflow_is_a_permission_bundled_names_stay_bundled_and_every_push_is_recorded() {
    let c = Cluster::start(1, 2);
    let file = c.path().join("deep.js");
    let shadow = "export const meta = { name: 'deep-research', description: 'not the real one' };\nreturn 'owned';";
    std::fs::write(&file, shadow).unwrap();
    // A plain client may not push at all, not even a new name.
    let mine = c.path().join("mine.js");
    std::fs::write(
        &mine,
        "export const meta = { name: 'mine', description: 'd' };\nreturn await agent('mine');",
    )
    .unwrap();
    for f in [&file, &mine] {
        let out = c.client(&["workflows", "push", f.to_str().unwrap()]);
        assert_ne!(out.code, 0, "{out:?}");
        assert!(out.stderr.contains("may not push workflows"), "{out:?}");
        assert!(out.stderr.contains("--publisher client"), "{out:?}");
    }
    drop(c);

    let c = Cluster::start_coordinator_with(1, 2, &["--publisher", "client"]);
    let file = c.path().join("deep.js");
    let mine = c.path().join("mine.js");
    std::fs::write(&file, shadow).unwrap();
    std::fs::write(
        &mine,
        "export const meta = { name: 'mine', description: 'd' };\nreturn await agent('mine');",
    )
    .unwrap();
    // A publisher may push, but not over a bundled name.
    let out = c.client(&["workflows", "push", file.to_str().unwrap()]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("bundled workflow"), "{out:?}");
    let out = c.client(&["workflows", "push", mine.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("pushed by client"), "{out:?}");
    let out = c.client(&["workflows", "push", mine.to_str().unwrap()]);
    assert!(out.stdout.starts_with("replaced mine"), "{out:?}");
    // Both pushes are recorded in the store: who, when, the hash, what it replaced.
    let dir = c.path().join("store/workflows/.pushes/mine");
    let mut records: Vec<serde_json::Value> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| serde_json::from_slice(&std::fs::read(e.unwrap().path()).unwrap()).unwrap())
        .collect();
    records.sort_by_key(|r| r["at"].as_str().unwrap().to_owned());
    assert_eq!(records.len(), 2, "{records:?}");
    assert!(
        records
            .iter()
            .all(|r| r["by"] == "client" && r["sha256"].is_string())
    );
    assert!(records[0]["replaced"].is_null());
    assert_eq!(records[1]["replaced"], records[0]["sha256"]);
}

#[test]
fn an_agent_no_worker_can_run_says_why_in_status_and_fails_after_its_wait() {
    use std::time::{Duration, Instant};
    let c = Cluster::start(1, 2);
    let run = c.launch(
        "no-backend",
        "const r = await agent('needs claude', { label: 'needs-claude' });\nreturn r;",
        &[
            "--stagger",
            "0",
            "--backend",
            "claude-code",
            "--worker-wait",
            "4s",
        ],
    );
    let status = || {
        let out = c.client(&["status", &run, "--json"]);
        assert_eq!(out.code, 0, "{out:?}");
        out.json()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let first = loop {
        let s = status();
        if s["waiting"].is_string() {
            break s;
        }
        assert!(Instant::now() < deadline, "status never said why: {s}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let why = first["waiting"].as_str().unwrap();
    assert!(
        why.contains("no attached worker offers backend \"claude-code\""),
        "{why}"
    );
    // elapsed_ms keeps growing while nothing else changes.
    std::thread::sleep(Duration::from_millis(1200));
    let later = status();
    assert!(
        later["elapsed_ms"].as_u64().unwrap() >= first["elapsed_ms"].as_u64().unwrap() + 1000,
        "{first} then {later}"
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"], serde_json::Value::Null);
    let a = agent(&r, "needs-claude");
    assert_eq!(a["status"], "failed");
    let error = a["error"].as_str().unwrap();
    assert!(
        error.contains("claude-code") && error.contains("gave up"),
        "{error}"
    );
    assert!(
        failures(&r)
            .iter()
            .any(|f| f.contains("no attached worker offers")),
        "{r}"
    );
    assert!(
        r["logs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l.as_str().unwrap().starts_with("[wait]")),
        "{r}"
    );
}

#[test]
fn on_the_fleet_a_run_is_resumed_by_one_run_at_a_time_and_not_while_it_is_live() {
    let etcd = flotilla_tests::services::Etcd::start();
    let c = Cluster::start_with(1, 4, Some(etcd.endpoint()));
    let body = "return (await parallel(Array.from({ length: 3 }, (_, i) => () => agent('item ' + i + ' [[sleep:1500]]')))).length;";
    let parent = c.launch("resumed", body, &["--stagger", "0"]);
    // Live: not resumed.
    let script = c.path().join("resumed.js");
    let out = c.client(&[
        "launch",
        script.to_str().unwrap(),
        "--resume",
        &parent,
        "--json",
    ]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("still"), "{out:?}");
    let (code, r) = c.wait(&parent);
    assert_eq!(code, 0, "{r}");
    // An edited script whose new calls take a while: the first resume runs, a second one at
    // the same time is refused and names the first.
    let edited = c.path().join("edited.js");
    std::fs::write(
        &edited,
        format!(
            "export const meta = {{ name: 'resumed', description: 'cluster test' }};\n{}\nawait agent('new [[sleep:2000]]');",
            body.replace("return ", "const n = ")
        ),
    )
    .unwrap();
    let e = edited.to_str().unwrap();
    let out = c.client(&["launch", e, "--resume", &parent, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let first = out.json()["run_id"].as_str().unwrap().to_owned();
    let out = c.client(&["launch", e, "--resume", &parent, "--json"]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains("being resumed already") && out.stderr.contains(&first),
        "{out:?}"
    );
    let (code, r) = c.wait(&first);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["usage"]["cached"], 3, "{r}");
    // Once that one ended, the run can be resumed again.
    let out = c.client(&["launch", e, "--resume", &parent, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let (code, _) = c.wait(out.json()["run_id"].as_str().unwrap());
    assert_eq!(code, 0);
}

#[test]
fn a_fleet_launch_with_the_exec_backend_uses_the_workers_command() {
    let c = Cluster::start_workers_with(
        1,
        2,
        &["--backend", "exec", "--exec-cmd", "printf from-the-worker"],
        Vec::new(),
    );
    let run = c.launch(
        "exec-fleet",
        "return await agent('x');",
        &["--stagger", "0", "--backend", "exec"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "from-the-worker");
}
