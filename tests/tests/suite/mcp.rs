//! `flotilla mcp` (issue 16): Claude Code's Workflow tool and its companions over MCP on
//! stdio, driven by a real MCP client (rmcp's) and by the real `claude` CLI against the built
//! binary, embedded and on a fleet.

use std::path::Path;
use std::time::{Duration, Instant};

use flotilla_tests::cluster::Cluster;
use flotilla_tests::{Env, http_get};
use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::TokioChildProcess;
use serde_json::{Value, json};

type Client = RunningService<RoleClient, ()>;

async fn call(client: &Client, tool: &str, args: Value) -> CallToolResult {
    let params = CallToolRequestParams::new(tool.to_owned())
        .with_arguments(args.as_object().expect("an object").clone());
    tokio::time::timeout(Duration::from_secs(60), client.call_tool(params))
        .await
        .expect("the tool answers in time")
        .expect("a tool result")
}

/// The tool's structured answer, which must not be an error.
async fn ok(client: &Client, tool: &str, args: Value) -> Value {
    let r = call(client, tool, args).await;
    assert_ne!(r.is_error, Some(true), "{tool}: {r:?}");
    r.structured_content.clone().expect("structured content")
}

/// A `Workflow` call that was refused (issue 29): a tool error (`isError`), with W46's answer
/// as its structured content: `remote_launched`, `error`, no run id.
async fn refused_launch(client: &Client, args: Value) -> Value {
    let r = call(client, "Workflow", args).await;
    assert_eq!(
        r.is_error,
        Some(true),
        "a refused launch is a tool error: {r:?}"
    );
    let v = r.structured_content.clone().expect("structured content");
    assert_eq!(v["status"], "remote_launched", "{v}");
    assert!(v.get("runId").is_none(), "{v}");
    v
}

async fn finished(client: &Client, run: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = ok(client, "WorkflowStatus", json!({ "runId": run })).await;
        if s["finished"] == true {
            return s;
        }
        assert!(Instant::now() < deadline, "the run never finished: {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workflow_tool_launches_at_once_and_its_companions_follow_read_and_stop_the_run() {
    let env = Env::new();
    let cmd = env.command(&["mcp", "--backend", "echo", "--stagger", "0"], &[]);
    let client: Client =
        ().serve(TokioChildProcess::new(tokio::process::Command::from(cmd)).expect("spawn"))
            .await
            .expect("an MCP session");
    let info = client.peer_info().expect("initialized");
    assert_eq!(
        info.server_info.as_ref().map(|i| i.name.as_str()),
        Some("flotilla")
    );
    let tools = client.list_all_tools().await.expect("tools");
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "Workflow",
            "WorkflowAnswer",
            "WorkflowBudget",
            "WorkflowList",
            "WorkflowResult",
            "WorkflowStatus",
            "WorkflowStop"
        ]
    );
    let workflow = tools.iter().find(|t| t.name == "Workflow").unwrap();
    for field in ["script", "name", "scriptPath", "args", "resumeFromRunId"] {
        assert!(
            workflow.input_schema["properties"].get(field).is_some(),
            "{field}: {:?}",
            workflow.input_schema
        );
    }

    // An inline script with agents and a result over 100 KB.
    let script = "export const meta = { name: 'big', description: 'a big result' };\n\
                  const rs = await parallel(args.items.map(i => () => agent('item ' + i)));\n\
                  return { rs, pad: 'x'.repeat(150000) };";
    let launched = ok(
        &client,
        "Workflow",
        json!({ "script": script, "args": { "items": [1, 2, 3] }, "title": "ignored" }),
    )
    .await;
    assert_eq!(launched["status"], "remote_launched", "{launched}");
    assert!(launched.get("error").is_none(), "{launched}");
    let run = launched["runId"].as_str().unwrap().to_owned();
    assert!(run.starts_with("wf_"), "{launched}");
    // The session URL serves the run.
    let url = launched["sessionUrl"].as_str().unwrap();
    let rest = url
        .strip_prefix("http://127.0.0.1:")
        .expect("a loopback URL");
    let (port, path) = rest.split_once('/').unwrap();
    let page = http_get(port.parse().unwrap(), &format!("/{path}"), &[]);
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains(&run), "the page does not show the run");
    // The script was kept where the caller can read it.
    let kept = launched["scriptPath"].as_str().unwrap();
    assert_eq!(std::fs::read_to_string(kept).unwrap(), script);

    let status = finished(&client, &run).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(status["agents"], 3, "{status}");
    // The whole result, a page at a time.
    let mut text = String::new();
    let mut offset = 0u64;
    loop {
        let page = ok(
            &client,
            "WorkflowResult",
            json!({ "runId": run, "offset": offset, "limit": 60000 }),
        )
        .await;
        assert_eq!(page["status"], "completed");
        text.push_str(page["resultJson"].as_str().unwrap());
        match page["nextOffset"].as_u64() {
            Some(next) => offset = next,
            None => break,
        }
    }
    let result: Value = serde_json::from_str(&text).expect("the pages make the JSON result");
    assert_eq!(result["rs"], json!(["item 1", "item 2", "item 3"]));
    assert_eq!(result["pad"].as_str().unwrap().len(), 150_000);

    // A script that does not compile comes back at once as a tool error with its line, and
    // never runs.
    let broken = refused_launch(
        &client,
        json!({ "script": "export const meta = { name: 'b', description: 'd' };\nconst x = ;\nreturn x;" }),
    )
    .await;
    assert!(
        broken["error"].as_str().unwrap().contains("line 2"),
        "{broken}"
    );
    let unknown = refused_launch(&client, json!({ "name": "no-such-workflow" })).await;
    assert!(
        unknown["error"]
            .as_str()
            .unwrap()
            .contains("unknown workflow"),
        "{unknown}"
    );
    let nothing = refused_launch(&client, json!({})).await;
    assert!(
        nothing["error"].as_str().unwrap().contains("give `script`"),
        "{nothing}"
    );

    // Saved ones, bundled included, by name.
    let listed = ok(&client, "WorkflowList", json!({})).await;
    assert!(
        listed["workflows"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["origin"] == "bundled" && w["description"].is_string()),
        "{listed}"
    );

    // Stopping a long run: it ends stopped, and its report is there.
    let long = ok(
        &client,
        "Workflow",
        json!({ "script": "export const meta = { name: 'long', description: 'd' };\nreturn await agent('wait [[sleep:60000]]');" }),
    )
    .await;
    let long = long["runId"].as_str().unwrap().to_owned();
    let running = ok(&client, "WorkflowResult", json!({ "runId": long })).await;
    assert_eq!(running["finished"], false, "{running}");
    // A run on this machine stops at its money budget: there is none to raise.
    let r = call(
        &client,
        "WorkflowBudget",
        json!({ "runId": long, "usd": 5 }),
    )
    .await;
    assert_eq!(r.is_error, Some(true), "{r:?}");
    assert!(
        format!("{r:?}").contains("only for a run on a fleet"),
        "{r:?}"
    );
    ok(&client, "WorkflowStop", json!({ "runId": long })).await;
    let stopped = finished(&client, &long).await;
    assert_eq!(stopped["status"], "stopped", "{stopped}");
    // A run id that is no run is a named refusal.
    let r = call(
        &client,
        "WorkflowStatus",
        json!({ "runId": "wf_00000000-000" }),
    )
    .await;
    assert_eq!(r.is_error, Some(true), "{r:?}");
    client.cancel().await.expect("the session ends");
}

/// `claude -p PROMPT` (the pinned CLI) against `fake`, with `flotilla mcp` as its MCP server;
/// what the CLI answered (`tool said: …` once the fake has seen the tool's result).
fn claude_with_flotilla(
    env: &Env,
    fake: &flotilla_tests::fake_anthropic::FakeAnthropic,
    prompt: &str,
) -> String {
    let server = json!({
        "type": "stdio",
        "command": env.bin.to_str().unwrap(),
        "args": ["mcp", "--backend", "echo", "--stagger", "0"],
        "env": {
            "FLOTILLA_STORE": env.store_url(),
            "FLOTILLA_WORKSPACE": env.workspace().to_str().unwrap(),
            "HOME": env.path().to_str().unwrap(),
        },
    });
    claude_with_server(env.path(), env.path(), server, fake, prompt)
}

/// `claude -p PROMPT` run in `dir` with `server` as its `flotilla` MCP server (`home`: its
/// HOME and configuration).
fn claude_with_server(
    dir: &Path,
    home: &Path,
    server: Value,
    fake: &flotilla_tests::fake_anthropic::FakeAnthropic,
    prompt: &str,
) -> String {
    let config = json!({ "mcpServers": { "flotilla": server } });
    let config_file = home.join("mcp.json");
    std::fs::write(&config_file, config.to_string()).unwrap();
    let claude_dir = home.join("claude-config");
    std::fs::create_dir_all(&claude_dir).unwrap();
    let mut cmd = std::process::Command::new(super::claude::claude_bin());
    cmd.current_dir(dir)
        .args([
            "-p",
            prompt,
            "--output-format",
            "json",
            "--no-session-persistence",
        ])
        .arg("--mcp-config")
        .arg(&config_file)
        .args(["--strict-mcp-config", "--allowedTools", "mcp__flotilla"])
        .env("HOME", home)
        .env("CLAUDE_CONFIG_DIR", &claude_dir)
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdin(std::process::Stdio::null());
    for (k, v) in fake.env() {
        cmd.env(k, v);
    }
    let out = flotilla_tests::run_with_timeout(cmd, Duration::from_secs(120));
    assert_eq!(out.code, 0, "{out:?}");
    let v: Value = serde_json::from_str(out.stdout.trim())
        .unwrap_or_else(|e| panic!("claude's answer is not JSON ({e}): {out:?}"));
    v["result"].as_str().unwrap_or_default().to_owned()
}

/// The tool's JSON answer inside `tool said: …`.
fn tool_answer(said: &str) -> Value {
    let text = said
        .strip_prefix("tool said: ")
        .unwrap_or_else(|| panic!("{said}"));
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not the tool's JSON ({e}): {said}"))
}

/// The tool's JSON answer inside `tool said: …` when the tool answered with an error: the CLI
/// passes it to the model as a failed call, the answer first, its own advice after it.
fn tool_error(said: &str) -> Value {
    let text = said
        .strip_prefix("tool said: ")
        .unwrap_or_else(|| panic!("{said}"));
    let first = serde_json::Deserializer::from_str(text)
        .into_iter::<Value>()
        .next();
    let answer = first
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("not the tool's JSON first: {said}"));
    assert!(
        text.len() > answer.to_string().len(),
        "the CLI read no tool error, only its answer: {said}"
    );
    answer
}

#[test]
fn a_stock_claude_launches_a_workflow_through_the_mcp_tool_and_reads_its_whole_result() {
    let env = Env::new();
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    // The model calls Workflow with an inline script whose result is over 100 KB.
    let input = json!({
        "script": "export const meta = { name: 'via-claude', description: 'launched from Claude Code' };\nconst r = await agent('hello [[sleep:1500]]');\nreturn { r, pad: 'y'.repeat(120000) };",
    });
    let said = claude_with_flotilla(
        &env,
        &fake,
        &format!("start it [[tool:mcp__flotilla__Workflow:{input}]]"),
    );
    let launched = tool_answer(&said);
    assert_eq!(launched["status"], "remote_launched", "{launched}");
    let run = launched["runId"].as_str().expect("a run id").to_owned();
    // Its session page serves the run (the run's own process serves it while it runs).
    let url = launched["sessionUrl"].as_str().unwrap();
    let (port, path) = url
        .strip_prefix("http://127.0.0.1:")
        .and_then(|r| r.split_once('/'))
        .expect("a loopback URL");
    let page = http_get(port.parse().unwrap(), &format!("/{path}"), &[]);
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains(&run));
    // The run is a process of its own: it goes on after the CLI has ended its session (and
    // signalled its MCP server), to its end; its report is then in the store, where the next
    // session reads it.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let shown = env.flotilla(&["show", &run, "--json"]);
        let status = if shown.code == 0 {
            shown.json()["status"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        } else {
            String::new()
        };
        if status == "completed" {
            break;
        }
        assert!(Instant::now() < deadline, "the run never ended: {shown:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
    let said = claude_with_flotilla(
        &env,
        &fake,
        &format!(
            "its result [[tool:mcp__flotilla__WorkflowResult:{}]]",
            json!({ "runId": run, "limit": 20000 })
        ),
    );
    let page = tool_answer(&said);
    assert_eq!(page["status"], "completed", "{page}");
    assert_eq!(page["resultJson"].as_str().unwrap().chars().count(), 20000);
    assert_eq!(page["nextOffset"], 20000, "{page}");
    assert!(page["totalChars"].as_u64().unwrap() > 120_000, "{page}");
    // A syntax error comes back at once as `error`, with its line.
    let input =
        json!({ "script": "export const meta = { name: 'b', description: 'd' };\nreturn (;" });
    let said = claude_with_flotilla(
        &env,
        &fake,
        &format!("go [[tool:mcp__flotilla__Workflow:{input}]]"),
    );
    let refused = tool_error(&said);
    assert!(
        refused["error"].as_str().unwrap().contains("line 2"),
        "{refused}"
    );
}

/// A repository for a fleet run's source: a committed file and an uncommitted edit of it.
fn caller_repo(dir: &Path) {
    flotilla_tests::git_repo(dir);
    std::fs::write(dir.join("marker.txt"), "committed\n").unwrap();
    flotilla_tests::commit_all(dir, "marker");
    std::fs::write(dir.join("marker.txt"), "from the caller's checkout\n").unwrap();
}

/// The `flotilla mcp` command line on `c`'s fleet (exec agents: a prompt is a shell script).
fn fleet_mcp_args(c: &Cluster) -> Vec<String> {
    [
        "mcp",
        "--backend",
        "exec",
        "--stagger",
        "0",
        "--coordinator",
        &c.url(),
        "--name",
        "client",
        "--tls-dir",
        c.pki().to_str().unwrap(),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// A session token of the cluster's client, for its pages.
fn page_token(c: &Cluster) -> String {
    let t = c.client(&["token", "create", "--json"]);
    assert_eq!(t.code, 0, "{t:?}");
    t.json()["token"].as_str().unwrap().to_owned()
}

/// GET of a coordinator page URL with a session token.
fn get_page(c: &Cluster, url: &str, token: &str) -> flotilla_tests::HttpResponse {
    let path = url
        .strip_prefix(&format!("http://127.0.0.1:{}", c.http_port))
        .unwrap_or_else(|| panic!("not the coordinator's page: {url}"));
    http_get(
        c.http_port,
        path,
        &[("Authorization", &format!("Bearer {token}"))],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_fleet_the_workflow_tool_launches_on_the_coordinator_with_the_caller_s_repository() {
    let c = Cluster::start_configured(
        2,
        2,
        &["--publisher", "client"],
        &["--backend", "exec", "--exec-cmd", "sh"],
    );
    let repo = c.path().join("repo");
    caller_repo(&repo);
    // A workflow pushed to the coordinator is listed, and runs by name.
    let pushed = flotilla_tests::write_workflow(
        c.path(),
        "fleet-greeting",
        "pushed to the fleet",
        "return await agent('echo pushed ' + args.who);",
    );
    let out = c.client(&["workflows", "push", pushed.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{out:?}");

    let mut cmd = tokio::process::Command::new(&c.bin);
    cmd.args(fleet_mcp_args(&c))
        .current_dir(&repo)
        .env("HOME", c.path())
        .env("AWS_EC2_METADATA_DISABLED", "true");
    let client: Client =
        ().serve(TokioChildProcess::new(cmd).expect("spawn"))
            .await
            .expect("an MCP session");

    // Three agents read the caller's checkout (uncommitted edit included); a big result.
    let script = "export const meta = { name: 'fleet-read', description: 'reads the caller repo' };\n\
                  const rs = await parallel([1, 2, 3].map(i => () => agent('cat marker.txt; echo call ' + i)));\n\
                  return { rs, pad: 'z'.repeat(130000) };";
    let launched = ok(&client, "Workflow", json!({ "script": script })).await;
    assert_eq!(launched["status"], "remote_launched", "{launched}");
    assert!(launched.get("error").is_none(), "{launched}");
    let run = launched["runId"].as_str().unwrap().to_owned();
    let url = launched["sessionUrl"].as_str().unwrap();
    // The coordinator serves its page (after sign-in), not this machine.
    let token = page_token(&c);
    let page = get_page(&c, url, &token);
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains(&run), "the page does not show the run");
    // The run is the coordinator's: `flotilla wait` there sees it complete.
    let (code, report) = c.wait(&run);
    assert_eq!(code, 0, "{report}");
    let status = finished(&client, &run).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(status["agents"], 3, "{status}");
    let mut text = String::new();
    let mut offset = 0u64;
    loop {
        let page = ok(
            &client,
            "WorkflowResult",
            json!({ "runId": run, "offset": offset }),
        )
        .await;
        text.push_str(page["resultJson"].as_str().unwrap());
        match page["nextOffset"].as_u64() {
            Some(next) => offset = next,
            None => break,
        }
    }
    let result: Value = serde_json::from_str(&text).expect("the pages make the JSON result");
    for (i, r) in result["rs"].as_array().unwrap().iter().enumerate() {
        let r = r.as_str().unwrap();
        assert!(r.contains("from the caller's checkout"), "{r}");
        assert!(r.contains(&format!("call {}", i + 1)), "{r}");
    }
    assert_eq!(result["pad"].as_str().unwrap().len(), 130_000);

    // By name, a pushed workflow, and WorkflowList names it with the bundled ones.
    let listed = ok(&client, "WorkflowList", json!({})).await;
    let rows = listed["workflows"].as_array().unwrap();
    assert!(
        rows.iter()
            .any(|w| w["name"] == "fleet-greeting" && w["origin"] == "server"),
        "{listed}"
    );
    assert!(rows.iter().any(|w| w["origin"] == "bundled"), "{listed}");
    let named = ok(
        &client,
        "Workflow",
        json!({ "name": "fleet-greeting", "args": { "who": "ann" } }),
    )
    .await;
    let named_run = named["runId"]
        .as_str()
        .unwrap_or_else(|| panic!("{named}"))
        .to_owned();
    let done = finished(&client, &named_run).await;
    assert_eq!(done["status"], "completed", "{done}");
    let page = ok(&client, "WorkflowResult", json!({ "runId": named_run })).await;
    assert!(
        page["resultJson"].as_str().unwrap().contains("pushed ann"),
        "{page}"
    );

    // Refusals, as tool errors: a syntax error with its line, an unknown name; nothing
    // launched.
    let broken = refused_launch(
        &client,
        json!({ "script": "export const meta = { name: 'b', description: 'd' };\nconst x = ;\nreturn x;" }),
    )
    .await;
    assert!(
        broken["error"].as_str().unwrap().contains("line 2"),
        "{broken}"
    );
    let unknown = refused_launch(&client, json!({ "name": "no-such-workflow" })).await;
    assert!(
        unknown["error"]
            .as_str()
            .unwrap()
            .contains("unknown workflow"),
        "{unknown}"
    );

    // Stop: the coordinator stops the run.
    let long = ok(
        &client,
        "Workflow",
        json!({ "script": "export const meta = { name: 'long', description: 'd' };\nreturn await agent('sleep 60');" }),
    )
    .await;
    let long = long["runId"]
        .as_str()
        .unwrap_or_else(|| panic!("{long}"))
        .to_owned();
    let running = ok(&client, "WorkflowResult", json!({ "runId": long })).await;
    assert_eq!(running["finished"], false, "{running}");
    ok(&client, "WorkflowStop", json!({ "runId": long })).await;
    let stopped = finished(&client, &long).await;
    assert_eq!(stopped["status"], "stopped", "{stopped}");
    let r = call(
        &client,
        "WorkflowStatus",
        json!({ "runId": "wf_00000000-000" }),
    )
    .await;
    assert_eq!(r.is_error, Some(true), "{r:?}");
    client.cancel().await.expect("the session ends");
}

#[test]
fn a_stock_claude_launches_on_the_fleet_through_the_mcp_tool_and_reads_the_whole_result() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let repo = c.path().join("repo");
    caller_repo(&repo);
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    let args = fleet_mcp_args(&c);
    let server = json!({
        "type": "stdio",
        "command": c.bin.to_str().unwrap(),
        "args": args,
        "env": { "HOME": c.path().to_str().unwrap(), "AWS_EC2_METADATA_DISABLED": "true" },
    });
    let home = c.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let input = json!({
        "script": "export const meta = { name: 'via-claude', description: 'launched from Claude Code' };\nconst r = await agent('cat marker.txt');\nreturn { r, pad: 'y'.repeat(110000) };",
    });
    let said = claude_with_server(
        &repo,
        &home,
        server.clone(),
        &fake,
        &format!("start it [[tool:mcp__flotilla__Workflow:{input}]]"),
    );
    let launched = tool_answer(&said);
    assert_eq!(launched["status"], "remote_launched", "{launched}");
    let run = launched["runId"].as_str().expect("a run id").to_owned();
    let page = get_page(
        &c,
        launched["sessionUrl"].as_str().unwrap(),
        &page_token(&c),
    );
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains(&run));
    // The run is the coordinator's; it ends there whatever the CLI's session did.
    let (code, report) = c.wait(&run);
    assert_eq!(code, 0, "{report}");
    let said = claude_with_server(
        &repo,
        &home,
        server.clone(),
        &fake,
        &format!(
            "its result [[tool:mcp__flotilla__WorkflowResult:{}]]",
            json!({ "runId": run, "offset": 0, "limit": 20000 })
        ),
    );
    let page = tool_answer(&said);
    assert_eq!(page["status"], "completed", "{page}");
    let text = page["resultJson"].as_str().unwrap();
    assert_eq!(text.chars().count(), 20000);
    assert!(text.contains("from the caller's checkout"), "{text:.300}");
    assert!(page["totalChars"].as_u64().unwrap() > 110_000, "{page}");
    let input =
        json!({ "script": "export const meta = { name: 'b', description: 'd' };\nreturn (;" });
    let said = claude_with_server(
        &repo,
        &home,
        server,
        &fake,
        &format!("go [[tool:mcp__flotilla__Workflow:{input}]]"),
    );
    let refused = tool_error(&said);
    assert!(
        refused["error"].as_str().unwrap().contains("line 2"),
        "{refused}"
    );
}

/// `flotilla mcp` spoken to line by line over its stdio, as a hostile MCP client would: raw
/// lines in, every answer line kept.
struct RawMcp {
    child: std::process::Child,
    input: std::process::ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
    /// Every line the server wrote.
    heard: Vec<String>,
    next_id: u64,
}

impl RawMcp {
    fn start(mut cmd: std::process::Command) -> RawMcp {
        use std::io::BufRead;
        use std::process::Stdio;
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start flotilla mcp");
        let input = child.stdin.take().unwrap();
        let output = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(output).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut mcp = RawMcp {
            child,
            input,
            lines,
            heard: Vec::new(),
            next_id: 0,
        };
        let init = mcp.request(
            "initialize",
            json!({ "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": { "name": "hostile", "version": "1" } }),
        );
        assert!(init.get("result").is_some(), "{init}");
        mcp.send(
            json!({ "jsonrpc": "2.0", "method": "notifications/initialized" })
                .to_string()
                .as_bytes(),
        );
        mcp
    }

    fn send(&mut self, line: &[u8]) {
        use std::io::Write;
        self.input.write_all(line).expect("write to the server");
        self.input.write_all(b"\n").expect("write to the server");
        self.input.flush().expect("flush");
    }

    /// The next line the server writes (it must write one within 30 s).
    fn answer(&mut self) -> Value {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(30))
            .expect("the server answers within 30 s");
        self.heard.push(line.clone());
        serde_json::from_str(&line).expect("the server writes JSON")
    }

    fn request(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        self.send(
            json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params })
                .to_string()
                .as_bytes(),
        );
        let a = self.answer();
        assert_eq!(a["id"], id, "{a}");
        a
    }

    /// A `Workflow` call's structured answer.
    fn workflow(&mut self, args: Value) -> Value {
        let a = self.request(
            "tools/call",
            json!({ "name": "Workflow", "arguments": args }),
        );
        a["result"]["structuredContent"].clone()
    }
}

impl Drop for RawMcp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A tree for a hostile `flotilla mcp` caller: secrets outside the project the server runs
/// in (and one inside it that is no workflow), symlinks from the project out, one workflow.
struct Planted {
    env: Env,
    project: std::path::PathBuf,
    /// Text no answer may carry.
    secrets: Vec<String>,
}

fn planted() -> Planted {
    let env = Env::new();
    let top = env.path().to_path_buf();
    let outside = "PLANTED_OUTSIDE_4e1f9c";
    let inside = "PLANTED_DOTENV_b7d203";
    let in_env = "PLANTED_ENVIRON_19ac55";
    let meta = "export const meta = { name: 'leak', description: 'd' };";
    std::fs::write(top.join("secret.env"), format!("{outside}=1 more\n")).unwrap();
    // A workflow script outside: a valid meta, then a compile error quoting the secret, so a
    // read or a run of it would carry the secret into its error.
    std::fs::write(top.join("secret.js"), format!("{meta}\n{outside} (((\n")).unwrap();
    std::fs::create_dir_all(top.join("outside")).unwrap();
    std::fs::write(
        top.join("outside/flow.js"),
        format!("{meta}\n{outside} (((\n"),
    )
    .unwrap();
    let project = top.join("proj");
    flotilla_tests::git_repo(&project);
    std::fs::write(project.join(".env"), format!("{inside}=abc\n")).unwrap();
    // A file named like a workflow, where the server runs.
    std::fs::write(project.join("leak"), format!("{inside}=abc\n")).unwrap();
    std::os::unix::fs::symlink(top.join("secret.js"), project.join("link.js")).unwrap();
    std::os::unix::fs::symlink(&top, project.join("dir")).unwrap();
    std::os::unix::fs::symlink("/proc/self/environ", project.join("environ.js")).unwrap();
    std::fs::create_dir_all(project.join(".flotilla/workflows")).unwrap();
    flotilla_tests::write_workflow(
        &project.join(".flotilla/workflows"),
        "ok",
        "a workflow in reach",
        "return 1;",
    );
    Planted {
        env,
        project,
        secrets: vec![outside.into(), inside.into(), in_env.into()],
    }
}

fn hostile_server(p: &Planted) -> RawMcp {
    let mut cmd = p.env.command(
        &["mcp", "--backend", "echo", "--stagger", "0"],
        &[("FLOTILLA_TEST_SECRET", "PLANTED_ENVIRON_19ac55")],
    );
    cmd.current_dir(&p.project);
    RawMcp::start(cmd)
}

/// Paths a hostile caller builds: `..`, absolute, doubled and back slashes, percent and
/// full-width look-alikes, NUL, symlinks out, names of the planted files.
fn hostile_paths(top: String) -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let segment = prop_oneof![
        Just("..".to_owned()),
        Just(".".to_owned()),
        Just(String::new()),
        Just("secret.env".to_owned()),
        Just("secret.js".to_owned()),
        Just("link.js".to_owned()),
        Just("environ.js".to_owned()),
        Just("dir".to_owned()),
        Just("proj".to_owned()),
        Just("outside".to_owned()),
        Just("flow.js".to_owned()),
        Just(".env".to_owned()),
        Just("leak".to_owned()),
        Just("etc".to_owned()),
        Just("shadow".to_owned()),
        Just("proc".to_owned()),
        Just("self".to_owned()),
        Just("environ".to_owned()),
        Just("%2e%2e".to_owned()),
        Just("..%2f".to_owned()),
        Just("\u{ff0e}\u{ff0e}".to_owned()),
        Just("secret.env\u{0}.js".to_owned()),
        Just("a".repeat(300)),
        // Never `ok`, the one workflow in reach.
        "[a-z.%]{3,8}",
    ];
    let sep = prop_oneof![Just("/"), Just("//"), Just("\\"), Just("/./")];
    let prefix = prop_oneof![
        Just(String::new()),
        Just("/".to_owned()),
        Just("./".to_owned()),
        Just("../".to_owned()),
        Just(format!("{top}/")),
        Just("~/".to_owned()),
        Just("file://".to_owned()),
    ];
    (prefix, proptest::collection::vec((segment, sep), 1..6)).prop_map(|(prefix, parts)| {
        let mut p = prefix;
        for (i, (seg, sep)) in parts.iter().enumerate() {
            if i > 0 {
                p.push_str(sep);
            }
            p.push_str(seg);
        }
        p
    })
}

#[test]
fn a_hostile_caller_reads_nothing_outside_the_project_through_script_path_or_name() {
    use proptest::test_runner::{Config, TestRunner};
    let p = planted();
    let mut mcp = hostile_server(&p);
    let top = p.env.path().display().to_string();
    let refused = |a: &Value, what: &str| {
        assert!(
            a["error"].is_string() && a.get("runId").is_none(),
            "{what}: {a}"
        );
    };
    // By hand first: the issue's own and the planted ones.
    for path in [
        "/etc/shadow".to_owned(),
        "/etc/passwd".to_owned(),
        "/proc/self/environ".to_owned(),
        "environ.js".to_owned(),
        "../secret.env".to_owned(),
        "../secret.js".to_owned(),
        format!("{top}/secret.env"),
        "link.js".to_owned(),
        "dir/secret.js".to_owned(),
        "dir/outside/flow.js".to_owned(),
        ".env".to_owned(),
        "leak".to_owned(),
        "secret.env\u{0}".to_owned(),
        "x".repeat(5000),
    ] {
        let a = mcp.workflow(json!({ "scriptPath": path }));
        refused(&a, &path);
    }
    let a = mcp.workflow(json!({ "scriptPath": "../secret.js" }));
    assert!(
        a["error"]
            .as_str()
            .unwrap()
            .contains("outside what this run may read"),
        "{a}"
    );
    let a = mcp.workflow(json!({ "scriptPath": ".env" }));
    assert!(
        a["error"]
            .as_str()
            .unwrap()
            .contains("is not a workflow script"),
        "{a}"
    );
    for name in [
        "/etc/shadow".to_owned(),
        "../secret".to_owned(),
        ".env".to_owned(),
        "leak".to_owned(),
        "secret.env".to_owned(),
        "-h".to_owned(),
        "--exec-cmd=id".to_owned(),
        "x".repeat(300),
    ] {
        let a = mcp.workflow(json!({ "name": name }));
        refused(&a, &name);
    }
    for resume in ["--exec-cmd=id", "../x", "wf_x\n"] {
        let a = mcp.workflow(json!({ "name": "ok", "resumeFromRunId": resume }));
        refused(&a, resume);
    }
    for tool in [
        "WorkflowStatus",
        "WorkflowResult",
        "WorkflowStop",
        "WorkflowBudget",
    ] {
        let a = mcp.request(
            "tools/call",
            json!({ "name": tool, "arguments": { "runId": "../../secret.env", "usd": 1 } }),
        );
        assert_eq!(a["result"]["isError"], true, "{tool}: {a}");
    }
    // Built by proptest: every path is refused, and no answer carries a secret.
    let mut runner = TestRunner::new(Config {
        cases: 96,
        failure_persistence: None,
        ..Config::default()
    });
    let mcp = std::cell::RefCell::new(mcp);
    runner
        .run(&hostile_paths(top.clone()), |path| {
            let mut mcp = mcp.borrow_mut();
            let by_path = mcp.workflow(json!({ "scriptPath": path }));
            proptest::prop_assert!(
                by_path["error"].is_string() && by_path.get("runId").is_none(),
                "{path:?}: {by_path}"
            );
            let by_name = mcp.workflow(json!({ "name": path }));
            proptest::prop_assert!(by_name.get("runId").is_none(), "{path:?}: {by_name}");
            Ok(())
        })
        .unwrap();
    let mut mcp = mcp.into_inner();
    // What is in reach still runs, by path and by name.
    for args in [
        json!({ "scriptPath": ".flotilla/workflows/ok.js" }),
        json!({ "name": "ok" }),
        json!({ "name": "/ok" }),
    ] {
        let a = mcp.workflow(args.clone());
        assert!(a["runId"].is_string(), "{args}: {a}");
    }
    for line in &mcp.heard {
        for s in &p.secrets {
            assert!(!line.contains(s.as_str()), "{s} in {line}");
        }
        assert!(!line.contains("root:"), "{line}");
    }
}

#[test]
fn a_line_that_is_not_json_or_is_too_long_gets_a_parse_error_and_the_server_goes_on() {
    let p = planted();
    let mut mcp = hostile_server(&p);
    let mut huge = br#"{"jsonrpc":"2.0","id":99,"method":"tools/list","params":{"pad":""#.to_vec();
    huge.resize(huge.len() + (50 << 20), b'a');
    huge.extend_from_slice(br#""}}"#);
    let truncated = br#"{"jsonrpc":"2.0","id":7,"method":"tools/list""#;
    let lines: [&[u8]; 5] = [
        b"not json",
        truncated,
        b"\xff\xfe{}",
        b"{\"jsonrpc\":\"2.0\",\"id\":8,\"method\":\"tools/list\"}}",
        &huge,
    ];
    for line in lines {
        mcp.send(line);
        let a = mcp.answer();
        assert_eq!(a["id"], Value::Null, "{a}");
        assert_eq!(a["error"]["code"], -32700, "{a}");
        // The next request is answered.
        let tools = mcp.request("tools/list", json!({}));
        assert!(tools["result"]["tools"].is_array(), "{tools}");
    }
    let last = mcp.heard.iter().rev().nth(1).unwrap();
    assert!(last.contains("16 MiB"), "{last}");
}

/// A run the MCP server started on this machine asks with `ask()`: WorkflowStatus lists the
/// question, WorkflowAnswer answers it through the local store (a wrong answer refused with
/// the reason), and the run goes on to its result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workflow_answer_answers_a_local_run_s_question_through_its_store() {
    let env = Env::new();
    let cmd = env.command(&["mcp", "--backend", "echo", "--stagger", "0"], &[]);
    let client: Client =
        ().serve(TokioChildProcess::new(tokio::process::Command::from(cmd)).expect("spawn"))
            .await
            .expect("an MCP session");
    let script = "export const meta = { name: 'asking', description: 'asks a person' };\n\
        const n = await ask('How many?', { schema: { type: 'integer', minimum: 1 } });\n\
        return await agent('make ' + n);";
    let launched = ok(&client, "Workflow", json!({ "script": script })).await;
    let run = launched["runId"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    let id = loop {
        let s = ok(&client, "WorkflowStatus", json!({ "runId": run })).await;
        if let Some(id) = s["questions"][0]["id"].as_str() {
            assert_eq!(s["questions"][0]["question"], "How many?", "{s}");
            break id.to_owned();
        }
        assert!(Instant::now() < deadline, "the question never showed: {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let wrong = call(
        &client,
        "WorkflowAnswer",
        json!({ "runId": run, "questionId": id, "answer": 0 }),
    )
    .await;
    assert_eq!(wrong.is_error, Some(true), "{wrong:?}");
    assert!(
        format!("{wrong:?}").contains("does not match the schema"),
        "{wrong:?}"
    );
    let right = ok(
        &client,
        "WorkflowAnswer",
        json!({ "runId": run, "questionId": id, "answer": 3 }),
    )
    .await;
    assert!(
        right["message"]
            .as_str()
            .is_some_and(|m| m.contains("answered")),
        "{right}"
    );
    let done = finished(&client, &run).await;
    let result = ok(&client, "WorkflowResult", json!({ "runId": run })).await;
    assert!(result.to_string().contains("make 3"), "{result} {done}");
    client.cancel().await.ok();
}
