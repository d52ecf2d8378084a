//! Working directories, confined to the worker's workspace root.
//!
//! A *shared* workspace (the embedded mode: the user's repository or directory) is where
//! every agent works, as Claude Code's agents work in the session's directory. Otherwise every
//! call gets a scratch directory `{root}/{run}/{call}`, removed after an attempt that left it
//! empty. A `cwd` must be a relative path that stays inside the root (no absolute paths, no
//! `..` that climbs out, no symlink that leads out). Attempts of one call share the directory:
//! files an earlier attempt wrote stay (W58).

use std::path::{Component, Path, PathBuf};

/// The root under which all agent working directories live.
#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
    shared: bool,
}

impl Workspace {
    /// Scratch directories per call under `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Workspace {
            root: root.into(),
            shared: false,
        }
    }

    /// Every agent works in `root` itself (or its `cwd` inside it).
    pub fn shared(root: impl Into<PathBuf>) -> Self {
        Workspace {
            root: root.into(),
            shared: true,
        }
    }

    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// After an attempt: a call's scratch directory that was left empty goes, and so does
    /// its run's directory once empty (nothing is left behind but what agents wrote).
    pub fn tidy(&self, run_id: &str, call: u64, cwd: &str) {
        if self.shared || !cwd.is_empty() || !is_plain_name(run_id) {
            return;
        }
        let run_dir = self.root.join(run_id);
        let _ = std::fs::remove_dir(run_dir.join(call.to_string()));
        let _ = std::fs::remove_dir(run_dir);
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The working directory of one call, created if missing.
    pub fn dir_for(&self, run_id: &str, call: u64, cwd: &str) -> Result<PathBuf, String> {
        let dir = if cwd.is_empty() && self.shared {
            self.root.clone()
        } else if cwd.is_empty() {
            if !is_plain_name(run_id) {
                return Err(format!("run id {run_id:?} cannot name a directory"));
            }
            self.root.join(run_id).join(call.to_string())
        } else {
            self.root.join(confined(cwd)?)
        };
        std::fs::create_dir_all(&self.root)
            .map_err(|e| format!("cannot create workspace root {}: {e}", self.root.display()))?;
        let root = self
            .root
            .canonicalize()
            .map_err(|e| format!("cannot resolve workspace root {}: {e}", self.root.display()))?;
        let outside = || {
            format!(
                "cwd {cwd:?} leads outside the worker's workspace root {} (through a symlink)",
                root.display()
            )
        };
        // Check the deepest part that already exists before creating anything, so a symlink
        // cannot make us create directories outside the root.
        let mut existing = dir.as_path();
        while !existing.exists() {
            existing = existing.parent().unwrap_or(&root);
        }
        let real_existing = existing
            .canonicalize()
            .map_err(|e| format!("cannot resolve {}: {e}", existing.display()))?;
        if !real_existing.starts_with(&root) {
            return Err(outside());
        }
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create working directory {}: {e}", dir.display()))?;
        let real = dir
            .canonicalize()
            .map_err(|e| format!("cannot resolve working directory {}: {e}", dir.display()))?;
        if !real.starts_with(&root) {
            return Err(outside());
        }
        Ok(real)
    }
}

fn is_plain_name(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Normalizes a relative `cwd` and refuses anything that leaves the root.
fn confined(cwd: &str) -> Result<PathBuf, String> {
    let path = Path::new(cwd);
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return Err(format!(
                        "cwd {cwd:?} climbs out of the agents' workspace; use a path inside it"
                    ));
                }
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(format!(
                    "cwd {cwd:?} is absolute; give a path relative to the agents' workspace (the repository root)"
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_call_directories_are_created_under_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = Workspace::new(tmp.path());
        let d = ws.dir_for("wf_1", 7, "").unwrap();
        assert!(d.is_dir());
        assert!(d.ends_with("wf_1/7"));
    }

    #[test]
    fn a_shared_workspace_is_every_agent_s_directory_and_scratch_ones_are_tidied() {
        let tmp = tempfile::tempdir().unwrap();
        let shared = Workspace::shared(tmp.path());
        assert_eq!(
            shared.dir_for("wf_1", 3, "").unwrap(),
            tmp.path().canonicalize().unwrap()
        );
        assert!(shared.dir_for("wf_1", 3, "src").unwrap().ends_with("src"));
        let scratch = Workspace::new(tmp.path());
        let d = scratch.dir_for("wf_2", 1, "").unwrap();
        let kept = scratch.dir_for("wf_2", 2, "").unwrap();
        std::fs::write(kept.join("out.txt"), "x").unwrap();
        scratch.tidy("wf_2", 1, "");
        assert!(!d.exists(), "an empty scratch directory goes");
        scratch.tidy("wf_2", 2, "");
        assert!(kept.join("out.txt").exists(), "what an agent wrote stays");
        std::fs::remove_dir_all(&kept).unwrap();
        scratch.tidy("wf_2", 2, "");
        assert!(!tmp.path().join("wf_2").exists());
    }

    #[test]
    fn cwd_must_stay_inside_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = Workspace::new(tmp.path());
        assert!(ws.dir_for("r", 1, "a/b/../c").unwrap().ends_with("a/c"));
        assert!(
            ws.dir_for("r", 1, "../x")
                .unwrap_err()
                .contains("climbs out")
        );
        assert!(ws.dir_for("r", 1, "/etc").unwrap_err().contains("absolute"));
        assert!(ws.dir_for("../..", 1, "").is_err());
    }

    #[test]
    fn symlinks_out_of_the_root_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), tmp.path().join("link")).unwrap();
        let ws = Workspace::new(tmp.path());
        assert!(
            ws.dir_for("r", 1, "link/sub")
                .unwrap_err()
                .contains("symlink")
        );
        assert!(
            !outside.path().join("sub").exists(),
            "nothing is created outside the root"
        );
    }
}
