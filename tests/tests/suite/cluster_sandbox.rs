//! Agents run sandboxed (issue 13): on a worker, an agent sees its checkout and its model,
//! nothing else of the worker. The hostile agent is a shell script run by the exec backend,
//! and the real `claude` CLI's Bash tool. Runs one at a time with the other cluster tests.

use std::io::{Read, Write};

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
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
    let conf_dir = tempfile::tempdir().unwrap();
    let config = conf_dir.path().join("worker.toml");
    std::fs::write(&config, format!("# {secret}\nexec_cmd = \"sh\"\n")).unwrap();
    let mut c = Cluster::start_workers_with(
        1,
        4,
        &["--backend", "exec", "--exec-cmd", "sh"],
        vec![
            ("ANTHROPIC_API_KEY".into(), secret.into()),
            ("FLOTILLA_CONFIG".into(), config.display().to_string()),
        ],
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
    let etcd = flotilla_tests::services::Etcd::start();
    let etcd_port = etcd.endpoint().rsplit(':').next().unwrap().to_owned();
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
            format!("ls {}/$FLOTILLA_RUN_ID/s00/0/code.txt", ws.display()),
        ),
        ("worker-environ", format!("cat /proc/{wpid}/environ")),
        ("env-secret", format!("env | grep {secret}")),
        ("config-file", format!("cat {}", config.display())),
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
        (
            "ptrace-worker",
            format!(
                "python3 -c 'import ctypes, sys; sys.exit(ctypes.CDLL(None).ptrace(16, {wpid}, 0, 0))'"
            ),
        ),
        (
            "etcd-port",
            format!(
                "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {etcd_port}), 2)'"
            ),
        ),
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
    let body = format!(
        "const [slow, probe] = await parallel([\n\
               () => agent('sleep 2; echo slow done', {{ label: 'slow' }}),\n\
               () => agent({}, {{ label: 'probe' }}),\n\
             ]);\n\
             return {{ slow, probe }};\n",
        serde_json::Value::String(body)
    );
    let run = c.launch_in(
        &src,
        "hostile",
        &body,
        &["--stagger", "0", "--backend", "exec"],
    );
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
    let body = format!(
        "return await agent('read it [[bash:cat {} || echo refused; printenv ANTHROPIC_API_KEY > token.txt; echo kept]]', {{ tools: ['Bash'], label: 'cat' }});",
        key.display()
    );
    let run = c.launch_in(
        &src,
        "cat",
        &body,
        &["--stagger", "0", "--backend", "claude-code"],
    );
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

#[test]
fn an_attempt_over_its_limits_fails_naming_them_and_the_worker_goes_on() {
    let c = Cluster::start_workers_with(
        1,
        4,
        &[
            "--backend",
            "exec",
            "--exec-cmd",
            "sh",
            "--memory-mib",
            "64",
            "--max-procs",
            "64",
            "--tmp-mib",
            "16",
        ],
        Vec::new(),
    );
    let log = std::fs::read_to_string(c.path().join("worker-0.log")).unwrap();
    assert!(
        log.contains("attempt limits: memory 64 MiB, processes 64, /tmp 16 MiB"),
        "the worker says its limits and how it keeps them: {log}"
    );
    // Groups of workers that are gone (killed outright by earlier tests) were swept.
    if log.contains("through cgroup v1") {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let memory = own
            .lines()
            .find_map(|l| l.split_once(":memory:").map(|(_, p)| p.to_owned()))
            .unwrap();
        let dir =
            std::path::Path::new("/sys/fs/cgroup/memory").join(memory.trim_start_matches('/'));
        let stale: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .filter(|n| {
                n.strip_prefix("flotilla-")
                    .is_some_and(|pid| !std::path::Path::new("/proc").join(pid).exists())
            })
            .collect();
        assert!(stale.is_empty(), "stale groups: {stale:?}");
    }
    let src = c.path().join("repo");
    repo(&src);
    let body = "const [memory, bomb, tmp, calm] = await parallel([\n\
           () => agent('python3 -c \"x = bytearray(512 * 1024 * 1024); print(len(x))\"', { label: 'memory' }),\n\
           () => agent('f() { f | f & }; f; sleep 3; echo survived', { label: 'bomb' }),\n\
           () => agent('dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1 | grep -o \"No space left\"; echo tmp done', { label: 'tmp' }),\n\
           () => agent('echo calm', { label: 'calm' }),\n\
           () => agent('head -c 1048576 /dev/zero > blob.bin; echo wrote', { label: 'blob' }),\n\
         ]);\n\
         return { memory, bomb, tmp, calm };\n";
    let run = c.launch_in(
        &src,
        "greedy",
        body,
        &["--stagger", "0", "--backend", "exec"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"]["calm"], "calm", "{r}");
    assert!(r["result"]["memory"].is_null(), "{r}");
    assert!(r["result"]["bomb"].is_null(), "{r}");
    let failures = r["failures"].to_string();
    assert!(failures.contains("memory limit of 64 MiB"), "{failures}");
    assert!(failures.contains("more than 64 processes"), "{failures}");
    let tmp = r["result"]["tmp"].as_str().unwrap_or_else(|| panic!("{r}"));
    assert!(
        tmp.contains("No space left") && tmp.ends_with("tmp done"),
        "{tmp}"
    );
    // What each checkout held is in the report.
    let blob = r["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["label"] == "blob")
        .unwrap_or_else(|| panic!("{r}"));
    assert!(
        blob["disk_bytes"].as_u64().unwrap_or(0) >= 1 << 20,
        "the checkout's disk use: {blob}"
    );
    // The worker goes on.
    let again = c.launch(
        "again",
        "return await agent('echo still here');",
        &["--backend", "exec"],
    );
    let (code, r) = c.wait(&again);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "still here", "{r}");
}

#[test]
fn an_attempt_over_the_worker_s_longest_time_ends_naming_it() {
    let c = Cluster::start_workers_with(
        1,
        1,
        &[
            "--backend",
            "exec",
            "--exec-cmd",
            "sh",
            "--max-attempt-time",
            "1s",
        ],
        Vec::new(),
    );
    let run = c.launch(
        "slow",
        "return await agent('sleep 60; echo late');",
        &["--backend", "exec"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert!(r["result"].is_null(), "{r}");
    let failures = r["failures"].to_string();
    assert!(failures.contains("--max-attempt-time"), "{failures}");
}

/// Answers every connection with `body` over HTTP, until the test ends.
fn http_server(body: &'static str) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    port
}

#[test]
fn an_agent_reaches_the_allowed_hosts_through_the_proxy_and_nothing_else() {
    let allowed = http_server("allowed host");
    let other = http_server("other host");
    let c = Cluster::start_workers_with(
        1,
        2,
        &[
            "--backend",
            "exec",
            "--exec-cmd",
            "sh",
            "--allow-net",
            &format!("127.0.0.1:{allowed}"),
        ],
        Vec::new(),
    );
    let fetch = |port: u16| {
        format!(
            "python3 -c \\\"import urllib.request as u, urllib.error as e\\ntry: print(u.urlopen('http://127.0.0.1:{port}/').read().decode())\\nexcept e.HTTPError as x: print(x.code, x.read().decode().strip())\\\""
        )
    };
    let direct = format!(
        "python3 -c \\\"import socket; socket.create_connection(('127.0.0.1', {allowed}), 2)\\\" 2>/dev/null && echo direct reached || echo direct refused"
    );
    let body = format!("{}; {}; {direct}", fetch(allowed), fetch(other));
    let run = c.launch(
        "net",
        &format!("return await agent(\"{body}\");"),
        &["--backend", "exec"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let text = r["result"].as_str().unwrap_or_else(|| panic!("{r}"));
    assert!(text.contains("allowed host"), "{text}");
    assert!(!text.contains("other host"), "{text}");
    assert!(
        text.contains(&format!(
            "403 flotilla: 127.0.0.1:{other} is not reachable from this sandbox"
        )),
        "the refusal says why: {text}"
    );
    assert!(
        text.contains("direct refused"),
        "no way around the proxy: {text}"
    );
}

/// `flotilla bench sandbox` runs and reports its figures (`BENCH_SANDBOX_ROUNDS` for more
/// rounds than the suite's three, to measure).
#[test]
fn the_sandbox_benchmark_runs_and_reports_its_figures() {
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    let rounds = std::env::var("BENCH_SANDBOX_ROUNDS").unwrap_or_else(|_| "3".into());
    let mut cmd = std::process::Command::new(flotilla_tests::binary());
    cmd.args([
        "bench", "sandbox", "--claude", "--json", "--rounds", &rounds,
    ])
    .envs(fake.env())
    .env("FLOTILLA_CLAUDE_BIN", crate::claude::claude_bin());
    let out = flotilla_tests::run_with_timeout(cmd, std::time::Duration::from_secs(600));
    assert_eq!(out.code, 0, "{out:?}");
    eprintln!("{}", out.stdout);
    let r: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    for k in [
        "exec_ratio",
        "claude_ratio",
        "exec_plain_ms",
        "claude_sandboxed_ms",
    ] {
        assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {r}");
    }
}

#[test]
fn an_embedded_run_with_sandbox_keeps_agents_to_the_repository() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("repo");
    repo(&src);
    let secret = dir.path().join("secret.txt");
    std::fs::write(&secret, "outside the repository\n").unwrap();
    let script = src.join("look.js");
    std::fs::write(
        &script,
        format!(
            "export const meta = {{ name: 'look', description: 'sandboxed locally' }};\n\
             return await agent('cat {} 2>/dev/null || echo refused; cat code.txt; echo edit >> code.txt; pwd');",
            secret.display()
        ),
    )
    .unwrap();
    let run = |extra: &[&str]| {
        let mut cmd = std::process::Command::new(flotilla_tests::binary());
        cmd.args([
            "run",
            "look.js",
            "--backend",
            "exec",
            "--exec-cmd",
            "sh",
            "--yes",
            "--json",
        ])
        .args(extra)
        .arg("--store")
        .arg(format!("file://{}", dir.path().join("store").display()))
        .current_dir(&src);
        flotilla_tests::run_with_timeout(cmd, std::time::Duration::from_secs(120))
    };
    // By default, as Claude Code's agents: the user's machine is theirs.
    let out = run(&[]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.json()["result"]
            .as_str()
            .unwrap()
            .contains("outside the repository")
    );
    let out = run(&["--sandbox"]);
    assert_eq!(out.code, 0, "{out:?}");
    let text = out.json()["result"].as_str().unwrap().to_owned();
    assert!(text.starts_with("refused\ncode\n"), "{text}");
    assert!(
        text.ends_with(src.to_str().unwrap()),
        "in the repository: {text}"
    );
    assert_eq!(
        std::fs::read_to_string(src.join("code.txt")).unwrap(),
        "code\nedit\nedit\n",
        "the repository is the agent's to edit"
    );
}

/// Traps an agent sets for the git the worker runs on its checkout afterwards: a nested
/// repository whose filter would run a command, links from the checkout's git directory to
/// files of the worker's, a FIFO that would hang git, a set-user-ID copy of a program. None
/// springs; the change still comes home and the worker goes on.
#[test]
fn traps_for_the_worker_s_git_spring_on_nothing() {
    let c =
        Cluster::start_workers_with(1, 2, &["--backend", "exec", "--exec-cmd", "sh"], Vec::new());
    let src = c.path().join("repo");
    repo(&src);
    let sprung = c.path().join("sprung");
    let victim = c.path().join("victim.txt");
    std::fs::write(&victim, "the worker's file\n").unwrap();
    let trap = format!(
        "set -e; admin=.git; \
         mkdir sub; cd sub; git init -q; git config filter.pwn.clean 'sh -c \"id > {sprung}; cat\"'; \
         git config filter.pwn.smudge cat; echo '* filter=pwn' > .gitattributes; echo x > f; \
         git add -A; git -c user.name=a -c user.email=a@a commit -qm sub; echo y > f; cd ..; git add sub; \
         echo '* filter=pwn' >> .gitattributes; \
         ln -sf {victim} $admin/COMMIT_EDITMSG; mkdir -p $admin/logs; ln -sf {victim} $admin/logs/HEAD; \
         printf '[extensions]\\n' > $admin/config.worktree; \
         cp /usr/bin/id suid-id; chmod 4755 suid-id; \
         echo kept > kept.txt; rm -f $admin/ORIG_HEAD; mkfifo $admin/ORIG_HEAD; echo set",
        sprung = sprung.display(),
        victim = victim.display(),
    );
    let launch_in_repo =
        |name: &str, body: &str| c.launch_in(&src, name, body, &["--backend", "exec"]);
    let run = launch_in_repo(
        "trap",
        &format!("return await agent({});", serde_json::Value::String(trap)),
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "set", "{r}");
    assert!(
        !sprung.exists(),
        "the agent's filter never ran on the worker"
    );
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "the worker's file\n",
        "no worker file was written through the agent's links"
    );
    let mut setuid = Vec::new();
    let mut todo = vec![c.path().join("ws-0")];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            use std::os::unix::fs::PermissionsExt;
            if m.is_dir() {
                todo.push(e.path());
            } else if m.is_file() && m.permissions().mode() & 0o6000 != 0 {
                setuid.push(e.path());
            }
        }
    }
    assert!(setuid.is_empty(), "no set-user-ID file stays: {setuid:?}");
    assert_eq!(r["changes"]["merged"], 1, "the change came home: {r}");
    // The worker goes on: the next checkout of the same repository is made.
    let again = launch_in_repo("again", "return await agent('cat code.txt');");
    let (code, r) = c.wait(&again);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "code", "{r}");
}

#[test]
fn where_no_cgroup_is_made_rlimits_hold_an_attempt_and_its_failure_says_them() {
    let c = Cluster::start_workers_with(
        1,
        2,
        &[
            "--backend",
            "exec",
            "--exec-cmd",
            "sh",
            "--memory-mib",
            "256",
            "--limits-via",
            "rlimits",
        ],
        Vec::new(),
    );
    let log = std::fs::read_to_string(c.path().join("worker-0.log")).unwrap();
    assert!(log.contains("through rlimits"), "{log}");
    let run = c.launch(
        "hog",
        "return await parallel([\n\
           () => agent('python3 -c \"x = bytearray(1024 * 1024 * 1024)\"', { label: 'hog' }),\n\
           () => agent('echo calm', { label: 'calm' }),\n\
         ]);",
        &["--backend", "exec"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"][1], "calm", "{r}");
    assert!(r["result"][0].is_null(), "{r}");
    let failures = r["failures"].to_string();
    assert!(
        failures.contains("MemoryError") && failures.contains("256 MiB of address space"),
        "{failures}"
    );
}
