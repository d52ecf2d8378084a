//! The launch plan and the approval prompt (W47–W48).
//!
//! Before `flotilla run` or `launch` starts anything it can print the plan: name, description,
//! where the script came from, its phases, the settings and limits, and a rough size read from
//! the script text. On a terminal it then asks: run it, don't ask again for this saved
//! workflow in this directory, view the script, or no. `--yes` skips the question, `--plan`
//! prints the plan and exits, and without a terminal nothing is asked (like `claude -p`).
//! "Don't ask again" is kept in the user's config directory (`flotilla/approvals.json`).

use flotilla_proto::Problem;
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};

use flotilla_local::workflows;
use flotilla_script::text::{self, Meta};
use serde_json::{Value, json};

use crate::config::ResolvedRun;

/// What the user decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Run,
    /// Print nothing more and exit with this status.
    Exit(i32),
}

/// Prints the plan and, on a terminal, asks whether to run.
pub fn gate(r: &ResolvedRun, yes: bool, plan_only: bool) -> Decision {
    let meta = text::read_meta(&r.source).ok();
    let interactive = std::io::stdin().is_terminal() && std::io::stderr().is_terminal();
    if plan_only {
        print!("{}", plan(r, meta.as_ref()));
        return Decision::Exit(0);
    }
    if yes || !interactive {
        return Decision::Run;
    }
    let dir = approval_dir(&r.cwd);
    if let Some(name) = &r.saved_name
        && approved(name, &dir)
    {
        return Decision::Run;
    }
    let mut err = std::io::stderr().lock();
    let _ = write!(err, "{}", plan(r, meta.as_ref()));
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        let always = r
            .saved_name
            .as_ref()
            .map(|n| {
                format!(
                    " / [a] yes, and don't ask again for {n} in {}",
                    dir.display()
                )
            })
            .unwrap_or_default();
        let _ = write!(
            err,
            "Run it? [y] yes{always} / [v] view the script / [n] no: "
        );
        let _ = err.flush();
        let Some(Ok(answer)) = lines.next() else {
            let _ = writeln!(err, "\nnot run: no answer");
            return Decision::Exit(1);
        };
        match answer.trim().to_ascii_lowercase().as_str() {
            "y" | "yes" => return Decision::Run,
            "a" | "always" if r.saved_name.is_some() => {
                let name = r.saved_name.as_deref().unwrap_or_default();
                if let Err(e) = remember(name, &dir) {
                    let _ = writeln!(err, "warning: cannot remember the approval: {e}");
                }
                return Decision::Run;
            }
            "v" | "view" => {
                let _ = writeln!(err, "----- {} -----\n{}\n-----", r.origin, r.source);
            }
            "n" | "no" | "" => {
                let _ = writeln!(err, "not run");
                return Decision::Exit(1);
            }
            other => {
                let _ = writeln!(err, "{other:?} is not an answer");
            }
        }
    }
}

use crate::term::clean;

/// The plan as text.
pub fn plan(r: &ResolvedRun, meta: Option<&Meta>) -> String {
    let s = &r.settings;
    let mut out = String::new();
    let (name, description) = meta
        .map(|m| (m.name.as_str(), m.description.as_str()))
        .unwrap_or(("(no valid meta)", ""));
    out.push_str(&format!(
        "Workflow {}: {}\n",
        clean(name),
        clean(description)
    ));
    out.push_str(&format!("  from      {}\n", clean(&r.origin)));
    if let Some(m) = meta
        && !m.phases.is_empty()
    {
        out.push_str("  phases\n");
        for (i, p) in m.phases.iter().enumerate() {
            let detail = p
                .detail
                .as_deref()
                .map(|d| format!(" — {}", clean(d)))
                .unwrap_or_default();
            out.push_str(&format!("    {}. {}{detail}\n", i + 1, clean(&p.title)));
        }
    }
    let model = if s.model.is_empty() {
        "the backend's default"
    } else {
        &s.model
    };
    let chosen = r
        .backend_chosen
        .as_deref()
        .map(|why| format!(" (chosen because {why}; --backend echo for a dry run)"))
        .unwrap_or_default();
    let backend = if s.backend.is_empty() {
        "chosen by the coordinator from its workers' (--backend to choose)"
    } else {
        &s.backend
    };
    out.push_str(&format!(
        "  settings  backend {backend}{chosen}, model {model}, {} agents at once, {} attempts each, stall after {} ms\n",
        s.concurrency, s.attempts, s.stall_timeout_ms
    ));
    let budget = match (s.budget_tokens, s.budget_usd) {
        (None, None) => "no budget".to_owned(),
        (Some(t), None) => format!("budget {t} output tokens"),
        (None, Some(d)) => format!("budget ${d:.2}"),
        (Some(t), Some(d)) => format!("budget {t} output tokens and ${d:.2}"),
    };
    out.push_str(&format!(
        "  limits    at most {} agents, {budget}\n",
        s.max_agents
    ));
    out.push_str(&format!(
        "  size      {}\n",
        size(&r.source, r.args.as_ref())
    ));
    if let Some(resume) = &r.resume {
        out.push_str(&format!(
            "  resume    from {resume}: its completed calls are not run again\n"
        ));
    }
    out
}

/// A rough size from the script text: `agent()` call sites, fan-outs, and the longest list in
/// `args` (the usual thing a fan-out goes over).
fn size(source: &str, args: Option<&Value>) -> String {
    let body = strip_comments(source);
    let sites = count_calls(&body, "agent");
    let fanouts = count_calls(&body, "parallel") + count_calls(&body, "pipeline");
    let loops = count_calls(&body, "for") + count_calls(&body, "while");
    let longest = args.map(longest_list).unwrap_or(0);
    let mut s = format!(
        "{sites} agent() call site{}",
        if sites == 1 { "" } else { "s" }
    );
    if fanouts + loops > 0 {
        s.push_str(&format!(
            ", {fanouts} parallel/pipeline fan-out{} and {loops} loop{}: the agent count depends on the data",
            if fanouts == 1 { "" } else { "s" },
            if loops == 1 { "" } else { "s" }
        ));
        if longest > 0 {
            s.push_str(&format!(" (the longest list in args has {longest} items)"));
        }
    } else {
        s.push_str(&format!(": about {sites} agents"));
    }
    s
}

fn longest_list(v: &Value) -> usize {
    match v {
        Value::Array(a) => a.len().max(a.iter().map(longest_list).max().unwrap_or(0)),
        Value::Object(o) => o.values().map(longest_list).max().unwrap_or(0),
        _ => 0,
    }
}

/// Drops `//` and `/* */` comments (strings are left as they are; this is an estimate).
fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut chars = src.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '/' && chars.peek() == Some(&'/') {
            for c in chars.by_ref() {
                if c == '\n' {
                    out.push('\n');
                    break;
                }
            }
        } else if c == '/' && chars.peek() == Some(&'*') {
            chars.next();
            let mut prev = ' ';
            for c in chars.by_ref() {
                if prev == '*' && c == '/' {
                    break;
                }
                prev = c;
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Occurrences of `name(` or `name (` not preceded by an identifier character or a dot.
fn count_calls(src: &str, name: &str) -> usize {
    let bytes = src.as_bytes();
    let mut n = 0;
    let mut at = 0;
    while let Some(i) = src[at..].find(name) {
        let start = at + i;
        let end = start + name.len();
        at = end;
        let before_ok = start == 0 || {
            let b = bytes[start - 1];
            !(b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b == b'.')
        };
        let rest = src[end..].trim_start_matches([' ', '\t']);
        if before_ok && rest.starts_with('(') {
            n += 1;
        }
    }
    n
}

/// The directory an approval is remembered for: the repository root, else the working dir.
fn approval_dir(cwd: &Path) -> PathBuf {
    workflows::repo_root(cwd).unwrap_or_else(|| cwd.to_path_buf())
}

fn approvals_file() -> Option<PathBuf> {
    workflows::personal_homes()
        .0
        .map(|f| f.join("approvals.json"))
}

fn approvals() -> Value {
    approvals_file()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| json!({"approved": []}))
}

fn approved(name: &str, dir: &Path) -> bool {
    let dir = dir.display().to_string();
    approvals()["approved"]
        .as_array()
        .is_some_and(|a| a.iter().any(|e| e["name"] == name && e["dir"] == dir))
}

fn remember(name: &str, dir: &Path) -> Result<(), Problem> {
    let path = approvals_file().ok_or(Problem::internal(
        "no HOME or XDG_CONFIG_HOME to keep it in",
    ))?;
    let mut all = approvals();
    if let Some(list) = all["approved"].as_array_mut() {
        list.push(json!({"name": name, "dir": dir.display().to_string()}));
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| Problem::internal(format!("{}: {e}", parent.display())))?;
    }
    let text = serde_json::to_string_pretty(&all).map_err(|e| Problem::internal(e.to_string()))?;
    // Written whole, then renamed, so a crash never leaves half a file.
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(|e| Problem::internal(format!("{}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, &path).map_err(|e| Problem::internal(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_estimate_counts_call_sites_not_comments_or_methods() {
        let src = "// agent('x')\nconst a = await agent('one');\nawait parallel(xs.map(x => () => agent(x)));\nobj.agent('no');\n";
        let s = size(
            src,
            Some(&json!({"files": [1, 2, 3], "n": {"deep": [1, 2, 3, 4]}})),
        );
        assert!(s.starts_with("2 agent() call sites"), "{s}");
        assert!(s.contains("1 parallel/pipeline fan-out"), "{s}");
        assert!(s.contains("4 items"), "{s}");
        assert_eq!(
            size("await agent('a');", None),
            "1 agent() call site: about 1 agents"
        );
    }
}
