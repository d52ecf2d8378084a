//! Agents run sandboxed (issue 13): on a worker, an agent sees its checkout and its model,
//! nothing else of the worker. The hostile agent is a shell script run by the exec backend,
//! and the real `claude` CLI's Bash tool. Runs one at a time with the other cluster tests.

use std::io::{Read, Write};

use flotilla_tests::cluster::Cluster;
use flotilla_tests::commit_all;

fn repo(dir: &std::path::Path) {
    flotilla_tests::git_repo(dir);
    std::fs::write(dir.join("code.txt"), "code\n").unwrap();
    commit_all(dir, "code");
}

/// A shell function that reports `REACHED name` when `cmd` succeeds and `blocked name` when
/// it fails.
const TRY: &str = "try() { if sh -c \"$2\" >/dev/null 2>&1; then echo \"REACHED $1\"; else echo \"blocked $1\"; fi; }; ";

#[test]
fn an_agent_in_the_sandbox_reaches_nothing_of_the_worker() {
    let secret = "sk-worker-secret-7d1c0e";
    let mut c = Cluster::start_workers_with(
        1,
        4,
        &["--backend", "exec", "--exec-cmd", "sh"],
        vec![("ANTHROPIC_API_KEY".into(), secret.into())],
    );
    let log = std::fs::read_to_string(c.path().join("worker-0.log")).unwrap();
    assert!(
        log.contains("sandbox"),
        "the worker says how agents run: {log}"
    );
    let src = c.path().join("repo");
    repo(&src);
    let key = c.pki().join("worker-0.key");
    assert!(key.exists());
    let ws = c.path().join("ws-0");
    let port = c.worker_url().rsplit(':').next().unwrap().to_owned();
    let wpid = c.worker_pid(0);
    let outside = c.path().join("pwned");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("operator-notes.txt"), "not for agents\n").unwrap();
    let probes = [
        ("key", format!("cat {}", key.display())),
        ("key-via-proc", format!("cat /proc/1/root{}", key.display())),
        (
            "workspace-file",
            format!("cat {}", ws.join("operator-notes.txt").display()),
        ),
        (
            "other-checkout",
            format!("ls {}/$FLOTILLA_RUN_ID/0/code.txt", ws.display()),
        ),
        ("worker-environ", format!("cat /proc/{wpid}/environ")),
        ("env-secret", format!("env | grep {secret}")),
        (
            "coordinator-port",
            format!(
                "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2)'"
            ),
        ),
        (
            "write-cache",
            format!(
                "for c in {}/.flotilla/sources/*.git/config; do echo x >> $c || exit 1; done",
                ws.display()
            ),
        ),
        ("write-system", "echo x > /usr/pwned".to_owned()),
        ("signal-worker", format!("kill -0 {wpid}")),
        ("remount", "mount -o remount,rw /usr".to_owned()),
    ];
    let mut body = TRY.to_owned();
    for (name, cmd) in &probes {
        body.push_str(&format!("try {name} '{}'; ", cmd.replace('\'', "'\\''")));
    }
    // The sandbox's /tmp is its own: this lands there, never in the worker's.
    body.push_str(&format!(
        "mkdir -p {dir}; echo x > {out} 2>/dev/null; echo inside >> code.txt; echo done",
        dir = c.path().display(),
        out = outside.display()
    ));
    let script = c.path().join("hostile.js");
    std::fs::write(
        &script,
        format!(
            "export const meta = {{ name: 'hostile', description: 'tries to escape' }};\n\
             const [slow, probe] = await parallel([\n\
               () => agent('sleep 2; echo slow done', {{ label: 'slow' }}),\n\
               () => agent({}, {{ label: 'probe' }}),\n\
             ]);\n\
             return {{ slow, probe }};\n",
            serde_json::Value::String(body)
        ),
    )
    .unwrap();
    let out = c.client_in(
        &src,
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--backend",
            "exec",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let text = r["result"]["probe"]
        .as_str()
        .unwrap_or_else(|| panic!("{r}"));
    for (name, _) in &probes {
        assert!(
            text.contains(&format!("blocked {name}\n")),
            "{name} must be blocked: {text}"
        );
    }
    assert!(text.ends_with("done"), "{text}");
    assert_eq!(r["result"]["slow"], "slow done", "{r}");
    assert!(
        !outside.exists(),
        "nothing was written outside the checkout"
    );
    // Its own checkout is writable, and the edit comes home.
    assert_eq!(r["changes"]["merged"], 1, "{r}");
    // The worker is unaffected: the next run goes.
    let again = c.launch(
        "again",
        "return await agent('echo still here');",
        &["--backend", "exec"],
    );
    let (code, r) = c.wait(&again);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "still here", "{r}");
    c.signal_worker(0, "-0");
}

#[test]
fn the_real_claude_cli_cannot_read_the_worker_key_and_its_token_dies_with_the_attempt() {
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    let mut env = fake.env();
    env.push((
        "FLOTILLA_CLAUDE_BIN".into(),
        crate::claude::claude_bin().to_str().unwrap().to_owned(),
    ));
    let c = Cluster::start_workers_with(1, 2, &["--backend", "claude-code"], env);
    let src = c.path().join("repo");
    repo(&src);
    let key = c.pki().join("worker-0.key");
    let script = c.path().join("cat.js");
    std::fs::write(
        &script,
        format!(
            "export const meta = {{ name: 'cat', description: 'reads the key' }};\n\
             return await agent('read it [[bash:cat {} || echo refused; printenv ANTHROPIC_API_KEY > token.txt; echo kept]]', {{ tools: ['Bash'], label: 'cat' }});",
            key.display()
        ),
    )
    .unwrap();
    let out = c.client_in(
        &src,
        &[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--stagger",
            "0",
            "--backend",
            "claude-code",
        ],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let text = r["result"].as_str().unwrap_or_else(|| panic!("{r}"));
    assert!(text.contains("refused") && text.contains("kept"), "{text}");
    assert!(
        !text.contains("PRIVATE KEY"),
        "the key stayed outside: {text}"
    );
    // The CLI reached the model with a token of its attempt, not the worker's key.
    let applied = c.client_in(&src, &["apply", &run, "--merge"]);
    assert_eq!(applied.code, 0, "{applied:?}");
    let token = std::fs::read_to_string(src.join("token.txt")).unwrap();
    let token = token.trim();
    assert!(token.starts_with("flotilla-attempt-"), "{token}");
    // That token is dead now that the attempt ended.
    let log = std::fs::read_to_string(c.path().join("worker-0.log")).unwrap();
    let socket = log
        .lines()
        .find_map(|l| l.split("model API gateway on ").nth(1))
        .unwrap_or_else(|| panic!("the worker names its gateway: {log}"))
        .trim()
        .to_owned();
    let mut s = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    write!(
        s,
        "POST /v1/messages HTTP/1.1\r\nhost: api\r\nx-api-key: {token}\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("no live attempt token"), "{answer}");
}

#[test]
fn a_worker_without_a_sandbox_refuses_to_start_unless_told_and_then_says_what_agents_reach() {
    use std::time::{Duration, Instant};
    // Its certificate is the cluster's worker's, which goes first.
    let mut c = Cluster::start_workers_with(1, 1, &[], Vec::new());
    c.signal_worker(0, "-KILL");
    let worker = |extra: &[&str]| {
        let mut cmd = std::process::Command::new(flotilla_tests::binary());
        cmd.args([
            "worker",
            "--coordinator",
            &c.worker_url(),
            "--name",
            "worker-0",
        ])
        .arg("--tls-dir")
        .arg(c.pki())
        .arg("--workspace")
        .arg(c.path().join("ws-x"))
        .args(extra)
        .env("FLOTILLA_BWRAP", c.path().join("no-such-bwrap"))
        .env("FLOTILLA_LOG", "info");
        cmd
    };
    let out = flotilla_tests::run_with_timeout(worker(&[]), Duration::from_secs(60));
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains("no-such-bwrap") && out.stderr.contains("--sandbox off"),
        "{}",
        out.stderr
    );
    // Told to go without one, it starts and says, first thing, what an agent can reach.
    let log = c.path().join("unsandboxed.log");
    let mut child = worker(&["--sandbox", "off"])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let ended = child.try_wait().unwrap().is_some();
        if text.contains("attached") || ended || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    child.wait().unwrap();
    assert!(
        text.contains("WARNING") && text.contains("--tls-dir key") && text.contains("environment"),
        "{text}"
    );
    assert!(text.contains("attached"), "it serves: {text}");
}
