//! W58–W59: stall restarts and usage-limit waits.

use flotilla_tests::{Env, agent, usage};
use serde_json::json;

#[test]
fn w58_stalled_attempts_restart_with_the_same_prompt() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await agent('work [[stall:2]]', { label: 'w' });",
        &["--stall-timeout", "300ms"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "work [[stall:2]]");
    assert_eq!(agent(&r, "w")["attempts"], 3);
    assert_eq!(usage(&r, "attempts"), 3);
    assert_eq!(usage(&r, "agents"), 1, "restarts are not new agents");
    let logs = r["logs"].as_array().unwrap();
    assert_eq!(
        logs.iter()
            .filter(|l| l
                .as_str()
                .unwrap()
                .starts_with("[stall] agent \"w\" stalled"))
            .count(),
        2,
        "{logs:?}"
    );
}

#[test]
fn w58_every_attempt_stalled_is_null_in_parallel_and_a_throw_when_awaited() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await parallel([() => agent('stuck [[stall]]', { label: 's' }), () => agent('ok')]);",
        &["--stall-timeout", "200ms", "--attempts", "3"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!([null, "ok"]));
    assert_eq!(agent(&r, "s")["attempts"], 3);
    assert_eq!(agent(&r, "s")["status"], "failed");
    assert!(
        r["failures"].as_array().unwrap().iter().any(|f| f
            .as_str()
            .unwrap()
            .starts_with("parallel[0] failed")
            && f.as_str().unwrap().contains("stalled on all 3 attempts")),
        "{r}"
    );
    let (code, r) = env.run_body(
        "return await agent('stuck [[stall]]');",
        &["--stall-timeout", "200ms", "--attempts", "2"],
    );
    assert_eq!(code, 1);
    assert!(
        r["error"]
            .as_str()
            .unwrap()
            .contains("agent stalled on all 2 attempts (no progress for 200ms each)"),
        "{r}"
    );
}

#[test]
fn keepalives_of_a_slow_agent_are_not_a_stall() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await agent('slow [[sleep:900]]', { label: 'slow' });",
        &["--stall-timeout", "300ms"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(agent(&r, "slow")["attempts"], 1);
}

#[test]
fn w59_rate_limits_wait_and_never_fail_the_call() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await agent('limited [[ratelimit:3]]', { label: 'l' });",
        &["--attempts", "2"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "limited [[ratelimit:3]]");
    assert_eq!(agent(&r, "l")["status"], "completed");
    assert_eq!(
        agent(&r, "l")["attempts"],
        4,
        "three limited sessions, then the answer"
    );
    assert!(usage(&r, "duration_ms") >= 600, "waited 3 × 200 ms");
    assert_eq!(usage(&r, "errors"), 0);
}

/// Issue 29: a Claude Code script gets Claude Code's attempts by default — no run-wide retry
/// budget takes them away — and an agent awaited directly that stalls on all of them rejects
/// with `STALLED`, not a `null`.
#[test]
fn by_default_every_agent_gets_its_attempts_and_a_stall_rejects_stalled() {
    let env = Env::new();
    let body = "const fanout = await parallel([\n\
          () => agent('[[stall:1]] recovers on the second attempt', { label: 'flaky' }),\n\
          () => agent('[[stall]] never makes progress', { label: 'stuck-in-parallel' }),\n\
          () => agent('healthy sibling', { label: 'healthy' }),\n\
        ])\n\
        let direct\n\
        try { direct = await agent('[[stall]] awaited directly', { label: 'direct' }) } catch (e) { direct = 'threw: ' + e.code + ' ' + e.message }\n\
        return { fanout, direct }";
    let (code, r) = env.run_body(body, &["--stall-timeout", "300ms", "--attempts", "6"]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(agent(&r, "flaky")["attempts"], 2, "{r}");
    assert_eq!(agent(&r, "stuck-in-parallel")["attempts"], 6, "{r}");
    assert_eq!(agent(&r, "direct")["attempts"], 6, "{r}");
    let direct = r["result"]["direct"]
        .as_str()
        .unwrap_or_else(|| panic!("{r}"));
    assert!(direct.starts_with("threw: STALLED"), "{direct}");
    assert_eq!(r["result"]["fanout"][2], "healthy sibling", "{r}");
}

/// Issue 29: a retry budget the run asked for, once spent, ends a stalling agent as its last
/// attempt would have: it still rejects with `STALLED`, and the message says the budget ran
/// out.
#[test]
fn a_spent_retry_budget_keeps_the_failure_s_cause_and_code() {
    let env = Env::new();
    let body = "const first = await agent('[[stall:1]] spends the one retry', { label: 'first' });\n\
        try { await agent('[[stall]] finds none left', { label: 'second' }); return 'resolved'; }\n\
        catch (e) { return first + ' | ' + e.code + ' | ' + e.message; }";
    let (code, r) = env.run_body(
        body,
        &[
            "--stall-timeout",
            "300ms",
            "--attempts",
            "6",
            "--retry-budget",
            "1",
        ],
    );
    assert_eq!(code, 0, "{r}");
    let text = r["result"].as_str().unwrap_or_else(|| panic!("{r}"));
    assert!(text.contains("| STALLED |"), "{text}");
    assert!(text.contains("retry budget is spent"), "{text}");
    assert_eq!(agent(&r, "second")["attempts"], 1, "{r}");
}
