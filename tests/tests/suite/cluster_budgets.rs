//! Money caps that pause (issue 33, 2): a coordinator's run that reaches its `--budget-usd` is
//! held — what runs finishes, nothing new starts, its status says by how much it is over —
//! until `flotilla budget` raises the cap; then it goes on, and every call runs once. Real
//! processes: a coordinator, a worker, the anthropic backend against the local fake API.

use flotilla_tests::cluster::Cluster;
use flotilla_tests::fake_anthropic::FakeAnthropic;
use serde_json::Value;

/// The Messages API requests the fake has seen.
fn asked(fake: &FakeAnthropic) -> Vec<Value> {
    fake.requests()
        .into_iter()
        .filter(|s| s.path.ends_with("/messages"))
        .map(|s| s.body)
        .collect()
}

fn status(c: &Cluster, run: &str) -> Value {
    let out = c.client(&["status", run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    out.json()
}

/// Waits until `run`'s status satisfies `ok`; the status it ended with.
fn until(c: &Cluster, run: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let s = status(c, run);
        if ok(&s) {
            return s;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: {s}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn a_run_at_its_money_budget_pauses_and_goes_on_once_raised_with_every_call_once() {
    let fake = FakeAnthropic::start();
    let c = Cluster::start_workers_with(1, 4, &["--backend", "anthropic"], fake.env());
    // One agent's cost is over the budget: the run is held after its first agent (or the
    // second, if it started before the first one's cost came in).
    let run = c.launch(
        "capped",
        "return await parallel(Array.from({ length: 6 }, (_, i) => () => agent('item ' + i)));",
        &[
            "--stagger",
            "0",
            "--concurrency",
            "1",
            "--backend",
            "anthropic",
            "--budget-usd",
            "0.0001",
        ],
    );
    let held = until(&c, &run, "the run is held at its budget", |s| {
        s["status"] == "paused" && s["running"] == 0
    });
    let why = held["waiting"].as_str().unwrap_or_default();
    assert!(
        why.starts_with("paused at its money budget: it has cost $")
            && why.contains("of $0.0001")
            && why.contains(&format!("flotilla budget {run} --usd")),
        "{held}"
    );
    let done = held["done"].as_u64().unwrap();
    assert!((1..=2).contains(&done), "{held}");
    assert_eq!(held["failed"], 0, "nothing was stopped: {held}");
    // Nothing new started: the fake API saw one request per agent done, no more.
    assert_eq!(asked(&fake).len() as u64, done, "{held}");
    // `resume` is not how it goes on; a budget still too low keeps it held.
    let resumed = c.client(&["resume", &run]);
    assert_ne!(resumed.code, 0, "{resumed:?}");
    assert!(
        resumed.stderr.contains("paused at its money budget")
            && resumed.stderr.contains("flotilla budget"),
        "{resumed:?}"
    );
    let low = c.client(&["budget", &run, "--usd", "0.0002"]);
    assert_eq!(low.code, 0, "{low:?}");
    assert!(low.stderr.contains("it stays paused"), "{low:?}");
    assert_eq!(status(&c, &run)["status"], "paused");
    for bad in ["--usd=-1", "--usd=0", "--usd=NaN"] {
        let out = c.client(&["budget", &run, bad]);
        assert_ne!(out.code, 0, "{bad}: {out:?}");
        assert!(
            out.stderr.contains("positive number of dollars"),
            "{bad}: {out:?}"
        );
    }
    // Raised: it goes on where it stopped.
    let raised = c.client(&["budget", &run, "--usd", "100", "--reason", "approved"]);
    assert_eq!(raised.code, 0, "{raised:?}");
    assert!(raised.stderr.contains("the run goes on"), "{raised:?}");
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    let results = r["result"].as_array().unwrap_or_else(|| panic!("{r}"));
    assert_eq!(results.len(), 6, "{r}");
    for (i, v) in results.iter().enumerate() {
        assert_eq!(v, &format!("fake reply to: item {i}"), "{r}");
    }
    // Every call once: six requests in all, one per agent.
    let mut prompts: Vec<String> = asked(&fake)
        .iter()
        .map(|b| b["messages"].to_string())
        .collect();
    assert_eq!(prompts.len(), 6, "{prompts:?}");
    prompts.sort();
    prompts.dedup();
    assert_eq!(prompts.len(), 6, "no agent asked twice");
    let log = r["logs"]
        .as_array()
        .map(|l| format!("{l:?}"))
        .unwrap_or_default();
    for line in [
        "[budget] the run is paused at its money budget",
        "asked to set the run's money budget: approved",
        "[budget] the run goes on",
    ] {
        assert!(log.contains(line), "{line:?} in {log}");
    }
}
