//! The `anthropic` backend (the Messages API in Rust) against the in-repo fake.

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::Env;
use flotilla_tests::fake_anthropic::FakeAnthropic;
use serde_json::{Value, json};

fn run(env: &Env, fake: &FakeAnthropic, body: &str, extra: &[&str]) -> (i32, Value) {
    let mut args = vec!["--stagger", "0"];
    args.extend_from_slice(extra);
    run_raw(env, fake, body, &args)
}

fn run_raw(env: &Env, fake: &FakeAnthropic, body: &str, extra: &[&str]) -> (i32, Value) {
    fake.run(env, "anthropic", body, extra, &[])
}

fn posts(fake: &FakeAnthropic) -> Vec<flotilla_tests::fake_anthropic::Seen> {
    fake.requests()
        .into_iter()
        .filter(|s| s.method == "POST" && s.path.starts_with("/v1/messages"))
        .collect()
}

#[test]
fn a_text_result_with_cache_breakpoints_usage_and_cost() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run(&env, &fake, "return await agent('say hi');", &[]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "fake reply to: say hi", "{r}");
    let sent = posts(&fake);
    assert_eq!(sent.len(), 1);
    let body = &sent[0].body;
    assert_eq!(body["stream"], true);
    assert_eq!(
        body["system"][0]["cache_control"]["type"], "ephemeral",
        "{body}"
    );
    assert_eq!(
        body["messages"][0]["content"][0]["cache_control"]["type"], "ephemeral",
        "the end of the shared prefix is a breakpoint: {body}"
    );
    let key = sent[0]
        .headers
        .iter()
        .find(|(k, _)| k == "x-api-key")
        .map(|(_, v)| v.as_str());
    assert_eq!(key, Some("sk-ant-fake"));
    assert_eq!(
        sent[0].cache_read, 0,
        "nothing cached before the first request"
    );
    assert!(
        r["usage"]["cost_usd"].as_f64().unwrap() > 0.0,
        "{}",
        r["usage"]
    );
}

#[test]
fn a_schema_result_comes_from_the_forced_tool() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run(
        &env,
        &fake,
        "return await agent('count [[json:{\"n\":3}]]', \
           { schema: { type: 'object', properties: { n: { type: 'number' } }, required: ['n'] } });",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!({"n": 3}), "{r}");
    let body = &posts(&fake)[0].body;
    assert_eq!(body["tool_choice"]["name"], "StructuredOutput", "{body}");
}

#[test]
fn an_invalid_structured_output_gets_feedback_until_the_limit() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run(
        &env,
        &fake,
        "try { return await agent('count [[json:{\"n\":\"three\"}]]', \
           { schema: { type: 'object', properties: { n: { type: 'number' } }, required: ['n'] } }); } \
         catch (e) { return e.code; }",
        &["--schema-attempts", "2"],
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"], "SCHEMA_FAILED", "{r}");
    let sent = posts(&fake);
    assert_eq!(sent.len(), 2, "one request per submission");
    let feedback = sent[1].body["messages"].to_string();
    assert!(
        feedback.contains("tool_result") && feedback.contains("does not match"),
        "{feedback}"
    );
}

#[test]
fn an_overloaded_api_is_waited_out_and_fails_the_call_only_past_the_throttle_wait() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run(
        &env,
        &fake,
        "return await agent('busy [[status:529]]');",
        // Overloads are waits, not attempts: one attempt allowed, and still it waits them out.
        &["--attempts", "1", "--throttle-wait", "3s"],
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"], Value::Null, "{r}");
    let failures = r["failures"].to_string();
    assert!(failures.contains("HTTP 529"), "{r}");
    assert!(failures.contains("--throttle-wait"), "{r}");
    // retry-after: 1 each time, for three seconds.
    let sent = posts(&fake).len();
    assert!((3..=5).contains(&sent), "{sent} requests: {r}");
    assert_eq!(r["usage"]["waits"].as_u64(), Some(sent as u64 - 1), "{r}");
}

/// W60's value, measured: 20 agents that share a prefix (model, system prompt, tools), with the
/// prefix stagger on and off; how many of agents 2..20 read the cache on their first request.
#[test]
fn the_prefix_stagger_turns_a_fan_out_into_cache_reads() {
    let body = "return (await parallel(Array.from({ length: 20 }, (_, i) => () => agent('item ' + i)))).length;";
    let hits = |stagger: &str| {
        let env = Env::new();
        let fake = FakeAnthropic::start();
        let (code, r) = run_raw(
            &env,
            &fake,
            body,
            &["--stagger", stagger, "--concurrency", "20"],
        );
        assert_eq!(code, 0, "{r}");
        assert_eq!(r["result"], 20);
        let sent = posts(&fake);
        assert_eq!(sent.len(), 20);
        sent.iter().skip(1).filter(|s| s.cache_read > 0).count()
    };
    let on = hits("5s");
    let off = hits("0");
    eprintln!("followers reading the cache: stagger on {on}/19, stagger off {off}/19");
    assert_eq!(
        on, 19,
        "with the stagger, every follower starts after the leader's response began"
    );
    assert!(
        off < 10,
        "without it, most start before the prefix is cached ({off}/19)"
    );
}

/// Issue 33, 3, for the Messages API backend: an attempt that stalls mid-conversation hands
/// back its message history, and the next attempt continues it: its first request carries the
/// feedback the stalled one had been given, not the bare prompt again.
#[test]
fn a_stalled_attempt_s_message_history_is_continued_by_the_next() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (_code, r) = run(
        &env,
        &fake,
        "try { return await agent('count [[json:{\"n\":\"three\"}]] [[stall-at:1]]', \
           { label: 'count', schema: { type: 'object', properties: { n: { type: 'number' } }, required: ['n'] } }); } \
         catch (e) { return e.code; }",
        &["--schema-attempts", "3", "--stall-timeout", "2s"],
    );
    let turns: Vec<usize> = posts(&fake)
        .iter()
        .map(|s| flotilla_tests::fake_anthropic::tool_results(&s.body))
        .collect();
    // The bare prompt, its feedback (the request that stalls), then the next attempt from
    // that feedback on: started over, it would send none.
    assert_eq!(turns.get(..3), Some(&[0, 1, 1][..]), "{turns:?}: {r}");
    let agent = flotilla_tests::agent(&r, "count");
    assert_eq!(agent["segments"][0]["outcome"], "stalled", "{r}");
    assert_eq!(agent["attempts"], 2, "{r}");
}
