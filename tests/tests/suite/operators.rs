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
    // With every `for:` cut to nothing, a rule evaluated before the first scrape (no leader
    // seen yet) fires once; the healthy fleet's state is that nothing does once it is seen.
    assert!(
        eventually(30, || prometheus
            .query("ALERTS{alertstate=\"firing\"}")
            .is_empty()),
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

/// Every query of every panel of `deploy/grafana/flotilla-dashboard.json` returns data from a
/// real Prometheus scraping a real fleet — a coordinator and a worker on their operator
/// listeners — while runs go on: an API backend's account (a local fake of the API), a
/// namespace with daily quotas that refuses an agent, runs that complete and one that fails.
#[test]
fn every_dashboard_panel_has_data_from_a_real_fleet() {
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    let cfg = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    std::fs::write(
        cfg.path(),
        "[namespaces.team-q]\nagents_per_day = 2\ntokens_per_day = 100000\nusd_per_day = 50.0\n",
    )
    .unwrap();
    let (coordinator_port, worker_port) = (free_port(), free_port());
    let coordinator_at = format!("127.0.0.1:{coordinator_port}");
    let worker_at = format!("127.0.0.1:{worker_port}");
    let c = Cluster::start_configured_env(
        1,
        8,
        &[
            "--metrics-listen",
            &coordinator_at,
            "--config",
            cfg.path().to_str().unwrap(),
        ],
        &[
            "--backend",
            "echo,anthropic,exec",
            "--exec-cmd",
            "sh",
            "--metrics-listen",
            &worker_at,
        ],
        fake.env(),
    );
    c.issue_client("quinn", &["team-q"]);
    let prometheus =
        Prometheus::start(&[("coordinator", coordinator_port), ("worker", worker_port)]);
    prometheus.wait_for("count(up == 1) == 2");
    // Through the API backend: an account, tokens, cost.
    let api = c.launch(
        "through-the-api",
        "return (await parallel(Array.from({ length: 12 }, (_, i) => () => agent('item ' + i)))).length;",
        &["--backend", "anthropic", "--stagger", "0"],
    );
    // A namespace's quota refuses its third agent; the script catches it and goes on.
    let quota = c.launch_as(
        "quinn",
        "quota",
        "const out = [];\nfor (let i = 0; i < 3; i++) { try { out.push(await agent('q ' + i)); } catch (e) { out.push(e.code); } }\nreturn out;",
        &["--backend", "echo", "--stagger", "0"],
    );
    let failing = c.launch("failing", "throw new Error('on purpose');", &[]);
    // And one that goes on while the panels are read.
    let long = c.launch(
        "long",
        "return await agent('sleep 300; echo slept');",
        &["--backend", "exec"],
    );
    let (code, report) = c.wait(&api);
    assert_eq!(code, 0, "{report}");
    let refused = c.client_as("quinn", &["wait", &quota, "--json"]);
    assert_eq!(refused.code, 0, "{refused:?}");
    assert_eq!(refused.json()["result"][2], "QUOTA_EXCEEDED", "{refused:?}");
    let (code, _) = c.wait(&failing);
    assert_ne!(code, 0);

    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../deploy/grafana/flotilla-dashboard.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let variables: Vec<&str> = dash["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(
        variables.contains(&"instance") && variables.contains(&"worker"),
        "the dashboard selects coordinators and workers: {variables:?}"
    );
    let mut queried = 0;
    for p in dash["panels"].as_array().unwrap() {
        let Some(targets) = p["targets"].as_array() else {
            assert_eq!(p["type"], "row", "{p}");
            continue;
        };
        for t in targets {
            // "All" of each selector, as the dashboard opens.
            let expr = t["expr"]
                .as_str()
                .unwrap()
                .replace("$instance", ".*")
                .replace("$worker", ".*");
            let found = prometheus.wait_for(&expr);
            assert!(!found.is_empty(), "{}: {expr}", p["title"]);
            queried += 1;
        }
    }
    assert!(queried >= 30, "{queried}");
    let stopped = c.client(&["stop", &long]);
    assert_eq!(stopped.code, 0, "{stopped:?}");
}

/// A collector that is not there: the spans are counted as dropped on the operator listener
/// and the coordinator says so once on stderr, naming the variables to check; the run is
/// not held up.
#[test]
fn spans_an_unreachable_collector_loses_are_counted_and_said_once() {
    let (metrics_port, nowhere) = (free_port(), free_port());
    let metrics_at = format!("127.0.0.1:{metrics_port}");
    let c = flotilla_tests::cluster::Cluster::start_configured_env(
        1,
        4,
        &["--metrics-listen", &metrics_at],
        &[],
        vec![
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT".into(),
                format!("http://127.0.0.1:{nowhere}"),
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL".into(), "http/protobuf".into()),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
            ("OTEL_EXPORTER_OTLP_TIMEOUT".into(), "500".into()),
        ],
    );
    for i in 0..2 {
        let run = c.launch(&format!("lost-{i}"), "return await agent('x');", &[]);
        let (code, r) = c.wait(&run);
        assert_eq!(code, 0, "{r}");
    }
    let mut scraped = String::new();
    assert!(
        eventually(30, || {
            scraped = http_get(metrics_port, "/metrics", &[]).body;
            scraped
                .lines()
                .find_map(|l| l.strip_prefix("flotilla_trace_spans_dropped_total "))
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|v| v > 0.0)
                && scraped.contains("flotilla_trace_export_failures_total ")
        }),
        "{scraped}"
    );
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap();
    assert_eq!(
        log.matches("cannot export traces to the OpenTelemetry collector")
            .count(),
        1,
        "said once: {log}"
    );
    assert!(log.contains("OTEL_EXPORTER_OTLP_ENDPOINT"), "{log}");
}

/// `--help` of the coordinator and the worker says how to get logs, traces and metrics.
#[test]
fn coordinator_and_worker_help_name_the_log_trace_and_metrics_settings() {
    for role in ["coordinator", "worker"] {
        let mut cmd = std::process::Command::new(flotilla_tests::binary());
        cmd.args([role, "--help"]);
        let out = flotilla_tests::run_with_timeout(cmd, std::time::Duration::from_secs(30));
        assert_eq!(out.code, 0, "{out:?}");
        for needed in [
            "FLOTILLA_LOG",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "http/protobuf",
            "OTEL_EXPORTER_OTLP_HEADERS",
            "--metrics-listen",
        ] {
            assert!(
                out.stdout.contains(needed),
                "{role} --help lacks {needed}: {}",
                out.stdout
            );
        }
    }
}

/// `launch --wait` prints the session at once and then the report, exiting as `wait` does;
/// `--exit-status` (on `launch --wait` and on `wait`) makes a run that completed with failed
/// agents exit 5, where by default it exits 0 (its script handled them).
#[test]
fn launch_wait_reports_and_exit_status_fails_a_run_whose_agents_failed() {
    let c = Cluster::start_configured(1, 2, &[], &["--backend", "echo,exec", "--exec-cmd", "sh"]);
    let script = |name: &str, body: &str| {
        flotilla_tests::write_workflow(c.path(), name, "client test", body)
            .to_str()
            .unwrap()
            .to_owned()
    };
    let mixed = script(
        "mixed",
        "return await parallel([() => agent('echo fine'), () => agent('exit 3')]);",
    );
    let fine = script("fine", "return await agent('echo fine');");
    let exec = ["--backend", "exec", "--stagger", "0"];
    let launch = |file: &str, extra: &[&str]| {
        let mut args = vec!["launch", file];
        args.extend_from_slice(&exec);
        args.extend_from_slice(extra);
        c.client(&args)
    };

    let waited = launch(&mixed, &["--wait"]);
    assert_eq!(
        waited.code, 0,
        "failed agents are the script's to handle: {waited:?}"
    );
    assert!(
        waited.stdout.contains("session "),
        "the session URL first: {waited:?}"
    );
    assert!(
        waited.stdout.contains("\"fine\"") && waited.stderr.contains("completed, 1 failed"),
        "then the result and the report: {waited:?}"
    );

    let strict = launch(&mixed, &["--wait", "--exit-status", "--json"]);
    assert_eq!(
        strict.code,
        flotilla_proto::wire::EXIT_SOME_AGENTS_FAILED,
        "{strict:?}"
    );
    let report = strict.json();
    assert_eq!(
        report["status"], "completed",
        "only the report on stdout: {strict:?}"
    );
    let run = report["run_id"].as_str().unwrap().to_owned();
    let again = c.client(&["wait", &run, "--exit-status"]);
    assert_eq!(
        again.code,
        flotilla_proto::wire::EXIT_SOME_AGENTS_FAILED,
        "{again:?}"
    );
    assert_eq!(c.client(&["wait", &run]).code, 0);

    let all_fine = launch(&fine, &["--wait", "--exit-status"]);
    assert_eq!(all_fine.code, 0, "{all_fine:?}");

    let unpaired = launch(&fine, &["--exit-status"]);
    assert_eq!(unpaired.code, 2, "{unpaired:?}");
    assert!(unpaired.stderr.contains("--wait"), "{unpaired:?}");

    // `--watch` follows the run as `watch` does (plain lines off a terminal), then reports
    // and exits as `--wait` does.
    let watched = launch(&mixed, &["--watch"]);
    assert_eq!(watched.code, 0, "{watched:?}");
    assert!(watched.stdout.contains("session "), "{watched:?}");
    assert!(
        watched.stderr.contains("completed, 1 failed") && watched.stdout.contains("\"fine\""),
        "{watched:?}"
    );
    let strict = launch(&mixed, &["--watch", "--exit-status"]);
    assert_eq!(
        strict.code,
        flotilla_proto::wire::EXIT_SOME_AGENTS_FAILED,
        "{strict:?}"
    );
    let both = launch(&fine, &["--wait", "--watch"]);
    assert_eq!(both.code, 2, "one or the other: {both:?}");
}

/// `--metrics-tls`: the coordinator's operator listener asks every scraper for a certificate
/// of the fleet's CA. A real Prometheus with one scrapes it; one without (or over plain http)
/// gets nothing.
#[test]
fn an_operator_listener_over_mutual_tls_is_scraped_only_with_a_certificate_of_the_fleet() {
    let metrics_port = free_port();
    let metrics_at = format!("127.0.0.1:{metrics_port}");
    let c = Cluster::start_configured(
        1,
        2,
        &["--metrics-listen", &metrics_at, "--metrics-tls"],
        &[],
    );
    let run = c.launch(
        "measured",
        "return await agent('one');",
        &["--stagger", "0"],
    );
    assert_eq!(c.wait(&run).0, 0);
    let with_cert =
        Prometheus::start_tls(&[("coordinator", metrics_port)], &c.pki(), Some("client"));
    with_cert.wait_for("up{job=\"coordinator\"} == 1");
    with_cert.wait_for("flotilla_runs{status=\"completed\"} >= 1");
    let without = Prometheus::start_tls(&[("coordinator", metrics_port)], &c.pki(), None);
    let down = without.wait_for("up{job=\"coordinator\"} == 0");
    assert_eq!(down.len(), 1, "{down:?}");
    let plain = Prometheus::start(&[("coordinator", metrics_port)]);
    plain.wait_for("up{job=\"coordinator\"} == 0");
    // Nothing of the figures leaks to a plain request either.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", metrics_port)).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    std::io::Write::write_all(&mut s, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut got);
    let got = String::from_utf8_lossy(&got);
    assert!(!got.contains("flotilla_"), "{got}");
}
