//! `flotilla`: the command line.
//!
//! `flotilla run SCRIPT` runs a workflow in this process (the embedded mode: coordinator and
//! an in-process worker, leases in memory, storage on the local disk). `runs` and `show` read
//! stored runs; `bench` measures the runtime.
//!
//! Settings come from, in increasing precedence: a TOML file (`--config`), `FLOTILLA_*`
//! environment variables, flags. See [`config`].

mod approve;
mod bench;
mod certs;
mod client;
mod config;
mod dev;
mod embedded;
mod mcp;
mod progress;
mod serve;
mod source;
mod stored;
mod telemetry;
mod term;

/// mimalloc (built without transparent huge pages), not glibc's malloc: on the fleet's hot
/// path (a coordinator and workers passing many small messages between tokio threads) it
/// takes about a fifth off the CPU time per call (`flotilla bench fanout --distributed`;
/// figures in issue 29's closing note).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use flotilla_proto::Problem;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use flotilla_proto::wire::{Report, RunStatus};

/// `0.1.0 (commit 1a2b3c4d5e6f)`: the version and the commit it was built from.
static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{} (commit {})",
        env!("CARGO_PKG_VERSION"),
        flotilla_proto::build::commit()
    )
});

/// Run dynamic workflows (Claude Code `Workflow` scripts) locally or on a fleet.
#[derive(Debug, Parser)]
#[command(name = "flotilla", version = VERSION.as_str(), about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a workflow script in this process and print its result.
    Run(Box<RunArgs>),
    /// Inside an agent's sandbox: relays the model API to its loopback while PROGRAM runs.
    #[command(name = "sandbox-relay", hide = true)]
    SandboxRelay(SandboxRelayArgs),
    /// Run PROGRAM in a copy-on-write view of a checkout (the worker starts agents and its
    /// own git on a checkout this way).
    #[command(name = "workspace-mount", hide = true)]
    WorkspaceMount(WorkspaceMountArgs),
    /// List stored runs.
    Runs(ListArgs),
    /// Print the report of a stored run.
    Show(ShowArgs),
    /// Delete old runs (`--older-than 30d`) and the stored objects no other run uses.
    Gc(stored::GcArgs),
    /// Print the transcript of an agent's attempt (tool calls, text, result).
    Logs(LogsArgs),
    /// List a run's agents a page at a time, by status or phase (from a store or a
    /// coordinator).
    Agents(client::agents::AgentsArgs),
    /// Measure the runtime (see `flotilla bench fanout --help`).
    Bench(bench::BenchArgs),
    /// Make a development CA and certificates for mTLS.
    Certs(certs::CertsArgs),
    /// Start a real fleet on this machine (a CA, a coordinator, workers as processes, a file
    /// store, memory leases or `--etcd`) and print how to launch on it; Ctrl-C stops it all.
    Dev(dev::DevArgs),
    /// Serve the session pages of a store's runs (the local one by default) on loopback:
    /// every run there, live for the ones going on; Ctrl-C stops it.
    Ui(serve::ui::UiArgs),
    /// Named coordinators and the identity that reaches each: `list`, `use NAME`,
    /// `add NAME --coordinator URL --tls-dir DIR [--use]`, `remove NAME`, `current`. Client
    /// commands given no coordinator use the current one (`flotilla dev` adds `dev`).
    Context(client::context::ContextArgs),
    /// Print a completion script for a shell: `flotilla completions bash >
    /// ~/.local/share/bash-completion/completions/flotilla`, `flotilla completions zsh >
    /// "${fpath[1]}/_flotilla"`, `flotilla completions fish >
    /// ~/.config/fish/completions/flotilla.fish`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Run a coordinator: workers attach to it, clients launch runs on it.
    #[command(after_help = telemetry::HELP)]
    Coordinator(Box<serve::coordinator::CoordinatorArgs>),
    /// Run a worker attached to a coordinator.
    #[command(after_help = telemetry::HELP)]
    Worker(Box<serve::worker::WorkerArgs>),
    /// Start a run on a coordinator and return at once with its id and session URL.
    Launch(Box<client::LaunchArgs>),
    /// Wait for a run on a coordinator to end and print its report.
    Wait(client::WaitArgs),
    /// Show a running run's progress.
    Status(client::RunRefArgs),
    /// Follow a run on a coordinator until it ends: progress bars on a terminal, plain lines
    /// otherwise; then its report.
    Watch(client::RunRefArgs),
    /// Stop a run on a coordinator, or one of its agents (`--agent`).
    Stop(client::AgentRefArgs),
    /// Pause a run: running agents are interrupted, nothing new starts.
    Pause(client::PauseArgs),
    /// Resume a run: a paused one goes on; any other starts again from its completed calls.
    Resume(client::ResumeArgs),
    /// Set a run's money budget (`--usd`): a run paused at its budget goes on once under it.
    Budget(client::BudgetArgs),
    /// Answer a question a run's script asked with `ask()` (`--json VALUE`), on a
    /// coordinator or in the local store; without `--json`, list its open questions.
    Answer(client::AnswerArgs),
    /// Restart one running agent of a run as a new attempt (it continues the conversation the
    /// interrupted one leaves, unless --fresh).
    Restart(client::RestartArgs),
    /// What a fleet run's agents changed in its source: each agent's change and the run head.
    Changes(client::changes::ChangesArgs),
    /// Bring a fleet run's changes into this repository as branches (`--merge`: and merge).
    Apply(client::changes::ApplyArgs),
    /// List the workers attached to a coordinator.
    Workers(client::WorkersArgs),
    /// Session tokens for the coordinator's pages.
    #[command(subcommand)]
    Token(client::TokenCommand),
    /// Saved workflows: list, show, save in the project, push to a coordinator.
    #[command(subcommand)]
    Workflows(client::workflows::WorkflowsCommand),
    /// An MCP server on stdio with Claude Code's Workflow tool and its companions, for runs
    /// on a fleet (`claude mcp add flotilla -- flotilla mcp --coordinator URL --tls-dir DIR`)
    /// or on this machine (`claude mcp add flotilla -- flotilla mcp`).
    Mcp(Box<mcp::McpArgs>),
}

/// Flags of `flotilla run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Script file to run (or the name of a saved workflow).
    pub script: String,
    /// SCRIPT is a saved workflow's name, never a path (what `flotilla mcp` passes for a
    /// `name`: a file of that name where it runs is not read).
    #[arg(long, hide = true)]
    pub by_name: bool,
    /// `args` for the script, as JSON.
    #[arg(long, conflicts_with = "args_file")]
    pub args: Option<String>,
    /// Read `args` from a JSON file.
    #[arg(long, value_name = "FILE")]
    pub args_file: Option<PathBuf>,
    /// Print one JSON report on stdout instead of the result.
    #[arg(long)]
    pub json: bool,
    /// With --json: list every agent. By default a report lists at most 1000, those that
    /// did not complete first, and counts the rest in `agents_omitted` (`flotilla agents`
    /// pages through all of them).
    #[arg(long)]
    pub full: bool,
    /// Resume from an earlier run: completed calls are served from it (W51).
    #[arg(long, value_name = "RUN_ID")]
    pub resume: Option<String>,
    /// Start without asking (on a terminal the plan is shown and confirmed first).
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// Print the launch plan (phases, settings, limits, rough size) and exit.
    #[arg(long, conflicts_with = "yes")]
    pub plan: bool,
    /// Serve the run's session page on loopback while it runs and print its URL
    /// (`--serve`, or `--serve=127.0.0.1:PORT`) [default: 127.0.0.1 on a free port].
    #[arg(
        long,
        value_name = "ADDR",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "127.0.0.1:0"
    )]
    pub serve: Option<std::net::SocketAddr>,
    /// Run the agents' processes in a bubblewrap sandbox: each sees its working directory
    /// read-write, the system read-only, no network and nothing else of this machine. Off by
    /// default here, as Claude Code's agents run as you locally.
    #[arg(long, env = "FLOTILLA_SANDBOX_LOCAL")]
    pub sandbox: bool,
    #[command(flatten)]
    pub settings: config::SettingFlags,
    /// TOML config file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct ListArgs {
    /// Object store URL (file:///path or memory://).
    #[arg(long, env = "FLOTILLA_STORE")]
    store: Option<String>,
    /// List the runs of a coordinator instead of a local store.
    #[arg(long, env = "FLOTILLA_COORDINATOR")]
    coordinator: Option<String>,
    #[command(flatten)]
    tls: client::TlsArgs,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    filter: stored::FilterArgs,
}

#[derive(Debug, Args)]
struct LogsArgs {
    run_id: String,
    /// The agent: its index or its label [default: every agent].
    #[arg(long)]
    agent: Option<String>,
    /// Which attempt [default: the last].
    #[arg(long)]
    attempt: Option<u32>,
    /// Keep printing new events as the agents go on (a new attempt with its heading), until
    /// the run ends. With --agent, one agent's.
    #[arg(long, short = 'f')]
    follow: bool,
    #[command(flatten)]
    from: client::ReadFrom,
    /// One JSON event per line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct SandboxRelayArgs {
    /// LISTEN=SOCKET: a loopback address inside, and the unix socket it leads to.
    #[arg(long = "relay")]
    relays: Vec<String>,
    #[arg(last = true, required = true)]
    program: Vec<String>,
}

#[derive(Debug, Args)]
struct WorkspaceMountArgs {
    /// The shared tree.
    #[arg(long)]
    lower: PathBuf,
    /// The call's writes.
    #[arg(long)]
    upper: PathBuf,
    /// overlayfs' scratch, beside the writes.
    #[arg(long)]
    work: PathBuf,
    /// Where the view is mounted (the checkout's path).
    #[arg(long)]
    at: PathBuf,
    /// Where PROGRAM starts, relative to the view.
    #[arg(long)]
    cwd: Option<String>,
    /// Only check that a view can be written through.
    #[arg(long)]
    probe: bool,
    #[arg(last = true)]
    program: Vec<std::ffi::OsString>,
}

#[derive(Debug, Args)]
struct ShowArgs {
    run_id: String,
    #[command(flatten)]
    from: client::ReadFrom,
    #[arg(long)]
    json: bool,
    /// List every agent (by default at most 1000, those that did not complete first).
    #[arg(long)]
    full: bool,
}

impl Command {
    /// Whether the command was asked for JSON output (its refusals are JSON too).
    fn json(&self) -> bool {
        match self {
            Command::Run(a) => a.json,
            Command::Launch(a) => a.json(),
            Command::Resume(a) => a.json(),
            Command::Wait(a) => a.run.json(),
            Command::Status(a) | Command::Watch(a) => a.json(),
            Command::Pause(a) => a.json(),
            Command::Budget(a) => a.json(),
            Command::Stop(a) => a.json(),
            Command::Restart(a) => a.agent.json(),
            Command::Runs(a) => a.json,
            Command::Show(a) => a.json,
            Command::Logs(a) => a.json,
            Command::Agents(a) => a.json(),
            Command::Changes(a) => a.json(),
            Command::Workers(a) => a.json(),
            Command::Token(client::TokenCommand::Create(a)) => a.json(),
            Command::Workflows(w) => w.json(),
            Command::Dev(a) => a.json(),
            _ => false,
        }
    }
}

fn main() -> ExitCode {
    flotilla_proto::build::set_commit(env!("FLOTILLA_COMMIT"));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // A bad flag of a command asked for JSON is a refusal like any other.
        Err(e) if e.use_stderr() && std::env::args_os().skip(1).any(|a| a == "--json") => {
            JSON_REFUSALS.store(true, std::sync::atomic::Ordering::Relaxed);
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or_default();
            let first = first.strip_prefix("error: ").unwrap_or(first);
            let _ = e.print();
            let refusal = serde_json::json!({
                "status": "rejected",
                "error": { "code": "invalid", "message": term::clean_text(first) },
            });
            println!("{refusal}");
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    JSON_REFUSALS.store(cli.command.json(), std::sync::atomic::Ordering::Relaxed);
    // A coordinator or worker that `flotilla dev` started ends with it (a view's mount, which
    // a worker starts with its environment, is the worker's child, not dev's).
    if !matches!(cli.command, Command::WorkspaceMount(_)) {
        dev::exit_with_parent();
    }
    if let Command::WorkspaceMount(a) = cli.command {
        // Before any thread starts: a process with threads cannot enter a user namespace.
        let code = flotilla_worker::layers::mount_and_exec(&flotilla_worker::layers::MountArgs {
            lower: a.lower,
            upper: a.upper,
            work: a.work,
            at: a.at,
            cwd: a.cwd,
            probe: a.probe,
            program: a.program,
        });
        return ExitCode::from(code.clamp(0, 255) as u8);
    }
    flotilla_proto::tls::install_crypto_provider();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("flotilla")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    if let Command::SandboxRelay(a) = &cli.command {
        // No telemetry, no config: a program in a sandbox, and its relay.
        let relays: Vec<(String, PathBuf)> = a
            .relays
            .iter()
            .filter_map(|r| r.split_once('='))
            .map(|(l, s)| (l.to_owned(), PathBuf::from(s)))
            .collect();
        let code = rt.block_on(flotilla_worker::gateway::relay(
            &relays,
            &a.program[0],
            &a.program[1..],
        ));
        return ExitCode::from(code.clamp(0, 255) as u8);
    }
    let service = match &cli.command {
        Command::Coordinator(_) => "flotilla-coordinator",
        Command::Worker(_) => "flotilla-worker",
        _ => "flotilla",
    };
    let code = rt.block_on(async move {
        let telemetry = telemetry::init(service);
        let code = dispatch(cli.command).await;
        telemetry.shutdown().await;
        code
    });
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    ExitCode::from(code.clamp(0, 255) as u8)
}

/// Runs `command` (in the runtime, with telemetry on); its exit status.
async fn dispatch(command: Command) -> i32 {
    match command {
        Command::Run(args) => run(*args).await,
        Command::SandboxRelay(_) | Command::WorkspaceMount(_) => 0,
        Command::Runs(args) => match args.coordinator {
            Some(coordinator) => {
                let remote = client::ClientArgs {
                    coordinator: Some(coordinator),
                    tls: args.tls,
                };
                client::list_remote(remote, &args.filter, args.json).await
            }
            None => stored::list(args.store, &args.filter, args.json).await,
        },
        Command::Gc(args) => stored::gc(args).await,
        Command::Show(args) => match &args.from.coordinator {
            Some(c) => match client::report_of(c, &args.from.tls, &args.run_id).await {
                Ok(report) => stored::print_show(report, args.json, args.full),
                Err(code) => code,
            },
            None => stored::show(args.from.store, &args.run_id, args.json, args.full).await,
        },
        Command::Agents(args) => client::agents::run(args).await,
        Command::Logs(a) => match a.from.coordinator {
            Some(coordinator) => {
                let remote = client::ClientArgs {
                    coordinator: Some(coordinator),
                    tls: a.from.tls,
                };
                let ask = client::LogsAsk {
                    run: &a.run_id,
                    agent: a.agent.as_deref(),
                    attempt: a.attempt,
                    json: a.json,
                    follow: a.follow,
                };
                client::logs_remote(remote, ask).await
            }
            None => {
                let ask = client::LogsAsk {
                    run: &a.run_id,
                    agent: a.agent.as_deref(),
                    attempt: a.attempt,
                    json: a.json,
                    follow: a.follow,
                };
                stored::logs(a.from.store, ask).await
            }
        },
        Command::Bench(args) => bench::run(args).await,
        Command::Certs(args) => certs::run(args),
        Command::Dev(args) => dev::dev(args).await,
        Command::Ui(args) => serve::ui::ui(args).await,
        Command::Context(args) => client::context::run(args),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            use std::io::Write;
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "flotilla", &mut script);
            // A reader that stops early (`| head`) is not an error.
            let _ = std::io::stdout().write_all(&script);
            0
        }
        Command::Coordinator(args) => serve::coordinator::coordinator(*args).await,
        Command::Worker(args) => serve::worker::worker(*args).await,
        Command::Launch(args) => client::launch(*args).await,
        Command::Wait(args) => client::wait(args).await,
        Command::Status(args) => client::status(args).await,
        Command::Watch(args) => client::watch(args).await,
        Command::Stop(args) => client::stop(args).await,
        Command::Pause(args) => client::pause(args).await,
        Command::Budget(args) => client::budget(args).await,
        Command::Answer(args) => client::answer(args).await,
        Command::Resume(args) => client::resume(args).await,
        Command::Restart(args) => client::restart(args).await,
        Command::Changes(args) => client::changes::changes(args).await,
        Command::Apply(args) => client::changes::apply(args).await,
        Command::Workers(args) => client::workers(args).await,
        Command::Token(client::TokenCommand::Create(args)) => client::token_create(args).await,
        Command::Workflows(cmd) => client::workflows::run(cmd).await,
        Command::Mcp(args) => mcp::serve(*args).await,
    }
}

/// Says once, on stderr, which backend a run got when nothing named one.
pub fn say_backend_chosen(r: &config::ResolvedRun) {
    if let Some(why) = &r.backend_chosen {
        eprintln!(
            "backend {} ({why}; pass --backend to choose, --backend echo for a dry run)",
            r.settings.backend
        );
    }
}

/// Bubblewrap, with the model API relayed in by this binary.
pub async fn sandbox_with_api(
    allow_net: Vec<String>,
) -> Result<flotilla_worker::sandbox::Sandbox, Problem> {
    let s = flotilla_worker::sandbox::Sandbox::bubblewrap().await?;
    let me = std::env::current_exe()
        .map_err(|e| Problem::unavailable(format!("cannot find this program's own path: {e}")))?;
    s.with_network(me, allow_net).await
}

/// Whether this command was asked for `--json`: its refusals are then one JSON object on
/// stdout too (set once, before the command runs).
static JSON_REFUSALS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A refusal of `kind`: the error line on stderr and, with `--json`, the object
/// `{"status":"rejected","error":{"code","message"}}` on stdout; returns the exit status of
/// that kind ([`flotilla_proto::ErrorKind::exit_code`]: the one map from a kind to a status).
pub fn fail_kind(kind: flotilla_proto::ErrorKind, message: impl Said) -> i32 {
    let message = term::clean_text(&message.said()).into_owned();
    eprintln!("error: {message}");
    if JSON_REFUSALS.load(std::sync::atomic::Ordering::Relaxed) {
        let refusal = serde_json::json!({
            "status": "rejected",
            "error": { "code": kind.name(), "message": message },
        });
        println!("{refusal}");
    }
    kind.exit_code()
}

/// What a refusal says. A [`Problem`](flotilla_proto::Problem) is not text: it carries its
/// own kind and is refused with [`refuse`], so no call site can give it another.
pub trait Said {
    fn said(self) -> String;
}

impl Said for String {
    fn said(self) -> String {
        self
    }
}

impl Said for &str {
    fn said(self) -> String {
        self.to_owned()
    }
}

/// A refusal as a [`Problem`](flotilla_proto::Problem): [`fail_kind`] of its kind and message.
pub fn refuse(p: flotilla_proto::Problem) -> i32 {
    fail_kind(p.kind, p.message)
}

async fn run(args: RunArgs) -> i32 {
    let resolved = match config::resolve_run(&args) {
        Ok(r) => r,
        Err(e) => return crate::refuse(e),
    };
    if let approve::Decision::Exit(code) = approve::gate(&resolved, args.yes, args.plan) {
        return code;
    }
    say_backend_chosen(&resolved);
    let (json, full) = (args.json, args.full);
    let bars = !json && std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
    let lines = !json && !bars;
    if let Some(addr) = args.serve
        && !addr.ip().is_loopback()
    {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            format!(
                "--serve {addr}: the embedded session page has no sign-in, so it is served on loopback only; use --serve 127.0.0.1:PORT"
            ),
        );
    }
    let sandbox = if args.sandbox {
        match sandbox_with_api(Vec::new()).await {
            Ok(s) => s,
            Err(e) => {
                return fail_kind(
                    flotilla_proto::ErrorKind::Invalid,
                    format!(
                        "--sandbox: {e}; install bubblewrap (Debian: apt-get install bubblewrap) where unprivileged user namespaces are allowed"
                    ),
                );
            }
        }
    } else {
        flotilla_worker::sandbox::Sandbox::Off
    };
    let report = match embedded::run(
        resolved,
        progress::Mode::pick(bars, lines),
        args.serve,
        sandbox,
    )
    .await
    {
        Ok(r) => r,
        Err(e) => {
            // A store that cannot be used as given is a refused request (exit 2).
            let kind = e
                .downcast_ref::<flotilla_coordinator::host::StoreError>()
                .map_or(flotilla_proto::ErrorKind::Unavailable, |s| s.kind());
            return fail_kind(kind, format!("{e:#}"));
        }
    };
    print_report(&report, json, full)
}

/// Prints a finished run: the JSON report, or the result plus a summary line.
pub fn print_report(report: &Report, json: bool, full: bool) -> i32 {
    let mut out = std::io::stdout().lock();
    if json {
        let brief;
        let report = if full {
            report
        } else {
            brief = report.brief(flotilla_proto::wire::REPORT_AGENTS);
            &brief
        };
        match serde_json::to_string_pretty(report) {
            Ok(s) => {
                let _ = writeln!(out, "{s}");
            }
            Err(e) => {
                return fail_kind(
                    flotilla_proto::ErrorKind::Internal,
                    format!("cannot encode the report: {e}"),
                );
            }
        }
        return flotilla_proto::wire::Summary::of_report(report).exit_code();
    }
    match report.status {
        RunStatus::Rejected => {
            eprintln!(
                "error: {}",
                term::clean(report.error.as_deref().unwrap_or("the launch was refused"))
            );
        }
        _ => {
            // A result goes out verbatim to a pipe or file, but never as instructions to
            // a terminal.
            let tty = std::io::stdout().is_terminal();
            match &report.result {
                serde_json::Value::Null => {}
                serde_json::Value::String(s) if tty => {
                    let _ = writeln!(out, "{}", term::clean_text(s));
                }
                serde_json::Value::String(s) => {
                    let _ = writeln!(out, "{s}");
                }
                other => {
                    let _ = writeln!(
                        out,
                        "{}",
                        serde_json::to_string_pretty(other).unwrap_or_default()
                    );
                }
            }
            let _ = out.flush();
            progress::summary(report);
        }
    }
    flotilla_proto::wire::Summary::of_report(report).exit_code()
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_command_s_flags_are_consistent() {
        <super::Cli as clap::CommandFactory>::command().debug_assert();
    }
}
