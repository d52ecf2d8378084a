//! Command-line behaviour: bad input, `runs`, `show`.

use flotilla_tests::Env;

#[test]
fn bad_flags_and_bad_args_are_usage_errors() {
    let env = Env::new();
    let s = env.script("x", "return args;");
    let s = s.to_str().unwrap();
    let out = env.flotilla(&["run", s, "--args", "{not json"]);
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.contains("--args is not valid JSON"),
        "{}",
        out.stderr
    );
    let out = env.flotilla(&["run", s, "--concurrency", "lots"]);
    assert_eq!(out.code, 2);
    let out = env.flotilla(&["run", s, "--stall-timeout", "soon"]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("--stall-timeout"), "{}", out.stderr);
    let out = env.flotilla(&["run", s, "--backend", "exec"]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("--exec-cmd"), "{}", out.stderr);
    let out = env.flotilla(&["run", "missing.js"]);
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.contains("cannot read script missing.js"),
        "{}",
        out.stderr
    );
    let out = env.flotilla(&["run", s, "--replay", "sideways"]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("unknown replay mode"), "{}", out.stderr);
}

#[test]
fn refusals_with_json_are_one_json_object_on_stdout_with_their_code() {
    let env = Env::new();
    let s = env.script("x", "return args;");
    let s = s.to_str().unwrap();
    let refused = |args: &[&str], code: i32, kind: &str, says: &str| {
        let out = env.flotilla(args);
        assert_eq!(out.code, code, "{args:?}: {out:?}");
        let v: serde_json::Value = serde_json::from_str(out.stdout.trim())
            .unwrap_or_else(|e| panic!("{args:?}: stdout is not one JSON object ({e}): {out:?}"));
        assert_eq!(v["status"], "rejected", "{v}");
        assert_eq!(v["error"]["code"], kind, "{args:?}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{args:?}: {message}");
    };
    refused(
        &["run", s, "--json", "--args", "{bad"],
        2,
        "invalid",
        "--args is not valid JSON",
    );
    // A name no saved workflow has is not found (issue 30: the kind its lookup gave).
    refused(
        &["run", "no-such-workflow", "--json"],
        2,
        "not_found",
        "unknown workflow \"no-such-workflow\"",
    );
    refused(
        &["run", s, "--json", "--concurrency", "lots"],
        2,
        "invalid",
        "--concurrency",
    );
    refused(
        &["run", s, "--json", "--no-such-flag"],
        2,
        "invalid",
        "--no-such-flag",
    );
    refused(&["launch", s, "--json"], 2, "invalid", "no coordinator");
    refused(
        &["wait", "wf_00000000-000", "--json"],
        2,
        "invalid",
        "no coordinator",
    );
    refused(
        &["resume", "wf_00000000-000", "--json"],
        2,
        "invalid",
        "no coordinator",
    );
    // A run the store does not have is not found, not invalid (issue 30).
    refused(
        &["show", "wf_00000000-000", "--json"],
        2,
        "not_found",
        "run wf_00000000-000 not found",
    );
    refused(
        &["logs", "wf_00000000-000", "--json"],
        2,
        "not_found",
        "run wf_00000000-000 not found",
    );
    // Without --json, stdout stays empty.
    let out = env.flotilla(&["run", s, "--args", "{bad"]);
    assert_eq!((out.code, out.stdout.as_str()), (2, ""), "{out:?}");
}

#[test]
fn without_a_backend_named_the_one_this_machine_has_is_used_or_the_choices_are_given() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let s = env.script("x", "return 1;");
    let s = s.to_str().unwrap();
    let named = env.script("named", "return 1;");
    std::fs::write(
        &named,
        "export const meta = { name: 'named', description: 'd', backend: 'echo' };\nreturn 1;\n",
    )
    .unwrap();
    let bin = env.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let empty = env.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let claude = bin.join("claude");
    std::fs::write(&claude, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&claude, std::fs::Permissions::from_mode(0o755)).unwrap();
    // The suite's own default (echo, from .cargo/config.toml) taken away: what a user gets.
    let plan = |args: &[&str], vars: &[(&str, &str)]| {
        let mut cmd = env.command(args, vars);
        cmd.env_remove("FLOTILLA_DEFAULT_BACKEND")
            .env_remove("ANTHROPIC_API_KEY")
            .env_remove("FLOTILLA_CLAUDE_BIN");
        cmd.envs(vars.iter().copied());
        flotilla_tests::run_with_timeout(cmd, std::time::Duration::from_secs(30))
    };
    let path_with = bin.to_str().unwrap();
    let path_without = empty.to_str().unwrap();
    let out = plan(&["run", s, "--plan"], &[("PATH", path_with)]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stdout
            .contains("backend claude-code (chosen because the claude CLI is on PATH"),
        "{out:?}"
    );
    let out = plan(
        &["run", s, "--plan"],
        &[("PATH", path_without), ("ANTHROPIC_API_KEY", "sk-test")],
    );
    assert!(
        out.stdout
            .contains("backend anthropic (chosen because ANTHROPIC_API_KEY is set"),
        "{out:?}"
    );
    // Neither: refused, with the choices (a dry run among them), in JSON too.
    let out = plan(&["run", s, "--json"], &[("PATH", path_without)]);
    assert_eq!(out.code, 2, "{out:?}");
    let v: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("no agent backend") && message.contains("--backend echo for a dry run"),
        "{message}"
    );
    // Named by a flag or by the script's meta: that one, and nothing is said of a choice.
    for args in [
        vec!["run", s, "--plan", "--backend", "echo"],
        vec!["run", named.to_str().unwrap(), "--plan"],
    ] {
        let out = plan(&args, &[("PATH", path_with)]);
        assert!(
            out.stdout.contains("backend echo, model"),
            "{args:?}: {out:?}"
        );
    }
    // A run says which backend it got, once.
    let out = plan(
        &["run", s],
        &[
            ("PATH", path_without),
            ("FLOTILLA_CLAUDE_BIN", claude.to_str().unwrap()),
        ],
    );
    assert!(
        out.stderr
            .contains("backend claude-code (FLOTILLA_CLAUDE_BIN names the claude CLI;"),
        "{out:?}"
    );
}

#[test]
fn a_large_workflow_is_said_in_the_json_report_the_plain_output_and_show() {
    let env = Env::new();
    let s = env.script(
        "big",
        "return (await parallel(Array.from({ length: 30 }, (_, i) => () => agent('a ' + i)))).length;",
    );
    let (code, r) = env.run(&s, &["--stagger", "0"]);
    assert_eq!(code, 0, "{r}");
    let w = r["warnings"][0].as_str().unwrap_or_default();
    assert!(w.starts_with("Large workflow: 30 agents"), "{r}");
    let plain = env.flotilla(&["run", s.to_str().unwrap(), "--stagger", "0"]);
    assert!(
        plain.stderr.contains("warning: Large workflow: 30 agents"),
        "{plain:?}"
    );
    let shown = env.flotilla(&["show", r["run_id"].as_str().unwrap()]);
    assert!(
        shown.stdout.contains("warning   Large workflow: 30 agents"),
        "{shown:?}"
    );
    // A small run says nothing of the kind.
    let small = env.script("small", "return await agent('one');");
    let (_, r) = env.run(&small, &[]);
    assert!(r.get("warnings").is_none(), "{r}");
}

#[test]
fn runs_lists_and_show_reopens_stored_runs() {
    let env = Env::new();
    let s = env.script("listed", "log('hi');\nreturn await agent('p');");
    let (code, r) = env.run(&s, &[]);
    assert_eq!(code, 0);
    let id = r["run_id"].as_str().unwrap();
    let runs = env.flotilla(&["runs", "--json"]).json();
    assert_eq!(runs[0]["run_id"], id);
    assert_eq!(runs[0]["status"], "completed");
    assert_eq!(runs[0]["workflow"], "listed");
    let shown = env.flotilla(&["show", id, "--json"]);
    assert_eq!(shown.code, 0);
    assert_eq!(shown.json(), r, "show prints the stored report");
    let text = env.flotilla(&["show", id]);
    assert!(
        text.stdout.contains("completed") && text.stdout.contains("log: hi"),
        "{}",
        text.stdout
    );
    let missing = env.flotilla(&["show", "wf_deadbeef-000"]);
    assert_eq!(missing.code, 2);
    assert!(missing.stderr.contains("not found"), "{}", missing.stderr);
}

#[test]
fn plain_output_prints_the_result_and_a_summary() {
    let env = Env::new();
    let s = env.script("plain", "log('note');\nreturn { a: await agent('x') };");
    let out = env.flotilla(&["run", s.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v, serde_json::json!({"a": "x"}));
    assert!(out.stderr.contains("log: note"), "{}", out.stderr);
    assert!(out.stderr.contains("completed in"), "{}", out.stderr);
}

#[test]
fn transcripts_and_journal_are_stored_per_call_and_attempt() {
    let env = Env::new();
    let s = env.script("stored", "return await agent('remember me [[stall:1]]');");
    let (code, r) = env.run(&s, &["--stall-timeout", "300ms"]);
    assert_eq!(code, 0, "{r}");
    let run = env
        .path()
        .join("store/runs")
        .join(r["run_id"].as_str().unwrap());
    // Transcript segments hold lines of {call, attempt, events}.
    let mut attempt2 = Vec::new();
    for f in std::fs::read_dir(run.join("transcripts")).unwrap() {
        for line in std::fs::read_to_string(f.unwrap().path()).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            if v["call"] == 0 && v["attempt"] == 2 {
                attempt2.extend(v["events"].as_array().unwrap().iter().cloned());
            }
        }
    }
    assert_eq!(attempt2[0]["type"], "init", "{attempt2:?}");
    assert!(
        attempt2
            .iter()
            .any(|e| e["text"] == "remember me [[stall:1]]"),
        "{attempt2:?}"
    );
    let journal: String = std::fs::read_dir(run.join("calls"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    let lines: Vec<serde_json::Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["result"], "remember me [[stall:1]]");
    assert_eq!(lines[0]["attempts"], 2);
    assert!(run.join("run.json").exists() && run.join("result.json").exists());
}

#[test]
fn large_results_are_stored_once_as_payloads_and_resume_reads_them() {
    let env = Env::new();
    let s = env.script(
        "big",
        "const r = await agent('x'.repeat(300000)); return r.length;",
    );
    let (code, r) = env.run(&s, &[]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 300000);
    let payloads = std::fs::read_dir(env.path().join("store/payloads"))
        .unwrap()
        .count();
    assert_eq!(payloads, 1);
    let (code, again) = env.run(&s, &["--resume", r["run_id"].as_str().unwrap()]);
    assert_eq!(code, 0, "{again}");
    assert_eq!(again["result"], 300000);
    assert_eq!(again["usage"]["cached"], 1);
}

#[test]
fn a_big_run_s_report_is_brief_unless_asked_and_its_agents_page_through() {
    let env = Env::new();
    let s = env.script(
        "big",
        "const calls = [];\nfor (let i = 0; i < 1200; i++) calls.push(agent(i === 1100 ? 'broken [[fail]]' : 'item ' + i, { label: 'item ' + i }));\nreturn (await Promise.all(calls)).filter(r => r === null).length;",
    );
    let (code, r) = env.run(&s, &["--max-agents", "2000", "--concurrency", "64"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 1);
    let listed = r["agents"].as_array().unwrap();
    assert_eq!(listed.len(), 1000);
    assert_eq!(r["agents_omitted"], 200);
    assert_eq!(r["usage"]["agents"], 1200, "the counters are whole");
    assert!(
        listed
            .iter()
            .any(|a| a["index"] == 1100 && a["status"] == "failed"),
        "the failed agent is listed although it is past the first thousand"
    );
    let run = r["run_id"].as_str().unwrap();
    let full = env.flotilla(&["show", run, "--json", "--full"]).json();
    assert_eq!(full["agents"].as_array().unwrap().len(), 1200);
    assert!(full.get("agents_omitted").is_none());
    let brief = env.flotilla(&["show", run]);
    assert!(brief.stdout.contains("200 more agents"), "{}", brief.stdout);

    // Every agent, a page at a time.
    let failed = env
        .flotilla(&["agents", run, "--status", "failed", "--json"])
        .json();
    assert_eq!(failed["total"], 1);
    assert_eq!(failed["agents"][0]["label"], "item 1100");
    let last = env
        .flotilla(&[
            "agents", run, "--offset", "1150", "--limit", "100", "--json",
        ])
        .json();
    assert_eq!(
        (
            last["total"].as_u64(),
            last["agents"].as_array().unwrap().len()
        ),
        (Some(1200), 50)
    );
    assert!(last["next_offset"].is_null());
    let first = env.flotilla(&["agents", run, "--limit", "10"]);
    assert_eq!(first.code, 0, "{}", first.stderr);
    assert!(
        first
            .stderr
            .contains("agents 1–10 of 1200 (next page: --offset 10)"),
        "{}",
        first.stderr
    );
    let bad = env.flotilla(&["agents", run, "--status", "done"]);
    assert_eq!(bad.code, 2);
    assert!(
        bad.stderr.contains("use one of queued, running"),
        "{}",
        bad.stderr
    );
}

/// Issue 29: a coordinator that cannot be reached is said one way by every client command:
/// what failed (the address) and what to check, no transport debug dump, exit status 3 (its
/// own: neither a failed run's 1 nor a refused request's 2), and with `--json` one refusal
/// object whose code is `unreachable`.
#[test]
fn an_unreachable_coordinator_is_said_alike_with_its_own_exit_status_by_every_client_command() {
    let env = Env::new();
    let pki = env.path().join("pki");
    let pki_s = pki.to_str().unwrap();
    for args in [
        vec!["certs", "init", "--dir", pki_s],
        vec![
            "certs", "issue", "--dir", pki_s, "--name", "client", "--role", "client",
        ],
    ] {
        let out = env.flotilla(&args);
        assert_eq!(out.code, 0, "{out:?}");
    }
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://{}", closed.local_addr().unwrap());
    drop(closed);
    let s = env.script("x", "return await agent('x');");
    let s = s.to_str().unwrap();
    let run = "wf_00000000-000";
    let commands: Vec<Vec<&str>> = vec![
        vec!["launch", s, "--backend", "echo", "--source", "none"],
        vec!["launch", s, "--source", "none"],
        vec!["resume", run],
        vec!["wait", run],
        vec!["status", run],
        vec!["watch", run],
        vec!["stop", run],
        vec!["pause", run],
        vec!["restart", run, "--agent", "0"],
        vec!["runs"],
        vec!["show", run],
        vec!["agents", run],
        vec!["logs", run],
        vec!["changes", run],
        vec!["workers"],
        vec!["token", "create"],
        vec!["workflows", "list"],
        vec!["workflows", "push", s],
    ];
    for command in &commands {
        // Every one of them takes --json but `workflows push`.
        let mut forms = vec![command.clone()];
        if !command.starts_with(&["workflows", "push"]) {
            forms.push([command.clone(), vec!["--json"]].concat());
        }
        for mut args in forms {
            let json = args.contains(&"--json");
            args.extend(["--coordinator", &url, "--tls-dir", pki_s]);
            let out = env.flotilla(&args);
            assert_eq!(out.code, 3, "{args:?}: {out:?}");
            let said = format!(
                "cannot reach the coordinator at {url}: nothing accepts connections there; check that the coordinator runs"
            );
            assert!(out.stderr.contains(&said), "{args:?}: {out:?}");
            for debug in ["tonic::", "ConnectError(", "Os {", "code: '"] {
                assert!(!out.stderr.contains(debug), "{args:?}: {debug}: {out:?}");
            }
            if json {
                let v: serde_json::Value = serde_json::from_str(out.stdout.trim())
                    .unwrap_or_else(|e| panic!("{args:?}: not one JSON object ({e}): {out:?}"));
                assert_eq!(v["status"], "rejected", "{args:?}: {v}");
                assert_eq!(v["error"]["code"], "unreachable", "{args:?}: {v}");
                assert!(
                    v["error"]["message"].as_str().unwrap().contains(&said),
                    "{args:?}: {v}"
                );
            } else {
                assert_eq!(out.stdout, "", "{args:?}: {out:?}");
            }
        }
    }
}

/// Issue 29: the config file's keys are the flags in snake_case: `allowed_models` (the flag
/// `--allowed-models`) is taken and means what the flag means, as `label` does `--label`.
#[test]
fn the_config_file_takes_allowed_models_and_label_as_the_flags_name_them() {
    let env = Env::new();
    let s = env.script(
        "models",
        "return [await agent('a', { label: 'opus', model: 'opus' })];",
    );
    let config = env.file(
        "flotilla.toml",
        "allowed_models = [\"sonnet\"]\nlabel = [\"team=payments\"]\n",
    );
    let out = env.flotilla(&[
        "run",
        s.to_str().unwrap(),
        "--json",
        "--config",
        config.to_str().unwrap(),
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    assert_eq!(flotilla_tests::agent(&r, "opus")["model"], "sonnet", "{r}");
    let listed = env.flotilla(&["runs", "--label", "team=payments", "--json"]);
    assert_eq!(listed.code, 0, "{listed:?}");
    assert_eq!(listed.json()[0]["run_id"], r["run_id"], "{listed:?}");
}

/// `flotilla completions SHELL` prints a script the shell takes: bash, sourced, completes
/// `flotilla` and offers its commands; an unknown shell is a usage error naming the choices.
#[test]
fn completion_scripts_load_in_the_shell_and_offer_the_commands() {
    let env = Env::new();
    let out = env.flotilla(&["completions", "bash"]);
    assert_eq!(out.code, 0, "{out:?}");
    for cmd in ["launch", "ui", "runs", "completions"] {
        assert!(out.stdout.contains(cmd), "{cmd} in the script");
    }
    let script = env.path().join("flotilla.bash");
    std::fs::write(&script, &out.stdout).unwrap();
    // Loaded by a real bash, asked what follows `flotilla la`.
    let probe = format!(
        "source {}; COMP_WORDS=(flotilla la); COMP_CWORD=1; COMP_LINE='flotilla la'; COMP_POINT=11; \
         _flotilla flotilla la flotilla; complete -p flotilla; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display()
    );
    let b = std::process::Command::new("bash")
        .args(["--norc", "-c", &probe])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&b.stdout);
    assert!(b.status.success(), "{b:?}");
    assert!(said.contains("-F _flotilla flotilla"), "{said}");
    assert!(
        said.lines().any(|l| l == "launch"),
        "launch offered for `la`: {said}"
    );
    for shell in ["zsh", "fish"] {
        let out = env.flotilla(&["completions", shell]);
        assert!(
            out.code == 0 && out.stdout.contains("flotilla"),
            "{shell}: {out:?}"
        );
    }
    let bad = env.flotilla(&["completions", "nosh"]);
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(
        bad.stderr.contains("bash") && bad.stderr.contains("zsh"),
        "{bad:?}"
    );
}

/// `flotilla context`: contexts are added, listed, chosen and removed; bad names, bad
/// addresses and a damaged file are refused with what to do; with none current a command
/// that needs a coordinator says how to name one.
#[test]
fn contexts_are_kept_chosen_and_refused_when_wrong() {
    let env = Env::new();
    let none = env.flotilla(&["status", "wf_00000000-000"]);
    assert_eq!(none.code, 2, "{none:?}");
    assert!(
        none.stderr.contains("flotilla context use NAME"),
        "{none:?}"
    );
    let cur = env.flotilla(&["context", "current"]);
    assert!(
        cur.code != 0 && cur.stderr.contains("no current context"),
        "{cur:?}"
    );
    for (args, says) in [
        (
            vec![
                "context",
                "add",
                "a/b",
                "--coordinator",
                "https://h:1",
                "--insecure",
            ],
            "context name",
        ),
        (
            vec!["context", "add", "a", "--coordinator", "h:1", "--insecure"],
            "https://host:port",
        ),
        (
            vec!["context", "add", "a", "--coordinator", "https://h:1"],
            "--tls-dir",
        ),
    ] {
        let out = env.flotilla(&args);
        assert!(
            out.code != 0 && out.stderr.contains(says),
            "{args:?}: {out:?}"
        );
    }
    let pki = env.path().join("pki");
    let add = env.flotilla(&[
        "context",
        "add",
        "prod",
        "--coordinator",
        "https://10.0.0.1:7443",
        "--tls-dir",
        pki.to_str().unwrap(),
    ]);
    assert_eq!(add.code, 0, "{add:?}");
    let add = env.flotilla(&[
        "context",
        "add",
        "local",
        "--coordinator",
        "http://127.0.0.1:9",
        "--insecure",
        "--use",
    ]);
    assert_eq!(add.code, 0, "{add:?}");
    let list = env.flotilla(&["context"]);
    assert_eq!(list.stdout.lines().count(), 2, "{list:?}");
    assert!(
        list.stdout
            .contains("* local\thttp://127.0.0.1:9\tinsecure"),
        "{list:?}"
    );
    assert!(
        list.stdout.contains(&format!(
            "  prod\thttps://10.0.0.1:7443\tclient in {}",
            pki.display()
        )),
        "{list:?}"
    );
    let file = env.path().join(".config/flotilla/contexts.toml");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
    assert_eq!(mode & 0o077, 0, "readable by its owner only: {mode:o}");
    assert_eq!(env.flotilla(&["context", "current"]).stdout.trim(), "local");
    assert_eq!(env.flotilla(&["context", "remove", "local"]).code, 0);
    assert!(
        env.flotilla(&["context", "current"]).code != 0,
        "the current one removed"
    );
    std::fs::write(&file, "current = [").unwrap();
    let bad = env.flotilla(&["context", "list"]);
    assert!(
        bad.code != 0 && bad.stderr.contains("contexts file") && bad.stderr.contains("invalid"),
        "{bad:?}"
    );
}
