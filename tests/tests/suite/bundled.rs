//! The bundled workflows (W73–W74): structure and results on the `echo` backend (whose
//! answers `spec/echo-backend.md` fixes), the paths the echo backend cannot reach on the fake
//! API, and `ingest` / `reflect` end to end on the real Claude Code CLI.

use std::path::PathBuf;

use flotilla_tests::Env;
use flotilla_tests::fake_anthropic::FakeAnthropic;
use serde_json::{Value, json};

/// `flotilla run NAME --json --args ARGS` on the echo backend.
fn bundled(env: &Env, name: &str, args: &Value, extra: &[&str]) -> (i32, Value) {
    let text = args.to_string();
    let mut all = vec!["run", name, "--json", "--stagger", "0", "--args", &text];
    all.extend_from_slice(extra);
    let out = env.flotilla(&all);
    (out.code, out.json())
}

fn labels(r: &Value) -> Vec<String> {
    r["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["label"].as_str().unwrap().to_owned())
        .collect()
}

fn logged(r: &Value, needle: &str) -> bool {
    r["logs"]
        .as_array()
        .unwrap()
        .iter()
        .any(|l| l.as_str().unwrap().contains(needle))
}

#[test]
fn deep_research_scopes_searches_dedupes_verifies_and_synthesizes() {
    let env = Env::new();
    let (code, r) = bundled(&env, "deep-research", &json!("why is the sky blue"), &[]);
    assert_eq!(code, 0, "{r}");
    let res = &r["result"];
    // Echo: 2 angles; both searchers find the same 2 URLs, so 2 are dropped as duplicates.
    assert_eq!(
        res["counts"],
        json!({"angles": 2, "sources": 2, "duplicateSources": 2, "claims": 4, "verified": 4,
               "supported": 4, "refuted": 0, "unverified": 0})
    );
    assert!(logged(&r, "dropped 2 duplicate source(s)"), "{}", r["logs"]);
    assert_eq!(res["question"], "why is the sky blue");
    assert_eq!(res["sources"][0]["url"], "sources[0].url");
    assert_eq!(res["report"]["findings"][0]["confidence"], "high");
    // 1 scope + 2 searches + 2 fetches + 4 claims x 3 voters + 1 synthesis.
    assert_eq!(r["usage"]["agents"], 18);
    let groups: Vec<&str> = r["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["title"].as_str().unwrap())
        .collect();
    assert_eq!(groups, ["Scope", "Search", "Fetch", "Verify", "Synthesize"]);
    let l = labels(&r);
    assert!(l.contains(&"verify 4.3".to_owned()), "{l:?}");

    let (code, r) = bundled(&env, "deep-research", &json!({"question": ""}), &[]);
    assert_ne!(code, 0);
    assert!(
        r["error"].as_str().unwrap().contains("needs a question"),
        "{r}"
    );
}

#[test]
fn deep_research_reports_refuted_and_unverified_claims_apart() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    // The fake's made-up answers say `refuted: true`: every claim is refuted.
    let (code, r) = fake.run(
        &env,
        "anthropic",
        "return await workflow('deep-research', 'what is fake');",
        &["--stagger", "0"],
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let counts = &r["result"]["counts"];
    assert_eq!(counts["refuted"], counts["verified"], "{counts}");
    assert_eq!(counts["unverified"], 0);
    assert!(
        r["result"]["refuted"][0]["reasons"]
            .as_array()
            .unwrap()
            .len()
            >= 2
    );

    // Voters that fail abstain: claims they could not check are unverified, not refuted.
    let fake = FakeAnthropic::start();
    fake.when("Try to refute", "[[status:400]]");
    let (code, r) = fake.run(
        &env,
        "anthropic",
        "return await workflow('deep-research', 'what is fake');",
        &["--stagger", "0"],
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let counts = &r["result"]["counts"];
    assert_eq!(counts["unverified"], counts["verified"], "{counts}");
    assert_eq!(counts["refuted"], 0);
    assert!(logged(&r, "reported as unverified"), "{}", r["logs"]);
}

#[test]
fn code_review_finds_per_file_and_keeps_only_what_skeptics_confirm() {
    let env = Env::new();
    let (code, r) = bundled(
        &env,
        "code-review",
        &json!({"files": ["src/a.rs", "src/b.rs", "src/[[fail]].rs"]}),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let res = &r["result"];
    // Echo voters answer `confirmed: false`: nothing survives, and every finding is listed
    // as rejected with its location.
    assert_eq!(
        res["counts"],
        json!({"files": 3, "found": 4, "checked": 4, "confirmed": 0, "rejected": 4})
    );
    assert_eq!(res["rejected"][0]["location"], "src/a.rs:1");
    assert!(
        logged(&r, "the reviewer of src/[[fail]].rs failed"),
        "{}",
        r["logs"]
    );
    // 3 finders + 4 findings x 3 skeptics.
    assert_eq!(r["usage"]["agents"], 15);

    // On the fake, skeptics confirm (made-up `true`): findings are reported with locations.
    let fake = FakeAnthropic::start();
    let (code, r) = fake.run(
        &env,
        "anthropic",
        "return await workflow('code-review', { files: ['lib.rs'], voters: 2 });",
        &["--stagger", "0"],
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let findings = r["result"]["findings"].as_array().unwrap();
    assert!(!findings.is_empty(), "{r}");
    assert_eq!(findings[0]["location"], "lib.rs:1");
    assert_eq!(findings[0]["confirmations"], "2/2");
}

fn playbook() -> Value {
    json!([{"id": "r1", "rule": "Run the tests before committing", "helpful": 3, "harmful": 0}])
}

#[test]
fn reflect_writes_a_diary_validates_additions_and_merges_them() {
    let env = Env::new();
    let (code, r) = bundled(
        &env,
        "reflect",
        &json!({"transcript": "user: fix the build\nassistant: fixed it", "playbook": playbook()}),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let res = &r["result"];
    assert_eq!(res["diary"]["status"], "success");
    assert_eq!(res["diary"]["keyLearnings"][0], "keyLearnings[0]");
    let rules: Vec<&str> = res["playbook"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    assert_eq!(rules, ["r1", "r2", "r3"]);
    assert_eq!(res["playbook"][1]["rule"], "deltas[0].content");
    assert_eq!(res["accepted"].as_array().unwrap().len(), 2);
    assert_eq!(res["rejected"], json!([]));
    // diary + 1 reflector + 2 validators.
    assert_eq!(r["usage"]["agents"], 4);

    // A rule already in the playbook is reinforced, not added again.
    let (code, r) = bundled(
        &env,
        "reflect",
        &json!({"transcript": "t", "playbook": [
            {"id": "r1", "rule": "Deltas[0].content", "helpful": 1, "harmful": 0}]}),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let pb = r["result"]["playbook"].as_array().unwrap();
    assert_eq!(pb.len(), 2, "{pb:?}");
    assert_eq!(pb[0]["helpful"], 2);

    // dryRun: the proposals, nothing validated or merged.
    let (code, r) = bundled(
        &env,
        "reflect",
        &json!({"transcript": "t", "playbook": playbook(), "dryRun": true}),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"]["dryRun"], true);
    assert_eq!(r["result"]["proposals"].as_array().unwrap().len(), 2);
    assert!(r["result"].get("playbook").is_none());
    assert_eq!(r["usage"]["agents"], 2);
}

#[test]
fn a_reflector_that_fails_later_keeps_the_earlier_proposals() {
    let env = Env::new();
    // Windows of 20 characters: the second holds a marker that fails its reflector.
    let transcript = format!(
        "{:<20}{:<20}{}",
        "part one is fine", "two [[fail]]", "three"
    );
    let (code, r) = bundled(
        &env,
        "reflect",
        &json!({"transcript": transcript, "playbook": playbook(), "window": 20, "diaryChars": 20, "dryRun": true}),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"]["proposals"].as_array().unwrap().len(), 2, "{r}");
    assert!(
        logged(
            &r,
            "reflector 2/3 failed; keeping the proposals of the 1 completed"
        ),
        "{}",
        r["logs"]
    );
}

#[test]
fn reflect_flags_conflicts_and_rejects_what_validators_reject() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    fake.when(
        "propose typed deltas",
        r#"[[json:{"deltas": [
            {"type": "helpful", "ruleId": "r1", "reason": "used it"},
            {"type": "harmful", "ruleId": "r1", "reason": "it slowed us"},
            {"type": "add", "content": "Prefer small commits", "reason": "worked"},
            {"type": "add", "content": "Always use tabs", "reason": "taste"},
            {"type": "add", "reason": "no content"},
            {"type": "deprecate", "ruleId": "r9", "reason": "unknown"}]}]]"#,
    );
    fake.when(
        "Always use tabs",
        r#"[[json:{"verdict": "reject", "reason": "a preference, not a lesson"}]]"#,
    );
    fake.when(
        "Prefer small commits",
        r#"[[json:{"verdict": "refine", "refined": "Prefer small, focused commits", "reason": "clearer"}]]"#,
    );
    let args = json!({"transcript": "a session", "playbook": playbook()}).to_string();
    let (code, r) = fake.run(
        &env,
        "anthropic",
        &format!("return await workflow('reflect', {args});"),
        &["--stagger", "0"],
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let res = &r["result"];
    assert_eq!(
        res["warnings"],
        json!(["conflicting deltas for r1: helpful, harmful"])
    );
    assert_eq!(res["playbook"][0]["helpful"], 4);
    assert_eq!(res["playbook"][0]["harmful"], 1);
    assert_eq!(res["playbook"][1]["rule"], "Prefer small, focused commits");
    let reasons: Vec<&str> = res["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["reason"].as_str().unwrap())
        .collect();
    assert_eq!(
        reasons,
        ["a preference, not a lesson", "no content", "no rule r9"]
    );
}

#[test]
fn ingest_goes_source_by_source_in_the_wiki_and_lints_every_n() {
    let env = Env::new();
    let (code, r) = bundled(
        &env,
        "ingest",
        &json!({"wiki": "wiki", "sources": ["inbox/a.md", "inbox/b.md", "inbox/c.md"], "lintEvery": 2}),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let res = &r["result"];
    assert_eq!(
        res["counts"],
        json!({"sources": 3, "ingested": 3, "failed": 0, "operations": 6, "lintRuns": 2})
    );
    assert_eq!(res["lints"][0]["after"], 2);
    assert_eq!(res["lints"][1]["after"], 3);
    assert_eq!(res["lints"][1]["report"]["wiki"], "wiki");
    assert_eq!(
        labels(&r),
        [
            "ingest inbox/a.md",
            "ingest inbox/b.md",
            "lint",
            "ingest inbox/c.md",
            "lint"
        ]
    );
    // Sources are named by their path from the wiki (where the agents work): the fake-API
    // test below answers the prompt that names `../inbox/tides.md`.
}

fn claude_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/claude/node_modules/.bin/claude")
}

#[test]
fn ingest_on_the_real_cli_writes_the_pages_with_its_tools() {
    let env = Env::new();
    let ws = env.workspace();
    std::fs::create_dir_all(ws.join("wiki/pages")).unwrap();
    std::fs::create_dir_all(ws.join("inbox")).unwrap();
    std::fs::write(
        ws.join("wiki/SCHEMA.md"),
        "One page per subject under pages/.\n",
    )
    .unwrap();
    std::fs::write(ws.join("wiki/index.md"), "# Index\n").unwrap();
    std::fs::write(ws.join("wiki/log.md"), "").unwrap();
    std::fs::write(ws.join("inbox/tides.md"), "Tides follow the moon.\n").unwrap();
    let fake = FakeAnthropic::start();
    // The "model" does what the prompt asks with the CLI's Bash tool, then answers.
    fake.when(
        "the new source at ../inbox/tides.md",
        r#"[[bash:cp ../inbox/tides.md pages/tides.md && echo '- [tides](pages/tides.md)' >> index.md && echo 'ingested inbox/tides.md' >> log.md && echo ok]] [[json:{"operations": [{"op": "create", "page": "pages/tides.md", "reason": "new subject"}]}]]"#,
    );
    let bin = claude_bin().display().to_string();
    let mut vars: Vec<(String, String)> = fake.env();
    vars.push(("FLOTILLA_CLAUDE_BIN".into(), bin));
    // No FLOTILLA_ALLOW_TOOLS: the workflow's own `tools` list lets the agent use Bash.
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let out = env.flotilla_with_env(
        &[
            "run",
            "ingest",
            "--json",
            "--backend",
            "claude-code",
            "--stagger",
            "0",
            "--args",
            r#"{"wiki": "wiki", "sources": ["inbox/tides.md"]}"#,
        ],
        &vars,
    );
    let (code, r) = (out.code, out.json());
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"]["counts"]["lintRuns"], 1, "{r}");
    assert_eq!(
        r["result"]["ingested"][0]["operations"][0]["page"],
        "pages/tides.md"
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("wiki/pages/tides.md")).unwrap(),
        "Tides follow the moon.\n"
    );
    assert!(
        std::fs::read_to_string(ws.join("wiki/index.md"))
            .unwrap()
            .contains("[tides](pages/tides.md)")
    );
    assert_eq!(
        std::fs::read_to_string(ws.join("wiki/log.md")).unwrap(),
        "ingested inbox/tides.md\n"
    );
}

#[test]
fn reflect_runs_end_to_end_on_the_real_cli() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    fake.when(
        "propose typed deltas",
        r#"[[json:{"deltas": [{"type": "add", "content": "Read the schema first", "reason": "saved a retry"}]}]]"#,
    );
    let bin = claude_bin().display().to_string();
    let args = json!({"transcript": "user: add a page\nassistant: done", "playbook": playbook()});
    let (code, r) = fake.run(
        &env,
        "claude-code",
        &format!("return await workflow('reflect', {args});"),
        &["--stagger", "0"],
        &[("FLOTILLA_CLAUDE_BIN", bin.as_str())],
    );
    assert_eq!(code, 0, "{r}");
    let pb = r["result"]["playbook"].as_array().unwrap();
    assert_eq!(pb.len(), 2, "{r}");
    assert_eq!(pb[1]["rule"], "Read the schema first");
    assert_eq!(
        r["result"]["diary"]["status"], "success",
        "the fake fills enums with their first member"
    );
}
