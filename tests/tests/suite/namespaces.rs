//! Namespaces (M40) on a real fleet with mTLS: certificates name a client's namespaces, the
//! dispatcher shares slots between namespaces by weight, a namespace at its cap queues, a
//! used-up daily quota refuses (`QUOTA_EXCEEDED`, which quota, when it resets), and a client
//! sees and controls only its namespaces' runs, pages included. A namespace's model policy,
//! pinned labels and prices apply to its runs.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use flotilla_tests::cluster::Cluster;
use flotilla_tests::http_get;
use serde_json::Value;

/// A coordinator config file with `body` (its `[namespaces.*]` tables), outside the cluster's
/// directory (which is made when the cluster starts).
fn config(body: &str) -> tempfile::NamedTempFile {
    let f = tempfile::Builder::new()
        .suffix(".toml")
        .tempfile()
        .expect("config file");
    std::fs::write(f.path(), body).expect("write config");
    f
}

/// A session token of certificate `who`.
fn token(c: &Cluster, who: &str) -> String {
    let t = c.client_as(who, &["token", "create", "--json", "--ttl", "1h"]);
    assert_eq!(t.code, 0, "{t:?}");
    t.json()["token"].as_str().expect("token").to_owned()
}

/// `/metrics` as seen with `token`.
fn metrics(c: &Cluster, token: &str) -> String {
    let m = http_get(
        c.http_port,
        "/metrics",
        &[("Authorization", &format!("Bearer {token}"))],
    );
    assert_eq!(m.status, 200, "{m:?}");
    m.body
}

/// The value of the metric line that starts with `series` (`name{labels}`), if any.
fn metric(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn running(body: &str, ns: &str) -> u64 {
    metric(
        body,
        &format!("flotilla_namespace_running{{namespace=\"{ns}\"}}"),
    )
    .unwrap_or(0.0) as u64
}

fn fan_out(n: usize, ms: u64) -> String {
    format!(
        "return (await parallel(Array.from({{ length: {n} }}, (_, i) => () => agent('job ' + i + ' [[sleep:{ms}]]')))).filter(Boolean).length;"
    )
}

/// Two namespaces of weights 3 and 1 on a saturated fleet of 8 slots: while both have calls
/// queued, the slots split 6:2 (± one slot), whichever launched first and however many runs
/// each has; a namespace capped at 2 agents runs at most 2 while its calls queue.
#[test]
fn namespaces_share_a_saturated_fleet_by_weight_and_a_capped_one_queues() {
    let cfg = config(
        r#"
[namespaces.team-a]
weight = 3
[namespaces.team-b]
weight = 1
[namespaces.team-c]
max_agents = 2
"#,
    );
    let c = Cluster::start_coordinator_with(2, 4, &["--config", cfg.path().to_str().unwrap()]);
    c.issue_client("ops", &["*"]);
    c.issue_client("alice", &["team-a"]);
    c.issue_client("bob", &["team-b"]);
    let ops = token(&c, "ops");
    // team-b first, with two runs, so that it would hold every slot if runs merely took turns.
    let flags = ["--stagger", "0", "--concurrency", "64"];
    let b1 = c.launch_as("bob", "b1", &fan_out(120, 400), &flags);
    let b2 = c.launch_as("bob", "b2", &fan_out(120, 400), &flags);
    let a1 = c.launch_as("alice", "a1", &fan_out(120, 400), &flags);
    // team-b held every slot when team-a came: slots are not taken back, so team-a gets its
    // share as team-b's calls end (one call's time); from then on the split holds.
    let deadline = Instant::now() + Duration::from_secs(60);
    while running(&metrics(&c, &ops), "team-a") < 5 {
        assert!(Instant::now() < deadline, "team-a never got its share");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Saturated: all 8 slots busy and both namespaces with calls queued.
    let mut samples: Vec<(u64, u64)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while samples.len() < 12 {
        assert!(
            Instant::now() < deadline,
            "never saturated; samples {samples:?}"
        );
        let m = metrics(&c, &ops);
        let queued = |ns: &str| {
            metric(
                &m,
                &format!("flotilla_namespace_queued{{namespace=\"{ns}\"}}"),
            )
            .unwrap_or(0.0)
        };
        let (a, b) = (running(&m, "team-a"), running(&m, "team-b"));
        if a + b == 8 && queued("team-a") > 0.0 && queued("team-b") > 0.0 {
            samples.push((a, b));
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    for (a, b) in &samples {
        assert!(
            (5..=7).contains(a) && (1..=3).contains(b),
            "slots split {a}:{b}, not 6:2 ± 1; every sample {samples:?}"
        );
    }
    let (sa, sb) = samples.iter().fold((0, 0), |(x, y), (a, b)| (x + a, y + b));
    assert!(
        sa >= 2 * sb,
        "over the window team-a held {sa} slot-samples against team-b's {sb}"
    );
    for run in [&b1, &b2] {
        c.client_as("bob", &["stop", run]);
    }
    c.client_as("alice", &["stop", &a1]);
    // team-c: capped at 2 running while 10 wait, on an otherwise idle fleet.
    c.issue_client("carol", &["team-c"]);
    for run in [&b1, &b2, &a1] {
        let out = c.client(&["wait", run, "--json"]);
        assert_ne!(out.code, 0, "stopped runs end stopped: {out:?}");
    }
    let run = c.launch_as("carol", "capped", &fan_out(12, 300), &flags);
    let mut most = 0;
    let mut saw_queue = false;
    loop {
        let m = metrics(&c, &ops);
        most = most.max(running(&m, "team-c"));
        saw_queue |=
            metric(&m, "flotilla_namespace_queued{namespace=\"team-c\"}").is_some_and(|q| q > 0.0);
        let s = c.client_as("carol", &["status", &run, "--json"]);
        assert_eq!(s.code, 0, "{s:?}");
        if !matches!(s.json()["status"].as_str(), Some("running" | "paused")) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = c.client_as("carol", &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["result"], 12);
    assert!(saw_queue, "team-c's calls never queued");
    assert!(most <= 2, "team-c ran {most} agents at once; its cap is 2");
    assert_eq!(out.json()["namespace"], "team-c");
}

/// A namespace's daily agent quota: agents past it are refused with QUOTA_EXCEEDED (the
/// script catches the code), then launches are refused naming the quota and when it resets;
/// the count is in the store, so a restarted coordinator refuses too; refusals are counted.
/// Another namespace's run that passes its token quota is paused until the quota resets.
#[test]
fn used_up_daily_quotas_refuse_agents_and_launches_and_say_when_they_reset() {
    let cfg = config(
        r#"
[namespaces.team-q]
agents_per_day = 3
[namespaces.team-t]
tokens_per_day = 100
"#,
    );
    let mut c = Cluster::start_coordinator_with(1, 4, &["--config", cfg.path().to_str().unwrap()]);
    c.issue_client("quinn", &["team-q"]);
    c.issue_client("tess", &["team-t"]);
    c.issue_client("ops", &["*"]);
    let body = "const codes = [];\n\
        for (let i = 0; i < 5; i++) {\n\
          try { await agent('step ' + i); codes.push('ok'); } catch (e) { codes.push(e.code + ' ' + e.message); }\n\
        }\n\
        return codes;";
    let run = c.launch_as("quinn", "quota", body, &["--stagger", "0"]);
    let out = c.client_as("quinn", &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let codes: Vec<String> = out.json()["result"]
        .as_array()
        .expect("codes")
        .iter()
        .map(|v| v.as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(&codes[..3], ["ok", "ok", "ok"], "{codes:?}");
    for refused in &codes[3..] {
        assert!(
            refused.starts_with("QUOTA_EXCEEDED QUOTA_EXCEEDED: namespace team-q has used its agents per day (3 of 3")
                && refused.contains("it resets at")
                && refused.contains("T00:00:00Z"),
            "{refused}"
        );
    }
    let refused = |c: &Cluster| {
        let script = flotilla_tests::write_workflow(c.path(), "again", "d", "return 1;");
        c.client_as("quinn", &["launch", script.to_str().unwrap(), "--json"])
    };
    let out = refused(&c);
    assert_ne!(out.code, 0, "{out:?}");
    let text = format!("{}{}", out.stdout, out.stderr);
    assert!(
        text.contains("QUOTA_EXCEEDED: namespace team-q has used its agents per day"),
        "{text}"
    );
    // Another namespace goes on.
    let ok = c.launch_as("ops", "other", "return await agent('x');", &[]);
    assert_eq!(c.client_as("ops", &["wait", &ok, "--json"]).code, 0);
    let m = metrics(&c, &token(&c, "ops"));
    let n = metric(
        &m,
        "flotilla_quota_refusals_total{namespace=\"team-q\",quota=\"agents_per_day\"}",
    )
    .unwrap_or(0.0);
    assert!(n >= 3.0, "refusals counted: {n}\n{m}");
    assert_eq!(
        metric(&m, "flotilla_namespace_agents_today{namespace=\"team-q\"}"),
        Some(3.0),
        "{m}"
    );
    // The count is stored (every 2 s): a new coordinator over the same store refuses too.
    let stored = c.path().join("store/namespaces/team-q/usage");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_dir(&stored).map_or(true, |mut d| d.next().is_none()) {
        assert!(
            Instant::now() < deadline,
            "the use of team-q was never stored"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    if let Some(mut old) = c.take_coordinator() {
        old.kill().expect("kill");
        old.wait().expect("reap");
    }
    // The next coordinator reads the wall clock through libfaketime, from a file this test
    // writes: at first no shift; later the next UTC day, when its quotas reset. Its monotonic
    // clock (timers, leases' renewals) is left alone.
    assert!(
        std::path::Path::new(FAKETIME).exists(),
        "no libfaketime at {FAKETIME}: tools/test installs it (apt-get install faketime)"
    );
    let shift = c.path().join("clock-shift");
    std::fs::write(&shift, "+0\n").unwrap();
    c.coordinator_env = vec![
        ("LD_PRELOAD".into(), FAKETIME.into()),
        (
            "FAKETIME_TIMESTAMP_FILE".into(),
            shift.display().to_string(),
        ),
        ("FAKETIME_NO_CACHE".into(), "1".into()),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
    ];
    c.start_coordinator();
    c.wait_for_workers(1);
    let out = refused(&c);
    let text = format!("{}{}", out.stdout, out.stderr);
    assert!(
        out.code != 0 && text.contains("agents per day (3 of 3"),
        "after a restart: {out:?}"
    );
    // Tokens: each echo agent uses its prompt's and result's characters (2 × 30 here); the
    // second passes 100. A coordinator's run is then paused at its namespace's quota (issue
    // 33, 2) instead of failing its agents: the third waits in it for the day's reset, and
    // the status says which quota, by how much and when it resets.
    let prompt = "x".repeat(30);
    let body = format!(
        "const out = [];\nfor (let i = 0; i < 3; i++) {{ try {{ await agent('{prompt}' + i); out.push('ok'); }} catch (e) {{ out.push(e.code); }} }}\nreturn out;"
    );
    let run = c.launch_as("tess", "tokens", &body, &["--stagger", "0"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let held = loop {
        let out = c.client_as("tess", &["status", &run, "--json"]);
        let s = if out.code == 0 {
            out.json()
        } else {
            serde_json::Value::Null
        };
        if s["status"] == "paused" && s["queued"] == 1 {
            break s;
        }
        assert!(Instant::now() < deadline, "never held at the quota: {s}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let why = held["waiting"].as_str().unwrap_or_default();
    assert!(
        why.starts_with(
            "paused at its namespace's daily quota: namespace team-t has used its tokens per day ("
        ) && why.contains("of 100)")
            && why.contains("it resets at")
            && why.contains("T00:00:00Z"),
        "{held}"
    );
    assert_eq!(held["done"], 2, "{held}");
    assert_eq!(held["failed"], 0, "nothing failed: {held}");
    let resumed = c.client_as("tess", &["resume", &run]);
    assert_ne!(resumed.code, 0, "{resumed:?}");
    assert!(resumed.stderr.contains("goes on by itself"), "{resumed:?}");
    // The coordinator's day turns: the quota resets and the run goes on where it stopped,
    // its third agent run once, nothing before it again.
    std::fs::write(&shift, "+1d\n").unwrap();
    let out = c.client_as("tess", &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["result"], serde_json::json!(["ok", "ok", "ok"]), "{r}");
    assert_eq!(r["usage"]["dispatched"], 3, "every agent once: {r}");
    let logs = r["logs"].to_string();
    assert!(
        logs.contains("[quota] the namespace's daily quota reset")
            && logs.contains("[quota] the run goes on"),
        "{r}"
    );
}

/// libfaketime, which `tools/test` installs (Debian `faketime`).
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// A client sees and controls only its namespaces' runs: status, wait, stop, runs and the
/// session pages all answer as if another namespace's run were not there; a launch into a
/// namespace its certificate does not name is refused naming the ones it does; an operator
/// (`*`) sees them all and filters by namespace.
#[test]
fn a_client_sees_and_controls_only_its_namespaces_runs() {
    let c = Cluster::start(1, 4);
    c.issue_client("alice", &["team-a"]);
    c.issue_client("bob", &["team-b", "team-x"]);
    c.issue_client("ops", &["*"]);
    let slow = fan_out(2, 300_000);
    let a = c.launch_as("alice", "alice-run", &slow, &["--stagger", "0"]);
    let b = c.launch_as("bob", "bob-run", "return await agent('b');", &[]);
    assert_eq!(c.client_as("bob", &["wait", &b, "--json"]).code, 0);
    for args in [
        vec!["status", a.as_str(), "--json"],
        vec!["wait", a.as_str(), "--json"],
        vec!["stop", a.as_str()],
        vec!["changes", a.as_str(), "--json"],
        vec!["logs", a.as_str()],
        vec!["pause", a.as_str()],
        vec!["pause", a.as_str(), "--reason", "mine now"],
        vec!["stop", a.as_str(), "--reason", "mine now"],
        vec!["budget", a.as_str(), "--usd", "1000"],
    ] {
        let out = c.client_as("bob", &args);
        let text = format!("{}{}", out.stdout, out.stderr);
        assert_ne!(out.code, 0, "bob {args:?}: {out:?}");
        assert!(
            text.contains(&format!("no run {a} in namespace(s) team-b, team-x")),
            "bob {args:?}: {text}"
        );
    }
    let listed = |who: &str, extra: &[&str]| -> Vec<String> {
        let out = c.client_as(who, &[&["runs", "--json"], extra].concat());
        assert_eq!(out.code, 0, "{out:?}");
        out.json()
            .as_array()
            .expect("runs")
            .iter()
            .map(|r| r["run_id"].as_str().unwrap_or("").to_owned())
            .collect()
    };
    assert_eq!(listed("bob", &[]), std::slice::from_ref(&b));
    assert_eq!(listed("alice", &[]), std::slice::from_ref(&a));
    let all = listed("ops", &[]);
    assert!(all.contains(&a) && all.contains(&b), "{all:?}");
    assert_eq!(
        listed("ops", &["--namespace", "team-a"]),
        std::slice::from_ref(&a)
    );
    // A launch into a namespace the certificate does not name; bob's second is fine.
    let script = flotilla_tests::write_workflow(c.path(), "elsewhere", "d", "return 1;");
    let out = c.client_as(
        "alice",
        &[
            "launch",
            script.to_str().unwrap(),
            "--namespace",
            "team-b",
            "--json",
        ],
    );
    let text = format!("{}{}", out.stdout, out.stderr);
    assert!(
        out.code != 0 && text.contains("may act in namespace(s) team-a only, not \"team-b\""),
        "{out:?}"
    );
    let x = c.launch_as("bob", "in-x", "return 2;", &["--namespace", "team-x"]);
    let out = c.client_as("bob", &["wait", &x, "--json"]);
    assert_eq!(out.json()["namespace"], "team-x", "{out:?}");
    // Pages: bob's token does not show alice's run; hers does; lists are theirs.
    let (tb, ta) = (token(&c, "bob"), token(&c, "alice"));
    let get = |path: &str, t: &str| {
        http_get(
            c.http_port,
            path,
            &[("Authorization", &format!("Bearer {t}"))],
        )
    };
    let page = get(&format!("/runs/{a}"), &tb);
    assert_eq!(page.status, 404, "{page:?}");
    assert!(page.body.contains("team-b, team-x"), "{}", page.body);
    assert_eq!(get(&format!("/runs/{a}.json"), &tb).status, 404);
    assert_eq!(get(&format!("/runs/{a}"), &ta).status, 200);
    let list = get("/runs.json", &tb);
    assert_eq!(list.status, 200);
    let ids: Vec<String> = serde_json::from_str::<Value>(&list.body)
        .expect("runs json")
        .as_array()
        .expect("list")
        .iter()
        .map(|r| r["run_id"].as_str().unwrap_or("").to_owned())
        .collect();
    assert!(ids.contains(&b) && !ids.contains(&a), "{ids:?}");
    // Filters never widen a sign-in: asking for another namespace's runs lists none.
    let list = get("/runs.json?namespace=team-a", &tb);
    assert_eq!(list.status, 200, "{list:?}");
    assert_eq!(list.body.trim(), "[]", "{}", list.body);
    let page = get("/runs?namespace=team-a&status=running", &tb);
    assert!(
        page.status == 200 && page.body.contains("no run matches") && !page.body.contains(&a),
        "{page:?}"
    );
    assert_eq!(get("/runs.json?within=team-a", &tb).status, 400);
    // An agent's page of another namespace's run is not there; the fleet page shows the
    // namespaces of the sign-in only.
    assert_eq!(get(&format!("/runs/{a}/agents/0"), &tb).status, 404);
    // Its live stream (whose renderings are shared by every reader) is not there either.
    let events = get(&format!("/runs/{a}/events"), &tb);
    assert_eq!(events.status, 404, "{events:?}");
    assert!(!events.body.contains("event:"), "{}", events.body);
    assert_eq!(get(&format!("/runs/{a}/agents/0"), &ta).status, 200);
    let fleet = get("/fleet", &tb);
    assert_eq!(fleet.status, 200, "{fleet:?}");
    assert!(!fleet.body.contains("team-a"), "{}", fleet.body);
    let fleet = get("/fleet", &ta);
    assert!(fleet.body.contains("id=\"ns-team-a\""), "{}", fleet.body);
    assert!(!fleet.body.contains("team-b"), "{}", fleet.body);
    // A control from another namespace's token does nothing: a stop with a reason, a budget.
    for body in [
        r#"{"action":"stop","reason":"not yours"}"#,
        r#"{"action":"budget","usd":1000}"#,
    ] {
        let r = flotilla_tests::http_request(
            c.http_port,
            "POST",
            &format!("/runs/{a}/control"),
            &[
                ("Authorization", &format!("Bearer {tb}")),
                ("Content-Type", "application/json"),
                ("x-flotilla", "1"),
            ],
            Some(body),
        );
        assert_eq!(r.status, 404, "{body}: {r:?}");
    }
    // `/metrics` counts the runs of the token's namespaces only: bob's two ended, alice's
    // running one.
    let metric = |t: &str, name: &str| -> Option<f64> {
        let m = get("/metrics", t);
        assert_eq!(m.status, 200, "{m:?}");
        m.body
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    };
    assert_eq!(metric(&tb, "flotilla_runs{status=\"running\"}"), Some(0.0));
    assert_eq!(
        metric(&tb, "flotilla_runs{status=\"completed\"}"),
        Some(2.0)
    );
    assert_eq!(metric(&ta, "flotilla_runs{status=\"running\"}"), Some(1.0));
    assert_eq!(
        metric(&ta, "flotilla_runs{status=\"completed\"}"),
        Some(0.0)
    );
    // Alice's own stop works, with her reason in the run's log; the report names her
    // namespace. A reason too long is refused by its size.
    let long = "x".repeat(2000);
    let out = c.client_as("alice", &["stop", &a, "--reason", &long]);
    assert!(
        out.code != 0 && out.stderr.contains("keep it under 1000"),
        "{out:?}"
    );
    let out = c.client_as("alice", &["stop", &a, "--reason", "done\nwith it"]);
    assert_eq!(out.code, 0, "{out:?}");
    let out = c.client_as("alice", &["wait", &a, "--json"]);
    assert_eq!(out.json()["namespace"], "team-a", "{out:?}");
    let logs = out.json()["logs"].to_string();
    assert!(
        logs.contains("[stop] alice (client) asked to stop the run: done with it"),
        "{logs}"
    );
    assert!(
        !logs.contains("not yours") && !logs.contains("mine now"),
        "{logs}"
    );
    // A resume of another namespace's run is refused like the rest, and a resume stays in
    // its run's namespace.
    let out = c.client_as("bob", &["resume", &a, "--json"]);
    assert!(out.code != 0, "{out:?}");
    let again = flotilla_tests::write_workflow(c.path(), "again", "d", "return await agent('b');");
    let out = c.client_as(
        "bob",
        &[
            "launch",
            again.to_str().unwrap(),
            "--resume",
            &b,
            "--namespace",
            "team-x",
            "--json",
        ],
    );
    let text = format!("{}{}", out.stdout, out.stderr);
    assert!(
        out.code != 0 && text.contains("a resume stays in its run's namespace"),
        "{out:?}"
    );
}

/// A namespace's model policy, pinned labels and prices: its agents asking for another model
/// run on its default with a warning naming both, every one runs on a worker with its labels
/// (even one asking for another value), and their cost is its price table's.
#[test]
fn a_namespace_s_model_policy_labels_and_prices_apply_to_its_runs() {
    let cfg = config(
        r#"
[namespaces.team-m]
allowed_models = ["sonnet"]
default_model = "claude-sonnet-4-5"
labels = { region = "eu" }
prices = { sonnet = { input = 1000.0, output = 2000.0 } }
"#,
    );
    let mut c = Cluster::start_configured(
        2,
        4,
        &["--config", cfg.path().to_str().unwrap()],
        &[
            "--backend",
            "echo,exec",
            "--exec-cmd",
            "echo in-us",
            "--label",
            "region=us",
        ],
    );
    c.restart_worker_with(
        1,
        4,
        &[
            "--backend",
            "echo,exec",
            "--exec-cmd",
            "echo in-eu",
            "--label",
            "region=eu",
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let w = c.client(&["workers", "--json"]).json_or_null();
        let attached = |region: &str| {
            w.as_array().is_some_and(|ws| {
                ws.iter()
                    .any(|w| w["labels"]["region"] == region && w["state"] == "attached")
            })
        };
        if attached("eu") && attached("us") {
            break;
        }
        assert!(Instant::now() < deadline, "workers never attached: {w}");
        std::thread::sleep(Duration::from_millis(100));
    }
    c.issue_client("mia", &["team-m"]);
    c.issue_client("ops", &["*"]);
    // Where agents run: every one on the eu worker, the one asking for us too; another
    // namespace's agents go anywhere.
    let placed = "return await parallel(Array.from({ length: 16 }, (_, i) => () => agent('p' + i, i === 0 ? { placement: { labels: { region: 'us' } } } : {})));";
    let run = c.launch_as(
        "mia",
        "placed",
        placed,
        &["--stagger", "0", "--backend", "exec"],
    );
    let out = c.client_as("mia", &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    let results = r["result"].as_array().expect("results");
    assert_eq!(results.len(), 16);
    assert!(results.iter().all(|v| v == "in-eu"), "{r}");
    let run = c.launch_as(
        "ops",
        "anywhere",
        placed,
        &["--stagger", "0", "--backend", "exec"],
    );
    let out = c.client_as("ops", &["wait", &run, "--json"]);
    let r = out.json();
    assert!(
        r["result"]
            .as_array()
            .expect("results")
            .iter()
            .any(|v| v == "in-us"),
        "another namespace is not pinned: {r}"
    );
    // Models and prices.
    let body = "return await parallel([\n\
        () => agent('a', { model: 'opus', label: 'asks-opus' }),\n\
        () => agent('b', { label: 'asks-none' }),\n\
        () => agent('d', { label: 'asks-sonnet', model: 'sonnet' }),\n\
      ]);";
    let run = c.launch_as(
        "mia",
        "policy",
        body,
        &["--stagger", "0", "--backend", "echo"],
    );
    let out = c.client_as("mia", &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    let agents: HashMap<String, Value> = r["agents"]
        .as_array()
        .expect("agents")
        .iter()
        .map(|a| (a["label"].as_str().unwrap_or("").to_owned(), a.clone()))
        .collect();
    assert_eq!(agents["asks-opus"]["model"], "claude-sonnet-4-5", "{r}");
    assert_eq!(agents["asks-none"]["model"], "claude-sonnet-4-5", "{r}");
    assert_eq!(agents["asks-sonnet"]["model"], "sonnet", "{r}");
    let warnings = r["warnings"].to_string();
    assert!(
        warnings.contains("opus") && warnings.contains("claude-sonnet-4-5"),
        "{warnings}"
    );
    // Echo's tokens: input = the prompt's characters (1), output = the result's (1), so each
    // agent costs (1 × 1000 + 1 × 2000) / 1e6 dollars.
    let cost = r["usage"]["cost_usd"].as_f64().expect("cost");
    assert!((cost - 3.0 * 0.003).abs() < 1e-9, "{cost}: {r}");
}

/// Through a standby, which forwards to the leader with the caller's namespaces, a client
/// sees its own runs as the leader runs them and only those; a client that sends the forwarding header itself (it is read
/// only from coordinators) gains nothing.
#[test]
fn a_standby_forwards_the_caller_s_namespaces_and_a_client_cannot_claim_more() {
    use flotilla_proto::v1;
    use flotilla_proto::v1::client_service_client::ClientServiceClient;
    let etcd = flotilla_tests::services::Etcd::start();
    let s3 = flotilla_tests::services::S3::start();
    let url = format!("s3://{}/namespaces", s3.bucket);
    let c = Cluster::start_group(1, 4, etcd.endpoint(), (url, s3.env()));
    c.issue_client("alice", &["team-a"]);
    c.issue_client("bob", &["team-b"]);
    let a = c.launch_as(
        "alice",
        "alice-run",
        &fan_out(1, 300_000),
        &["--stagger", "0"],
    );
    let standby = c.standby_url();
    let out = c.client_as_at(&standby, "bob", &["status", &a, "--json"]);
    let text = format!("{}{}", out.stdout, out.stderr);
    assert!(
        out.code != 0 && text.contains(&format!("no run {a} in namespace(s) team-b")),
        "bob through the standby: {out:?}"
    );
    let out = c.client_as_at(&standby, "alice", &["status", &a, "--json"]);
    assert_eq!(out.code, 0, "alice through the standby: {out:?}");
    // Her listing through the standby is the leader's, which shows her run as its engine has
    // it (the store's index knows only that it started).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = c.client_as_at(&standby, "alice", &["runs", "--json"]);
        assert_eq!(out.code, 0, "{out:?}");
        let listed = out.json();
        let row = listed
            .as_array()
            .and_then(|rs| rs.iter().find(|r| r["run_id"] == a.as_str()).cloned());
        if row
            .as_ref()
            .is_some_and(|r| r["status"] == "running" && r["agents"] == 1 && r["running"] == 1)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "alice's run through the standby: {listed}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = c.client_as_at(&standby, "bob", &["runs", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(!out.stdout.contains(&a), "{out:?}");
    // Bob's own client, claiming every namespace in the header a standby would send.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (status, listed) = rt.block_on(async {
        let tls = flotilla_proto::tls::TlsFiles::in_dir(&c.pki(), "bob");
        let channel = flotilla_proto::tls::channel(&c.url(), Some(&tls)).expect("channel");
        let mut client = ClientServiceClient::new(channel);
        fn claim<T>(msg: T) -> tonic::Request<T> {
            let mut req = tonic::Request::new(msg);
            req.metadata_mut()
                .insert("x-flotilla-scope", "*".parse().expect("header"));
            req
        }
        let status = client.status(claim(v1::RunRef { run_id: a.clone() })).await;
        let listed = client
            .list_runs(claim(v1::ListRunsRequest::default()))
            .await
            .expect("list runs")
            .into_inner()
            .runs_json;
        (status, listed)
    });
    let e = status.expect_err("bob's claim of every namespace is ignored");
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(!listed.contains(&a), "{listed}");
    // A coordinator's certificate that says for nobody acts in `default` only.
    let status = rt.block_on(async {
        let tls = flotilla_proto::tls::TlsFiles::in_dir(&c.pki(), "coordinator");
        let channel = flotilla_proto::tls::channel(&c.url(), Some(&tls)).expect("channel");
        ClientServiceClient::new(channel)
            .status(v1::RunRef { run_id: a.clone() })
            .await
    });
    assert_eq!(
        status.expect_err("not alice's namespace").code(),
        tonic::Code::NotFound
    );
    assert_eq!(c.client_as("alice", &["stop", &a]).code, 0);
}
