//! W38–W40 and the runtime's own limits: concurrency, agent cap, CPU, memory, deadlock,
//! prefix stagger.

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::{Env, agents, max_overlap, usage};
use serde_json::json;

#[test]
fn w38_concurrency_cap_queues_the_rest() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return (await parallel(Array.from({ length: 10 }, (_, i) => () => agent('job ' + i + ' [[sleep:120]]')))).length;",
        &["--concurrency", "3"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 10);
    let overlap = max_overlap(&r);
    assert!(overlap <= 3, "at most 3 at once, saw {overlap}");
    assert!(overlap >= 2, "they did run concurrently ({overlap})");
    assert!(agents(&r).iter().all(|a| a["status"] == "completed"));
}

#[test]
fn w40_agent_cap_rejects_the_next_call_with_advice() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const got = [];\n\
         for (let i = 0; i < 10; i++) {\n\
           try { got.push(await agent('a' + i)); } catch (e) { return { got, code: e.code, message: e.message }; }\n\
         }\n\
         return { got };",
        &["--max-agents", "5"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"]["got"].as_array().unwrap().len(), 5);
    assert_eq!(r["result"]["code"], "AGENT_CAP");
    assert!(
        r["result"]["message"]
            .as_str()
            .unwrap()
            .contains("--budget")
    );
    assert_eq!(usage(&r, "agents"), 5);
}

#[test]
fn runaway_loop_fails_with_a_clear_message() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "await agent('first');\nwhile (true) {}",
        &["--script-cpu", "500ms"],
    );
    assert_eq!(code, 1);
    assert_eq!(r["status"], "failed");
    let e = r["error"].as_str().unwrap();
    assert!(
        e.contains("500ms of CPU time") && e.contains("runaway loop"),
        "{e}"
    );
    assert_eq!(
        r["agents"][0]["status"], "completed",
        "work done before the loop is kept"
    );
}

#[test]
fn memory_bomb_fails_with_a_clear_message() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const a = [];\nwhile (true) a.push('x'.repeat(1 << 20) + a.length);",
        &["--script-memory", "64"],
    );
    assert_eq!(code, 1, "{r}");
    let e = r["error"].as_str().unwrap();
    assert!(e.contains("out of memory") && e.contains("64 MiB"), "{e}");
}

#[test]
fn a_promise_that_can_never_settle_ends_the_run() {
    let env = Env::new();
    let (code, r) = env.run_body("await new Promise(() => {});\nreturn 1;", &[]);
    assert_eq!(code, 1);
    assert!(
        r["error"].as_str().unwrap().contains("can never settle"),
        "{r}"
    );
}

#[test]
fn unawaited_agents_are_cancelled_when_the_script_returns() {
    let env = Env::new();
    let (code, r) = env.run_body("agent('left behind [[sleep:5000]]');\nreturn 'early';", &[]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "early");
    assert_eq!(r["agents"][0]["status"], "cancelled");
    assert!(usage(&r, "duration_ms") < 5000);
}

#[test]
fn w60_prefix_stagger_holds_matching_agents_until_the_first_responds() {
    let env = Env::new();
    let body = "return await parallel([() => agent('lead [[sleep:300]]'), () => agent('b'), () => agent('c'), () => agent('other', { model: 'haiku' })]);";
    let script = env.script("stagger", body);
    let (code, r) = env.run(&script, &["--stagger", "5s"]);
    assert_eq!(code, 0, "{r}");
    let start = |label: &str| {
        agents(&r).iter().find(|a| a["label"] == label).unwrap()["start_ms"]
            .as_u64()
            .unwrap()
    };
    assert!(
        start("b") >= 300 && start("c") >= 300,
        "held until the leader's response began: {r}"
    );
    assert!(start("other") < 300, "a different prefix is not held: {r}");
    // With the stagger off nobody waits.
    let (code, r) = env.run(&script, &["--stagger", "0"]);
    assert_eq!(code, 0);
    let start = |label: &str| {
        agents(&r).iter().find(|a| a["label"] == label).unwrap()["start_ms"]
            .as_u64()
            .unwrap()
    };
    assert!(start("b") < 300 && start("c") < 300, "{r}");
    // The hold is capped.
    let (code, r) = env.run(&script, &["--stagger", "100ms"]);
    assert_eq!(code, 0);
    let start = |label: &str| {
        agents(&r).iter().find(|a| a["label"] == label).unwrap()["start_ms"]
            .as_u64()
            .unwrap()
    };
    assert!((100..300).contains(&start("b")), "released by the cap: {r}");
    assert_eq!(
        r["result"],
        json!(["lead [[sleep:300]]", "b", "c", "other"])
    );
}

#[test]
fn stall_restarts_give_their_slots_back() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "await parallel([0, 1, 2].map(i => () => agent('stalls once ' + i + ' [[stall:1]]')));\n\
         return await parallel([0, 1, 2, 3].map(i => () => agent('after ' + i + ' [[sleep:400]]', { label: 'after ' + i })));",
        &["--concurrency", "4", "--stall-timeout", "200ms"],
    );
    assert_eq!(code, 0, "{r}");
    let after: Vec<&serde_json::Value> = agents(&r)
        .iter()
        .filter(|a| a["label"].as_str().unwrap().starts_with("after"))
        .collect();
    let last_start = after
        .iter()
        .map(|a| a["start_ms"].as_u64().unwrap())
        .max()
        .unwrap();
    let first_end = after
        .iter()
        .map(|a| a["end_ms"].as_u64().unwrap())
        .min()
        .unwrap();
    assert!(
        last_start < first_end,
        "all four ran at once on four slots: {r}"
    );
}

#[test]
fn absurd_durations_and_array_sizes_are_refused_not_fatal() {
    let env = Env::new();
    let s = env.script("d", "return 1;");
    let out = env.flotilla(&["run", s.to_str().unwrap(), "--stall-timeout", "1000d"]);
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.contains("stall timeout must be at most"),
        "{}",
        out.stderr
    );
    let (code, r) = env.run_body(
        "try { await agent('x', { schema: { type: 'object', properties: { a: { type: 'array', minItems: 1e12 } } } }); } catch (e) { return e.code; }",
        &[],
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"], "INVALID_AGENT");
}
