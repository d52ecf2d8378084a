//! The `claude-code` backend: the real, pinned Claude Code CLI (`.ci/run` installs it under
//! `.tools/claude`) against the in-repo fake Messages API (`spec/agent-backends.md`).

use std::path::PathBuf;

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::Env;
use flotilla_tests::fake_anthropic::FakeAnthropic;
use serde_json::json;

/// The pinned CLI; a missing one is a failure with the install command, never a skip.
pub(crate) fn claude_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOTILLA_CLAUDE_BIN") {
        return PathBuf::from(p);
    }
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/claude/node_modules/.bin/claude");
    assert!(
        p.exists(),
        "the pinned Claude Code CLI is missing at {}; install it with `npm install --prefix .tools/claude @anthropic-ai/claude-code@2.1.332` (.ci/run does)",
        p.display()
    );
    p
}

/// Runs `body` on the claude-code backend against `fake`.
fn run(env: &Env, fake: &FakeAnthropic, body: &str) -> (i32, serde_json::Value) {
    run_with(env, fake, body, &[])
}

fn run_with(
    env: &Env,
    fake: &FakeAnthropic,
    body: &str,
    extra: &[&str],
) -> (i32, serde_json::Value) {
    run_env(env, fake, body, extra, &[])
}

/// On the claude-code backend (the pinned CLI), stagger off, with `vars` added.
fn run_env(
    env: &Env,
    fake: &FakeAnthropic,
    body: &str,
    extra: &[&str],
    vars: &[(&str, &str)],
) -> (i32, serde_json::Value) {
    let bin = claude_bin().to_str().unwrap().to_owned();
    let mut all = vec![("FLOTILLA_CLAUDE_BIN", bin.as_str())];
    all.extend_from_slice(vars);
    let mut args = vec!["--stagger", "0"];
    args.extend_from_slice(extra);
    fake.run(env, "claude-code", body, &args, &all)
}

/// Files named `name` anywhere under the workspace.
fn find(env: &Env, name: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![env.workspace()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == name) {
                out.push(p);
            }
        }
    }
    out
}

#[test]
fn a_text_result_comes_from_the_real_cli() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run(&env, &fake, "return await agent('say hi');");
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "fake reply to: say hi", "{r}");
    assert!(
        r["usage"]["output_tokens"].as_u64().unwrap() > 0,
        "{}",
        r["usage"]
    );
    let posts: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|s| s.method == "POST" && s.path.starts_with("/v1/messages"))
        .collect();
    assert!(!posts.is_empty());
    assert_eq!(posts[0].body["stream"], true);
}

#[test]
fn a_schema_result_goes_through_the_structured_output_tool() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run(
        &env,
        &fake,
        "return await agent('name something [[json:{\"name\":\"flotilla\"}]]', \
           { schema: { type: 'object', properties: { name: { type: 'string' } }, required: ['name'] } });",
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!({"name": "flotilla"}), "{r}");
    let sent_tool = fake.requests().iter().any(|s| {
        s.body["tools"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["name"] == "StructuredOutput"))
    });
    assert!(sent_tool, "the CLI offered the StructuredOutput tool");
}

#[test]
fn an_allowed_tool_runs_in_the_call_s_working_directory() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run(
        &env,
        &fake,
        "return await agent('make a file [[bash:touch made-by-bash.txt && echo made]]', { tools: ['Bash'] });",
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "tool said: made", "{r}");
    let made = find(&env, "made-by-bash.txt");
    assert_eq!(
        made.len(),
        1,
        "the file is in the call's directory: {made:?}"
    );
    assert!(made[0].starts_with(env.workspace()));
    // The transcript is stored: `flotilla logs` shows the tool call and its output.
    let run_id = r["run_id"].as_str().unwrap();
    let logs = env.flotilla(&["logs", run_id, "--agent", "0"]);
    assert_eq!(logs.code, 0, "{logs:?}");
    assert!(logs.stdout.contains("tool Bash"), "{}", logs.stdout);
    assert!(logs.stdout.contains("result: made"), "{}", logs.stdout);
    assert!(
        !logs.stdout.contains("sk-ant-fake"),
        "no credentials in transcripts"
    );
    let missing = env.flotilla(&["logs", run_id, "--agent", "nobody"]);
    assert_eq!(missing.code, 2, "{missing:?}");
}

#[test]
fn a_tool_the_policy_does_not_allow_is_denied_without_hanging() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run(
        &env,
        &fake,
        "return await agent('make a file [[bash:touch denied.txt && echo made]]');",
    );
    assert_eq!(code, 0, "{r}");
    let text = r["result"].as_str().unwrap_or_default();
    assert!(
        text.starts_with("tool said:") && text.contains("not allowed"),
        "{r}"
    );
    assert!(
        find(&env, "denied.txt").is_empty(),
        "the denied command did not run"
    );
}

#[test]
fn a_timeout_kills_the_cli_and_the_commands_its_tools_started() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run(
        &env,
        &fake,
        "return await agent('wait [[bash:timeout 41.731 tail -f /dev/null; echo late]]', { tools: ['Bash'], timeout: 3000 });",
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"], serde_json::Value::Null, "{r}");
    assert!(r["failures"].to_string().contains("timed out"), "{r}");
    // Neither the CLI nor the shell its Bash tool started survives the attempt.
    let left = std::process::Command::new("pgrep")
        .args(["-f", "timeout 41.731"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&left.stdout).trim().is_empty(),
        "processes left behind: {}",
        String::from_utf8_lossy(&left.stdout)
    );
}

#[test]
fn a_workflow_runs_end_to_end_on_remote_workers_with_the_real_cli() {
    let fake = FakeAnthropic::start();
    let mut env = fake.env();
    env.push((
        "FLOTILLA_CLAUDE_BIN".into(),
        claude_bin().to_str().unwrap().to_owned(),
    ));
    let c = flotilla_tests::cluster::Cluster::start_workers_with(
        2,
        3,
        &["--backend", "echo,claude-code"],
        env,
    );
    let run = c.launch(
        "remote-claude",
        "const notes = await parallel(['a', 'b', 'c'].map(x => () => agent('note ' + x)));\n\
         const verdict = await agent('judge [[json:{\"ok\":true}]]', \
           { schema: { type: 'object', properties: { ok: { type: 'boolean' } }, required: ['ok'] } });\n\
         const piped = await pipeline(['x', 'y'], it => agent('draft ' + it), (prev, it) => agent('polish ' + it));\n\
         return { notes, verdict, piped };",
        &["--stagger", "0", "--backend", "claude-code"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"]["notes"][0], "fake reply to: note a", "{r}");
    assert_eq!(r["result"]["verdict"], json!({"ok": true}), "{r}");
    assert_eq!(r["result"]["piped"][1], "fake reply to: polish y", "{r}");
    assert_eq!(r["usage"]["agents"], 8);
    assert!(
        r["usage"]["cost_usd"].as_f64().unwrap() > 0.0,
        "{}",
        r["usage"]
    );
}

#[test]
fn the_money_budget_refuses_new_agents_and_stops_running_ones() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    // One quick agent costs more than the budget; two others are busy in a long tool call
    // when its cost comes in, and a later one is refused outright.
    let (code, r) = run_with(
        &env,
        &fake,
        "const codes = [];\n\
         const slow = [1, 2].map(i => agent('busy ' + i + ' [[bash:timeout 20.5 tail -f /dev/null; echo late]]', { tools: ['Bash'], label: 'busy ' + i })\n\
           .catch(e => { codes.push(e.code); return 'stopped'; }));\n\
         const quick = await agent('quick one', { label: 'quick' });\n\
         const stopped = await Promise.all(slow);\n\
         let later = 'ran';\n\
         try { await agent('one more'); } catch (e) { later = e.code; }\n\
         return { quick, stopped, codes, later };",
        &["--budget-usd", "0.001", "--concurrency", "3"],
    );
    assert_eq!(code, 0, "{r}");
    let res = &r["result"];
    assert_eq!(res["quick"], "fake reply to: quick one", "{r}");
    assert_eq!(res["stopped"], json!(["stopped", "stopped"]), "{r}");
    assert_eq!(
        res["codes"],
        json!(["BUDGET_EXCEEDED", "BUDGET_EXCEEDED"]),
        "{r}"
    );
    assert_eq!(res["later"], "BUDGET_EXCEEDED", "{r}");
    assert!(
        r["usage"]["cost_usd"].as_f64().unwrap() >= 0.001,
        "{}",
        r["usage"]
    );
    let left = std::process::Command::new("pgrep")
        .args(["-f", "timeout 20.5"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&left.stdout).trim().is_empty(),
        "the stopped agents' commands are gone"
    );
}

#[test]
fn a_rate_limited_call_waits_and_then_succeeds() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run_env(
        &env,
        &fake,
        "return await agent('limited [[fail-first:3:429]]');",
        &[],
        &[("FLOTILLA_LIMIT_WAIT", "1s")],
    );
    assert_eq!(code, 0, "{r}");
    // The CLI retried twice itself and gave up on the API's 429; the call waited it out (a
    // throttle of the account, not counted as an attempt) and then succeeded.
    assert!(
        r["result"]
            .as_str()
            .unwrap_or("")
            .starts_with("fake reply to: limited"),
        "{r}"
    );
    assert!(r["logs"].to_string().contains("[throttle]"), "{r}");
    assert_eq!(r["usage"]["waits"], 1, "{r}");
    assert_eq!(r["usage"]["errors"], 0, "a throttle is not a failure: {r}");
}

#[test]
fn a_stalled_stream_is_restarted_by_the_watchdog_and_the_retry_succeeds() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let prompt = "slow start [[stall-first:1]]";
    let (code, r) = run_with(
        &env,
        &fake,
        &format!("return await agent('{prompt}', {{ label: 's' }});"),
        &["--stall-timeout", "5s"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], format!("fake reply to: {prompt}"), "{r}");
    assert_eq!(flotilla_tests::agent(&r, "s")["attempts"], 2, "{r}");
    let logs = r["logs"].as_array().unwrap();
    assert!(
        logs.iter().any(|l| l
            .as_str()
            .unwrap()
            .starts_with("[stall] agent \"s\" stalled")),
        "{logs:?}"
    );
    // The CLI did not retry by itself: the watchdog restarted the attempt.
    let asked = fake
        .requests()
        .iter()
        .filter(|s| s.path.starts_with("/v1/messages") && s.body.to_string().contains("slow start"))
        .count();
    assert_eq!(asked, 2, "one stalled request and one answered");
}

/// Issue 33, 3: an agent interrupted mid-session continues its own conversation. The real
/// CLI takes two turns, stalls on its third model call and is cut off by the watchdog; the
/// next attempt resumes the CLI's session: its first request to the model carries the two
/// earlier turns and the note that it was interrupted, and it asks only for the rest (three
/// requests, not the five of a start over).
#[test]
fn a_stalled_agent_continues_its_own_session_with_its_earlier_turns() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let prompt = "four steps [[turns:4]] [[stall-at:2]]";
    let (code, r) = run_with(
        &env,
        &fake,
        &format!("return await agent('{prompt}', {{ label: 'steps' }});"),
        &["--stall-timeout", "3s"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "done after 4 turns", "{r}");
    assert_eq!(flotilla_tests::agent(&r, "steps")["attempts"], 2, "{r}");
    let asked: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|s| s.path.starts_with("/v1/messages") && s.body.to_string().contains("four steps"))
        .collect();
    let turns: Vec<usize> = asked
        .iter()
        .map(|s| flotilla_tests::fake_anthropic::tool_results(&s.body))
        .collect();
    let out = env.flotilla(&[
        "logs",
        r["run_id"].as_str().unwrap(),
        "--agent",
        "steps",
        "--attempt",
        "2",
    ]);
    assert_eq!(
        turns,
        [0, 1, 2, 2, 3, 4],
        "three requests, then three more that go on: {}",
        out.stdout
    );
    let resumed = asked[3].body["messages"].to_string();
    for said in ["turn 1", "turn 2", "was interrupted before it finished"] {
        assert!(resumed.contains(said), "{said:?} in {resumed}");
    }
    // Its transcript says it went on.
    let out = env.flotilla(&[
        "logs",
        r["run_id"].as_str().unwrap(),
        "--agent",
        "steps",
        "--attempt",
        "2",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stdout.contains("continued the session attempt 1 left"),
        "{}",
        out.stdout
    );
}

/// `flotilla bench continue` measures what a continued restart sends the model against a
/// restart that starts over; here at N = 2 (the figures for 2, 8 and 32 are in the closing
/// notes): the continued one makes fewer model calls and sends fewer uncached tokens.
#[test]
fn bench_continue_compares_a_continued_restart_with_one_that_starts_over() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let bin = claude_bin().to_str().unwrap().to_owned();
    let mut vars: Vec<(String, String)> = fake.env();
    vars.push(("FLOTILLA_CLAUDE_BIN".into(), bin));
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let out = env.flotilla_with_env(
        &[
            "bench",
            "continue",
            "--turns",
            "2",
            "--after",
            "1",
            "--stall-ms",
            "1500",
            "--json",
        ],
        &vars,
    );
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    let row = &r["rows"][0];
    assert_eq!(row["turns"], 2, "{r}");
    // Continued: the call after the stall and the one left; over: all four again.
    assert_eq!(row["continued"]["model_calls"], 2, "{r}");
    assert_eq!(row["fresh"]["model_calls"], 4, "{r}");
    for ratio in ["cost_ratio", "uncached_ratio"] {
        let x = row[ratio].as_f64().unwrap();
        assert!(x > 0.0 && x < 1.0, "{ratio}: {r}");
    }
}

/// Makes `dir` a git repository with one commit.

#[test]
fn worktree_agents_work_in_their_own_checkout_which_is_kept_only_when_changed() {
    let env = Env::new();
    flotilla_tests::git_repo(&env.workspace());
    let fake = FakeAnthropic::start();
    let (code, r) = run(
        &env,
        &fake,
        "return await parallel([\n\
           () => agent('edit [[bash:touch edited.txt && pwd]]', { isolation: 'worktree', tools: ['Bash'], label: 'edit' }),\n\
           () => agent('look only', { isolation: 'worktree', label: 'look' }),\n\
         ]);",
    );
    assert_eq!(code, 0, "{r}");
    let run_id = r["run_id"].as_str().unwrap();
    let ws = env.workspace().canonicalize().unwrap();
    let worktrees = ws.join(".git/flotilla/worktrees").join(run_id);
    let edit_dir = worktrees.join("0");
    // The agent's shell ran inside its worktree, and the file stayed there.
    assert_eq!(
        r["result"][0],
        format!("tool said: {}", edit_dir.display()),
        "{r}"
    );
    assert!(edit_dir.join("edited.txt").exists());
    assert!(edit_dir.join("README").exists(), "a full checkout");
    assert!(
        !ws.join("edited.txt").exists(),
        "the main checkout is untouched"
    );
    // The unchanged worktree and its branch are gone; the changed one's branch stays; the
    // user's tree shows nothing of either.
    assert!(!worktrees.join("1").exists());
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(&ws)
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let branches = git(&["branch", "--list", "flotilla/*"]);
    assert!(
        branches.contains(&format!("flotilla/{run_id}/0")),
        "{branches}"
    );
    assert!(
        !branches.contains(&format!("flotilla/{run_id}/1")),
        "{branches}"
    );
    assert_eq!(
        git(&["status", "--porcelain"]),
        "",
        "nothing is left in the tree"
    );
    // Each agent was told it works in an isolated copy.
    let told = fake
        .requests()
        .iter()
        .filter(|s| s.body.to_string().contains("isolated git worktree"))
        .count();
    assert!(told >= 2, "{told} requests mention the worktree");
}

#[test]
fn outside_a_repository_a_worktree_agent_fails_with_the_reason_and_leaves_nothing() {
    let env = Env::new();
    std::fs::create_dir_all(env.workspace()).unwrap();
    let fake = FakeAnthropic::start();
    let (code, r) = run(
        &env,
        &fake,
        "try { await agent('where [[bash:pwd]]', { isolation: 'worktree', tools: ['Bash'] }); return 'ran'; } catch (e) { return [e.code, e.message]; }",
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"][0], "INVALID_AGENT", "{r}");
    let why = r["result"][1].as_str().unwrap();
    assert!(why.contains("needs a git repository"), "{why}");
    assert_eq!(
        std::fs::read_dir(env.workspace()).unwrap().count(),
        0,
        "no stray directories"
    );
    assert!(
        fake.requests()
            .iter()
            .all(|s| !s.body.to_string().contains("where")),
        "no agent started"
    );
}

#[test]
fn a_custom_agent_type_runs_with_its_definition() {
    let env = Env::new();
    env.file(
        ".claude/agents/reviewer.md",
        "---\nname: reviewer\ndescription: Reviews code for one team\n---\nYou are the RVW-7 reviewer. Be terse.\n",
    );
    let fake = FakeAnthropic::start();
    // The agents work outside the directory that holds the definition, so the CLI can only
    // know it from what the worker passes.
    let elsewhere = tempfile::tempdir().unwrap();
    let (code, r) = run_with(
        &env,
        &fake,
        "return await agent('review this', { agentType: 'reviewer' });",
        &["--workspace", elsewhere.path().to_str().unwrap()],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "fake reply to: review this", "{r}");
    let main: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|s| s.body.to_string().contains("review this"))
        .collect();
    assert!(!main.is_empty());
    let system = main[0].body["system"].to_string();
    assert!(
        system.contains("You are the RVW-7 reviewer"),
        "the custom type's prompt is the agent's system prompt: {system}"
    );
}

/// The real CLI's tool calls become `execute_tool {name}` spans under its attempt's worker
/// span (GenAI conventions), and the attempt's `invoke_agent` span says the provider and the
/// tokens, in a trace exported to an OTLP receiver.
#[test]
fn the_real_cli_s_tool_calls_are_execute_tool_spans_in_the_run_s_trace() {
    let receiver = flotilla_tests::otlp::Receiver::start();
    let fake = FakeAnthropic::start();
    let mut env = fake.env();
    env.push((
        "FLOTILLA_CLAUDE_BIN".into(),
        claude_bin().to_str().unwrap().to_owned(),
    ));
    env.push(("OTEL_EXPORTER_OTLP_ENDPOINT".into(), receiver.endpoint()));
    env.push(("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()));
    let c = flotilla_tests::cluster::Cluster::start_configured_env(
        1,
        2,
        &[],
        &["--backend", "claude-code"],
        env,
    );
    let run = c.launch(
        "tool-trace",
        "return await agent('run it [[bash:echo traced-tool]]', { tools: ['Bash'], label: 'tooly' });",
        &["--stagger", "0", "--backend", "claude-code"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "tool said: traced-tool", "{r}");
    let spans = receiver.spans_of_run(&run, |spans| {
        spans.iter().any(|s| s.name.starts_with("execute_tool"))
            && spans.iter().any(|s| s.name == "invoke_agent tooly")
    });
    let named = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span: {spans:?}"))
    };
    let (attempt, worker_span, tool) = (
        named("invoke_agent tooly"),
        named("attempt.run"),
        named("execute_tool Bash"),
    );
    assert_eq!(tool.parent_span_id, worker_span.span_id);
    assert_eq!(tool.name, "execute_tool Bash");
    assert_eq!(tool.trace_id, worker_span.trace_id);
    assert_eq!(tool.attributes["gen_ai.operation.name"], "execute_tool");
    assert_eq!(tool.attributes["gen_ai.tool.name"], "Bash");
    assert!(
        tool.attributes["gen_ai.tool.call.id"].starts_with("toolu_"),
        "{tool:?}"
    );
    assert_eq!(tool.attributes["flotilla.outcome"], "ok", "{tool:?}");
    assert_eq!(worker_span.parent_span_id, attempt.span_id);
    assert_eq!(attempt.attributes["gen_ai.provider.name"], "anthropic");
    assert_eq!(
        attempt.attributes["gen_ai.response.model"], "claude-opus-5-5",
        "{attempt:?}"
    );
    let tokens: u64 = [
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.cache_read.input_tokens",
        "gen_ai.usage.cache_creation.input_tokens",
    ]
    .iter()
    .map(|k| attempt.attributes[*k].parse::<u64>().unwrap())
    .sum();
    assert!(tokens > 0, "{attempt:?}");
}
