//! W51–W52: resume, content-keyed and ordered-prefix, including after an edit.

use flotilla_tests::{Env, agent, usage};
use serde_json::json;

fn run_id(r: &serde_json::Value) -> String {
    r["run_id"].as_str().unwrap().to_owned()
}

#[test]
fn content_resume_serves_every_completed_call_and_reruns_only_the_edited_one() {
    let env = Env::new();
    let body = |x: &str| {
        format!(
            "const items = ['a', 'b', 'c', 'd'];\n\
             const r = await pipeline(items,\n\
               it => agent('scan ' + it + (it === 'b' ? ' [[sleep:100]]' : ''), {{ label: 'scan ' + it }}),\n\
               (prev, it) => agent('check {x} ' + it, {{ label: 'check ' + it }}));\n\
             return r;"
        )
    };
    let s = env.script("resume", &body("v1"));
    let (code, first) = env.run(&s, &["--stagger", "0"]);
    assert_eq!(code, 0, "{first}");
    assert_eq!(usage(&first, "dispatched"), 8);

    // Same script: everything comes from the journal.
    let (code, again) = env.run(&s, &["--stagger", "0", "--resume", &run_id(&first)]);
    assert_eq!(code, 0, "{again}");
    assert_eq!(again["result"], first["result"]);
    assert_eq!(usage(&again, "cached"), 8);
    assert_eq!(usage(&again, "dispatched"), 0);
    assert_eq!(usage(&again, "attempts"), 0);
    assert_eq!(
        usage(&again, "output_tokens"),
        0,
        "a cached result costs nothing"
    );
    assert_eq!(again["parent_run_id"], json!(run_id(&first)));

    // Edit one prompt: only the changed calls run.
    std::fs::write(
        &s,
        std::fs::read_to_string(&s)
            .unwrap()
            .replace("check v1", "check v2"),
    )
    .unwrap();
    let (code, edited) = env.run(&s, &["--stagger", "0", "--resume", &run_id(&first)]);
    assert_eq!(code, 0, "{edited}");
    assert_eq!(usage(&edited, "cached"), 4);
    assert_eq!(usage(&edited, "dispatched"), 4);
    assert_eq!(agent(&edited, "scan a")["cached"], true);
    assert_eq!(agent(&edited, "check a")["cached"], false);
    assert_eq!(edited["result"][0], "check v2 a");

    // A resumed run's journal is complete: resuming it serves everything.
    let (code, chain) = env.run(&s, &["--stagger", "0", "--resume", &run_id(&edited)]);
    assert_eq!(code, 0);
    assert_eq!(usage(&chain, "cached"), 8);
}

#[test]
fn prefix_resume_reruns_from_the_first_failure_on() {
    let env = Env::new();
    // A, B, C, D start in that order and B fails (it stalls and the first run allows one
    // attempt): the relaunch serves A and runs B, C and D again (W51's documented example).
    let body = "const r = [];\n\
                for (const x of ['A', 'B', 'C', 'D']) {\n\
                  try { r.push(await agent(x === 'B' ? 'B [[stall:1]]' : x, { label: x })); } catch (e) { r.push(null); }\n\
                }\n\
                return r;";
    let s = env.script("prefix", body);
    let (code, first) = env.run(
        &s,
        &[
            "--stagger",
            "0",
            "--stall-timeout",
            "200ms",
            "--attempts",
            "1",
        ],
    );
    assert_eq!(code, 0, "{first}");
    assert_eq!(first["result"], json!(["A", null, "C", "D"]));
    let retry = [
        "--stagger",
        "0",
        "--stall-timeout",
        "200ms",
        "--attempts",
        "2",
        "--resume",
    ];
    let mut args = retry.to_vec();
    let id = run_id(&first);
    args.push(&id);
    args.extend(["--replay", "prefix"]);
    let (_, prefix) = env.run(&s, &args);
    assert_eq!(prefix["result"], json!(["A", "B [[stall:1]]", "C", "D"]));
    assert_eq!(agent(&prefix, "A")["cached"], true);
    for x in ["B", "C", "D"] {
        assert_eq!(
            agent(&prefix, x)["cached"],
            false,
            "{x} runs again after the failure"
        );
    }
    assert_eq!(usage(&prefix, "cached"), 1);
    assert_eq!(usage(&prefix, "dispatched"), 3);
    // Content mode keeps C and D, which completed.
    let mut args = retry.to_vec();
    args.push(&id);
    let (_, content) = env.run(&s, &args);
    assert_eq!(content["result"], prefix["result"]);
    assert_eq!(usage(&content, "cached"), 3);
    assert_eq!(usage(&content, "dispatched"), 1);
}

#[test]
fn resuming_a_missing_run_is_refused() {
    let env = Env::new();
    let s = env.script("x", "return 1;");
    let (code, r) = env.run(&s, &["--resume", "wf_00000000-000"]);
    assert_eq!(code, 2);
    assert_eq!(r["status"], "rejected");
    assert!(
        r["error"].as_str().unwrap().contains("nothing to resume"),
        "{r}"
    );
}

#[test]
fn both_replay_modes_ignore_a_changed_completion_order() {
    let env = Env::new();
    // Stage 1 finishes in reverse order, so stage 2 starts in reverse order in the first run;
    // on resume stage 1 is served at once, in order, and stage 2 starts in order.
    let s = env.script(
        "order",
        "const items = [0, 1, 2, 3, 4, 5];\n\
         return await pipeline(items,\n\
           i => agent('scan ' + i + ' [[sleep:' + (6 - i) * 80 + ']]', { label: 'scan ' + i }),\n\
           (prev, i) => agent('check ' + i + (i === 5 && args.broken ? ' [[fail]]' : ''), { label: 'check ' + i }));",
    );
    let (code, first) = env.run(&s, &["--stagger", "0", "--args", r#"{"broken":true}"#]);
    assert_eq!(code, 0, "{first}");
    assert_eq!(first["result"][5], serde_json::Value::Null, "{first}");
    let id = run_id(&first);
    let fixed = [
        "--stagger",
        "0",
        "--args",
        r#"{"broken":false}"#,
        "--resume",
        &id,
    ];
    let (code, content) = env.run(&s, &fixed);
    assert_eq!(code, 0, "{content}");
    assert_eq!(
        usage(&content, "dispatched"),
        1,
        "only the failed call runs again"
    );
    assert_eq!(usage(&content, "cached"), 11);
    assert_eq!(content["result"][5], "check 5");
    // The ordered prefix is this run's start order: check 5, the failed call, is the only
    // one started after the first miss.
    let mut prefix = fixed.to_vec();
    prefix.extend(["--replay", "prefix"]);
    let (code, ordered) = env.run(&s, &prefix);
    assert_eq!(code, 0, "{ordered}");
    assert_eq!(usage(&ordered, "dispatched"), 1, "{}", ordered["usage"]);
    assert_eq!(ordered["result"], content["result"]);
}

#[test]
fn prefix_replay_of_a_pipeline_run_with_concurrency_serves_every_call_up_to_the_first_change() {
    let env = Env::new();
    // Three stages of eight items, eight at a time; the sleeps make stages finish out of
    // order, so later stages start in an order of their own.
    let s = env.script(
        "stages",
        "const items = [0, 1, 2, 3, 4, 5, 6, 7];\n\
         return await pipeline(items,\n\
           i => agent('scan ' + i + ' [[sleep:' + ((i * 37) % 5) * 40 + ']]', { label: 'scan ' + i }),\n\
           (prev, i) => agent('check ' + i + (args.change === i ? ' again' : '') + ' [[sleep:' + ((i * 53) % 7) * 30 + ']]', { label: 'check ' + i }),\n\
           (prev, i) => agent('fix ' + i, { label: 'fix ' + i }));",
    );
    let base = ["--stagger", "0", "--concurrency", "8"];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|a| a.to_string()).collect()
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, r) = env.run(&s, &args);
        assert_eq!(code, 0, "{r}");
        r
    };
    let first = run(with(&["--args", r#"{"change":-1}"#]));
    let id = run_id(&first);
    let again = run(with(&[
        "--args",
        r#"{"change":-1}"#,
        "--resume",
        &id,
        "--replay",
        "prefix",
    ]));
    assert_eq!(usage(&again, "dispatched"), 0, "{}", again["usage"]);
    assert_eq!(usage(&again, "cached"), 24);
    assert_eq!(again["result"], first["result"]);
    // One prompt changed: it and every call this run started after it run again, and every
    // call started before it is served.
    let changed = run(with(&[
        "--args",
        r#"{"change":3}"#,
        "--resume",
        &id,
        "--replay",
        "prefix",
    ]));
    let from = agent(&changed, "check 3")["index"].as_u64().unwrap();
    for a in changed["agents"].as_array().unwrap() {
        let before = a["index"].as_u64().unwrap() < from;
        assert_eq!(
            a["cached"], before,
            "{} (started {}; the change started {from})",
            a["label"], a["index"]
        );
    }
    assert_eq!(usage(&changed, "dispatched"), 24 - from);
}

#[test]
fn the_resume_benchmark_reports_its_figures() {
    let env = Env::new();
    let out = env.flotilla(&["bench", "resume", "--calls", "300", "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    assert_eq!(r["cached"], 299, "{r}");
    assert_eq!(r["dispatched"], 1, "{r}");
    for field in ["first_run_ms", "first_new_dispatch_ms", "resume_ms"] {
        assert!(r[field].as_f64().is_some_and(|v| v > 0.0), "{field} in {r}");
    }
}
