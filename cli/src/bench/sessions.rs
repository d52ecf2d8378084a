//! `flotilla bench continue`: what the restart of an interrupted agent sends the model when it
//! continues its own session (issue 33, 3) and when it starts over, through the real Claude
//! Code CLI.
//!
//! For each N in `--turns`, in one process (an embedded coordinator and worker, the
//! `claude-code` backend), an agent of N + `--after` turns is cut off by the stall watchdog
//! while it waits on its model call after N turns; its second attempt finishes the task. Once
//! with the worker continuing sessions (the default), once with every attempt starting over
//! (`FLOTILLA_SESSIONS=fresh`). The second attempt's figures come from the CLI's own result
//! line (what the API said it read): prompt tokens sent (uncached, written to the cache, read
//! from it), model calls, and cost; `cost_ratio` is continued over fresh.
//!
//! It needs the CLI (`claude` on PATH, or FLOTILLA_CLAUDE_BIN) and `ANTHROPIC_BASE_URL` set
//! to a Messages API that plays scripted agents: the test suite's fake (`tools/bench-continue`
//! starts it), whose `[[turns:N]]` and `[[stall-at:K]]` markers make the agent and its stall,
//! and whose simulated prompt cache reports cache reads as the real API does.

use flotilla_proto::Problem;
use std::sync::Arc;

use clap::Args;
use flotilla_coordinator::{LaunchRequest, RunSettings, RunStatus};
use flotilla_local::workflows::NoWorkflows;
use serde::Serialize;
use serde_json::Value;

use crate::embedded::Embedded;

#[derive(Debug, Args)]
pub struct ContinueArgs {
    /// Turns the agent has taken when it is interrupted (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "2,8,32")]
    turns: Vec<u32>,
    /// Turns left after the interruption.
    #[arg(long, default_value_t = 2)]
    after: u32,
    /// The run's stall timeout, in milliseconds: how long the stalled model call is waited out.
    #[arg(long, default_value_t = 2000)]
    stall_ms: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// What one restarted attempt sent the model.
#[derive(Debug, Serialize, Default, Clone)]
struct Restart {
    model_calls: u64,
    /// Prompt tokens of all its model calls: uncached, written to the cache, read from it.
    sent_tokens: u64,
    uncached_tokens: u64,
    cache_write_tokens: u64,
    cache_read_tokens: u64,
    cost_usd: f64,
}

#[derive(Debug, Serialize)]
struct Row {
    turns: u32,
    continued: Restart,
    fresh: Restart,
    /// Continued over fresh.
    cost_ratio: f64,
    sent_ratio: f64,
    uncached_ratio: f64,
}

#[derive(Debug, Serialize)]
pub struct ContinueReport {
    after: u32,
    rows: Vec<Row>,
}

const SCRIPT: &str = "export const meta = { name: 'bench-continue', description: 'one agent, interrupted and restarted' };\n\
return await agent(args.prompt, { label: 'agent' });\n";

/// Runs one agent interrupted after `n` turns; what its second attempt sent the model.
async fn restart(n: u32, after: u32, stall_ms: u64, continues: bool) -> Result<Restart, Problem> {
    let dir = tempfile::tempdir().map_err(|e| Problem::internal(e.to_string()))?;
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).map_err(|e| Problem::internal(e.to_string()))?;
    let claude = flotilla_worker::backend::claude::ClaudeCode {
        sessions: continues,
        ..flotilla_worker::backend::claude::ClaudeCode::from_env()
    };
    let backends: Vec<Arc<dyn flotilla_worker::backend::AgentBackend>> = vec![Arc::new(claude)];
    let e = Embedded::start_shaped(
        &format!("file://{}", dir.path().join("store").display()),
        (1, ws, backends, flotilla_worker::sandbox::Sandbox::Off),
        false,
        |o| o.shared_workspace = false,
    )
    .map_err(|e| Problem::internal(e.to_string()))?;
    // A prompt of its own each time: the fake stalls each prompt once.
    let mode = if continues { "continued" } else { "fresh" };
    let nonce = flotilla_coordinator::ids::new_run_id();
    let prompt = format!(
        "bench {mode} {nonce} [[turns:{}]] [[stall-at:{n}]]",
        n + after
    );
    let handle = e
        .coordinator
        .launch(LaunchRequest {
            source: SCRIPT.into(),
            origin: Some("bench".into()),
            args: serde_json::value::to_raw_value(&serde_json::json!({ "prompt": prompt })).ok(),
            settings: RunSettings {
                backend: "claude-code".into(),
                concurrency: 1,
                stagger_ms: 0,
                stall_timeout_ms: stall_ms,
                ..RunSettings::default()
            },
            resume_from: None,
            inherit: false,
            resolver: Arc::new(NoWorkflows),
        })
        .await
        .map_err(|r| Problem::internal(format!("the bench run was refused: {r}")))?;
    let report = handle.wait().await;
    let attempts = report.agents.first().map_or(0, |a| a.attempts);
    if report.status != RunStatus::Completed || attempts != 2 {
        e.shutdown();
        return Err(Problem::internal(format!(
            "the agent interrupted after {n} turns did not end in its second attempt ({}, {attempts} attempts; is ANTHROPIC_BASE_URL the test suite's fake API?): {}",
            report.status.as_str(),
            report.error.clone().unwrap_or_default()
        )));
    }
    let store = e.coordinator.store().clone();
    let seen = flotilla_coordinator::host::transcripts(&store, &report, Some("agent"), Some(2))
        .await
        .map_err(|e| Problem::internal(format!("cannot read the second attempt: {e:?}")))?;
    e.shutdown();
    let result = seen
        .first()
        .and_then(|t| t.events.iter().rev().find(|ev| ev["type"] == "result"))
        .cloned()
        .ok_or_else(|| Problem::internal("the second attempt has no result line"))?;
    let n_of = |p: &str| result.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let (input, write, read) = (
        n_of("/usage/input_tokens"),
        n_of("/usage/cache_creation_input_tokens"),
        n_of("/usage/cache_read_input_tokens"),
    );
    Ok(Restart {
        model_calls: n_of("/num_turns"),
        sent_tokens: input + write + read,
        uncached_tokens: input + write,
        cache_write_tokens: write,
        cache_read_tokens: read,
        cost_usd: result["cost_usd"].as_f64().unwrap_or(0.0),
    })
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

pub async fn measure(a: &ContinueArgs) -> Result<ContinueReport, Problem> {
    let mut rows = Vec::new();
    for &n in &a.turns {
        let continued = restart(n, a.after, a.stall_ms, true).await?;
        let fresh = restart(n, a.after, a.stall_ms, false).await?;
        rows.push(Row {
            turns: n,
            cost_ratio: ratio(continued.cost_usd, fresh.cost_usd),
            sent_ratio: ratio(continued.sent_tokens as f64, fresh.sent_tokens as f64),
            uncached_ratio: ratio(
                continued.uncached_tokens as f64,
                fresh.uncached_tokens as f64,
            ),
            continued,
            fresh,
        });
    }
    Ok(ContinueReport {
        after: a.after,
        rows,
    })
}

pub async fn run(a: ContinueArgs) -> i32 {
    match measure(&a).await {
        Ok(r) => {
            if a.json {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
                return 0;
            }
            println!(
                "the restart of an agent interrupted after N turns ({} left), continued vs started over:",
                r.after
            );
            for row in &r.rows {
                println!(
                    "  N={:>3}  model calls {:>3} vs {:>3}  prompt tokens {:>8} vs {:>8} ({:.2}×), uncached {:>7} vs {:>7} ({:.2}×)  cost ${:.4} vs ${:.4} ({:.2}×)",
                    row.turns,
                    row.continued.model_calls,
                    row.fresh.model_calls,
                    row.continued.sent_tokens,
                    row.fresh.sent_tokens,
                    row.sent_ratio,
                    row.continued.uncached_tokens,
                    row.fresh.uncached_tokens,
                    row.uncached_ratio,
                    row.continued.cost_usd,
                    row.fresh.cost_usd,
                    row.cost_ratio
                );
            }
            0
        }
        Err(e) => crate::refuse(e),
    }
}
