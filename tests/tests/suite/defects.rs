//! Defects found by trying the landed build as a new user and a hostile one would (issue
//! 11), in the embedded mode: each test here failed before its fix. The fleet ones are in
//! `cluster_defects`.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::{Env, agents, usage};
use serde_json::Value;

/// Polls `ok` until it holds, failing the test after `within`.
fn wait_until<T>(what: &str, within: Duration, mut ok: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = ok() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs in the store, by id.
fn stored_runs(env: &Env) -> Vec<String> {
    let mut runs: Vec<String> = std::fs::read_dir(env.path().join("store/runs"))
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    runs.sort();
    runs
}

/// Owner records of a run (see `coordinator/src/owner.rs`).
fn owner_records(env: &Env, run: &str) -> Vec<Value> {
    let dir = env.path().join("store/runs").join(run).join("owner");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    files.retain(|f| f.extension().is_some_and(|e| e == "json"));
    files.sort();
    files
        .iter()
        .filter_map(|f| serde_json::from_slice(&std::fs::read(f).ok()?).ok())
        .collect()
}

/// `flotilla run` in the background, its stderr in `log`.
fn spawn_run(env: &Env, args: &[&str], log: &Path) -> Child {
    let err = std::fs::File::create(log).unwrap();
    env.command(args, &[])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .unwrap()
}

/// Waits for a child to exit, killing it (and failing) after `within`.
fn exit_of(mut child: Child, within: Duration) -> i32 {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the run did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

const SLOW: &str = "return (await parallel(Array.from({ length: 4 }, (_, i) => () => agent('slow ' + i + ' [[sleep:4000]]')))).length;";

#[test]
fn a_run_is_not_resumed_while_its_process_lives_and_a_dead_one_shows_interrupted() {
    let env = Env::new();
    let script = env.script("quick-then-slow", &format!("await agent('quick');\n{SLOW}"));
    let s = script.to_str().unwrap();
    let first = spawn_run(
        &env,
        &["run", s, "--stagger", "0"],
        &env.path().join("a.log"),
    );
    let run = wait_until(
        "the run to take its owner record",
        Duration::from_secs(30),
        || {
            stored_runs(&env)
                .into_iter()
                .find(|r| !owner_records(&env, r).is_empty())
        },
    );
    wait_until(
        "the quick agent to be journaled",
        Duration::from_secs(30),
        || {
            std::fs::read_dir(env.path().join("store/runs").join(&run).join("calls"))
                .ok()
                .and_then(|mut d| d.next())
                .map(|_| ())
        },
    );
    // Its process is alive: a resume is refused, naming it.
    let out = env.flotilla(&["run", s, "--resume", &run, "--json"]);
    assert_eq!(out.code, 2, "{out:?}");
    let r = out.json();
    assert!(
        r["error"].as_str().unwrap().contains("still running"),
        "{r}"
    );
    // Killed with -9 it never stores a report; `show` and `runs` say interrupted, not running.
    let pid = first.id();
    assert!(
        std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(exit_of(first, Duration::from_secs(10)), -1);
    let shown = env.flotilla(&["show", &run, "--json"]);
    assert_eq!(shown.json()["status"], "interrupted", "{shown:?}");
    let listed = env.flotilla(&["runs", "--json"]);
    let row = listed
        .json()
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run_id"] == run.as_str())
        .cloned()
        .unwrap();
    assert_eq!(row["status"], "interrupted", "{row}");
    // Now it resumes.
    let (code, r) = env.run(&script, &["--resume", &run, "--stagger", "0"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 4);
    assert_eq!(usage(&r, "cached"), 1);
}

#[test]
fn two_resumes_of_one_run_at_once_are_one_resume() {
    let env = Env::new();
    let quick = env.script(
        "stages",
        "return (await parallel(Array.from({ length: 3 }, (_, i) => () => agent('item ' + i)))).length;",
    );
    let (code, r) = env.run(&quick, &["--stagger", "0"]);
    assert_eq!(code, 0, "{r}");
    let parent = r["run_id"].as_str().unwrap().to_owned();
    // An edited script: the old calls come from the journal, the new ones take a while.
    let edited = env.script(
        "stages2",
        "const a = await parallel(Array.from({ length: 3 }, (_, i) => () => agent('item ' + i)));\n\
         const b = await parallel(Array.from({ length: 3 }, (_, i) => () => agent('new ' + i + ' [[sleep:3000]]')));\n\
         return a.length + b.length;",
    );
    let e = edited.to_str().unwrap();
    let first = spawn_run(
        &env,
        &["run", e, "--resume", &parent, "--stagger", "0", "--json"],
        &env.path().join("first.log"),
    );
    wait_until(
        "the first resume to claim the run",
        Duration::from_secs(30),
        || {
            let records = owner_records(&env, &parent);
            let last = records.last()?;
            (last["holder"] != parent.as_str() && last["released"] == false).then_some(())
        },
    );
    let second = env.flotilla(&["run", e, "--resume", &parent, "--json", "--stagger", "0"]);
    assert_eq!(second.code, 2, "{second:?}");
    let refused = second.json();
    assert!(
        refused["error"]
            .as_str()
            .unwrap()
            .contains("is being resumed already"),
        "{refused}"
    );
    assert_eq!(exit_of(first, Duration::from_secs(60)), 0);
    // One resume ran: the new agents ran once, in one run.
    let runs = stored_runs(&env);
    assert_eq!(
        runs.len(),
        2,
        "only the parent and one resume are stored: {runs:?}"
    );
    let child = runs.iter().find(|r| **r != parent).unwrap();
    let shown = env.flotilla(&["show", child, "--json"]).json();
    assert_eq!(shown["result"], 6, "{shown}");
    assert_eq!(usage(&shown, "cached"), 3);
    assert_eq!(usage(&shown, "dispatched"), 3);
    assert_eq!(agents(&shown).len(), 6);
    // Once it ended, the parent can be resumed again.
    let (code, again) = env.run(&edited, &["--resume", &parent, "--stagger", "0"]);
    assert_eq!(code, 0, "{again}");
}

#[test]
fn sigterm_stops_an_embedded_run_like_ctrl_c_and_its_report_is_stored() {
    let env = Env::new();
    let script = env.script("slow", SLOW);
    let child = spawn_run(
        &env,
        &["run", script.to_str().unwrap(), "--stagger", "0", "--json"],
        &env.path().join("term.log"),
    );
    let run = wait_until("the run to start", Duration::from_secs(30), || {
        stored_runs(&env)
            .into_iter()
            .find(|r| !owner_records(&env, r).is_empty())
    });
    // Wait for its agents to be running, then SIGTERM it (as docker stop does).
    wait_until("agents to run", Duration::from_secs(30), || {
        std::fs::read_dir(env.path().join("store/runs").join(&run).join("events"))
            .ok()
            .and_then(|mut d| d.next())
            .map(|_| ())
    });
    let pid = child.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(exit_of(child, Duration::from_secs(30)), 1);
    assert!(
        env.path()
            .join("store/runs")
            .join(&run)
            .join("result.json")
            .exists(),
        "the report was stored"
    );
    let shown = env.flotilla(&["show", &run, "--json"]).json();
    assert_eq!(shown["status"], "stopped", "{shown}");
    let records = owner_records(&env, &run);
    assert_eq!(records.last().unwrap()["released"], true, "{records:?}");
}

#[test]
fn a_store_that_cannot_be_written_for_good_stops_the_run_at_once_and_resume_works_once_fixed() {
    let env = Env::new();
    // `payloads/` (where results over 256 KiB go) is a file: every such write fails the
    // same way, so retrying for ten minutes would only hide it.
    std::fs::create_dir_all(env.path().join("store")).unwrap();
    std::fs::write(env.path().join("store/payloads"), "in the way").unwrap();
    let script = env.script(
        "big-result",
        "const small = await agent('small');\nconst big = await agent('x'.repeat(300 * 1024));\nreturn [small, big.length];",
    );
    let started = Instant::now();
    let (code, r) = env.run(&script, &["--stagger", "0"]);
    assert_eq!(code, 1, "{r}");
    assert!(started.elapsed() < Duration::from_secs(60), "it retried");
    assert_eq!(r["status"], "failed", "{r}");
    let error = r["error"].as_str().unwrap();
    assert!(
        error.contains("is a file, not a directory") && error.contains("payloads"),
        "{error}"
    );
    let run = r["run_id"].as_str().unwrap().to_owned();
    // Fixed: the resume serves what was stored and runs the rest.
    std::fs::remove_file(env.path().join("store/payloads")).unwrap();
    let (code, r) = env.run(&script, &["--stagger", "0", "--resume", &run]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], serde_json::json!(["small", 300 * 1024]));
    assert_eq!(usage(&r, "cached"), 1);
}

#[test]
fn store_urls_and_paths_that_cannot_work_say_why() {
    let env = Env::new();
    let script = env.script("t", "return 1;");
    let s = script.to_str().unwrap();
    // `file:` without its slashes is a mistyped URL, not a directory named "file:".
    let out = env.flotilla(&["run", s, "--store", "file:"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("file:///absolute/path"), "{out:?}");
    assert!(!env.path().join("file:").exists());
    // A store path that is a file.
    std::fs::write(env.path().join("plain-file"), "x").unwrap();
    let url = format!("file://{}", env.path().join("plain-file").display());
    let out = env.flotilla(&["run", s, "--store", &url]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("is a file, not a directory"), "{out:?}");
    assert_eq!(out.stderr.matches("File exists").count(), 0, "{out:?}");
}

#[test]
fn a_corrupt_segment_costs_only_its_calls_and_a_corrupt_report_is_rebuilt() {
    let env = Env::new();
    let script = env.script(
        "three",
        "const a = await agent('a');\nconst b = await agent('b');\nconst c = await agent('c');\nreturn [a, b, c];",
    );
    let (code, r) = env.run(&script, &["--stagger", "0"]);
    assert_eq!(code, 0, "{r}");
    let run = r["run_id"].as_str().unwrap().to_owned();
    let dir = env.path().join("store/runs").join(&run);
    let mut segments: Vec<PathBuf> = std::fs::read_dir(dir.join("calls"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    segments.sort();
    assert_eq!(segments.len(), 3, "one segment per awaited call");
    // Truncate the middle one mid-line, and damage the report.
    let body = std::fs::read(&segments[1]).unwrap();
    std::fs::write(&segments[1], &body[..body.len() / 2]).unwrap();
    std::fs::write(dir.join("result.json"), "{\"run_id\": \"trunc").unwrap();
    let shown = env.flotilla(&["show", &run, "--json"]);
    assert_eq!(shown.code, 0, "{shown:?}");
    let shown = shown.json();
    assert_eq!(shown["status"], "completed", "{shown}");
    let logs = shown["logs"].to_string();
    assert!(logs.contains("result.json is unreadable"), "{logs}");
    assert!(
        logs.contains("skipped 1 unreadable journal record"),
        "{logs}"
    );
    assert_eq!(agents(&shown).len(), 3);
    // The resume serves the two readable calls and runs the damaged one again.
    let (code, r) = env.run(&script, &["--stagger", "0", "--resume", &run]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], serde_json::json!(["a", "b", "c"]));
    assert_eq!(usage(&r, "cached"), 2);
    assert_eq!(usage(&r, "dispatched"), 1);
    let logs = r["logs"].to_string();
    let name = segments[1]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        logs.contains("[resume] skipped 1") && logs.contains(&name),
        "{logs}"
    );
}

#[test]
fn every_read_from_outside_has_a_limit_that_the_error_names() {
    let env = Env::new();
    let script = env.script("t", "return args;");
    let s = script.to_str().unwrap();
    let out = env.flotilla(&["run", "/dev/zero"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("/dev/zero is a device"), "{out:?}");
    let out = env.flotilla(&["run", s, "--args-file", "/dev/zero"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("is a device"), "{out:?}");
    let big = env.path().join("big.json");
    std::fs::write(&big, format!("\"{}\"", "a".repeat(17 << 20))).unwrap();
    let out = env.flotilla(&["run", s, "--args-file", big.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains("larger than the limit of 16 MiB"),
        "{out:?}"
    );
    let huge_script = env.file(
        "huge.js",
        &format!(
            "export const meta = {{ name: 'h', description: 'd' }};\n//{}\n",
            "x".repeat(3 << 20)
        ),
    );
    let out = env.flotilla(&["run", huge_script.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains("larger than the limit of 2 MiB"),
        "{out:?}"
    );
    // A script cannot make the host read a device either.
    let (code, r) = env.run_body(
        "try { await workflow({ scriptPath: '/dev/zero' }); return 'read it'; } catch (e) { return e.message; }",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert!(r["result"].as_str().unwrap().contains("is a device"), "{r}");
}

#[test]
fn an_exec_agent_that_floods_stdout_is_stopped_at_the_limit() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const r = await agent('flood', { label: 'flood' });\nreturn r;",
        &[
            "--backend",
            "exec",
            "--exec-cmd",
            "head -c 200000000 /dev/zero",
        ],
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"], Value::Null);
    let a = flotilla_tests::agent(&r, "flood");
    let error = a["error"].as_str().unwrap();
    assert!(error.contains("more than 64 MiB to stdout"), "{error}");
}

#[test]
fn terminal_escapes_from_a_script_are_shown_not_obeyed() {
    let env = Env::new();
    let script = env.file(
        "esc.js",
        "export const meta = { name: 'esc\\u001b]0;TITLE\\u0007', description: 'd' };\n\
         log('\\u001b]0;OWNED\\u0007\\u001b[2J');\n\
         await agent('x', { label: 'l\\ncompleted in 0.0s · forged' });\n\
         return 'r\\u001b[31m';",
    );
    let out = env.flotilla(&["run", script.to_str().unwrap(), "--stagger", "0"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        !out.stderr.contains('\u{1b}'),
        "a raw escape reached stderr: {:?}",
        out.stderr
    );
    assert!(!out.stderr.contains('\u{7}'), "{:?}", out.stderr);
    assert!(
        out.stderr.contains("\\u{1b}]0;OWNED\\u{7}\\u{1b}[2J"),
        "{}",
        out.stderr
    );
    // A forged "completed in" line cannot start a line of its own.
    assert_eq!(
        out.stderr
            .lines()
            .filter(|l| l.starts_with("completed in"))
            .count(),
        1,
        "{}",
        out.stderr
    );
    // To a pipe, the result is delivered verbatim (W04); --json escapes by JSON's rules.
    assert_eq!(out.stdout, "r\u{1b}[31m\n");
    let (code, r) = env.run(&script, &["--stagger", "0"]);
    assert_eq!(code, 0);
    assert_eq!(r["result"], "r\u{1b}[31m");
    // On a terminal (progress bars and all), none of the script's sequences arrive raw.
    let line = format!(
        "{} run '{}' --stagger 0 --yes",
        env.bin.display(),
        script.display()
    );
    let tty = std::process::Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .current_dir(env.path())
        .env("FLOTILLA_STORE", env.store_url())
        .env("HOME", env.path())
        .stdin(Stdio::null())
        .output()
        .expect("util-linux `script` runs commands on a pseudo-terminal");
    let seen = String::from_utf8_lossy(&tty.stdout);
    assert!(seen.contains("completed in"), "{seen:?}");
    for raw in ["\u{1b}]0;", "\u{1b}[2J", "\u{1b}[31m", "\u{7}"] {
        assert!(
            !seen.contains(raw),
            "{raw:?} reached the terminal: {seen:?}"
        );
    }
}

#[test]
fn smaller_ones_say_what_is_wrong() {
    let env = Env::new();
    let script = env.script("t", "return 1;");
    let s = script.to_str().unwrap();
    // TypeScript: the line, and what is wrong with it.
    let ts = env.file(
        "typed.js",
        "export const meta = { name: 'typed', description: 'd' };\nconst n: number = 1;\nreturn n;\n",
    );
    let out = env.flotilla(&["run", ts.to_str().unwrap()]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("const n: number = 1;"), "{out:?}");
    assert!(
        out.stderr.contains("type annotations are not JavaScript"),
        "{out:?}"
    );
    // A negative count is a bad value, not an unknown flag.
    let out = env.flotilla(&["run", s, "--concurrency", "-1"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("-1 is not in 1.."), "{out:?}");
    let out = env.flotilla(&["run", s, "--script-memory", "999999999"]);
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("at most"), "{out:?}");
    // A refused launch names no run that was never stored.
    let bad = env.file("bad.js", "export const meta = { name: 'b' };\nreturn 1;\n");
    let out = env.flotilla(&["run", bad.to_str().unwrap(), "--json"]);
    assert_eq!(out.code, 2, "{out:?}");
    let r = out.json();
    assert!(r.get("run_id").is_none(), "{r}");
    assert!(stored_runs(&env).is_empty());
    // Error codes a script can branch on.
    let (code, r) = env.run_body(
        "const o = {}; o.self = o;\n\
         const codes = [];\n\
         for (const f of [() => agent(123), () => agent('x', o), () => agent('x', [1])]) {\n\
           try { await f(); codes.push('none'); } catch (e) { codes.push(e.code); }\n\
         }\n\
         return codes;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        serde_json::json!(["INVALID_PROMPT", "INVALID_OPTION", "INVALID_OPTION"])
    );
    // An S3 store without credentials says so instead of asking a cloud metadata address.
    let out = env.flotilla_with_env(
        &["run", s, "--store", "s3://some-bucket/x"],
        &[("AWS_ACCESS_KEY_ID", ""), ("AWS_SECRET_ACCESS_KEY", "")],
    );
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("no S3 credentials"), "{out:?}");
}

#[test]
fn a_run_whose_events_were_never_written_shows_its_journaled_calls() {
    let env = Env::new();
    let script = env.script(
        "j",
        "return (await parallel(Array.from({ length: 10 }, (_, i) => () => agent('item ' + i)))).length;",
    );
    let (code, r) = env.run(&script, &["--stagger", "0"]);
    assert_eq!(code, 0, "{r}");
    let run = r["run_id"].as_str().unwrap().to_owned();
    let dir = env.path().join("store/runs").join(&run);
    std::fs::remove_dir_all(dir.join("events")).unwrap();
    std::fs::remove_file(dir.join("result.json")).unwrap();
    let shown = env.flotilla(&["show", &run, "--json"]).json();
    assert_eq!(usage(&shown, "agents"), 10, "{shown}");
    assert!(
        agents(&shown).iter().all(|a| a["status"] == "completed"),
        "{shown}"
    );
}
