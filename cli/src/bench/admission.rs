//! `flotilla bench admission`: goodput and refusals against a provider that takes a limited
//! number of requests at once, with admission per provider account and without it.
//!
//! In one process: a local Messages API on loopback that serves `--limit` requests at once
//! (each `--latency-ms` long, streamed) and answers any request beyond them with 429 and
//! `retry-after: 1`; an embedded coordinator and worker whose `anthropic` backend calls it; a
//! fan-out of `--agents` agents at `--concurrency`. Rounds alternate the two modes:
//! - **adaptive**: admission on (the default): the account's window finds the limit;
//! - **fixed**: admission off (`FLOTILLA_ADMISSION=off`): every slot the run has is used.
//!
//! Goodput is completed agents per second; `of_limit` is goodput over what the provider
//! serves at most (`limit` / latency); `refused_pct` is 429s over all requests. The goal for
//! adaptive admission: `of_limit` ≥ 0.9 with `refused_pct` ≤ 2.

use flotilla_proto::Problem;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use clap::Args;
use flotilla_coordinator::{LaunchRequest, RunSettings, RunStatus};
use flotilla_local::workflows::NoWorkflows;
use serde::Serialize;

use crate::embedded::Embedded;

#[derive(Debug, Args)]
pub struct AdmissionArgs {
    /// Agents per run (enough that the window's first search is a small part of the run).
    #[arg(long, default_value_t = 2000)]
    agents: u64,
    /// Requests the provider takes at once.
    #[arg(long, default_value_t = 16)]
    limit: u64,
    /// How long the provider takes per request, in milliseconds.
    #[arg(long, default_value_t = 100)]
    latency_ms: u64,
    /// The run's concurrency (its agents at once).
    #[arg(long, default_value_t = 64)]
    concurrency: u32,
    /// Runs per mode (alternating); the medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// One mode's figures (medians over the rounds).
#[derive(Debug, Serialize, Default, Clone)]
struct Mode {
    elapsed_ms: f64,
    goodput_per_s: f64,
    of_limit: f64,
    requests: f64,
    refused: f64,
    refused_pct: f64,
}

#[derive(Debug, Serialize)]
struct AdmissionReport {
    agents: u64,
    limit: u64,
    latency_ms: u64,
    concurrency: u32,
    rounds: u32,
    /// Agents per second the provider serves at most.
    limit_per_s: f64,
    adaptive: Mode,
    fixed: Mode,
    /// Adaptive goodput over fixed goodput.
    goodput_ratio: f64,
}

/// The provider: `limit` at once, 429 beyond.
#[derive(Default)]
struct Provider {
    limit: u64,
    latency: Duration,
    in_flight: AtomicU64,
    served: AtomicU64,
    refused: AtomicU64,
}

async fn messages(State(p): State<Arc<Provider>>, _headers: HeaderMap) -> Response {
    let now = p.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    if now > p.limit {
        p.in_flight.fetch_sub(1, Ordering::SeqCst);
        p.refused.fetch_add(1, Ordering::SeqCst);
        let body = r#"{"type":"error","error":{"type":"rate_limit_error","message":"bench: too many requests at once"}}"#;
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "1"), ("content-type", "application/json")],
            body,
        )
            .into_response();
    }
    tokio::time::sleep(p.latency).await;
    p.in_flight.fetch_sub(1, Ordering::SeqCst);
    p.served.fetch_add(1, Ordering::SeqCst);
    let events = [
        r#"{"type":"message_start","message":{"id":"msg_bench","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[],"stop_reason":null,"usage":{"input_tokens":20,"output_tokens":1}}}"#,
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"done"}}"#,
        r#"{"type":"content_block_stop","index":0}"#,
        r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":2}}"#,
        r#"{"type":"message_stop"}"#,
    ];
    let mut body = String::new();
    for e in events {
        let kind = serde_json::from_str::<serde_json::Value>(e)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .unwrap_or_default();
        body.push_str(&format!("event: {kind}\ndata: {e}\n\n"));
    }
    (
        StatusCode::OK,
        [("content-type", "text/event-stream")],
        body,
    )
        .into_response()
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

async fn one_run(
    a: &AdmissionArgs,
    p: &Provider,
    base: &str,
    admission: bool,
) -> Result<(f64, u64, u64), Problem> {
    let dir = tempfile::tempdir().map_err(|e| Problem::internal(e.to_string()))?;
    let store = format!("file://{}", dir.path().join("store").display());
    std::fs::create_dir_all(dir.path().join("store"))
        .map_err(|e| Problem::internal(e.to_string()))?;
    let base = base.to_owned();
    let backend = flotilla_worker::backend::anthropic::Anthropic::from_vars(&move |k| match k {
        "ANTHROPIC_BASE_URL" => Some(base.clone()),
        "ANTHROPIC_API_KEY" => Some("sk-bench".into()),
        _ => None,
    });
    let e = Embedded::start_parts(
        &store,
        a.concurrency,
        dir.path().join("ws"),
        vec![Arc::new(backend)],
        flotilla_worker::sandbox::Sandbox::Off,
        admission,
    )
    .map_err(|e| Problem::internal(e.to_string()))?;
    let settings = RunSettings {
        backend: "anthropic".into(),
        concurrency: a.concurrency,
        stagger_ms: 0,
        max_agents: a.agents + 1,
        ..RunSettings::default()
    };
    let script = "export const meta = { name: 'bench-admission', description: 'a fan-out against a limited provider' };\n\
                  return (await parallel(Array.from({ length: args.n }, (_, i) => () => agent('item ' + i)))).filter(x => x !== null).length;\n";
    let (served0, refused0) = (
        p.served.load(Ordering::SeqCst),
        p.refused.load(Ordering::SeqCst),
    );
    let start = Instant::now();
    let handle = e
        .coordinator
        .launch(LaunchRequest {
            source: script.into(),
            origin: Some("bench".into()),
            args: serde_json::value::to_raw_value(&serde_json::json!({ "n": a.agents })).ok(),
            settings,
            resume_from: None,
            inherit: false,
            resolver: Arc::new(NoWorkflows),
        })
        .await
        .map_err(|r| Problem::internal(format!("the bench run was refused: {r}")))?;
    let report = handle.wait().await;
    let elapsed = start.elapsed().as_secs_f64();
    e.shutdown();
    if report.status != RunStatus::Completed || report.result != serde_json::json!(a.agents) {
        return Err(Problem::internal(format!(
            "the bench run ended {} with {} (failures: {:?})",
            report.status.as_str(),
            report.result,
            report.failures.first()
        )));
    }
    Ok((
        elapsed,
        p.served.load(Ordering::SeqCst) - served0,
        p.refused.load(Ordering::SeqCst) - refused0,
    ))
}

async fn bench(a: &AdmissionArgs) -> Result<AdmissionReport, Problem> {
    if a.agents == 0 || a.limit == 0 || a.rounds == 0 {
        return Err(Problem::internal(
            "--agents, --limit and --rounds must be at least 1",
        ));
    }
    let provider = Arc::new(Provider {
        limit: a.limit,
        latency: Duration::from_millis(a.latency_ms),
        ..Provider::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| Problem::internal(e.to_string()))?;
    let base = format!(
        "http://{}",
        listener
            .local_addr()
            .map_err(|e| Problem::internal(e.to_string()))?
    );
    let app = axum::Router::new()
        .route("/v1/messages", axum::routing::post(messages))
        .with_state(provider.clone());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let limit_per_s = a.limit as f64 * 1000.0 / a.latency_ms.max(1) as f64;
    let mut runs: [Vec<(f64, u64, u64)>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..a.rounds {
        for (i, admission) in [true, false].into_iter().enumerate() {
            runs[i].push(one_run(a, &provider, &base, admission).await?);
        }
    }
    server.abort();
    let mode = |rs: &[(f64, u64, u64)]| {
        let goodput: Vec<f64> = rs.iter().map(|(t, _, _)| a.agents as f64 / t).collect();
        let g = median(goodput);
        let requests: Vec<f64> = rs.iter().map(|(_, s, r)| (s + r) as f64).collect();
        let refused: Vec<f64> = rs.iter().map(|(_, _, r)| *r as f64).collect();
        let pct: Vec<f64> = rs
            .iter()
            .map(|(_, s, r)| 100.0 * *r as f64 / (s + r).max(1) as f64)
            .collect();
        Mode {
            elapsed_ms: median(rs.iter().map(|(t, _, _)| t * 1000.0).collect()),
            goodput_per_s: g,
            of_limit: g / limit_per_s,
            requests: median(requests),
            refused: median(refused),
            refused_pct: median(pct),
        }
    };
    let adaptive = mode(&runs[0]);
    let fixed = mode(&runs[1]);
    Ok(AdmissionReport {
        agents: a.agents,
        limit: a.limit,
        latency_ms: a.latency_ms,
        concurrency: a.concurrency,
        rounds: a.rounds,
        limit_per_s,
        goodput_ratio: adaptive.goodput_per_s / fixed.goodput_per_s.max(f64::MIN_POSITIVE),
        adaptive,
        fixed,
    })
}

pub async fn run(a: AdmissionArgs) -> i32 {
    match bench(&a).await {
        Ok(r) if a.json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&r).unwrap_or_else(|e| e.to_string())
            );
            0
        }
        Ok(r) => {
            println!(
                "{} agents, provider takes {} at once ({} ms each: {:.0} agents/s at most), concurrency {}, {} rounds",
                r.agents, r.limit, r.latency_ms, r.limit_per_s, r.concurrency, r.rounds
            );
            for (name, m) in [("adaptive", &r.adaptive), ("fixed", &r.fixed)] {
                println!(
                    "  {name:8}  {:7.1} agents/s ({:4.0}% of the limit)  {:6.0} ms  {:5.0} requests  {:5.0} refused ({:.1}%)",
                    m.goodput_per_s,
                    m.of_limit * 100.0,
                    m.elapsed_ms,
                    m.requests,
                    m.refused,
                    m.refused_pct
                );
            }
            println!("  goodput adaptive / fixed: {:.2}", r.goodput_ratio);
            0
        }
        Err(e) => crate::refuse(e),
    }
}
