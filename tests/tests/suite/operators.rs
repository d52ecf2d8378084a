//! What operators watch a fleet with (issue 31): the operator listener that Prometheus and the
//! autoscaler scrape without a session token, scraped here by a real Prometheus.

use flotilla_tests::cluster::{Cluster, free_port};
use flotilla_tests::services::Prometheus;
use flotilla_tests::{eventually, http_get, http_request};

/// A probe an agent runs in its sandbox: can it open a connection to 127.0.0.1:`port`?
fn connect_probe(port: u16) -> String {
    format!(
        "python3 -c \"import socket; s = socket.socket(); s.settimeout(3); print('PROBE-' + ('OPEN' if s.connect_ex(('127.0.0.1', {port})) == 0 else 'CLOSED'))\""
    )
}

#[test]
fn prometheus_scrapes_the_operator_listener_which_serves_nothing_but_metrics() {
    let metrics_port = free_port();
    let metrics_at = format!("127.0.0.1:{metrics_port}");
    let worker_port = free_port();
    let worker_at = format!("127.0.0.1:{worker_port}");
    let c = Cluster::start_configured(
        1,
        4,
        &["--metrics-listen", &metrics_at],
        &[
            "--backend",
            "echo,exec",
            "--exec-cmd",
            "sh",
            "--metrics-listen",
            &worker_at,
        ],
    );
    c.issue_client("alpha", &["alpha"]);
    c.issue_client("beta", &["beta"]);
    let long = c.launch_as(
        "alpha",
        "long",
        "return await agent('sleep 40; echo slept');",
        &["--backend", "exec"],
    );
    // Alpha's tokens, counted by namespace, workflow and model: the echo backend's input
    // tokens are the prompt's characters.
    let tally = c.launch_as(
        "alpha",
        "tally",
        "return await parallel([() => agent('abc'), () => agent('defgh')]);",
        &["--backend", "echo"],
    );
    let tallied = c.client_as("alpha", &["wait", &tally, "--json"]);
    assert_eq!(tallied.code, 0, "{tallied:?}");
    // A hostile agent of the other team tries both operator listeners from its sandbox.
    let probe = c.launch_as(
        "beta",
        "probe",
        &format!(
            "return await agent({:?});",
            format!(
                "{}; {}",
                connect_probe(metrics_port),
                connect_probe(worker_port)
            )
        ),
        &["--backend", "exec"],
    );
    let waited = c.client_as("beta", &["wait", &probe, "--json"]);
    assert_eq!(waited.code, 0, "{waited:?}");
    let result = waited.json()["result"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert_eq!(
        result.matches("PROBE-CLOSED").count(),
        2,
        "the sandboxed agent's probes of the operator listeners: {result:?}"
    );

    // Without a token, every namespace's figures, while alpha's agent runs.
    let mut scraped = String::new();
    assert!(
        eventually(30, || {
            let r = http_get(metrics_port, "/metrics", &[]);
            scraped = r.body;
            r.status == 200 && scraped.contains("flotilla_namespace_running{namespace=\"alpha\"} 1")
        }),
        "the operator listener's /metrics: {scraped}"
    );
    assert!(scraped.contains("flotilla_queue_depth "), "{scraped}");
    assert!(!scraped.contains(&long), "no run ids on it: {scraped}");
    let mut worker_scraped = String::new();
    assert!(
        eventually(30, || {
            let r = http_get(worker_port, "/metrics", &[]);
            worker_scraped = r.body;
            r.status == 200 && worker_scraped.contains("flotilla_worker_slots{state=\"busy\"} 1\n")
        }),
        "alpha's long agent holds one of the worker's slots: {worker_scraped}"
    );
    for path in ["/", "/runs", "/healthz", "/metrics/x"] {
        assert_eq!(http_get(worker_port, path, &[]).status, 404, "{path}");
    }

    // A real Prometheus scrapes both: the families the dashboard and the autoscaler use.
    let prometheus = Prometheus::start(&[("coordinator", metrics_port), ("worker", worker_port)]);
    let up = prometheus.wait_for("count(up == 1) == 2");
    assert_eq!(up[0]["value"][1], "2", "{up:?}");
    let input = prometheus.wait_for(
        "sum(flotilla_tokens_total{namespace=\"alpha\",workflow=\"tally\",type=\"input\"})",
    );
    assert_eq!(input[0]["value"][1], "8", "abc and defgh: {input:?}");
    let completed = prometheus.wait_for(
        "flotilla_run_duration_seconds_count{job=\"coordinator\",status=\"completed\"} >= 2",
    );
    assert!(!completed.is_empty(), "{completed:?}");
    prometheus.wait_for("flotilla_attempts_total{outcome=\"completed\",class=\"\"} >= 3");
    prometheus.wait_for("flotilla_coordinator_role{role=\"single\"} == 1");
    let build = prometheus.wait_for("flotilla_build_info{commit!=\"unknown\"}");
    assert_eq!(
        build.len(),
        2,
        "coordinator and worker say their commit: {build:?}"
    );
    prometheus.wait_for("flotilla_worker_attached{job=\"worker\"} == 1");
    prometheus
        .wait_for("flotilla_worker_attempts_total{job=\"worker\",outcome=\"completed\"} >= 3");
    prometheus.wait_for("flotilla_worker_slots{job=\"worker\",state=\"free\"} == 3");
    prometheus.wait_for("flotilla_queue_depth{job=\"coordinator\"}");
    let running = prometheus.wait_for("flotilla_namespace_running{namespace=\"alpha\"} == 1");
    assert_eq!(running[0]["value"][1], "1", "{running:?}");
    prometheus.wait_for("flotilla_runs{status=\"running\"} >= 1");

    // Nothing else is on it: no page, run, sign-in or control, whatever the path.
    for path in [
        "/".to_owned(),
        "/runs".to_owned(),
        "/runs.json".to_owned(),
        format!("/runs/{long}"),
        format!("/runs/{long}/status.json"),
        format!("/runs/{long}/events"),
        format!("/runs/{long}/agents/0"),
        format!("/runs/{long}/diff"),
        "/login?token=x&next=/runs".to_owned(),
        "/metrics/../runs.json".to_owned(),
        "/healthz".to_owned(),
    ] {
        let r = http_get(metrics_port, &path, &[]);
        assert_eq!(r.status, 404, "{path}: {r:?}");
        assert!(!r.body.contains(&long), "{path}: {}", r.body);
    }
    let stop = http_request(
        metrics_port,
        "POST",
        &format!("/runs/{long}/control"),
        &[("Content-Type", "application/json"), ("x-flotilla", "1")],
        Some(r#"{"action":"stop"}"#),
    );
    assert!(
        stop.status == 404 || stop.status == 405,
        "a control on the operator listener: {stop:?}"
    );
    let status = c.client_as("alpha", &["status", &long, "--json"]);
    assert!(status.stdout.contains("running"), "{status:?}");

    // The session pages' /metrics is unchanged: a token, and only its own namespaces.
    assert_eq!(http_get(c.http_port, "/metrics", &[]).status, 401);
    let token = c.client_as("beta", &["token", "create", "--json", "--ttl", "1h"]);
    assert_eq!(token.code, 0, "{token:?}");
    let bearer = format!("Bearer {}", token.json()["token"].as_str().unwrap());
    let beta_view = http_get(c.http_port, "/metrics", &[("Authorization", &bearer)]);
    assert_eq!(beta_view.status, 200, "{beta_view:?}");
    assert!(
        !beta_view.body.contains("namespace=\"alpha\""),
        "another team's figures on beta's /metrics: {}",
        beta_view.body
    );

    let stopped = c.client_as("alpha", &["stop", &long]);
    assert_eq!(stopped.code, 0, "{stopped:?}");
}

/// `flotilla --version` (and `flotilla_build_info`) name the commit the binary was built from.
#[test]
fn the_version_names_the_commit_the_binary_was_built_from() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(&repo)
        .output()
        .expect("git");
    assert!(head.status.success(), "this suite runs in a git checkout");
    let head = String::from_utf8(head.stdout).unwrap().trim().to_owned();
    let mut cmd = std::process::Command::new(flotilla_tests::binary());
    cmd.arg("--version");
    let out = flotilla_tests::run_with_timeout(cmd, std::time::Duration::from_secs(30));
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.stdout.trim(),
        format!("flotilla {} (commit {head})", env!("CARGO_PKG_VERSION")),
        "{out:?}"
    );
}

/// The alerting rules `deploy/prometheus` ships, each `for:` cut to nothing (the expressions
/// are what is tested here; their unit test times the `for:`s).
fn shipped_rules_without_waits() -> String {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let rules =
        std::fs::read_to_string(repo.join("deploy/prometheus/flotilla-alerts.yaml")).unwrap();
    rules
        .lines()
        .map(|l| match l.trim_start().strip_prefix("for: ") {
            Some(_) => format!("{}for: 0s", &l[..l.len() - l.trim_start().len()]),
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A real Prometheus with the shipped rules watches a fleet of two workers; one is killed
/// (SIGKILL) and FlotillaWorkersLost fires, while FlotillaNoLeader does not.
#[test]
fn the_shipped_alert_for_a_lost_worker_fires_when_one_is_killed() {
    let metrics_port = free_port();
    let metrics_at = format!("127.0.0.1:{metrics_port}");
    let mut c = Cluster::start_configured(2, 2, &["--metrics-listen", &metrics_at], &[]);
    let rules = shipped_rules_without_waits();
    let prometheus = Prometheus::start_with_rules(&[("coordinator", metrics_port)], Some(&rules));
    // Both attached, long enough for the rule's 15 s subquery to have seen it.
    prometheus.wait_for("max_over_time(sum(flotilla_workers{state=\"attached\"})[15m:15s]) == 2");
    let loaded = http_get(prometheus.port, "/api/v1/rules", &[]).body;
    assert!(
        loaded.contains("\"FlotillaWorkersLost\"") && loaded.contains("\"health\":\"ok\""),
        "Prometheus evaluates the shipped rules: {loaded}"
    );
    assert!(!loaded.contains("\"health\":\"err\""), "{loaded}");
    assert!(
        prometheus.query("ALERTS{alertstate=\"firing\"}").is_empty(),
        "nothing fires on a healthy fleet: {:?}",
        prometheus.query("ALERTS")
    );
    c.signal_worker(1, "-9");
    let firing =
        prometheus.wait_for("ALERTS{alertname=\"FlotillaWorkersLost\",alertstate=\"firing\"}");
    assert_eq!(firing[0]["metric"]["severity"], "warning", "{firing:?}");
    assert!(
        prometheus
            .query("ALERTS{alertname=\"FlotillaNoLeader\"}")
            .is_empty(),
        "the coordinator still leads"
    );
}
