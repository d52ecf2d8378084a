//! An interrupted agent continues its own session on another worker (issue 33, 3). Real
//! processes: a coordinator, sandboxed workers running the pinned Claude Code CLI against the
//! local fake API. The agent takes two turns on one worker and is waiting on its third model
//! call when that worker is stopped (a rolling deploy: SIGTERM); the worker interrupts it and
//! hands back its session, and the next attempt, on the other worker, resumes the CLI's
//! session: the fake API's first request from it carries the earlier turns, and only the rest
//! of the work is asked for.

use flotilla_tests::cluster::Cluster;
use flotilla_tests::fake_anthropic::{FakeAnthropic, tool_results};
use serde_json::Value;

/// The workers' environment: the fake API's, and the pinned Claude Code CLI.
fn cli_env(fake: &FakeAnthropic) -> Vec<(String, String)> {
    let mut env = fake.env();
    env.push((
        "FLOTILLA_CLAUDE_BIN".into(),
        crate::claude::claude_bin().to_str().unwrap().to_owned(),
    ));
    env
}

/// Launches an agent of `turns` model turns whose third model call stalls; its run id.
/// `words` ("six steps") is how the fake's requests of it are told apart.
fn launch_steps(c: &Cluster, words: &str, turns: u32) -> String {
    c.launch(
        "steps",
        &format!(
            "return await agent('{words} [[turns:{turns}]] [[stall-at:2]]', {{ label: 'steps' }});"
        ),
        &[
            "--stagger",
            "0",
            "--backend",
            "claude-code",
            "--stall-timeout",
            "10m",
        ],
    )
}

/// `text` without its terminal colours.
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('\x1b') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        rest = rest.find('m').map_or("", |m| &rest[m + 1..]);
    }
    out.push_str(rest);
    out
}

/// The Messages API requests of the agent whose prompt holds `mark`.
fn asked(fake: &FakeAnthropic, mark: &str) -> Vec<Value> {
    fake.requests()
        .into_iter()
        .filter(|s| s.path.starts_with("/v1/messages") && s.body.to_string().contains(mark))
        .map(|s| s.body)
        .collect()
}

#[test]
fn an_agent_cut_off_by_its_worker_s_stop_continues_its_session_on_another_worker() {
    let fake = FakeAnthropic::start();
    let mut c = Cluster::start_workers_with(1, 1, &["--backend", "claude-code"], cli_env(&fake));
    let run = launch_steps(&c, "six steps", 6);
    // Two turns done; the third model call hangs.
    assert!(
        flotilla_tests::eventually(60, || asked(&fake, "six steps").len() == 3),
        "the agent never reached its third model call: {:?}",
        asked(&fake, "six steps").len()
    );
    c.issue_worker(1);
    c.start_worker(1, 1);
    c.wait_for_workers(2);
    let stopped = c.stop_worker(0);
    assert!(stopped.success(), "{stopped:?}");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "done after 6 turns", "{r}");
    let agent = flotilla_tests::agent(&r, "steps");
    let workers: Vec<&str> = agent["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["worker"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(workers, ["worker-0", "worker-1"], "{r}");
    let bodies = asked(&fake, "six steps");
    let turns: Vec<usize> = bodies.iter().map(tool_results).collect();
    assert_eq!(
        turns,
        [0, 1, 2, 2, 3, 4, 5, 6],
        "the second attempt went on from two turns, not from none"
    );
    let resumed = bodies[3]["messages"].to_string();
    for said in ["turn 1", "turn 2", "was interrupted before it finished"] {
        assert!(resumed.contains(said), "{said:?} in {resumed}");
    }
}

/// The conversation an interrupted attempt hands back is kept in the store: a coordinator
/// SIGKILLed while the call waits for its next attempt (the run is paused) loses nothing of
/// it, and the successor that adopts the run continues the agent's session from there. The
/// call's end deletes what was kept.
#[test]
fn a_paused_agent_s_conversation_outlives_its_coordinator_s_sigkill() {
    let fake = FakeAnthropic::start();
    let etcd = flotilla_tests::services::Etcd::start();
    let s3 = flotilla_tests::services::S3::start();
    let url = format!("s3://{}/sessions", s3.bucket);
    let mut c = Cluster::start_group_ttl(
        0,
        1,
        etcd.endpoint(),
        (url, s3.env()),
        &["--backend", "claude-code"],
        Some(std::time::Duration::from_secs(3)),
    );
    c.worker_env = cli_env(&fake);
    c.issue_worker(0);
    c.start_worker(0, 1);
    c.wait_for_workers(1);
    let run = launch_steps(&c, "five steps", 5);
    assert!(
        flotilla_tests::eventually(60, || asked(&fake, "five steps").len() == 3),
        "the agent never reached its third model call"
    );
    let paused = c.client(&["pause", &run]);
    assert_eq!(paused.code, 0, "{paused:?}");
    let kept = format!("runs/{run}/leftovers/");
    assert!(
        flotilla_tests::eventually(60, || c.stored_keys(&kept).len() == 1),
        "the interrupted attempt's conversation never reached the store: {:?}",
        c.stored_keys(&kept)
    );
    let mut coordinator = c.take_coordinator().unwrap();
    coordinator.kill().unwrap();
    coordinator.wait().unwrap();
    // The successor adopts the run (a pause is not carried over) and runs the call again.
    let out = c.client_at(&c.standby_url(), &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    assert_eq!(r["result"], "done after 5 turns", "{r}");
    // The CLI writes its session file a little after it asks the model, so the conversation
    // the pause caught holds one turn or both; never none.
    let turns: Vec<usize> = asked(&fake, "five steps")
        .iter()
        .map(tool_results)
        .collect();
    let from = turns.get(3).copied().unwrap_or_default();
    assert!(
        (1..=2).contains(&from) && turns[..3] == [0, 1, 2],
        "the adopted call went on from {from} turns: {turns:?}"
    );
    assert_eq!(turns[3..], (from..=5).collect::<Vec<_>>(), "{turns:?}");
    assert!(
        flotilla_tests::eventually(30, || c.stored_keys(&kept).is_empty()),
        "the call ended, and what it kept is still there: {:?}",
        c.stored_keys(&kept)
    );
}

/// A worker SIGKILLed mid-conversation hands nothing back, but its agent's conversation was
/// checkpointed while it ran (`FLOTILLA_SESSION_CHECKPOINT`): the attempt, lost with its
/// worker, is restarted on another one, which continues the session from that checkpoint.
#[test]
fn an_agent_whose_worker_is_sigkilled_continues_from_its_last_checkpoint() {
    let fake = FakeAnthropic::start();
    // The coordinator logs each checkpoint it takes (at debug).
    let mut c = Cluster::start_with_env(
        0,
        1,
        vec![(
            "FLOTILLA_LOG".into(),
            "info,flotilla_coordinator::sched::outcomes=debug".into(),
        )],
    );
    c.worker_args = vec!["--backend".into(), "claude-code".into()];
    c.worker_env = cli_env(&fake);
    c.worker_env
        .push(("FLOTILLA_SESSION_CHECKPOINT".into(), "300ms".into()));
    c.issue_worker(0);
    c.start_worker(0, 1);
    c.wait_for_workers(1);
    let run = launch_steps(&c, "four steps", 4);
    let log =
        || plain(&std::fs::read_to_string(c.path().join("coordinator.log")).unwrap_or_default());
    assert!(
        flotilla_tests::eventually(60, || asked(&fake, "four steps").len() == 3
            && log().lines().any(|l| l
                .contains("a checkpoint of a running agent's conversation")
                && l.contains("turns=2"))),
        "no checkpoint of two turns: {} requests; the coordinator's log:\n{}",
        asked(&fake, "four steps").len(),
        log()
    );
    c.signal_worker(0, "-9");
    c.issue_worker(1);
    c.start_worker(1, 1);
    let out = c.client(&["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    assert_eq!(r["result"], "done after 4 turns", "{r}");
    let turns: Vec<usize> = asked(&fake, "four steps")
        .iter()
        .map(tool_results)
        .collect();
    assert_eq!(
        turns,
        [0, 1, 2, 2, 3, 4],
        "went on from the checkpoint's two turns"
    );
    let agent = flotilla_tests::agent(&r, "steps");
    assert_eq!(agent["segments"][1]["worker"], "worker-1", "{r}");
}
