//! `flotilla bench sandbox`: what the agents' sandbox costs an attempt.
//!
//! In one process, with an embedded coordinator and a worker run as a fleet worker runs
//! (a directory per call), it times attempts one after another, without and then with the
//! bubblewrap sandbox (its seccomp filter, its model API gateway, and the worker's default
//! limits: a cgroup or rlimits, the disk quota and its watch), and reports the medians and
//! their ratio:
//! - a no-op exec attempt (`true`);
//! - with `--claude`, a real Claude Code CLI attempt ("say hi") against the worker's
//!   `ANTHROPIC_BASE_URL` (a local fake API offline).
//!
//! An attempt's time is its slot's, start to end, as the run's report has it.

use flotilla_proto::Problem;
use std::sync::Arc;

use clap::Args;
use flotilla_coordinator::{LaunchRequest, RunSettings, RunStatus};
use flotilla_local::workflows::NoWorkflows;
use serde::Serialize;

use crate::embedded::Embedded;

#[derive(Debug, Args)]
pub struct SandboxArgs {
    /// Attempts timed per figure.
    #[arg(long, default_value_t = 20)]
    rounds: u64,
    /// Time a real Claude Code CLI attempt too (`claude`, or FLOTILLA_CLAUDE_BIN, against
    /// ANTHROPIC_BASE_URL).
    #[arg(long)]
    claude: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize, Default)]
pub struct SandboxReport {
    rounds: u64,
    exec_plain_ms: f64,
    exec_sandboxed_ms: f64,
    exec_ratio: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    claude_plain_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    claude_sandboxed_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    claude_ratio: Option<f64>,
}

const SCRIPT: &str = "export const meta = { name: 'bench-sandbox', description: 'attempts one after another' };\n\
const out = [];\n\
for (let i = 0; i < args.n; i++) out.push(await agent(args.prompt + ' ' + i));\n\
return out.filter((x) => x !== null).length;\n";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The median attempt time of `n` attempts of `backend` one after another.
async fn attempts(
    sandbox: flotilla_worker::sandbox::Sandbox,
    backend: &str,
    prompt: &str,
    n: u64,
) -> Result<f64, Problem> {
    let dir = tempfile::tempdir().map_err(|e| Problem::internal(e.to_string()))?;
    let store = dir.path().join("store");
    std::fs::create_dir_all(&store).map_err(|e| Problem::internal(e.to_string()))?;
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).map_err(|e| Problem::internal(e.to_string()))?;
    // As a fleet worker runs attempts: a directory of each call's own, and (sandboxed) the
    // worker's limits, its disk quota included; the sandbox brings its seccomp filter.
    let limits = if sandbox.is_on() {
        flotilla_worker::limits::Limits::detect(flotilla_worker::limits::Settings::default())
    } else {
        flotilla_worker::limits::Limits::default()
    };
    let backends = flotilla_worker::backend::NAMES
        .iter()
        .filter_map(|name| flotilla_worker::backend::by_name(name, Some("true")).ok())
        .collect();
    let e = Embedded::start_shaped(
        &format!("file://{}", store.display()),
        (1, ws, backends, sandbox),
        false,
        |o| {
            o.shared_workspace = false;
            o.limits = limits;
        },
    )
    .map_err(|e| Problem::internal(e.to_string()))?;
    let handle = e
        .coordinator
        .launch(LaunchRequest {
            source: SCRIPT.into(),
            origin: Some("bench".into()),
            args: serde_json::value::to_raw_value(&serde_json::json!({ "n": n, "prompt": prompt }))
                .ok(),
            settings: RunSettings {
                backend: backend.into(),
                concurrency: 1,
                max_agents: n.max(1),
                stagger_ms: 0,
                ..RunSettings::default()
            },
            resume_from: None,
            inherit: false,
            resolver: Arc::new(NoWorkflows),
        })
        .await
        .map_err(|r| Problem::internal(format!("the bench run was refused: {r}")))?;
    let report = handle.wait().await;
    e.shutdown();
    if report.status != RunStatus::Completed || report.result != serde_json::json!(n) {
        return Err(Problem::internal(format!(
            "the {backend} attempts did not all complete: {}",
            report
                .failures
                .first()
                .cloned()
                .unwrap_or_else(|| report.status.as_str().to_owned())
        )));
    }
    Ok(median(
        report
            .agents
            .iter()
            .filter_map(|a| Some(a.end_ms?.saturating_sub(a.start_ms?) as f64))
            .collect(),
    ))
}

pub async fn measure(a: &SandboxArgs) -> Result<SandboxReport, Problem> {
    let sandboxed = crate::sandbox_with_api(Vec::new()).await?;
    let off = flotilla_worker::sandbox::Sandbox::Off;
    let mut r = SandboxReport {
        rounds: a.rounds,
        ..SandboxReport::default()
    };
    r.exec_plain_ms = attempts(off.clone(), "exec", "noop", a.rounds).await?;
    r.exec_sandboxed_ms = attempts(sandboxed.clone(), "exec", "noop", a.rounds).await?;
    r.exec_ratio = r.exec_sandboxed_ms / r.exec_plain_ms.max(0.001);
    if a.claude {
        let plain = attempts(off, "claude-code", "say hi", a.rounds).await?;
        let boxed = attempts(sandboxed, "claude-code", "say hi", a.rounds).await?;
        r.claude_plain_ms = Some(plain);
        r.claude_sandboxed_ms = Some(boxed);
        r.claude_ratio = Some(boxed / plain.max(0.001));
    }
    Ok(r)
}

pub async fn run(a: SandboxArgs) -> i32 {
    match measure(&a).await {
        Ok(r) => {
            if a.json {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
            } else {
                println!(
                    "attempt time, median of {} (without → with the sandbox):\n  exec no-op       {:>8.1} ms → {:>8.1} ms  ({:.2}×)",
                    r.rounds, r.exec_plain_ms, r.exec_sandboxed_ms, r.exec_ratio
                );
                if let (Some(p), Some(s), Some(x)) =
                    (r.claude_plain_ms, r.claude_sandboxed_ms, r.claude_ratio)
                {
                    println!("  claude \"say hi\"  {p:>8.1} ms → {s:>8.1} ms  ({x:.2}×)");
                }
            }
            0
        }
        Err(e) => crate::refuse(e),
    }
}
