//! W11–W24: agent() results, schemas, labels, phases, options, nulls and rejections.

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::{Env, agent, agents, usage};
use serde_json::json;

const SCHEMA: &str = "{ type: 'object', properties: { files: { type: 'array', items: { type: 'string' } }, echo: { type: 'string' }, n: { type: 'integer', minimum: 3 }, ok: { type: 'boolean' } }, required: ['files'] }";

#[test]
fn w12_text_result_is_the_final_text_and_usage_counts_characters() {
    let env = Env::new();
    let (code, r) = env.run_body("return await agent('héllo [[sleep:10]]');", &[]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "héllo [[sleep:10]]");
    assert_eq!(usage(&r, "input_tokens"), 18);
    assert_eq!(usage(&r, "output_tokens"), 18);
    assert_eq!(usage(&r, "agents"), 1);
    assert_eq!(usage(&r, "dispatched"), 1);
    assert_eq!(usage(&r, "attempts"), 1);
}

#[test]
fn w13_schema_result_is_the_validated_object() {
    let env = Env::new();
    let (code, r) = env.run_body(
        &format!("return await agent('find', {{ schema: {SCHEMA} }});"),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let expected = json!({"files": ["files[0]", "files[1]"], "echo": "find", "n": 3, "ok": false});
    assert_eq!(r["result"], expected);
    assert_eq!(
        usage(&r, "output_tokens"),
        expected.to_string().chars().count() as u64
    );
}

#[test]
fn w14_invalid_submissions_retry_then_reject_with_the_last_failure() {
    let env = Env::new();
    // Four invalid submissions, the fifth is valid: success within one attempt.
    let (code, r) = env.run_body(
        &format!("return await agent('x [[invalid:4]]', {{ schema: {SCHEMA} }});"),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"]["files"], json!(["files[0]", "files[1]"]));
    assert_eq!(
        usage(&r, "attempts"),
        1,
        "resubmissions stay inside one session"
    );
    // Never valid: the call rejects; awaited directly and uncaught, the run fails.
    let (code, r) = env.run_body(
        &format!("return await agent('x [[invalid]]', {{ schema: {SCHEMA} }});"),
        &[],
    );
    assert_eq!(code, 1, "{r}");
    let e = r["error"].as_str().unwrap();
    assert!(e.contains("retry cap (5)") && e.contains("files"), "{e}");
    assert_eq!(agents(&r)[0]["status"], "failed");
    // The limit is a run setting.
    let (code, r) = env.run_body(
        &format!("try {{ await agent('x [[invalid:2]]', {{ schema: {SCHEMA} }}); return 'ok'; }} catch (e) {{ return e.code + ': ' + e.message; }}"),
        &["--schema-attempts", "2"],
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED);
    let msg = r["result"].as_str().unwrap();
    assert!(
        msg.starts_with("SCHEMA_FAILED") && msg.contains("retry cap (2)"),
        "{msg}"
    );
}

#[test]
fn w15_contradictory_or_invalid_schema_rejects_before_any_agent_starts() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const bad = { type: 'object', properties: { a: { type: 'string' } }, required: ['a', 'b'], additionalProperties: false };\n\
         const out = [];\n\
         try { await agent('x', { schema: bad }); } catch (e) { out.push(e.message); }\n\
         try { await agent('y', { schema: { type: 'object', properties: { a: { type: 'strnig' } } } }); } catch (e) { out.push(e.message); }\n\
         return out;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let out = r["result"].as_array().unwrap();
    assert!(out[0].as_str().unwrap().contains("'b' is required"), "{r}");
    assert!(
        out[1].as_str().unwrap().contains("not valid JSON Schema"),
        "{r}"
    );
    assert_eq!(usage(&r, "attempts"), 0, "no subagent started");
    assert_eq!(usage(&r, "dispatched"), 0);
}

#[test]
fn w16_w17_labels_and_phase_groups() {
    let env = Env::new();
    let long = "word ".repeat(30);
    let (code, r) = env.run_body(
        &format!(
            "phase('Scan');\n\
             await agent('  spaced\\n\\n  prompt  ');\n\
             await agent('{long}');\n\
             await agent('x', {{ label: 'custom', phase: 'Other' }});\n\
             phase('Later');\n\
             await agent('y');\n\
             return null;"
        ),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let a = agents(&r);
    assert_eq!(a[0]["label"], "spaced prompt");
    assert_eq!(a[1]["label"].as_str().unwrap().chars().count(), 60);
    assert_eq!(a[0]["group"], "Scan");
    assert_eq!(agent(&r, "custom")["group"], "Other");
    assert_eq!(agent(&r, "y")["group"], "Later");
    let groups: Vec<_> = r["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["title"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(groups, vec!["Scan", "Other", "Later"]);
    assert_eq!(r["groups"][0]["agents"].as_array().unwrap().len(), 2);
}

#[test]
fn w19_w20_w22_options_checked_by_value_unknown_ones_ignored() {
    let env = Env::new();
    // `isolation: 'worktree'` needs a repository to branch from.
    flotilla_tests::git_repo(&env.workspace());
    let (code, r) = env.run_body(
        "const out = [];\n\
         out.push(await agent('a', { effort: 'high', model: 'opus', agentType: 'Explore', isolation: 'worktree', someFutureOption: { x: 1 }, cwd: 'sub', tools: ['Read'], timeout: '5m' }));\n\
         for (const bad of [{ effort: 'turbo' }, { isolation: 'remote' }, { isolation: 'vm' }, { tools: 'Read' }]) {\n\
           try { await agent('b', bad); out.push('accepted'); } catch (e) { out.push(e.code); }\n\
         }\n\
         return out;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!([
            "a",
            "INVALID_OPTION",
            "INVALID_OPTION",
            "INVALID_OPTION",
            "INVALID_OPTION"
        ])
    );
    assert_eq!(agent(&r, "a")["model"], "opus");
}

#[test]
fn w23_terminal_error_resolves_null_with_a_failure_line_and_census_entry() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const a = await agent('boom [[fail]]', { label: 'boom' });\nconst b = await agent('fine');\nreturn [a, b];",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!([null, "fine"]));
    assert_eq!(usage(&r, "errors"), 1);
    let boom = agent(&r, "boom");
    assert_eq!(boom["status"], "failed");
    assert!(
        boom["error"]
            .as_str()
            .unwrap()
            .contains("terminal API error")
    );
    let failures = r["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 1);
    assert!(
        failures[0].as_str().unwrap().contains("boom"),
        "{failures:?}"
    );
}

#[test]
fn w24_uncaught_rejection_fails_the_run_and_non_string_prompt_rejects() {
    let env = Env::new();
    let (code, r) = env.run_body("await agent(42);\nreturn 1;", &[]);
    assert_eq!(code, 1);
    assert_eq!(r["status"], "failed");
    assert!(
        r["error"].as_str().unwrap().contains("prompt string"),
        "{r}"
    );
}

#[test]
fn w18_model_resolution_call_then_agent_type_then_run_then_forced() {
    let env = Env::new();
    env.file(
        ".claude/agents/reviewer.md",
        "---\nname: reviewer\nmodel: opus\ndescription: reviews\n---\nYou review.\n",
    );
    let s = env.script(
        "models",
        "await agent('a', { label: 'call', model: 'haiku', agentType: 'reviewer' });\n\
         await agent('b', { label: 'type', agentType: 'reviewer' });\n\
         await agent('c', { label: 'run' });\n\
         await agent('d', { label: 'inherit', model: 'inherit' });\n\
         return null;",
    );
    let model = |r: &serde_json::Value, l: &str| agent(r, l)["model"].as_str().unwrap().to_owned();
    let out = env.flotilla_with_env(
        &["run", s.to_str().unwrap(), "--json"],
        &[("CLAUDE_CODE_SUBAGENT_MODEL", "sonnet")],
    );
    let r = out.json();
    assert_eq!(out.code, 0, "{r}");
    assert_eq!(
        [
            model(&r, "call"),
            model(&r, "type"),
            model(&r, "run"),
            model(&r, "inherit")
        ],
        ["haiku", "opus", "sonnet", "sonnet"]
    );
    let out = env.flotilla_with_env(
        &["run", s.to_str().unwrap(), "--json", "--model", "fable"],
        &[("CLAUDE_CODE_SUBAGENT_MODEL_FORCE", "1")],
    );
    let r = out.json();
    for l in ["call", "type", "run", "inherit"] {
        assert_eq!(model(&r, l), "fable", "forced: {r}");
    }
    // An unknown type lists the known ones, custom ones included.
    let (code, r) = env.run_body(
        "try { await agent('x', { agentType: 'nope' }); } catch (e) { return e.message; }",
        &[],
    );
    assert_eq!(code, 0);
    let m = r["result"].as_str().unwrap();
    assert!(
        m.contains("\"nope\"") && m.contains("general-purpose") && m.contains("reviewer"),
        "{m}"
    );
}

#[test]
fn a_saved_workflow_runs_by_name() {
    let env = Env::new();
    env.file(
        ".flotilla/workflows/greet.js",
        "export const meta = { name: 'greet', description: 'says hi' };\nreturn await agent('hi ' + args.who);\n",
    );
    let out = env.flotilla(&["run", "greet", "--json", "--args", "{\"who\":\"you\"}"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.json()["result"], "hi you");
    let out = env.flotilla(&["run", "no-such-workflow", "--json"]);
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.contains("unknown workflow \"no-such-workflow\""),
        "{}",
        out.stderr
    );
}
