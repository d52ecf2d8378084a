//! Workers as a coordinator must distrust them, over the real gRPC stream with real worker
//! certificates: a second process claiming an attached worker's name, and a hostile worker
//! that answers for attempts it was never given and reports usage no attempt can reach.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_proto::tls::TlsFiles;
use flotilla_proto::v1::worker_service_client::WorkerServiceClient;
use flotilla_proto::v1::{
    self, CoordinatorMessage, WorkerMessage, coordinator_message, outcome, worker_message,
};
use flotilla_tests::cluster::Cluster;
use flotilla_tests::http_get;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// A second worker process with worker-0's certificate and name, next to the one attached: it
/// is refused and stops with the reason (naming where each connects from), rather than take
/// the name from the first on every reconnect; the first never notices and keeps serving.
#[test]
fn a_second_worker_with_the_same_certificate_and_name_is_refused_and_the_first_keeps_serving() {
    let c = Cluster::start(1, 2);
    let log = std::fs::File::create(c.path().join("twin.log")).unwrap();
    let mut twin = Command::new(&c.bin)
        .args(["worker", "--coordinator", &c.url(), "--name", "worker-0"])
        .args(["--slots", "2", "--tls-dir"])
        .arg(c.pki())
        .arg("--workspace")
        .arg(c.path().join("ws-twin"))
        .env("FLOTILLA_LOG", "info")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = twin.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = twin.kill();
            let _ = twin.wait();
            panic!(
                "the second worker never stopped:\n{}",
                std::fs::read_to_string(c.path().join("twin.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let said = std::fs::read_to_string(c.path().join("twin.log")).unwrap();
    assert!(!status.success(), "{said}");
    assert!(
        said.contains("worker name \\\"worker-0\\\" is taken")
            || said.contains("worker name \"worker-0\" is taken"),
        "{said}"
    );
    assert!(
        said.contains("is attached from 127.0.0.1:") && said.contains("--name CN/INSTANCE"),
        "{said}"
    );
    // The coordinator names both: the one that keeps the name and the one turned away.
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("refused a second worker named \"worker-0\""))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        line.matches("127.0.0.1:").count() >= 2,
        "both peers named: {line}"
    );
    // The first was never cut off, and serves.
    let run = c.launch(
        "served",
        "return (await parallel(Array.from({ length: 6 }, (_, i) => () => agent('x' + i)))).length;",
        &["--stagger", "0"],
    );
    let (code, r) = c.wait(&run);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 6);
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap();
    assert_eq!(log.matches("worker attached").count(), 1, "{log}");
    assert!(!log.contains("closing its previous stream"), "{log}");
    let first = std::fs::read_to_string(c.path().join("worker-0.log")).unwrap();
    assert!(!first.contains("cut off from the coordinator"), "{first}");
}

/// A worker on the real stream that plays hostile, as an attacker with a worker certificate
/// would.
struct Hostile {
    tx: tokio::sync::mpsc::UnboundedSender<WorkerMessage>,
    inbound: tonic::Streaming<CoordinatorMessage>,
}

impl Hostile {
    async fn attach(c: &Cluster, name: &str, slots: u32) -> Hostile {
        let tls = TlsFiles::in_dir(&c.pki(), name);
        let channel = flotilla_proto::tls::channel(&c.url(), Some(&tls)).expect("channel");
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(WorkerMessage {
            msg: Some(worker_message::Msg::Hello(v1::Hello {
                protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
                name: name.into(),
                slots,
                incarnation: "hostile".into(),
                ..v1::Hello::default()
            })),
        })
        .unwrap();
        let inbound = WorkerServiceClient::new(channel)
            .attach(UnboundedReceiverStream::new(rx))
            .await
            .map(tonic::Response::into_inner)
            .unwrap_or_else(|e| panic!("attach: {e:?}"));
        Hostile { tx, inbound }
    }

    fn send(&self, m: worker_message::Msg) {
        self.tx
            .send(WorkerMessage { msg: Some(m) })
            .expect("link open");
    }

    /// The next message that is not a welcome.
    async fn next(&mut self) -> coordinator_message::Msg {
        loop {
            let m = tokio::time::timeout(Duration::from_secs(60), self.inbound.next())
                .await
                .expect("a message from the coordinator")
                .expect("stream open")
                .expect("no error")
                .msg
                .expect("a message");
            if !matches!(m, coordinator_message::Msg::Welcome(_)) {
                return m;
            }
        }
    }

    /// The next `n` assignments, by prompt.
    async fn assignments(&mut self, n: usize) -> HashMap<String, v1::Assignment> {
        let mut out = HashMap::new();
        while out.len() < n {
            match self.next().await {
                coordinator_message::Msg::Assign(a) => {
                    out.insert(a.task.as_ref().unwrap().prompt.clone(), a);
                }
                other => panic!("expected an assignment, got {other:?}"),
            }
        }
        out
    }

    /// An outcome of attempt `a`'s run, call and attempt, with these fence, key and usage.
    fn answer(&self, a: &v1::Assignment, fence: i64, key: &str, text: &str, usage: v1::Usage) {
        self.send(worker_message::Msg::Outcome(v1::Outcome {
            run_id: a.run_id.clone(),
            call: a.call,
            attempt: a.attempt,
            result: Some(outcome::Result::Completed(v1::Completed {
                text: text.into(),
                ..v1::Completed::default()
            })),
            usage: Some(usage),
            fence,
            call_key: key.into(),
        }));
    }

    fn complete(&self, a: &v1::Assignment, text: &str, usage: v1::Usage) {
        self.answer(a, a.fence, &a.call_key, text, usage);
    }
}

fn small() -> v1::Usage {
    v1::Usage {
        input_tokens: 10,
        output_tokens: 5,
        cost_usd: 0.001,
        ..v1::Usage::default()
    }
}

fn huge() -> v1::Usage {
    v1::Usage {
        input_tokens: 1_000_000_000_000_000,
        output_tokens: 1_000_000_000_000_000,
        cost_usd: 1e12,
        ..v1::Usage::default()
    }
}

fn metric(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A hostile worker, attached with a real worker certificate, is the only worker of a fleet
/// that runs two namespaces' runs. It answers call B under call A's fence and key, and under
/// a key that is not B's; another namespace's call it holds under an attempt it was not
/// given; a run that does not exist; writes transcript lines into a call never made; asks for
/// a source none of its attempts has; reports 10^15 tokens and $10^12 for a real attempt; and
/// sends that outcome twice. The runs' results are exactly the real ones, each taken once; the
/// namespaces' quotas, the runs' usage and `/metrics` show only the real figures with the huge
/// report clipped to the configured ceilings; and the link and the fleet keep serving.
#[test]
fn a_hostile_worker_speaks_only_for_its_own_attempts_and_its_usage_is_clipped() {
    let cfg = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    // Ceilings that do not grow with time, so the clipped figures are exact: 2 requests of
    // 1,000 input-side and 100 output tokens, at $150 and $600 per million.
    std::fs::write(
        cfg.path(),
        "[attempt_usage]\ncontext_tokens = 1000\noutput_tokens = 100\nrequests_at_once = 2\nrequests_per_second = 0\n\n\
         [namespaces.team-a]\ntokens_per_day = 1000000\n",
    )
    .unwrap();
    let c = Cluster::start_coordinator_with(0, 1, &["--config", cfg.path().to_str().unwrap()]);
    c.issue_client("alice", &["team-a"]);
    c.issue_client("bob", &["team-b"]);
    c.issue_client("ops", &["*"]);
    let issued = Command::new(&c.bin)
        .args([
            "certs", "issue", "--role", "worker", "--name", "hostile", "--dir",
        ])
        .arg(c.pki())
        .output()
        .unwrap();
    assert!(issued.status.success(), "{issued:?}");
    let mine = c.launch_as(
        "alice",
        "mine",
        "const a = agent('A');\nconst c = await agent('C');\nconst b = agent('B');\nreturn [await a, c, await b];",
        &["--stagger", "0"],
    );
    let theirs = c.launch_as(
        "bob",
        "theirs",
        "return await agent('T');",
        &["--stagger", "0"],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut w = rt.block_on(Hostile::attach(&c, "hostile", 4));
    let refusal = rt.block_on(async {
        let mut got = w.assignments(3).await;
        let (a, cc, t) = (
            got.remove("A").unwrap(),
            got.remove("C").unwrap(),
            got.remove("T").unwrap(),
        );
        w.complete(&cc, "C", small());
        let b = w.assignments(1).await.remove("B").unwrap();
        assert_ne!(
            a.fence, b.fence,
            "A and B were sent apart: fences of their own"
        );
        // B's result under A's fence and key; under its own fence with a key not B's.
        w.answer(&b, a.fence, &a.call_key, "B as A", huge());
        w.answer(&b, b.fence, "v1:0000000000000000:0", "B, no key", huge());
        // The other namespace's call under an attempt it was not given; a run not here.
        let mut later = t.clone();
        later.attempt += 1;
        w.complete(&later, "T, later", huge());
        let mut nowhere = a.clone();
        nowhere.run_id = "wf_nowhere".into();
        w.complete(&nowhere, "nowhere", huge());
        w.send(worker_message::Msg::Transcript(v1::TranscriptChunk {
            run_id: a.run_id.clone(),
            call: 7,
            attempt: 1,
            events: vec!["{\"type\":\"text\",\"text\":\"planted\"}".into()],
        }));
        w.send(worker_message::Msg::SourceRequest(v1::SourceRequest {
            id: 1,
            repo: "0".repeat(64),
            commit: "1".repeat(40),
            ..v1::SourceRequest::default()
        }));
        // The real outcomes; A's with usage no attempt can reach, and sent twice.
        w.complete(&a, "A", huge());
        w.complete(&b, "B", small());
        w.complete(&t, "T", small());
        w.complete(&a, "A, again", huge());
        match w.next().await {
            coordinator_message::Msg::SourceData(d) => d.error,
            other => panic!("expected the source request's answer, got {other:?}"),
        }
    });
    assert!(
        refusal.contains("is not the source of an attempt this worker runs"),
        "{refusal}"
    );
    let out = c.client_as("alice", &["wait", &mine, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let r = out.json();
    assert_eq!(r["result"], serde_json::json!(["A", "C", "B"]), "{r}");
    // A clipped to 2 requests' worth; C and B as they came.
    assert_eq!(
        r["usage"]["input_tokens"],
        2_000 + 10 + 10,
        "{}",
        r["usage"]
    );
    assert_eq!(r["usage"]["output_tokens"], 200 + 5 + 5, "{}", r["usage"]);
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for rec in c.journal(&mine) {
        *seen.entry(rec["index"].as_u64().unwrap()).or_default() += 1;
    }
    assert_eq!(
        seen,
        HashMap::from([(0, 1), (1, 1), (2, 1)]),
        "one result per call"
    );
    let out = c.client_as("bob", &["wait", &theirs, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["result"], "T");
    // The quotas and /metrics count the clipped figures only.
    let t = c.client_as("ops", &["token", "create", "--json", "--ttl", "1h"]);
    let token = t.json()["token"].as_str().unwrap().to_owned();
    let m = http_get(
        c.http_port,
        "/metrics",
        &[("Authorization", &format!("Bearer {token}"))],
    );
    assert_eq!(m.status, 200, "{m:?}");
    let body = m.body;
    let value = |series: &str| metric(&body, series).unwrap_or_else(|| panic!("{series}\n{body}"));
    assert_eq!(
        value("flotilla_namespace_tokens_today{namespace=\"team-a\"}"),
        2_230.0
    );
    let cost = value("flotilla_namespace_cost_usd_today{namespace=\"team-a\"}");
    assert!((cost - (0.42 + 0.002)).abs() < 1e-9, "{cost}\n{body}");
    assert_eq!(
        value("flotilla_namespace_tokens_today{namespace=\"team-b\"}"),
        15.0
    );
    assert_eq!(value("flotilla_worker_usage_clipped_total"), 1.0);
    // The counters by workflow and model add up to the same clipped figures.
    let sum = |prefix: &str, kinds: &[&str]| -> f64 {
        body.lines()
            .filter(|l| l.starts_with(prefix))
            .filter(|l| {
                kinds.is_empty() || kinds.iter().any(|k| l.contains(&format!("type=\"{k}\"")))
            })
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    };
    let team_a = "flotilla_tokens_total{namespace=\"team-a\",";
    assert_eq!(sum(team_a, &["input", "output"]), 2_230.0, "{body}");
    let dollars = sum("flotilla_cost_usd_total{namespace=\"team-a\",", &[]);
    assert!((dollars - (0.42 + 0.002)).abs() < 1e-9, "{dollars}\n{body}");
    // Two forged outcomes for B, one for T, one for a run not here, the transcript, the
    // source request, and A sent again.
    assert_eq!(value("flotilla_worker_messages_dropped_total"), 7.0);
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).unwrap();
    assert!(
        log.contains("dropped an outcome from worker hostile"),
        "{log}"
    );
    assert!(
        log.contains("clipped an implausible usage report from worker hostile"),
        "{log}"
    );
    // The link goes on, and the namespace is not locked out of its day.
    let again = c.launch_as(
        "alice",
        "again",
        "return await agent('D');",
        &["--stagger", "0"],
    );
    rt.block_on(async {
        let d = w.assignments(1).await.remove("D").unwrap();
        w.complete(&d, "D", small());
    });
    let out = c.client_as("alice", &["wait", &again, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["result"], "D");
}
