//! The session page in a real browser (headless Chromium over WebDriver): it follows a run
//! live, opens an agent's transcript, and its stop button stops the run.

use flotilla_tests::cluster::Cluster;
use flotilla_tests::webdriver::Browser;

/// Kills a child process when the test ends, failed assertions included.
struct Reaper(Option<std::process::Child>);

impl Reaper {
    fn wait(mut self) -> std::process::Output {
        self.0.take().unwrap().wait_with_output().unwrap()
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `flotilla run ARGS` (which includes `--serve`) in `env` and reads the session page
/// line it prints: the process, the page's port and path, and the page's key.
fn serve(env: &flotilla_tests::Env, args: &[&str]) -> (Reaper, u16, String, String) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(&env.bin)
        .arg("run")
        .args(args)
        .current_dir(env.path())
        .env("FLOTILLA_STORE", env.store_url())
        .env("FLOTILLA_WORKSPACE", env.workspace())
        .env("HOME", env.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let child = Reaper(Some(child));
    let mut line = String::new();
    let url = loop {
        line.clear();
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "no session page line"
        );
        if let Some(u) = line.trim().strip_prefix("session page: ") {
            break u.to_owned();
        }
    };
    // Keep reading what it prints, so its stderr never meets a closed pipe.
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    let rest = url
        .strip_prefix("http://127.0.0.1:")
        .expect("served on loopback");
    let (port, path) = rest.split_once('/').unwrap();
    let (path, key) = path
        .split_once("?key=")
        .expect("the URL carries the page's key");
    (
        child,
        port.parse().unwrap(),
        format!("/{path}"),
        key.to_owned(),
    )
}

#[test]
fn the_session_page_follows_a_run_live_and_its_stop_button_stops_it() {
    let c = Cluster::start(1, 8);
    let run = c.launch(
        "live",
        "phase('Work');\n\
         return (await parallel(Array.from({ length: 16 }, (_, i) => () =>\n\
           agent('job ' + i + ' [[sleep:' + (400 + i * 400) + ']]', { label: 'job ' + i })))).length;",
        &["--stagger", "0", "--concurrency", "4"],
    );
    let t = c.client(&["token", "create", "--json"]);
    assert_eq!(t.code, 0, "{t:?}");
    let login = t.json()["login_url"].as_str().unwrap().to_owned();

    let b = Browser::start();
    eprintln!("browser up; signing in at {login}");
    b.goto(&format!("{login}&next=/runs/{run}"));
    eprintln!("page opened");
    b.wait_for("the session page", 20, |b| {
        b.text("#status").filter(|s| s == "running")
    });
    assert_eq!(
        b.text("h1").unwrap().split_whitespace().next(),
        Some("live")
    );
    // A marker in the page's memory survives only if the page is never reloaded.
    b.eval("window.__stayed = true; return null;");
    let first: u64 = b.text("#done").unwrap().parse().unwrap();
    let later = b.wait_for("the done count to rise", 30, |b| {
        let n: u64 = b.text("#done")?.parse().ok()?;
        (n > first).then_some(n)
    });
    assert!(later > first);
    assert_eq!(
        b.eval("return window.__stayed === true;"),
        true,
        "updated without a reload"
    );

    // The timeline draws the agents that started, live.
    b.wait_for("bars on the timeline", 20, |b| {
        let n = b.eval("return document.querySelectorAll('#timeline svg g[data-a]').length;");
        (n.as_u64()? > 0).then_some(())
    });
    let shot = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/test-artifacts/session-page.png");
    b.screenshot(&shot);
    assert!(std::fs::metadata(&shot).unwrap().len() > 1000, "a real PNG");

    // One agent's page of its own: its prompt and transcript.
    b.click("[data-agent=\"0\"]");
    let detail = b.wait_for("the agent's page", 20, |b| {
        b.text(".transcript").map(|_| b.text("body").unwrap())
    });
    assert!(
        b.url().ends_with(&format!("/runs/{run}/agents/0")),
        "{}",
        b.url()
    );
    assert!(
        detail.contains("job 0 [[sleep:400]]"),
        "the prompt: {detail}"
    );
    assert!(detail.contains("Transcript, attempt 1"), "{detail}");
    b.screenshot(&shot.with_file_name("agent-page.png"));

    // Stop, as a user would: the page asks to confirm and for a reason.
    let base = login.split("/login").next().unwrap().to_owned();
    b.goto(&format!("{base}/runs/{run}"));
    b.wait_for("the session page again", 20, |b| {
        b.text("#status").filter(|s| s == "running")
    });
    b.click("button[data-action=stop]");
    b.wait_for("the confirmation", 10, |b| {
        (b.eval("return document.getElementById('confirm').hidden;") == false).then_some(())
    });
    assert_eq!(
        b.text("#status").as_deref(),
        Some("running"),
        "nothing stops before the confirmation"
    );
    b.type_into("#reason", "wrong input data");
    b.click("#confirm-go");
    b.wait_for("the run to show stopped", 30, |b| {
        b.text("#status").filter(|s| s == "stopped")
    });
    let (code, r) = c.wait(&run);
    assert_eq!(code, 1, "{r}");
    assert_eq!(r["status"], "stopped", "{r}");
    assert!(r["usage"]["agents"].as_u64().unwrap() < 17);
    let said = r["logs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l.as_str())
        .find(|l| l.starts_with("[stop]"));
    let said = said.unwrap_or_else(|| panic!("the stop in the run's log: {r}"));
    assert!(
        said.contains("asked to stop the run: wrong input data"),
        "{said}"
    );
}

#[test]
fn run_serve_shows_the_page_on_loopback_streams_updates_and_takes_actions() {
    let env = flotilla_tests::Env::new();
    let script = env.script(
        "served",
        "return (await parallel(Array.from({ length: 6 }, (_, i) => () => agent('s' + i + ' [[sleep:700]]')))).length;",
    );
    let (child, port, path, key) = serve(
        &env,
        &[
            "--serve",
            script.to_str().unwrap(),
            "--json",
            "--concurrency",
            "2",
            "--stagger",
            "0",
        ],
    );
    // Without the key printed in its URL, nothing; with it, the page, and a cookie.
    let without = flotilla_tests::http_get(port, &path, &[]);
    assert_eq!(without.status, 401, "{without:?}");
    let page = flotilla_tests::http_get(port, &format!("{path}?key={key}"), &[]);
    assert_eq!(page.status, 200, "{page:?}");
    assert!(page.body.contains("served"), "{}", page.body);
    let cookie = page
        .header("set-cookie")
        .expect("the key is kept in a cookie");
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let keyed = format!("flotilla_key={key}");
    let page = flotilla_tests::http_get(port, &path, &[("Cookie", &keyed)]);
    assert_eq!(page.status, 200, "{page:?}");
    // DNS rebinding: another host name for 127.0.0.1 is refused, key or not.
    let rebound = format!("{path}?key={key}");
    let evil = serve_raw(port, &rebound, "attacker.example:80");
    assert!(evil.starts_with("HTTP/1.1 403"), "{evil}");

    // The page's actions need the x-flotilla header; with it, pause and resume work.
    let control = format!("{path}/control");
    let json = [("Content-Type", "application/json"), ("Cookie", &keyed)];
    let r =
        flotilla_tests::http_request(port, "POST", &control, &json, Some(r#"{"action":"pause"}"#));
    assert_eq!(r.status, 403, "{r:?}");
    let with = [
        ("Content-Type", "application/json"),
        ("x-flotilla", "1"),
        ("Cookie", &keyed),
    ];
    let r =
        flotilla_tests::http_request(port, "POST", &control, &with, Some(r#"{"action":"pause"}"#));
    assert_eq!(r.status, 200, "{r:?}");
    let r =
        flotilla_tests::http_request(port, "POST", &control, &with, Some(r#"{"action":"pause"}"#));
    assert_eq!(r.status, 409, "paused already: {r:?}");
    let r = flotilla_tests::http_request(
        port,
        "POST",
        &control,
        &with,
        Some(r#"{"action":"resume"}"#),
    );
    assert_eq!(r.status, 200, "{r:?}");
    let no_key = [("Content-Type", "application/json"), ("x-flotilla", "1")];
    let r = flotilla_tests::http_request(
        port,
        "POST",
        &control,
        &no_key,
        Some(r#"{"action":"stop"}"#),
    );
    assert_eq!(r.status, 401, "no key, no stop: {r:?}");

    // The event stream sends the changing part of the page until the run ends.
    let events = flotilla_tests::http_get(port, &format!("{path}/events"), &[("Cookie", &keyed)]);
    assert_eq!(events.status, 200);
    assert!(
        events.body.contains("event: update") || events.body.contains("event: end"),
        "{}",
        events.body
    );
    assert!(events.body.contains("event: end"), "{}", events.body);
    let out = child.wait();
    assert_eq!(out.status.code(), Some(0));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["result"], 6);

    let bad = env.flotilla(&["run", script.to_str().unwrap(), "--serve=0.0.0.0:0"]);
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(bad.stderr.contains("loopback"), "{bad:?}");
}

#[test]
fn a_served_call_of_a_resumed_run_shows_the_prompt_from_the_run_it_came_from() {
    let env = flotilla_tests::Env::new();
    let first = env.script(
        "first",
        "return [await agent('alpha prompt'), await agent('beta [[sleep:10]]')];",
    );
    let (code, r) = env.run(&first, &["--stagger", "0"]);
    assert_eq!(code, 0, "{r}");
    let parent = r["run_id"].as_str().unwrap().to_owned();
    let second = env.script(
        "second",
        "return [await agent('alpha prompt'), await agent('gamma [[sleep:3000]]')];",
    );
    let (child, port, path, key) = serve(
        &env,
        &[
            second.to_str().unwrap(),
            "--json",
            "--serve",
            "--resume",
            &parent,
            "--stagger",
            "0",
        ],
    );
    // The script makes its first call a moment after the page is up.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let detail = loop {
        let d = flotilla_tests::http_get(port, &format!("{path}/agents/0?key={key}"), &[]);
        if d.status == 200 || std::time::Instant::now() > deadline {
            break d;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(detail.status, 200, "{detail:?}");
    assert!(detail.body.contains("alpha prompt"), "{}", detail.body);
    assert!(
        detail.body.contains("served from an earlier run"),
        "{}",
        detail.body
    );
    let out = child.wait();
    assert_eq!(out.status.code(), Some(0));
}

/// A GET with a `Host` header of our choosing (the harness's helper always sends loopback's).
fn serve_raw(port: u16, path: &str, host: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// The `--serve` page has the fleet's read timeout: a client that trickles its headers, a
/// byte every 200 ms, is cut off though it never goes quiet, and the page answers meanwhile.
#[test]
fn run_serve_cuts_off_a_client_that_trickles_its_headers() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let env = flotilla_tests::Env::new();
    let script = env.script("slow", "return await agent('s [[sleep:60000]]');");
    let (_child, port, path, key) = serve(&env, &["--serve", script.to_str().unwrap()]);
    let mut slow = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        slow,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-A: "
    )
    .unwrap();
    slow.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let page = flotilla_tests::http_get(port, &format!("{path}?key={key}"), &[]);
    assert_eq!(page.status, 200, "the page answers meanwhile: {page:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = [0u8; 1024];
    loop {
        assert!(
            Instant::now() < deadline,
            "a trickling client was never cut off"
        );
        match slow.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
        if slow.write_all(b"a").is_err() {
            break;
        }
    }
}

/// The pages on a run of 1,000 agents in two phases, some failing and some retried, in a real
/// browser: the timeline draws every started agent live and to the end, a bar opens its
/// agent's page, and `/runs`'s filters narrow the list. Screenshots are kept under
/// `target/test-artifacts/`.
#[test]
fn a_thousand_agent_run_has_a_timeline_agent_pages_and_filtered_runs() {
    let c = Cluster::start(2, 128);
    // Signed in before the big run starts, so the page meets it live.
    let t = c.client(&["token", "create", "--json"]);
    assert_eq!(t.code, 0, "{t:?}");
    let login = t.json()["login_url"].as_str().unwrap().to_owned();
    let base = login.split("/login").next().unwrap().to_owned();
    let shots = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-artifacts");
    let b = Browser::start();
    b.goto(&format!("{login}&next=/runs"));
    let other = c.launch(
        "small",
        "return await agent('tiny');",
        &["--label", "team=beta", "--stagger", "0"],
    );
    let run = c.launch(
        "thousand",
        "phase('Survey');\n\
         await parallel(Array.from({ length: 600 }, (_, i) => () =>\n\
           agent('survey ' + i + (i % 97 == 5 ? ' [[fail]]' : '') + (i % 50 == 7 ? ' [[ratelimit:1]]' : '') +\n\
                 ' [[sleep:' + (800 + (i % 7) * 200) + ']]', { label: 'survey ' + i })));\n\
         phase('Fix');\n\
         const r = await parallel(Array.from({ length: 400 }, (_, i) => () =>\n\
           agent('fix ' + i + ' [[sleep:' + (200 + (i % 5) * 100) + ']]', { label: 'fix ' + i })));\n\
         return r.length;",
        &[
            "--label",
            "team=alpha",
            "--stagger",
            "0",
            "--concurrency",
            "256",
        ],
    );
    b.goto(&format!("{base}/runs/{run}"));
    let bars = |b: &Browser, css: &str| {
        b.eval(&format!(
            "return document.querySelectorAll('#timeline svg {css}').length;"
        ))
        .as_u64()
        .unwrap_or(0)
    };
    // Live: running bars while the run goes on.
    b.wait_for("running agents on the timeline", 60, |b| {
        (bars(b, "rect.run") > 0 && b.text("#status").as_deref() == Some("running")).then_some(())
    });
    b.screenshot(&shots.join("timeline-live.png"));
    b.wait_for("the run to end", 180, |b| {
        b.text("#status").filter(|s| s.starts_with("completed"))
    });
    let (code, r) = c.wait(&run);
    assert_eq!(r["usage"]["agents"], 1000, "{code} {}", r["usage"]);
    let failed = r["agents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["status"] == "failed")
        .count() as u64;
    assert!(failed > 0, "some agents fail");
    // Every agent is on the timeline (an agent is one group of bars), in both phases.
    assert_eq!(bars(&b, "g[data-a]"), 1000);
    assert!(
        bars(&b, "rect.fail") as usize >= failed as usize,
        "failed attempts are red"
    );
    assert!(
        bars(&b, "rect.retry") > 0,
        "a rate-limited attempt ends and goes again"
    );
    let phases = b.eval(
        "return Array.from(document.querySelectorAll('#timeline svg text.ph')).map(t => t.textContent).join('|');",
    );
    let phases = phases.as_str().unwrap();
    assert!(
        phases.contains("Survey · 600 agents") && phases.contains("Fix · 400 agents"),
        "{phases}"
    );
    b.screenshot(&shots.join("timeline-1000.png"));
    let bytes = std::fs::metadata(shots.join("timeline-1000.png"))
        .unwrap()
        .len();
    assert!(bytes > 10_000, "a real picture: {bytes} bytes");

    // A bar opens its agent's page: a rate-limited one, with both attempts and their worker.
    // Past the lanes' cap agents share lanes and later bars cover earlier ones, so the click
    // goes to a point where one of these agents' bars is on top (a real click, at that point).
    let limited: Vec<(u64, String)> = r["agents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| {
            a["label"]
                .as_str()
                .and_then(|l| l.strip_prefix("survey "))
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|n| n % 50 == 7)
        })
        .map(|a| {
            (
                a["index"].as_u64().unwrap(),
                a["label"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let indices: Vec<u64> = limited.iter().map(|(i, _)| *i).collect();
    let spot = b.eval(&format!(
        "for (const i of {indices:?}) {{\n\
           for (const r of document.querySelectorAll('#timeline svg g[data-a=\"' + i + '\"] rect')) {{\n\
             r.scrollIntoView({{ block: 'center' }});\n\
             const box = r.getBoundingClientRect();\n\
             const y = Math.round(box.top + box.height / 2);\n\
             for (let x = Math.ceil(box.left); x < box.right; x++) {{\n\
               if (document.elementFromPoint(x, y) === r) return [i, x, y];\n\
             }}\n\
           }}\n\
         }}\n\
         return null;"
    ));
    let spot: Vec<u64> = spot
        .as_array()
        .unwrap_or_else(|| panic!("every rate-limited agent's bar is covered: {spot}"))
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let retried = spot[0];
    let label = &limited.iter().find(|(i, _)| *i == retried).unwrap().1;
    b.click_at(spot[1], spot[2]);
    b.wait_for("the agent's page", 20, |b| {
        b.url()
            .ends_with(&format!("/runs/{run}/agents/{retried}"))
            .then_some(())?;
        b.text(".attempts")
    });
    let page = b.text("body").unwrap();
    assert!(page.contains(label.as_str()), "{label}: {page}");
    let rows = b.eval("return document.querySelectorAll('table.attempts tbody tr').length;");
    assert_eq!(rows.as_u64(), Some(2), "two attempts: {page}");
    assert!(
        page.contains("worker-"),
        "the worker of each attempt: {page}"
    );
    b.screenshot(&shots.join("agent-from-timeline.png"));

    // /runs: newest first, and the filters narrow it.
    b.goto(&format!("{base}/runs"));
    let listed = |b: &Browser| {
        b.eval("return Array.from(document.querySelectorAll('#runs tbody tr')).map(r => r.id).join(',');")
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let all = b.wait_for("the runs", 20, |b| {
        Some(listed(b)).filter(|l| !l.is_empty())
    });
    let (at_run, at_other) = (
        all.find(&format!("run-{run}")).expect("the big run"),
        all.find(&format!("run-{other}")).expect("the small run"),
    );
    assert!(at_run < at_other, "newest first: {all}");
    b.type_into("#f-label", "team=beta");
    b.click("#f-go");
    b.wait_for("the label filter", 20, |b| {
        (listed(b) == format!("run-{other}")).then_some(())
    });
    b.goto(&format!("{base}/runs?workflow=thousand&status=completed"));
    b.wait_for("the workflow and status filters", 20, |b| {
        (listed(b) == format!("run-{run}")).then_some(())
    });
    let row = b.text(&format!("#run-{run}")).unwrap();
    assert!(
        row.contains(&format!("{failed}")),
        "the failed column: {row}"
    );
    b.screenshot(&shots.join("runs-filtered.png"));
    b.goto(&format!("{base}/runs?status=failed&workflow=thousand"));
    b.wait_for("no run", 20, |b| b.text("#no-runs"));

    // The fleet page: both workers and the attempts they ran.
    b.goto(&format!("{base}/fleet"));
    let fleet = b.wait_for("the fleet page", 20, |b| b.text("#workers"));
    assert!(fleet.contains("attached"), "{fleet}");
    let attempts: u64 = b
        .eval("return Array.from(document.querySelectorAll('#workers tbody tr')).map(r => +r.children[3].textContent).reduce((a, b) => a + b, 0);")
        .as_u64()
        .unwrap();
    assert!(
        attempts >= 1001,
        "the workers ran every attempt: {attempts}"
    );
    b.screenshot(&shots.join("fleet.png"));
}

/// `flotilla ui` serves the pages of the local store's runs on loopback: a finished run, and
/// one going on in another `flotilla run` process, followed live; without its key, nothing.
#[test]
fn flotilla_ui_shows_every_local_run_and_follows_one_running_elsewhere() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let env = flotilla_tests::Env::new();
    let done = env.script("finished", "return await agent('one');");
    let (code, r) = env.run(&done, &["--stagger", "0"]);
    assert_eq!(code, 0, "{r}");
    let finished = r["run_id"].as_str().unwrap().to_owned();

    let bad = env.flotilla(&["ui", "--listen", "0.0.0.0:0"]);
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(bad.stderr.contains("loopback"), "{bad:?}");

    let mut ui = Command::new(&env.bin)
        .args(["ui", "--listen", "127.0.0.1:0"])
        .current_dir(env.path())
        .env("FLOTILLA_STORE", env.store_url())
        .env("HOME", env.path())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(ui.stderr.take().unwrap());
    let ui = Reaper(Some(ui));
    let mut line = String::new();
    let url = loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "no URL line");
        if let Some(u) = line.trim().strip_prefix("flotilla ui: ") {
            break u.to_owned();
        }
    };
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    let rest = url.strip_prefix("http://127.0.0.1:").expect("loopback");
    let (port, path) = rest.split_once('/').unwrap();
    let port: u16 = port.parse().unwrap();
    let key = path.split_once("?key=").unwrap().1.to_owned();
    assert_eq!(
        flotilla_tests::http_get(port, "/runs", &[]).status,
        401,
        "no key, nothing"
    );

    // A run going on in another process.
    let slow = env.script(
        "going-on",
        "phase('Slow'); return (await parallel([1, 2, 3].map(i => () => agent('s' + i + ' [[sleep:' + i * 2500 + ']]')))).length;",
    );
    let (other, _, _, _) = serve(&env, &["--serve", slow.to_str().unwrap(), "--stagger", "0"]);

    let b = Browser::start();
    b.goto(&format!("http://127.0.0.1:{port}/runs?key={key}"));
    let rows = b.wait_for("both runs listed", 30, |b| {
        let ids = b
            .eval("return Array.from(document.querySelectorAll('#runs tbody tr')).map(r => r.id).join(',');")
            .as_str()
            .unwrap_or_default()
            .to_owned();
        (ids.contains(&finished) && ids.split(',').count() >= 2).then_some(ids)
    });
    let live = rows
        .split(',')
        .map(|id| id.trim_start_matches("run-").to_owned())
        .find(|id| *id != finished)
        .unwrap();
    b.goto(&format!("http://127.0.0.1:{port}/runs/{live}"));
    b.wait_for("the other process's run, running", 30, |b| {
        b.text("#status").filter(|s| s == "running")
    });
    b.wait_for("its bars on the timeline", 30, |b| {
        let n = b.eval("return document.querySelectorAll('#timeline svg g[data-a]').length;");
        (n.as_u64()? == 3).then_some(())
    });
    // Followed live until it ends, without a reload.
    b.eval("window.__stayed = true; return null;");
    b.wait_for("the run to end on the page", 60, |b| {
        b.text("#status").filter(|s| s.starts_with("completed"))
    });
    assert_eq!(b.eval("return window.__stayed === true;"), true);
    let shot = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/test-artifacts/flotilla-ui.png");
    b.screenshot(&shot);
    let out = other.wait();
    assert_eq!(out.status.code(), Some(0));
    drop(ui);
}

/// `flotilla bench pages` serves real pages and reports its figures: page times for each
/// size, with and without the timeline, and what readers of a live run's events cost.
#[test]
fn the_pages_benchmark_reports_its_figures() {
    let env = flotilla_tests::Env::new();
    let out = env.flotilla(&[
        "bench",
        "pages",
        "--agents",
        "20,60",
        "--rounds",
        "1",
        "--viewers",
        "3",
        "--window",
        "1",
        "--json",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    let pages = r["pages"].as_array().expect("pages");
    assert_eq!(pages.len(), 2, "{r}");
    assert_eq!(pages[1]["agents"], 60, "{r}");
    for p in pages {
        for f in [
            "stored_complete_ms",
            "live_complete_ms",
            "stored_no_timeline_ms",
        ] {
            assert!(p[f].as_f64().is_some_and(|v| v > 0.0), "{f} in {p}");
        }
        assert!(p["page_bytes"].as_u64().unwrap() > 5_000, "{p}");
    }
    // The bigger page is bigger: each agent is on it.
    assert!(
        pages[1]["page_bytes"].as_u64() > pages[0]["page_bytes"].as_u64(),
        "{r}"
    );
    let v = &r["viewers"];
    assert_eq!(
        (v["agents"].as_u64(), v["viewers"].as_u64()),
        (Some(60), Some(3)),
        "{r}"
    );
    assert!(
        v["updates"].as_u64().unwrap() > 0,
        "the readers were sent updates: {r}"
    );
}

/// `flotilla logs RUN --follow`, started while the run goes on, prints every event of every
/// agent once, as they come, and ends with the run: what it printed is what a plain `logs`
/// prints afterwards.
#[test]
fn logs_follow_prints_each_event_once_as_it_comes_and_ends_with_the_run() {
    let env = flotilla_tests::Env::new();
    let script = env.script(
        "followed",
        "const a = await agent('first [[sleep:1500]]', { label: 'first' });\n\
         const b = await agent('second [[sleep:1500]]', { label: 'second' });\n\
         return [a, b];",
    );
    let (run_proc, _, path, _) = serve(
        &env,
        &["--serve", script.to_str().unwrap(), "--stagger", "0"],
    );
    let run = path.trim_start_matches("/runs/").to_owned();
    let follow = std::process::Command::new(&env.bin)
        .args(["logs", &run, "--follow"])
        .current_dir(env.path())
        .env("FLOTILLA_STORE", env.store_url())
        .env("HOME", env.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut follow = Reaper(Some(follow));
    // The first agent's lines come while the run still goes on (its second agent sleeps).
    let out = follow.0.as_mut().unwrap().stdout.take().unwrap();
    let mut followed = String::new();
    let mut early = None;
    for line in std::io::BufRead::lines(std::io::BufReader::new(out)) {
        let line = line.unwrap();
        if line.starts_with("== #0 first") {
            let shown = env.flotilla(&["show", &run, "--json"]);
            early = Some(shown.json()["status"].clone());
        }
        followed.push_str(&line);
        followed.push('\n');
    }
    assert_eq!(
        early,
        Some(serde_json::json!("running")),
        "the first agent's heading before the run ended: {followed}"
    );
    assert_eq!(run_proc.wait().status.code(), Some(0));
    let ended = follow.wait();
    assert_eq!(ended.status.code(), Some(0), "{ended:?}");
    let plain = env.flotilla(&["logs", &run]);
    assert_eq!(plain.code, 0, "{plain:?}");
    assert!(plain.stdout.contains("== #1 second"), "{}", plain.stdout);
    assert_eq!(followed, plain.stdout, "followed and plain logs differ");
    // With --json, one object per event, each once.
    let json = env.flotilla(&["logs", &run, "--follow", "--json"]);
    assert_eq!(
        json.code, 0,
        "an ended run: the follow ends at once: {json:?}"
    );
    let lines: Vec<&str> = json.stdout.lines().collect();
    let unique: std::collections::HashSet<&&str> = lines.iter().collect();
    assert!(
        !lines.is_empty() && unique.len() == lines.len(),
        "{}",
        json.stdout
    );
}

/// The same through a coordinator: `logs --follow --coordinator` ends with the run and prints
/// what a plain `logs` prints afterwards.
#[test]
fn logs_follow_through_a_coordinator_ends_with_the_run() {
    let c = Cluster::start(1, 2);
    let run = c.launch(
        "followed",
        "const a = await agent('first [[sleep:1200]]', { label: 'first' });\n\
         return [a, await agent('second [[sleep:1200]]', { label: 'second' })];",
        &["--stagger", "0"],
    );
    let followed = c.client(&["logs", &run, "--follow"]);
    assert_eq!(followed.code, 0, "{followed:?}");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let plain = c.client(&["logs", &run]);
    assert!(plain.stdout.contains("== #1 second"), "{plain:?}");
    assert_eq!(followed.stdout, plain.stdout);
}
