//! Admission per provider account (issue 18): a fan-out far wider than what the provider
//! takes at once completes with every agent and few refusals, a storm of 529s delays a run
//! and never fails it, and the retry budget bounds retries, not throttle waits.

use std::time::Duration;

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::Env;
use flotilla_tests::fake_anthropic::FakeAnthropic;

/// A fan-out of `n` agents.
fn fan_out(n: usize) -> String {
    format!(
        "return (await parallel(Array.from({{ length: {n} }}, (_, i) => () => agent('item ' + i)))).filter(x => x !== null).length;"
    )
}

#[test]
fn a_fan_out_of_200_at_64_against_a_provider_that_takes_16_completes_with_few_429s() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    fake.limit_concurrency(16);
    let (code, r) = fake.run(
        &env,
        "anthropic",
        &fan_out(200),
        &["--stagger", "0", "--concurrency", "64"],
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["result"], 200, "every agent answered: {}", r["failures"]);
    assert_eq!(r["usage"]["errors"], 0, "{}", r["usage"]);
    let counts = fake.limit_counts();
    assert!(counts.peak <= 16, "{counts:?}");
    // Each refusal is one wait of its agent, never an attempt.
    assert_eq!(
        r["usage"]["waits"].as_u64(),
        Some(counts.refused_429),
        "{counts:?} {}",
        r["usage"]
    );
    // Sessions started: one per agent and one per wait (no retry was counted).
    assert_eq!(
        r["usage"]["attempts"].as_u64(),
        Some(200 + counts.refused_429),
        "{}",
        r["usage"]
    );
    // Without admission, 48 of every 64 would be refused, round after round. The window's
    // first growth overshoots once; after that a refusal is a probe, one per window change.
    assert!(
        counts.refused_429 <= 24,
        "{} refusals for 200 agents: {counts:?}",
        counts.refused_429
    );
}

#[test]
fn a_storm_of_529s_delays_the_run_and_fails_no_agent_nor_spends_the_retry_budget() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    fake.overload_for(Duration::from_secs(30));
    let (code, r) = fake.run(
        &env,
        "anthropic",
        &fan_out(40),
        // A retry budget of one: throttles are not retries.
        &[
            "--stagger",
            "0",
            "--concurrency",
            "16",
            "--retry-budget",
            "1",
        ],
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 40, "{}", r["failures"]);
    assert_eq!(r["usage"]["errors"], 0, "{}", r["usage"]);
    let counts = fake.limit_counts();
    assert!(counts.refused_529 > 0, "{counts:?}");
    assert_eq!(r["usage"]["waits"].as_u64(), Some(counts.refused_529));
    assert_eq!(
        r["usage"]["attempts"].as_u64(),
        Some(40 + counts.refused_529),
        "no attempt but the waits' was counted: {}",
        r["usage"]
    );
    assert!(
        r["usage"]["duration_ms"].as_u64() >= Some(29_000),
        "the run waited the storm out: {}",
        r["usage"]
    );
    assert!(
        r["logs"].as_array().unwrap().iter().any(|l| l
            .as_str()
            .is_some_and(|l| l.contains("throttled by anthropic@127.0.0.1:"))),
        "the log names the account: {}",
        r["logs"]
    );
}

#[test]
fn once_the_retry_budget_is_spent_failing_agents_fail_and_the_report_says_so() {
    let env = Env::new();
    let fake = FakeAnthropic::start();
    // Every request of these prompts fails with a 500 (retryable) until it has failed 3 times.
    let body = "return await parallel(Array.from({ length: 6 }, (_, i) => () => agent('flaky ' + i + ' [[fail-first:3:500]]')));";
    let (code, r) = fake.run(
        &env,
        "anthropic",
        body,
        &["--stagger", "0", "--retry-budget", "4"],
        &[],
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    let results = r["result"].as_array().unwrap();
    let failed = results.iter().filter(|v| v.is_null()).count();
    // 6 agents need 3 retries each; 4 retries in all: at most one agent makes it.
    assert!(failed >= 5, "{r}");
    let retries: u64 = r["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["attempts"].as_u64().unwrap().saturating_sub(1))
        .sum();
    assert_eq!(retries, 4, "the budget bounds retries: {}", r["agents"]);
    let warned = r["warnings"].as_array().unwrap().iter().any(|w| {
        w.as_str()
            .is_some_and(|w| w.starts_with("Retry budget spent"))
    });
    assert!(warned, "{}", r["warnings"]);
    let errors: Vec<&str> = r["agents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a["error"].as_str())
        .collect();
    assert!(
        errors.iter().any(|e| e.contains("retry budget is spent")),
        "{errors:?}"
    );
}

#[test]
fn the_admission_benchmark_runs_and_reports_both_modes() {
    let env = Env::new();
    let out = env.flotilla(&[
        "bench",
        "admission",
        "--agents",
        "200",
        "--rounds",
        "1",
        "--json",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    for mode in ["adaptive", "fixed"] {
        let m = &r[mode];
        assert!(m["goodput_per_s"].as_f64() > Some(0.0), "{r}");
        assert!(m["requests"].as_f64() >= Some(200.0), "{r}");
    }
    // Counts, not times: a fixed concurrency of 64 against a limit of 16 is refused far more.
    assert!(
        r["adaptive"]["refused"].as_f64().unwrap() * 10.0 < r["fixed"]["refused"].as_f64().unwrap(),
        "{r}"
    );
}

/// `flotilla bench affinity`: with prefix affinity most prefix tokens come from the servers'
/// caches (each worker sees a couple of the eight prefixes); spread over every worker, each
/// cache of two thrashes between eight. Counts, not times.
#[test]
fn the_affinity_benchmark_runs_and_affinity_hits_the_prefix_caches() {
    let env = Env::new();
    let out = env.flotilla(&[
        "bench",
        "affinity",
        "--calls",
        "240",
        "--rounds",
        "1",
        "--prefill-ms",
        "5",
        "--decode-ms",
        "2",
        "--json",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    let share = |m: &str| r[m]["cached_share"].as_f64().unwrap_or(-1.0);
    assert!(share("affinity") > 0.8, "{r}");
    assert!(share("spread") < share("affinity") - 0.3, "{r}");
}
