//! The exec backend: a command per agent call.

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::{Env, agent, usage};
use serde_json::json;

#[test]
fn prompt_on_stdin_options_in_env_stdout_is_the_result() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return [await agent('hello from stdin', { model: 'opus', effort: 'low', label: 'x' }), await agent('two')];",
        &["--backend", "exec", "--exec-cmd", "printf '%s|%s|%s|%s' \"$(cat)\" \"$FLOTILLA_MODEL\" \"$FLOTILLA_EFFORT\" \"$(basename \"$PWD\")\""],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!(["hello from stdin|opus|low|workspace", "two|||workspace"]),
        "embedded agents work in the run's workspace, as Claude Code's work in its directory"
    );
}

#[test]
fn schema_results_are_parsed_and_validated_and_failures_classified() {
    let env = Env::new();
    let schema = "{ type: 'object', properties: { n: { type: 'integer' } }, required: ['n'] }";
    let (code, r) = env.run_body(
        &format!(
            "const out = [];\n\
             out.push(await agent('{{\"n\": 3}}', {{ schema: {schema} }}));\n\
             try {{ await agent('{{\"n\": \"x\"}}', {{ schema: {schema} }}); }} catch (e) {{ out.push(e.code); }}\n\
             try {{ await agent('not json', {{ schema: {schema} }}); }} catch (e) {{ out.push(e.code); }}\n\
             out.push(await agent('exit 3', {{ label: 'bad exit' }}));\n\
             return out;"
        ),
        &["--backend", "exec", "--exec-cmd", "p=$(cat); case \"$p\" in 'exit 3') echo oops >&2; exit 3;; *) printf '%s\\n' \"$p\";; esac"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!([{"n": 3}, "SCHEMA_FAILED", "SCHEMA_FAILED", null])
    );
    let bad = agent(&r, "bad exit");
    assert!(
        bad["error"].as_str().unwrap().contains("status 3: oops"),
        "{bad}"
    );
    assert_eq!(usage(&r, "errors"), 3);
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.split_whitespace().nth(2) == Some("Z"))
            .unwrap_or(true)
}

/// Every pid listed (one per line) in `file` is gone.
fn assert_all_dead(file: &std::path::Path, after: &str) {
    for pid in std::fs::read_to_string(file).unwrap().lines() {
        assert!(
            !alive(pid.trim().parse().unwrap()),
            "process {pid} outlived {after}"
        );
    }
}

#[test]
fn a_stalled_command_and_everything_it_started_are_killed() {
    let env = Env::new();
    let pids = env.path().join("pids");
    std::fs::create_dir_all(&pids).unwrap();
    let cmd = format!(
        "sleep 300 & echo $! >> {dir}/children; echo $$ >> {dir}/parents; if [ \"$FLOTILLA_ATTEMPT\" = 1 ]; then wait; fi; echo done",
        dir = pids.display()
    );
    let (code, r) = env.run_body(
        "return await agent('go', { label: 'g' });",
        &[
            "--backend",
            "exec",
            "--exec-cmd",
            &cmd,
            "--stall-timeout",
            "400ms",
        ],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "done");
    assert_eq!(agent(&r, "g")["attempts"], 2);
    let read = |f: &str| -> Vec<u32> {
        std::fs::read_to_string(pids.join(f))
            .unwrap()
            .lines()
            .map(|l| l.trim().parse().unwrap())
            .collect()
    };
    let all: Vec<u32> = read("children")
        .into_iter()
        .chain(read("parents"))
        .collect();
    assert_eq!(all.len(), 4);
    for pid in all {
        assert!(!alive(pid), "process {pid} survived its attempt");
    }
}

#[test]
fn ctrl_c_stops_the_run_and_kills_running_agents() {
    let env = Env::new();
    let pids = env.path().join("pids");
    std::fs::create_dir_all(&pids).unwrap();
    let cmd = format!(
        "sleep 300 & echo $! >> {dir}/children; wait",
        dir = pids.display()
    );
    let script = env.script(
        "stoppable",
        "return await parallel([() => agent('a'), () => agent('b')]);",
    );
    let child = std::process::Command::new(&env.bin)
        .args([
            "run",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--backend",
            "exec",
            "--exec-cmd",
            &cmd,
        ])
        .current_dir(env.path())
        .env("FLOTILLA_STORE", env.store_url())
        .env("FLOTILLA_WORKSPACE", env.workspace())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until both agents run.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let n = std::fs::read_to_string(pids.join("children"))
            .map(|s| s.lines().count())
            .unwrap_or(0);
        if n == 2 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "agents never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let status = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["status"], "stopped");
    assert!(
        r["agents"]
            .as_array()
            .unwrap()
            .iter()
            .all(|a| a["status"] == "cancelled"),
        "{r}"
    );
    assert_eq!(
        r["usage"]["errors"], 0,
        "stopping a run marks no agent failed (W55)"
    );
    assert_all_dead(&pids.join("children"), "the stop");
    // The stored run says so too.
    let shown = env
        .flotilla(&["show", r["run_id"].as_str().unwrap(), "--json"])
        .json();
    assert_eq!(shown["status"], "stopped");
}

#[test]
fn an_agent_timeout_kills_the_command_and_its_children() {
    let env = Env::new();
    let pids = env.path().join("pids");
    std::fs::create_dir_all(&pids).unwrap();
    let cmd = format!(
        "sleep 300 & echo $! >> {dir}/children; wait",
        dir = pids.display()
    );
    let (code, r) = env.run_body(
        "return await agent('slow', { label: 't', timeout: '300ms' });",
        &["--backend", "exec", "--exec-cmd", &cmd],
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"], serde_json::Value::Null);
    assert!(
        agent(&r, "t")["error"]
            .as_str()
            .unwrap()
            .contains("timed out after 300ms"),
        "{r}"
    );
    assert_all_dead(&pids.join("children"), "the timeout");
}
