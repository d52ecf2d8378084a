//! `flotilla mcp`: an MCP server on stdio, so a stock `claude` starts workflows here with the
//! same tool it knows (`claude mcp add flotilla -- flotilla mcp`). Its tools:
//!
//! - `Workflow`: the input of Claude Code's Workflow tool (`script`, `name`, `scriptPath`,
//!   `args`, `resumeFromRunId`; `title` and `description` accepted and ignored) and its launch
//!   output (W44–W46): `status: "remote_launched"`, `runId`, `taskId`, `sessionUrl`,
//!   `scriptPath`, and `error` for a launch that was refused (a syntax or meta error with its
//!   line), which is then a tool error (`isError`). It returns at once; the run goes on in
//!   this process.
//! - `WorkflowStatus`, `WorkflowResult` (the whole result, a page at a time), `WorkflowStop`
//!   and `WorkflowList`.
//!
//! Two modes, as the CLI has:
//!
//! - **On a fleet** (`--coordinator URL --tls-dir DIR`, or `coordinator` in `--config`): a
//!   `Workflow` call is a `flotilla launch` from the server's working directory (the caller's
//!   repository is the run's source, `--source` as for `launch`); the coordinator runs it
//!   and serves its session page, and the other tools ask the coordinator. Nothing of the
//!   run is in this process, so it goes on when the Claude Code session ends.
//! - **On this machine** (no coordinator): each run is a `flotilla run` process of its own,
//!   started in a process group of its own with the server's flags, so it outlives the
//!   Claude Code session that launched it (Claude Code signals its MCP servers when a session
//!   ends). Its session page is served on loopback with a key in its URL; finished runs are
//!   read from the store the settings name (any later session can read them).
//!
//! Names and relative paths resolve from the server's working directory in both, as in the
//! CLI, and are held as a run holds its script's own references (see `refs`): a
//! `scriptPath` must be a workflow script inside the project (the repository holding that
//! directory) or a workflow directory, symlinks resolved; a `name` is looked up among the
//! saved workflows only, never read as a path; a refusal names the path and the rule, never
//! what a file holds. Each message is one line of at most [`lines::MAX_LINE_BYTES`]; a line
//! that is not JSON or is longer is answered with a JSON-RPC parse error (`lines`).

use flotilla_proto::Problem;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

mod lines;
mod refs;

use clap::Args;
use flotilla_coordinator::host;
use flotilla_local::workflows::DirResolver;
use flotilla_proto::wire::Report;
use flotilla_proto::wire::SnapshotView;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::{ErrorData, ServerHandler, ServiceExt, tool, tool_handler, tool_router};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::Mutex;

use crate::client::{ClientArgs, SourceFlags};
use crate::config;
use flotilla_proto::v1::{self, client_service_client::ClientServiceClient};
use tonic::transport::Channel;

#[derive(Debug, Clone, Args)]
pub struct McpArgs {
    #[command(flatten)]
    settings: config::SettingFlags,
    /// TOML config file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Run workflows on this coordinator's fleet (with --tls-dir) instead of on this machine.
    #[command(flatten)]
    remote: ClientArgs,
    #[command(flatten)]
    source: SourceFlags,
}

/// The coordinator a fleet-mode server launches on, and how it reaches it.
#[derive(Clone)]
struct RemoteFleet {
    client: ClientServiceClient<Channel>,
    /// Its address and this client's identity, the config file's filled in.
    remote: ClientArgs,
}

/// How long a tool waits for a coordinator's answer before it says so.
const RPC_TIMEOUT: Duration = Duration::from_secs(30);

/// A `Workflow` call: Claude Code's Workflow tool input (W44).
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkflowInput {
    /// The workflow script itself: `export const meta = { name, description }` first, then
    /// the body (`agent()`, `parallel()`, `pipeline()`, `phase()`, `log()`, `workflow()`).
    script: Option<String>,
    /// The name of a saved workflow (project, personal or bundled; `/name` works too).
    name: Option<String>,
    /// A script file, relative to the server's working directory; wins over `script` and
    /// `name`.
    script_path: Option<String>,
    /// The script's `args`: any JSON value.
    args: Option<Value>,
    /// Resume this earlier run: its completed agents are served from storage (W51).
    resume_from_run_id: Option<String>,
    /// Accepted and ignored (the script's meta names the run).
    title: Option<String>,
    /// Accepted and ignored.
    description: Option<String>,
}

/// A run named by its id.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunInput {
    /// The run id a `Workflow` call returned (`wf_…`).
    run_id: String,
}

/// A run's money budget set anew.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BudgetInput {
    /// The run id a `Workflow` call returned (`wf_…`).
    run_id: String,
    /// The run's money budget from now on, in US dollars.
    usd: f64,
    /// Why: kept, with who asked, in the run's log.
    #[serde(default)]
    reason: Option<String>,
}

/// An answer to a question a run's script asked with `ask()`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AnswerInput {
    /// The run id a `Workflow` call returned (`wf_…`).
    run_id: String,
    /// The question's id (`q_…`, as WorkflowStatus lists it under `questions`); leave it
    /// out when the run has one open question.
    #[serde(default)]
    question_id: Option<String>,
    /// The answer: any JSON value that matches the question's `schema`, if it has one.
    answer: Value,
}

/// A page of a run's result.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResultInput {
    /// The run id a `Workflow` call returned (`wf_…`).
    run_id: String,
    /// Where the page starts in the result's JSON text, in characters (0 for the first).
    offset: Option<u64>,
    /// The page's length in characters [default 20000, which Claude Code shows inline].
    limit: Option<u64>,
}

/// The characters of a result page unless the caller asks for another size.
const PAGE: u64 = 20_000;

/// A run this server started: its process, and its session page.
struct Started {
    pid: u32,
    ended: Arc<AtomicBool>,
    /// `http://127.0.0.1:PORT` and the page key.
    page: (String, String),
}

#[derive(Clone)]
pub struct Flotilla {
    args: Arc<McpArgs>,
    /// The flags `flotilla mcp` was given, passed on to every `flotilla run` it starts.
    passed: Arc<Vec<std::ffi::OsString>>,
    runs: Arc<Mutex<HashMap<String, Started>>>,
    /// `Some`: runs go to this coordinator's fleet.
    fleet: Option<RemoteFleet>,
    tool_router: ToolRouter<Self>,
}

const WORKFLOW_TOOL: &str = "Start a workflow: a short JavaScript script that orchestrates many agents, each `agent(prompt, opts)` call one full agent session. The run happens in Flotilla (on this machine, or on a team's fleet of workers, where the agents work in checkouts of this repository), not in this conversation: the call returns at once with the run id and a session URL; follow it with WorkflowStatus and read what it returned with WorkflowResult. The script starts with `export const meta = { name, description }`; its body may `await agent(...)`, `parallel([...thunks])`, `pipeline(items, ...stages)`, `phase(title)`, `log(text)` and `workflow(name, args)`, reads `args` and `budget`, and returns a JSON value. Give `script` inline, or `name` for a saved workflow (WorkflowList shows them), or `scriptPath` for a file. A script that does not compile comes back at once as a tool error, with `error` naming its line.";

#[tool_router]
impl Flotilla {
    fn new(args: McpArgs, passed: Vec<std::ffi::OsString>, fleet: Option<RemoteFleet>) -> Flotilla {
        Flotilla {
            args: Arc::new(args),
            passed: Arc::new(passed),
            runs: Arc::default(),
            fleet,
            tool_router: Self::tool_router(),
        }
    }

    #[tool(name = "Workflow", description = WORKFLOW_TOOL)]
    async fn workflow(
        &self,
        Parameters(input): Parameters<WorkflowInput>,
    ) -> Result<CallToolResult, ErrorData> {
        let _ = (&input.title, &input.description);
        let out = self.launch(input).await;
        // W46's shape (`remote_launched` with `error`), and a tool error, so a caller that
        // reads only `isError` does not take a refused launch (a script that does not
        // compile, an unknown name) for a run.
        Ok(if out.get("error").is_some() {
            CallToolResult::structured_error(out)
        } else {
            CallToolResult::structured(out)
        })
    }

    #[tool(
        name = "WorkflowStatus",
        description = "How a run started with Workflow is doing: its status (running, paused, stopping, completed, failed, stopped; `headline` says `completed, N failed` when the script returned although agents failed), its agents queued, running, done, failed and cancelled, why agents wait, tokens, cost, its phases and recent log lines."
    )]
    async fn workflow_status(
        &self,
        Parameters(input): Parameters<RunInput>,
    ) -> Result<CallToolResult, ErrorData> {
        Ok(answer(self.status(&input.run_id).await))
    }

    #[tool(
        name = "WorkflowResult",
        description = "What a finished run returned, whole: the result's JSON text a page at a time (`offset`, `limit`; `nextOffset` is set while more follows), with the run's status, error and usage. A run still going answers with its status."
    )]
    async fn workflow_result(
        &self,
        Parameters(input): Parameters<ResultInput>,
    ) -> Result<CallToolResult, ErrorData> {
        Ok(answer(self.result(&input).await))
    }

    #[tool(
        name = "WorkflowStop",
        description = "Stops a run started with Workflow: running agents are stopped, nothing new starts, and its report is stored (it can be resumed with resumeFromRunId)."
    )]
    async fn workflow_stop(
        &self,
        Parameters(input): Parameters<RunInput>,
    ) -> Result<CallToolResult, ErrorData> {
        if let Err(p) = flotilla_local::sizes::check_run_id(&input.run_id) {
            return Ok(refused(&p.message));
        }
        if let Some(fleet) = &self.fleet {
            let mut client = fleet.client.clone();
            let stopped = rpc(client.stop(v1::RunRef {
                run_id: input.run_id.clone(),
            }))
            .await;
            return Ok(match stopped {
                Ok(_) => {
                    CallToolResult::structured(json!({ "runId": input.run_id, "stopping": true }))
                }
                Err(s) => refused(&said(&s)),
            });
        }
        let started = self
            .runs
            .lock()
            .await
            .get(&input.run_id)
            .map(|s| (s.pid, s.ended.clone()));
        let Some((pid, ended)) = started else {
            return Ok(refused(&format!(
                "run {} was not started by this session, so it cannot be stopped here (`flotilla runs` lists the stored ones)",
                input.run_id
            )));
        };
        if !ended.load(Ordering::Acquire) {
            // Its own Ctrl-C: it stops its agents and stores its report.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGINT,
            );
        }
        Ok(CallToolResult::structured(
            json!({ "runId": input.run_id, "stopping": true }),
        ))
    }

    #[tool(
        name = "WorkflowBudget",
        description = "Sets the money budget (US dollars) of a run started on a fleet with Workflow: a run paused at its budget (WorkflowStatus says `paused at its money budget` and by how much) goes on once under the new one, and nothing it completed runs again. A run on this machine stops its agents at its budget instead; its budget cannot be raised."
    )]
    async fn workflow_budget(
        &self,
        Parameters(input): Parameters<BudgetInput>,
    ) -> Result<CallToolResult, ErrorData> {
        if let Err(p) = flotilla_local::sizes::check_run_id(&input.run_id) {
            return Ok(refused(&p.message));
        }
        if !(input.usd.is_finite() && input.usd > 0.0) {
            return Ok(refused(
                "usd: give the run's money budget as a positive number of dollars",
            ));
        }
        let Some(fleet) = &self.fleet else {
            return Ok(refused(
                "a run on this machine stops its agents at its money budget; a budget can be raised only for a run on a fleet (`flotilla mcp --coordinator URL`)",
            ));
        };
        let mut client = fleet.client.clone();
        let set = rpc(client.control(v1::ControlRequest {
            run_id: input.run_id.clone(),
            action: "budget".into(),
            agent: String::new(),
            reason: input.reason.unwrap_or_default(),
            budget_usd: input.usd,
            ..Default::default()
        }))
        .await;
        Ok(match set {
            Ok(r) => {
                CallToolResult::structured(json!({ "runId": input.run_id, "message": r.message }))
            }
            Err(s) => refused(&said(&s)),
        })
    }

    #[tool(
        name = "WorkflowAnswer",
        description = "Answers a question a run's script asked with ask() (WorkflowStatus lists the open ones under `questions`, each with its id, text and the JSON Schema an answer must match). The run goes on once the answer is stored. A wrong answer is refused with the reason and the question stays open; a question answered already says by whom."
    )]
    async fn workflow_answer(
        &self,
        Parameters(input): Parameters<AnswerInput>,
    ) -> Result<CallToolResult, ErrorData> {
        if let Err(p) = flotilla_local::sizes::check_run_id(&input.run_id) {
            return Ok(refused(&p.message));
        }
        let text = input.answer.to_string();
        if let Err(p) = flotilla_local::sizes::answer(&text) {
            return Ok(refused(&p.message));
        }
        let said_back = match &self.fleet {
            Some(fleet) => {
                let mut client = fleet.client.clone();
                rpc(client.control(v1::ControlRequest {
                    run_id: input.run_id.clone(),
                    action: "answer".into(),
                    question: input.question_id.clone().unwrap_or_default(),
                    answer_json: text,
                    ..Default::default()
                }))
                .await
                .map(|r| r.message)
                .map_err(|s| said(&s))
            }
            None => self.answer_here(&input).await.map_err(|p| p.message),
        };
        Ok(match said_back {
            Ok(message) => {
                CallToolResult::structured(json!({ "runId": input.run_id, "message": message }))
            }
            Err(why) => refused(&why),
        })
    }

    #[tool(
        name = "WorkflowList",
        description = "The workflows Workflow can start by `name`: the project's, yours, those saved on the fleet's coordinator and the bundled ones, each with its description and when to use it."
    )]
    async fn workflow_list(&self) -> Result<CallToolResult, ErrorData> {
        let remote = match &self.fleet {
            Some(f) => f.remote.clone(),
            None => ClientArgs {
                coordinator: None,
                tls: Default::default(),
            },
        };
        let namespace = config::asked_namespace(
            self.args.settings.namespace.as_deref(),
            self.args.config.as_deref(),
        );
        let rows = match namespace {
            Ok(ns) => {
                crate::client::workflows::rows(&self.args.settings.workflows_dirs, remote, Some(ns))
                    .await
            }
            Err(e) => Err(e),
        };
        Ok(answer(rows.map(|rows| json!({ "workflows": rows }))))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Flotilla {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("flotilla", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Flotilla runs dynamic workflows: Workflow starts one and returns at once with a run id and a session URL; WorkflowStatus follows it, WorkflowResult reads what it returned, WorkflowStop stops it, WorkflowList names the saved ones.",
            )
    }
}

/// A tool's answer: its JSON, or a refusal.
fn answer(r: Result<Value, Problem>) -> CallToolResult {
    match r {
        Ok(v) => CallToolResult::structured(v),
        Err(e) => refused(&e.message),
    }
}

/// A refusal the caller reads: a tool error with the message.
fn refused(message: &str) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message.to_owned())])
}

/// A call to the coordinator, given [`RPC_TIMEOUT`] to answer.
async fn rpc<T>(
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, tonic::Status> {
    match tokio::time::timeout(RPC_TIMEOUT, call).await {
        Ok(r) => r.map(tonic::Response::into_inner),
        Err(_) => Err(no_answer()),
    }
}

fn no_answer() -> tonic::Status {
    tonic::Status::deadline_exceeded(format!(
        "the coordinator did not answer within {} s; is it up and reachable from here?",
        RPC_TIMEOUT.as_secs()
    ))
}

/// A coordinator's refusal as the caller reads it.
fn said(s: &tonic::Status) -> String {
    crate::client::rpc_error(s).1
}

/// What a launch answers (W45): the run and where to watch it.
fn launched(run: &str, url: &str, script_path: &str) -> Value {
    json!({
        "status": "remote_launched",
        "taskId": run,
        "runId": run,
        "sessionUrl": url,
        "scriptPath": script_path,
    })
}

/// The launch's warning when no flag, setting or meta chose the backend.
fn backend_warning(r: &config::ResolvedRun) -> Option<String> {
    r.backend_chosen.as_ref().map(|why| {
        format!(
            "backend {} ({why}); pass --backend to `flotilla mcp` to choose",
            r.settings.backend
        )
    })
}

/// A run as a tool sees it: still going (its live view), or ended (its report).
enum Progress {
    Running(Value),
    Ended(Box<Report>),
}

fn not_here(run: &str) -> String {
    format!(
        "no run {run} here: give the runId a Workflow call returned (stored runs are listed by `flotilla runs`)"
    )
}

impl Flotilla {
    /// W45/W46: the launch's answer, a refusal included (`error`, no run id).
    async fn launch(&self, input: WorkflowInput) -> Value {
        let refused = |error: String| json!({ "status": "remote_launched", "error": error });
        if let Some(r) = &input.resume_from_run_id
            && let Err(p) = flotilla_local::sizes::check_run_id(r)
        {
            return refused(format!("resumeFromRunId: {}", p.message));
        }
        // What the call names is held where `flotilla run` holds a script's own references:
        // a path to the project and the workflow directories, a name to the saved workflows.
        let (script, inline, by_name) = match (&input.script_path, &input.name, &input.script) {
            (Some(p), _, _) => match self.script_in_reach(p) {
                Ok(real) => (real, None, false),
                Err(e) => return refused(e.message),
            },
            (None, Some(n), _) => match refs::workflow_name(n) {
                Ok(n) => (n, None, true),
                Err(e) => return refused(e.message),
            },
            (None, None, Some(s)) => match save_inline(s) {
                Ok(path) => (path.display().to_string(), Some(path), false),
                Err(e) => return refused(e.message),
            },
            (None, None, None) => {
                return refused(
                    "give `script` (the workflow itself), `name` (a saved workflow) or `scriptPath` (a file)".into(),
                );
            }
        };
        let args = match input.args.as_ref().map(serde_json::to_string).transpose() {
            Ok(a) => a,
            Err(e) => return refused(format!("args cannot be sent as JSON: {e}")),
        };
        let run_args = crate::RunArgs {
            script: script.clone(),
            by_name,
            args: args.clone(),
            args_file: None,
            json: true,
            full: false,
            resume: input.resume_from_run_id.clone(),
            yes: true,
            plan: false,
            serve: None,
            sandbox: false,
            settings: self.args.settings.clone(),
            config: self.args.config.clone(),
        };
        let inline = inline.map(|p| p.display().to_string());
        if let Some(fleet) = &self.fleet {
            return self.launch_on(fleet, &run_args, inline).await;
        }
        // What `flotilla run` would refuse before it starts (an unknown name, a script path
        // that cannot be read, bad settings) is answered here, at once.
        let resolved = match config::resolve_run(&run_args) {
            Ok(r) => r,
            Err(e) => return refused(e.message),
        };
        let script_path = inline.unwrap_or_else(|| resolved.origin.clone());
        let started = match self
            .start(
                &script,
                by_name,
                args.as_deref(),
                input.resume_from_run_id.as_deref(),
            )
            .await
        {
            Ok(s) => s,
            Err(e) => {
                return json!({ "status": "remote_launched", "error": e.message, "scriptPath": script_path });
            }
        };
        let (run_id, started) = started;
        let (base, key) = &started.page;
        let mut out = launched(
            &run_id,
            &format!("{base}/runs/{run_id}?key={key}"),
            &script_path,
        );
        if let Some(w) = backend_warning(&resolved) {
            out["warning"] = json!(w);
        }
        self.runs.lock().await.insert(run_id, started);
        out
    }

    /// A `scriptPath` held where `flotilla run`'s own `workflow({ scriptPath })` is: inside
    /// the project (the repository holding the server's working directory) or a workflow
    /// directory, symlinks resolved, and a workflow script; its real path.
    fn script_in_reach(&self, p: &str) -> Result<String, Problem> {
        refs::path_text(p)?;
        let file = config::load(self.args.config.as_deref())?;
        let mut dirs = self.args.settings.workflows_dirs.clone();
        dirs.extend(file.workflows_dirs.iter().cloned());
        let cwd = std::env::current_dir()
            .map_err(|e| Problem::invalid(format!("cannot read the working directory: {e}")))?;
        DirResolver::standard(&cwd, &dirs)
            .read_script(p, &format!("scriptPath {p:?}"))
            .map(|found| found.origin)
            .map_err(|e| Problem::invalid(e.to_string()))
    }

    /// A launch on the fleet: as `flotilla launch` from the server's working directory.
    async fn launch_on(
        &self,
        fleet: &RemoteFleet,
        run_args: &crate::RunArgs,
        inline: Option<String>,
    ) -> Value {
        let mut client = fleet.client.clone();
        let refused = |error: String, path: Option<&str>| {
            let mut v = json!({ "status": "remote_launched", "error": error });
            if let Some(p) = path {
                v["scriptPath"] = json!(p);
            }
            v
        };
        let prepared =
            match tokio::time::timeout(RPC_TIMEOUT, crate::client::prepare(&mut client, run_args))
                .await
            {
                Ok(Ok(p)) => p,
                Ok(Err(e)) => return refused(e.message, inline.as_deref()),
                Err(_) => return refused(said(&no_answer()), inline.as_deref()),
            };
        let script_path = inline.unwrap_or_else(|| prepared.resolved.origin.clone());
        let warning = backend_warning(&prepared.resolved);
        // A big repository's first upload may take a while: no timeout over the whole send.
        let sent = crate::client::send(&mut client, prepared, &self.args.source).await;
        let reply = match sent {
            Ok(s) => s.reply,
            Err(e) => return refused(e.message, Some(&script_path)),
        };
        if reply.status == "rejected" {
            return refused(reply.error, Some(&script_path));
        }
        let mut out = launched(&reply.run_id, &reply.session_url, &script_path);
        // What the coordinator said of the run: the backend it chose, agents no attached
        // worker can run yet.
        let said: Vec<String> = warning.into_iter().chain(reply.notes).collect();
        if !said.is_empty() {
            out["warning"] = json!(said.join("\n"));
        }
        out
    }

    /// The live view of a run this session started and whose process still runs it.
    async fn live(&self, run: &str) -> Option<Value> {
        let (base, key) = {
            let runs = self.runs.lock().await;
            let s = runs.get(run)?;
            if s.ended.load(Ordering::Acquire) {
                return None;
            }
            s.page.clone()
        };
        let port: u16 = base.rsplit(':').next()?.parse().ok()?;
        let v = get_json(port, &format!("/runs/{run}/status.json?key={key}")).await?;
        // Ended, its report is in the store (read from there).
        (v["finished"] == false).then_some(v)
    }

    /// A running run's view, or its report once it has ended (on the fleet or here).
    async fn progress(&self, run: &str) -> Result<Progress, Problem> {
        flotilla_local::sizes::check_run_id(run)?;
        let Some(fleet) = &self.fleet else {
            if let Some(v) = self.live(run).await {
                return Ok(Progress::Running(v));
            }
            return Ok(Progress::Ended(Box::new(self.stored(run).await?)));
        };
        let mut client = fleet.client.clone();
        let reference = v1::RunRef {
            run_id: run.to_owned(),
        };
        match rpc(client.status(reference.clone())).await {
            Ok(r) if !r.finished => {
                let mut v: Value = serde_json::from_str(&r.snapshot_json).map_err(|e| {
                    Problem::unavailable(format!(
                        "the coordinator sent a status this server cannot read: {e}"
                    ))
                })?;
                v["finished"] = json!(false);
                return Ok(Progress::Running(v));
            }
            Ok(_) => {}
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => return Err(Problem::unavailable(said(&s))),
        }
        // Ended, or not running there: the coordinator's report (from its store).
        let reply = rpc(client.wait(reference)).await.map_err(|s| {
            if s.code() == tonic::Code::NotFound {
                Problem::not_found(format!("{}: {}", not_here(run), s.message()))
            } else {
                crate::client::call_problem(&s)
            }
        })?;
        serde_json::from_str::<Report>(&reply.report_json)
            .map(|r| Progress::Ended(Box::new(r)))
            .map_err(|e| {
                Problem::unavailable(format!(
                    "the coordinator sent a report this server cannot read: {e}"
                ))
            })
    }

    /// The run's summary (what every view says of it: status, agents by state, why they
    /// wait, tokens, cost, elapsed), with its phases and log lines.
    async fn status(&self, run: &str) -> Result<Value, Problem> {
        let mut v = match self.progress(run).await? {
            Progress::Running(mut v) => {
                if let Some(o) = v.as_object_mut() {
                    o.remove("report");
                }
                v
            }
            Progress::Ended(report) => {
                let mut v = serde_json::to_value(SnapshotView::from_report(&report))
                    .map_err(|e| Problem::unavailable(e.to_string()))?;
                v["finished"] = json!(true);
                v
            }
        };
        let summary: flotilla_proto::wire::Summary =
            serde_json::from_value(v.clone()).map_err(|e| Problem::unavailable(e.to_string()))?;
        v["costUsd"] = json!(summary.cost_usd);
        v["headline"] = json!(summary.headline());
        Ok(v)
    }

    async fn result(&self, input: &ResultInput) -> Result<Value, Problem> {
        let run = &input.run_id;
        let report = match self.progress(run).await? {
            Progress::Running(v) => {
                return Ok(json!({
                    "runId": run,
                    "status": v["status"],
                    "finished": false,
                    "done": v["done"],
                    "agents": v["agents"],
                    "message": "the run is still going; ask again when WorkflowStatus says it finished",
                }));
            }
            Progress::Ended(report) => report,
        };
        let text = serde_json::to_string(&report.result)
            .map_err(|e| Problem::unavailable(e.to_string()))?;
        let chars: Vec<char> = text.chars().collect();
        let total = chars.len() as u64;
        let offset = input.offset.unwrap_or(0).min(total);
        let limit = input.limit.unwrap_or(PAGE).max(1);
        let end = offset.saturating_add(limit).min(total);
        let page: String = chars[offset as usize..end as usize].iter().collect();
        let mut out = json!({
            "runId": run,
            "status": report.status.as_str(),
            "finished": true,
            "offset": offset,
            "totalChars": total,
            "nextOffset": if end < total { json!(end) } else { Value::Null },
            "resultJson": page,
            "usage": report.usage,
        });
        if let Some(e) = &report.error {
            out["error"] = json!(e);
        }
        if !report.warnings.is_empty() {
            out["warnings"] = json!(report.warnings);
        }
        Ok(out)
    }

    /// Starts `flotilla run SCRIPT` in a process group of its own and waits for its session
    /// page (the run has started) or its end (it was refused: the report's error).
    async fn start(
        &self,
        script: &str,
        by_name: bool,
        args: Option<&str>,
        resume: Option<&str>,
    ) -> Result<(String, Started), Problem> {
        use std::os::unix::process::CommandExt;
        let dir = data_dir().join("runs");
        std::fs::create_dir_all(&dir).map_err(|e| {
            Problem::internal(format!(
                "cannot keep the run's output in {}: {e}",
                dir.display()
            ))
        })?;
        let stem = format!("launch-{}-{}", std::process::id(), next_launch());
        let (out_path, log_path) = (
            dir.join(format!("{stem}.json")),
            dir.join(format!("{stem}.log")),
        );
        let open = |p: &PathBuf| {
            std::fs::File::create(p)
                .map_err(|e| Problem::internal(format!("cannot write {}: {e}", p.display())))
        };
        let me = std::env::current_exe()
            .map_err(|e| Problem::internal(format!("cannot find this program's own path: {e}")))?;
        let mut cmd = std::process::Command::new(me);
        cmd.args(["run", "--json", "--yes", "--serve=127.0.0.1:0"]);
        if by_name {
            cmd.arg("--by-name");
        }
        // `--flag=value` and the script after `--`: nothing a call sends is read as a flag.
        if let Some(a) = args {
            cmd.arg(format!("--args={a}"));
        }
        if let Some(r) = resume {
            cmd.arg(format!("--resume={r}"));
        }
        cmd.args(self.passed.iter())
            .args(["--", script])
            .stdin(std::process::Stdio::null())
            .stdout(open(&out_path)?)
            .stderr(open(&log_path)?)
            // Not the session's: a signal Claude Code sends its MCP servers does not reach it.
            .process_group(0);
        let mut child = cmd
            .spawn()
            .map_err(|e| Problem::internal(format!("cannot start `flotilla run`: {e}")))?;
        let pid = child.id();
        let ended = Arc::new(AtomicBool::new(false));
        let (exit_tx, mut exit_rx) = tokio::sync::oneshot::channel();
        {
            let ended = ended.clone();
            std::thread::spawn(move || {
                let status = child.wait();
                ended.store(true, Ordering::Release);
                let _ = exit_tx.send(status.ok().and_then(|s| s.code()));
            });
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            if let Some(url) = log.lines().find_map(|l| l.strip_prefix("session page: ")) {
                let (base, rest) = url.split_once("/runs/").ok_or_else(|| {
                    Problem::internal(format!("`flotilla run` printed an odd session page: {url}"))
                })?;
                let (run, key) = rest.split_once("?key=").ok_or_else(|| {
                    Problem::internal(format!("`flotilla run` printed an odd session page: {url}"))
                })?;
                return Ok((
                    run.to_owned(),
                    Started {
                        pid,
                        ended,
                        page: (base.to_owned(), key.trim().to_owned()),
                    },
                ));
            }
            if let Ok(code) = exit_rx.try_recv() {
                let out = std::fs::read_to_string(&out_path).unwrap_or_default();
                let error = serde_json::from_str::<Value>(&out)
                    .ok()
                    .and_then(|r| {
                        r["error"]
                            .as_str()
                            .map(str::to_owned)
                            .or_else(|| r["error"]["message"].as_str().map(str::to_owned))
                    })
                    .unwrap_or_else(|| {
                        format!(
                            "`flotilla run` ended (exit {code:?}) before its run started: {}",
                            log.lines().last().unwrap_or("no output")
                        )
                    });
                return Err(Problem::internal(error));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Problem::internal(format!(
                    "`flotilla run` did not start its run within a minute; its output is in {}",
                    log_path.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Answers a question of a run on this machine, in the store the settings name (the run
    /// looks there while a question is open).
    async fn answer_here(&self, input: &AnswerInput) -> Result<String, Problem> {
        let file = config::load(self.args.config.as_deref())?;
        let merged = config::settings_from(&self.args.settings, &file, true)?;
        let store = flotilla_coordinator::host::open_store(&config::store_url(merged.store))
            .map_err(|e| Problem::not_found(e.to_string()))?;
        let user = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
        host::answer_in_store(
            &store,
            &input.run_id,
            input.question_id.as_deref(),
            input.answer.clone(),
            &format!("local user {user} (MCP)"),
        )
        .await
    }

    /// A run's report from the store the settings name (this session's or any earlier one's).
    async fn stored(&self, run: &str) -> Result<Report, Problem> {
        flotilla_local::sizes::check_run_id(run)?;
        // A run of this session whose process is still storing its report: a moment more.
        let ended = self.runs.lock().await.get(run).map(|s| s.ended.clone());
        let file = config::load(self.args.config.as_deref())?;
        let merged = config::settings_from(&self.args.settings, &file, true)?;
        let store = flotilla_coordinator::host::open_store(&config::store_url(merged.store))
            .map_err(|e| Problem::not_found(e.to_string()))?;
        if let Some(ended) = ended {
            for _ in 0..200 {
                if ended.load(Ordering::Acquire) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
        host::load_report(&store, run)
            .await
            .map_err(|e| Problem::not_found(format!("{}: {e}", not_here(run))))
    }
}

/// Where this server keeps inline scripts and its runs' output.
fn data_dir() -> PathBuf {
    dirs::data_local_dir()
        .unwrap_or_else(std::env::temp_dir)
        .join("flotilla")
}

/// How long the output files of a run started here are kept (its report is in the store).
const OUTPUT_KEPT: Duration = Duration::from_secs(7 * 24 * 3600);

/// Removes the runs' output files (`launch-*.json`, `launch-*.log`) older than `kept`.
fn prune_outputs(dir: &std::path::Path, kept: Duration) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let now = flotilla_proto::clock::now();
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name();
        let ours = name.to_str().is_some_and(|n| {
            n.starts_with("launch-") && (n.ends_with(".json") || n.ends_with(".log"))
        });
        let old = e
            .metadata()
            .ok()
            .filter(std::fs::Metadata::is_file)
            .and_then(|m| m.modified().ok())
            .and_then(|t| now.duration_since(t).ok())
            .is_some_and(|age| age > kept);
        if ours && old {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn next_launch() -> u64 {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// `GET path` of a session page on loopback, as JSON (`None`: no answer, or not JSON).
async fn get_json(port: u16, path: &str) -> Option<Value> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::net::TcpStream::connect(("127.0.0.1", port)),
    )
    .await
    .ok()?
    .ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    conn.write_all(req.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut raw))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.1 200") {
        return None;
    }
    // A chunked answer: its one chunk (the pages answer small JSON in one).
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body.split_once("\r\n")?
            .1
            .rsplit_once("\r\n0")?
            .0
            .trim_end()
    } else {
        body
    };
    serde_json::from_str(body).ok()
}

/// Keeps an inline script where a person can read it again (as Claude Code does), under the
/// local data directory, named by its content.
fn save_inline(script: &str) -> Result<PathBuf, Problem> {
    use sha2::Digest;
    let limit = flotilla_local::reads::SCRIPT_BYTES;
    if script.len() > limit {
        return Err(Problem::invalid(format!(
            "the script is {} bytes, over the limit of {}; split the work into workflows called with workflow(name)",
            script.len(),
            flotilla_local::reads::human_bytes(limit)
        )));
    }
    let dir = data_dir().join("scripts");
    std::fs::create_dir_all(&dir).map_err(|e| {
        Problem::invalid(format!("cannot keep the script in {}: {e}", dir.display()))
    })?;
    let digest = hex::encode(sha2::Sha256::digest(script.as_bytes()));
    let path = dir.join(format!("wf-{}.js", &digest[..12]));
    std::fs::write(&path, script).map_err(|e| {
        Problem::invalid(format!("cannot keep the script in {}: {e}", path.display()))
    })?;
    Ok(path)
}

/// The coordinator the flags or the config file name, with a client for it; `None` when they
/// name none (runs happen on this machine).
fn fleet_of(args: &McpArgs) -> Result<Option<RemoteFleet>, Problem> {
    let file = config::load(args.config.as_deref())?;
    let mut remote = args.remote.clone();
    remote.tls.fill(&file);
    remote.coordinator = remote.coordinator.or_else(|| file.coordinator.clone());
    if remote.coordinator.is_none() {
        let (s, t) = (&args.source, &args.remote.tls);
        if s.source.is_some() || s.max_source_mib.is_some() || s.submodules {
            return Err(Problem::invalid(
                "--source, --max-source-mib and --submodules are for a fleet: add --coordinator https://host:port --tls-dir DIR (here each agent works in the workspace)",
            ));
        }
        if t.tls_dir.is_some() || t.cert.is_some() || t.key.is_some() || t.insecure {
            return Err(Problem::invalid(
                "a client identity (--tls-dir, --cert, --key, --insecure) is for a fleet: add --coordinator https://host:port, or drop it to run workflows on this machine",
            ));
        }
        return Ok(None);
    }
    let client = remote.client()?;
    Ok(Some(RemoteFleet { client, remote }))
}

/// `flotilla mcp`: serves the tools on stdin/stdout until the client goes. The runs it
/// started go on in their own processes.
pub async fn serve(args: McpArgs) -> i32 {
    // The flags after `mcp`, for every `flotilla run` it starts.
    let passed: Vec<std::ffi::OsString> = std::env::args_os()
        .skip_while(|a| a != "mcp")
        .skip(1)
        .collect();
    let fleet = match fleet_of(&args) {
        Ok(f) => f,
        Err(e) => return crate::refuse(e),
    };
    if fleet.is_none() {
        prune_outputs(&data_dir().join("runs"), OUTPUT_KEPT);
    }
    let server = Flotilla::new(args, passed, fleet);
    // Every line is framed here first: one that is not JSON or is too long is answered.
    let framed = lines::frame(tokio::io::stdin(), tokio::io::stdout());
    let service = match server.serve((framed.read, framed.write)).await {
        Ok(s) => s,
        Err(e) => {
            return crate::fail_kind(
                flotilla_proto::ErrorKind::Unavailable,
                format!("the MCP client did not start a session: {e}"),
            );
        }
    };
    let _ = service.waiting().await;
    // rmcp's last answers reach stdout before the process ends.
    let _ = tokio::time::timeout(Duration::from_secs(5), framed.done).await;
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_old_output_files_of_runs_are_pruned() {
        let dir = tempfile::tempdir().unwrap();
        let old = flotilla_proto::clock::now() - Duration::from_secs(10 * 24 * 3600);
        for name in [
            "launch-1-0.json",
            "launch-1-0.log",
            "notes.txt",
            "launch-2-0.log",
        ] {
            std::fs::write(dir.path().join(name), "x").unwrap();
        }
        for name in ["launch-1-0.json", "launch-1-0.log", "notes.txt"] {
            let f = std::fs::File::options()
                .write(true)
                .open(dir.path().join(name))
                .unwrap();
            f.set_modified(old).unwrap();
        }
        prune_outputs(dir.path(), OUTPUT_KEPT);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["launch-2-0.log", "notes.txt"]);
    }
}
