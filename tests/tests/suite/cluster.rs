//! The fleet: a coordinator and workers as separate processes over mTLS.
//! (Module name `cluster`: nextest runs these one at a time, see .config/nextest.toml.)

use std::collections::HashMap;
use std::time::{Duration, Instant};

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::cluster::Cluster;
use flotilla_tests::{Env, Output, agents, http_get, usage};
use serde_json::Value;

/// Each journaled call index appears exactly once: no result accepted twice.
fn assert_one_result_per_call(c: &Cluster, run: &str, calls: usize) {
    let journal = c.journal(run);
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for rec in &journal {
        *seen.entry(rec["index"].as_u64().unwrap()).or_default() += 1;
    }
    assert_eq!(seen.len(), calls, "every call journaled");
    assert!(
        seen.values().all(|n| *n == 1),
        "a call was accepted twice: {seen:?}"
    );
}

#[test]
fn fan_out_over_three_workers_matches_the_embedded_run() {
    let c = Cluster::start(3, 8);
    let body = "const r = await parallel(Array.from({ length: 200 }, (_, i) => () => agent('item ' + i, { label: 'a' + i })));\n\
                return { n: r.filter(Boolean).length, first: r[0], last: r[199] };";
    let run = c.launch("fanout", body, &["--stagger", "0", "--concurrency", "24"]);
    let (code, fleet) = c.wait(&run);
    assert_eq!(code, 0, "{fleet}");
    let env = Env::new();
    let (code, local) = env.run_body(body, &["--concurrency", "24"]);
    assert_eq!(code, 0);
    assert_eq!(fleet["result"], local["result"]);
    for counter in [
        "agents",
        "dispatched",
        "cached",
        "attempts",
        "errors",
        "input_tokens",
        "output_tokens",
    ] {
        assert_eq!(usage(&fleet, counter), usage(&local, counter), "{counter}");
    }
    let labels = |r: &Value| {
        agents(r)
            .iter()
            .map(|a| (a["label"].clone(), a["status"].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(labels(&fleet), labels(&local));
    assert_one_result_per_call(&c, &run, 200);
    // The work was spread over the workers.
    let coordinator_log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap();
    assert!(
        coordinator_log.contains("worker attached"),
        "{coordinator_log}"
    );
}

#[test]
fn a_killed_worker_s_calls_finish_on_the_others() {
    let mut c = Cluster::start(3, 4);
    let run = c.launch(
        "kill",
        "return (await parallel(Array.from({ length: 24 }, (_, i) => () => agent('slow ' + i + ' [[sleep:1500]]')))).filter(Boolean).length;",
        &["--stagger", "0", "--concurrency", "12"],
    );
    // Every slot of every worker busy, then a worker is killed in the middle of them.
    wait_until("12 attempts are running", Duration::from_secs(30), || {
        status(&c, &run)["running"].as_u64().unwrap_or(0) >= 12
    });
    c.signal_worker(0, "-9");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 24, "every call completed");
    assert!(
        usage(&r, "attempts") > 24,
        "some calls were restarted: {}",
        r["usage"]
    );
    assert_one_result_per_call(&c, &run, 24);
}

#[test]
fn certificates_decide_who_may_attach_and_launch() {
    let c = Cluster::start(1, 2);
    let bin = &c.bin;
    let other = c.path().join("other");
    for args in [
        vec!["certs", "init", "--dir", other.to_str().unwrap()],
        vec![
            "certs",
            "issue",
            "--dir",
            other.to_str().unwrap(),
            "--name",
            "intruder",
            "--role",
            "worker",
        ],
    ] {
        assert!(
            std::process::Command::new(bin)
                .args(&args)
                .status()
                .unwrap()
                .success()
        );
    }
    let pki = c.pki();
    let run = |args: Vec<String>| {
        let mut cmd = std::process::Command::new(bin);
        cmd.args(args);
        flotilla_tests::run_with_timeout(cmd, Duration::from_secs(60))
    };
    let s = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    // A worker whose certificate comes from another CA.
    let out = run(vec![
        "worker".into(),
        "--coordinator".into(),
        c.url(),
        "--ca".into(),
        s(&pki.join("ca.crt")),
        "--cert".into(),
        s(&other.join("intruder.crt")),
        "--key".into(),
        s(&other.join("intruder.key")),
    ]);
    assert_eq!(out.code, 1);
    assert!(
        out.stderr.contains("refused this worker") && out.stderr.contains("certificate"),
        "{}",
        out.stderr
    );
    // A client certificate used to attach as a worker.
    let out = run(vec![
        "worker".into(),
        "--coordinator".into(),
        c.url(),
        "--tls-dir".into(),
        s(&pki),
        "--name".into(),
        "client".into(),
    ]);
    assert_eq!(out.code, 1);
    assert!(
        out.stderr
            .contains("role client and may not attach as a worker"),
        "{}",
        out.stderr
    );
    // A client with no certificate at all cannot even start.
    let out = run(vec!["workers".into(), "--coordinator".into(), c.url()]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("--tls-dir"), "{}", out.stderr);
    // A worker certificate cannot launch or list.
    let out = run(vec![
        "workers".into(),
        "--coordinator".into(),
        c.url(),
        "--tls-dir".into(),
        s(&pki),
        "--name".into(),
        "worker-0".into(),
    ]);
    assert_eq!(out.code, 1);
    assert!(
        out.stderr.contains("role worker and may not list workers"),
        "{}",
        out.stderr
    );
    // The rightful worker is still the only one attached.
    let listed = c.client(&["workers", "--json"]).json();
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert!(
        listed[0]["name"].as_str().unwrap().starts_with("worker-0"),
        "{listed}"
    );
}

#[test]
fn launch_returns_at_once_and_status_stop_and_runs_work_remotely() {
    let c = Cluster::start(1, 2);
    let started = Instant::now();
    let run = c.launch(
        "long",
        "return await agent('slow [[sleep:30000]]');",
        &["--stagger", "0"],
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "launch returns without waiting for the run"
    );
    let status = c.client(&["status", &run, "--json"]);
    assert_eq!(status.code, 0, "{status:?}");
    assert_eq!(status.json()["run_id"], run.as_str());
    let stop = c.client(&["stop", &run]);
    assert_eq!(stop.code, 0, "{stop:?}");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 1);
    assert_eq!(r["status"], "stopped");
    let runs = c.client(&["runs", "--json"]).json();
    assert!(
        runs.as_array()
            .unwrap()
            .iter()
            .any(|x| x["run_id"] == run.as_str() && x["status"] == "stopped"),
        "{runs}"
    );
    // A rejected launch says why and exits 2.
    let script = c.path().join("bad.js");
    std::fs::write(
        &script,
        "export const meta = { name: x, description: 'y' };",
    )
    .unwrap();
    let out = c.client(&["launch", script.to_str().unwrap()]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("variable reference"), "{}", out.stderr);
    let missing = c.client(&["wait", "wf_00000000-000"]);
    assert_eq!(missing.code, 2, "{missing:?}");
    // A run the coordinator does not have is not found, with --json too, for every command
    // that names one (issue 30: the kind comes from the answer, not from the exit status).
    for cmd in ["wait", "status", "stop", "agents", "changes"] {
        let out = c.client(&[cmd, "wf_00000000-000", "--json"]);
        assert_eq!(out.code, 2, "{cmd}: {out:?}");
        let v: serde_json::Value = serde_json::from_str(out.stdout.trim())
            .unwrap_or_else(|e| panic!("{cmd}: not one JSON object ({e}): {out:?}"));
        assert_eq!(v["error"]["code"], "not_found", "{cmd}: {v}");
    }
}

#[test]
fn a_frozen_worker_s_late_outcomes_are_fenced_off() {
    let mut c = Cluster::start(2, 4);
    // No stall watchdog here: the frozen worker's lease must be what restarts its calls.
    let run = c.launch(
        "frozen",
        "return (await parallel(Array.from({ length: 8 }, (_, i) => () => agent('job ' + i + ' [[sleep:1500]]')))).filter(Boolean).length;",
        &["--stagger", "0", "--concurrency", "8", "--stall-timeout", "10m"],
    );
    wait_until(
        "both workers run 4 attempts",
        Duration::from_secs(30),
        || status(&c, &run)["running"].as_u64().unwrap_or(0) >= 8,
    );
    c.signal_worker(0, "-STOP");
    // Past its lease TTL (plus the keep-alive pings that find its stream dead), the lease
    // lapses and its calls restart on worker 1; then it wakes up and answers late.
    wait_for_log(
        &c,
        "coordinator.log",
        &["lease lapsed"],
        Duration::from_secs(30),
    );
    // Its calls run again on worker 1 when it wakes up.
    wait_until(
        "the restarted attempts run",
        Duration::from_secs(30),
        || status(&c, &run)["running"].as_u64().unwrap_or(0) >= 4,
    );
    c.signal_worker(0, "-CONT");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 8);
    assert_one_result_per_call(&c, &run, 8);
    // The woken worker reconnects and reports what it held; every such outcome is refused.
    wait_for_log(
        &c,
        "coordinator.log",
        &["no longer current (fenced)"],
        Duration::from_secs(20),
    );
    assert_one_result_per_call(&c, &run, 8);
}

#[test]
fn a_worker_cut_off_briefly_keeps_its_attempts() {
    let c = Cluster::start_proxied(2, 4);
    let run = c.launch(
        "cut",
        "return (await parallel(Array.from({ length: 8 }, (_, i) => () => agent('job ' + i + ' [[sleep:2500]]')))).filter(Boolean).length;",
        &["--stagger", "0", "--concurrency", "8", "--stall-timeout", "10m"],
    );
    wait_until("8 attempts are running", Duration::from_secs(30), || {
        status(&c, &run)["running"].as_u64().unwrap_or(0) >= 8
    });
    // Both workers lose their streams mid-attempt and reconnect within the lease TTL.
    c.proxy.as_ref().unwrap().cut();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 8);
    assert_eq!(
        usage(&r, "attempts"),
        8,
        "no call was restarted: {}",
        r["usage"]
    );
    assert_one_result_per_call(&c, &run, 8);
    wait_for_log(
        &c,
        "coordinator.log",
        &["worker reattached"],
        Duration::from_secs(5),
    );
}

/// Waits until `file` in the cluster's directory contains one of `needles`.
fn wait_for_log(c: &Cluster, file: &str, needles: &[&str], within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let log = std::fs::read_to_string(c.path().join(file)).unwrap_or_default();
        if needles.iter().any(|n| log.contains(n)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{file} never said any of {needles:?}:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn worker_leases_live_in_etcd_and_a_restart_of_etcd_does_not_fail_the_run() {
    let mut etcd = flotilla_tests::services::Etcd::start();
    let c = Cluster::start_with(2, 4, Some(etcd.endpoint()));
    // The workers are registered in etcd under their leases.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let listed = std::process::Command::new("etcdctl")
            .args([
                "--endpoints",
                &etcd.endpoint(),
                "get",
                "--prefix",
                "--keys-only",
                "/flotilla/workers/",
            ])
            .env("ETCDCTL_API", "3")
            .output()
            .unwrap();
        let keys = String::from_utf8_lossy(&listed.stdout).into_owned();
        if keys
            .lines()
            .filter(|l| l.starts_with("/flotilla/workers/"))
            .count()
            == 2
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "workers not registered in etcd: {keys:?} {}; coordinator log:\n{}",
            String::from_utf8_lossy(&listed.stderr),
            std::fs::read_to_string(c.path().join("coordinator.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let run = c.launch(
        "etcd-restart",
        "return (await parallel(Array.from({ length: 12 }, (_, i) => () => agent('job ' + i + ' [[sleep:800]]')))).filter(Boolean).length;",
        &["--stagger", "0", "--concurrency", "4"],
    );
    wait_until("attempts are running", Duration::from_secs(30), || {
        status(&c, &run)["running"].as_u64().unwrap_or(0) >= 4
    });
    etcd.restart();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 12);
    assert_one_result_per_call(&c, &run, 12);
}

#[test]
fn leases_live_in_an_etcd_that_requires_tls_client_certificates() {
    let (c, etcd) = Cluster::start_with_tls_etcd(2, 4);
    let run = c.launch(
        "etcd-tls",
        "return (await parallel(Array.from({ length: 16 }, (_, i) => () => agent('job ' + i + ' [[sleep:300]]')))).filter(Boolean).length;",
        &["--stagger", "0", "--concurrency", "8"],
    );
    // While the calls run, their attempt keys sit in etcd under the workers' leases.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = etcd
            .etcdctl(&["get", "--prefix", "--keys-only", "/flotilla/"])
            .unwrap();
        let keys = String::from_utf8_lossy(&out.stdout).into_owned();
        let attempts = keys
            .lines()
            .filter(|l| l.starts_with("/flotilla/attempts/"))
            .count();
        let workers = keys
            .lines()
            .filter(|l| l.starts_with("/flotilla/workers/"))
            .count();
        if attempts > 0 && workers == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no attempt keys in etcd: {keys:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 16);
    assert_one_result_per_call(&c, &run, 16);
    // Finished attempts take their keys with them.
    let out = etcd
        .etcdctl(&["get", "--prefix", "--keys-only", "/flotilla/attempts/"])
        .unwrap();
    let left = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(left.is_empty(), "attempt keys left behind: {left}");

    // A coordinator that does not trust etcd's certificate says so and stops.
    let other = c.path().join("other-ca");
    let status = std::process::Command::new(&c.bin)
        .args(["certs", "init", "--dir"])
        .arg(&other)
        .status()
        .unwrap();
    assert!(status.success());
    let mut cmd = std::process::Command::new(&c.bin);
    cmd.args([
        "coordinator",
        "--listen",
        &format!("127.0.0.1:{}", flotilla_tests::cluster::free_port()),
    ])
    .arg("--store")
    .arg(c.store_url())
    .arg("--tls-dir")
    .arg(c.pki())
    .args(["--etcd", &etcd.endpoint(), "--etcd-ca"])
    .arg(other.join("ca.crt"));
    let out = flotilla_tests::run_with_timeout(cmd, Duration::from_secs(60));
    assert_ne!(out.code, 0, "{}", out.stderr);
    assert!(out.stderr.contains("etcd"), "{}", out.stderr);
}

#[test]
fn session_pages_need_a_token_from_a_client_certificate() {
    let c = Cluster::start(1, 4);
    let launched = c.client(&[
        "launch",
        &{
            let script = c.path().join("page.js");
            std::fs::write(
                &script,
                "export const meta = { name: 'page', description: 'session page test' };\n\
                 return (await parallel(Array.from({ length: 6 }, (_, i) => () => agent('job ' + i + ' [[sleep:1500]]')))).filter(Boolean).length;\n",
            )
            .unwrap();
            script.to_str().unwrap().to_owned()
        },
        "--json",
        "--stagger",
        "0",
    ]);
    assert_eq!(launched.code, 0, "{launched:?}");
    let v = launched.json();
    let run = v["run_id"].as_str().unwrap().to_owned();
    let session = v["session_url"].as_str().unwrap().to_owned();
    let page_path = format!("/runs/{run}");
    assert_eq!(
        session,
        format!("http://127.0.0.1:{}{page_path}", c.http_port)
    );

    // No token: refused, with the way in.
    let r = http_get(c.http_port, &page_path, &[]);
    assert_eq!(r.status, 401, "{r:?}");
    assert!(r.body.contains("flotilla token create"), "{}", r.body);
    let r = http_get(c.http_port, &format!("{page_path}/status.json"), &[]);
    assert_eq!(r.status, 401, "{r:?}");
    assert_eq!(http_get(c.http_port, "/runs.json", &[]).status, 401);
    for path in [
        format!("{page_path}/events"),
        format!("{page_path}/agents/0"),
    ] {
        assert_eq!(http_get(c.http_port, &path, &[]).status, 401, "{path}");
    }
    let post = flotilla_tests::http_request(
        c.http_port,
        "POST",
        &format!("{page_path}/control"),
        &[("Content-Type", "application/json"), ("x-flotilla", "1")],
        Some(r#"{"action":"stop"}"#),
    );
    assert_eq!(post.status, 401, "{post:?}");
    // A made-up token: refused.
    let r = http_get(
        c.http_port,
        &page_path,
        &[("Authorization", "Bearer v1.e30.AAAA")],
    );
    assert_eq!(r.status, 401, "{r:?}");

    // A client certificate gets a token; the sign-in link sets the cookie.
    let t = c.client(&["token", "create", "--json", "--ttl", "1h"]);
    assert_eq!(t.code, 0, "{t:?}");
    let t = t.json();
    let token = t["token"].as_str().unwrap().to_owned();
    assert_eq!(t["subject"], "client");
    let login = t["login_url"].as_str().unwrap();
    let login_path = login.split_once(&format!(":{}", c.http_port)).unwrap().1;
    let r = http_get(c.http_port, &format!("{login_path}&next={page_path}"), &[]);
    assert_eq!(r.status, 303, "{r:?}");
    assert_eq!(r.header("location"), Some(page_path.as_str()));
    let cookie = r.header("set-cookie").expect("a session cookie").to_owned();
    assert!(cookie.contains("HttpOnly"), "{cookie}");
    let cookie = cookie.split(';').next().unwrap().to_owned();

    let r = http_get(c.http_port, &page_path, &[("Cookie", &cookie)]);
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        r.body.contains(&run) && r.body.contains("page"),
        "{}",
        r.body
    );
    let bearer = format!("Bearer {token}");
    let r = http_get(
        c.http_port,
        &format!("{page_path}/status.json"),
        &[("Authorization", &bearer)],
    );
    assert_eq!(r.status, 200, "{r:?}");
    let live: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(live["run_id"], run.as_str());
    assert!(live["agents"].as_u64().unwrap() <= 6, "{live}");

    // After the end, the page shows the report.
    let (code, report) = c.wait(&run);
    assert_eq!(code, 0, "{report}");
    let r = http_get(
        c.http_port,
        &format!("{page_path}/status.json"),
        &[("Authorization", &bearer)],
    );
    let done: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(done["finished"], true, "{done}");
    assert_eq!(done["report"]["result"], 6);
    let r = http_get(c.http_port, "/runs.json", &[("Authorization", &bearer)]);
    assert_eq!(r.status, 200);
    assert!(r.body.contains(&run), "{}", r.body);

    // A second run whose only agent stalls once, for the stall and restart counters.
    let stally = c.launch(
        "stally",
        "return await agent('slow start [[stall:1]]');",
        &["--stall-timeout", "300ms"],
    );
    let (code, stalled) = c.wait(&stally);
    assert_eq!(code, 0, "{stalled}");
    assert_eq!(stalled["usage"]["attempts"], 2);

    // Prometheus metrics, behind the same sign-in; they agree with the reports.
    assert_eq!(http_get(c.http_port, "/metrics", &[]).status, 401);
    let m = http_get(c.http_port, "/metrics", &[("Authorization", &bearer)]);
    assert_eq!(m.status, 200, "{m:?}");
    let value = |line_start: &str| -> f64 {
        m.body
            .lines()
            .find(|l| l.starts_with(line_start))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {line_start} in:\n{}", m.body))
    };
    for line in m.body.lines().filter(|l| !l.starts_with('#')) {
        let (name, v) = line.rsplit_once(' ').expect("name value");
        assert!(v.parse::<f64>().is_ok(), "not a sample: {line}");
        assert!(name.starts_with("flotilla_"), "{line}");
    }
    assert_eq!(value("flotilla_runs{status=\"completed\"}"), 2.0);
    assert_eq!(value("flotilla_agents{status=\"done\"}"), 7.0);
    let attempts = report["usage"]["attempts"].as_f64().unwrap() + 2.0;
    assert_eq!(value("flotilla_attempts_assigned_total"), attempts);
    assert_eq!(value("flotilla_queue_wait_seconds_count"), attempts);
    assert_eq!(
        value("flotilla_queue_wait_seconds_bucket{le=\"+Inf\"}"),
        attempts
    );
    assert_eq!(value("flotilla_stalls_total"), 1.0);
    assert_eq!(value("flotilla_restarts_total{reason=\"stall\"}"), 1.0);
    assert_eq!(value("flotilla_restarts_total{reason=\"user\"}"), 0.0);
    assert_eq!(value("flotilla_lease_renewal_failures_total"), 0.0);
    assert!(value("flotilla_storage_write_seconds_count") > 0.0);
    assert_eq!(value("flotilla_workers{state=\"attached\"}"), 1.0);
}

/// `flotilla status RUN --json`.
fn status(c: &Cluster, run: &str) -> Value {
    let out = c.client(&["status", run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    out.json()
}

fn wait_until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_run_pauses_resumes_and_its_agents_stop_and_restart_one_by_one() {
    let c = Cluster::start(1, 4);
    let run = c.launch(
        "life",
        "const r = await parallel(Array.from({ length: 6 }, (_, i) => () => \
           agent('job ' + i + (i === 0 ? ' [[sleep:5000]]' : ' [[sleep:1200]]'), { label: 'a' + i })));\n\
         return r.map(x => x === null ? null : 'ok');",
        &["--stagger", "0", "--concurrency", "2"],
    );
    wait_until("an agent runs", Duration::from_secs(20), || {
        status(&c, &run)["running"].as_u64().unwrap_or(0) > 0
    });

    // Pause: what runs is interrupted and nothing new starts.
    let out = c.client(&["pause", &run]);
    assert_eq!(out.code, 0, "{out:?}");
    wait_until(
        "the run is paused and idle",
        Duration::from_secs(10),
        || {
            let s = status(&c, &run);
            s["status"] == "paused" && s["running"] == 0
        },
    );
    let done = status(&c, &run)["done"].clone();
    std::thread::sleep(Duration::from_millis(1500));
    let s = status(&c, &run);
    assert_eq!(s["done"], done, "nothing finished while paused: {s}");
    assert_eq!(s["running"], 0, "{s}");

    let out = c.client(&["resume", &run]);
    assert_eq!(out.code, 0, "{out:?}");
    // a0 was interrupted and goes first again; restart it once it runs.
    wait_until("a0 is restarted", Duration::from_secs(20), || {
        c.client(&["restart", &run, "--agent", "a0"]).code == 0
    });
    // Stop a5 (queued or running): its agent() resolves null.
    let out = c.client(&["stop", &run, "--agent", "a5"]);
    assert_eq!(out.code, 0, "{out:?}");
    // Agent names are checked.
    let out = c.client(&["restart", &run, "--agent", "nobody"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("no agent labeled"), "{out:?}");

    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        serde_json::json!(["ok", "ok", "ok", "ok", "ok", null]),
        "{r}"
    );
    let a0 = r["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["label"] == "a0")
        .unwrap();
    assert!(a0["attempts"].as_u64().unwrap() >= 2, "restarted: {a0}");
    let failures = r["failures"].to_string();
    assert!(failures.contains("stopped by the user"), "{failures}");
    assert_one_result_per_call(&c, &run, 5);
}

#[test]
fn runs_live_in_s3_and_any_coordinator_reads_them_back() {
    let s3 = flotilla_tests::services::S3::start();
    let url = format!("s3://{}/fleet", s3.bucket);
    let mut c = Cluster::start_full(2, 4, None, Some((url.clone(), s3.env())));
    let run = c.launch(
        "s3",
        "const r = await parallel(Array.from({ length: 30 }, (_, i) => () => agent('item ' + i)));\nreturn r.length;",
        &["--stagger", "0"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 30);
    // Restart the coordinator: the finished run is read back from S3.
    if let Some(mut old) = c.take_coordinator() {
        let _ = old.kill();
        let _ = old.wait();
    }
    c.start_coordinator();
    c.wait_for_workers(2);
    let (code, again) = c.wait(&run);
    assert_eq!(code, 0, "{again}");
    assert_eq!(again["result"], 30);
    assert_eq!(again["usage"], r["usage"]);
    // Resume through the new coordinator: everything is served from the journal in S3.
    let resumed = c.launch(
        "s3",
        "const r = await parallel(Array.from({ length: 30 }, (_, i) => () => agent('item ' + i)));\nreturn r.length;",
        &["--stagger", "0", "--resume", &run],
    );
    let (code, rr) = c.wait(&resumed);
    assert_eq!(code, 0, "{rr}");
    assert_eq!(rr["usage"]["cached"], 30);
    assert_eq!(rr["usage"]["dispatched"], 0);
}

const STAGES: &str = "const items = await parallel(Array.from({ length: 6 }, (_, i) => () => \
    agent((i === 3 ? ITEM3 : 'item ' + i) + ' [[sleep:' + (400 - i * 50) + ']]')));\n\
    const summary = await agent('summarize ' + items.length);\n\
    const extra = await workflow('helper', { n: items.length });\n\
    return [items.length, summary, extra];";

fn stages_script(c: &Cluster, name: &str, item3: &str) -> String {
    let path = c.path().join(format!("{name}.js"));
    std::fs::write(
        &path,
        format!(
            "export const meta = {{ name: 'stages', description: 'resume test' }};\nconst ITEM3 = '{item3}';\n{STAGES}\n"
        ),
    )
    .unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn a_run_resumes_on_another_coordinator_process_in_both_modes() {
    let s3 = flotilla_tests::services::S3::start();
    let url = format!("s3://{}/resume", s3.bucket);
    let mut c = Cluster::start_full(2, 4, None, Some((url, s3.env())));
    // A saved workflow the launching client carries: a resume and a takeover need it too.
    std::fs::create_dir_all(c.path().join(".flotilla/workflows")).unwrap();
    std::fs::write(
        c.path().join(".flotilla/workflows/helper.js"),
        "export const meta = { name: 'helper', description: 'child' };\nreturn await agent('helper for ' + args.n);\n",
    )
    .unwrap();
    let first = stages_script(&c, "first", "item 3");
    let out = c.client(&["launch", &first, "--json", "--stagger", "0"]);
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["usage"]["dispatched"], 8, "{r}");

    // The coordinator that ran it is gone; another process takes over the store.
    if let Some(mut old) = c.take_coordinator() {
        let _ = old.kill();
        let _ = old.wait();
    }
    c.start_coordinator();
    c.wait_for_workers(2);

    let resume = |extra: &[&str]| -> Value {
        let mut args = vec!["resume", run.as_str(), "--json"];
        args.extend_from_slice(extra);
        let out = c.client(&args);
        assert_eq!(out.code, 0, "{out:?}");
        let id = out.json()["run_id"].as_str().unwrap().to_owned();
        let (code, r) = c.wait(&id);
        assert_eq!(code, 0, "{r}");
        assert_eq!(r["parent_run_id"], run.as_str(), "{r}");
        r
    };
    // Same script (stored with the run), content mode: nothing runs again.
    let same = resume(&[]);
    assert_eq!(same["usage"]["cached"], 8, "{}", same["usage"]);
    assert_eq!(same["usage"]["dispatched"], 0);
    assert_eq!(same["result"], r["result"]);

    // One prompt edited: content mode runs only that call.
    let edited = stages_script(&c, "edited", "item three");
    let content = resume(&["--script", &edited]);
    assert_eq!(content["usage"]["dispatched"], 1, "{}", content["usage"]);
    assert_eq!(content["usage"]["cached"], 7);

    // Prefix mode (W51): the edited call and every call started after it run again.
    let prefix = resume(&["--script", &edited, "--replay", "prefix"]);
    assert_eq!(prefix["usage"]["dispatched"], 5, "{}", prefix["usage"]);
    assert_eq!(prefix["usage"]["cached"], 3);

    // An unknown run: nothing to resume.
    let out = c.client(&["resume", "wf_00000000000000000000000000", "--json"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("nothing to resume"), "{out:?}");
}

#[test]
fn a_run_is_not_resumed_while_its_agents_still_run() {
    let c = Cluster::start(1, 4);
    let run = c.launch(
        "alive",
        "return (await parallel(Array.from({ length: 4 }, (_, i) => () => agent('slow ' + i + ' [[sleep:3000]]')))).length;",
        &["--stagger", "0"],
    );
    wait_until("an agent runs", Duration::from_secs(20), || {
        status(&c, &run)["running"].as_u64().unwrap_or(0) > 0
    });
    let script = c.path().join("alive.js");
    let out = c.client(&["launch", script.to_str().unwrap(), "--resume", &run]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("still has"), "{out:?}");
    // A running run is not "resumed" either.
    let out = c.client(&["resume", &run]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("running already"), "{out:?}");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
}

#[test]
fn an_s3_outage_of_twenty_seconds_pauses_the_run_and_loses_nothing() {
    let s3 = flotilla_tests::services::S3::start();
    let url = format!("s3://{}/outage", s3.bucket);
    let c = Cluster::start_full(2, 4, None, Some((url, s3.env())));
    let run = c.launch(
        "s3-outage",
        "return (await parallel(Array.from({ length: 40 }, (_, i) => () => agent('job ' + i + ' [[sleep:400]]')))).filter(Boolean).length;",
        &["--stagger", "0", "--concurrency", "8"],
    );
    wait_until("some agents finished", Duration::from_secs(20), || {
        status(&c, &run)["done"].as_u64().unwrap_or(0) >= 4
    });
    s3.freeze(true);
    std::thread::sleep(Duration::from_secs(20));
    // Results reach the script only once their journal segment is stored: the run cannot
    // have finished while the store was out.
    let during = status(&c, &run);
    s3.freeze(false);
    assert_eq!(during["status"], "running", "{during}");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 40);
    assert_one_result_per_call(&c, &run, 40);
}

#[test]
fn an_etcd_outage_of_ten_seconds_does_not_fail_the_run() {
    let mut etcd = flotilla_tests::services::Etcd::start();
    let c = Cluster::start_with(2, 4, Some(etcd.endpoint()));
    let run = c.launch(
        "etcd-outage",
        "return (await parallel(Array.from({ length: 30 }, (_, i) => () => agent('job ' + i + ' [[sleep:500]]')))).filter(Boolean).length;",
        &["--stagger", "0", "--concurrency", "8"],
    );
    wait_until("some agents finished", Duration::from_secs(20), || {
        status(&c, &run)["done"].as_u64().unwrap_or(0) >= 4
    });
    etcd.kill();
    std::thread::sleep(Duration::from_secs(10));
    etcd.restart();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 30);
    assert_one_result_per_call(&c, &run, 30);
}

#[test]
fn a_killed_coordinator_s_run_is_adopted_by_the_standby_and_completes() {
    let etcd = flotilla_tests::services::Etcd::start();
    let s3 = flotilla_tests::services::S3::start();
    let url = format!("s3://{}/failover", s3.bucket);
    let mut c = Cluster::start_group(3, 4, etcd.endpoint(), (url, s3.env()));
    // A client can talk to either coordinator: the standby forwards to the leader.
    let script = c.path().join("fanout.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'fanout', description: 'failover test' };\n\
         return (await parallel(Array.from({ length: 300 }, (_, i) => () => agent('job ' + i + ' [[sleep:300]]')))).filter(Boolean).length;\n",
    )
    .unwrap();
    let out = c.client_at(
        &c.standby_url(),
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--concurrency",
            "12",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    wait_until("60 calls are journaled", Duration::from_secs(60), || {
        c.journal(&run).len() >= 60
    });
    let mut leader = c.take_coordinator().unwrap();
    leader.kill().unwrap();
    leader.wait().unwrap();
    let before = c.journal(&run).len();
    assert!(
        before < 300,
        "the kill came too late to test anything ({before} done)"
    );

    // The standby takes over within the lease TTL and finishes the run.
    let out = c.client_at(&c.standby_url(), &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    assert_eq!(r["result"], 300, "{r}");
    assert_one_result_per_call(&c, &run, 300);
    let cached = r["usage"]["cached"].as_u64().unwrap();
    assert!(
        cached >= before as u64,
        "every call completed before the kill is served from storage: {cached} cached, {before} journaled before the kill"
    );
    assert_eq!(
        r["usage"]["cached"].as_u64().unwrap() + r["usage"]["dispatched"].as_u64().unwrap(),
        300,
        "{}",
        r["usage"]
    );
    // The run's usage is the whole run's, not only what the adopter ran: every agent took
    // at least one attempt and spent its tokens, before the kill or after.
    let agents = r["agents"].as_array().unwrap();
    assert_eq!(agents.len(), 300);
    assert!(
        agents
            .iter()
            .all(|a| a["attempts"].as_u64() >= Some(1) && a["output_tokens"].as_u64() > Some(0)),
        "an agent with no attempt or no tokens: {r}"
    );
    let sum = |field: &str| {
        agents
            .iter()
            .map(|a| a[field].as_u64().unwrap())
            .sum::<u64>()
    };
    assert_eq!(r["usage"]["attempts"].as_u64(), Some(sum("attempts")));
    assert!(sum("attempts") >= 300);
    assert_eq!(
        r["usage"]["output_tokens"].as_u64(),
        Some(sum("output_tokens"))
    );
    assert_eq!(
        r["usage"]["input_tokens"].as_u64(),
        Some(sum("input_tokens"))
    );
    let log = std::fs::read_to_string(c.path().join("standby.log")).unwrap();
    assert!(log.contains("adopted a run"), "{log}");
    // Attempts in flight at the kill were not thrown away: the workers kept them and the new
    // leader took them over.
    assert!(
        log.contains("re-attached an attempt that outlived its coordinator"),
        "{log}"
    );
}

#[test]
fn a_coordinator_with_a_store_that_does_not_answer_says_so() {
    let s3 = flotilla_tests::services::S3::start();
    let mut env = s3.env();
    // Nothing listens here.
    env[0].1 = format!("http://127.0.0.1:{}", flotilla_tests::cluster::free_port());
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(flotilla_tests::binary());
    cmd.args([
        "coordinator",
        "--insecure",
        "--listen",
        &format!("127.0.0.1:{}", flotilla_tests::cluster::free_port()),
        "--store",
        "s3://runs/x",
    ])
    .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    .current_dir(dir.path());
    let out = flotilla_tests::run_with_timeout(cmd, Duration::from_secs(120));
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr
            .contains("cannot use store s3://runs/x: nothing answers at"),
        "{}",
        out.stderr
    );
}

#[test]
fn the_distributed_benchmark_runs_and_reports_its_figures() {
    let env = Env::new();
    let out = env.flotilla(&[
        "bench",
        "fanout",
        "--distributed",
        "--calls",
        "300",
        "--concurrency",
        "16",
        "--workers",
        "2",
        "--json",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    for field in [
        "raw_rpc_per_s",
        "memory_calls_per_s",
        "durable_calls_per_s",
        "overhead_ratio",
    ] {
        assert!(r[field].as_f64().is_some_and(|v| v > 0.0), "{field} in {r}");
    }
    assert_eq!(r["calls"], 300);
}

#[test]
fn fleet_commands_read_their_settings_from_a_config_file() {
    let c = Cluster::start(1, 2);
    let pki = c.pki();
    // A second worker configured only by file.
    assert!(
        std::process::Command::new(&c.bin)
            .args([
                "certs",
                "issue",
                "--role",
                "worker",
                "--name",
                "from-file",
                "--dir"
            ])
            .arg(&pki)
            .status()
            .unwrap()
            .success()
    );
    let worker_toml = c.path().join("worker.toml");
    std::fs::write(
        &worker_toml,
        format!(
            "coordinator = \"{}\"\ntls_dir = \"{}\"\nname = \"from-file\"\nslots = 3\nbackends = [\"echo\"]\nworkspace = \"{}\"\n",
            c.url(),
            pki.display(),
            c.path().join("ws-file").display()
        ),
    )
    .unwrap();
    let mut worker = std::process::Command::new(&c.bin)
        .args(["worker", "--config"])
        .arg(&worker_toml)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    c.wait_for_workers(2);
    // A client configured only by file.
    let client_toml = c.path().join("client.toml");
    std::fs::write(
        &client_toml,
        format!(
            "coordinator = \"{}\"\ntls_dir = \"{}\"\nname = \"client\"\n",
            c.url(),
            pki.display()
        ),
    )
    .unwrap();
    let out = flotilla_tests::run_with_timeout(
        {
            let mut cmd = std::process::Command::new(&c.bin);
            cmd.args(["workers", "--json", "--config"])
                .arg(&client_toml);
            cmd
        },
        Duration::from_secs(60),
    );
    let _ = worker.kill();
    let _ = worker.wait();
    assert_eq!(out.code, 0, "{out:?}");
    let listed = out.json();
    let w = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["name"].as_str().unwrap().starts_with("from-file"))
        .expect("the file-configured worker");
    assert_eq!(w["slots"], 3);
    // Unknown keys are refused with the key named.
    std::fs::write(&client_toml, "coordinatr = \"x\"\n").unwrap();
    let bad = flotilla_tests::run_with_timeout(
        {
            let mut cmd = std::process::Command::new(&c.bin);
            cmd.args(["workers", "--config"]).arg(&client_toml);
            cmd
        },
        Duration::from_secs(60),
    );
    assert_eq!(bad.code, 2);
    assert!(bad.stderr.contains("coordinatr"), "{}", bad.stderr);
}

#[test]
fn watch_follows_a_fleet_run_with_plain_lines_and_ends_with_its_report() {
    let c = Cluster::start(1, 4);
    let run = c.launch(
        "watched",
        "phase('Gather');\nlog('starting');\n\
         const r = await parallel([1, 2, 3].map(i => () => agent('w' + i + ' [[sleep:600]]')));\n\
         return r.length;",
        &["--stagger", "0"],
    );
    let out = c.client(&["watch", &run]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("log: starting"), "{}", out.stderr);
    assert!(
        out.stderr.contains("[Gather] 3/3 agents done"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.contains('3'), "the result: {}", out.stdout);
    // Once ended, watch prints the stored report at once.
    let again = c.client(&["watch", &run, "--json"]);
    assert_eq!(again.code, 0, "{again:?}");
    assert_eq!(again.json()["result"], 3);
    let missing = c.client(&["watch", "wf_00000000-000"]);
    assert_ne!(missing.code, 0);

    // Transcripts through the coordinator, without access to its store.
    let logs = c.client(&["logs", &run, "--agent", "0"]);
    assert_eq!(logs.code, 0, "{logs:?}");
    assert!(logs.stdout.contains("== #0"), "{}", logs.stdout);
    assert!(
        logs.stdout.contains("text: w1 [[sleep:600]]"),
        "{}",
        logs.stdout
    );
    let json = c.client(&["logs", &run, "--json"]);
    assert_eq!(json.code, 0, "{json:?}");
    let lines: Vec<Value> = json
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for agent in 0..3 {
        assert!(lines.iter().any(|l| l["agent"] == agent), "{lines:?}");
    }
    let nobody = c.client(&["logs", &run, "--agent", "nobody"]);
    assert_eq!(nobody.code, 2, "{nobody:?}");
    assert!(nobody.stderr.contains("no agent \"nobody\""), "{nobody:?}");
}

/// One trace per run, across coordinator and worker, in the OpenTelemetry GenAI conventions:
/// each attempt an `invoke_agent {label}` span with the `gen_ai.*` attributes (usage, models,
/// `error.type` of a failure), Flotilla's own under `flotilla.`; the agent's process gets the
/// attempt's `TRACEPARENT`.
#[test]
fn one_trace_per_run_reaches_an_otlp_receiver_with_worker_spans_under_their_attempts() {
    traces_reach(flotilla_tests::otlp::Receiver::start(), "grpc");
}

/// The same over OTLP/HTTP (`OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf`), which many hosted
/// backends take only.
#[test]
fn traces_go_over_http_protobuf_when_the_otel_protocol_says_so() {
    traces_reach(
        flotilla_tests::otlp::Receiver::start_http(),
        "http/protobuf",
    );
}

fn traces_reach(receiver: flotilla_tests::otlp::Receiver, protocol: &str) {
    let c = Cluster::start_configured_env(
        1,
        4,
        &[],
        &["--backend", "echo,exec", "--exec-cmd", "sh"],
        vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), receiver.endpoint()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL".into(), protocol.into()),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
            ("OTEL_METRIC_EXPORT_INTERVAL".into(), "200".into()),
        ],
    );
    let run = c.launch(
        "traced",
        "phase('Look');\nconst r = await parallel([1, 2, 3].map(i => () => agent('t' + i, { label: 'a' + i, model: 'echo-model' })));\nreturn r.length;",
        &["--stagger", "0", "--backend", "echo"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let count = |spans: &[flotilla_tests::otlp::SpanRecord], prefix: &str| {
        spans.iter().filter(|s| s.name.starts_with(prefix)).count()
    };
    let spans = receiver.spans_of_run(&run, |spans| {
        count(spans, "run ") == 1
            && count(spans, "attempt.run") == 3
            && count(spans, "invoke_agent ") == 3
            && count(spans, "agent") == 3
    });
    let find = |prefix: &'static str| spans.iter().filter(move |s| s.name.starts_with(prefix));
    let root = find("run ").next().unwrap();
    assert_eq!(root.name, "run traced");
    assert_eq!(root.attributes["flotilla.workflow"], "traced");
    assert!(root.parent_span_id.is_empty(), "the run span is the root");
    // One trace for the whole run, across both processes.
    assert!(spans.iter().all(|s| s.trace_id == root.trace_id));
    let phase = find("phase").next().expect("a phase span");
    assert_eq!(phase.attributes["flotilla.phase"], "Look");
    assert_eq!(phase.parent_span_id, root.span_id);
    for agent in spans.iter().filter(|s| s.name == "agent") {
        assert_eq!(agent.parent_span_id, phase.span_id);
        assert_eq!(agent.attributes["flotilla.outcome"], "completed");
        assert!(agent.attributes["flotilla.label"].starts_with('a'));
        assert_eq!(agent.attributes["flotilla.attempts"], "1");
        assert_eq!(agent.attributes["gen_ai.usage.input_tokens"], "2");
    }
    for worker_span in find("attempt.run") {
        assert_eq!(worker_span.service, "flotilla-worker");
        let attempt = find("invoke_agent ")
            .find(|a| a.span_id == worker_span.parent_span_id)
            .expect("the worker's span hangs under the coordinator's attempt span");
        assert_eq!(attempt.service, "flotilla-coordinator");
        let label = &attempt.attributes["gen_ai.agent.name"];
        assert_eq!(attempt.name, format!("invoke_agent {label}"));
        assert_eq!(attempt.attributes["gen_ai.operation.name"], "invoke_agent");
        assert_eq!(attempt.attributes["gen_ai.provider.name"], "flotilla.echo");
        assert_eq!(
            attempt.attributes["gen_ai.request.model"], "echo-model",
            "{attempt:?}"
        );
        // The echo backend counts a prompt's characters: 't1' is two.
        assert_eq!(
            attempt.attributes["gen_ai.usage.input_tokens"], "2",
            "{attempt:?}"
        );
        assert!(
            attempt
                .attributes
                .contains_key("gen_ai.usage.output_tokens")
        );
        assert!(
            !attempt.attributes.contains_key("error.type"),
            "{attempt:?}"
        );
        assert_eq!(attempt.attributes["flotilla.worker"], "worker-0");
        assert_eq!(attempt.attributes["flotilla.outcome"], "completed");
        let agent = find("agent")
            .find(|a| a.span_id == attempt.parent_span_id)
            .expect("the attempt hangs under its agent span");
        assert_eq!(
            agent.attributes["flotilla.call"],
            worker_span.attributes["flotilla.call"]
        );
        assert_eq!(agent.attributes["flotilla.label"], *label);
    }
    // OTLP metrics the same way: the GenAI client conventions' token usage (three attempts of
    // two input tokens each) and operation duration, with their attributes.
    let is = |p: &flotilla_tests::otlp::MetricPoint, name: &str, kv: &[(&str, &str)]| {
        p.name == name
            && p.service == "flotilla-coordinator"
            && kv
                .iter()
                .all(|(k, v)| p.attributes.get(*k).map(String::as_str) == Some(*v))
    };
    let common = [
        ("gen_ai.operation.name", "invoke_agent"),
        ("gen_ai.provider.name", "flotilla.echo"),
        ("gen_ai.request.model", "echo-model"),
    ];
    let input = [common.as_slice(), &[("gen_ai.token.type", "input")]].concat();
    let points = receiver.points_when(|ps| {
        ps.iter()
            .any(|p| is(p, "gen_ai.client.token.usage", &input) && p.count == 3 && p.value == 6.0)
            && ps
                .iter()
                .any(|p| is(p, "gen_ai.client.operation.duration", &common) && p.count == 3)
    });
    let usage = points
        .iter()
        .find(|p| is(p, "gen_ai.client.token.usage", &input))
        .unwrap();
    assert_eq!(usage.unit, "{token}");
    let duration = points
        .iter()
        .find(|p| is(p, "gen_ai.client.operation.duration", &common))
        .unwrap();
    assert_eq!(duration.unit, "s");
    assert!(
        !duration.attributes.contains_key("error.type"),
        "{duration:?}"
    );
    assert!(
        points.iter().any(
            |p| is(p, "flotilla.attempts", &[("flotilla.outcome", "completed")]) && p.value >= 3.0
        ),
        "{points:?}"
    );

    // The agent's process sees its attempt's trace context; a failed attempt says its class.
    let run = c.launch(
        "traced-exec",
        "return await parallel([() => agent('echo \"$TRACEPARENT\"', { label: 'tp' }), () => agent('exit 3', { label: 'bad' })]);",
        &["--stagger", "0", "--backend", "exec"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    // Worker and coordinator export in batches of their own: wait for both attempts' spans
    // from each.
    let spans = receiver.spans_of_run(&run, |spans| {
        count(spans, "attempt.run") == 2 && count(spans, "invoke_agent ") == 2
    });
    let traceparent = r["result"][0]
        .as_str()
        .unwrap_or_default()
        .trim()
        .to_owned();
    let worker_span = spans
        .iter()
        .find(|s| s.name == "attempt.run" && s.attributes["flotilla.label"] == "tp")
        .expect("the tp attempt's worker span");
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    assert_eq!(
        traceparent,
        format!(
            "00-{}-{}-01",
            hex(&worker_span.trace_id),
            hex(&worker_span.span_id)
        ),
        "{r}"
    );
    let bad = spans
        .iter()
        .find(|s| s.name == "invoke_agent bad")
        .expect("the failed attempt's span");
    assert_eq!(bad.attributes["error.type"], "terminal", "{bad:?}");
    assert_eq!(bad.attributes["gen_ai.provider.name"], "flotilla.exec");
    // Its operation's duration says the same class.
    receiver.points_when(|ps| {
        ps.iter().any(|p| {
            p.name == "gen_ai.client.operation.duration"
                && p.attributes.get("gen_ai.provider.name").map(String::as_str)
                    == Some("flotilla.exec")
                && p.attributes.get("error.type").map(String::as_str) == Some("terminal")
        })
    });
}

#[test]
fn a_leader_stopped_with_sigterm_hands_over_at_once_and_the_run_completes() {
    let etcd = flotilla_tests::services::Etcd::start();
    let s3 = flotilla_tests::services::S3::start();
    let url = format!("s3://{}/handover", s3.bucket);
    // A 30 s lease: a standby that waited for it to lapse would take 30 s to lead.
    let mut c = Cluster::start_group_ttl(
        2,
        4,
        etcd.endpoint(),
        (url, s3.env()),
        &[],
        Some(Duration::from_secs(30)),
    );
    let script = c.path().join("fanout.js");
    std::fs::write(
        &script,
        "export const meta = { name: 'fanout', description: 'handover test' };\n\
         return (await parallel(Array.from({ length: 120 }, (_, i) => () => agent('job ' + i + ' [[sleep:200]]')))).filter(Boolean).length;\n",
    )
    .unwrap();
    let out = c.client_at(
        &c.standby_url(),
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--concurrency",
            "8",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    wait_until("20 calls are journaled", Duration::from_secs(60), || {
        c.journal(&run).len() >= 20
    });
    // Both are ready, each in its role (no sign-in needed for the probe).
    let health = |port: u16| {
        let r = http_get(port, "/healthz", &[]);
        (
            r.status,
            serde_json::from_str::<Value>(&r.body).unwrap_or_default(),
        )
    };
    let (code, leading) = health(c.http_port);
    assert_eq!(
        (code, leading["role"].as_str()),
        (200, Some("leader")),
        "{leading}"
    );
    let (code, standing) = health(c.standby_http_port);
    assert_eq!(
        (code, standing["role"].as_str()),
        (200, Some("standby")),
        "{standing}"
    );
    let mut leader = c.take_coordinator().unwrap();
    nix_kill(leader.id(), "-TERM");
    let status = leader.wait().unwrap();
    assert!(
        status.success(),
        "the leader did not stop cleanly: {status}"
    );
    let before = c.journal(&run).len();
    assert!(before < 120, "the stop came too late to test anything");
    // The standby leads well inside the 30 s the lease would have taken to lapse.
    wait_for_log(
        &c,
        "standby.log",
        &["this coordinator leads"],
        Duration::from_secs(20),
    );
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap();
    assert!(log.contains("this coordinator resigned"), "{log}");
    assert_eq!(health(c.standby_http_port).1["role"], "leader");
    let out = c.client_at(&c.standby_url(), &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["result"], 120, "{}", out.stdout);
    assert_one_result_per_call(&c, &run, 120);
}

fn nix_kill(pid: u32, signal: &str) {
    let ok = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {signal} {pid}");
}

#[test]
fn replicas_sharing_one_worker_certificate_attach_side_by_side() {
    let c = Cluster::start(1, 2);
    let pki = c.pki();
    let mut extra = Vec::new();
    for instance in ["a", "b"] {
        let child = std::process::Command::new(&c.bin)
            .args(["worker", "--coordinator", &c.url(), "--slots", "2"])
            .args(["--name", &format!("worker-0/{instance}")])
            .arg("--cert")
            .arg(pki.join("worker-0.crt"))
            .arg("--key")
            .arg(pki.join("worker-0.key"))
            .arg("--ca")
            .arg(pki.join("ca.crt"))
            .arg("--workspace")
            .arg(c.path().join(format!("ws-{instance}")))
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        extra.push(child);
    }
    c.wait_for_workers(3);
    let listed = c.client(&["workers", "--json"]).json();
    let mut names: Vec<String> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    assert!(names[0].starts_with("worker-0"), "{names:?}");
    assert!(names[1].starts_with("worker-0/a"), "{names:?}");
    assert!(names[2].starts_with("worker-0/b"), "{names:?}");
    let run = c.launch(
        "shared",
        "return (await parallel(Array.from({ length: 12 }, (_, i) => () => agent('x' + i + ' [[sleep:200]]')))).length;",
        &["--stagger", "0"],
    );
    let (code, report) = c.wait(&run);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["result"], 12);
    for mut child in extra {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A launch through `url` of `agents` echo agents, waited for there: the run's report.
fn launch_through(c: &Cluster, url: &str, name: &str, agents: usize) -> Output {
    let script = c.path().join(format!("{name}.js"));
    std::fs::write(
        &script,
        format!(
            "export const meta = {{ name: '{name}', description: 'through a standby' }};\n\
             return (await parallel(Array.from({{ length: {agents} }}, (_, i) => () => agent('p' + i)))).length;\n"
        ),
    )
    .unwrap();
    let out = c.client_at(
        url,
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
        ],
    );
    if out.code != 0 {
        return out;
    }
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    c.client_at(url, &["wait", &run, "--json"])
}

/// Coordinators that advertise themselves at an address their certificates do not name
/// (a pod's IP: here `localhost`, which the certificate lacks) reach each other with
/// `--peer-name`, the name they do hold: a standby forwards a launch to the leader, and
/// after the leader is killed and started again, the new standby forwards to the new leader.
/// Without `--peer-name` the same forwarding is refused, naming the certificate.
#[test]
fn standbys_reach_a_leader_advertised_at_an_unnamed_address_by_its_peer_name() {
    let s3 = flotilla_tests::services::S3::start();
    // Without --peer-name: the standby cannot check the leader at `localhost`.
    {
        let etcd = flotilla_tests::services::Etcd::start();
        let url = format!("s3://{}/unnamed", s3.bucket);
        let c = Cluster::start_group_advertised(
            1,
            2,
            etcd.endpoint(),
            (url, s3.env()),
            "localhost",
            &[],
        );
        let out = launch_through(&c, &c.standby_url(), "refused", 2);
        assert_ne!(out.code, 0, "{out:?}");
        let text = format!("{}{}", out.stdout, out.stderr).to_lowercase();
        assert!(text.contains("does not name the address"), "{out:?}");
        assert!(text.contains("--peer-name"), "{out:?}");
    }
    let etcd = flotilla_tests::services::Etcd::start();
    let url = format!("s3://{}/peer-name", s3.bucket);
    let mut c = Cluster::start_group_advertised(
        2,
        2,
        etcd.endpoint(),
        (url, s3.env()),
        "localhost",
        &["--peer-name", "flotilla-coordinator"],
    );
    let out = launch_through(&c, &c.standby_url(), "forwarded", 6);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["result"], 6, "{}", out.stdout);

    // The leader dies; the standby leads. The old leader comes back as a standby and
    // forwards to the new leader, also advertised at `localhost`.
    let mut leader = c.take_coordinator().unwrap();
    leader.kill().unwrap();
    leader.wait().unwrap();
    // The role `/healthz` gives, once the coordinator listens.
    let role = |port: u16| {
        std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        let r = http_get(port, "/healthz", &[]);
        let v: Value = serde_json::from_str(&r.body).ok()?;
        v["role"].as_str().map(str::to_owned)
    };
    wait_until("the standby leads", Duration::from_secs(30), || {
        role(c.standby_http_port).as_deref() == Some("leader")
    });
    c.start_coordinator();
    wait_until(
        "the restarted coordinator stands by",
        Duration::from_secs(30),
        || role(c.http_port).as_deref() == Some("standby"),
    );
    let out = launch_through(&c, &c.url(), "after-failover", 6);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["result"], 6, "{}", out.stdout);
}

/// Two workers that hold the same key call through one provider account: the coordinator
/// keeps one admission window for both, so a fan-out over both stays within what the
/// provider takes, and `/metrics` shows the account's window, calls in flight and throttles.
#[test]
fn workers_sharing_a_key_share_one_admission_window() {
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    fake.limit_concurrency(12);
    let c = Cluster::start_workers_with(2, 32, &["--backend", "anthropic"], fake.env());
    let run = c.launch(
        "shared-account",
        "return (await parallel(Array.from({ length: 150 }, (_, i) => () => agent('item ' + i)))).filter(x => x !== null).length;",
        &["--stagger", "0", "--concurrency", "64", "--backend", "anthropic"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 150, "{}", r["failures"]);
    let counts = fake.limit_counts();
    assert_eq!(
        r["usage"]["waits"].as_u64(),
        Some(counts.refused_429),
        "{counts:?}"
    );
    assert!(counts.refused_429 <= 24, "{counts:?}");
    let t = c.client(&["token", "create", "--json", "--ttl", "1h"]);
    assert_eq!(t.code, 0, "{t:?}");
    let bearer = format!("Bearer {}", t.json()["token"].as_str().unwrap());
    let m = http_get(c.http_port, "/metrics", &[("Authorization", &bearer)]);
    assert_eq!(m.status, 200, "{m:?}");
    let windows: Vec<&str> = m
        .body
        .lines()
        .filter(|l| l.starts_with("flotilla_account_window{"))
        .collect();
    assert_eq!(windows.len(), 1, "one account for both workers: {}", m.body);
    assert!(
        windows[0].contains("account=\"anthropic@127.0.0.1:"),
        "{}",
        windows[0]
    );
    let throttled = m
        .body
        .lines()
        .find(|l| l.starts_with("flotilla_account_throttled_total{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<u64>().ok());
    assert_eq!(throttled, Some(counts.refused_429), "{}", m.body);
    let page = http_get(c.http_port, "/runs", &[("Authorization", &bearer)]);
    assert_eq!(page.status, 200);
    assert!(
        page.body.contains("Provider accounts") && page.body.contains("anthropic@127.0.0.1:"),
        "{}",
        page.body
    );
    assert!(
        m.body
            .lines()
            .any(|l| l.starts_with("flotilla_account_started_total{")
                && l.ends_with(&format!(" {}", 150 + counts.refused_429))),
        "{}",
        m.body
    );
}

/// `placement.labels` (EXT): agents that ask for a label run only on workers that carry it,
/// the others anywhere; an agent asking for a label no attached worker carries waits with
/// the reason in its status, and fails with it after `--worker-wait`.
#[test]
fn agents_asking_for_a_label_run_only_on_workers_that_carry_it() {
    let mut c = Cluster::start_workers_with(
        2,
        4,
        &["--backend", "exec", "--exec-cmd", "echo plain"],
        Vec::new(),
    );
    c.restart_worker_with(
        1,
        4,
        &[
            "--backend",
            "exec",
            "--exec-cmd",
            "echo on-gpu",
            "--label",
            "gpu=h100,region=eu",
        ],
    );
    wait_until(
        "the labelled worker is back",
        Duration::from_secs(30),
        || {
            let w = c.client(&["workers", "--json"]).json_or_null();
            w.as_array().is_some_and(|ws| {
                ws.iter()
                    .any(|w| w["labels"]["gpu"] == "h100" && w["state"] == "attached")
            })
        },
    );
    let run = c.launch(
        "placed",
        "const gpu = await parallel(Array.from({ length: 12 }, (_, i) => () => agent('g' + i, { placement: { labels: { gpu: 'h100' } } })));\n\
         const any = await parallel(Array.from({ length: 12 }, (_, i) => () => agent('a' + i)));\n\
         return { gpu, any };",
        &["--stagger", "0", "--backend", "exec"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let gpu = r["result"]["gpu"].as_array().unwrap();
    assert_eq!(gpu.len(), 12);
    assert!(gpu.iter().all(|v| v == "on-gpu"), "{r}");

    // A label nobody carries: the agent waits, and says why.
    let run = c.launch(
        "unplaced",
        "return await agent('x', { placement: { labels: { region: 'us' } } });",
        &["--stagger", "0", "--backend", "exec", "--worker-wait", "3s"],
    );
    let mut why = String::new();
    wait_until(
        "the agent says why it waits",
        Duration::from_secs(20),
        || {
            let s = status(&c, &run);
            why = s["waiting"].as_str().unwrap_or("").to_owned();
            !why.is_empty()
        },
    );
    assert!(
        why.contains("region=us") && why.contains("--label"),
        "{why}"
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"], Value::Null, "{r}");
    assert!(r["failures"].to_string().contains("region=us"), "{r}");

    // A malformed placement is refused by name.
    let run = c.launch(
        "badly-placed",
        "return await agent('x', { placement: { labels: { gpu: 1 } } });",
        &["--stagger", "0", "--backend", "exec"],
    );
    let (_, r) = c.wait(&run);
    assert!(r.to_string().contains("option `placement`"), "{r}");
}

/// A coordinator's `--allowed-models` bound every run launched there: a run that allows
/// more keeps only what the operator allows, and an agent asking for another model runs on
/// a substitute with the warning.
#[test]
fn a_coordinator_s_allowed_models_bound_every_run() {
    let c = Cluster::start_coordinator_with(1, 2, &["--allowed-models", "sonnet,haiku"]);
    let run = c.launch(
        "policy",
        "await agent('a', { label: 'opus', model: 'opus' });\n\
         await agent('b', { label: 'haiku', model: 'haiku' });\n\
         return null;",
        &["--stagger", "0", "--allowed-models", "opus,haiku"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let model = |l: &str| {
        r["agents"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["label"] == l)
            .map(|a| a["model"].as_str().unwrap().to_owned())
            .unwrap()
    };
    // The run's own list, within the operator's: haiku only.
    assert_eq!(model("opus"), "haiku", "{r}");
    assert_eq!(model("haiku"), "haiku", "{r}");
    assert!(
        r["warnings"].to_string().contains("asked for \\\"opus\\\""),
        "{}",
        r["warnings"]
    );
}

/// A coordinator alone in its group (etcd, no standby) frozen past its lease: etcd lets the
/// lease and the leader's seat go. Woken, it finds nobody leading, so instead of stopping (and
/// leaving its run to wait for a restart) it starts again in its own place — same process —
/// campaigns, leads, and adopts its run from storage like any successor; the run completes
/// with one result per call.
#[test]
fn a_lone_coordinator_frozen_past_its_lease_campaigns_again_and_its_run_completes() {
    let etcd = flotilla_tests::services::Etcd::start();
    let mut c = Cluster::start_with(2, 4, Some(etcd.endpoint()));
    let run = c.launch(
        "lone",
        "return (await parallel(Array.from({ length: 60 }, (_, i) => () => agent('job ' + i + ' [[sleep:400]]')))).filter(Boolean).length;",
        &["--stagger", "0", "--concurrency", "8", "--stall-timeout", "10m"],
    );
    wait_until("10 calls are journaled", Duration::from_secs(60), || {
        c.journal(&run).len() >= 10
    });
    let leader_key = |etcd: &flotilla_tests::services::Etcd| {
        let out = etcd
            .etcdctl(&["get", "/flotilla/leader", "--print-value-only"])
            .expect("etcdctl");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert!(!leader_key(&etcd).is_empty(), "it leads before the pause");
    c.signal_coordinator("-STOP");
    // Frozen past its TTL: etcd lets its lease go, and the leader's seat with it.
    wait_until(
        "etcd frees the leader's seat",
        Duration::from_secs(30),
        || leader_key(&etcd).is_empty(),
    );
    let before = c.journal(&run).len();
    assert!(before < 60, "the pause came too late to test anything");
    c.signal_coordinator("-CONT");
    wait_until("the seat is held again", Duration::from_secs(60), || {
        !leader_key(&etcd).is_empty()
    });
    assert_eq!(c.coordinator_exited(), None, "the same process carries on");
    // It adopts its own run, as a successor would (the journal sealed, then replayed).
    wait_for_log(
        &c,
        "coordinator.log",
        &["adopted a run whose coordinator is gone"],
        Duration::from_secs(60),
    );
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap();
    assert!(
        log.contains(
            "no other coordinator leads: starting again in its own place to campaign again"
        ) && log.matches("this coordinator leads").count() == 2,
        "{log}"
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 60);
    assert_one_result_per_call(&c, &run, 60);
    assert!(
        r["usage"]["cached"].as_u64().unwrap() >= before as u64,
        "what was journaled before the pause is served from storage: {}",
        r["usage"]
    );
}
