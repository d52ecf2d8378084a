//! Workflows as assets (W44–W48, W62–W67): saved and bundled workflows, the launch plan and
//! approval prompt, the disable switch, `meta` defaults, and server-side saved workflows.

use std::process::{Command, Stdio};

use flotilla_tests::Env;
use flotilla_tests::cluster::Cluster;
use serde_json::{Value, json};

fn wf(name: &str, description: &str, body: &str) -> String {
    format!(
        "export const meta = {{ name: '{name}', description: '{description}', whenToUse: 'when testing' }};\n{body}\n"
    )
}

/// An environment that is a repository root (so the project search stops there).
fn project() -> Env {
    let env = Env::new();
    std::fs::create_dir_all(env.path().join(".git")).unwrap();
    env
}

fn listed(env: &Env, vars: &[(&str, &str)]) -> Vec<Value> {
    let out = env.flotilla_with_env(&["workflows", "list", "--json"], vars);
    assert_eq!(out.code, 0, "{out:?}");
    out.json().as_array().unwrap().clone()
}

#[test]
fn the_list_shows_project_personal_and_bundled_workflows_with_precedence() {
    let env = project();
    env.file(
        ".flotilla/workflows/triage.js",
        &wf("triage", "project triage", "return 'project';"),
    );
    env.file(
        ".config/flotilla/workflows/triage.js",
        &wf("triage", "personal triage", "return 'personal';"),
    );
    env.file(
        ".claude/workflows/mine.js",
        &wf("mine", "a Claude Code workflow", "return 'claude';"),
    );
    env.file(
        ".claude/workflows/deep-research.js",
        &wf("deep-research", "my own deep research", "return 'mine';"),
    );
    env.file(
        ".claude/workflows/broken.js",
        "const n = 'x';\nexport const meta = { name: n, description: 'd' };\nreturn 1;\n",
    );
    let rows = listed(&env, &[]);
    let find = |name: &str, origin: &str| {
        rows.iter()
            .find(|r| r["name"] == name && r["origin"] == origin)
            .unwrap_or_else(|| panic!("{name} ({origin}) missing from {rows:#?}"))
            .clone()
    };
    assert_eq!(find("triage", "project")["description"], "project triage");
    assert!(find("triage", "project").get("shadowedBy").is_none());
    assert!(
        find("triage", "personal")["shadowedBy"]
            .as_str()
            .unwrap()
            .contains(".flotilla/workflows/triage.js")
    );
    assert_eq!(find("mine", "project")["whenToUse"], "when testing");
    for bundled in ["deep-research", "code-review", "reflect", "ingest", "lint"] {
        assert_eq!(find(bundled, "bundled")["offered"], true);
    }
    assert!(find("deep-research", "bundled")["shadowedBy"].is_string());
    let broken = rows.iter().find(|r| r["offered"] == false).unwrap();
    assert!(broken["location"].as_str().unwrap().ends_with("broken.js"));
    assert!(!broken["error"].as_str().unwrap().is_empty(), "{broken}");

    // The closest one runs, by name and by `/name`.
    for name in ["triage", "/triage"] {
        let out = env.flotilla(&["run", name, "--json"]);
        assert_eq!(out.code, 0, "{out:?}");
        assert_eq!(out.json()["result"], "project");
    }
    let out = env.flotilla(&["run", "deep-research", "--json"]);
    assert_eq!(
        out.json()["result"],
        "mine",
        "a project workflow replaces a bundled one"
    );

    // Bundled ones can be hidden.
    let rows = listed(&env, &[("FLOTILLA_DISABLE_BUNDLED_WORKFLOWS", "1")]);
    assert!(rows.iter().all(|r| r["origin"] != "bundled"), "{rows:#?}");

    let shown = env.flotilla(&["workflows", "show", "mine"]);
    assert_eq!(shown.code, 0, "{shown:?}");
    assert!(shown.stdout.contains("return 'claude';"));
    let missing = env.flotilla(&["workflows", "show", "nope"]);
    assert_eq!(missing.code, 2);
    assert!(
        missing.stderr.contains("flotilla workflows list"),
        "{missing:?}"
    );
}

#[test]
fn saving_writes_the_project_directory_and_refuses_symbolic_links() {
    let env = project();
    let file = env.file("draft.js", &wf("release-notes", "d", "return 7;"));
    let out = env.flotilla(&["workflows", "save", file.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        env.path()
            .join(".flotilla/workflows/release-notes.js")
            .exists()
    );
    let out = env.flotilla(&["run", "release-notes", "--json"]);
    assert_eq!(out.json()["result"], 7);

    // A linked target file is refused, and what it points at is untouched.
    let victim = env.file("victim.txt", "keep me");
    let other = env.file("other.js", &wf("linked", "d", "return 1;"));
    std::os::unix::fs::symlink(&victim, env.path().join(".flotilla/workflows/linked.js")).unwrap();
    let out = env.flotilla(&["workflows", "save", other.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("symbolic link"), "{out:?}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");

    // So is a linked workflows directory.
    let env = project();
    let elsewhere = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), env.path().join(".flotilla")).unwrap();
    let file = env.file("draft.js", &wf("x", "d", "return 1;"));
    let out = env.flotilla(&["workflows", "save", file.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        std::fs::read_dir(elsewhere.path())
            .unwrap()
            .next()
            .is_none()
    );

    // Names cannot climb out, and a non-literal meta is not saved.
    let bad = env.file("bad.js", &wf("../up", "d", "return 1;"));
    let out = env.flotilla(&["workflows", "save", bad.to_str().unwrap(), "--personal"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("cannot name"), "{out:?}");
}

#[test]
fn the_plan_shows_phases_settings_and_size_and_runs_nothing() {
    let env = project();
    let out = env.flotilla(&[
        "run",
        "deep-research",
        "--plan",
        "--args",
        "\"why is the sky blue\"",
        "--concurrency",
        "3",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    for needle in [
        "Workflow deep-research:",
        "1. Scope",
        "5. Synthesize",
        "3 agents at once",
        "agent() call sites",
        "from      bundled:deep-research",
    ] {
        assert!(
            out.stdout.contains(needle),
            "{needle:?} missing:\n{}",
            out.stdout
        );
    }
    let runs = env.flotilla(&["runs", "--json"]);
    assert_eq!(runs.json(), json!([]), "nothing ran");
}

#[test]
fn meta_suggests_settings_that_flags_override() {
    let env = project();
    let script = env.file(
        "m.js",
        "export const meta = { name: 'm', description: 'd', budget: 500, concurrency: 3, somethingElse: [1] };\nreturn budget.total;\n",
    );
    let s = script.to_str().unwrap();
    let out = env.flotilla(&["run", s, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["result"], 500);
    let out = env.flotilla(&["run", s, "--json", "--budget", "9"]);
    assert_eq!(out.json()["result"], 9);
    let plan = env.flotilla(&["run", s, "--plan"]);
    assert!(plan.stdout.contains("3 agents at once"), "{plan:?}");
    let bad = env.file(
        "b.js",
        "export const meta = { name: 'b', description: 'd', concurrency: 'lots' };\nreturn 1;\n",
    );
    let out = env.flotilla(&["run", bad.to_str().unwrap(), "--json"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("meta.concurrency"), "{out:?}");
}

#[test]
fn the_disable_switch_refuses_new_runs() {
    let env = project();
    let script = env.script("t", "return 1;");
    let s = script.to_str().unwrap();
    for (var, value) in [
        ("FLOTILLA_DISABLE_WORKFLOWS", "1"),
        ("CLAUDE_CODE_DISABLE_WORKFLOWS", "1"),
    ] {
        let out = env.flotilla_with_env(&["run", s, "--json"], &[(var, value)]);
        assert_eq!(out.code, 2, "{out:?}");
        assert!(out.stderr.contains("workflows are disabled"), "{out:?}");
    }
    let config = env.file("flotilla.toml", "disable_workflows = true\n");
    let out = env.flotilla(&["run", s, "--config", config.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{out:?}");
    assert_eq!(env.flotilla(&["run", s, "--json"]).code, 0);
}

/// Runs `flotilla ARGS` on a pseudo-terminal (util-linux `script`), typing `input`.
fn on_a_terminal(env: &Env, args: &[&str], input: &str) -> (i32, String) {
    let mut line = env.bin.display().to_string();
    for a in args {
        line.push_str(&format!(" '{a}'"));
    }
    let mut child = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .current_dir(env.path())
        .env("FLOTILLA_STORE", env.store_url())
        .env("FLOTILLA_WORKSPACE", env.workspace())
        .env("HOME", env.path())
        .env_remove("XDG_CONFIG_HOME")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("util-linux `script` runs commands on a pseudo-terminal");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        // Give the prompt time to appear, then answer (a pty keeps what is typed early too).
        std::thread::sleep(std::time::Duration::from_millis(300));
        stdin.write_all(input.as_bytes()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn on_a_terminal_the_plan_is_confirmed_and_always_is_remembered() {
    let env = project();
    env.file(
        ".flotilla/workflows/greet.js",
        &wf("greet", "says hello", "return 'hello from greet';"),
    );
    let (code, out) = on_a_terminal(&env, &["run", "greet"], "n\n");
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("Workflow greet: says hello"), "{out}");
    assert!(out.contains("don't ask again for greet"), "{out}");
    assert!(out.contains("not run"), "{out}");
    assert!(!out.contains("hello from greet"), "{out}");

    let (code, out) = on_a_terminal(&env, &["run", "greet"], "v\ny\n");
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("return 'hello from greet';"),
        "the script was shown: {out}"
    );
    assert!(out.contains("hello from greet"), "{out}");

    let (code, out) = on_a_terminal(&env, &["run", "greet"], "a\n");
    assert_eq!(code, 0, "{out}");
    let kept = std::fs::read_to_string(env.path().join(".config/flotilla/approvals.json")).unwrap();
    assert!(kept.contains("greet"), "{kept}");
    // Not asked again: no answer is given, and it runs.
    let (code, out) = on_a_terminal(&env, &["run", "greet"], "");
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("Run it?"), "{out}");
    assert!(out.contains("hello from greet"), "{out}");

    // --yes never asks; an inline script is never remembered.
    let script = env.script("inline", "return 'inline ran';");
    let (code, out) = on_a_terminal(&env, &["run", script.to_str().unwrap(), "--yes"], "");
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("Run it?"), "{out}");
    let (_, out) = on_a_terminal(&env, &["run", script.to_str().unwrap()], "n\n");
    assert!(!out.contains("don't ask again"), "{out}");
}

#[test]
fn pushed_workflows_launch_by_name_and_a_saved_only_coordinator_refuses_scripts() {
    let c = Cluster::start_coordinator_with(1, 4, &["--saved-only", "--publisher", "client"]);
    let file = c.path().join("triage.js");
    std::fs::write(
        &file,
        wf(
            "triage",
            "pushed",
            "const r = await parallel((args || []).map(x => () => agent('triage ' + x)));\nreturn r;",
        ),
    )
    .unwrap();
    let out = c.client(&["workflows", "push", file.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("saved triage"), "{out:?}");

    let listed = c.client(&["workflows", "list", "--json"]);
    assert_eq!(listed.code, 0, "{listed:?}");
    assert!(
        listed
            .json()
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["name"] == "triage" && r["origin"] == "server"),
        "{}",
        listed.stdout
    );

    // Launched by name from a directory that has no copy of it.
    let out = c.client(&["launch", "triage", "--json", "--args", "[1, 2]"]);
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!(["triage 1", "triage 2"]));

    // Nested workflow() calls reach pushed workflows only, never ones the client carries.
    std::fs::create_dir_all(c.path().join(".flotilla/workflows")).unwrap();
    std::fs::write(
        c.path().join(".flotilla/workflows/sneaky.js"),
        wf("sneaky", "not pushed", "return 'ran unpushed code';"),
    )
    .unwrap();
    let outer = c.path().join("outer.js");
    std::fs::write(
        &outer,
        wf(
            "outer",
            "calls another",
            "let got; try { got = await workflow('sneaky'); } catch (e) { got = 'refused'; }
return got;",
        ),
    )
    .unwrap();
    assert_eq!(
        c.client(&["workflows", "push", outer.to_str().unwrap()])
            .code,
        0
    );
    let out = c.client(&["launch", "outer", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let (code, r) = c.wait(out.json()["run_id"].as_str().unwrap());
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "refused", "{r}");

    // A bundled one runs by name too; an inline script is refused with the fix.
    let out = c.client(&["launch", "lint", "--json", "--args", "\"wiki\""]);
    assert_eq!(out.code, 0, "{out:?}");
    let refused = c.client(&["launch", file.to_str().unwrap(), "--json"]);
    assert_ne!(refused.code, 0, "{refused:?}");
    assert!(
        refused.stderr.contains("saved workflows only"),
        "{refused:?}"
    );
    assert!(
        refused.stderr.contains("flotilla workflows push"),
        "{refused:?}"
    );

    // A broken script is not pushed.
    std::fs::write(&file, "export const meta = { name: n, description: 'd' };").unwrap();
    let out = c.client(&["workflows", "push", file.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("literal"), "{out:?}");
}

#[test]
fn a_coordinator_disabled_in_its_config_refuses_new_runs_while_running_ones_finish() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("coordinator.toml");
    std::fs::write(&config, "").unwrap();
    let c = Cluster::start_coordinator_with(1, 4, &["--config", config.to_str().unwrap()]);
    let running = c.launch("long", "return await agent('slow [[sleep:1500]]');", &[]);
    std::fs::write(&config, "disable_workflows = true\n").unwrap();
    let script = c.path().join("long.js");
    let refused = c.client(&["launch", script.to_str().unwrap(), "--json"]);
    assert_ne!(refused.code, 0, "{refused:?}");
    assert!(
        refused.stderr.contains("workflows are disabled"),
        "{refused:?}"
    );
    let (code, r) = c.wait(&running);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "slow [[sleep:1500]]");
    std::fs::write(&config, "disable_workflows = false\n").unwrap();
    let out = c.client(&["launch", script.to_str().unwrap(), "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
}

#[test]
fn a_saved_claude_code_workflow_runs_by_name_on_the_fleet_and_resolves_its_children() {
    let c = Cluster::start(1, 4);
    std::fs::create_dir_all(c.path().join(".git")).unwrap();
    let dir = c.path().join(".claude/workflows");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("outer.js"),
        wf(
            "outer",
            "calls a sibling",
            "const inner = await workflow('inner', { n: 2 });\nreturn { inner, own: await agent('outer agent') };",
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("inner.js"),
        wf(
            "inner",
            "the sibling",
            "return await agent('inner ' + args.n);",
        ),
    )
    .unwrap();
    let out = c.client(&["launch", "/outer", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({"inner": "inner 2", "own": "outer agent"})
    );
    assert_eq!(r["workflow"]["name"], "outer");
}

/// Makes a marketplace on disk with one plugin (an agent, a workflow) and installs it with the
/// real CLI, in `env`'s home.
fn install_plugin(env: &Env) {
    // A marketplace on disk with one plugin, installed the way a user does it.
    env.file(
        "mkt/.claude-plugin/marketplace.json",
        &json!({ "name": "local-mkt", "owner": { "name": "t" },
                 "plugins": [{ "name": "ravenclaude-core", "source": "./plugins/ravenclaude-core", "description": "core" }] })
            .to_string(),
    );
    env.file(
        "mkt/plugins/ravenclaude-core/.claude-plugin/plugin.json",
        r#"{"name":"ravenclaude-core","version":"1.0.0","description":"core"}"#,
    );
    env.file(
        "mkt/plugins/ravenclaude-core/agents/architect.md",
        "---\nname: architect\ndescription: designs things\n---\nYou design.\n",
    );
    env.file(
        "mkt/plugins/ravenclaude-core/workflows/triage.js",
        &wf(
            "triage",
            "triage from a plugin",
            "return 'triaged ' + args.n;",
        ),
    );
    claude_plugin(
        env.path(),
        &[
            "marketplace",
            "add",
            env.path().join("mkt").to_str().unwrap(),
        ],
    );
    claude_plugin(env.path(), &["install", "ravenclaude-core@local-mkt"]);
}

/// `claude plugin …` (the pinned CLI), with the environment's home as the user's.
fn claude_plugin(home: &std::path::Path, args: &[&str]) {
    let mut cmd = Command::new(super::claude::claude_bin());
    cmd.arg("plugin")
        .args(args)
        .current_dir(home)
        .env("HOME", home)
        .env_remove("CLAUDE_CONFIG_DIR")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .stdin(Stdio::null());
    let out = flotilla_tests::run_with_timeout(cmd, std::time::Duration::from_secs(120));
    assert_eq!(out.code, 0, "claude plugin {args:?}: {out:?}");
}

#[test]
fn a_plugin_installed_by_claude_gives_its_agent_types_and_workflows_by_its_name() {
    let env = Env::new();
    install_plugin(&env);
    let (code, r) = env.run_body(
        "return await agent('plan it', { agentType: 'ravenclaude-core:architect', label: 'a' });",
        &["--backend", "echo"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["status"], "completed", "{r}");
    let (code, r) = env.run_body(
        "return await agent('plan it', { agentType: 'ravenclaude-core:nope' });",
        &["--backend", "echo"],
    );
    assert_ne!(code, 0, "{r}");
    let shown = r.to_string();
    assert!(
        shown.contains("unknown agentType") && shown.contains("ravenclaude-core:architect"),
        "{r}"
    );
    // Its workflow runs by `plugin:name`, and is listed.
    let out = env.flotilla(&[
        "run",
        "ravenclaude-core:triage",
        "--args",
        r#"{"n":7}"#,
        "--json",
        "--backend",
        "echo",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["result"], "triaged 7");
    let rows = listed(&env, &[]);
    assert!(
        rows.iter()
            .any(|w| w["name"] == "ravenclaude-core:triage" && w["origin"] == "plugin"),
        "{rows:?}"
    );
    // Disabled, it is gone.
    claude_plugin(env.path(), &["disable", "ravenclaude-core@local-mkt"]);
    let out = env.flotilla(&[
        "run",
        "ravenclaude-core:triage",
        "--json",
        "--backend",
        "echo",
    ]);
    assert_eq!(out.code, 2, "{out:?}");
}

#[test]
fn a_plugin_s_agent_type_and_workflow_resolve_on_the_fleet() {
    let c = Cluster::start(1, 4);
    let home = Env::new();
    install_plugin(&home);
    std::fs::create_dir_all(c.path().join(".git")).unwrap();
    let script = c.path().join("uses-plugin.js");
    std::fs::write(
        &script,
        wf(
            "uses-plugin",
            "an agent and a workflow of a plugin",
            "const t = await workflow('ravenclaude-core:triage', { n: 3 });\nreturn { t, a: await agent('design', { agentType: 'ravenclaude-core:architect' }) };",
        ),
    )
    .unwrap();
    let mut cmd = Command::new(&c.bin);
    cmd.args([
        "launch",
        script.to_str().unwrap(),
        "--json",
        "--backend",
        "echo",
    ])
    .args(["--coordinator", &c.url(), "--name", "client", "--tls-dir"])
    .arg(c.pki())
    .current_dir(c.path())
    .env("HOME", home.path())
    .env_remove("CLAUDE_CONFIG_DIR")
    .env("AWS_EC2_METADATA_DISABLED", "true");
    let out = flotilla_tests::run_with_timeout(cmd, std::time::Duration::from_secs(60));
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({ "t": "triaged 3", "a": "design" }),
        "{r}"
    );
    // A launch the coordinator refuses is one JSON object too (its rejected report).
    std::fs::write(&script, "export const meta = { name: 7 };\nreturn 1;\n").unwrap();
    let out = c.client(&[
        "launch",
        script.to_str().unwrap(),
        "--json",
        "--backend",
        "echo",
    ]);
    assert_eq!(out.code, 2, "{out:?}");
    assert_eq!(out.json()["status"], "rejected", "{out:?}");
}
