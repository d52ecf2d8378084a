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

/// Issue 33, 3, for the Chat Completions backend: an attempt that stalls mid-conversation
/// hands back its messages, and the next attempt continues them: its first request carries the
/// model's earlier answer and the feedback on it, not the bare prompt again.
#[test]
fn a_stalled_attempt_s_messages_are_continued_by_the_next() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    let (_code, r) = run(
        &env,
        &fake,
        "try { return await agent('count [[json:{\"n\":\"three\"}]] [[stall-at:1]]', \
           { label: 'count', model: 'gpt-test', schema: { type: 'object', properties: { n: { type: 'number' } }, required: ['n'] } }); } \
         catch (e) { return e.code; }",
        &["--schema-attempts", "3", "--stall-timeout", "2s"],
    );
    let said: Vec<usize> = chats(&fake)
        .iter()
        .map(|s| {
            s.body["messages"]
                .as_array()
                .map_or(0, |m| m.iter().filter(|x| x["role"] == "assistant").count())
        })
        .collect();
    // The bare prompt, the feedback on its answer (the request that stalls), then the next
    // attempt from that feedback on: started over, it would hold no answer.
    assert_eq!(said.get(..3), Some(&[0, 1, 1][..]), "{said:?}: {r}");
    let agent = flotilla_tests::agent(&r, "count");
    assert_eq!(agent["segments"][0]["outcome"], "stalled", "{r}");
    assert_eq!(agent["attempts"], 2, "{r}");
}
