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
    let c = Cluster::start_configured(
        1,
        4,
        &["--metrics-listen", &metrics_at],
        &["--backend", "exec", "--exec-cmd", "sh"],
    );
    c.issue_client("alpha", &["alpha"]);
    c.issue_client("beta", &["beta"]);
    let long = c.launch_as(
        "alpha",
        "long",
        "return await agent('sleep 40; echo slept');",
        &["--backend", "exec"],
    );
    // A hostile agent of the other team tries the operator listener from its sandbox.
    let probe = c.launch_as(
        "beta",
        "probe",
        &format!("return await agent({:?});", connect_probe(metrics_port)),
        &["--backend", "exec"],
    );
    let waited = c.client_as("beta", &["wait", &probe, "--json"]);
    assert_eq!(waited.code, 0, "{waited:?}");
    let result = waited.json()["result"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        result.contains("PROBE-CLOSED"),
        "the sandboxed agent's probe of the operator listener: {result:?}"
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

    // A real Prometheus scrapes it: the families the dashboard and the autoscaler use.
    let prometheus = Prometheus::start(&[("coordinator", metrics_port)]);
    let up = prometheus.wait_for("up{job=\"coordinator\"} == 1");
    assert_eq!(up.len(), 1, "{up:?}");
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
