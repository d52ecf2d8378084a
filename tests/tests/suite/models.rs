//! Model policy (issue 18, W18): the allowed models substitute what an agent asks for, with a
//! warning naming both; the `anthropic` backend resolves Claude Code's aliases to model ids;
//! a coordinator's policy bounds every run launched there.

use flotilla_tests::Env;
use flotilla_tests::fake_anthropic::FakeAnthropic;
use serde_json::Value;

fn agent<'a>(r: &'a Value, label: &str) -> &'a Value {
    r["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["label"] == label)
        .unwrap_or_else(|| panic!("no agent {label}: {r}"))
}

const BODY: &str = "await agent('a', { label: 'opus', model: 'opus' });\n\
                    await agent('b', { label: 'id', model: 'claude-sonnet-4-5' });\n\
                    await agent('c', { label: 'haiku', model: 'haiku' });\n\
                    await agent('d', { label: 'opus again', model: 'opus' });\n\
                    return null;";

#[test]
fn an_agent_asking_for_a_model_outside_the_allowed_ones_runs_on_a_substitute_with_a_warning() {
    let env = Env::new();
    let s = env.script("models", BODY);
    let out = env.flotilla(&[
        "run",
        s.to_str().unwrap(),
        "--json",
        "--backend",
        "echo",
        "--allowed-models",
        "sonnet",
    ]);
    let r = out.json();
    assert_eq!(out.code, 0, "{r}");
    let model = |l: &str| agent(&r, l)["model"].as_str().unwrap().to_owned();
    // No run model: the first allowed one. An id of an allowed family is allowed.
    assert_eq!(
        [
            model("opus"),
            model("id"),
            model("haiku"),
            model("opus again")
        ],
        ["sonnet", "claude-sonnet-4-5", "sonnet", "sonnet"]
    );
    let warnings = r["warnings"].to_string();
    assert!(
        warnings.contains("2 agents asked for \\\"opus\\\"")
            && warnings.contains("1 agent asked for \\\"haiku\\\"")
            && warnings.contains("(sonnet)"),
        "{warnings}"
    );
    let logs = r["logs"].to_string();
    assert_eq!(logs.matches("[model]").count(), 2, "once per pair: {logs}");

    // The run's model, when it is allowed, is the substitute; CLAUDE_CODE_SUBAGENT_MODEL
    // names the run's model as Claude Code's does.
    let out = env.flotilla_with_env(
        &[
            "run",
            s.to_str().unwrap(),
            "--json",
            "--backend",
            "echo",
            "--allowed-models",
            "sonnet,haiku",
        ],
        &[("CLAUDE_CODE_SUBAGENT_MODEL", "haiku")],
    );
    let r = out.json();
    assert_eq!(out.code, 0, "{r}");
    assert_eq!(agent(&r, "opus")["model"], "haiku", "{r}");
    assert_eq!(agent(&r, "haiku")["model"], "haiku", "allowed as asked");
    // Without an allowlist, every agent runs on what it asked for.
    let out = env.flotilla(&["run", s.to_str().unwrap(), "--json", "--backend", "echo"]);
    let r = out.json();
    assert_eq!(agent(&r, "opus")["model"], "opus", "{r}");
    assert!(!r["warnings"].to_string().contains("substituted"), "{r}");
}

#[test]
fn the_anthropic_backend_resolves_claude_code_s_aliases_to_model_ids() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let body = "await agent('o', { model: 'opus' });\n\
                await agent('s', { model: 'sonnet[1m]' });\n\
                await agent('h', { model: 'haiku' });\n\
                await agent('i', { model: 'claude-3-7-sonnet-latest' });\n\
                return null;";
    let (code, r) = fake.run(
        &env,
        "anthropic",
        body,
        &["--stagger", "0", "--concurrency", "1"],
        &[("ANTHROPIC_DEFAULT_HAIKU_MODEL", "my-haiku-deployment")],
    );
    assert_eq!(code, 0, "{r}");
    let sent: Vec<(String, Option<String>)> = fake
        .requests()
        .into_iter()
        .filter(|s| s.path.starts_with("/v1/messages"))
        .map(|s| {
            let beta = s
                .headers
                .iter()
                .find(|(k, _)| k == "anthropic-beta")
                .map(|(_, v)| v.clone());
            (s.body["model"].as_str().unwrap_or("").to_owned(), beta)
        })
        .collect();
    assert_eq!(
        sent,
        vec![
            ("claude-opus-4-1".to_owned(), None),
            (
                "claude-sonnet-4-5".to_owned(),
                Some("context-1m-2025-08-07".to_owned())
            ),
            ("my-haiku-deployment".to_owned(), None),
            ("claude-3-7-sonnet-latest".to_owned(), None),
        ]
    );
    // The report names the model each agent really ran on: the id its alias resolved to.
    let ran: Vec<&str> = r["agents"]
        .as_array()
        .expect("agents")
        .iter()
        .map(|a| a["model"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        ran,
        [
            "claude-opus-4-1",
            "claude-sonnet-4-5",
            "my-haiku-deployment",
            "claude-3-7-sonnet-latest"
        ],
        "{r}"
    );
}
