//! Fleet defects found by trying the landed build as a new user and a hostile one would
//! (issue 11): each test here failed before its fix. Runs one at a time with the other
//! cluster tests (.config/nextest.toml).

use flotilla_tests::cluster::Cluster;
use flotilla_tests::{agent, failures};

#[test]
fn a_stall_restart_on_etcd_leaves_the_fleet_dispatching() {
    let etcd = flotilla_tests::services::Etcd::start();
    let c = Cluster::start_with(2, 4, Some(etcd.endpoint()));
    // One agent stalls once and is restarted (its old key deleted and the new one put in
    // one batch), next to one that stalls on every attempt.
    let run = c.launch(
        "stall-etcd",
        "const r = await parallel([\n\
           () => agent('once [[stall:1]]', { label: 'once' }),\n\
           () => agent('always [[stall]]', { label: 'always' }),\n\
           () => agent('fine', { label: 'fine' }),\n\
         ]);\n\
         return r;",
        &[
            "--stagger",
            "0",
            "--stall-timeout",
            "300ms",
            "--attempts",
            "3",
        ],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        serde_json::json!(["once [[stall:1]]", null, "fine"])
    );
    assert_eq!(agent(&r, "once")["attempts"], 2, "{r}");
    assert_eq!(agent(&r, "always")["attempts"], 3, "{r}");
    assert!(
        failures(&r)
            .iter()
            .any(|f| f.contains("stalled on all 3 attempts")),
        "{r}"
    );
    // The coordinator goes on dispatching: a later run completes too.
    let next = c.launch(
        "after-stall",
        "return await agent('after');",
        &["--stagger", "0"],
    );
    let (code, r) = c.wait(&next);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "after");
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap_or_default();
    assert!(
        !log.contains("duplicate key"),
        "etcd refused a batch:\n{log}"
    );
}
