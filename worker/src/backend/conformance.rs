//! What every `AgentBackend` must do, checked the same way for each: an answered call comes
//! back once, with a transcript that starts with `init` and ends with the `result` that says
//! how it ended; a cancelled attempt returns soon after its cancel with `Cancelled` and leaves
//! no process behind; a structured result is validated against the call's schema, and one that
//! never validates fails the call with `Schema` after the call's submissions. The HTTP
//! backends run against the local fake of the model APIs (`flotilla-tests`), never the
//! network; the Claude Code CLI is the real, pinned binary (`.tools/claude`) against that fake.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_proto::v1::{self, FailureKind, ProgressKind};
use flotilla_tests::fake_anthropic::FakeAnthropic;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::seam::{AgentBackend, EventSink, Events, Output, Task, run_attempt};

/// What one attempt sent while it ran.
#[derive(Default)]
struct Seen {
    progress: Mutex<Vec<ProgressKind>>,
    transcript: Mutex<Vec<Value>>,
}

impl EventSink for Seen {
    fn progress(&self, kind: ProgressKind, _output_tokens: u64, _detail: String) {
        self.progress.lock().unwrap().push(kind);
    }
    fn transcript(&self, event: Value) {
        self.transcript.lock().unwrap().push(event);
    }
}

/// One backend under test, with the prompts that make it do each thing.
struct Case {
    name: &'static str,
    backend: Arc<dyn AgentBackend>,
    /// Answered with text containing `answer`.
    plain: &'static str,
    answer: &'static str,
    /// Works until cancelled.
    slow: &'static str,
    /// With [`schema`]: answered `{"n": 1}` / never answered validly.
    valid: &'static str,
    invalid: &'static str,
    dir: tempfile::TempDir,
    /// Kept running for the HTTP backends.
    _fake: Option<FakeAnthropic>,
}

fn schema() -> Value {
    json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
}

impl Case {
    fn task(&self, prompt: &str, schema: Option<Value>) -> Task {
        let limits = crate::limits::Limits::default();
        Task {
            run_id: "wf_conformance".into(),
            call: 0,
            attempt: 1,
            call_key: "k".into(),
            spec: v1::TaskSpec {
                prompt: prompt.into(),
                backend: self.name.into(),
                model: "test-model".into(),
                schema_json: schema.as_ref().map(Value::to_string),
                schema_attempts: 2,
                ..v1::TaskSpec::default()
            },
            schema,
            workspace: crate::workspace::Workspace::new(self.dir.path()),
            worktree: None,
            sandbox: crate::sandbox::Sandbox::Off,
            limits: Arc::new(limits.attempt("conformance")),
            tmp_size: limits.settings.tmp,
            trace_parent: None,
        }
    }

    /// Runs one attempt to its end; what it returned and what it sent.
    async fn run(
        &self,
        prompt: &str,
        schema: Option<Value>,
        cancel: CancellationToken,
        seen: Arc<Seen>,
    ) -> Result<Output, crate::failure::Error> {
        let task = self.task(prompt, schema);
        let events = Events::new(seen);
        tokio::time::timeout(
            Duration::from_secs(120),
            run_attempt(&*self.backend, &task, &events, cancel),
        )
        .await
        .unwrap_or_else(|_| panic!("{}: the attempt never ended", self.name))
    }
}

/// This process's live children, by pid (a cancelled attempt must leave none).
fn children() -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    out.retain(|pid| state(*pid).is_some_and(|s| s != "Z"));
    out.sort_unstable();
    out
}

/// A process's state letter (`Z`: dead, its status not read yet), if it exists.
fn state(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().next().map(str::to_owned)
}

/// Processes still in process group `pgid`.
fn in_group(pgid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...: the fields after the command's closing parenthesis.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        if rest
            .split_whitespace()
            .nth(2)
            .and_then(|g| g.parse::<u32>().ok())
            == Some(pgid)
        {
            out.push(pid);
        }
    }
    out
}

/// The transcript rule: `init` first, and last the `result` that says how the attempt ended.
fn check_transcript(name: &str, events: &[Value], failed: bool) {
    let kind = |e: &Value| e.get("type").and_then(Value::as_str).map(str::to_owned);
    assert_eq!(
        events.first().and_then(kind).as_deref(),
        Some("init"),
        "{name}: the transcript starts with init: {events:?}"
    );
    let last = events.last().expect("a transcript");
    assert_eq!(kind(last).as_deref(), Some("result"), "{name}: {events:?}");
    assert_eq!(
        last.get("is_error").and_then(Value::as_bool),
        Some(failed),
        "{name}: the last result says how the attempt ended: {events:?}"
    );
}

async fn answers_once_with_its_transcript_in_order(c: &Case) {
    let seen = Arc::new(Seen::default());
    let out = c
        .run(c.plain, None, CancellationToken::new(), seen.clone())
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", c.name));
    assert!(out.text.contains(c.answer), "{}: {:?}", c.name, out.text);
    assert!(out.json.is_none(), "{}: no schema, no json", c.name);
    check_transcript(c.name, &seen.transcript.lock().unwrap(), false);
    assert!(
        !seen.progress.lock().unwrap().is_empty(),
        "{}: an attempt that worked said so as it went",
        c.name
    );
}

async fn a_cancel_ends_the_attempt_and_leaves_no_process(c: &Case) {
    let before = children();
    let seen = Arc::new(Seen::default());
    let cancel = CancellationToken::new();
    let run = c.run(c.slow, None, cancel.clone(), seen.clone());
    tokio::pin!(run);
    // Cancelled once it is under way (it said something), not before it began.
    let watch = async {
        while seen.progress.lock().unwrap().is_empty() && seen.transcript.lock().unwrap().len() < 2
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cancel.cancel();
        std::future::pending::<()>().await
    };
    let r = tokio::select! {
        r = &mut run => r,
        _ = watch => unreachable!(),
    };
    let e = r.expect_err("a cancelled attempt does not complete");
    assert_eq!(e.kind, FailureKind::Cancelled, "{}: {e}", c.name);
    check_transcript(c.name, &seen.transcript.lock().unwrap(), true);
    // Its processes are gone once it returned; the kernel may take a moment to finish off
    // what was killed.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while children().iter().any(|p| !before.contains(p)) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = children();
    let left: Vec<&u32> = after.iter().filter(|p| !before.contains(p)).collect();
    assert!(
        left.is_empty(),
        "{}: processes left behind: {left:?}",
        c.name
    );
    // A backend that started a process group names it in `init`: nothing of it is left.
    let group = seen.transcript.lock().unwrap()[0]
        .get("pid")
        .and_then(Value::as_u64);
    if let Some(pgid) = group {
        // Killed as the attempt ended; the kernel may take a moment to finish them off.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !in_group(pgid as u32).is_empty() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let left = in_group(pgid as u32);
        assert!(
            left.is_empty(),
            "{}: its process group lives on: {left:?}",
            c.name
        );
    }
}

async fn a_structured_result_is_validated_against_the_schema(c: &Case) {
    let seen = Arc::new(Seen::default());
    let out = c
        .run(
            c.valid,
            Some(schema()),
            CancellationToken::new(),
            seen.clone(),
        )
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", c.name));
    assert_eq!(out.json, Some(json!({"n": 1})), "{}", c.name);
    check_transcript(c.name, &seen.transcript.lock().unwrap(), false);

    let seen = Arc::new(Seen::default());
    let e = c
        .run(
            c.invalid,
            Some(schema()),
            CancellationToken::new(),
            seen.clone(),
        )
        .await
        .expect_err("a result that never validates fails its call");
    assert_eq!(e.kind, FailureKind::Schema, "{}: {e}", c.name);
    check_transcript(c.name, &seen.transcript.lock().unwrap(), true);
}

async fn conforms(c: Case) {
    answers_once_with_its_transcript_in_order(&c).await;
    a_cancel_ends_the_attempt_and_leaves_no_process(&c).await;
    a_structured_result_is_validated_against_the_schema(&c).await;
}

fn dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary directory")
}

/// The fake's variables for the HTTP backends' `from_vars`.
fn fake_vars(fake: &FakeAnthropic) -> impl Fn(&str) -> Option<String> + use<> {
    let vars = fake.env();
    move |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
}

#[tokio::test]
async fn echo_conforms() {
    conforms(Case {
        name: "echo",
        backend: Arc::new(super::echo::Echo),
        plain: "hello there",
        answer: "hello there",
        slow: "wait [[sleep:60000]]",
        valid: "give n",
        invalid: "never valid [[invalid]]",
        dir: dir(),
        _fake: None,
    })
    .await;
}

#[tokio::test]
async fn exec_conforms() {
    // The prompt picks what the command does: a long sleep (in a child of its own, which
    // must die with it), a valid or an invalid structured result, or an echo.
    let cmd = r#"read -r p; case "$p" in
      slow*) echo started >&2; sleep 600 & wait ;;
      valid*) echo '{"n": 1}' ;;
      invalid*) echo '{"n": "one"}' ;;
      *) echo "said: $p" ;;
    esac"#;
    conforms(Case {
        name: "exec",
        backend: Arc::new(super::exec::Exec::new(cmd)),
        plain: "hello there",
        answer: "said: hello there",
        slow: "slow one",
        valid: "valid one",
        invalid: "invalid one",
        dir: dir(),
        _fake: None,
    })
    .await;
}

/// An HTTP backend against the fake: the same prompts for each.
fn http_case(name: &'static str, make: impl Fn(&FakeAnthropic) -> Arc<dyn AgentBackend>) -> Case {
    flotilla_proto::tls::install_crypto_provider();
    let fake = FakeAnthropic::start();
    Case {
        name,
        backend: make(&fake),
        plain: "hello there",
        answer: "fake reply to: hello there",
        slow: "hold on [[stall-first:5]]",
        valid: r#"give [[json:{"n": 1}]]"#,
        invalid: r#"give [[json:{"n": "one"}]]"#,
        dir: dir(),
        _fake: Some(fake),
    }
}

#[tokio::test]
async fn anthropic_conforms_against_the_fake_api() {
    conforms(http_case("anthropic", |fake| {
        Arc::new(super::anthropic::Anthropic::from_vars(&fake_vars(fake)))
    }))
    .await;
}

#[tokio::test]
async fn openai_conforms_against_the_fake_api() {
    conforms(http_case("openai", |fake| {
        Arc::new(super::openai::OpenAi::from_vars(&fake_vars(fake)))
    }))
    .await;
}

/// The pinned Claude Code CLI (`.ci/run` installs it under `.tools/claude`); a missing one is
/// a failure with the install command, never a skip.
fn claude_bin() -> String {
    if let Ok(p) = std::env::var("FLOTILLA_CLAUDE_BIN") {
        return p;
    }
    let p = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../.tools/claude/node_modules/.bin/claude");
    assert!(
        p.exists(),
        "the pinned Claude Code CLI is missing at {}; install it with `npm install --prefix .tools/claude @anthropic-ai/claude-code@2.1.332` (.ci/run does)",
        p.display()
    );
    p.display().to_string()
}

#[tokio::test]
async fn claude_code_conforms_against_the_fake_api() {
    let bin = claude_bin();
    conforms(http_case("claude-code", move |fake| {
        let vars = fake_vars(fake);
        let get = |k: &str| {
            if k == "FLOTILLA_CLAUDE_BIN" {
                Some(bin.clone())
            } else {
                vars(k)
            }
        };
        Arc::new(super::claude::ClaudeCode::from_vars(&get))
    }))
    .await;
}
