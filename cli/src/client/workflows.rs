//! `flotilla workflows list|show|save|push`: the saved workflows a user can run by name
//! (W62–W64): project (`.flotilla/workflows/`, `.claude/workflows/`, closest first), personal,
//! the coordinator's (pushed), and the bundled ones, in that precedence.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use flotilla_local::bundled;
use flotilla_local::workflows::{self, DirResolver};
use flotilla_proto::names;
use flotilla_proto::v1;
use flotilla_script::text;
use serde_json::{Value, json};

use crate::client::{ClientArgs, call_problem};
use crate::fail_kind;
use crate::term::clean;
use flotilla_proto::Problem;

#[derive(Debug, Subcommand)]
pub enum WorkflowsCommand {
    /// List the workflows you can run by name, with their origin.
    List(ListArgs),
    /// Print one workflow's source and origin.
    Show(ShowArgs),
    /// Save a workflow file in the project's (or your personal) workflows directory.
    Save(SaveArgs),
    /// Save a workflow on a coordinator, so your namespace's runs can `flotilla launch NAME`.
    Push(PushArgs),
}

#[derive(Debug, Args)]
pub struct Where {
    /// Directory searched first (repeatable).
    #[arg(long = "workflows-dir", value_name = "DIR")]
    workflows_dirs: Vec<PathBuf>,
    /// Also list the workflows saved on this coordinator.
    #[command(flatten)]
    remote: ClientArgs,
    /// With --coordinator: the namespace whose pushed workflows are listed (one your
    /// certificate names; default: its first, where your launches go); `*`: only those an
    /// operator pushed to every namespace.
    #[arg(long, env = "FLOTILLA_NAMESPACE", value_name = "NS")]
    namespace: Option<String>,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    at: Where,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    #[arg(value_name = "NAME")]
    workflow: String,
    #[command(flatten)]
    at: Where,
}

#[derive(Debug, Args)]
pub struct SaveArgs {
    /// The script to save; its literal meta names it.
    file: PathBuf,
    /// Save in your personal directory instead of the project's.
    #[arg(long)]
    personal: bool,
}

#[derive(Debug, Args)]
pub struct PushArgs {
    /// The script to save on the coordinator.
    file: PathBuf,
    #[command(flatten)]
    remote: ClientArgs,
    /// The namespace whose runs it is for (one your certificate names; default: its first,
    /// where your launches go); `*`: every namespace, after their own (operators only).
    #[arg(long, env = "FLOTILLA_NAMESPACE", value_name = "NS")]
    namespace: Option<String>,
}

impl WorkflowsCommand {
    /// Whether it was asked for JSON output.
    pub fn json(&self) -> bool {
        matches!(self, WorkflowsCommand::List(a) if a.json)
    }
}

pub async fn run(cmd: WorkflowsCommand) -> i32 {
    match cmd {
        WorkflowsCommand::List(a) => list(a).await,
        WorkflowsCommand::Show(a) => show(a).await,
        WorkflowsCommand::Save(a) => save(a),
        WorkflowsCommand::Push(a) => push(a).await,
    }
}

/// One listed workflow.
struct Entry {
    name: String,
    origin: &'static str,
    location: String,
    /// Its meta, or why it is not offered.
    meta: Result<text::Meta, Problem>,
    source: Option<String>,
    /// A pushed workflow's namespace (`*`: every namespace's).
    namespace: Option<String>,
}

fn personal_dirs() -> Vec<PathBuf> {
    let (flotilla, claude) = workflows::personal_homes();
    flotilla.into_iter().chain(claude).collect()
}

async fn entries(at: &Where) -> Result<Vec<Entry>, Problem> {
    let cwd = std::env::current_dir()
        .map_err(|e| Problem::internal(format!("cannot read the working directory: {e}")))?;
    let resolver = DirResolver::standard(&cwd, &at.workflows_dirs);
    let personal = personal_dirs();
    // The project's directories: `--workflows-dir`s, and those from here up to the repository root.
    let mut project: Vec<PathBuf> = at.workflows_dirs.iter().map(|d| cwd.join(d)).collect();
    for dir in workflows::project_roots(&cwd) {
        project.push(dir.join(".flotilla").join("workflows"));
        project.push(dir.join(".claude").join("workflows"));
    }
    let mut out = Vec::new();
    for (path, meta) in resolver.list() {
        let origin = if project.iter().any(|p| path.parent() == Some(p.as_path())) {
            "project"
        } else if personal.iter().any(|p| path.starts_with(p)) {
            "personal"
        } else {
            "project"
        };
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        out.push(Entry {
            name: meta.as_ref().map(|m| m.name.clone()).unwrap_or(stem),
            origin,
            location: path.display().to_string(),
            meta: meta.map_err(|e| Problem::invalid(String::from(e))),
            source: None,
            namespace: None,
        });
    }
    for w in resolver.plugin_workflows() {
        out.push(Entry {
            meta: text::read_meta(&w.source).map_err(|e| Problem::invalid(e.to_string())),
            name: w.name,
            origin: "plugin",
            location: w.origin,
            source: Some(w.source),
            namespace: None,
        });
    }
    let wants_remote = at.remote.coordinator.is_some();
    if wants_remote {
        let mut client = at.remote.client()?;
        let listed = client
            .list_workflows(v1::ListWorkflowsRequest {
                protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
                namespace: at.namespace.clone().unwrap_or_default(),
            })
            .await
            .map_err(|s| call_problem(&s))?
            .into_inner();
        for w in listed.workflows {
            // Pushed to the namespace itself, or by an operator to every namespace.
            let namespace = if names::pushed_to_fleet(&w.origin) {
                names::ALL_NAMESPACES.to_owned()
            } else {
                listed.namespace.clone()
            };
            out.push(Entry {
                meta: text::read_meta(&w.source).map_err(|e| Problem::invalid(e.to_string())),
                name: w.name,
                origin: "server",
                location: w.origin,
                source: Some(w.source),
                namespace: Some(namespace),
            });
        }
    }
    if !bundled::hidden() {
        for (name, text) in bundled::BUNDLED {
            out.push(Entry {
                name: name.to_owned(),
                origin: "bundled",
                location: bundled::origin(name),
                meta: text::read_meta(text).map_err(|e| Problem::invalid(e.to_string())),
                source: Some(text.to_owned()),
                namespace: None,
            });
        }
    }
    Ok(out)
}

/// The index of the entry that runs for each name (the first offered one).
fn winner(entries: &[Entry], i: usize) -> Option<usize> {
    let e = &entries[i];
    entries
        .iter()
        .position(|o| o.meta.is_ok() && o.name == e.name)
}

/// The listing `workflows list --json` prints, of this machine's workflows (and the bundled
/// ones), with `dirs` searched first, and those pushed to `namespace` (empty: the
/// certificate's first) on `remote`'s coordinator if it names one.
pub async fn rows(
    dirs: &[PathBuf],
    remote: ClientArgs,
    namespace: Option<String>,
) -> Result<Vec<Value>, Problem> {
    let at = Where {
        workflows_dirs: dirs.to_vec(),
        remote,
        namespace,
    };
    Ok(json_rows(&entries(&at).await?))
}

fn json_rows(all: &[Entry]) -> Vec<Value> {
    all.iter()
        .enumerate()
        .map(|(i, e)| {
            let mut row = json!({
                "name": e.name,
                "origin": e.origin,
                "location": e.location,
            });
            if let Some(ns) = &e.namespace {
                row["namespace"] = json!(ns);
            }
            match &e.meta {
                Ok(m) => {
                    row["description"] = json!(m.description);
                    row["whenToUse"] = json!(m.when_to_use);
                    row["offered"] = json!(true);
                    if let Some(w) = winner(all, i).filter(|w| *w != i) {
                        row["shadowedBy"] = json!(all[w].location);
                    }
                }
                Err(why) => {
                    row["offered"] = json!(false);
                    row["error"] = json!(why.message);
                }
            }
            row
        })
        .collect()
}

async fn list(a: ListArgs) -> i32 {
    let all = match entries(&a.at).await {
        Ok(e) => e,
        Err(f) => return crate::refuse(f),
    };
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json_rows(&all)).unwrap_or_default()
        );
        return 0;
    }
    let mut skipped = Vec::new();
    for (i, e) in all.iter().enumerate() {
        match &e.meta {
            Ok(m) => {
                let shadow = match winner(&all, i).filter(|w| *w != i) {
                    Some(w) => format!("  (shadowed by {})", all[w].location),
                    None => String::new(),
                };
                let pushed_to = match e.namespace.as_deref() {
                    Some(names::ALL_NAMESPACES) => "  (pushed to every namespace)".to_owned(),
                    Some(ns) => format!("  (namespace {})", clean(ns)),
                    None => String::new(),
                };
                println!(
                    "{:<20} {:<9} {}{pushed_to}{shadow}",
                    clean(&e.name),
                    e.origin,
                    clean(&m.description)
                );
                if let Some(when) = &m.when_to_use {
                    println!("{:<20} {:<9} when: {}", "", "", clean(when));
                }
                if e.origin != "bundled" && e.origin != "server" {
                    println!("{:<20} {:<9} {}", "", "", e.location);
                }
            }
            Err(why) => skipped.push(format!("{}: not offered: {why}", e.location)),
        }
    }
    for s in skipped {
        println!("{}", clean(&s));
    }
    0
}

async fn show(a: ShowArgs) -> i32 {
    let all = match entries(&a.at).await {
        Ok(e) => e,
        Err(f) => return crate::refuse(f),
    };
    let name = a.workflow.trim_start_matches('/');
    let Some(e) = all.iter().find(|e| e.name == name && e.meta.is_ok()) else {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            format!("no workflow {name:?}: `flotilla workflows list` shows the ones you can run"),
        );
    };
    let text = match &e.source {
        Some(s) => s.clone(),
        None => match flotilla_local::reads::read_file(
            std::path::Path::new(&e.location),
            flotilla_local::reads::SCRIPT_BYTES,
            "workflow",
        ) {
            Ok(s) => s,
            Err(err) => return crate::refuse(err),
        },
    };
    eprintln!("# {} ({})", e.location, e.origin);
    print!("{text}");
    if !text.ends_with('\n') {
        println!();
    }
    0
}

fn is_link(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

/// The project directory a workflow is saved in: the closest existing workflows directory
/// between here and the repository root, else `.flotilla/workflows` at the repository root
/// (or here, outside a repository).
fn project_target(cwd: &Path) -> PathBuf {
    for dir in workflows::project_roots(cwd) {
        for sub in [".flotilla", ".claude"] {
            let w = dir.join(sub).join("workflows");
            if w.is_dir() {
                return w;
            }
        }
    }
    workflows::repo_root(cwd)
        .unwrap_or_else(|| cwd.to_path_buf())
        .join(".flotilla")
        .join("workflows")
}

fn save(a: SaveArgs) -> i32 {
    let text = match flotilla_local::reads::read_file(
        &a.file,
        flotilla_local::reads::SCRIPT_BYTES,
        "workflow",
    ) {
        Ok(t) => t,
        Err(e) => return crate::refuse(e),
    };
    let meta = match text::read_meta(&text) {
        Ok(m) => m,
        Err(e) => {
            return fail_kind(
                flotilla_proto::ErrorKind::Invalid,
                format!(
                    "{} has no literal meta with name and description (W02): {e}",
                    a.file.display()
                ),
            );
        }
    };
    if !names::valid_workflow_name(&meta.name) {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            format!(
                "meta.name {:?} cannot name a saved workflow: use letters, digits, '-', '_' and '.'",
                meta.name
            ),
        );
    }
    let dir = if a.personal {
        match personal_dirs().into_iter().next() {
            Some(d) => d.join("workflows"),
            None => {
                return fail_kind(
                    flotilla_proto::ErrorKind::Invalid,
                    "no HOME or XDG_CONFIG_HOME for a personal directory",
                );
            }
        }
    } else {
        match std::env::current_dir() {
            Ok(cwd) => project_target(&cwd),
            Err(e) => {
                return fail_kind(
                    flotilla_proto::ErrorKind::Unavailable,
                    format!("cannot read the working directory: {e}"),
                );
            }
        }
    };
    let target = dir.join(format!("{}.js", meta.name));
    // Never write through a link (W64): the config directory, the workflows directory (for a
    // project) or the file itself.
    let mut checked = vec![target.clone()];
    if !a.personal {
        checked.push(dir.clone());
        if let Some(parent) = dir.parent() {
            checked.push(parent.to_path_buf());
        }
    }
    if let Some(link) = checked.iter().find(|p| is_link(p)) {
        return fail_kind(
            flotilla_proto::ErrorKind::Invalid,
            format!(
                "refusing to save through a symbolic link: {} is a link; save to a real directory",
                link.display()
            ),
        );
    }
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return fail_kind(
            flotilla_proto::ErrorKind::Internal,
            format!("cannot create {}: {e}", dir.display()),
        );
    }
    let replaced = target.exists();
    let tmp = dir.join(format!(".{}.js.tmp", meta.name));
    if let Err(e) = std::fs::write(&tmp, &text).and_then(|()| std::fs::rename(&tmp, &target)) {
        let _ = std::fs::remove_file(&tmp);
        return fail_kind(
            flotilla_proto::ErrorKind::Internal,
            format!("cannot write {}: {e}", target.display()),
        );
    }
    println!(
        "{} {} as {}",
        if replaced { "replaced" } else { "saved" },
        meta.name,
        target.display()
    );
    0
}

async fn push(a: PushArgs) -> i32 {
    let text = match flotilla_local::reads::read_file(
        &a.file,
        flotilla_local::reads::SCRIPT_BYTES,
        "workflow",
    ) {
        Ok(t) => t,
        Err(e) => return crate::refuse(e),
    };
    let mut client = match a.remote.client() {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    match client
        .push_workflow(v1::PushWorkflowRequest {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            source: text,
            namespace: a.namespace.unwrap_or_default(),
        })
        .await
    {
        Ok(r) => {
            let r = r.into_inner();
            let (to, whose) = if r.namespace == names::ALL_NAMESPACES {
                (
                    "for every namespace".to_owned(),
                    "any namespace's runs (after a push of the same name to their own)",
                )
            } else {
                (
                    format!("in namespace {}", clean(&r.namespace)),
                    "that namespace's runs",
                )
            };
            println!(
                "{} {} {to} on the coordinator ({}, sha256 {}, recorded as pushed by {}); {whose} run it with `flotilla launch {}`",
                if r.replaced { "replaced" } else { "saved" },
                r.name,
                r.origin,
                &r.sha256[..r.sha256.len().min(12)],
                r.pushed_by,
                r.name
            );
            0
        }
        Err(s) => crate::client::rpc_fail(&s),
    }
}
