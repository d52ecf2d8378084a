//! Copy-on-write workspaces (issue 32): an attempt's checkout is a view, not a copy.
//!
//! A worker keeps one read-only tree per (namespace, commit) it serves
//! (`.flotilla/trees/NAMESPACE/REPO/COMMIT` under its workspace root: the files and a `.git`
//! that borrows the cache's objects), made once. A call's checkout is kernel overlayfs over
//! that tree, with the call's writes in an upper directory of its own (`{run}/{call}.upper`,
//! beside the mount point `{run}/{call}` and overlayfs' scratch `{run}/{call}.work`). Making
//! one is three empty directories, whatever the size of the repository; its disk is what its
//! attempts write; a retry on the same worker mounts the same upper directory (W58).
//!
//! Nothing is mounted in the worker's own namespace: every process that works in a checkout
//! (the agent, the worker's git on it) is started through `flotilla workspace-mount`, which
//! enters a user and mount namespace of its own (the worker's uid and gid mapped to
//! themselves), mounts the view at the checkout's path, and `exec`s the rest: bubblewrap for
//! a sandboxed agent, which binds that path as it would bind a full checkout. The view goes
//! with the last process in that namespace. The tree is only ever a lower layer: no process
//! writes it through a view, and no sandbox shows its path.
//!
//! Where overlayfs is refused (no user namespaces, an old kernel, a filesystem that cannot
//! hold an upper directory), [`Layers::probe`] says why and the worker makes full checkouts.

use flotilla_proto::Problem;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Printed (with the reason) by `flotilla workspace-mount` when it cannot make the view; it
/// then exits with [`MOUNT_FAILED`].
pub const MOUNT_FAILED_PREFIX: &str = "flotilla workspace: ";
/// The exit status of a `workspace-mount` that could not make the view.
pub const MOUNT_FAILED: i32 = 125;

/// Copy-on-write views, made by the flotilla binary at `bin` (checked by [`Layers::probe`]).
#[derive(Debug, Clone)]
pub struct Layers {
    bin: PathBuf,
}

/// One call's view: `lower` (a shared tree) under `upper` (the call's writes), at `at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    pub lower: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub at: PathBuf,
    bin: PathBuf,
    /// Holds the shared tree while the view is in use (see `Sources::sweep_trees`).
    hold: Option<std::sync::Arc<()>>,
}

/// What `flotilla workspace-mount` is told.
#[derive(Debug, Clone, Default)]
pub struct MountArgs {
    pub lower: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub at: PathBuf,
    /// Where the program starts, relative to `at`: created in the view if missing, never
    /// through a link out of it.
    pub cwd: Option<String>,
    /// Only check that a view works (see [`Layers::probe`]).
    pub probe: bool,
    pub program: Vec<OsString>,
}

impl Layers {
    /// Copy-on-write views made by `bin` (the flotilla binary), if they work for a workspace
    /// at `root`: a view is mounted over a small tree under `root` and written through (a new
    /// file, a deleted one, a directory replaced), and the upper directory must hold exactly
    /// that. `Err` says why they do not.
    pub fn probe(bin: &Path, root: &Path) -> Result<Layers, Problem> {
        let refused = |why: String| Problem::unavailable(why);
        let base = root.join(".flotilla");
        std::fs::create_dir_all(&base)
            .map_err(|e| refused(format!("cannot make {}: {e}", base.display())))?;
        let dir = tempfile::Builder::new()
            .prefix("probe-")
            .tempdir_in(&base)
            .map_err(|e| {
                refused(format!(
                    "cannot make a directory in {}: {e}",
                    base.display()
                ))
            })?;
        let layers = Layers {
            bin: bin.to_owned(),
        };
        let view = layers.view(&dir.path().join("lower"), &dir.path().join("at"));
        for d in [&view.lower.join("d"), &view.upper, &view.work, &view.at] {
            std::fs::create_dir_all(d)
                .map_err(|e| refused(format!("cannot make {}: {e}", d.display())))?;
        }
        for (f, body) in [("gone", "x"), ("d/old", "y")] {
            std::fs::write(view.lower.join(f), body)
                .map_err(|e| refused(format!("cannot write the probe's tree: {e}")))?;
        }
        let out = std::process::Command::new(bin)
            .args(view.args(None))
            .arg("--probe")
            .arg("--")
            .arg("true")
            .output()
            .map_err(|e| refused(format!("cannot run {}: {e}", bin.display())))?;
        if !out.status.success() {
            let said = String::from_utf8_lossy(&out.stderr);
            let said = said.trim();
            let said = said.strip_prefix(MOUNT_FAILED_PREFIX).unwrap_or(said);
            return Err(refused(format!("overlayfs is refused here: {said}")));
        }
        let wrote = written(&view.upper);
        let mut want = vec![
            Written::Dir("d".into(), true),
            Written::File("d/new".into()),
            Written::Gone("gone".into()),
            Written::File("new".into()),
        ];
        want.sort();
        if wrote != want {
            return Err(refused(format!(
                "overlayfs' upper directory does not hold what was written through it (it holds {wrote:?})"
            )));
        }
        let lower_kept = std::fs::read_to_string(view.lower.join("gone")).is_ok_and(|s| s == "x")
            && std::fs::read_to_string(view.lower.join("d/old")).is_ok_and(|s| s == "y");
        if !lower_kept {
            return Err(refused(
                "writing through overlayfs changed its lower directory".into(),
            ));
        }
        Ok(layers)
    }

    /// The view of `lower` at `at` (a call's checkout path): its writes beside it.
    pub fn view(&self, lower: &Path, at: &Path) -> View {
        View {
            lower: lower.to_owned(),
            upper: at.with_extension(crate::workspace::VIEW_BESIDE[0]),
            work: at.with_extension(crate::workspace::VIEW_BESIDE[1]),
            at: at.to_owned(),
            bin: self.bin.clone(),
            hold: None,
        }
    }
}

impl View {
    /// This view, holding its tree with `hold` (no sweep removes a tree held).
    pub fn holding(mut self, hold: std::sync::Arc<()>) -> View {
        self.hold = Some(hold);
        self
    }

    /// The arguments of `flotilla workspace-mount` for this view (what follows the binary).
    fn args(&self, cwd: Option<&str>) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec!["workspace-mount".into()];
        for (flag, p) in [
            ("--lower", &self.lower),
            ("--upper", &self.upper),
            ("--work", &self.work),
            ("--at", &self.at),
        ] {
            a.push(flag.into());
            a.push(p.clone().into_os_string());
        }
        if let Some(cwd) = cwd.filter(|c| !c.is_empty()) {
            a.push("--cwd".into());
            a.push(cwd.into());
        }
        a
    }

    /// A command prefix that runs the rest in this view, starting in `cwd` inside it.
    pub fn prefix(&self, cwd: Option<&str>) -> Vec<OsString> {
        let mut p = vec![self.bin.clone().into_os_string()];
        p.extend(self.args(cwd));
        p.push("--".into());
        p
    }

    /// Makes the directories of a new view (an empty upper directory) or finds those of an
    /// earlier attempt of the call; `true` when the upper directory was there already.
    pub fn make(&self) -> Result<bool, Problem> {
        let had = std::fs::symlink_metadata(&self.upper).is_ok_and(|m| m.is_dir());
        for d in [&self.upper, &self.work, &self.at] {
            crate::workspace::make_dirs(d)
                .map_err(|e| Problem::internal(format!("cannot make {}: {e}", d.display())))?;
        }
        Ok(had)
    }

    /// Whether the call's writes hold anything but git's own files (`.git` at the top): a
    /// file, a link, a deletion or a directory.
    pub fn wrote_files(&self) -> bool {
        std::fs::read_dir(&self.upper).is_ok_and(|d| d.flatten().any(|e| e.file_name() != ".git"))
    }

    /// `rel` in the view as it stands, found from outside without mounting it: the upper
    /// directory's entry when there is one (nothing if that is a deletion), else the tree's.
    /// For files of the checkout's `.git` the worker wrote (an index), not for what an agent
    /// may have replaced a directory with.
    pub fn host_file(&self, rel: &Path) -> Option<PathBuf> {
        let up = self.upper.join(rel);
        match std::fs::symlink_metadata(&up) {
            Ok(m) if is_whiteout(&m) => None,
            Ok(_) => Some(up),
            Err(_) => {
                let low = self.lower.join(rel);
                low.exists().then_some(low)
            }
        }
    }

    /// The paths the agent wrote through the view, for the worker's git to look at those
    /// only: files, links, deletions, and directories that replaced the tree's (whatever is
    /// beneath them); not the checkout's own `.git`. `None` past `most` paths, for a name
    /// that is not UTF-8, for what cannot be read, or when the agent made a repository
    /// inside the checkout: git looks at the whole checkout then.
    pub fn touched(&self, most: usize) -> Option<Vec<String>> {
        let mut out = Vec::new();
        let mut todo = vec![(self.upper.clone(), String::new())];
        while let Some((dir, rel)) = todo.pop() {
            for e in std::fs::read_dir(&dir).ok()? {
                let e = e.ok()?;
                let name = e.file_name().into_string().ok()?;
                if name == ".git" {
                    if rel.is_empty() {
                        continue;
                    }
                    return None;
                }
                let path = if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                };
                if e.file_type().ok()?.is_dir() && !is_opaque(&e.path()) {
                    todo.push((e.path(), path));
                } else if out.len() == most {
                    return None;
                } else {
                    out.push(path);
                }
            }
        }
        Some(out)
    }

    /// Removes the view's directories (the mount point, the writes, overlayfs' scratch).
    pub fn remove(&self) {
        for d in [&self.at, &self.upper, &self.work] {
            crate::workspace::remove_tree(d);
        }
    }
}

/// One entry of an upper directory, by its path in the view.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Written {
    /// A directory: `true` when it replaced the tree's (opaque), else the tree's shows
    /// through where it wrote nothing.
    Dir(String, bool),
    /// A regular file or a symlink, written whole.
    File(String),
    /// A deletion (a whiteout).
    Gone(String),
}

/// Whether `m` is an overlayfs whiteout: a character device 0:0.
fn is_whiteout(m: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    m.file_type().is_char_device() && m.rdev() == 0
}

/// Whether the directory at `p` replaced the lower one (`user.overlay.opaque` is `y`).
fn is_opaque(p: &Path) -> bool {
    let mut buf = [0u8; 8];
    rustix::fs::lgetxattr(p, "user.overlay.opaque", &mut buf).is_ok_and(|n| &buf[..n] == b"y")
}

/// What an upper directory holds, sorted by path: what was written through the view.
pub fn written(upper: &Path) -> Vec<Written> {
    let mut out = Vec::new();
    let mut todo = vec![(upper.to_owned(), String::new())];
    while let Some((dir, rel)) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let Ok(m) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if m.is_dir() {
                out.push(Written::Dir(path.clone(), is_opaque(&e.path())));
                todo.push((e.path(), path));
            } else if is_whiteout(&m) {
                out.push(Written::Gone(path));
            } else {
                out.push(Written::File(path));
            }
        }
    }
    out.sort();
    out
}

/// In `flotilla workspace-mount`, before any thread starts: enters a user and mount namespace
/// of its own, mounts the view, starts in `cwd` in it, and `exec`s the program. Returns only
/// when something failed (the status to exit with, the reason printed), or after a probe.
pub fn mount_and_exec(m: &MountArgs) -> i32 {
    if let Err(e) = enter(m) {
        eprintln!("{MOUNT_FAILED_PREFIX}cannot mount the workspace view: {e}");
        return MOUNT_FAILED;
    }
    if m.probe {
        return match probe_writes(&m.at) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("{MOUNT_FAILED_PREFIX}cannot write through the view: {e}");
                MOUNT_FAILED
            }
        };
    }
    // The process started in the mount point as it was before the view (or anywhere): it
    // starts again in the view.
    let start = match &m.cwd {
        Some(cwd) => crate::workspace::confine(&m.at, cwd),
        None => std::env::current_dir()
            .map_err(|e| Problem::internal(format!("cannot find the working directory: {e}"))),
    };
    if let Err(e) = start.and_then(|d| {
        std::env::set_current_dir(&d)
            .map_err(|e| Problem::internal(format!("cannot enter {}: {e}", d.display())))
    }) {
        eprintln!("{MOUNT_FAILED_PREFIX}{e}");
        return MOUNT_FAILED;
    }
    let Some((program, args)) = m.program.split_first() else {
        eprintln!("{MOUNT_FAILED_PREFIX}no program to run");
        return MOUNT_FAILED;
    };
    use std::os::unix::process::CommandExt;
    let e = std::process::Command::new(program).args(args).exec();
    eprintln!(
        "{MOUNT_FAILED_PREFIX}cannot start {}: {e}",
        Path::new(program).display()
    );
    127
}

/// What [`Layers::probe`] writes through its view.
fn probe_writes(at: &Path) -> Result<(), std::io::Error> {
    std::fs::write(at.join("new"), "n")?;
    std::fs::remove_file(at.join("gone"))?;
    std::fs::remove_dir_all(at.join("d"))?;
    std::fs::create_dir(at.join("d"))?;
    std::fs::write(at.join("d/new"), "n")
}

/// A path overlayfs can take in its options: no separator or escape of them.
fn plain_path(p: &Path) -> Result<&str, Problem> {
    p.to_str()
        .filter(|s| s.starts_with('/') && !s.contains([',', ':', '\\', '=']))
        .ok_or_else(|| {
            Problem::invalid(format!(
                "{} cannot be a layer (an absolute path without ',', ':', '\\' or '='); move the workspace root",
                p.display()
            ))
        })
}

fn enter(m: &MountArgs) -> Result<(), Problem> {
    use nix::mount::{MsFlags, mount};
    use nix::sched::{CloneFlags, unshare};
    let opts = format!(
        "lowerdir={},upperdir={},workdir={},userxattr,volatile",
        plain_path(&m.lower)?,
        plain_path(&m.upper)?,
        plain_path(&m.work)?
    );
    let (uid, gid) = (nix::unistd::geteuid(), nix::unistd::getegid());
    unshare(CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWNS).map_err(|e| {
        Problem::unavailable(format!(
            "cannot make a user and mount namespace ({e}); user namespaces may be off"
        ))
    })?;
    let write = |file: &str, body: String| {
        std::fs::write(file, body)
            .map_err(|e| Problem::unavailable(format!("cannot write {file}: {e}")))
    };
    write("/proc/self/setgroups", "deny".into())?;
    write("/proc/self/uid_map", format!("{uid} {uid} 1"))?;
    write("/proc/self/gid_map", format!("{gid} {gid} 1"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| Problem::unavailable(format!("cannot make the mounts private: {e}")))?;
    // `volatile`: nothing syncs the worker's whole disk when the view goes (overlayfs
    // would at every unmount); the marker a volatile view leaves in its scratch would refuse
    // the next view of the call's writes, so it goes first (what survives a crash of the
    // machine is a scratch checkout's business, not the disk's).
    let _ = std::fs::remove_dir_all(m.work.join("work").join("incompat").join("volatile"));
    mount(
        Some("flotilla"),
        &m.at,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(opts.as_str()),
    )
    .map_err(|e| Problem::unavailable(format!("overlayfs at {}: {e}", m.at.display())))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_layer_must_be_an_absolute_path_overlayfs_can_name() {
        assert!(plain_path(Path::new("/srv/ws/.flotilla/trees/default/r/abc")).is_ok());
        for bad in ["ws/trees", "/srv/a,b", "/srv/a:b", "/srv/a\\b", "/srv/a=b"] {
            let e = plain_path(Path::new(bad)).unwrap_err();
            assert!(
                e.to_string().contains("move the workspace root"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_view_s_files_are_found_in_its_writes_first_then_in_its_tree() {
        let dir = tempfile::tempdir().unwrap();
        let layers = Layers {
            bin: "/usr/bin/flotilla".into(),
        };
        let view = layers.view(&dir.path().join("tree"), &dir.path().join("run/7"));
        assert_eq!(view.upper, dir.path().join("run/7.upper"));
        assert_eq!(view.work, dir.path().join("run/7.work"));
        assert!(!view.make().unwrap(), "a new view has no writes");
        assert!(view.make().unwrap(), "a second attempt finds the first's");
        std::fs::create_dir_all(view.lower.join(".git")).unwrap();
        std::fs::write(view.lower.join(".git/index"), "tree's").unwrap();
        let index = Path::new(".git/index");
        assert_eq!(view.host_file(index), Some(view.lower.join(index)));
        assert!(!view.wrote_files());
        std::fs::create_dir_all(view.upper.join(".git")).unwrap();
        std::fs::write(view.upper.join(".git/index"), "agent's").unwrap();
        assert_eq!(view.host_file(index), Some(view.upper.join(index)));
        assert!(!view.wrote_files(), "git's own files are no change");
        std::fs::write(view.upper.join("new.txt"), "x").unwrap();
        assert!(view.wrote_files());
        assert_eq!(view.host_file(Path::new("missing")), None);
        // The command names the view, then the program follows `--`.
        let p = view.prefix(Some("sub"));
        assert_eq!(p[0], "/usr/bin/flotilla");
        assert_eq!(p[1], "workspace-mount");
        assert_eq!(p.last().unwrap(), "--");
        assert!(p.windows(2).any(|w| w[0] == "--cwd" && w[1] == "sub"));
        view.remove();
        assert!(!view.upper.exists() && !view.at.exists() && !view.work.exists());
    }

    #[test]
    fn what_an_agent_touched_is_read_from_its_writes_and_the_whole_checkout_when_unsure() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let layers = Layers {
            bin: "/usr/bin/flotilla".into(),
        };
        let view = layers.view(&dir.path().join("tree"), &dir.path().join("run/7"));
        view.make().unwrap();
        let up = &view.upper;
        assert_eq!(view.touched(10), Some(Vec::new()));
        std::fs::create_dir_all(up.join(".git")).unwrap();
        std::fs::write(up.join(".git/index"), "git's").unwrap();
        std::fs::create_dir_all(up.join("src/deep")).unwrap();
        std::fs::write(up.join("src/deep/a.rs"), "a").unwrap();
        std::os::unix::fs::symlink("a.rs", up.join("src/link")).unwrap();
        // A directory that replaced the tree's stands for all beneath it.
        std::fs::create_dir_all(up.join("redone/inner")).unwrap();
        std::fs::write(up.join("redone/inner/x"), "x").unwrap();
        rustix::fs::lsetxattr(
            up.join("redone"),
            "user.overlay.opaque",
            b"y",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        let mut touched = view.touched(10).unwrap();
        touched.sort();
        assert_eq!(touched, ["redone", "src/deep/a.rs", "src/link"]);
        assert_eq!(view.touched(2), None, "past the most, the whole checkout");
        // A repository the agent made inside: the whole checkout.
        std::fs::create_dir_all(up.join("src/.git")).unwrap();
        assert_eq!(view.touched(10), None);
        std::fs::remove_dir(up.join("src/.git")).unwrap();
        // A name git would be given mangled: the whole checkout.
        let odd = std::ffi::OsStr::from_bytes(b"bad\xff");
        std::fs::write(up.join(odd), "?").unwrap();
        assert_eq!(view.touched(10), None);
    }
}
