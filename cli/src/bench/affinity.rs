//! `flotilla bench affinity`: prompt-prefix cache hits of self-hosted model servers, one per
//! worker, with prefix affinity and without it.
//!
//! In one process: `--workers` local OpenAI-compatible servers on loopback, each with a
//! prefix cache of its own that holds `--cache` prefixes (least recently used goes first); a
//! prefix that is in the cache costs no prefill (`--prefill-ms` otherwise), and the answer
//! says how many prompt tokens it served from the cache. A coordinator and one worker per
//! server (`--slots` each, `--local-prefix-cache openai`), and a fan-out of `--calls` agents
//! over `--groups` prefixes (a model each, so the requests differ from their first token).
//! Rounds alternate the two modes:
//! - **affinity** (the default): a group's calls go back to the worker that served it first;
//! - **spread** (`FLOTILLA_AFFINITY=off`): wherever a slot is free.
//!
//! Figures per mode (medians): the share of prompt tokens served from caches, and the run's
//! time; `speedup` is spread's time over affinity's.

use flotilla_proto::Problem;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::response::IntoResponse;
use clap::Args;
use flotilla_coordinator::lease::memory::MemoryLeaseStore;
use flotilla_coordinator::{Coordinator, LaunchRequest, RunSettings, RunStatus};
use flotilla_local::workflows::NoWorkflows;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::bench::admission::median;

#[derive(Debug, Args)]
pub struct AffinityArgs {
    /// Workers, each with a model server of its own.
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Attempts at once per worker.
    #[arg(long, default_value_t = 4)]
    slots: u32,
    /// Prefixes (groups of calls that share one).
    #[arg(long, default_value_t = 8)]
    groups: u32,
    /// Prefixes each server's cache holds.
    #[arg(long, default_value_t = 2)]
    cache: usize,
    /// Agents per run.
    #[arg(long, default_value_t = 800)]
    calls: u64,
    /// Prompt tokens of a prefix (what a hit saves).
    #[arg(long, default_value_t = 2000)]
    prefix_tokens: u64,
    /// Prefill time of a prefix that is not in the cache, in milliseconds.
    #[arg(long, default_value_t = 40)]
    prefill_ms: u64,
    /// Time of the rest of a request (decoding), in milliseconds.
    #[arg(long, default_value_t = 10)]
    decode_ms: u64,
    /// Runs per mode (alternating); the medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// One model server: its prefix cache and what it served.
struct Server {
    cache: Mutex<VecDeque<String>>,
    capacity: usize,
    prefix_tokens: u64,
    prefill: Duration,
    decode: Duration,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
}

async fn completions(
    State(s): State<Arc<Server>>,
    axum::Json(body): axum::Json<serde_json::Value>,
) -> axum::response::Response {
    // The prefix: the model and the system message, which every request of a group shares.
    let prefix = format!(
        "{}\u{0}{}",
        body["model"].as_str().unwrap_or(""),
        body["messages"][0]["content"].as_str().unwrap_or("")
    );
    let hit = {
        let mut cache = s.cache.lock().unwrap_or_else(|e| e.into_inner());
        let hit = match cache.iter().position(|p| *p == prefix) {
            Some(i) => {
                cache.remove(i);
                true
            }
            None => false,
        };
        cache.push_front(prefix);
        cache.truncate(s.capacity);
        hit
    };
    let prompt = s.prefix_tokens + 10;
    let cached = if hit { s.prefix_tokens } else { 0 };
    s.prompt_tokens.fetch_add(prompt, Ordering::Relaxed);
    s.cached_tokens.fetch_add(cached, Ordering::Relaxed);
    tokio::time::sleep(if hit { s.decode } else { s.prefill + s.decode }).await;
    let chunk = serde_json::json!({"choices": [{"index": 0, "delta": {"content": "done"}}]});
    let usage = serde_json::json!({"choices": [], "usage": {"prompt_tokens": prompt,
        "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached}}});
    let text = format!("data: {chunk}\n\ndata: {usage}\n\ndata: [DONE]\n\n");
    ([("content-type", "text/event-stream")], text).into_response()
}

#[derive(Debug, Serialize, Default, Clone)]
struct Mode {
    /// Prompt tokens served from the servers' caches, over all prompt-prefix tokens.
    cached_share: f64,
    elapsed_ms: f64,
}

#[derive(Debug, Serialize)]
struct AffinityReport {
    workers: u32,
    slots: u32,
    groups: u32,
    cache: usize,
    calls: u64,
    rounds: u32,
    affinity: Mode,
    spread: Mode,
    /// Spread's time over affinity's.
    speedup: f64,
}

async fn one_run(
    a: &AffinityArgs,
    servers: &[(Arc<Server>, String)],
    affinity: bool,
) -> Result<(f64, f64), Problem> {
    for (s, _) in servers {
        s.cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
        s.prompt_tokens.store(0, Ordering::Relaxed);
        s.cached_tokens.store(0, Ordering::Relaxed);
    }
    let coordinator = Coordinator::build(
        flotilla_coordinator::store::open("memory://")
            .map_err(|e| Problem::internal(e.to_string()))?,
        MemoryLeaseStore::new(),
        flotilla_coordinator::CoordinatorOptions {
            dispatch: flotilla_coordinator::sched::DispatchOptions {
                fixed_fleet: true,
                affinity,
                ..Default::default()
            },
            ..Default::default()
        },
    );
    let cancel = CancellationToken::new();
    let dir = tempfile::tempdir().map_err(|e| Problem::internal(e.to_string()))?;
    for (i, (_, base)) in servers.iter().enumerate() {
        let base = base.clone();
        let backend = flotilla_worker::backend::openai::OpenAi::from_vars(&move |k| match k {
            "OPENAI_BASE_URL" => Some(base.clone()),
            "OPENAI_API_KEY" => Some("sk-bench".into()),
            _ => None,
        });
        let worker = flotilla_worker::Worker::new(
            flotilla_worker::WorkerOptions {
                account_limits: flotilla_worker::AccountLimits {
                    local_cache: vec!["openai".into()],
                    ..Default::default()
                },
                ..flotilla_worker::WorkerOptions::unsandboxed(
                    &format!("w{i}"),
                    a.slots,
                    dir.path().join(format!("w{i}")),
                )
            },
            vec![Arc::new(backend)],
        );
        let (link, end) = flotilla_proto::link::link_pair();
        coordinator.dispatch().attach(end);
        let token = cancel.child_token();
        tokio::spawn(async move { worker.run(link, token).await });
    }
    let settings = RunSettings {
        backend: "openai".into(),
        concurrency: a.workers * a.slots * 2,
        stagger_ms: 0,
        max_agents: a.calls + 1,
        ..RunSettings::default()
    };
    let script = "export const meta = { name: 'bench-affinity', description: 'a fan-out over a few prompt prefixes' };\n\
                  return (await parallel(Array.from({ length: args.n }, (_, i) => () => agent('item ' + i, { model: 'm' + (i % args.groups) })))).filter(x => x !== null).length;\n";
    let start = Instant::now();
    let handle = coordinator
        .launch(LaunchRequest {
            source: script.into(),
            origin: Some("bench".into()),
            args: serde_json::value::to_raw_value(
                &serde_json::json!({ "n": a.calls, "groups": a.groups }),
            )
            .ok(),
            settings,
            resume_from: None,
            inherit: false,
            resolver: Arc::new(NoWorkflows),
        })
        .await
        .map_err(|r| Problem::internal(format!("the bench run was refused: {r}")))?;
    let report = handle.wait().await;
    let elapsed = start.elapsed().as_secs_f64();
    cancel.cancel();
    coordinator.shutdown();
    if report.status != RunStatus::Completed || report.result != serde_json::json!(a.calls) {
        return Err(Problem::internal(format!(
            "the bench run ended {} with {} (failures: {:?})",
            report.status.as_str(),
            report.result,
            report.failures.first()
        )));
    }
    let (cached, prefix): (u64, u64) = servers.iter().fold((0, 0), |(c, p), (s, _)| {
        (
            c + s.cached_tokens.load(Ordering::Relaxed),
            p + s.prompt_tokens.load(Ordering::Relaxed) / (s.prefix_tokens + 10) * s.prefix_tokens,
        )
    });
    Ok((cached as f64 / prefix.max(1) as f64, elapsed))
}

async fn bench(a: &AffinityArgs) -> Result<AffinityReport, Problem> {
    if a.workers == 0
        || a.slots == 0
        || a.groups == 0
        || a.cache == 0
        || a.calls == 0
        || a.rounds == 0
    {
        return Err(Problem::internal(
            "--workers, --slots, --groups, --cache, --calls and --rounds must be at least 1",
        ));
    }
    let mut servers = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..a.workers {
        let server = Arc::new(Server {
            cache: Mutex::new(VecDeque::new()),
            capacity: a.cache,
            prefix_tokens: a.prefix_tokens,
            prefill: Duration::from_millis(a.prefill_ms),
            decode: Duration::from_millis(a.decode_ms),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| Problem::internal(e.to_string()))?;
        let base = format!(
            "http://{}/v1",
            listener
                .local_addr()
                .map_err(|e| Problem::internal(e.to_string()))?
        );
        let app = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(completions))
            .with_state(server.clone());
        tasks.push(tokio::spawn(
            async move { axum::serve(listener, app).await },
        ));
        servers.push((server, base));
    }
    let mut runs: [Vec<(f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..a.rounds {
        for (i, affinity) in [true, false].into_iter().enumerate() {
            runs[i].push(one_run(a, &servers, affinity).await?);
        }
    }
    for t in tasks {
        t.abort();
    }
    let mode = |rs: &[(f64, f64)]| Mode {
        cached_share: median(rs.iter().map(|(c, _)| *c).collect()),
        elapsed_ms: median(rs.iter().map(|(_, t)| t * 1000.0).collect()),
    };
    let (affinity, spread) = (mode(&runs[0]), mode(&runs[1]));
    Ok(AffinityReport {
        workers: a.workers,
        slots: a.slots,
        groups: a.groups,
        cache: a.cache,
        calls: a.calls,
        rounds: a.rounds,
        speedup: spread.elapsed_ms / affinity.elapsed_ms.max(f64::MIN_POSITIVE),
        affinity,
        spread,
    })
}

pub async fn run(a: AffinityArgs) -> i32 {
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
                "{} agents over {} prefixes, {} workers of {} slots, each server caching {} prefixes, {} rounds",
                r.calls, r.groups, r.workers, r.slots, r.cache, r.rounds
            );
            for (name, m) in [("affinity", &r.affinity), ("spread", &r.spread)] {
                println!(
                    "  {name:8}  {:5.1}% of prefix tokens from the cache  {:7.0} ms",
                    m.cached_share * 100.0,
                    m.elapsed_ms
                );
            }
            println!("  time spread / affinity: {:.2}", r.speedup);
            0
        }
        Err(e) => crate::refuse(e),
    }
}
