//! The exec backend: a command per agent call.

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
        json!(["hello from stdin|opus|low|0", "two|||1"]),
        "per-call working directories"
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
