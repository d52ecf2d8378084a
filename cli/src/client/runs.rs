//! The client commands on one run: `wait`, `logs`, `watch`, `status`, `pause`, `stop`,
//! `restart`, and `runs` on a coordinator.

use std::io::Write;
use std::sync::Arc;

use flotilla_proto::v1::{self};
use flotilla_proto::wire::Report;
use flotilla_proto::wire::SnapshotView;

use crate::client::*;
use crate::{fail_kind, print_report};

/// `flotilla wait RUN`.
#[derive(Debug, clap::Args)]
pub struct WaitArgs {
    #[command(flatten)]
    pub run: RunRefArgs,
    /// Exit 5 when the run completed but some of its agents failed (without it such a run
    /// exits 0, its script having handled the failures; 4 when every agent failed either way).
    #[arg(long)]
    pub exit_status: bool,
}

pub async fn wait(a: WaitArgs) -> i32 {
    let mut client = match a.run.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    let (json, full) = (a.run.json, a.run.full);
    wait_and_report(&mut client, a.run.run_id, json, full, a.exit_status).await
}

/// Waits for run `run_id` to end and prints its report; the exit status says how it ended
/// (strictly, with `exit_status`: any failed agent is a failure).
pub(crate) async fn wait_and_report(
    client: &mut ClientServiceClient<Channel>,
    run_id: String,
    json: bool,
    full: bool,
    exit_status: bool,
) -> i32 {
    match client.wait(v1::RunRef { run_id }).await {
        Ok(r) => match serde_json::from_str::<Report>(&r.into_inner().report_json) {
            Ok(report) => {
                let code = print_report(&report, json, full);
                let summary = flotilla_proto::wire::Summary::of_report(&report);
                if exit_status && code == summary.exit_code() {
                    summary.strict_exit_code()
                } else {
                    code
                }
            }
            Err(e) => fail_kind(
                flotilla_proto::ErrorKind::Unavailable,
                format!("the coordinator sent a report this client cannot read: {e}"),
            ),
        },
        Err(s) => rpc_fail(&s),
    }
}

/// What `flotilla logs` asks for.
#[derive(Debug, Clone, Copy)]
pub struct LogsAsk<'a> {
    pub run: &'a str,
    pub agent: Option<&'a str>,
    pub attempt: Option<u32>,
    pub json: bool,
    /// Print new events as they come until the run ends.
    pub follow: bool,
}

/// How often `logs --follow` looks for new events.
pub const FOLLOW_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// `flotilla logs RUN --coordinator URL`: transcripts through the coordinator, which reads
/// its own store; with `follow`, again every second until the run has ended.
pub async fn logs_remote(remote: ClientArgs, ask: LogsAsk<'_>) -> i32 {
    let mut client = match remote.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    let mut printed = if ask.follow {
        crate::stored::Printed::following()
    } else {
        crate::stored::Printed::default()
    };
    loop {
        // Whether it had ended before this read: then this read is its last.
        let ended = !ask.follow
            || match client
                .status(v1::RunRef {
                    run_id: ask.run.to_owned(),
                })
                .await
            {
                Ok(r) => serde_json::from_str::<SnapshotView>(&r.into_inner().snapshot_json)
                    .map_or(true, |s| s.summary.status.is_final()),
                // Not running there: it has ended (or the transcripts' answer says why not).
                Err(s) if s.code() == tonic::Code::NotFound => true,
                Err(s) => return rpc_fail(&s),
            };
        let reply = client
            .transcripts(v1::TranscriptsRequest {
                protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
                run_id: ask.run.to_owned(),
                agent: ask.agent.unwrap_or_default().to_owned(),
                attempt: ask.attempt.unwrap_or(0),
            })
            .await;
        let reply = match reply {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::NotFound => {
                return crate::fail_kind(flotilla_proto::ErrorKind::NotFound, s.message());
            }
            Err(s) => return rpc_fail(&s),
        };
        let mut found = Vec::with_capacity(reply.agents_json.len());
        for a in &reply.agents_json {
            match serde_json::from_str::<flotilla_proto::wire::AgentTranscript>(a) {
                Ok(t) => found.push(t),
                Err(e) => {
                    return fail_kind(
                        flotilla_proto::ErrorKind::Unavailable,
                        format!("the coordinator sent a transcript this client cannot read: {e}"),
                    );
                }
            }
        }
        printed.print(&found, ask.json);
        if ended {
            return 0;
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
    }
}

/// Follows a run on a coordinator: progress bars on a terminal, plain lines otherwise, then
/// the report (as `run` prints it).
pub async fn watch(a: RunRefArgs) -> i32 {
    let mut client = match a.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    watch_on(&mut client, a.run_id.clone(), a.json, a.full, false).await
}

/// Follows run `run_id` (`watch`, `launch --watch`), then prints its report as
/// [`wait_and_report`] does (`exit_status`: 5 when agents failed).
pub(crate) async fn watch_on(
    client: &mut ClientServiceClient<Channel>,
    run_id: String,
    json: bool,
    full: bool,
    exit_status: bool,
) -> i32 {
    use std::io::IsTerminal;
    let bars = !json && std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
    let mode = crate::progress::Mode::pick(bars, !bars && !json);
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(flotilla_proto::wire::Snapshot::default()));
    let view = crate::progress::start(mode, rx);
    let run = v1::RunRef { run_id };
    loop {
        match client.status(run.clone()).await {
            Ok(r) => match serde_json::from_str::<SnapshotView>(&r.into_inner().snapshot_json) {
                Ok(s) => {
                    let ended = s.summary.status.is_final();
                    let _ = tx.send(Arc::new(flotilla_proto::wire::Snapshot::from(&s)));
                    if ended {
                        break;
                    }
                }
                Err(e) => {
                    view.finish().await;
                    return fail_kind(
                        flotilla_proto::ErrorKind::Unavailable,
                        format!("the coordinator sent a status this client cannot read: {e}"),
                    );
                }
            },
            // Not running there (ended before, or elsewhere): the report says the rest.
            Err(s) if s.code() == tonic::Code::NotFound => break,
            Err(s) => {
                view.finish().await;
                return rpc_fail(&s);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    view.finish().await;
    wait_and_report(client, run.run_id, json, full, exit_status).await
}

pub async fn status(a: RunRefArgs) -> i32 {
    let mut client = match a.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    match client
        .status(v1::RunRef {
            run_id: a.run_id.clone(),
        })
        .await
    {
        Ok(r) => {
            let r = r.into_inner();
            if a.json {
                println!("{}", r.snapshot_json);
                return 0;
            }
            match serde_json::from_str::<SnapshotView>(&r.snapshot_json) {
                Ok(s) => {
                    let mut out = std::io::stdout().lock();
                    for line in status_lines(&s) {
                        let _ = writeln!(out, "{line}");
                    }
                    0
                }
                Err(e) => fail_kind(flotilla_proto::ErrorKind::Unavailable, e.to_string()),
            }
        }
        Err(s) => rpc_fail(&s),
    }
}

/// What plain `flotilla status` prints: the run's summary (status, agents by state, tokens,
/// cost, elapsed), why agents wait, and each group's progress.
pub(crate) fn status_lines(s: &SnapshotView) -> Vec<String> {
    let u = &s.summary;
    let mut lines = vec![format!(
        "{} {} · {} · {} in / {} out tokens · ${:.4} · {}",
        s.run_id,
        u.headline(),
        u.agents_line(),
        u.input_tokens,
        u.output_tokens,
        u.cost_usd,
        crate::progress::elapsed(u.elapsed_ms)
    )];
    if let Some(w) = &u.waiting {
        lines.push(format!("  waiting: {}", crate::term::clean(w)));
    }
    for g in &s.groups {
        let (done, total) = (g.done + g.failed, g.total);
        let title = if g.title.is_empty() {
            "(no phase)".into()
        } else {
            crate::term::clean(&g.title)
        };
        lines.push(format!("  [{title}] {done}/{total}"));
    }
    lines
}

/// `pause` a run.
pub async fn pause(a: PauseArgs) -> i32 {
    control_call(&a.run, "pause", "", a.reason.as_deref().unwrap_or("")).await
}

pub(crate) async fn control_call(a: &RunRefArgs, action: &str, agent: &str, reason: &str) -> i32 {
    control_with(a, action, agent, reason, 0.0).await
}

/// `budget`: a run's money budget set anew; a run held at its budget goes on once under it.
pub async fn budget(a: BudgetArgs) -> i32 {
    control_with(
        &a.run,
        "budget",
        "",
        a.reason.as_deref().unwrap_or(""),
        a.usd,
    )
    .await
}

async fn control_with(a: &RunRefArgs, action: &str, agent: &str, reason: &str, usd: f64) -> i32 {
    let mut client = match a.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    match client
        .control(v1::ControlRequest {
            run_id: a.run_id.clone(),
            action: action.to_owned(),
            agent: agent.to_owned(),
            reason: reason.to_owned(),
            budget_usd: usd,
            ..Default::default()
        })
        .await
    {
        Ok(r) => {
            let msg = r.into_inner().message;
            if a.json {
                println!("{}", serde_json::json!({ "message": msg }));
            } else {
                eprintln!("{msg}");
            }
            0
        }
        Err(s) => rpc_fail(&s),
    }
}

pub async fn restart(r: RestartArgs) -> i32 {
    let a = &r.agent;
    let Some(agent) = a.agent.as_deref() else {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            "name the agent to restart: --agent INDEX or --agent LABEL",
        );
    };
    let action = if r.fresh {
        "restart_agent_fresh"
    } else {
        "restart_agent"
    };
    control_call(&a.run, action, agent, a.reason.as_deref().unwrap_or("")).await
}

pub async fn stop(a: AgentRefArgs) -> i32 {
    let reason = a.reason.as_deref().unwrap_or("");
    if let Some(agent) = a.agent.as_deref() {
        return control_call(&a.run, "stop_agent", agent, reason).await;
    }
    if !reason.is_empty() {
        return control_call(&a.run, "stop", "", reason).await;
    }
    let a = a.run;
    let mut client = match a.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    match client
        .stop(v1::RunRef {
            run_id: a.run_id.clone(),
        })
        .await
    {
        Ok(_) => {
            eprintln!("stopping {}", a.run_id);
            0
        }
        Err(s) => rpc_fail(&s),
    }
}

/// A run's report from a coordinator: live while it runs there, else the stored one (`show`
/// and `agents` with `--coordinator`); on failure, the exit status (the error is printed).
pub async fn report_of(coordinator: &str, tls: &TlsArgs, run: &str) -> Result<Report, i32> {
    let remote = ClientArgs {
        coordinator: Some(coordinator.to_owned()),
        tls: tls.clone(),
    };
    let mut c = remote.client().map_err(crate::refuse)?;
    let reply = c
        .report(v1::RunRef {
            run_id: run.to_owned(),
        })
        .await
        .map_err(|s| rpc_fail(&s))?
        .into_inner();
    serde_json::from_str(&reply.report_json).map_err(|e| {
        fail_kind(
            flotilla_proto::ErrorKind::Unavailable,
            format!("the coordinator sent a report this client cannot read: {e}"),
        )
    })
}

/// `flotilla runs --coordinator URL`: the coordinator's store, listed by the coordinator.
pub async fn list_remote(
    remote: ClientArgs,
    filter: &crate::stored::FilterArgs,
    json: bool,
) -> i32 {
    let filter = match filter.filter() {
        Ok(f) => f,
        Err(e) => return crate::refuse(e),
    };
    let mut client = match remote.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    let filter_json = match serde_json::to_string(&filter) {
        Ok(f) => f,
        Err(e) => return fail_kind(flotilla_proto::ErrorKind::Unavailable, e.to_string()),
    };
    match client.list_runs(v1::ListRunsRequest { filter_json }).await {
        Ok(r) => {
            let r = r.into_inner();
            let runs: Vec<flotilla_proto::wire::RunSummary> =
                match serde_json::from_str(&r.runs_json) {
                    Ok(runs) => runs,
                    Err(e) => {
                        return fail_kind(
                            flotilla_proto::ErrorKind::Unavailable,
                            format!("the coordinator sent runs this client cannot read: {e}"),
                        );
                    }
                };
            let next = (!r.next.is_empty()).then_some(r.next.as_str());
            crate::stored::print_runs(
                &runs,
                next,
                json,
                remote.coordinator.as_deref().unwrap_or("the coordinator"),
            )
        }
        Err(s) => rpc_fail(&s),
    }
}
