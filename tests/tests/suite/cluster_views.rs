//! One truth for every view of a run (issue 29, item 4): a run walked through queued,
//! running, paused, resumed, waiting (no worker carries what an agent asks) and completed
//! with failures, and a second run held in `stopping` (its worker does not answer) — at each
//! step `status --json`, plain `status`, `agents --status`, `runs --status` (text and JSON),
//! `/runs.json`, the `/runs` page, the run page's `status.json`, `/metrics`, the MCP tool
//! `WorkflowStatus` and `watch` say the same thing, read from the coordinator's one summary
//! of the run; `show`, which reads the store, says the same of the run and its agents.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::cluster::Cluster;
use flotilla_tests::http_get;
use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::TokioChildProcess;
use serde_json::{Value, json};

type Mcp = RunningService<RoleClient, ()>;

/// What every view must say of a run at one step.
#[derive(Debug, Clone, Copy)]
struct Expect {
    status: &'static str,
    agents: u64,
    queued: u64,
    running: u64,
    done: u64,
    failed: u64,
    cancelled: u64,
    /// A piece of why agents wait (`None`: nothing says they wait).
    waiting: Option<&'static str>,
}

impl Expect {
    fn new(status: &'static str, agents: u64) -> Expect {
        Expect {
            status,
            agents,
            queued: 0,
            running: 0,
            done: 0,
            failed: 0,
            cancelled: 0,
            waiting: None,
        }
    }

    /// The status as the views print it.
    fn headline(&self) -> String {
        if self.status == "completed" && self.failed > 0 {
            format!("completed, {} failed", self.failed)
        } else {
            self.status.to_owned()
        }
    }

    /// The agents as the views print them.
    fn agents_line(&self) -> String {
        let mut line = format!("{}/{} agents done", self.done, self.agents);
        for (n, what) in [
            (self.running, "running"),
            (self.queued, "queued"),
            (self.failed, "failed"),
            (self.cancelled, "cancelled"),
        ] {
            if n > 0 {
                line.push_str(&format!(" · {n} {what}"));
            }
        }
        line
    }

    /// Whether a view's JSON summary (`status`, `agents`, `queued`, ... at its top level)
    /// says this; `Err` says what differs.
    fn check(&self, v: &Value) -> Result<(), String> {
        let mut wrong = Vec::new();
        if v["status"] != self.status {
            wrong.push(format!("status {} (want {})", v["status"], self.status));
        }
        for (key, want) in [
            ("agents", self.agents),
            ("queued", self.queued),
            ("running", self.running),
            ("done", self.done),
            ("failed", self.failed),
            ("cancelled", self.cancelled),
        ] {
            if v[key].as_u64() != Some(want) {
                wrong.push(format!("{key} {} (want {want})", v[key]));
            }
        }
        match (self.waiting, v["waiting"].as_str()) {
            (None, None) => {}
            (Some(piece), Some(w)) if w.contains(piece) => {}
            (want, got) => wrong.push(format!("waiting {got:?} (want {want:?})")),
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong.join(", "))
        }
    }

    /// Whether a report (`show --json`: read from the store, rebuilt from the run's events
    /// while it goes on) says this of the run and of each agent; the store does not hold why
    /// agents wait.
    fn check_report(&self, r: &Value) -> Result<(), String> {
        let mut wrong = Vec::new();
        if r["status"] != self.status {
            wrong.push(format!("status {} (want {})", r["status"], self.status));
        }
        if r["usage"]["agents"].as_u64() != Some(self.agents) {
            wrong.push(format!(
                "agents {} (want {})",
                r["usage"]["agents"], self.agents
            ));
        }
        let agents = r["agents"].as_array().cloned().unwrap_or_default();
        for (status, want) in [
            ("queued", self.queued),
            ("running", self.running),
            ("completed", self.done),
            ("failed", self.failed),
            ("cancelled", self.cancelled),
        ] {
            let n = agents.iter().filter(|a| a["status"] == status).count() as u64;
            if n != want {
                wrong.push(format!("{n} agents {status} (want {want})"));
            }
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong.join(", "))
        }
    }
}

/// Polls `view` until it holds (at most 20 s): every view reaches the step's state, and a
/// view that never does fails with what it said last.
fn eventually(what: &str, mut view: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match view() {
            Ok(()) => return,
            Err(e) if Instant::now() >= deadline => panic!("{what}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

fn json_of(out: &flotilla_tests::Output) -> Result<Value, String> {
    if out.code != 0 {
        return Err(format!("exit {}: {}", out.code, out.stderr));
    }
    serde_json::from_str(&out.stdout).map_err(|e| format!("{e}: {}", out.stdout))
}

/// The run's row in a list of runs.
fn row<'a>(runs: &'a Value, run: &str) -> Result<&'a Value, String> {
    runs.as_array()
        .and_then(|rs| rs.iter().find(|r| r["run_id"] == run))
        .ok_or_else(|| format!("{run} is not listed: {runs}"))
}

/// The fleet, its page token and an MCP session on it.
struct Views {
    c: Cluster,
    bearer: String,
    mcp: Mcp,
}

impl Views {
    fn page(&self, path: &str) -> Result<String, String> {
        let r = http_get(
            self.c.http_port,
            path,
            &[("Authorization", self.bearer.as_str())],
        );
        if r.status == 200 {
            Ok(r.body)
        } else {
            Err(format!("{path}: {} {}", r.status, r.body))
        }
    }

    fn page_json(&self, path: &str) -> Result<Value, String> {
        let body = self.page(path)?;
        serde_json::from_str(&body).map_err(|e| format!("{path}: {e}: {body}"))
    }

    /// `/metrics` as name{labels} → value.
    fn metrics(&self) -> Result<std::collections::HashMap<String, f64>, String> {
        Ok(self
            .page("/metrics")?
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.rsplit_once(' '))
            .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
            .collect())
    }

    async fn mcp_status(&self, run: &str) -> Result<Value, String> {
        let params = CallToolRequestParams::new("WorkflowStatus")
            .with_arguments(json!({ "runId": run }).as_object().unwrap().clone());
        let r = tokio::time::timeout(Duration::from_secs(60), self.mcp.call_tool(params))
            .await
            .map_err(|_| "WorkflowStatus did not answer in time".to_owned())?
            .map_err(|e| e.to_string())?;
        if r.is_error == Some(true) {
            return Err(format!("WorkflowStatus failed: {r:?}"));
        }
        r.structured_content
            .clone()
            .ok_or_else(|| format!("no structured content: {r:?}"))
    }

    /// Every view of `run` says `e` (each polled until it does, at most 20 s).
    async fn agree(&self, step: &str, run: &str, e: Expect) {
        let c = &self.c;
        eventually(&format!("{step}: status --json"), || {
            e.check(&json_of(&c.client(&["status", run, "--json"]))?)
        });
        eventually(&format!("{step}: plain status"), || {
            let out = c.client(&["status", run]);
            let first = out.stdout.lines().next().unwrap_or("");
            let want = format!("{run} {} · {} · ", e.headline(), e.agents_line());
            if out.code != 0 || !first.starts_with(&want) || !first.contains(" · $0.0000 · ") {
                return Err(format!("want {want:?} and the cost: {out:?}"));
            }
            let waits = out.stdout.lines().find(|l| l.starts_with("  waiting: "));
            match (e.waiting, waits) {
                (None, None) => Ok(()),
                (Some(piece), Some(l)) if l.contains(piece) => Ok(()),
                (want, got) => Err(format!("waiting line {got:?}, want {want:?}")),
            }
        });
        for (status, n) in [
            ("queued", e.queued),
            ("running", e.running),
            ("completed", e.done),
            ("failed", e.failed),
            ("cancelled", e.cancelled),
        ] {
            eventually(&format!("{step}: agents --status {status}"), || {
                let page = json_of(&c.client(&["agents", run, "--status", status, "--json"]))?;
                if page["total"].as_u64() != Some(n) {
                    return Err(format!("want {n}: {page}"));
                }
                if let (Some(piece), "queued", 1..) = (e.waiting, status, n) {
                    let says = page["agents"][0]["waiting"].as_str().unwrap_or("");
                    if !says.contains(piece) {
                        return Err(format!("the waiting agent does not say why: {page}"));
                    }
                }
                Ok(())
            });
        }
        eventually(&format!("{step}: runs --json"), || {
            e.check(row(&json_of(&c.client(&["runs", "--json"]))?, run)?)
        });
        eventually(&format!("{step}: runs --status {}", e.status), || {
            let found = json_of(&c.client(&["runs", "--status", e.status, "--json"]))?;
            e.check(row(&found, run)?)?;
            let other = if e.status == "running" {
                "paused"
            } else {
                "running"
            };
            let not = json_of(&c.client(&["runs", "--status", other, "--json"]))?;
            match row(&not, run) {
                Ok(_) => Err(format!("`runs --status {other}` lists it: {not}")),
                Err(_) => Ok(()),
            }
        });
        eventually(&format!("{step}: plain runs"), || {
            let out = c.client(&["runs"]);
            let line = out.stdout.lines().find(|l| l.starts_with(run));
            match line {
                Some(l) if l.contains(&format!(" {} ", e.headline())) => Ok(()),
                _ => Err(format!(
                    "no line of {run} saying {:?}: {out:?}",
                    e.headline()
                )),
            }
        });
        eventually(&format!("{step}: /runs.json"), || {
            e.check(row(&self.page_json("/runs.json")?, run)?)
        });
        eventually(&format!("{step}: the /runs page"), || {
            let page = self.page("/runs")?;
            let start = page
                .find(&format!("<tr id=\"run-{run}\">"))
                .ok_or_else(|| format!("no row of {run}: {page}"))?;
            let tr = &page[start..start + page[start..].find("</tr>").unwrap_or(0)];
            let failures = if e.status == "completed" && e.failed > 0 {
                " failures"
            } else {
                ""
            };
            let cell = format!("class=\"st {}{failures}\">{}</td>", e.status, e.headline());
            if tr.contains(&cell) && tr.contains(&e.agents_line()) {
                Ok(())
            } else {
                Err(format!("want {cell:?} and {:?} in {tr}", e.agents_line()))
            }
        });
        eventually(&format!("{step}: the run page's status.json"), || {
            let v = self.page_json(&format!("/runs/{run}/status.json"))?;
            e.check(&v)?;
            let ended = !matches!(e.status, "running" | "paused" | "stopping");
            if v["finished"] != ended {
                return Err(format!("finished {} (want {ended})", v["finished"]));
            }
            Ok(())
        });
        eventually(&format!("{step}: show --json, from the store"), || {
            let mut cmd = Command::new(&c.bin);
            cmd.args(["show", run, "--json", "--store", &c.store_url()])
                .current_dir(c.path());
            e.check_report(&json_of(&flotilla_tests::run_with_timeout(
                cmd,
                flotilla_tests::COMMAND_TIMEOUT,
            ))?)
        });
        eventually(&format!("{step}: /metrics"), || {
            // Every run this coordinator ran, as its listing has them.
            let runs = json_of(&c.client(&["runs", "--json"]))?;
            let m = self.metrics()?;
            let runs = runs.as_array().cloned().unwrap_or_default();
            for status in ["running", "paused", "stopping", "completed", "stopped"] {
                let listed = runs.iter().filter(|r| r["status"] == status).count() as f64;
                let key = format!("flotilla_runs{{status=\"{status}\"}}");
                if m.get(&key) != Some(&listed) {
                    return Err(format!("{key} {:?}, listed {listed}", m.get(&key)));
                }
            }
            for (metric, key) in [
                ("queued", "queued"),
                ("running", "running"),
                ("done", "done"),
                ("failed", "failed"),
                ("cancelled", "cancelled"),
            ] {
                let listed: u64 = runs.iter().filter_map(|r| r[key].as_u64()).sum();
                let name = format!("flotilla_agents{{status=\"{metric}\"}}");
                if m.get(&name) != Some(&(listed as f64)) {
                    return Err(format!("{name} {:?}, listed {listed}", m.get(&name)));
                }
            }
            let partial = runs
                .iter()
                .filter(|r| r["status"] == "completed" && r["failed"].as_u64() > Some(0))
                .count() as f64;
            match m.get("flotilla_runs_completed_with_failures") {
                Some(n) if *n == partial => Ok(()),
                n => Err(format!(
                    "runs completed with failures {n:?}, listed {partial}"
                )),
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let said = self.mcp_status(run).await.and_then(|v| {
                e.check(&v)?;
                if v["headline"] == e.headline().as_str() {
                    Ok(())
                } else {
                    Err(format!(
                        "headline {} (want {})",
                        v["headline"],
                        e.headline()
                    ))
                }
            });
            match said {
                Ok(()) => break,
                Err(err) if Instant::now() >= deadline => panic!("{step}: WorkflowStatus: {err}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

/// A client command of the cluster, started and left running (its stderr in `log`).
fn spawn_client(c: &Cluster, args: &[&str], log: &std::path::Path) -> Child {
    Command::new(&c.bin)
        .args(args)
        .args(["--coordinator", &c.url(), "--name", "client", "--tls-dir"])
        .arg(c.pki())
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"))
        .spawn()
        .expect("start a client command")
}

/// Waits until `watch` (writing to `log`) has printed a line that starts with `line`: it polls
/// the run every half second, so a state the test walks through quickly is only seen when the
/// test waits for it before going on.
fn watch_says(log: &std::path::Path, line: &str) {
    eventually(&format!("watch prints {line:?}"), || {
        let said = std::fs::read_to_string(log).unwrap_or_default();
        said.lines()
            .any(|l| l.starts_with(line))
            .then_some(())
            .ok_or(said)
    });
}

fn ok(out: flotilla_tests::Output) {
    assert_eq!(out.code, 0, "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_view_of_a_run_says_the_same_at_each_step_of_its_life() {
    // One worker with one slot; its lease outlives a freeze of a few seconds.
    let c = Cluster::start_with_ttl(1, 1, Duration::from_secs(60));
    let token = c.client(&["token", "create", "--json"]).json()["token"]
        .as_str()
        .expect("a session token")
        .to_owned();
    let mcp: Mcp =
        ().serve(TokioChildProcess::new(c.mcp_command()).expect("spawn flotilla mcp"))
            .await
            .expect("an MCP session");
    // A run that holds the only slot.
    let holder = c.launch(
        "holder",
        "return await agent('hold [[sleep:600000]]', { label: 'hold' });",
        &["--stagger", "0"],
    );
    eventually("the holder runs", || {
        let s = json_of(&c.client(&["status", &holder, "--json"]))?;
        (s["running"] == 1).then_some(()).ok_or(s.to_string())
    });
    let run = c.launch(
        "walked",
        "phase('views');\n\
         const first = await agent('first [[sleep:600000]]', { label: 'first' });\n\
         const placed = await agent('placed', { label: 'placed', placement: { labels: { zone: 'nowhere' } } });\n\
         const last = await agent('last [[fail]]', { label: 'last' });\n\
         return { first, placed, last };",
        &["--stagger", "0"],
    );
    let watch_log = c.path().join("watch.log");
    let mut watch = spawn_client(&c, &["watch", &run], &watch_log);
    let mut views = Views {
        c,
        bearer: format!("Bearer {token}"),
        mcp,
    };

    // Queued: its agent waits for the slot the holder takes.
    let queued = Expect {
        queued: 1,
        ..Expect::new("running", 1)
    };
    views.agree("queued", &run, queued).await;

    // Stopping: the holder is stopped while its worker does not answer; it stays `stopping`
    // until its agent has left the worker.
    views.c.signal_worker(0, "-STOP");
    ok(views.c.client(&["stop", &holder]));
    let stopping = Expect {
        cancelled: 1,
        waiting: Some("still stopping on its worker"),
        ..Expect::new("stopping", 1)
    };
    views.agree("stopping", &holder, stopping).await;
    // A stopping run cannot be paused; a second stop is the one under way.
    let refused = views.c.client(&["pause", &holder]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("is stopping"), "{refused:?}");
    ok(views.c.client(&["stop", &holder]));
    let control = |action: &str| {
        flotilla_tests::http_request(
            views.c.http_port,
            "POST",
            &format!("/runs/{holder}/control"),
            &[
                ("Authorization", views.bearer.as_str()),
                ("Content-Type", "application/json"),
                ("x-flotilla", "1"),
            ],
            Some(&format!("{{\"action\":\"{action}\"}}")),
        )
    };
    let r = control("pause");
    assert_eq!(r.status, 409, "{r:?}");
    assert!(r.body.contains("is stopping"), "{r:?}");
    let r = control("stop");
    assert_eq!(r.status, 200, "{r:?}");
    views
        .agree("queued while the holder stops", &run, queued)
        .await;
    // The worker answers again: the holder's agent leaves it, and the slot is free.
    views.c.signal_worker(0, "-CONT");
    let stopped = Expect {
        cancelled: 1,
        ..Expect::new("stopped", 1)
    };
    views.agree("stopped", &holder, stopped).await;

    // Running.
    let running = Expect {
        running: 1,
        ..Expect::new("running", 1)
    };
    views.agree("running", &run, running).await;

    // Paused: the running agent is interrupted and queued again.
    ok(views.c.client(&["pause", &run]));
    let paused = Expect {
        queued: 1,
        ..Expect::new("paused", 1)
    };
    views.agree("paused", &run, paused).await;
    watch_says(&watch_log, "walked · paused · 0/1 agents done · 1 queued");

    // Resumed: it runs again.
    ok(views.c.client(&["resume", &run]));
    views.agree("resumed", &run, running).await;
    watch_says(&watch_log, "walked · running · ");

    // Waiting: `first` is stopped (it counts as failed, W55); `placed` asks for a label no
    // attached worker carries.
    ok(views.c.client(&["stop", &run, "--agent", "first"]));
    let waiting = Expect {
        queued: 1,
        failed: 1,
        waiting: Some("zone=nowhere"),
        ..Expect::new("running", 2)
    };
    views.agree("waiting", &run, waiting).await;

    // Completed with failures: `placed` is stopped too, and `last` fails on its own.
    ok(views.c.client(&["stop", &run, "--agent", "placed"]));
    let done = Expect {
        failed: 3,
        ..Expect::new("completed", 3)
    };
    views.agree("completed with failures", &run, done).await;
    let waited = views.c.client(&["wait", &run, "--json"]);
    assert_eq!(
        waited.code, EXIT_ALL_AGENTS_FAILED,
        "completed, every agent failed: {waited:?}"
    );
    assert_eq!(waited.json()["status"], "completed");
    let plain = views.c.client(&["wait", &run]);
    assert_eq!(plain.code, EXIT_ALL_AGENTS_FAILED, "{plain:?}");
    assert!(
        plain.stderr.contains("completed, 3 failed in "),
        "{plain:?}"
    );
    views
        .agree("the holder, at the end", &holder, stopped)
        .await;

    // `watch` followed the run: its header said paused, it ended with the report and the
    // same exit status as `wait`.
    let deadline = Instant::now() + Duration::from_secs(30);
    let code = loop {
        if let Some(status) = watch.try_wait().expect("watch's status") {
            break status.code();
        }
        assert!(Instant::now() < deadline, "watch never ended");
        std::thread::sleep(Duration::from_millis(100));
    };
    let said = std::fs::read_to_string(&watch_log).unwrap_or_default();
    assert_eq!(code, Some(EXIT_ALL_AGENTS_FAILED), "{said}");
    assert!(
        said.lines()
            .any(|l| l.starts_with("walked · paused · 0/1 agents done · 1 queued")),
        "{said}"
    );
    assert!(
        said.lines().any(|l| l.starts_with("walked · running · ")),
        "{said}"
    );
    assert!(said.contains("completed, 3 failed in "), "{said}");
}
