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

    // A script that does not compile comes back at once with its line, and never runs.
    let broken = ok(
        &client,
        "Workflow",
        json!({ "script": "export const meta = { name: 'b', description: 'd' };\nconst x = ;\nreturn x;" }),
    )
    .await;
    assert_eq!(broken["status"], "remote_launched");
    assert!(broken.get("runId").is_none(), "{broken}");
    assert!(
        broken["error"].as_str().unwrap().contains("line 2"),
        "{broken}"
    );
    let unknown = ok(&client, "Workflow", json!({ "name": "no-such-workflow" })).await;
    assert!(
        unknown["error"]
            .as_str()
            .unwrap()
            .contains("unknown workflow"),
        "{unknown}"
    );
    let nothing = ok(&client, "Workflow", json!({})).await;
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
    let refused = tool_answer(&said);
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

    // Refusals: a syntax error with its line, an unknown name; nothing launched.
    let broken = ok(
        &client,
        "Workflow",
        json!({ "script": "export const meta = { name: 'b', description: 'd' };\nconst x = ;\nreturn x;" }),
    )
    .await;
    assert!(broken.get("runId").is_none(), "{broken}");
    assert!(
        broken["error"].as_str().unwrap().contains("line 2"),
        "{broken}"
    );
    let unknown = ok(&client, "Workflow", json!({ "name": "no-such-workflow" })).await;
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
    let refused = tool_answer(&said);
    assert!(
        refused["error"].as_str().unwrap().contains("line 2"),
        "{refused}"
    );
}
