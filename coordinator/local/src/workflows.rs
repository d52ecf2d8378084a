//! Finding saved workflows for `workflow(name)` and `workflow({ scriptPath })` (W36, W62–W63).
//!
//! A [`WorkflowResolver`] turns a reference into a script's source. [`DirResolver`] searches, in
//! order: extra directories given on the command line, then `.flotilla/workflows/` and
//! `.claude/workflows/` in every directory from the working directory up to the repository
//! root (closest first), then the personal directories (`$XDG_CONFIG_HOME/flotilla/workflows`
//! and `~/.claude/workflows`, or `$CLAUDE_CONFIG_DIR/workflows`). A name matches a script
//! whose literal `meta.name` is that name; the file stem is the fallback. Files whose `meta`
//! cannot be read statically are not offered (W03).

use flotilla_proto::Problem;
use std::path::{Path, PathBuf};

use serde_json::Value;

use flotilla_script::text;

/// A reference from a script: a saved workflow's name, or a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkflowRef {
    Name(String),
    Path(String),
}

/// Why a workflow reference found nothing to run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkflowError {
    #[error("workflow() takes a saved workflow name or {{ scriptPath }}")]
    BadReference,
    #[error("{0:?} is not a workflow name")]
    NotAName(String),
    #[error("unknown workflow {name:?}: {hint}")]
    Unknown { name: String, hint: String },
    /// A script that cannot be read (or has no literal meta), with why.
    #[error("{0}")]
    Unreadable(String),
}

impl WorkflowError {
    pub fn kind(&self) -> flotilla_proto::ErrorKind {
        match self {
            WorkflowError::Unknown { .. } => flotilla_proto::ErrorKind::NotFound,
            _ => flotilla_proto::ErrorKind::Invalid,
        }
    }
}

impl WorkflowRef {
    /// Reads the JSON the prelude sends: a string, or `{ "scriptPath": ... }`.
    pub fn from_json(text: &str) -> Result<WorkflowRef, WorkflowError> {
        match serde_json::from_str::<Value>(text) {
            Ok(Value::String(name)) => Ok(WorkflowRef::Name(name)),
            Ok(Value::Object(m)) => match m.get("scriptPath") {
                Some(Value::String(p)) => Ok(WorkflowRef::Path(p.clone())),
                _ => Err(WorkflowError::BadReference),
            },
            _ => Err(WorkflowError::BadReference),
        }
    }
}

pub use crate::bundled::FoundWorkflow;

impl From<FoundWorkflow> for flotilla_proto::v1::SavedWorkflow {
    fn from(w: FoundWorkflow) -> Self {
        flotilla_proto::v1::SavedWorkflow {
            name: w.name,
            source: w.source,
            origin: w.origin,
        }
    }
}

/// Agent types every run knows, like Claude Code's built-in subagent types (W21).
pub const BUILTIN_AGENT_TYPES: [&str; 3] = ["general-purpose", "Explore", "Plan"];

/// An agent type a call may name with `agentType`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgentType {
    pub name: String,
    /// The type's own model (`model:` in its definition), used when the call names none (W18).
    pub model: Option<String>,
    /// A custom type's `description:`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A custom type's system prompt (the body of its definition). `None` for built-ins, which
    /// the agent backend knows by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// A custom type's `tools:` list; empty means the session's tools.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
}

impl AgentType {
    /// A built-in type, known to the agent backend by name.
    pub fn builtin(name: &str) -> AgentType {
        AgentType {
            name: name.to_owned(),
            model: None,
            description: None,
            prompt: None,
            tools: Vec::new(),
        }
    }

    /// What an agent backend needs to run a custom type: its definition as JSON (`None` for
    /// a built-in).
    pub fn definition_json(&self) -> Option<String> {
        let prompt = self.prompt.as_ref()?;
        let mut def = serde_json::json!({
            "description": self.description.clone().unwrap_or_else(|| self.name.clone()),
            "prompt": prompt,
        });
        if !self.tools.is_empty() {
            def["tools"] = serde_json::json!(self.tools);
        }
        if let Some(m) = &self.model {
            def["model"] = serde_json::json!(m);
        }
        Some(def.to_string())
    }
}

fn builtins() -> Vec<AgentType> {
    BUILTIN_AGENT_TYPES
        .iter()
        .map(|n| AgentType::builtin(n))
        .collect()
}

/// Resolves workflow references of a run, and knows which agent types exist.
pub trait WorkflowResolver: Send + Sync + 'static {
    fn resolve(&self, reference: &WorkflowRef) -> Result<FoundWorkflow, WorkflowError>;

    /// The `agentType` names a call may use: the built-ins plus custom agents.
    fn agent_types(&self) -> Vec<AgentType> {
        builtins()
    }

    /// What a client carried with its launch, to store with the run (so a resume or a
    /// takeover resolves the same); `None` for resolvers that read local files.
    fn carried(&self) -> Option<CarriedWorkflows> {
        None
    }
}

/// A resolver that knows no workflows (used by benchmarks and tests).
#[derive(Debug, Default)]
pub struct NoWorkflows;

impl WorkflowResolver for NoWorkflows {
    fn resolve(&self, reference: &WorkflowRef) -> Result<FoundWorkflow, WorkflowError> {
        Err(match reference {
            WorkflowRef::Name(n) => WorkflowError::Unknown {
                name: n.clone(),
                hint: "no saved workflows are available here".into(),
            },
            WorkflowRef::Path(p) => WorkflowError::Unreadable(format!(
                "cannot read workflow script {p:?}: no files are available here"
            )),
        })
    }
}

/// Workflows and agent types a client carried with its launch, so a remote run resolves
/// `workflow(name)` exactly as the client would locally (and again on resume).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct CarriedWorkflows {
    pub workflows: Vec<FoundWorkflow>,
    pub agent_types: Vec<AgentType>,
}

impl WorkflowResolver for CarriedWorkflows {
    fn carried(&self) -> Option<CarriedWorkflows> {
        Some(self.clone())
    }

    fn resolve(&self, reference: &WorkflowRef) -> Result<FoundWorkflow, WorkflowError> {
        match reference {
            WorkflowRef::Name(name) => {
                let name = name.strip_prefix('/').unwrap_or(name);
                self.workflows
                    .iter()
                    .find(|w| w.name == name)
                    .cloned()
                    .or_else(|| crate::bundled::find(name))
                    .ok_or_else(|| WorkflowError::Unknown {
                        name: name.to_owned(),
                        hint: "the launch carried no saved workflow of that name; \
                               save it in .flotilla/workflows/ where you launch from"
                            .into(),
                    })
            }
            WorkflowRef::Path(p) => self
                .workflows
                .iter()
                .find(|w| {
                    w.origin == *p
                        || w.origin
                            .ends_with(&format!("/{}", p.trim_start_matches("./")))
                })
                .cloned()
                .ok_or_else(|| {
                    WorkflowError::Unreadable(format!(
                        "workflow({{ scriptPath: {p:?} }}) cannot be read on the coordinator; \
                         save the workflow in .flotilla/workflows/ and call it by name"
                    ))
                }),
        }
    }

    fn agent_types(&self) -> Vec<AgentType> {
        let mut out = builtins();
        for t in &self.agent_types {
            if !out.iter().any(|o| o.name == t.name) {
                out.push(t.clone());
            }
        }
        out
    }
}

/// The file-system resolver of the CLI.
#[derive(Debug, Clone)]
pub struct DirResolver {
    /// Directories searched in order; the first match wins.
    pub dirs: Vec<PathBuf>,
    /// Directories of custom agent definitions (`*.md`, name from the front matter).
    pub agent_dirs: Vec<PathBuf>,
    /// Installed and enabled Claude Code plugins (W21, W62–W63): their agents are types named
    /// `plugin:agent`, their workflows run as `plugin:name`.
    pub plugins: Vec<Plugin>,
    /// Base for relative `scriptPath`s.
    pub cwd: PathBuf,
}

/// A plugin's workflow files (W62): those its manifest's `workflows` field names (a path or a
/// list of paths, files or directories, relative to the plugin's root), which replaces the
/// default scan of its `workflows/` directory. A path that leaves the plugin's root (through
/// `..` or a symlink) is skipped, as is a manifest that cannot be read.
fn plugin_workflow_files(root: &Path) -> Vec<PathBuf> {
    let manifest = root.join(".claude-plugin").join("plugin.json");
    let listed = crate::reads::read_file(&manifest, crate::reads::SMALL_FILE_BYTES, "plugin")
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|m| match m.get("workflows")? {
            Value::String(one) => Some(vec![one.clone()]),
            Value::Array(many) => Some(
                many.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect(),
            ),
            _ => None,
        });
    let Some(listed) = listed else {
        return files_in(&root.join("workflows"), "js");
    };
    let Ok(real_root) = root.canonicalize() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in listed {
        let Ok(path) = root.join(&entry).canonicalize() else {
            continue;
        };
        if !path.starts_with(&real_root) {
            continue;
        }
        let found = if path.is_dir() {
            files_in(&path, "js")
                .into_iter()
                .filter_map(|f| f.canonicalize().ok())
                .collect()
        } else {
            vec![path]
        };
        for f in found {
            if f.starts_with(&real_root) && f.is_file() && !out.contains(&f) {
                out.push(f);
            }
        }
    }
    out
}

/// An installed Claude Code plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plugin {
    pub name: String,
    pub root: PathBuf,
}

/// The plugins Claude Code has installed under `claude_home` (`plugins/installed_plugins.json`,
/// as `claude plugin install` writes it) and that are enabled for a session in `cwd`: by
/// `enabledPlugins` in the user's `settings.json` or the project's `.claude/settings.json` or
/// `.claude/settings.local.json`. A project- or local-scope install counts only in its project.
pub fn installed_plugins(claude_home: &Path, cwd: &Path) -> Vec<Plugin> {
    let read = |p: &Path| -> Option<Value> {
        let text =
            crate::reads::read_file(p, crate::reads::SMALL_FILE_BYTES, "Claude Code settings")
                .ok()?;
        serde_json::from_str(&text).ok()
    };
    let Some(installed) = read(&claude_home.join("plugins").join("installed_plugins.json")) else {
        return Vec::new();
    };
    let roots = project_roots(cwd);
    let mut settings: Vec<Value> =
        vec![read(&claude_home.join("settings.json")).unwrap_or_default()];
    for d in &roots {
        for f in ["settings.json", "settings.local.json"] {
            settings.extend(read(&d.join(".claude").join(f)));
        }
    }
    // The closest setting of a plugin wins (project over user).
    let enabled = |id: &str| {
        settings
            .iter()
            .rev()
            .find_map(|s| s["enabledPlugins"][id].as_bool())
            .unwrap_or(false)
    };
    let mut out = Vec::new();
    let Some(plugins) = installed["plugins"].as_object() else {
        return out;
    };
    for (id, installs) in plugins {
        let name = id.split('@').next().unwrap_or(id).to_owned();
        if name.is_empty() || !enabled(id) {
            continue;
        }
        for i in installs.as_array().into_iter().flatten() {
            let scope = i["scope"].as_str().unwrap_or("user");
            let here = match i["projectPath"].as_str() {
                Some(p) if scope != "user" => roots.iter().any(|r| r == Path::new(p)),
                _ => true,
            };
            if let Some(root) = i["installPath"].as_str().filter(|_| here) {
                let root = PathBuf::from(root);
                if root.is_dir() && !out.iter().any(|p: &Plugin| p.name == name) {
                    out.push(Plugin {
                        name: name.clone(),
                        root,
                    });
                }
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

impl DirResolver {
    /// The standard search path for a working directory, after `extra` directories.
    pub fn standard(cwd: &Path, extra: &[PathBuf]) -> DirResolver {
        let mut dirs: Vec<PathBuf> = extra.iter().map(|d| absolute(cwd, d)).collect();
        let mut agent_dirs = Vec::new();
        for d in project_roots(cwd) {
            dirs.push(d.join(".flotilla").join("workflows"));
            dirs.push(d.join(".claude").join("workflows"));
            agent_dirs.push(d.join(".flotilla").join("agents"));
            agent_dirs.push(d.join(".claude").join("agents"));
        }
        let (flotilla_home, claude_home) = personal_homes();
        if let Some(f) = flotilla_home {
            dirs.push(f.join("workflows"));
        }
        if let Some(claude) = claude_home {
            dirs.push(claude.join("workflows"));
            agent_dirs.push(claude.join("agents"));
        }
        // A directory reached twice (a project in the home directory) is searched once.
        let mut seen = std::collections::HashSet::new();
        dirs.retain(|d| seen.insert(d.clone()));
        let mut seen = std::collections::HashSet::new();
        agent_dirs.retain(|d| seen.insert(d.clone()));
        let plugins = personal_homes()
            .1
            .map(|claude| installed_plugins(&claude, cwd))
            .unwrap_or_default();
        DirResolver {
            dirs,
            agent_dirs,
            plugins,
            cwd: cwd.to_path_buf(),
        }
    }

    /// The project or personal workflow called `name` (closest first; a `meta.name` match
    /// beats a file-name match), without the bundled ones.
    pub fn find_saved(&self, name: &str) -> Result<Option<FoundWorkflow>, WorkflowError> {
        let name = name.strip_prefix('/').unwrap_or(name);
        if name.contains(':') {
            return Ok(self.plugin_workflows().into_iter().find(|w| w.name == name));
        }
        if name.is_empty() || name.contains('/') || name.contains('\\') || name.contains("..") {
            return Err(WorkflowError::NotAName(name.to_owned()));
        }
        let mut by_stem = None;
        for (path, meta) in self.list() {
            let Ok(meta) = meta else { continue };
            if meta.name == name {
                return read_found(&path, meta.name).map(Some);
            }
            if by_stem.is_none() && path.file_stem().is_some_and(|s| s == name) {
                by_stem = Some((path, meta.name));
            }
        }
        match by_stem {
            Some((path, meta_name)) => read_found(&path, meta_name).map(Some),
            None => Ok(None),
        }
    }

    /// The plugins' workflows (`workflows/*.js` at a plugin's root), named `plugin:name`.
    pub fn plugin_workflows(&self) -> Vec<FoundWorkflow> {
        let mut out = Vec::new();
        for p in &self.plugins {
            for f in plugin_workflow_files(&p.root) {
                let Ok(source) =
                    crate::reads::read_file(&f, crate::reads::SCRIPT_BYTES, "workflow")
                else {
                    continue;
                };
                let Ok(meta) = text::read_meta(&source) else {
                    continue;
                };
                out.push(FoundWorkflow {
                    name: format!("{}:{}", p.name, meta.name),
                    source,
                    origin: f.display().to_string(),
                });
            }
        }
        out
    }

    /// Every `.js` file in the search path with its statically read meta (or why not).
    pub fn list(&self) -> Vec<(PathBuf, Result<text::Meta, Problem>)> {
        let mut out = Vec::new();
        for dir in &self.dirs {
            for f in files_in(dir, "js") {
                let meta = crate::reads::read_file(&f, crate::reads::SCRIPT_BYTES, "workflow")
                    .and_then(|s| text::read_meta(&s).map_err(|e| Problem::invalid(e.to_string())));
                out.push((f, meta));
            }
        }
        out
    }
}

/// The directories a project's saved workflows and agents are searched from: `cwd`, then each
/// parent up to and including the repository root (the first with `.git`), closest first.
pub fn project_roots(cwd: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dir = Some(cwd);
    while let Some(d) = dir {
        out.push(d.to_path_buf());
        if d.join(".git").exists() {
            break;
        }
        dir = d.parent();
    }
    out
}

/// The repository root holding `cwd` (the first directory up with `.git`), if any.
pub fn repo_root(cwd: &Path) -> Option<PathBuf> {
    project_roots(cwd).pop().filter(|d| d.join(".git").exists())
}

/// The user's own config directories: Flotilla's (`$XDG_CONFIG_HOME/flotilla`, else
/// `~/.config/flotilla`) and Claude Code's (`$CLAUDE_CONFIG_DIR`, else `~/.claude`).
pub fn personal_homes() -> (Option<PathBuf>, Option<PathBuf>) {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let flotilla = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| home.as_ref().map(|h| h.join(".config")))
        .map(|c| c.join("flotilla"));
    let claude = std::env::var_os("CLAUDE_CONFIG_DIR")
        .map(PathBuf::from)
        .or_else(|| home.map(|h| h.join(".claude")));
    (flotilla, claude)
}

/// Reads a Markdown agent definition: `name:`, `description:`, `model:` and `tools:` of its
/// front matter (the name falls back to the file stem), and the body as its system prompt.
fn agent_definition(path: &Path) -> Option<AgentType> {
    let text = crate::reads::read_file(path, crate::reads::SMALL_FILE_BYTES, "agent definition")
        .map_err(|e| tracing::warn!("{e}"))
        .ok()?;
    let mut t = AgentType::builtin("");
    let mut name = None;
    let mut body = text.as_str();
    if let Some(rest) = text
        .strip_prefix("---\n")
        .or_else(|| text.strip_prefix("---\r\n"))
    {
        let (front, after) = match rest.find("\n---") {
            Some(end) => {
                let after = &rest[end + 4..];
                (&rest[..end], after.split_once('\n').map_or("", |(_, b)| b))
            }
            None => (rest, ""),
        };
        body = after;
        for line in front.lines() {
            let line = line.trim();
            let value = |v: &str| {
                let v = v.trim().trim_matches(|c| c == '"' || c == '\'');
                (!v.is_empty()).then(|| v.to_owned())
            };
            if let Some(v) = line.strip_prefix("name:") {
                name = value(v);
            } else if let Some(v) = line.strip_prefix("model:") {
                t.model = value(v).filter(|m| m != "inherit");
            } else if let Some(v) = line.strip_prefix("description:") {
                t.description = value(v);
            } else if let Some(v) = line.strip_prefix("tools:") {
                t.tools = v
                    .trim()
                    .trim_matches(|c| c == '[' || c == ']')
                    .split(',')
                    .map(|x| x.trim().trim_matches(|c| c == '"' || c == '\'').to_owned())
                    .filter(|x| !x.is_empty())
                    .collect();
            }
        }
    }
    t.name = name.or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()))?;
    t.prompt = Some(body.trim().to_owned());
    Some(t)
}

/// The files of `dir` whose names end in `.ext`, sorted (none when it cannot be read).
fn files_in(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}

fn absolute(base: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

impl DirResolver {
    /// W10: a `scriptPath` is read only where the run may read scripts — the project (the
    /// repository holding the working directory, else that directory) and the workflow
    /// directories — with symlinks resolved first, and only if it is a plain file (never a
    /// device, a pipe or `/dev/stdin`). `called` names the reference in errors
    /// (`workflow({ scriptPath: "x" })`); they name paths and the rule, never what a file
    /// holds. `flotilla mcp` holds its `scriptPath` to the same.
    pub fn confine_script(&self, p: &str, called: &str) -> Result<PathBuf, WorkflowError> {
        let path = absolute(&self.cwd, Path::new(p));
        let real = path.canonicalize().map_err(|e| {
            WorkflowError::Unreadable(format!("{called}: cannot read {}: {e}", path.display()))
        })?;
        let meta = std::fs::metadata(&real).map_err(|e| {
            WorkflowError::Unreadable(format!("workflow script {}: {e}", real.display()))
        })?;
        if !meta.is_file() {
            use std::os::unix::fs::FileTypeExt;
            let t = meta.file_type();
            let what = if t.is_char_device() || t.is_block_device() {
                "a device"
            } else if t.is_dir() {
                "a directory"
            } else if t.is_fifo() || t.is_socket() {
                "a pipe or socket"
            } else {
                "not a plain file"
            };
            return Err(WorkflowError::Unreadable(format!(
                "{called} is {what} ({}), not a script; a workflow script is a .js file in the project or a workflow directory",
                real.display()
            )));
        }
        let project = repo_root(&self.cwd).unwrap_or_else(|| self.cwd.clone());
        let roots: Vec<PathBuf> = std::iter::once(project)
            .chain(self.dirs.iter().cloned())
            .filter_map(|d| d.canonicalize().ok())
            .collect();
        if roots.iter().any(|r| real.starts_with(r)) {
            return Ok(real);
        }
        Err(WorkflowError::Unreadable(format!(
            "{called} is {}, outside what this run may read scripts from ({}); copy it into the project or a workflow directory, or pass its directory with --workflows-dir",
            real.display(),
            roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )))
    }
}

impl DirResolver {
    /// A `scriptPath` read as [`DirResolver::confine_script`] allows, if it is a workflow
    /// script: a file that does not start with a literal meta is refused without a word of
    /// what it holds (the parser's error quotes the text it found, and the file could be
    /// `.env`), only where to see the parser's own error.
    pub fn read_script(&self, p: &str, called: &str) -> Result<FoundWorkflow, WorkflowError> {
        let path = self.confine_script(p, called)?;
        let source = crate::reads::read_file(&path, crate::reads::SCRIPT_BYTES, "workflow script")
            .map_err(|p| WorkflowError::Unreadable(p.into()))?;
        let meta = text::read_meta(&source).map_err(|e| {
            let at = e.line.map(|l| format!(" (line {l})")).unwrap_or_default();
            WorkflowError::Unreadable(format!(
                "{called} ({}) is not a workflow script: it must start with a literal `export const meta = {{ name, description }}`{at}; its text is not shown here (`flotilla run {}` names the parser's error)",
                path.display(),
                path.display()
            ))
        })?;
        Ok(FoundWorkflow {
            name: meta.name,
            source,
            origin: path.display().to_string(),
        })
    }
}

impl WorkflowResolver for DirResolver {
    fn agent_types(&self) -> Vec<AgentType> {
        let mut out = builtins();
        // Closest directory first: the first definition of a name wins.
        for dir in &self.agent_dirs {
            for path in files_in(dir, "md") {
                if let Some(t) = agent_definition(&path)
                    && !out.iter().any(|o| o.name == t.name)
                {
                    out.push(t);
                }
            }
        }
        // A plugin's agents, named after it (`ravenclaude-core:architect`).
        for p in &self.plugins {
            for path in files_in(&p.root.join("agents"), "md") {
                if let Some(mut t) = agent_definition(&path) {
                    t.name = format!("{}:{}", p.name, t.name);
                    if !out.iter().any(|o| o.name == t.name) {
                        out.push(t);
                    }
                }
            }
        }
        out
    }

    fn resolve(&self, reference: &WorkflowRef) -> Result<FoundWorkflow, WorkflowError> {
        match reference {
            WorkflowRef::Path(p) => {
                self.read_script(p, &format!("workflow({{ scriptPath: {p:?} }})"))
            }
            WorkflowRef::Name(name) => {
                let name = name.strip_prefix('/').unwrap_or(name);
                if let Some(found) = self.find_saved(name)? {
                    return Ok(found);
                }
                if let Some(found) = crate::bundled::find(name) {
                    return Ok(found);
                }
                Err(WorkflowError::Unknown {
                    name: name.to_owned(),
                    hint: format!(
                        "no saved workflow has that name (searched {}); \
                         save it in .flotilla/workflows/ or pass --workflows-dir",
                        self.dirs
                            .iter()
                            .map(|d| d.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })
            }
        }
    }
}

fn read_found(path: &Path, name: String) -> Result<FoundWorkflow, WorkflowError> {
    let source = crate::reads::read_file(path, crate::reads::SCRIPT_BYTES, "workflow script")
        .map_err(|p| WorkflowError::Unreadable(p.into()))?;
    Ok(FoundWorkflow {
        name,
        source,
        origin: path.display().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_path_is_read_only_from_the_project_and_the_workflow_dirs() {
        let top = tempfile::tempdir().unwrap();
        let project = top.path().join("project");
        let outside = top.path().join("elsewhere");
        std::fs::create_dir_all(project.join(".git")).unwrap();
        std::fs::create_dir_all(project.join("sub")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        let script = "export const meta = { name: 'x', description: 'd' };\nreturn 1;\n";
        std::fs::write(project.join("ok.js"), script).unwrap();
        std::fs::write(outside.join("secret.js"), script).unwrap();
        std::os::unix::fs::symlink(outside.join("secret.js"), project.join("link.js")).unwrap();
        let r = DirResolver::standard(&project.join("sub"), &[]);
        let read = |p: &str| r.resolve(&WorkflowRef::Path(p.into()));
        assert!(read("../ok.js").is_ok(), "{:?}", read("../ok.js"));
        for (p, says) in [
            ("/dev/stdin", "is a"),
            ("/dev/zero", "is a device"),
            ("..", "is a directory"),
            (
                "../../elsewhere/secret.js",
                "outside what this run may read",
            ),
            ("../link.js", "outside what this run may read"),
        ] {
            let e = read(p).expect_err(p).to_string();
            assert!(e.contains(says), "{p}: {e}");
        }
        // A file in reach that is not a workflow: refused without a word of what it holds.
        std::fs::write(project.join(".env"), "API_KEY_sk_live_123=abc\n").unwrap();
        let e = read("../.env").expect_err(".env").to_string();
        assert!(e.contains("is not a workflow script"), "{e}");
        assert!(!e.contains("API_KEY") && !e.contains("sk_live"), "{e}");
        // A workflow directory given with --workflows-dir may be read from.
        let r = DirResolver::standard(&project, std::slice::from_ref(&outside));
        assert!(
            r.resolve(&WorkflowRef::Path(
                outside.join("secret.js").display().to_string()
            ))
            .is_ok()
        );
    }

    fn write(dir: &Path, file: &str, name: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join(file),
            format!("export const meta = {{ name: '{name}', description: 'd' }};\nreturn 1;\n"),
        )
        .unwrap();
    }

    #[test]
    fn closest_directory_wins_and_meta_name_beats_file_stem() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir(root.join(".git")).unwrap();
        let sub = root.join("a/b");
        write(&root.join(".claude/workflows"), "x.js", "triage");
        write(&sub.join(".flotilla/workflows"), "y.js", "triage");
        write(
            &root.join(".flotilla/workflows"),
            "other.js",
            "named-differently",
        );
        let r = DirResolver {
            dirs: DirResolver::standard(&sub, &[]).dirs[..6].to_vec(),
            agent_dirs: Vec::new(),
            plugins: Vec::new(),
            cwd: sub.clone(),
        };
        let found = r.resolve(&WorkflowRef::Name("triage".into())).unwrap();
        assert!(
            found.origin.ends_with("a/b/.flotilla/workflows/y.js"),
            "{}",
            found.origin
        );
        let by_stem = r.resolve(&WorkflowRef::Name("other".into())).unwrap();
        assert_eq!(by_stem.name, "named-differently");
        let e = r.resolve(&WorkflowRef::Name("nope".into())).unwrap_err();
        assert!(e.to_string().contains("unknown workflow \"nope\""), "{e}");
        assert_eq!(e.kind(), flotilla_proto::ErrorKind::NotFound);
        assert!(r.resolve(&WorkflowRef::Name("../x".into())).is_err());
    }

    #[test]
    fn non_literal_meta_is_not_offered() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("wf");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("bad.js"),
            "export const meta = { name: x, description: 'd' };",
        )
        .unwrap();
        let r = DirResolver {
            dirs: vec![dir],
            agent_dirs: Vec::new(),
            plugins: Vec::new(),
            cwd: tmp.path().into(),
        };
        assert!(r.resolve(&WorkflowRef::Name("bad".into())).is_err());
        let listed = r.list();
        assert_eq!(listed.len(), 1);
        assert!(
            listed[0]
                .1
                .as_ref()
                .unwrap_err()
                .message
                .contains("variable reference")
        );
    }

    #[test]
    fn agent_types_are_the_builtins_plus_custom_definitions() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join(".claude/agents");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("sec.md"),
            "---\nname: security-reviewer\ndescription: Finds holes\nmodel: opus\ntools: Read, Grep\n---\nYou review for security.\n",
        )
        .unwrap();
        std::fs::write(dir.join("plain.md"), "no front matter").unwrap();
        let r = DirResolver {
            dirs: Vec::new(),
            agent_dirs: vec![dir],
            plugins: Vec::new(),
            cwd: tmp.path().into(),
        };
        let types = r.agent_types();
        for t in [
            "general-purpose",
            "Explore",
            "Plan",
            "security-reviewer",
            "plain",
        ] {
            assert!(types.iter().any(|a| a.name == t), "{types:?}");
        }
        let sec = types
            .iter()
            .find(|a| a.name == "security-reviewer")
            .unwrap();
        assert_eq!(sec.model.as_deref(), Some("opus"));
        let def: serde_json::Value = serde_json::from_str(&sec.definition_json().unwrap()).unwrap();
        assert_eq!(
            def,
            serde_json::json!({"description": "Finds holes", "prompt": "You review for security.",
                "tools": ["Read", "Grep"], "model": "opus"})
        );
        let plain = types.iter().find(|a| a.name == "plain").unwrap();
        assert_eq!(plain.prompt.as_deref(), Some("no front matter"));
        let builtin = types.iter().find(|a| a.name == "Explore").unwrap();
        assert_eq!(builtin.definition_json(), None);
    }

    #[test]
    fn references_are_read_from_prelude_json() {
        assert_eq!(
            WorkflowRef::from_json("\"a\"").unwrap(),
            WorkflowRef::Name("a".into())
        );
        assert_eq!(
            WorkflowRef::from_json(r#"{"scriptPath": "x.js"}"#).unwrap(),
            WorkflowRef::Path("x.js".into())
        );
        assert!(WorkflowRef::from_json("3").is_err());
    }

    #[test]
    fn a_plugin_manifest_s_workflows_field_replaces_the_default_scan_and_stays_in_the_plugin() {
        let top = tempfile::tempdir().unwrap();
        let root = top.path().join("plugin");
        let wf = |name: &str| {
            format!("export const meta = {{ name: '{name}', description: 'd' }};\nreturn 1;\n")
        };
        for (file, name) in [
            ("workflows/scanned.js", "scanned"),
            ("flows/a.js", "a"),
            ("flows/b.js", "b"),
            ("extra/one.js", "one"),
            ("../outside.js", "outside"),
        ] {
            let path = root.join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, wf(name)).unwrap();
        }
        std::os::unix::fs::symlink(top.path().join("outside.js"), root.join("flows/link.js"))
            .unwrap();
        let resolver = |manifest: Option<&str>| {
            let dir = root.join(".claude-plugin");
            std::fs::create_dir_all(&dir).unwrap();
            match manifest {
                Some(m) => std::fs::write(dir.join("plugin.json"), m).unwrap(),
                None => {
                    let _ = std::fs::remove_file(dir.join("plugin.json"));
                }
            }
            let r = DirResolver {
                dirs: Vec::new(),
                agent_dirs: Vec::new(),
                plugins: vec![Plugin {
                    name: "p".into(),
                    root: root.clone(),
                }],
                cwd: top.path().to_path_buf(),
            };
            let mut names: Vec<String> = r.plugin_workflows().into_iter().map(|w| w.name).collect();
            names.sort();
            names
        };
        assert_eq!(resolver(None), ["p:scanned"]);
        assert_eq!(
            resolver(Some(
                r#"{"name":"p","workflows":["./flows","./extra/one.js","../outside.js","./missing"]}"#
            )),
            ["p:a", "p:b", "p:one"]
        );
        assert_eq!(
            resolver(Some(r#"{"name":"p","workflows":"./extra/one.js"}"#)),
            ["p:one"]
        );
        // A manifest without the field keeps the default scan.
        assert_eq!(resolver(Some(r#"{"name":"p"}"#)), ["p:scanned"]);
    }
}
