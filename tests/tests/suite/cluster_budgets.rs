//! Money caps that pause (issue 33, 2): a coordinator's run that reaches its `--budget-usd` is
//! held — what runs finishes, nothing new starts, its status says by how much it is over —
//! until `flotilla budget` raises the cap; then it goes on, and every call runs once. Real
//! processes: a coordinator, a worker, the anthropic backend against the local fake API.

use flotilla_tests::cluster::Cluster;
use flotilla_tests::fake_anthropic::FakeAnthropic;
use flotilla_tests::hook::Hook;
use rmcp::ServiceExt;
use serde_json::{Value, json};

/// An MCP session (`flotilla mcp`) on the cluster's coordinator, as the client certificate.
async fn mcp_of(c: &Cluster) -> rmcp::service::RunningService<rmcp::service::RoleClient, ()> {
    ().serve(rmcp::transport::TokioChildProcess::new(c.mcp_command()).expect("spawn flotilla mcp"))
        .await
        .expect("an MCP session")
}

/// The Messages API requests the fake has seen.
fn asked(fake: &FakeAnthropic) -> Vec<Value> {
    fake.requests()
        .into_iter()
        .filter(|s| s.path.ends_with("/messages"))
        .map(|s| s.body)
        .collect()
}

fn status(c: &Cluster, run: &str) -> Value {
    let out = c.client(&["status", run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    out.json()
}

/// Launches `n` agents (`item 0`, ...), one at a time, against a money budget one agent's cost
/// is over (with `extra` flags), and waits until the run is held there with nothing running:
/// its id and that status.
fn launch_held(c: &Cluster, name: &str, n: usize, extra: &[&str]) -> (String, Value) {
    let mut args = vec![
        "--stagger",
        "0",
        "--concurrency",
        "1",
        "--backend",
        "anthropic",
        "--budget-usd",
        "0.0001",
    ];
    args.extend_from_slice(extra);
    let run = c.launch(
        name,
        &format!(
            "return await parallel(Array.from({{ length: {n} }}, (_, i) => () => agent('item ' + i)));"
        ),
        &args,
    );
    let held = until(c, &run, "the run is held at its budget", |s| {
        s["status"] == "paused" && s["running"] == 0
    });
    (run, held)
}

/// Waits until `run`'s status satisfies `ok`; the status it ended with.
fn until(c: &Cluster, run: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    until_at(c, &c.url(), run, what, ok)
}

/// [`until`] through the coordinator at `url`.
fn until_at(c: &Cluster, url: &str, run: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    c.status_until(url, run, what, ok)
}

#[test]
fn a_run_at_its_money_budget_pauses_and_goes_on_once_raised_with_every_call_once() {
    let fake = FakeAnthropic::start();
    let secret = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret.path(), "a webhook secret of the test\n").unwrap();
    let c = Cluster::start_configured_env(
        1,
        4,
        &["--notify-secret-file", secret.path().to_str().unwrap()],
        &["--backend", "anthropic"],
        fake.env(),
    );
    let hook = Hook::start(vec![]);
    // One agent's cost is over the budget: the run is held after its first agent (or the
    // second, if it started before the first one's cost came in).
    let (run, held) = launch_held(&c, "capped", 6, &["--notify", &hook.url()]);
    let why = held["waiting"].as_str().unwrap_or_default();
    // Its webhook receiver hears of it, with why and the budget.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while hook.requests().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "no webhook of the pause"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let (headers, body) = hook.requests()[0].clone();
    assert!(
        headers.contains(&("x-flotilla-event".to_owned(), "run.paused".to_owned())),
        "{headers:?}"
    );
    let paused: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(paused["event"], "run.paused", "{paused}");
    assert_eq!(paused["run_id"], run.as_str(), "{paused}");
    assert_eq!(paused["reason"], "money_budget", "{paused}");
    assert_eq!(paused["budget_usd"], 0.0001, "{paused}");
    assert!(
        paused["waiting"]
            .as_str()
            .is_some_and(|w| w.contains("flotilla budget")),
        "{paused}"
    );
    assert!(
        why.starts_with("paused at its money budget: it has cost $")
            && why.contains("of $0.0001")
            && why.contains(&format!("flotilla budget {run} --usd")),
        "{held}"
    );
    let done = held["done"].as_u64().unwrap();
    assert!((1..=2).contains(&done), "{held}");
    assert_eq!(held["failed"], 0, "nothing was stopped: {held}");
    // Nothing new started: the fake API saw one request per agent done, no more.
    assert_eq!(asked(&fake).len() as u64, done, "{held}");
    // `resume` is not how it goes on; a budget still too low keeps it held.
    let resumed = c.client(&["resume", &run]);
    assert_ne!(resumed.code, 0, "{resumed:?}");
    assert!(
        resumed.stderr.contains("paused at its money budget")
            && resumed.stderr.contains("flotilla budget"),
        "{resumed:?}"
    );
    let low = c.client(&["budget", &run, "--usd", "0.0002"]);
    assert_eq!(low.code, 0, "{low:?}");
    assert!(low.stderr.contains("it stays paused"), "{low:?}");
    assert_eq!(status(&c, &run)["status"], "paused");
    for bad in ["--usd=-1", "--usd=0", "--usd=NaN"] {
        let out = c.client(&["budget", &run, bad]);
        assert_ne!(out.code, 0, "{bad}: {out:?}");
        assert!(
            out.stderr.contains("positive number of dollars"),
            "{bad}: {out:?}"
        );
    }
    // Raised: it goes on where it stopped.
    let raised = c.client(&["budget", &run, "--usd", "100", "--reason", "approved"]);
    assert_eq!(raised.code, 0, "{raised:?}");
    assert!(raised.stderr.contains("the run goes on"), "{raised:?}");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let results = r["result"].as_array().unwrap_or_else(|| panic!("{r}"));
    assert_eq!(results.len(), 6, "{r}");
    for (i, v) in results.iter().enumerate() {
        assert_eq!(v, &format!("fake reply to: item {i}"), "{r}");
    }
    // Every call once: six requests in all, one per agent.
    let mut prompts: Vec<String> = asked(&fake)
        .iter()
        .map(|b| b["messages"].to_string())
        .collect();
    assert_eq!(prompts.len(), 6, "{prompts:?}");
    prompts.sort();
    prompts.dedup();
    assert_eq!(prompts.len(), 6, "no agent asked twice");
    // Two webhooks: the pause (once, though it stayed paused at the low budget too) and the
    // end.
    let events: Vec<String> = hook
        .requests()
        .iter()
        .map(|(h, _)| {
            h.iter()
                .find(|(k, _)| k == "x-flotilla-event")
                .map_or(String::new(), |(_, v)| v.clone())
        })
        .collect();
    assert_eq!(events, ["run.paused", "run.ended"], "{events:?}");
    let log = r["logs"]
        .as_array()
        .map(|l| format!("{l:?}"))
        .unwrap_or_default();
    for line in [
        "[budget] the run is paused at its money budget",
        "asked to set the run's money budget: approved",
        "[budget] the run goes on",
    ] {
        assert!(log.contains(line), "{line:?} in {log}");
    }
}

/// The budget a run was given after its launch holds it on the coordinator that adopts it: a
/// run held at its budget, given one still too low, is adopted after its leader's SIGKILL and
/// held there at that one (not at the launch's); raised there, it completes with every call
/// once (those done before the kill served from the journal).
#[test]
fn a_raised_budget_holds_the_run_on_the_coordinator_that_adopts_it() {
    let fake = FakeAnthropic::start();
    let etcd = flotilla_tests::services::Etcd::start();
    let s3 = flotilla_tests::services::S3::start();
    let url = format!("s3://{}/budgets", s3.bucket);
    let mut c = Cluster::start_group_ttl(
        0,
        4,
        etcd.endpoint(),
        (url, s3.env()),
        &[],
        Some(std::time::Duration::from_secs(3)),
    );
    c.worker_env = fake.env();
    c.worker_args = vec!["--backend".into(), "anthropic".into()];
    c.issue_worker(0);
    c.start_worker(0, 4);
    c.wait_for_workers(1);
    let (run, _) = launch_held(&c, "adopted", 5, &[]);
    let low = c.client(&["budget", &run, "--usd", "0.0002"]);
    assert_eq!(low.code, 0, "{low:?}");
    let done = asked(&fake).len();
    let mut leader = c.take_coordinator().unwrap();
    leader.kill().unwrap();
    leader.wait().unwrap();
    let standby = c.standby_url();
    let held = until_at(&c, &standby, &run, "the adopted run is held", |s| {
        s["status"] == "paused"
            && s["waiting"]
                .as_str()
                .is_some_and(|w| w.starts_with("paused at its money budget"))
    });
    let why = held["waiting"].as_str().unwrap_or_default();
    assert!(
        why.contains("of $0.0002"),
        "the raised budget, not the launch's: {held}"
    );
    assert_eq!(asked(&fake).len(), done, "nothing new started: {held}");
    let raised = c.client_at(&standby, &["budget", &run, "--usd", "100"]);
    assert_eq!(raised.code, 0, "{raised:?}");
    let out = c.client_at(&standby, &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    assert_eq!(r["result"].as_array().map(Vec::len), Some(5), "{r}");
    assert!(
        r["result"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| v.is_string()),
        "{r}"
    );
    assert_eq!(asked(&fake).len(), 5, "every call once");
}

/// With `--budget-interrupt`, what runs at the budget is interrupted too, and goes on from
/// where it was once the budget is raised (here through the MCP tool `WorkflowBudget`): an
/// agent stalled in its model call is cut off at once instead of holding its slot, and runs
/// again (one more request) after the raise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_budget_interrupt_running_agents_are_interrupted_and_go_on_after_the_raise() {
    let fake = FakeAnthropic::start();
    let c = Cluster::start_workers_with(1, 4, &["--backend", "anthropic"], fake.env());
    let run = c.launch(
        "interrupted",
        "const slow = agent('slow [[stall-first:1]]', { label: 'slow' });\n\
         const quick = await agent('quick', { label: 'quick' });\n\
         return { quick, slow: await slow };",
        &[
            "--stagger",
            "0",
            "--backend",
            "anthropic",
            "--budget-usd",
            "0.0001",
            "--budget-interrupt",
        ],
    );
    let held = until(
        &c,
        &run,
        "the run is held, its stalled agent interrupted",
        |s| s["status"] == "paused" && s["running"] == 0 && s["queued"] == 1,
    );
    assert!(
        held["waiting"]
            .as_str()
            .is_some_and(|w| w.contains("running agents were interrupted")),
        "{held}"
    );
    assert_eq!(held["done"], 1, "{held}");
    let mcp = mcp_of(&c).await;
    let call = |args: Value| {
        rmcp::model::CallToolRequestParams::new("WorkflowBudget")
            .with_arguments(args.as_object().unwrap().clone())
    };
    let bad = mcp
        .call_tool(call(json!({ "runId": run, "usd": -3 })))
        .await
        .expect("an answer");
    assert_eq!(bad.is_error, Some(true), "{bad:?}");
    let raised = mcp
        .call_tool(call(
            json!({ "runId": run, "usd": 100, "reason": "from the session" }),
        ))
        .await
        .expect("an answer");
    assert_ne!(raised.is_error, Some(true), "{raised:?}");
    let said = raised.structured_content.clone().unwrap_or_default();
    assert!(
        said["message"]
            .as_str()
            .is_some_and(|m| m.contains("the run goes on")),
        "{said}"
    );
    let _ = mcp.cancel().await;
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"]["quick"], "fake reply to: quick", "{r}");
    assert_eq!(
        r["result"]["slow"], "fake reply to: slow [[stall-first:1]]",
        "{r}"
    );
    // The stalled request, its retry after the raise, and the quick one.
    assert_eq!(asked(&fake).len(), 3);
}

/// The session page of a run paused at its budget offers "Raise budget" instead of Resume;
/// the reader gives a new budget there, and the run goes on to its end.
#[test]
fn the_session_page_raises_the_budget_of_a_paused_run() {
    let fake = FakeAnthropic::start();
    let c = Cluster::start_workers_with(1, 4, &["--backend", "anthropic"], fake.env());
    let (run, _) = launch_held(&c, "paged", 3, &[]);
    let t = c.client(&["token", "create", "--json"]);
    assert_eq!(t.code, 0, "{t:?}");
    let login = t.json()["login_url"].as_str().unwrap().to_owned();
    let b = flotilla_tests::webdriver::Browser::start();
    b.goto(&format!("{login}&next=/runs/{run}"));
    b.wait_for("the paused page with its raise button", 20, |b| {
        b.text("button[data-action=budget]")
            .filter(|t| t == "Raise budget")
    });
    assert!(
        b.text("button[data-action=resume]").is_none(),
        "no Resume at the budget"
    );
    b.click("button[data-action=budget]");
    b.wait_for("the budget form", 10, |b| {
        (b.eval("return document.getElementById('budget-form').hidden;") == false).then_some(())
    });
    b.type_into("#budget-usd", "50");
    b.click("#budget-go");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"].as_array().map(Vec::len), Some(3), "{r}");
    let log = r["logs"]
        .as_array()
        .map(|l| format!("{l:?}"))
        .unwrap_or_default();
    assert!(log.contains("the run's money budget is now $50"), "{log}");
    assert_eq!(asked(&fake).len(), 3, "every call once");
}
