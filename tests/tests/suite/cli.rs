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
