//! Day-2 tools (issue 17): `flotilla runs` filtered and paged by workflow, status, time and
//! label, and retention (`flotilla gc`), which deletes old runs and the stored objects nothing
//! else uses, never a live run or an object a remaining run references.

use flotilla_tests::hook::Hook;
use std::path::Path;
use std::time::{Duration, Instant};

use flotilla_tests::Env;
use serde_json::Value;

fn ids(listed: &Value) -> Vec<String> {
    listed
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {listed}"))
        .iter()
        .map(|r| r["run_id"].as_str().unwrap().to_owned())
        .collect()
}

fn run_id(env: &Env, script: &Path, extra: &[&str]) -> (i32, String) {
    let (code, report) = env.run(script, &[&["--stagger", "0"], extra].concat());
    let id = report["run_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no run id: {report}"))
        .to_owned();
    (code, id)
}

/// Files under `dir` (recursively), as paths relative to it.
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn runs_are_listed_by_workflow_status_time_and_label_a_page_at_a_time() {
    let env = Env::new();
    let alpha = env.script("alpha", "return await agent('a');");
    let beta = env.script("beta", "await agent('b'); throw new Error('beta fails');");
    let mut made = Vec::new();
    for i in 0..5 {
        let team = if i % 2 == 0 { "team=core" } else { "team=web" };
        let (code, id) = run_id(&env, &alpha, &["--label", team, "--label", "tier=1"]);
        assert_eq!(code, 0);
        made.push(id);
    }
    let (code, failed) = run_id(&env, &beta, &["--label", "team=core"]);
    assert_ne!(code, 0);
    made.push(failed.clone());

    let list = |args: &[&str]| {
        let out = env.flotilla(&[&["runs", "--json"], args].concat());
        assert_eq!(out.code, 0, "{out:?}");
        (out.json(), out.stderr)
    };
    let (all, _) = list(&[]);
    let newest_first: Vec<String> = made.iter().rev().cloned().collect();
    assert_eq!(ids(&all), newest_first);
    assert_eq!(all[0]["labels"]["team"], "core", "{all}");
    let (core, _) = list(&["--label", "team=core"]);
    assert_eq!(
        ids(&core),
        [
            made[5].clone(),
            made[4].clone(),
            made[2].clone(),
            made[0].clone()
        ]
    );
    let (both, _) = list(&["--label", "team=core", "--label", "tier=1"]);
    assert_eq!(
        ids(&both),
        [made[4].clone(), made[2].clone(), made[0].clone()]
    );
    let (fails, _) = list(&["--status", "failed"]);
    assert_eq!(ids(&fails), std::slice::from_ref(&failed));
    let (by_name, _) = list(&["--workflow", "beta"]);
    assert_eq!(ids(&by_name), std::slice::from_ref(&failed));
    let (recent, _) = list(&["--since", "1h"]);
    assert_eq!(recent.as_array().unwrap().len(), 6);
    let (none, _) = list(&["--since", "2999-01-01T00:00:00Z"]);
    assert_eq!(none.as_array().unwrap().len(), 0);

    // Pages of two: every run once, in order, each page naming where the next begins.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut args = vec!["--limit", "2"];
        if let Some(a) = &after {
            args.extend(["--after", a]);
        }
        let (page, stderr) = list(&args);
        seen.extend(ids(&page));
        match stderr
            .lines()
            .find_map(|l| l.strip_prefix("more runs follow: add --after "))
        {
            Some(token) => after = Some(token.trim().to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, newest_first);

    // Bad filters are refused by name.
    for (args, says) in [
        (vec!["runs", "--status", "done"], "--status"),
        (vec!["runs", "--label", "Team"], "KEY=VALUE"),
        (vec!["runs", "--since", "yesterday"], "--since"),
        (
            vec!["run", alpha.to_str().unwrap(), "--label", "BAD KEY=x"],
            "--label",
        ),
    ] {
        let out = env.flotilla(&args);
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
        assert!(out.stderr.contains(says), "{args:?}: {}", out.stderr);
    }
}

#[test]
fn gc_deletes_old_ended_runs_and_what_only_they_used_never_a_live_run_or_a_shared_payload() {
    let env = Env::new();
    let store = env.path().join("store");
    // Two runs with the same big result (one payload, stored once), one of them failing.
    let shared = "const r = await agent('pad ' + 'q'.repeat(300000));";
    let kept_script = env.script(
        "keeps",
        &format!("{shared}\nthrow new Error('fails after');"),
    );
    let gone_script = env.script("goes", &format!("{shared}\nreturn r.length;"));
    let small = env.script("small", "return await agent('small');");
    let (code, failed) = run_id(&env, &kept_script, &[]);
    assert_ne!(code, 0);
    let (code, gone) = run_id(&env, &gone_script, &[]);
    assert_eq!(code, 0);
    let (code, small_run) = run_id(&env, &small, &[]);
    assert_eq!(code, 0);
    let payloads = files_under(&store.join("payloads"));
    assert_eq!(
        payloads.len(),
        1,
        "one payload for the two equal results: {payloads:?}"
    );

    // A live run in another process: never deleted.
    let long = env.script("long", "return await agent('wait [[sleep:60000]]');");
    let mut live = env
        .command(
            &["run", long.to_str().unwrap(), "--json", "--stagger", "0"],
            &[],
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let live_id = loop {
        let out = env.flotilla(&["runs", "--json", "--status", "running"]);
        if let Some(id) = ids(&out.json()).first() {
            break id.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the long run never showed: {out:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };

    // Wait until all four are older than a second (what --older-than 1s looks at).
    let deadline = Instant::now() + Duration::from_secs(30);
    let dry = loop {
        let out = env.flotilla(&["gc", "--older-than", "1s", "--dry-run", "--json"]);
        assert_eq!(out.code, 0, "{out:?}");
        let v = out.json();
        if v["runs"].as_array().unwrap().len() + v["kept"].as_array().unwrap().len() == 4 {
            break v;
        }
        assert!(Instant::now() < deadline, "{v}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(dry["dry_run"], true);
    assert_eq!(dry["runs"].as_array().unwrap().len(), 3, "{dry}");
    assert!(
        dry["kept"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["run_id"] == live_id.as_str()
                && k["why"].as_str().unwrap().contains("running")),
        "{dry}"
    );
    // A dry run deletes nothing.
    assert_eq!(env.flotilla(&["show", &gone, "--json"]).code, 0);

    let out = env.flotilla(&["gc", "--older-than", "1s", "--keep-failed", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let swept = out.json();
    let mut deleted: Vec<String> = swept["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect();
    deleted.sort();
    let mut expected = vec![gone.clone(), small_run.clone()];
    expected.sort();
    assert_eq!(deleted, expected, "{swept}");
    for run in [&gone, &small_run] {
        let shown = env.flotilla(&["show", run]);
        assert_ne!(shown.code, 0, "{run} is still there");
        assert!(
            !store.join("runs").join(run).exists(),
            "{run}'s objects are left"
        );
    }
    // The failed run keeps its payload, and its journal still reads whole.
    assert_eq!(files_under(&store.join("payloads")), payloads);
    let failed_report = env.flotilla(&["show", &failed, "--json"]);
    assert_eq!(failed_report.code, 0, "{failed_report:?}");
    assert_eq!(failed_report.json()["status"], "failed");
    // Resumed, its call is served from its journal, big result (the payload) and all.
    let (_, resumed) = env.run(&kept_script, &["--stagger", "0", "--resume", &failed]);
    assert_eq!(resumed["agents"][0]["cached"], true, "{resumed}");
    assert!(
        resumed["error"]
            .as_str()
            .unwrap_or_default()
            .contains("fails after"),
        "{resumed}"
    );
    // The live run is untouched and still goes on.
    let listed = env.flotilla(&["runs", "--json"]).json();
    assert!(ids(&listed).contains(&live_id));

    // Killed, it is interrupted: old, ended, and without --keep-failed it goes; then nothing
    // references the payload, so it goes too.
    live.kill().unwrap();
    live.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = env.flotilla(&["runs", "--json", "--status", "interrupted"]);
        if ids(&out.json()).contains(&live_id) {
            break;
        }
        assert!(Instant::now() < deadline, "never interrupted: {out:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The resume is a run too: wait until it is a second old as well.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = env.flotilla(&["gc", "--older-than", "1s", "--dry-run", "--json"]);
        assert_eq!(out.code, 0, "{out:?}");
        if out.json()["runs"].as_array().unwrap().len() == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "{out:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = env.flotilla(&["gc", "--older-than", "1s"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("deleted 3 runs"), "{}", out.stdout);
    assert!(out.stdout.contains("1 payloads"), "{}", out.stdout);
    assert!(files_under(&store.join("payloads")).is_empty());
    let listed = env.flotilla(&["runs", "--json"]).json();
    assert!(ids(&listed).is_empty(), "{listed}");
    assert!(files_under(&store.join("index")).is_empty());
}

#[test]
fn a_coordinator_s_retention_deletes_ended_runs_and_keeps_a_running_run_and_its_source() {
    let c = flotilla_tests::cluster::Cluster::start_coordinator_with(
        1,
        4,
        &["--retention", "1s", "--retention-every", "1s"],
    );
    let repo = c.path().join("repo");
    flotilla_tests::git_repo(&repo);
    std::fs::write(repo.join("code.txt"), "the code\n").unwrap();
    flotilla_tests::commit_all(&repo, "code");
    let long = c.launch_in(
        &repo,
        "long",
        "return await agent('wait [[sleep:60000]]');",
        &["--label", "kind=long", "--stagger", "0"],
    );
    let quick = c.launch_in(
        &repo,
        "quick",
        "return await agent('quick');",
        &["--label", "kind=quick", "--stagger", "0"],
    );
    let store = c.path().join("store");
    // The fleet lists by label too (the coordinator reads its index).
    let listed = c.client(&["runs", "--json", "--label", "kind=long"]);
    assert_eq!(listed.code, 0, "{listed:?}");
    assert_eq!(ids(&listed.json()), std::slice::from_ref(&long));
    let (code, report) = c.wait(&quick);
    assert_eq!(code, 0, "{report}");

    // The sweep takes the ended run; the running one and the source it uses stay.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = ids(&c.client(&["runs", "--json"]).json());
        if !now.contains(&quick) {
            assert!(now.contains(&long), "{now:?}");
            break;
        }
        assert!(Instant::now() < deadline, "retention never took {quick}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(!store.join("runs").join(&quick).exists());
    let sources = files_under(&store.join("sources"));
    assert!(
        sources.iter().any(|f| f.contains("/commits/"))
            && sources.iter().any(|f| f.ends_with(".pack")),
        "the running run's source went: {sources:?}"
    );
    let status = c.client(&["status", &long, "--json"]);
    assert_eq!(status.code, 0, "the long run is not running: {status:?}");

    // Stopped, it ends, and then it and its source go.
    let out = c.client(&["stop", &long]);
    assert_eq!(out.code, 0, "{out:?}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = ids(&c.client(&["runs", "--json"]).json());
        if now.is_empty() && files_under(&store.join("sources")).is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left: {now:?} {:?}",
            files_under(&store.join("sources"))
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map_or("", |(_, v)| v.as_str())
}

/// Checks `X-Flotilla-Signature: t=UNIX,v1=HEX` against `secret` and the body.
fn signed_by(secret: &str, headers: &[(String, String)], body: &str) -> bool {
    let sig = header(headers, "x-flotilla-signature");
    let Some((t, v1)) = sig
        .strip_prefix("t=")
        .and_then(|rest| rest.split_once(",v1="))
    else {
        return false;
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    let Ok(tag) = hex::decode(v1) else {
        return false;
    };
    ring::hmac::verify(&key, format!("{t}.{body}").as_bytes(), &tag).is_ok()
}

const SECRET: &str = "a webhook secret of the test";

#[test]
fn a_run_s_end_is_posted_signed_retried_on_5xx_and_recorded() {
    let env = Env::new();
    let hook = Hook::start(vec![503, 502]);
    let script = env.script("hooked", "return await agent('done');");
    let out = env.flotilla_with_env(
        &[
            "run",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--notify",
            &hook.url(),
            "--label",
            "team=core",
        ],
        &[("FLOTILLA_NOTIFY_SECRET", SECRET)],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let report = out.json();
    let run = report["run_id"].as_str().unwrap().to_owned();
    assert_eq!(report["notify"]["delivered"], true, "{report}");
    assert_eq!(report["notify"]["attempts"], 3, "{report}");
    assert_eq!(report["notify"]["status"], 200, "{report}");
    let got = hook.requests();
    assert_eq!(got.len(), 3, "two refused, then delivered");
    // The same delivery each time, signed over its time and body.
    let id = header(&got[0].0, "x-flotilla-delivery").to_owned();
    assert!(!id.is_empty());
    for (headers, body) in &got {
        assert_eq!(header(headers, "x-flotilla-delivery"), id);
        assert_eq!(header(headers, "x-flotilla-event"), "run.ended");
        assert!(signed_by(SECRET, headers, body), "{headers:?}");
        assert!(!signed_by("another secret entirely", headers, body));
    }
    let body: Value = serde_json::from_str(&got[2].1).unwrap();
    assert_eq!(body["run_id"], run.as_str());
    assert_eq!(body["status"], "completed");
    assert_eq!(body["labels"]["team"], "core");
    assert_eq!(body["usage"]["agents"], 1);
    // Recorded: `show` reports it, and it is an event of the run.
    let shown = env.flotilla(&["show", &run, "--json"]).json();
    assert_eq!(shown["notify"], report["notify"]);
    let events = env.path().join("store/runs").join(&run).join("events");
    let recorded = std::fs::read_dir(&events)
        .unwrap()
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .any(|text| text.contains("\"type\":\"notified\"") && text.contains("\"delivered\":true"));
    assert!(recorded, "no notified event in {}", events.display());
}

#[test]
fn a_webhook_refused_with_4xx_is_not_retried_and_the_run_still_completes() {
    let env = Env::new();
    let hook = Hook::start(vec![400]);
    let script = env.script("hooked", "return await agent('done');");
    let args = [
        "run",
        script.to_str().unwrap(),
        "--json",
        "--stagger",
        "0",
        "--notify",
        &hook.url(),
    ];
    let out = env.flotilla_with_env(&args, &[("FLOTILLA_NOTIFY_SECRET", SECRET)]);
    assert_eq!(out.code, 0, "{out:?}");
    let report = out.json();
    assert_eq!(report["status"], "completed");
    assert_eq!(report["notify"]["delivered"], false, "{report}");
    assert_eq!(report["notify"]["attempts"], 1, "{report}");
    assert!(
        report["notify"]["error"].as_str().unwrap().contains("400"),
        "{report}"
    );
    assert_eq!(hook.requests().len(), 1);
    // Without a secret there is nothing to sign with: refused before anything runs.
    let out = env.flotilla(&args);
    assert_eq!(out.code, 2, "{out:?}");
    assert_eq!(out.json()["status"], "rejected", "{out:?}");
    assert!(
        out.json()["error"]
            .to_string()
            .contains("FLOTILLA_NOTIFY_SECRET"),
        "{out:?}"
    );
    let out = env.flotilla(&["run", script.to_str().unwrap(), "--notify", "ftp://x/y"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("http:// or https://"), "{}", out.stderr);
}

#[test]
fn a_fleet_run_s_end_is_posted_by_its_coordinator() {
    let secret_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret_file.path(), format!("{SECRET}\n")).unwrap();
    let c = flotilla_tests::cluster::Cluster::start_coordinator_with(
        1,
        2,
        &["--notify-secret-file", secret_file.path().to_str().unwrap()],
    );
    // A coordinator alone (no etcd) is ready as `single`.
    let probe = flotilla_tests::http_get(c.http_port, "/healthz", &[]);
    assert_eq!(probe.status, 200, "{}", probe.body);
    assert!(probe.body.contains("\"role\":\"single\""), "{}", probe.body);
    let hook = Hook::start(vec![]);
    let run = c.launch(
        "fleet-hook",
        "return await agent('on the fleet');",
        &["--notify", &hook.url(), "--stagger", "0"],
    );
    let (code, report) = c.wait(&run);
    assert_eq!(code, 0, "{report}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while hook.requests().is_empty() {
        assert!(Instant::now() < deadline, "the coordinator never posted");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (headers, body) = &hook.requests()[0];
    assert!(signed_by(SECRET, headers, body));
    let body: Value = serde_json::from_str(body).unwrap();
    assert_eq!(body["run_id"], run.as_str());
    assert_eq!(body["status"], "completed");
    // The delivery is in the store with the run.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let shown = env_show(&c, &run);
        if shown["notify"]["delivered"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "{shown}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn env_show(c: &flotilla_tests::cluster::Cluster, run: &str) -> Value {
    let mut cmd = std::process::Command::new(&c.bin);
    cmd.args(["show", run, "--json", "--store", &c.store_url()]);
    flotilla_tests::run_with_timeout(cmd, Duration::from_secs(30)).json()
}

#[test]
fn a_receiver_down_for_a_while_gets_exactly_one_delivery_once_it_is_up() {
    let env = Env::new();
    // Down: connections are taken and dropped at once (each attempt fails), counted.
    let down = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = down.local_addr().unwrap().port();
    let script = env.script("hooked", "return await agent('done');");
    let url = format!("http://127.0.0.1:{port}/hook");
    let child = env
        .command(
            &[
                "run",
                script.to_str().unwrap(),
                "--json",
                "--stagger",
                "0",
                "--notify",
                &url,
            ],
            &[("FLOTILLA_NOTIFY_SECRET", SECRET)],
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The first attempt reaches the receiver while it is down.
    let (conn, _) = down.accept().unwrap();
    drop(conn);
    drop(down);
    // Then it comes up on the same port; the retry finds it.
    let hook = Hook::start_on(port, vec![]);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["notify"]["delivered"], true, "{report}");
    assert!(
        report["notify"]["attempts"].as_u64().unwrap() >= 2,
        "{report}"
    );
    let got = hook.requests();
    assert_eq!(got.len(), 1, "exactly one delivery reached the receiver");
    assert!(signed_by(SECRET, &got[0].0, &got[0].1));
}

#[test]
fn a_webhook_a_killed_coordinator_did_not_finish_is_sent_once_by_the_next_one() {
    let secret_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret_file.path(), SECRET).unwrap();
    let mut c = flotilla_tests::cluster::Cluster::start_coordinator_with(
        1,
        2,
        &["--notify-secret-file", secret_file.path().to_str().unwrap()],
    );
    // The receiver is down: it takes each connection and drops it.
    let down = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = down.local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}/hook");
    let run = c.launch(
        "outlives",
        "return await agent('done');",
        &["--notify", &url, "--stagger", "0"],
    );
    let (code, _) = c.wait(&run);
    assert_eq!(code, 0);
    // Its first attempt fails; the coordinator dies before the next.
    let (conn, _) = down.accept().unwrap();
    drop(conn);
    let mut old = c.take_coordinator().unwrap();
    old.kill().unwrap();
    old.wait().unwrap();
    let outbox = c.path().join("store/notify/outbox");
    assert_eq!(
        files_under(&outbox),
        [format!("{run}.json")],
        "the undelivered webhook is kept"
    );
    drop(down);
    let hook = Hook::start_on(port, vec![]);
    // The next coordinator on the same store sends it, once.
    c.start_coordinator();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let shown = env_show(&c, &run);
        if shown["notify"]["delivered"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "{shown}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let got = hook.requests();
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(signed_by(SECRET, &got[0].0, &got[0].1));
    let body: Value = serde_json::from_str(&got[0].1).unwrap();
    assert_eq!(body["run_id"], run.as_str());
    assert!(files_under(&outbox).is_empty());
}
