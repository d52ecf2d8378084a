//! A person's answer on a fleet (issue 33, 1): a coordinator's run asks with `ask()`, its
//! webhook announces the question with a link, and it is answered from the CLI, the MCP tool
//! `WorkflowAnswer` and the session page (Chromium) — a wrong answer refused with the reason,
//! a client of another namespace refused as if the run were not there. A question outlives
//! its coordinator's SIGKILL and is answered on the successor, and a resume does not ask again.
//! A parked question survives a pause and is answered while the run is paused.

use flotilla_tests::cluster::Cluster;
use flotilla_tests::hook::Hook;
use rmcp::ServiceExt;
use serde_json::{Value, json};

/// Waits until `run`'s status (through the coordinator at `url`) satisfies `ok`.
fn until_at(c: &Cluster, url: &str, run: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    c.status_until(url, run, what, ok)
}

/// Waits until the run's one open question is `text`; that question.
fn asking(c: &Cluster, url: &str, run: &str, text: &str) -> Value {
    let s = until_at(c, url, run, text, |s| {
        s["questions"]
            .as_array()
            .is_some_and(|q| q.len() == 1 && q[0]["question"] == text)
    });
    assert!(
        s["waiting"]
            .as_str()
            .is_some_and(|w| w.starts_with("waiting for an answer to")),
        "{s}"
    );
    s["questions"][0].clone()
}

const THREE: &str = "const region = await ask('Which region?', { schema: { enum: ['eu', 'us'] }, label: 'region' });\n\
const shards = await ask('How many shards?', { schema: { type: 'integer', minimum: 1 } });\n\
const notes = await ask('Release notes ok?', { schema: { type: 'object', properties: { approve: { type: 'boolean' }, note: { type: 'string' } }, required: ['approve'] } });\n\
const done = await agent('deploy to ' + region + ' with ' + shards + ' shards');\n\
return { region, shards, notes, done };";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_run_is_answered_from_the_cli_the_mcp_tool_and_its_page() {
    let secret = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret.path(), "a webhook secret of the test\n").unwrap();
    let c = Cluster::start_configured_env(
        1,
        4,
        &["--notify-secret-file", secret.path().to_str().unwrap()],
        &[],
        Vec::new(),
    );
    c.issue_client("bob", &["team-b"]);
    let hook = Hook::start(vec![]);
    let run = c.launch("asks", THREE, &["--stagger", "0", "--notify", &hook.url()]);
    let url = c.url();
    let q = asking(&c, &url, &run, "Which region?");
    let id = q["id"].as_str().unwrap().to_owned();
    assert_eq!(q["label"], "region", "{q}");
    // The webhook announces it, with the page and the command that answers it.
    assert!(
        flotilla_tests::eventually(30, || !hook.requests().is_empty()),
        "no webhook of the question"
    );
    let (headers, body) = hook.requests()[0].clone();
    assert!(
        headers.contains(&("x-flotilla-event".to_owned(), "run.question".to_owned())),
        "{headers:?}"
    );
    let said: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(said["question"]["id"], id.as_str(), "{said}");
    assert_eq!(said["question"]["schema"], json!({ "enum": ["eu", "us"] }));
    assert!(
        said["url"]
            .as_str()
            .is_some_and(|u| u.ends_with(&format!("/runs/{run}"))),
        "{said}"
    );
    assert_eq!(
        said["answer"],
        format!("flotilla answer {run} --question {id} --json VALUE")
    );
    // Another namespace's client gets nothing, and changes nothing.
    let bob = c.client_as("bob", &["answer", &run, "--json", "\"us\""]);
    assert_ne!(bob.code, 0, "{bob:?}");
    assert!(
        bob.stderr
            .contains(&format!("no run {run} in namespace(s) team-b")),
        "{bob:?}"
    );
    // The CLI: a value the schema refuses, then the right one.
    let wrong = c.client(&["answer", &run, "--json", "\"asia\""]);
    assert_ne!(wrong.code, 0, "{wrong:?}");
    assert!(
        wrong
            .stderr
            .contains(&format!("does not match the schema of {id}"))
            && wrong.stderr.contains("stays open"),
        "{wrong:?}"
    );
    assert_eq!(asking(&c, &url, &run, "Which region?")["id"], id.as_str());
    let right = c.client(&["answer", &run, "--question", &id, "--json", "\"eu\""]);
    assert_eq!(right.code, 0, "{right:?}");
    let again = c.client(&["answer", &run, "--question", &id, "--json", "\"us\""]);
    assert_ne!(again.code, 0, "{again:?}");
    assert!(again.stderr.contains("answered already"), "{again:?}");
    // The MCP tool: WorkflowStatus lists the question; a wrong answer is refused, then one.
    asking(&c, &url, &run, "How many shards?");
    let mcp = ()
        .serve(
            rmcp::transport::TokioChildProcess::new(c.mcp_command()).expect("spawn flotilla mcp"),
        )
        .await
        .expect("an MCP session");
    let call = |name: &'static str, args: Value| {
        let mcp = &mcp;
        async move {
            mcp.call_tool(
                rmcp::model::CallToolRequestParams::new(name)
                    .with_arguments(args.as_object().unwrap().clone()),
            )
            .await
            .expect("a tool result")
        }
    };
    let status = call("WorkflowStatus", json!({ "runId": run })).await;
    let status = status.structured_content.expect("structured status");
    assert_eq!(
        status["questions"][0]["question"], "How many shards?",
        "{status}"
    );
    let refused = call("WorkflowAnswer", json!({ "runId": run, "answer": 0 })).await;
    assert_eq!(refused.is_error, Some(true), "{refused:?}");
    assert!(
        format!("{refused:?}").contains("does not match the schema"),
        "{refused:?}"
    );
    let answered = call("WorkflowAnswer", json!({ "runId": run, "answer": 3 })).await;
    assert_ne!(answered.is_error, Some(true), "{answered:?}");
    mcp.cancel().await.ok();
    // The page: its form, made from the schema, sends an object.
    asking(&c, &url, &run, "Release notes ok?");
    let t = c.client(&["token", "create", "--json"]);
    assert_eq!(t.code, 0, "{t:?}");
    let login = t.json()["login_url"].as_str().unwrap().to_owned();
    let b = flotilla_tests::webdriver::Browser::start();
    b.goto(&format!("{login}&next=/runs/{run}"));
    b.wait_for("the question's answer button", 20, |b| {
        b.text("button[data-answer]").filter(|t| t == "Answer")
    });
    b.click("button[data-answer]");
    b.wait_for("the answer form", 10, |b| {
        (b.eval("return document.getElementById('answer-form').hidden;") == false).then_some(())
    });
    b.type_into("#answer-fields textarea[name=note]", "lgtm");
    b.click("#answer-go");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({
            "region": "eu",
            "shards": 3,
            "notes": { "approve": true, "note": "lgtm" },
            "done": "deploy to eu with 3 shards"
        }),
        "{r}"
    );
    let by: Vec<String> = r["questions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["answer"]["by"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(by.len(), 3, "{r}");
    assert!(by[2].ends_with("(the page)"), "{by:?}");
    let events: Vec<String> = hook
        .requests()
        .iter()
        .filter_map(|(h, _)| {
            h.iter()
                .find(|(k, _)| k == "x-flotilla-event")
                .map(|(_, v)| v.clone())
        })
        .collect();
    assert_eq!(
        events,
        ["run.question", "run.question", "run.question", "run.ended"],
        "{events:?}"
    );
}

#[test]
fn a_question_outlives_its_coordinator_s_sigkill_and_is_answered_on_the_successor() {
    let etcd = flotilla_tests::services::Etcd::start();
    let s3 = flotilla_tests::services::S3::start();
    let url = format!("s3://{}/asks", s3.bucket);
    let mut c = Cluster::start_group_ttl(
        1,
        4,
        etcd.endpoint(),
        (url, s3.env()),
        &[],
        Some(std::time::Duration::from_secs(3)),
    );
    c.wait_for_workers(1);
    let run = c.launch(
        "outlives",
        "const before = await agent('before');\n\
         const go = await ask('Go on?', { schema: { type: 'boolean' }, timeout: '1d' });\n\
         const after = await agent('after ' + go);\n\
         return { before, go, after };",
        &["--stagger", "0"],
    );
    let leader = c.url();
    let first = asking(&c, &leader, &run, "Go on?");
    let mut coordinator = c.take_coordinator().unwrap();
    coordinator.kill().unwrap();
    coordinator.wait().unwrap();
    // The successor adopts the run, replays it, and asks the same question: same id, same
    // time and deadline as the first ask.
    let standby = c.standby_url();
    let again = asking(&c, &standby, &run, "Go on?");
    assert_eq!(again["id"], first["id"], "{again}");
    assert_eq!(again["asked_at"], first["asked_at"], "{again}");
    assert_eq!(again["deadline"], first["deadline"], "{again}");
    let answered = c.client_at(&standby, &["answer", &run, "--json", "true"]);
    assert_eq!(answered.code, 0, "{answered:?}");
    let out = c.client_at(&standby, &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    assert_eq!(
        r["result"],
        json!({ "before": "before", "go": true, "after": "after true" }),
        "{r}"
    );
    // `before` ran once, before the kill: the successor served it from the journal.
    let before = flotilla_tests::agent(&r, "before");
    assert_eq!(before["cached"], true, "{r}");
    // A resume of the finished run gets its answer from there: it completes unasked.
    let resumed = c.client_at(&standby, &["resume", &run, "--json"]);
    assert_eq!(resumed.code, 0, "{resumed:?}");
    let new = resumed.json()["run_id"].as_str().unwrap().to_owned();
    let out = c.client_at(&standby, &["wait", &new, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r2 = out.json();
    assert_eq!(r2["result"], r["result"], "{r2}");
    assert!(
        r2["logs"]
            .to_string()
            .contains(&format!("answered in {run} by")),
        "{r2}"
    );
}

/// A coordinator that parks a run after a second of waiting on its questions alone, with a
/// worker of the anthropic backend against `fake`.
fn parking(fake: &flotilla_tests::fake_anthropic::FakeAnthropic) -> Cluster {
    Cluster::start_configured_env(
        1,
        4,
        &["--park-after", "1s"],
        &["--backend", "anthropic"],
        fake.env(),
    )
}

/// Waits until `run` is parked waiting on its question `what`; its status.
fn parked(c: &Cluster, url: &str, run: &str, what: &str) -> Value {
    until_at(c, url, run, what, |s| {
        s["waiting"]
            .as_str()
            .is_some_and(|w| w.starts_with("parked, waiting for an answer"))
            && s["questions"][0]["question"] == what
    })
}

/// The coordinator's threads that run a script.
fn script_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(Result::ok)
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim() == "flotilla-js")
                })
                .count()
        })
        .unwrap_or(0)
}

/// A run that waits on its questions alone is parked (`--park-after`): its script thread
/// goes — the coordinator runs none — and a small record answers for it. The answer wakes it:
/// it is adopted again, replays to where it waited (no agent asked twice) and goes on. A
/// question's deadline wakes a parked run too, its `ask()` giving null; a parked run stops.
#[test]
fn a_run_waiting_on_questions_is_parked_without_its_script_and_woken_by_an_answer_or_a_deadline() {
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    let c = parking(&fake);
    let run = c.launch(
        "parked",
        "const before = await agent('before');\n\
         const go = await ask('Go on?', { schema: { type: 'boolean' } });\n\
         const more = await ask('Anything to add?', { timeout: '4s' });\n\
         return { before, go, more, after: await agent('after ' + go) };",
        &["--stagger", "0", "--backend", "anthropic"],
    );
    let url = c.url();
    let parked = |what: &str| parked(&c, &url, &run, what);
    parked("Go on?");
    assert_eq!(
        script_threads(c.coordinator_pid()),
        0,
        "no script thread while parked"
    );
    let answered = c.client(&["answer", &run, "--json", "true"]);
    assert_eq!(answered.code, 0, "{answered:?}");
    // Woken, it asks the next question, parks again, and its deadline wakes it.
    parked("Anything to add?");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({
            "before": "fake reply to: before",
            "go": true,
            "more": null,
            "after": "fake reply to: after true"
        }),
        "{r}"
    );
    let asked: Vec<String> = fake
        .requests()
        .into_iter()
        .filter(|s| s.path.ends_with("/messages"))
        .map(|s| s.body["messages"].to_string())
        .collect();
    assert_eq!(asked.len(), 2, "every agent once: {asked:?}");
    let logs = r["logs"].to_string();
    assert!(
        logs.matches("parked (its script set aside").count() >= 2,
        "{logs}"
    );
    assert!(logs.contains("timed out unanswered"), "{logs}");
    // A parked run stops.
    let other = c.launch(
        "stopped",
        "return await ask('Never answered?');",
        &["--stagger", "0"],
    );
    until_at(&c, &url, &other, "parked", |s| {
        s["waiting"]
            .as_str()
            .is_some_and(|w| w.starts_with("parked"))
    });
    let stopped = c.client(&["stop", &other, "--reason", "nobody answers"]);
    assert_eq!(stopped.code, 0, "{stopped:?}");
    let out = c.client(&["wait", &other, "--json"]);
    assert_eq!(out.json()["status"], "stopped", "{out:?}");
}

/// A question survives `pause`/`resume`: a pause wakes the parked run and pauses it, the
/// question stays open and is answered while the run is paused, the agent the answer lets go
/// waits for `resume`, and then runs once.
#[test]
fn a_question_is_answered_while_its_run_is_paused_and_the_run_goes_on_at_resume() {
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    let c = parking(&fake);
    let run = c.launch(
        "paused",
        "const go = await ask('Go on?', { schema: { type: 'boolean' } });\n\
         return { go, after: await agent('after ' + go) };",
        &["--stagger", "0", "--backend", "anthropic"],
    );
    let url = c.url();
    parked(&c, &url, &run, "Go on?");
    let paused = c.client(&["pause", &run]);
    assert_eq!(paused.code, 0, "{paused:?}");
    until_at(&c, &url, &run, "paused, its question open", |s| {
        s["status"] == "paused" && s["questions"][0]["question"] == "Go on?"
    });
    let answered = c.client(&["answer", &run, "--json", "true"]);
    assert_eq!(answered.code, 0, "{answered:?}");
    // The answer lets the script go on to its agent, which waits for the run's resume.
    let held = until_at(&c, &url, &run, "the agent queued", |s| {
        s["status"] == "paused" && s["queued"] == 1
    });
    assert!(
        held["questions"].as_array().is_none_or(Vec::is_empty),
        "{held}"
    );
    let messages = || {
        fake.requests()
            .into_iter()
            .filter(|s| s.path.ends_with("/messages"))
            .count()
    };
    assert_eq!(messages(), 0, "no agent ran while paused");
    let resumed = c.client(&["resume", &run]);
    assert_eq!(resumed.code, 0, "{resumed:?}");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({ "go": true, "after": "fake reply to: after true" }),
        "{r}"
    );
    assert_eq!(messages(), 1, "the agent ran once: {r}");
}
