//! A person's answer, durably awaited (issue 33, 1): `ask()` in a script records the question
//! and waits; `flotilla answer` (or the page, or `WorkflowAnswer`) answers it, checked against
//! its schema; a timeout ends it with `null`; a resumed run gets the stored answers without
//! asking again. Real processes: an embedded `flotilla run` answered from another process.

use flotilla_tests::{Env, eventually};
use serde_json::{Value, json};
use std::process::Stdio;

/// A script that asks twice: once with a schema (answered), once with a short timeout.
const ASKS: &str = "const notes = await agent('draft the release notes');\n\
const ok = await ask('Ship it?', { schema: { type: 'object', properties: { approve: { type: 'boolean' } }, required: ['approve'] }, label: 'ship' });\n\
const later = await ask('Anything to add?', { timeout: '1s' });\n\
return { notes, ok, later };";

/// The id of the one run in the environment's store, once there is one.
fn the_run(env: &Env) -> String {
    let mut id = String::new();
    assert!(
        eventually(30, || {
            let out = env.flotilla(&["runs", "--json"]);
            id = serde_json::from_str::<Value>(&out.stdout)
                .ok()
                .and_then(|v| v.as_array().and_then(|a| a.first().cloned()))
                .and_then(|r| r["run_id"].as_str().map(str::to_owned))
                .unwrap_or_default();
            !id.is_empty()
        }),
        "the run never showed in the store"
    );
    id
}

#[test]
fn an_embedded_run_waits_for_its_answer_from_another_process_and_its_resume_does_not_ask_again() {
    let env = Env::new();
    let script = env.script("asks", ASKS);
    let report_file = env.path().join("report.json");
    let mut run = env
        .command(
            &["run", script.to_str().unwrap(), "--json", "--stagger", "0"],
            &[],
        )
        .stdout(std::fs::File::create(&report_file).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let id = the_run(&env);
    // The question shows in the store, listed by `flotilla answer RUN` without an answer.
    let mut listed = String::new();
    assert!(
        eventually(30, || {
            listed = env.flotilla(&["answer", &id]).stdout;
            listed.contains("Ship it?")
        }),
        "the question was never listed: {listed}"
    );
    assert!(listed.contains("\"approve\""), "its schema: {listed}");
    // Refused: a value its schema refuses, and text that is not JSON; it stays open.
    let wrong = env.flotilla(&["answer", &id, "--json", r#"{"approve": "yes"}"#]);
    assert_ne!(wrong.code, 0, "{wrong:?}");
    assert!(
        wrong.stderr.contains("does not match the schema")
            && wrong.stderr.contains("/approve")
            && wrong.stderr.contains("stays open"),
        "{wrong:?}"
    );
    let not_json = env.flotilla(&["answer", &id, "--json", "yes please"]);
    assert_ne!(not_json.code, 0, "{not_json:?}");
    assert!(not_json.stderr.contains("is not JSON"), "{not_json:?}");
    let unknown = env.flotilla(&["answer", &id, "--question", "q_000000000000", "--json", "1"]);
    assert_ne!(unknown.code, 0, "{unknown:?}");
    assert!(
        unknown.stderr.contains("no question q_000000000000"),
        "{unknown:?}"
    );
    assert!(
        env.flotilla(&["answer", &id]).stdout.contains("Ship it?"),
        "still open"
    );
    let right = env.flotilla(&["answer", &id, "--json", r#"{"approve": true}"#]);
    assert_eq!(right.code, 0, "{right:?}");
    assert!(right.stderr.contains("answered"), "{right:?}");
    // The second question times out: `ask()` gives null, and the run completes.
    let status = run.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&report_file).unwrap())
        .expect("the run's report");
    assert_eq!(
        report["result"],
        json!({ "notes": "draft the release notes", "ok": { "approve": true }, "later": null }),
        "{report}"
    );
    let questions = report["questions"]
        .as_array()
        .expect("questions in the report");
    assert_eq!(questions.len(), 2, "{report}");
    assert_eq!(questions[0]["question"], "Ship it?");
    assert_eq!(questions[0]["label"], "ship");
    assert!(
        questions[0]["answer"]["by"]
            .as_str()
            .is_some_and(|b| b.starts_with("local user")),
        "who answered: {report}"
    );
    assert_eq!(questions[1]["answer"]["timed_out"], true, "{report}");
    assert_eq!(questions[1]["answer"]["value"], Value::Null, "{report}");
    // A question of a run that has ended is not answered.
    let late = env.flotilla(&["answer", &id, "--json", "true"]);
    assert_ne!(late.code, 0, "{late:?}");
    assert!(late.stderr.contains("has ended"), "{late:?}");
    // The resume gets both answers from the run it resumes: it completes with nobody
    // answering, the same result, and its log says where the answers came from.
    let (code, resumed) = env.run(&script, &["--stagger", "0", "--resume", &id]);
    assert_eq!(code, 0, "{resumed}");
    assert_eq!(resumed["result"], report["result"], "{resumed}");
    let logs = resumed["logs"].to_string();
    assert!(
        logs.contains(&format!("answered in {id} by local user")),
        "{logs}"
    );
    assert!(
        !logs.contains("answer with `flotilla answer"),
        "asked again: {logs}"
    );
}

#[test]
fn ask_refuses_a_schema_that_is_not_one_and_a_bad_timeout_with_its_code() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const codes = [];\n\
         for (const bad of [{ schema: { type: 'nonsense' } }, { timeout: 'soon' }, { label: 3 }]) {\n\
           try { await ask('q', bad); codes.push('asked'); } catch (e) { codes.push(e.code); }\n\
         }\n\
         return codes;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!(["SCHEMA_INVALID", "INVALID_OPTION", "INVALID_OPTION"]),
        "{r}"
    );
}
