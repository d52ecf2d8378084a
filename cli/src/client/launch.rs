//! `flotilla launch` and `flotilla resume`: a run sent to a coordinator, with its source.

use std::path::PathBuf;

use clap::Args;
use flotilla_local::workflows::{DirResolver, FoundWorkflow, WorkflowResolver};
use flotilla_proto::v1::client_service_client::ClientServiceClient;
use flotilla_proto::v1::{self};

use crate::client::*;
use crate::{config, fail_kind};
use flotilla_proto::Problem;

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("follows").args(["wait", "watch"]).multiple(false)))]
pub struct LaunchArgs {
    #[command(flatten)]
    run: crate::RunArgs,
    /// Wait for the run to end and print its report, as `flotilla wait` would (the session URL
    /// is printed at once; with --json only the report is).
    #[arg(long)]
    wait: bool,
    /// Follow the run as `flotilla watch` does (progress bars on a terminal, lines
    /// otherwise), then print its report.
    #[arg(long)]
    watch: bool,
    /// With --wait or --watch: exit 5 when the run completed but some of its agents failed.
    #[arg(long, requires = "follows")]
    exit_status: bool,
    #[command(flatten)]
    remote: ClientArgs,
    #[command(flatten)]
    source: SourceFlags,
}

/// What code a fleet run's agents work on (`launch`, and `mcp` on a fleet).
#[derive(Debug, Clone, Args, Default)]
pub struct SourceFlags {
    /// The code the agents work on: `auto` (the repository you launch from, with its
    /// uncommitted and untracked files; none outside one), `none` (a scratch directory per
    /// agent), or `git+URL#REF` (a repository the workers fetch themselves).
    #[arg(long, env = "FLOTILLA_SOURCE", value_name = "auto|none|git+URL#REF")]
    pub source: Option<String>,
    /// The most a launch sends of the repository's objects, in MiB [default: 2048].
    #[arg(long, env = "FLOTILLA_MAX_SOURCE_MIB", value_name = "MIB")]
    pub max_source_mib: Option<u64>,
    /// Send checked-out submodules' files with the source (as plain files in its snapshot);
    /// without it they are recorded by commit and their directories stay empty.
    #[arg(long, env = "FLOTILLA_SUBMODULES")]
    pub submodules: bool,
}

/// A launch resolved on this machine (the coordinator's saved workflows included), not sent.
pub(crate) struct Prepared {
    pub resolved: config::ResolvedRun,
    server: Vec<FoundWorkflow>,
}

/// Resolves `run` as the coordinator will run it: a name may be a workflow pushed there to
/// the run's namespace (or to every namespace).
pub(crate) async fn prepare(
    client: &mut ClientServiceClient<tonic::transport::Channel>,
    run: &crate::RunArgs,
) -> Result<Prepared, Problem> {
    let by_path = std::path::Path::new(&run.script).exists() || run.script.ends_with(".js");
    let server = if by_path && !run.by_name {
        Vec::new()
    } else {
        let asked =
            config::asked_namespace(run.settings.namespace.as_deref(), run.config.as_deref())?;
        let namespace = run_namespace(client, asked, run.resume.as_deref()).await;
        client
            .list_workflows(v1::ListWorkflowsRequest {
                protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
                namespace,
            })
            .await
            .map_err(|s| call_problem(&s))?
            .into_inner()
            .workflows
            .into_iter()
            .map(FoundWorkflow::from)
            .collect()
    };
    let resolved = config::resolve_run_with(run, &server, false)?;
    Ok(Prepared { resolved, server })
}

/// The namespace a launch asking for `asked` runs in, as far as this client can tell: `asked`,
/// else (a resume) its run's, else empty (the certificate's first, the coordinator decides).
async fn run_namespace(
    client: &mut ClientServiceClient<tonic::transport::Channel>,
    asked: String,
    resume: Option<&str>,
) -> String {
    let (true, Some(parent)) = (asked.is_empty(), resume) else {
        return asked;
    };
    let Ok(r) = client
        .report(v1::RunRef {
            run_id: parent.to_owned(),
        })
        .await
    else {
        return asked;
    };
    serde_json::from_str::<serde_json::Value>(&r.into_inner().report_json)
        .ok()
        .and_then(|v| v["namespace"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// A launch as the coordinator answered it, with the source it sent.
pub(crate) struct Sent {
    pub reply: v1::LaunchReply,
    pub source: Option<(flotilla_proto::settings::SourceRef, crate::source::Uploaded)>,
}

/// Sends a prepared launch: its source first (what the store lacks of it), then the run.
pub(crate) async fn send(
    client: &mut ClientServiceClient<tonic::transport::Channel>,
    prepared: Prepared,
    source: &SourceFlags,
) -> Result<Sent, Problem> {
    let Prepared {
        mut resolved,
        server,
    } = prepared;
    let (workflows, agent_types, agent_definitions) = carried(&resolved, server);
    // A source commit the store held when asked may be swept by retention before the run
    // holds it; the coordinator then refuses the launch, and it is sent once more (the
    // commit uploaded again).
    let mut again = true;
    // A resume runs in its run's namespace (unless it names one), so its source goes there.
    let namespace = run_namespace(
        client,
        resolved.settings.namespace.clone(),
        resolved.resume.as_deref(),
    )
    .await;
    loop {
        let sent = send_source(client, source, &resolved.cwd, &namespace).await?;
        resolved.settings.source = sent.as_ref().map(|(s, _)| s.clone());
        let settings_json = serde_json::to_string(&resolved.settings)
            .map_err(|e| Problem::internal(format!("the run's settings cannot be sent: {e}")))?;
        let req = v1::LaunchRequest {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            script: resolved.source.clone(),
            origin: resolved.origin.clone(),
            args_json: resolved.args.as_ref().map(|v| v.to_string()),
            settings_json,
            resume_from: resolved.resume.clone().unwrap_or_default(),
            workflows: workflows.clone(),
            agent_types: agent_types.clone(),
            agent_definitions: agent_definitions.clone(),
            inherit: false,
            saved_name: resolved.saved_name.clone().unwrap_or_default(),
        };
        // The coordinator's limits, checked here first, with the same words.
        flotilla_local::sizes::check_launch(&req)?;
        let reply = client
            .launch(req)
            .await
            .map_err(|s| call_problem(&s))?
            .into_inner();
        if again && reply.status == "rejected" && reply.resend_source {
            again = false;
            continue;
        }
        return Ok(Sent {
            reply,
            source: sent,
        });
    }
}

pub async fn launch(a: LaunchArgs) -> i32 {
    if a.run.serve.is_some() {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            "--serve is for `flotilla run`; on the fleet the coordinator serves every run's page at its --http address",
        );
    }
    let file = match config::load(a.run.config.as_deref()) {
        Ok(f) => f,
        Err(e) => return crate::refuse(e),
    };
    let mut client = match a.remote.client_with(&file) {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    let prepared = match prepare(&mut client, &a.run).await {
        Ok(p) => p,
        Err(e) => return crate::refuse(e),
    };
    if let crate::approve::Decision::Exit(code) =
        crate::approve::gate(&prepared.resolved, a.run.yes, a.run.plan)
    {
        return code;
    }
    crate::say_backend_chosen(&prepared.resolved);
    let Sent { reply, source } = match send(&mut client, prepared, &a.source).await {
        Ok(s) => s,
        Err(e) => return crate::refuse(e),
    };
    if (a.wait || a.watch) && reply.status != "rejected" {
        let run_id = reply.run_id.clone();
        if !a.run.json {
            print_launched(reply, false, None);
        } else {
            say_notes(&reply.notes);
        }
        if a.watch {
            return watch_on(&mut client, run_id, a.run.json, false, a.exit_status).await;
        }
        return wait_and_report(&mut client, run_id, a.run.json, false, a.exit_status).await;
    }
    if a.run.json && reply.status != "rejected" {
        say_notes(&reply.notes);
        let mut v = serde_json::json!({"run_id": reply.run_id, "session_url": reply.session_url, "status": reply.status, "notes": reply.notes});
        if let Some((src, up)) = &source {
            v["source"] = serde_json::json!({
                "repo": src.repo, "commit": src.commit, "origin": src.origin,
                "uploaded_bytes": up.bytes, "uploaded_objects": up.objects,
            });
        }
        println!("{v}");
        return 0;
    }
    print_launched(reply, a.run.json, None)
}

/// What a launch carries to the coordinator from the launching machine: the workflows it can
/// see (the coordinator's own come after them, for `workflow(name)`), the agent types' models,
/// and the custom agent types' definitions.
fn carried(
    resolved: &config::ResolvedRun,
    server: Vec<FoundWorkflow>,
) -> (
    Vec<v1::SavedWorkflow>,
    std::collections::HashMap<String, String>,
    Vec<v1::AgentDefinition>,
) {
    let dirs = DirResolver::standard(&resolved.cwd, &resolved.workflows_dirs);
    let workflows = dirs
        .list()
        .into_iter()
        .filter_map(|(path, meta)| {
            let meta = meta.ok()?;
            let source = flotilla_local::reads::read_file(
                &path,
                flotilla_local::reads::SCRIPT_BYTES,
                "workflow",
            )
            .ok()?;
            Some(v1::SavedWorkflow {
                name: meta.name,
                source,
                origin: path.display().to_string(),
            })
        })
        .collect::<Vec<_>>();
    // The caller's plugins' workflows (`plugin:name`), then the coordinator's own saved ones,
    // for `workflow(name)`.
    let mut workflows = workflows;
    workflows.extend(
        dirs.plugin_workflows()
            .into_iter()
            .map(v1::SavedWorkflow::from),
    );
    for w in server {
        if !workflows.iter().any(|c| c.name == w.name) {
            workflows.push(w.into());
        }
    }
    let types = dirs.agent_types();
    let agent_definitions = types
        .iter()
        .filter_map(|t| {
            Some(v1::AgentDefinition {
                prompt: t.prompt.clone()?,
                name: t.name.clone(),
                model: t.model.clone().unwrap_or_default(),
                description: t.description.clone().unwrap_or_default(),
                tools: t.tools.clone(),
            })
        })
        .collect();
    let agent_types = types
        .into_iter()
        .map(|t| (t.name, t.model.unwrap_or_default()))
        .collect();
    (workflows, agent_types, agent_definitions)
}

/// Decides the run's source and sends what the store lacks of it (`--source`) to the sources
/// of `namespace`, the one the run is launched in (empty: the certificate's first).
pub(crate) async fn send_source(
    client: &mut ClientServiceClient<tonic::transport::Channel>,
    a: &SourceFlags,
    cwd: &std::path::Path,
    namespace: &str,
) -> Result<Option<(flotilla_proto::settings::SourceRef, crate::source::Uploaded)>, Problem> {
    use crate::source::{Choice, Uploaded};
    match crate::source::parse_choice(a.source.as_deref())? {
        Choice::None => Ok(None),
        Choice::Url { url, rev } => Ok(Some((
            crate::source::url_source(&url, &rev),
            Uploaded::default(),
        ))),
        Choice::Auto => {
            let Some(snap) = crate::source::snapshot_with(cwd, a.submodules)? else {
                eprintln!(
                    "source: {} is not in a git repository, so the agents get scratch directories (--source none); launch from a checkout to send its code",
                    cwd.display()
                );
                return Ok(None);
            };
            for note in crate::source::notes(&snap) {
                eprintln!("source: {note}");
            }
            let max = a.max_source_mib.unwrap_or(2048).saturating_mul(1 << 20);
            let up = crate::source::upload(client, &snap, max, namespace).await?;
            eprintln!(
                "source: {} at {} ({})",
                crate::term::clean(&snap.origin),
                &snap.commit[..snap.commit.len().min(12)],
                if up.bytes == 0 {
                    "the coordinator has it already".to_owned()
                } else {
                    format!(
                        "sent {} objects, {} KiB",
                        up.objects,
                        up.bytes.div_ceil(1024)
                    )
                }
            );
            Ok(Some((
                flotilla_proto::settings::SourceRef {
                    repo: snap.repo,
                    commit: snap.commit,
                    url: None,
                    origin: snap.origin,
                    submodules: snap.submodules,
                },
                up,
            )))
        }
    }
}

/// Prints what a launch answered (the rejected report with `--json`, or the new run);
/// returns the exit status. `resumes`: the run it resumes, if any.
pub(crate) fn print_launched(reply: v1::LaunchReply, json: bool, resumes: Option<&str>) -> i32 {
    if reply.status == "rejected" {
        if json {
            // The rejected report is the one JSON object (not a second refusal after it).
            println!("{}", reply.report_json);
            eprintln!("error: {}", crate::term::clean_text(&reply.error));
            return 2;
        }
        return fail_kind(flotilla_proto::ErrorKind::Invalid, reply.error);
    }
    say_notes(&reply.notes);
    if json {
        let mut v = serde_json::json!({"run_id": reply.run_id, "session_url": reply.session_url, "status": reply.status, "notes": reply.notes});
        if let Some(parent) = resumes {
            v["resumed_from"] = parent.into();
        }
        println!("{v}");
    } else if let Some(parent) = resumes {
        println!(
            "run {}  session {}  (resumes {parent})",
            reply.run_id, reply.session_url
        );
    } else {
        println!("run {}  session {}", reply.run_id, reply.session_url);
    }
    0
}

/// What the coordinator said of a run it started (the backend it chose, agents no attached
/// worker can run yet), on stderr, at once.
fn say_notes(notes: &[String]) {
    for n in notes {
        eprintln!("{}", crate::term::clean_text(n));
    }
}

#[derive(Debug, Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    run: RunRefArgs,
    /// Run this script instead of the stored one (an edited version).
    #[arg(long, value_name = "FILE")]
    script: Option<PathBuf>,
    /// `args` for the script as JSON [default: the stored run's].
    #[arg(long)]
    args: Option<String>,
    /// content (reuse any completed call with the same key) or prefix (W51's ordered rule).
    #[arg(long, default_value = "content")]
    replay: String,
}

impl LaunchArgs {
    pub fn json(&self) -> bool {
        self.run.json
    }
}

impl ResumeArgs {
    pub fn json(&self) -> bool {
        self.run.json()
    }
}

/// `flotilla resume RUN`: a paused run on the coordinator goes on; any other run (ended,
/// stopped, or run by a coordinator that is gone) starts again as a new run that reuses
/// its completed calls.
pub async fn resume(a: ResumeArgs) -> i32 {
    let mut client = match a.run.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    if a.script.is_none() && a.args.is_none() {
        match client
            .control(v1::ControlRequest {
                run_id: a.run.run_id.clone(),
                action: "resume".into(),
                agent: String::new(),
                ..Default::default()
            })
            .await
        {
            Ok(r) => {
                eprintln!("{}", r.into_inner().message);
                return 0;
            }
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => return rpc_fail(&s),
        }
    }
    let script = match &a.script {
        None => String::new(),
        Some(p) => {
            match flotilla_local::reads::read_file(p, flotilla_local::reads::SCRIPT_BYTES, "script")
            {
                Ok(s) => s,
                Err(e) => return crate::refuse(e),
            }
        }
    };
    if let Some(args) = &a.args
        && let Err(e) = serde_json::from_str::<serde_json::Value>(args)
    {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            format!("--args is not valid JSON: {e}"),
        );
    }
    let replay = match a.replay.parse::<flotilla_proto::settings::ReplayMode>() {
        Ok(m) => m,
        Err(e) => return fail_kind(flotilla_proto::ErrorKind::Invalid, e.to_string()),
    };
    let settings = flotilla_proto::settings::RunSettings {
        replay,
        ..Default::default()
    };
    let settings_json = match serde_json::to_string(&settings) {
        Ok(s) => s,
        Err(e) => return fail_kind(flotilla_proto::ErrorKind::Unavailable, e.to_string()),
    };
    let req = v1::LaunchRequest {
        protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
        script,
        origin: a
            .script
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        args_json: a.args.clone(),
        settings_json,
        resume_from: a.run.run_id.clone(),
        workflows: Vec::new(),
        agent_types: Default::default(),
        agent_definitions: Vec::new(),
        saved_name: String::new(),
        inherit: true,
    };
    if let Err(e) = flotilla_local::sizes::check_launch(&req) {
        return crate::refuse(e);
    }
    match client.launch(req).await {
        Ok(r) => print_launched(r.into_inner(), a.run.json, Some(&a.run.run_id)),
        Err(s) => rpc_fail(&s),
    }
}
