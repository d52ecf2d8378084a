//! Contexts: named coordinators with the identity that reaches each (`flotilla context`), kept
//! in `contexts.toml` under the user's config directory (`FLOTILLA_CONTEXTS` names another
//! file). A client command given no coordinator (no `--coordinator`, `FLOTILLA_COORDINATOR`
//! or `coordinator` in `--config`) uses the current context — `FLOTILLA_CONTEXT` picks
//! another — with its TLS identity where the flags name none. `flotilla dev` writes one,
//! `dev`, and makes it current.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use flotilla_proto::Problem;
use serde::{Deserialize, Serialize};

/// One coordinator and how to reach it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Context {
    pub coordinator: String,
    /// The directory with `ca.crt` and the identity's `NAME.crt`/`NAME.key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_dir: Option<PathBuf>,
    /// The identity in `tls_dir` [default: client].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Plain text (a loopback coordinator started `--insecure`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
}

/// The contexts file.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Contexts {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<String>,
    #[serde(default)]
    pub contexts: BTreeMap<String, Context>,
}

/// Where the contexts are kept.
pub fn path() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOTILLA_CONTEXTS") {
        return PathBuf::from(p);
    }
    dirs::config_dir()
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(std::env::temp_dir)
        .join("flotilla")
        .join("contexts.toml")
}

impl Contexts {
    /// The contexts file (none yet: no context).
    pub fn load() -> Result<Contexts, Problem> {
        let p = path();
        match std::fs::read_to_string(&p) {
            Ok(text) => toml::from_str(&text).map_err(|e| {
                Problem::invalid(format!(
                    "the contexts file {} is invalid: {e} (fix it, or remove it and add the contexts again)",
                    p.display()
                ))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Contexts::default()),
            Err(e) => Err(Problem::unavailable(format!(
                "cannot read the contexts file {}: {e}",
                p.display()
            ))),
        }
    }

    /// Writes the file whole (a new file moved into place), readable by its owner only.
    pub fn save(&self) -> Result<(), Problem> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let p = path();
        let fail = |e: std::io::Error| {
            Problem::unavailable(format!(
                "cannot write the contexts file {}: {e}",
                p.display()
            ))
        };
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir).map_err(fail)?;
        }
        let text = toml::to_string(self).map_err(|e| Problem::internal(e.to_string()))?;
        let tmp = p.with_extension(format!("toml.{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(fail)?;
        f.write_all(text.as_bytes()).map_err(fail)?;
        f.sync_all().map_err(fail)?;
        std::fs::rename(&tmp, &p).map_err(fail)
    }

    /// The context client commands use: `FLOTILLA_CONTEXT`'s, else the current one.
    pub fn chosen(&self) -> Result<Option<(String, Context)>, Problem> {
        let name = match std::env::var("FLOTILLA_CONTEXT") {
            Ok(n) if !n.is_empty() => n,
            _ => match &self.current {
                Some(n) => n.clone(),
                None => return Ok(None),
            },
        };
        match self.contexts.get(&name) {
            Some(c) => Ok(Some((name, c.clone()))),
            None => Err(Problem::invalid(format!(
                "no context {name:?} (contexts: {}); `flotilla context list` shows them",
                self.names()
            ))),
        }
    }

    fn names(&self) -> String {
        if self.contexts.is_empty() {
            "none".to_owned()
        } else {
            self.contexts.keys().cloned().collect::<Vec<_>>().join(", ")
        }
    }
}

/// Saves `ctx` as `name` and makes it current (`flotilla dev`, `context add --use`).
pub fn add(name: &str, ctx: Context, make_current: bool) -> Result<(), Problem> {
    check_name(name)?;
    let mut all = Contexts::load()?;
    all.contexts.insert(name.to_owned(), ctx);
    if make_current {
        all.current = Some(name.to_owned());
    }
    all.save()
}

fn check_name(name: &str) -> Result<(), Problem> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Problem::invalid(format!(
            "context name {name:?}: use up to 64 letters, digits, '-', '_' or '.'"
        )))
    }
}

#[derive(Debug, Args)]
pub struct ContextArgs {
    #[command(subcommand)]
    what: Option<ContextCommand>,
}

#[derive(Debug, Subcommand)]
enum ContextCommand {
    /// List the contexts (the current one marked `*`).
    List,
    /// Make NAME the current context.
    Use { name: String },
    /// Save a context: a coordinator and the identity that reaches it.
    Add {
        name: String,
        /// Coordinator address (https://host:port).
        #[arg(long)]
        coordinator: String,
        /// Directory with ca.crt and NAME.crt/NAME.key (from `flotilla certs`).
        #[arg(long, value_name = "DIR")]
        tls_dir: Option<PathBuf>,
        /// Which identity in --tls-dir [default: client].
        #[arg(long = "name")]
        identity: Option<String>,
        /// Plain text (a loopback coordinator started --insecure).
        #[arg(long)]
        insecure: bool,
        /// Make it the current context too.
        #[arg(long = "use")]
        make_current: bool,
    },
    /// Remove a context (no context is current after removing the current one).
    Remove { name: String },
    /// Print the current context's name.
    Current,
}

/// `flotilla context ...`; the exit status.
pub fn run(a: ContextArgs) -> i32 {
    match act(a.what.unwrap_or(ContextCommand::List)) {
        Ok(()) => 0,
        Err(e) => crate::refuse(e),
    }
}

fn act(what: ContextCommand) -> Result<(), Problem> {
    match what {
        ContextCommand::List => {
            let all = Contexts::load()?;
            if all.contexts.is_empty() {
                eprintln!(
                    "no context yet: `flotilla dev` writes one, or `flotilla context add NAME --coordinator URL --tls-dir DIR --use`"
                );
            }
            for (name, c) in &all.contexts {
                let mark = if all.current.as_deref() == Some(name) {
                    "*"
                } else {
                    " "
                };
                let who = match (&c.tls_dir, c.insecure) {
                    (_, true) => "insecure".to_owned(),
                    (Some(d), _) => format!(
                        "{} in {}",
                        c.name.as_deref().unwrap_or("client"),
                        d.display()
                    ),
                    (None, _) => "no identity".to_owned(),
                };
                println!("{mark} {name}\t{}\t{who}", c.coordinator);
            }
            Ok(())
        }
        ContextCommand::Use { name } => {
            let mut all = Contexts::load()?;
            if !all.contexts.contains_key(&name) {
                return Err(Problem::not_found(format!(
                    "no context {name:?} (contexts: {}); add it with `flotilla context add {name} --coordinator URL --tls-dir DIR`",
                    all.names()
                )));
            }
            all.current = Some(name.clone());
            all.save()?;
            eprintln!("context {name} is current");
            Ok(())
        }
        ContextCommand::Add {
            name,
            coordinator,
            tls_dir,
            identity,
            insecure,
            make_current,
        } => {
            if !coordinator.starts_with("https://") && !coordinator.starts_with("http://") {
                return Err(Problem::invalid(format!(
                    "--coordinator {coordinator:?}: give its address as https://host:port"
                )));
            }
            if tls_dir.is_none() && !insecure {
                return Err(Problem::invalid(
                    "say how to reach it: --tls-dir DIR (from `flotilla certs`), or --insecure for a loopback coordinator",
                ));
            }
            let tls_dir = match tls_dir {
                Some(d) => Some(
                    std::path::absolute(&d)
                        .map_err(|e| Problem::invalid(format!("--tls-dir {}: {e}", d.display())))?,
                ),
                None => None,
            };
            let ctx = Context {
                coordinator,
                tls_dir,
                name: identity,
                insecure,
            };
            add(&name, ctx, make_current)?;
            eprintln!(
                "context {name} saved{}",
                if make_current { " and current" } else { "" }
            );
            Ok(())
        }
        ContextCommand::Remove { name } => {
            let mut all = Contexts::load()?;
            if all.contexts.remove(&name).is_none() {
                return Err(Problem::not_found(format!("no context {name:?}")));
            }
            if all.current.as_deref() == Some(name.as_str()) {
                all.current = None;
            }
            all.save()
        }
        ContextCommand::Current => match Contexts::load()?.chosen()? {
            Some((name, _)) => {
                println!("{name}");
                Ok(())
            }
            None => Err(Problem::not_found(
                "no current context: `flotilla context use NAME`",
            )),
        },
    }
}
