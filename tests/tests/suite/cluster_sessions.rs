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
    let mut env = fake.env();
    env.push((
        "FLOTILLA_CLAUDE_BIN".into(),
        crate::claude::claude_bin().to_str().unwrap().to_owned(),
    ));
    let mut c = Cluster::start_workers_with(1, 1, &["--backend", "claude-code"], env);
    let run = c.launch(
        "steps",
        "return await agent('six steps [[turns:6]] [[stall-at:2]]', { label: 'steps' });",
        &[
            "--stagger",
            "0",
            "--backend",
            "claude-code",
            "--stall-timeout",
            "10m",
        ],
    );
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
