//! The `openai` backend (chat completions) against the in-repo fake.

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::Env;
use flotilla_tests::fake_anthropic::FakeAnthropic;
use serde_json::{Value, json};

fn run(env: &Env, fake: &FakeAnthropic, body: &str, extra: &[&str]) -> (i32, Value) {
    let mut args = vec!["--stagger", "0"];
    args.extend_from_slice(extra);
    fake.run(env, "openai", body, &args, &[])
}

fn chats(fake: &FakeAnthropic) -> Vec<flotilla_tests::fake_anthropic::Seen> {
    fake.requests()
        .into_iter()
        .filter(|s| s.path.starts_with("/v1/chat/completions"))
        .collect()
}

#[test]
fn a_text_result_streams_with_usage() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (code, r) = run(
        &env,
        &fake,
        "return await agent('say hi', { model: 'gpt-test' });",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "fake reply to: say hi", "{r}");
    let sent = chats(&fake);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].body["model"], "gpt-test");
    assert_eq!(sent[0].body["stream_options"]["include_usage"], true);
    let auth = sent[0]
        .headers
        .iter()
        .find(|(k, _)| k == "authorization")
        .map(|(_, v)| v.as_str());
    assert_eq!(auth, Some("Bearer sk-openai-fake"));
    assert_eq!(r["usage"]["output_tokens"], 5, "{}", r["usage"]);
}

#[test]
fn a_schema_result_uses_the_json_schema_response_format_and_feedback() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let schema = "{ type: 'object', properties: { n: { type: 'number' } }, required: ['n'] }";
    let (code, r) = run(
        &env,
        &fake,
        &format!("return await agent('count [[json:{{\"n\":3}}]]', {{ schema: {schema} }});"),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!({"n": 3}), "{r}");
    assert_eq!(
        chats(&fake)[0].body["response_format"]["type"],
        "json_schema"
    );
    // An answer that never matches: feedback turns, then the call rejects.
    let (code, r) = run(
        &env,
        &fake,
        &format!(
            "try {{ return await agent('count [[json:{{\"n\":\"x\"}}]]', {{ schema: {schema} }}); }} catch (e) {{ return e.code; }}"
        ),
        &["--schema-attempts", "2"],
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"], "SCHEMA_FAILED", "{r}");
    let last = chats(&fake).last().unwrap().body["messages"].to_string();
    assert!(last.contains("does not match"), "{last}");
}
