//! `flotilla bench fanout`: the cost of the script runtime per `agent()` call.
//!
//! In one process, against one coordinator and one in-process echo worker, it alternates two
//! runs of N no-op agents:
//! - **script**: a workflow script that fans out N `agent()` calls with `Promise.all`;
//! - **baseline**: the same N calls pushed straight into a run engine by Rust code, without
//!   the script runtime (same dispatcher, worker, journal and store).
//!
//! `script_overhead_us` = (median script time − median baseline time) / N, in microseconds.

use flotilla_proto::Problem;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use flotilla_coordinator::run::{self, EngineInit};
use flotilla_coordinator::script::{HostReply, ScriptEnd, ScriptOp, ScriptShared};
use flotilla_coordinator::store::records::WorkflowInfo;
use flotilla_coordinator::{LaunchRequest, RunSettings, RunStatus};
use flotilla_local::workflows::NoWorkflows;
use serde::Serialize;
use tokio::sync::mpsc;

mod admission;
mod affinity;
mod fleet;
mod pages;
mod sandbox;
mod scale;
mod sessions;
mod source;

use crate::config;
use crate::embedded::Embedded;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchKind,
}

#[derive(Debug, Subcommand)]
enum BenchKind {
    /// Fan out N no-op echo agents from a script vs. straight through the dispatcher.
    Fanout(FanoutArgs),
    /// Resume a run of N completed calls with the last prompt changed: time to the first new
    /// dispatch and to the end.
    Resume(ResumeArgs),
    /// Send a generated repository as a run's source, relaunch after a one-file change, check
    /// it out warm and cold: each against git doing the same alone.
    Source(crate::bench::source::SourceArgs),
    /// What the restart of an agent interrupted after N turns sends the model when it
    /// continues its session and when it starts over (the real CLI against the test fake API).
    Continue(crate::bench::sessions::ContinueArgs),
    /// Time no-op exec attempts and real-CLI "say hi" attempts without and with the agents'
    /// sandbox.
    Sandbox(crate::bench::sandbox::SandboxArgs),
    /// The fleet at scale: N agents in flight over W worker processes, the leader killed
    /// with all of them out, a big run resumed, failover with a backlog.
    Fleet(crate::bench::scale::FleetArgs),
    /// Goodput and 429s against a provider that takes a limited number of requests at once,
    /// with admission per provider account and with a fixed concurrency.
    Admission(crate::bench::admission::AdmissionArgs),
    /// Prompt-prefix cache hits of self-hosted model servers (one per worker), with prefix
    /// affinity and without it.
    Affinity(crate::bench::affinity::AffinityArgs),
    /// The session pages: time to first byte and to a complete run page with and without the
    /// timeline at 100, 1,000 and 10,000 agents, and the CPU each reader of a live page costs.
    Pages(crate::bench::pages::PagesArgs),
}

#[derive(Debug, Args)]
struct ResumeArgs {
    /// Completed calls in the run that is resumed.
    #[arg(long, default_value_t = 10_000)]
    calls: u64,
    /// Object store [default: a file store in a temporary directory].
    #[arg(long)]
    store: Option<String>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct ResumeReport {
    calls: u64,
    store: String,
    /// The first run, all calls dispatched.
    first_run_ms: f64,
    /// From the resume's launch to the first call that is not served from the journal
    /// reaching the dispatcher.
    first_new_dispatch_ms: f64,
    /// From the resume's launch to its report.
    resume_ms: f64,
    cached: u64,
    dispatched: u64,
}

const RESUME_SCRIPT: &str = "export const meta = { name: 'bench-resume', description: 'N calls, the last one edited on resume' };\n\
const n = args.n;\n\
const calls = [];\n\
for (let i = 0; i < n; i++) calls.push(agent(i === n - 1 ? args.last : 'bench ' + i));\n\
return (await Promise.all(calls)).length;\n";

async fn resume_bench(a: &ResumeArgs) -> Result<ResumeReport, Problem> {
    if a.calls < 2 {
        return Err(Problem::internal("--calls must be at least 2"));
    }
    let dir = tempfile::tempdir().map_err(|e| Problem::internal(e.to_string()))?;
    let url = match &a.store {
        Some(s) => config::store_url(Some(s.clone())),
        None => format!("file://{}", dir.path().join("store").display()),
    };
    if let Some(path) = url.strip_prefix("file://") {
        std::fs::create_dir_all(path).map_err(|e| Problem::internal(e.to_string()))?;
    }
    let e = Embedded::start(&url, 64, dir.path().join("ws"), None)
        .map_err(|e| Problem::internal(e.to_string()))?;
    let launch = |last: &str, resume_from: Option<String>| LaunchRequest {
        source: RESUME_SCRIPT.into(),
        origin: Some("bench".into()),
        args: serde_json::value::to_raw_value(&serde_json::json!({ "n": a.calls, "last": last }))
            .ok(),
        settings: settings(a.calls, 64),
        resume_from,
        inherit: false,
        resolver: Arc::new(NoWorkflows),
    };
    let start = Instant::now();
    let first = e
        .coordinator
        .launch(launch("bench last", None))
        .await
        .map_err(|r| Problem::internal(format!("bench run was refused: {r}")))?;
    let first_id = first.run_id.clone();
    let report = first.wait().await;
    let first_run = start.elapsed();
    if report.status != RunStatus::Completed {
        return Err(Problem::internal(format!(
            "the first run ended {}",
            report.status.as_str()
        )));
    }
    let before = e
        .coordinator
        .dispatch()
        .stats()
        .await
        .map_or(0, |s| s.assigned);
    let start = Instant::now();
    let resumed = e
        .coordinator
        .launch(launch("bench last, edited", Some(first_id)))
        .await
        .map_err(|r| Problem::internal(format!("the resume was refused: {r}")))?;
    // The one changed call is the only one the dispatcher ever sees.
    let mut first_dispatch = None;
    let wait = resumed.wait();
    tokio::pin!(wait);
    let report = loop {
        tokio::select! {
            r = &mut wait => break r,
            stats = e.coordinator.dispatch().stats(), if first_dispatch.is_none() => {
                if stats.is_some_and(|s| s.assigned > before) {
                    first_dispatch = Some(start.elapsed());
                } else {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    };
    let resume = start.elapsed();
    e.shutdown();
    if report.status != RunStatus::Completed {
        return Err(Problem::internal(format!(
            "the resume ended {}",
            report.status.as_str()
        )));
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Ok(ResumeReport {
        calls: a.calls,
        store: url,
        first_run_ms: ms(first_run),
        first_new_dispatch_ms: first_dispatch.map_or(f64::NAN, ms),
        resume_ms: ms(resume),
        cached: report.usage.cached,
        dispatched: report.usage.dispatched,
    })
}

#[derive(Debug, Args)]
struct FanoutArgs {
    /// Run the fan-out through a coordinator and worker processes over mTLS instead of in
    /// this process: with memory leases and storage, and with etcd + an S3 server (moto).
    #[arg(long)]
    distributed: bool,
    /// Worker processes for --distributed.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Skip the etcd + S3 measurement of --distributed.
    #[arg(long)]
    no_durable: bool,
    /// Agent calls per run.
    #[arg(long, default_value_t = 10_000)]
    calls: u64,
    /// Agents at once (worker slots and the run's cap).
    #[arg(long, default_value_t = 64)]
    concurrency: u32,
    /// Measured rounds of each kind (the median is reported).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Object store for the runs' journals (memory:// keeps disk speed out of it).
    #[arg(long, default_value = "memory://")]
    store: String,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct FanoutReport {
    calls: u64,
    concurrency: u32,
    rounds: u32,
    store: String,
    calls_per_s: f64,
    baseline_calls_per_s: f64,
    script_overhead_us: f64,
    script_ms: Vec<f64>,
    baseline_ms: Vec<f64>,
}

pub async fn run(args: BenchArgs) -> i32 {
    match args.what {
        BenchKind::Source(a) => crate::bench::source::run(a).await,
        BenchKind::Sandbox(a) => crate::bench::sandbox::run(a).await,
        BenchKind::Continue(a) => crate::bench::sessions::run(a).await,
        BenchKind::Fleet(a) => crate::bench::scale::run(a).await,
        BenchKind::Admission(a) => crate::bench::admission::run(a).await,
        BenchKind::Affinity(a) => crate::bench::affinity::run(a).await,
        BenchKind::Pages(a) => crate::bench::pages::run(a).await,
        BenchKind::Resume(a) => match resume_bench(&a).await {
            Ok(r) => {
                if a.json {
                    println!("{}", serde_json::to_string(&r).unwrap_or_default());
                } else {
                    println!(
                        "resume of a run of {} completed calls, the last one edited ({}):\n  first run          {:>9.0} ms\n  first new dispatch {:>9.1} ms after launch\n  whole resume       {:>9.0} ms ({} cached, {} dispatched)",
                        r.calls,
                        r.store,
                        r.first_run_ms,
                        r.first_new_dispatch_ms,
                        r.resume_ms,
                        r.cached,
                        r.dispatched
                    );
                }
                0
            }
            Err(e) => crate::refuse(e),
        },
        BenchKind::Fanout(a) if a.distributed => {
            match crate::bench::fleet::fanout(a.calls, a.concurrency, a.workers, !a.no_durable)
                .await
            {
                Ok(r) => {
                    if a.json {
                        println!("{}", serde_json::to_string(&r).unwrap_or_default());
                    } else {
                        println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
                    }
                    0
                }
                Err(e) => crate::refuse(e),
            }
        }
        BenchKind::Fanout(a) => match fanout(&a).await {
            Ok(r) => {
                if a.json {
                    println!("{}", serde_json::to_string(&r).unwrap_or_default());
                } else {
                    println!(
                        "fanout of {} calls (concurrency {}, {} rounds, median):\n  script   {:>10.0} calls/s\n  baseline {:>10.0} calls/s\n  script overhead {:.2} µs per agent() call",
                        r.calls,
                        r.concurrency,
                        r.rounds,
                        r.calls_per_s,
                        r.baseline_calls_per_s,
                        r.script_overhead_us
                    );
                }
                0
            }
            Err(e) => crate::refuse(e),
        },
    }
}

fn settings(calls: u64, concurrency: u32) -> RunSettings {
    RunSettings {
        backend: "echo".into(),
        concurrency,
        max_agents: calls.max(1),
        stagger_ms: 0,
        ..RunSettings::default()
    }
}

pub const SCRIPT: &str = "export const meta = { name: 'bench-fanout', description: 'N no-op agents at once' };\n\
const n = args.n;\n\
const calls = [];\n\
for (let i = 0; i < n; i++) calls.push(agent('bench ' + i));\n\
const results = await Promise.all(calls);\n\
return results.length;\n";

async fn script_round(e: &Embedded, calls: u64, concurrency: u32) -> Result<Duration, Problem> {
    let start = Instant::now();
    let handle = e
        .coordinator
        .launch(LaunchRequest {
            source: SCRIPT.into(),
            origin: Some("bench".into()),
            args: serde_json::value::to_raw_value(&serde_json::json!({ "n": calls })).ok(),
            settings: settings(calls, concurrency),
            resume_from: None,
            inherit: false,
            resolver: Arc::new(NoWorkflows),
        })
        .await
        .map_err(|r| Problem::internal(format!("bench script was refused: {r}")))?;
    let report = handle.wait().await;
    let took = start.elapsed();
    if report.status != RunStatus::Completed || report.result != serde_json::json!(calls) {
        return Err(Problem::internal(format!(
            "bench script run ended {} with result {} ({:?})",
            report.status.as_str(),
            report.result,
            report.error
        )));
    }
    Ok(took)
}

async fn baseline_round(e: &Embedded, calls: u64, concurrency: u32) -> Result<Duration, Problem> {
    let start = Instant::now();
    let (ops_tx, ops_rx) = mpsc::unbounded_channel();
    let (reply_tx, mut reply_rx) = mpsc::unbounded_channel();
    let init = EngineInit {
        run_id: flotilla_coordinator::coordinator::new_run_id(),
        workflow: WorkflowInfo {
            name: "bench-baseline".into(),
            description: "N no-op agents without a script".into(),
        },
        phases: Vec::new(),
        settings: settings(calls, concurrency),
        store: e.coordinator.store().clone(),
        generation: 1,
        dispatch: e.coordinator.dispatch().clone(),
        resolver: Arc::new(NoWorkflows),
        resume: None,
        shared: Arc::new(ScriptShared::default()),
        script_path: None,
        parent_run_id: None,
        write_result: false,
        owners: Vec::new(),
        cache_dir: None,
        indexed: None,
        notifier: None,
        quotas: None,
        tasks: Default::default(),
        budget_pauses: false,
        answers_from_store: false,
        page_base: None,
        park_after: None,
        logs_before: Vec::new(),
        kept: Default::default(),
    };
    let handle = run::start(
        init,
        ops_rx,
        Box::new(move |r: HostReply| {
            let _ = reply_tx.send(r);
        }),
    );
    for i in 0..calls {
        let _ = ops_tx.send(ScriptOp::Agent {
            id: i + 1,
            prompt: format!("bench {i}"),
            opts_json: "{}".into(),
            group: String::new(),
            child: String::new(),
        });
    }
    let mut done = 0u64;
    while done < calls {
        match reply_rx.recv().await {
            Some(HostReply::Agent { result: Ok(_), .. }) => done += 1,
            Some(HostReply::Agent { result: Err(e), .. }) => {
                return Err(Problem::internal(format!(
                    "baseline call failed: {}",
                    e.message
                )));
            }
            Some(_) => {}
            None => return Err(Problem::internal("baseline engine ended early")),
        }
    }
    let _ = ops_tx.send(ScriptOp::Finished(ScriptEnd::Returned(Some(
        calls.to_string(),
    ))));
    let report = handle.wait().await;
    let took = start.elapsed();
    if report.status != RunStatus::Completed {
        return Err(Problem::internal(format!(
            "baseline run ended {}",
            report.status.as_str()
        )));
    }
    Ok(took)
}

fn median(v: &[Duration]) -> Duration {
    let mut s = v.to_vec();
    s.sort();
    s[s.len() / 2]
}

async fn fanout(a: &FanoutArgs) -> Result<FanoutReport, Problem> {
    if a.calls == 0 || a.rounds == 0 || a.concurrency == 0 {
        return Err(Problem::internal(
            "--calls, --rounds and --concurrency must be at least 1",
        ));
    }
    let url = config::store_url(Some(a.store.clone()));
    let workspace = std::env::temp_dir().join("flotilla-bench-workspace");
    let e = Embedded::start(&url, a.concurrency, workspace, None)
        .map_err(|e| Problem::internal(e.to_string()))?;
    // Warm up both paths (thread pools, allocator, QuickJS).
    let warm = a.calls.min(500);
    script_round(&e, warm, a.concurrency).await?;
    baseline_round(&e, warm, a.concurrency).await?;
    let mut script = Vec::new();
    let mut baseline = Vec::new();
    for _ in 0..a.rounds {
        baseline.push(baseline_round(&e, a.calls, a.concurrency).await?);
        script.push(script_round(&e, a.calls, a.concurrency).await?);
    }
    e.shutdown();
    let (s, b) = (median(&script), median(&baseline));
    let n = a.calls as f64;
    Ok(FanoutReport {
        calls: a.calls,
        concurrency: a.concurrency,
        rounds: a.rounds,
        store: url,
        calls_per_s: n / s.as_secs_f64(),
        baseline_calls_per_s: n / b.as_secs_f64(),
        script_overhead_us: (s.as_secs_f64() - b.as_secs_f64()) * 1e6 / n,
        script_ms: script.iter().map(|d| d.as_secs_f64() * 1e3).collect(),
        baseline_ms: baseline.iter().map(|d| d.as_secs_f64() * 1e3).collect(),
    })
}
