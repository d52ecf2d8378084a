//! `flotilla dev` (issue 17): a real fleet on this machine in one command. A run launched with
//! the line it prints completes on its workers; Ctrl-C leaves nothing running; killed
//! outright, its own children end with it, and the next `dev` in the same directory stops
//! what was left (an etcd) and still has the earlier runs. A second `dev` in the directory of
//! one that runs is refused and leaves it be (issue 29); the printed line runs as printed.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_tests::cluster::free_port;
use flotilla_tests::{Output, binary, http_get, run_with_timeout};
use serde_json::Value;

/// A running `flotilla dev --json` and what it printed once its fleet was up.
struct Dev {
    child: Child,
    up: Value,
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_dev(dir: &Path, extra: &[&str]) -> Dev {
    let mut child = Command::new(binary())
        .args(["dev", "--json", "--workers", "2", "--slots", "2", "--dir"])
        .arg(dir)
        .args(["--port", &free_port().to_string()])
        .args(["--http-port", &free_port().to_string()])
        .args(extra)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("FLOTILLA_CONTEXTS", dir.join("contexts.toml"))
        .env_remove("FLOTILLA_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start flotilla dev");
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    // Its stderr, kept for a failure's message.
    let errors = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    {
        let errors = errors.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                errors.lock().unwrap().push_str(&(l + "\n"));
            }
        });
    }
    let line = rx
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("the fleet never came up: {}", errors.lock().unwrap()));
    let up: Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {line:?} {}", errors.lock().unwrap()));
    Dev { child, up }
}

/// The printed `launch` line, with the script in place of `SCRIPT.js`, run with `extra`.
fn launch(dev: &Dev, script: &Path, extra: &[&str]) -> Output {
    let line: Vec<String> = dev.up["launch"]
        .as_array()
        .expect("a launch line")
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(line[0], "flotilla");
    let mut cmd = Command::new(binary());
    for a in &line[1..] {
        if a == "SCRIPT.js" {
            cmd.arg(script);
        } else {
            cmd.arg(a);
        }
    }
    // As a user runs it: without the suite's default backend (.cargo/config.toml).
    cmd.args(extra)
        .current_dir(script.parent().unwrap())
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env_remove("FLOTILLA_DEFAULT_BACKEND");
    run_with_timeout(cmd, Duration::from_secs(60))
}

/// A client command against the fleet, as the printed line names it.
fn client(dev: &Dev, args: &[&str]) -> Output {
    let mut cmd = Command::new(binary());
    cmd.args(args)
        .args(["--coordinator", dev.up["coordinator"].as_str().unwrap()])
        .arg("--tls-dir")
        .arg(dev.up["tls_dir"].as_str().unwrap())
        .env("AWS_EC2_METADATA_DISABLED", "true");
    run_with_timeout(cmd, Duration::from_secs(60))
}

fn pids(dev: &Dev) -> Vec<u32> {
    dev.up["pids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_u64().unwrap() as u32)
        .collect()
}

/// Whether `pid` is a live process (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

fn wait_gone(pids: &[u32], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while pids.iter().any(|p| alive(*p)) {
        assert!(
            Instant::now() < deadline,
            "{what}: still running: {:?}",
            pids.iter().filter(|p| alive(**p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn fan_out(dir: &Path) -> std::path::PathBuf {
    flotilla_tests::write_workflow(
        dir,
        "dev-fanout",
        "on the dev fleet",
        "return await parallel([1, 2, 3, 4, 5, 6].map(i => () => agent('item ' + i)));",
    )
}

/// The run's report, once it has ended.
fn wait_run(dev: &Dev, run: &str) -> Value {
    let out = client(dev, &["wait", run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    out.json()
}

#[test]
fn a_dev_fleet_runs_what_its_launch_line_sends_and_ctrl_c_leaves_nothing_running() {
    let dir = tempfile::tempdir().unwrap();
    let dev = start_dev(dir.path(), &[]);
    let procs = pids(&dev);
    assert_eq!(procs.len(), 3, "a coordinator and two workers: {}", dev.up);
    assert!(procs.iter().all(|p| alive(*p)));
    assert_eq!(dev.up["etcd"], Value::Null);

    let out = client(&dev, &["workers", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json().as_array().map(Vec::len), Some(2), "{out:?}");

    let script = fan_out(dir.path());
    let out = launch(
        &dev,
        &script,
        &["--json", "--backend", "echo", "--stagger", "0"],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let launched = out.json();
    let run = launched["run_id"].as_str().unwrap().to_owned();
    let report = wait_run(&dev, &run);
    assert_eq!(report["status"], "completed", "{report}");
    assert_eq!(report["usage"]["agents"], 6, "{report}");
    // The sign-in link signs in, and the run's page is there after it.
    let login = dev.up["login_url"].as_str().unwrap();
    let rest = login.strip_prefix("http://127.0.0.1:").unwrap();
    let (port, path) = rest.split_once('/').unwrap();
    let port: u16 = port.parse().unwrap();
    let signed = http_get(port, &format!("/{path}"), &[]);
    let cookie = signed
        .headers
        .iter()
        .find(|(k, _)| k == "set-cookie")
        .map(|(_, v)| v.split(';').next().unwrap().to_owned())
        .unwrap_or_else(|| panic!("no cookie: {} {:?}", signed.status, signed.headers));
    let page = http_get(port, &format!("/runs/{run}"), &[("Cookie", &cookie)]);
    assert_eq!(page.status, 200, "{}", page.body);

    // It is the current context: client commands need neither --coordinator nor --tls-dir.
    let bare = |args: &[&str]| {
        let mut cmd = Command::new(binary());
        cmd.args(args)
            .env("FLOTILLA_CONTEXTS", dir.path().join("contexts.toml"))
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env_remove("FLOTILLA_COORDINATOR")
            .env_remove("FLOTILLA_TLS_DIR")
            .env_remove("FLOTILLA_CONFIG")
            .env_remove("FLOTILLA_CONTEXT");
        run_with_timeout(cmd, Duration::from_secs(60))
    };
    let listed = bare(&["context", "list"]);
    assert!(
        listed.code == 0 && listed.stdout.starts_with("* dev\t"),
        "{listed:?}"
    );
    let out = bare(&["status", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["status"], "completed", "{out:?}");
    let out = bare(&["workers", "--json"]);
    assert_eq!(out.json().as_array().map(Vec::len), Some(2), "{out:?}");
    // Another context, made current, is what they reach; a missing one is named.
    let add = bare(&[
        "context",
        "add",
        "gone",
        "--coordinator",
        "http://127.0.0.1:9",
        "--insecure",
        "--use",
    ]);
    assert_eq!(add.code, 0, "{add:?}");
    let out = bare(&["workers", "--json"]);
    assert_eq!(out.code, 3, "unreachable, as it says: {out:?}");
    assert!(out.stderr.contains("127.0.0.1:9"), "{out:?}");
    assert_eq!(bare(&["context", "use", "dev"]).code, 0);
    assert_eq!(bare(&["workers", "--json"]).code, 0);
    let nope = bare(&["context", "use", "nope"]);
    assert!(
        nope.code != 0 && nope.stderr.contains("no context \"nope\""),
        "{nope:?}"
    );

    // Ctrl-C: it stops every process it started, and ends well.
    let mut dev = dev;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dev.child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = dev.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "dev did not stop on Ctrl-C");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    wait_gone(&procs, "after Ctrl-C");
    assert!(!dir.path().join("dev.pids").exists());
}

#[test]
fn a_dev_fleet_killed_outright_takes_its_children_and_the_next_one_stops_its_etcd() {
    let dir = tempfile::tempdir().unwrap();
    let mut dev = start_dev(dir.path(), &["--etcd"]);
    assert!(
        dev.up["etcd"]
            .as_str()
            .unwrap()
            .starts_with("https://127.0.0.1:"),
        "{}",
        dev.up
    );
    let procs = pids(&dev);
    assert_eq!(
        procs.len(),
        4,
        "etcd, a coordinator and two workers: {}",
        dev.up
    );
    let script = fan_out(dir.path());
    let out = launch(
        &dev,
        &script,
        &["--json", "--backend", "echo", "--stagger", "0"],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    assert_eq!(wait_run(&dev, &run)["status"], "completed");

    // SIGKILL: no chance to clean up. Its own children end by themselves; etcd is left.
    dev.child.kill().unwrap();
    dev.child.wait().unwrap();
    let (etcd, ours) = (procs[0], &procs[1..]);
    wait_gone(ours, "the coordinator and workers after dev was killed");
    assert!(alive(etcd), "etcd should be the one left over");

    // The next `dev` in the same directory stops it, comes up, and still has the run.
    let again = start_dev(dir.path(), &["--etcd"]);
    assert!(!alive(etcd), "the leftover etcd still runs");
    let shown = client(&again, &["wait", &run, "--json"]);
    assert_eq!(shown.code, 0, "{shown:?}");
    assert_eq!(shown.json()["status"], "completed");
    let out = launch(
        &again,
        &script,
        &["--json", "--backend", "echo", "--stagger", "0"],
    );
    assert_eq!(out.code, 0, "{out:?}");
    let second = out.json()["run_id"].as_str().unwrap().to_owned();
    assert_eq!(wait_run(&again, &second)["status"], "completed");
    let new_procs = pids(&again);
    drop(again);
    // Dropped with SIGKILL again: the children go; the next etcd is a leftover for the
    // directory's next user, so stop it here by the pid the fleet printed.
    wait_gone(&new_procs[1..], "after the second kill");
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(new_procs[0] as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    wait_gone(&new_procs[..1], "the second etcd");
}

/// Issue 29: a second `dev` in the directory of a running fleet is refused, naming that
/// fleet's pid and how to stop it, and leaves every process of it running and serving.
#[test]
fn a_second_dev_in_the_directory_of_a_running_fleet_is_refused_and_leaves_it_be() {
    let dir = tempfile::tempdir().unwrap();
    let dev = start_dev(dir.path(), &[]);
    let procs = pids(&dev);
    let first = dev.child.id();
    for json in [false, true] {
        let mut cmd = Command::new(binary());
        cmd.args(["dev", "--workers", "1", "--dir"])
            .arg(dir.path())
            .args(["--port", &free_port().to_string()])
            .args(["--http-port", &free_port().to_string()])
            .env_remove("FLOTILLA_CONFIG");
        if json {
            cmd.arg("--json");
        }
        let out = run_with_timeout(cmd, Duration::from_secs(60));
        assert_eq!(out.code, 2, "{out:?}");
        assert!(
            out.stderr.contains(&format!(
                "already runs in {} (pid {first})",
                dir.path().canonicalize().unwrap().display()
            )),
            "{out:?}"
        );
        assert!(out.stderr.contains(&format!("`kill {first}`")), "{out:?}");
        if json {
            let v: Value = serde_json::from_str(out.stdout.trim())
                .unwrap_or_else(|e| panic!("not one JSON object ({e}): {out:?}"));
            assert_eq!(v["status"], "rejected", "{v}");
        }
    }
    // Every process of the first is alive, and it still serves.
    for p in &procs {
        assert!(alive(*p), "pid {p} of the running fleet is gone");
    }
    let out = client(&dev, &["workers", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json().as_array().map(Vec::len), Some(2), "{out:?}");
}

/// Issue 29: the printed launch line, run as printed (no `--backend`), gets a backend the
/// workers offer and says which; a backend no attached worker offers is said at once, in the
/// launch's answer; and `show --coordinator`, which the banner promises, shows the run.
#[test]
fn the_printed_launch_line_runs_as_printed_and_a_backend_no_worker_offers_is_said_at_once() {
    let dir = tempfile::tempdir().unwrap();
    // The workers offer echo only, whatever this machine has.
    let dev = start_dev(dir.path(), &["--backend", "echo"]);
    let script = fan_out(dir.path());
    let out = launch(&dev, &script, &[]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stderr
            .contains("backend echo (chosen by the coordinator: the launch named none, and its attached workers offer echo"),
        "{out:?}"
    );
    let run = printed_run(&out);
    let report = wait_run(&dev, &run);
    assert_eq!(report["status"], "completed", "{report}");
    assert_eq!(report["usage"]["agents"], 6, "{report}");
    // `show` with the fleet's flags, as the banner says every client command takes them.
    let shown = client(&dev, &["show", &run, "--json"]);
    assert_eq!(shown.code, 0, "{shown:?}");
    assert_eq!(shown.json()["status"], "completed", "{shown:?}");
    assert_eq!(shown.json()["run_id"], run.as_str(), "{shown:?}");
    let shown = client(&dev, &["show", &run]);
    assert!(shown.stdout.contains("status    completed"), "{shown:?}");

    // A backend no worker offers: the launch returns at once, saying so and what to do.
    for json in [false, true] {
        let mut extra = vec!["--backend", "claude-code", "--worker-wait", "10m"];
        if json {
            extra.push("--json");
        }
        let out = launch(&dev, &script, &extra);
        assert_eq!(out.code, 0, "{out:?}");
        let said = "no attached worker offers backend \"claude-code\" (the 2 attached offer echo); start a worker with --backend claude-code; the run's agents wait up to 10m";
        assert!(out.stderr.contains(said), "{out:?}");
        let run = if json {
            let v = out.json();
            assert!(
                v["notes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|n| n.as_str().unwrap().contains(said)),
                "{v}"
            );
            v["run_id"].as_str().unwrap().to_owned()
        } else {
            printed_run(&out)
        };
        let stop = client(&dev, &["stop", &run]);
        assert_eq!(stop.code, 0, "{stop:?}");
    }
}

/// The run id `launch` printed (`run ID  session URL`).
fn printed_run(out: &Output) -> String {
    out.stdout
        .strip_prefix("run ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no run printed: {out:?}"))
        .to_owned()
}
