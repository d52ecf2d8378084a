//! Working directories, confined to the worker's workspace root.
//!
//! A *shared* workspace (the embedded mode: the user's repository or directory) is where
//! every agent works, as Claude Code's agents work in the session's directory, and `cwd` is
//! relative to it. Otherwise every call gets a scratch directory `{root}/{run}/sXX/{call}` of
//! its own (`XX`: the call's number modulo 256 in hex, so the calls of a big run are made and
//! removed in 256 directories, not all in one whose lock every call takes), and `cwd` is
//! relative to *that*: an agent's directory is always inside its own call's
//! directory, never the workspace root, another call's directory or a cache. A `cwd` must be
//! a relative path that stays inside its base (no absolute paths, no `..` that climbs out, no
//! symlink that leads out). Attempts of one call share the directory: files an earlier attempt
//! wrote stay for a retry (W58); the directory goes when the call ends ([`Workspace::remove`]).

use flotilla_proto::Problem;
use std::path::{Component, Path, PathBuf};

/// Beside a call's directory `{call}` when its checkout is a copy-on-write view
/// ([`crate::layers`]): the call's writes (`{call}.upper`) and overlayfs' scratch
/// (`{call}.work`).
pub const VIEW_BESIDE: [&str; 2] = ["upper", "work"];

/// How many directories the calls of one run are spread over on a worker.
const SHARDS: u64 = 256;

/// The directory of a run's directory that call `call`'s entries are in (`sXX`).
fn shard(call: u64) -> String {
    format!("s{:02x}", call % SHARDS)
}

/// Whether `name` (in a run's directory) is one of its shards.
fn is_shard(name: &str) -> bool {
    name.len() == 3
        && name.starts_with('s')
        && name[1..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// `create_dir_all`, again when a directory on the way went meanwhile: a call of the same run
/// that ended here removes its shard's and its run's directories once empty, and may do so
/// between the making of a parent and of its child.
pub fn make_dirs(dir: &Path) -> std::io::Result<()> {
    let mut tries = 0;
    loop {
        match std::fs::create_dir_all(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < 8 => tries += 1,
            r => return r,
        }
    }
}

/// After a call's `dir` went: the directories above it go too once empty, its shard's and
/// then its run's (an entry made in one meanwhile keeps it).
pub fn prune_above(dir: &Path) {
    let mut up = dir.parent();
    for _ in 0..2 {
        match up {
            Some(d) if std::fs::remove_dir(d).is_ok() => up = d.parent(),
            _ => return,
        }
    }
}

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

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of one call (`{root}/{run}/sXX/{call}`), not created; `None` for a
    /// shared workspace (the user's own) or a run id that cannot name a directory.
    pub fn call_dir(&self, run_id: &str, call: u64) -> Option<PathBuf> {
        (!self.shared && is_plain_name(run_id)).then(|| {
            self.root
                .join(run_id)
                .join(shard(call))
                .join(call.to_string())
        })
    }

    /// After a call's last attempt here: its directory goes with whatever the agent left in it
    /// (nothing of a scratch directory is kept: a fleet run's edits travel only through its
    /// source), and so does its run's directory once empty.
    pub fn remove(&self, run_id: &str, call: u64) {
        let Some(dir) = self.call_dir(run_id, call) else {
            return;
        };
        remove_tree(&dir);
        // A copy-on-write checkout's writes and scratch, and what records its base.
        for beside in VIEW_BESIDE {
            remove_tree(&dir.with_extension(beside));
        }
        for beside in ["base", "partial"] {
            let _ = std::fs::remove_file(dir.with_extension(beside));
        }
        prune_above(&dir);
    }

    /// Marks the call's directory as used now (an attempt that keeps it for a retry).
    pub fn touch(&self, run_id: &str, call: u64) {
        if let Some(dir) = self.call_dir(run_id, call)
            && let Ok(f) = std::fs::File::open(&dir)
        {
            let _ = f.set_modified(flotilla_proto::clock::now());
        }
    }

    /// Removes the call directories of runs (`wf_…/sXX/N`, and what sits beside them) that no
    /// attempt has used for `older_than` and that `busy` does not name: a call retried on
    /// another worker, stopped or never run again leaves its directory here. Shards and runs'
    /// directories left empty go too. Returns how many call directories went.
    pub fn sweep(
        &self,
        older_than: std::time::Duration,
        busy: impl Fn(&str, u64) -> bool,
    ) -> usize {
        if self.shared {
            return 0;
        }
        let Ok(runs) = std::fs::read_dir(&self.root) else {
            return 0;
        };
        let now = flotilla_proto::clock::now();
        let old = |p: &Path| {
            std::fs::symlink_metadata(p)
                .and_then(|m| m.modified())
                .is_ok_and(|t| now.duration_since(t).is_ok_and(|age| age > older_than))
        };
        let mut removed = 0;
        for run in runs.flatten() {
            let Some(run_id) = run.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            // Only what is the worker's: a run's directory (`wf_…`), never anything else a
            // workspace someone pointed elsewhere may hold.
            if !run_id.starts_with("wf_")
                || !is_plain_name(&run_id)
                || !run.file_type().is_ok_and(|t| t.is_dir())
            {
                continue;
            }
            // Judged before its old call directories go (their removal touches it): a run
            // directory made just now, empty or not, is a call's that is about to use it.
            let run_old = old(&run.path());
            let Ok(entries) = std::fs::read_dir(run.path()) else {
                continue;
            };
            for entry in entries.flatten() {
                let shard = entry.path();
                if entry.file_name().to_str().is_some_and(is_shard)
                    && entry.file_type().is_ok_and(|t| t.is_dir())
                {
                    let shard_old = old(&shard);
                    removed += sweep_calls(&shard, &run_id, &old, &busy);
                    if shard_old {
                        let _ = std::fs::remove_dir(&shard);
                    }
                }
            }
            // A run's directory as workers before shards left it: its call entries in it.
            removed += sweep_calls(&run.path(), &run_id, &old, &busy);
            if run_old {
                let _ = std::fs::remove_dir(run.path());
            }
        }
        removed
    }

    /// The working directory of one call, created if missing: for a shared workspace the root
    /// (or `cwd` inside it), else the call's own directory (or `cwd` inside that).
    pub fn dir_for(&self, run_id: &str, call: u64, cwd: &str) -> Result<PathBuf, Problem> {
        let base = if self.shared {
            self.root.clone()
        } else {
            self.call_dir(run_id, call).ok_or_else(|| {
                Problem::invalid(format!("run id {run_id:?} cannot name a directory"))
            })?
        };
        std::fs::create_dir_all(&self.root).map_err(|e| {
            Problem::internal(format!(
                "cannot create workspace root {}: {e}",
                self.root.display()
            ))
        })?;
        make_dirs(&base).map_err(|e| {
            Problem::internal(format!(
                "cannot create working directory {}: {e}",
                base.display()
            ))
        })?;
        confine(&base, cwd)
    }
}

/// The sweep of `holder`, a directory with the entries of run `run_id`'s calls (`N`, and
/// `N.upper`, `N.base`, … beside it): those of calls `busy` does not name that were not used
/// for a while (`old`) go. Returns how many call directories went.
fn sweep_calls(
    holder: &Path,
    run_id: &str,
    old: &impl Fn(&Path) -> bool,
    busy: &impl Fn(&str, u64) -> bool,
) -> usize {
    let Ok(calls) = std::fs::read_dir(holder) else {
        return 0;
    };
    let mut removed = 0;
    for entry in calls.flatten() {
        let name = entry.file_name();
        let Some(call) = name
            .to_str()
            .and_then(|n| n.split('.').next())
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        let dir = holder.join(call.to_string());
        if busy(run_id, call) || !old(&entry.path()) || (dir.exists() && !old(&dir)) {
            continue;
        }
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_tree(&entry.path());
            removed += 1;
        } else {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    removed
}

/// What a tree holds: bytes of its files (apparent sizes) and how many entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub bytes: u64,
    pub entries: u64,
    /// The largest file's size.
    pub largest: u64,
}

/// Bytes of the files under `dir` (see [`usage_of`]).
pub fn disk_use(dir: &Path, clear_setid: bool) -> u64 {
    usage_of(dir, clear_setid).bytes
}

/// What is under `dir`, walked by directory handles (`openat`), never by paths, so no depth
/// hides a file (a path past `PATH_MAX` would), and never through a link. A directory its
/// owner made unreadable is made readable for the owner again, through a handle opened on it
/// without following links (what an agent made is the worker's user's). With `clear_setid`
/// (the agent is gone), set-user-ID and set-group-ID bits are cleared on the way: no such
/// file an agent made outlives its sandbox (inside, it was the worker's user).
pub fn usage_of(dir: &Path, clear_setid: bool) -> Usage {
    use nix::dir::Dir;
    use nix::fcntl::OFlag;
    use nix::sys::stat::{FchmodatFlags, Mode, SFlag, fchmodat, fstatat};
    use std::rc::Rc;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut total = Usage::default();
    let Ok(top) = Dir::open(dir, flags, Mode::empty()) else {
        return total;
    };
    // Directories to read: the open parent (shared by siblings, so few stay open) and a name.
    let mut todo: Vec<(Rc<Dir>, std::ffi::CString)> = Vec::new();
    let mut read = |d: Rc<Dir>, todo: &mut Vec<(Rc<Dir>, std::ffi::CString)>| {
        let mut names = Vec::new();
        // Its names through a handle of their own (reading needs it alone; `d` stays shared
        // with the entries below it that wait to be opened).
        let Ok(mut own) = Dir::openat(&*d, ".", flags, Mode::empty()) else {
            return;
        };
        for e in own.iter().flatten() {
            let name = e.file_name();
            if name.to_bytes() != b"." && name.to_bytes() != b".." {
                names.push(name.to_owned());
            }
        }
        for name in names {
            let Ok(st) = fstatat(
                &*d,
                name.as_c_str(),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            ) else {
                continue;
            };
            total.entries += 1;
            let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
            if kind == SFlag::S_IFDIR {
                todo.push((d.clone(), name));
                continue;
            }
            let size = u64::try_from(st.st_size).unwrap_or(0);
            total.bytes += size;
            total.largest = total.largest.max(size);
            if clear_setid && kind == SFlag::S_IFREG && st.st_mode & 0o6000 != 0 {
                let _ = fchmodat(
                    &*d,
                    name.as_c_str(),
                    Mode::from_bits_truncate(st.st_mode & 0o1777),
                    FchmodatFlags::FollowSymlink,
                );
            }
        }
    };
    read(Rc::new(top), &mut todo);
    while let Some((parent, name)) = todo.pop() {
        let opened = match Dir::openat(&*parent, name.as_c_str(), flags, Mode::empty()) {
            Err(nix::errno::Errno::EACCES) => {
                make_readable(&parent, &name);
                Dir::openat(&*parent, name.as_c_str(), flags, Mode::empty())
            }
            other => other,
        };
        drop(parent);
        if let Ok(d) = opened {
            read(Rc::new(d), &mut todo);
        }
    }
    total
}

/// Gives the owner read, write and search on the directory `name` in `parent` again,
/// through a handle opened on it without following links (`O_PATH`, then its `/proc/self/fd`
/// entry, which names that very directory whatever is done to the path meanwhile).
fn make_readable(parent: &nix::dir::Dir, name: &std::ffi::CStr) {
    use nix::fcntl::OFlag;
    use nix::sys::stat::{Mode, fstat};
    use std::os::fd::AsRawFd;
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let Ok(fd) = nix::fcntl::openat(parent, name, flags, Mode::empty()) else {
        return;
    };
    let Ok(st) = fstat(&fd) else { return };
    let via = format!("/proc/self/fd/{}", fd.as_raw_fd());
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(
        via,
        std::fs::Permissions::from_mode((st.st_mode & 0o7777) | 0o700),
    );
}

/// Removes `dir` and everything under it, following no link (an agent's links to the
/// worker's files go, the files stay), making read-only directories an agent left writable
/// on the way.
pub fn remove_tree(dir: &Path) {
    if std::fs::remove_dir_all(dir).is_ok() || !dir.exists() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        if !std::fs::symlink_metadata(&d).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        let _ = std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700));
        if let Ok(entries) = std::fs::read_dir(&d) {
            todo.extend(entries.flatten().map(|e| e.path()));
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `cwd` inside `base` (which exists), created if missing and resolved: `Err` when it is
/// absolute, climbs out of `base`, or leads out of it through a symlink (nothing is created
/// outside `base` on the way).
pub fn confine(base: &Path, cwd: &str) -> Result<PathBuf, Problem> {
    let base = base
        .canonicalize()
        .map_err(|e| Problem::internal(format!("cannot resolve {}: {e}", base.display())))?;
    let dir = base.join(confined(cwd)?);
    let outside = || {
        format!(
            "cwd {cwd:?} leads outside the agent's directory {} (through a symlink)",
            base.display()
        )
    };
    // Check the deepest part that already exists before creating anything, so a symlink
    // cannot make us create directories outside.
    let mut existing = dir.as_path();
    while std::fs::symlink_metadata(existing).is_err() {
        existing = existing.parent().unwrap_or(&base);
    }
    let real_existing = existing
        .canonicalize()
        .map_err(|e| Problem::invalid(format!("cannot resolve {}: {e}", existing.display())))?;
    if !real_existing.starts_with(&base) {
        return Err(Problem::invalid(outside()));
    }
    std::fs::create_dir_all(&dir).map_err(|e| {
        Problem::invalid(format!(
            "cannot create working directory {}: {e}",
            dir.display()
        ))
    })?;
    let real = dir.canonicalize().map_err(|e| {
        Problem::invalid(format!(
            "cannot resolve working directory {}: {e}",
            dir.display()
        ))
    })?;
    if !real.starts_with(&base) {
        return Err(Problem::invalid(outside()));
    }
    Ok(real)
}

/// A name of one directory level that is never a hidden one (`.flotilla`, where the worker
/// keeps its caches, `.`, `..`).
fn is_plain_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with('.')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// `cwd` normalized, refused when it is absolute or climbs out of its base (whether a link
/// leads out is for [`confine`], on the directory itself).
pub fn relative(cwd: &str) -> Result<PathBuf, Problem> {
    confined(cwd)
}

/// Normalizes a relative `cwd` and refuses anything that leaves its base.
fn confined(cwd: &str) -> Result<PathBuf, Problem> {
    let path = Path::new(cwd);
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return Err(Problem::invalid(format!(
                        "cwd {cwd:?} climbs out of the agent's directory; use a path inside it"
                    )));
                }
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(Problem::invalid(format!(
                    "cwd {cwd:?} is absolute; give a path relative to the agent's directory (the repository root, or the run's checkout)"
                )));
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
        assert!(d.ends_with("wf_1/s07/7"));
        let far = ws.dir_for("wf_1", 300, "").unwrap();
        assert!(far.ends_with("wf_1/s2c/300"), "{}", far.display());
    }

    #[test]
    fn a_shared_workspace_is_every_agent_s_directory_and_a_call_s_own_goes_when_it_ends() {
        let tmp = tempfile::tempdir().unwrap();
        let shared = Workspace::shared(tmp.path());
        assert_eq!(
            shared.dir_for("wf_1", 3, "").unwrap(),
            tmp.path().canonicalize().unwrap()
        );
        assert!(shared.dir_for("wf_1", 3, "src").unwrap().ends_with("src"));
        shared.remove("wf_1", 3);
        assert!(tmp.path().join("src").exists(), "the user's files stay");
        let scratch = Workspace::new(tmp.path());
        let d = scratch.dir_for("wf_2", 1, "").unwrap();
        let kept = scratch.dir_for("wf_2", 2, "deep/er").unwrap();
        std::fs::write(kept.join("out.txt"), "x").unwrap();
        // A read-only directory and a link out do not stop it (and the link's target stays).
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep.txt"), "k").unwrap();
        std::os::unix::fs::symlink(outside.path(), kept.join("out")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&kept, std::fs::Permissions::from_mode(0o500)).unwrap();
        scratch.remove("wf_2", 1);
        assert!(!d.exists());
        assert!(
            kept.join("out.txt").exists(),
            "another call's directory stays"
        );
        scratch.remove("wf_2", 2);
        assert!(!tmp.path().join("wf_2").exists());
        assert!(outside.path().join("keep.txt").exists());
    }

    #[test]
    fn cwd_is_inside_the_call_s_own_directory_and_never_leaves_it() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = Workspace::new(tmp.path());
        let own = tmp.path().canonicalize().unwrap().join("r/s01/1");
        assert_eq!(ws.dir_for("r", 1, "a/b/../c").unwrap(), own.join("a/c"));
        // What named the workspace root itself before (issue 28): now the call's directory.
        for cwd in [".", "./", "x/..", "a/./..", ""] {
            assert_eq!(ws.dir_for("r", 1, cwd).unwrap(), own, "{cwd:?}");
        }
        assert_eq!(
            ws.dir_for("r", 1, ".flotilla/sources").unwrap(),
            own.join(".flotilla/sources"),
        );
        assert!(!tmp.path().join(".flotilla").exists());
        for cwd in ["../x", "..", "../2", "a/../../..", "../../r/2"] {
            assert!(
                ws.dir_for("r", 1, cwd)
                    .unwrap_err()
                    .message
                    .contains("climbs out"),
                "{cwd:?}"
            );
        }
        assert!(
            ws.dir_for("r", 1, "/etc")
                .unwrap_err()
                .message
                .contains("absolute")
        );
        for run in ["../..", ".flotilla", ".", "..", "a/b", ""] {
            assert!(ws.dir_for(run, 1, "").is_err(), "{run:?}");
        }
    }

    #[test]
    fn a_sweep_takes_what_no_attempt_used_for_a_while_and_leaves_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = Workspace::new(tmp.path());
        let stale = ws.dir_for("wf_s", 1, "").unwrap();
        std::fs::write(stale.join("left.txt"), "x").unwrap();
        std::fs::write(stale.with_extension("base"), "abc").unwrap();
        let busy = ws.dir_for("wf_s", 2, "").unwrap();
        let fresh = ws.dir_for("wf_t", 3, "").unwrap();
        // A call's directory as workers before shards left it, in its run's directory.
        let legacy = tmp.path().join("wf_s").join("5");
        std::fs::create_dir_all(legacy.join("src")).unwrap();
        std::fs::create_dir_all(tmp.path().join(".flotilla/caches")).unwrap();
        // Not a run's: a file of someone's, as old as the rest.
        let photos = tmp.path().join("photos");
        std::fs::create_dir_all(&photos).unwrap();
        std::fs::write(photos.join("2023.jpg"), "jpg").unwrap();
        let long_ago = flotilla_proto::clock::now() - std::time::Duration::from_secs(7200);
        for p in [
            stale.clone(),
            stale.with_extension("base"),
            busy.clone(),
            legacy.clone(),
            photos.join("2023.jpg"),
        ] {
            std::fs::File::open(&p)
                .unwrap()
                .set_modified(long_ago)
                .unwrap();
        }
        // Empty run directories: one left long ago with an empty shard, one a call has just
        // made.
        let (old_run, new_run) = (tmp.path().join("wf_old"), tmp.path().join("wf_new"));
        std::fs::create_dir_all(old_run.join("s05")).unwrap();
        std::fs::create_dir(&new_run).unwrap();
        for p in [old_run.join("s05"), old_run.clone()] {
            std::fs::File::open(&p)
                .unwrap()
                .set_modified(long_ago)
                .unwrap();
        }
        let gone = ws.sweep(std::time::Duration::from_secs(3600), |run, call| {
            run == "wf_s" && call == 2
        });
        assert_eq!(gone, 2);
        assert!(
            !legacy.exists(),
            "an old call directory of the old layout goes"
        );
        assert!(
            !old_run.exists(),
            "an empty run directory left long ago goes"
        );
        assert!(new_run.is_dir(), "one a call has just made stays for it");
        assert!(!stale.exists());
        assert!(!stale.with_extension("base").exists());
        assert!(busy.exists(), "a running attempt's directory stays");
        assert!(fresh.exists(), "a recently used one stays");
        assert!(
            tmp.path().join(".flotilla/caches").exists(),
            "caches are not calls"
        );
        assert!(
            photos.join("2023.jpg").exists(),
            "what is not a run's stays"
        );
        // Touched now: it stays however old it was.
        std::fs::File::open(&busy)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
        ws.touch("wf_s", 2);
        assert_eq!(
            ws.sweep(std::time::Duration::from_secs(3600), |_, _| false),
            0
        );
    }

    #[test]
    fn what_is_written_is_counted_however_deep_and_never_through_a_link() {
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().join("call");
        // A chain of directories longer than PATH_MAX, built relative, a file at its bottom.
        let mut rel = std::path::PathBuf::new();
        let name = "d".repeat(200);
        for _ in 0..30 {
            rel.push(&name);
        }
        std::fs::create_dir_all(&top).unwrap();
        let mut at = std::fs::File::open(&top).unwrap();
        for _ in 0..30 {
            use std::os::fd::AsFd;
            nix::sys::stat::mkdirat(at.as_fd(), name.as_str(), nix::sys::stat::Mode::S_IRWXU)
                .unwrap();
            let next = nix::fcntl::openat(
                at.as_fd(),
                name.as_str(),
                nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
                nix::sys::stat::Mode::empty(),
            )
            .unwrap();
            at = std::fs::File::from(next);
        }
        assert!(top.join(&rel).as_os_str().len() > 4096);
        use std::io::Write;
        let fd = nix::fcntl::openat(
            std::os::fd::AsFd::as_fd(&at),
            "deep.bin",
            nix::fcntl::OFlag::O_WRONLY | nix::fcntl::OFlag::O_CREAT,
            nix::sys::stat::Mode::S_IRWXU,
        )
        .unwrap();
        std::fs::File::from(fd).write_all(&[7u8; 5000]).unwrap();
        // A link out counts as itself, never as what it names.
        let outside = tmp.path().join("outside.bin");
        std::fs::write(&outside, vec![0u8; 1 << 20]).unwrap();
        std::os::unix::fs::symlink(&outside, top.join("link")).unwrap();
        let u = usage_of(&top, false);
        assert!(u.bytes >= 5000 && u.bytes < 6000, "{u:?}");
        assert_eq!(u.entries, 30 + 1 + 1, "{u:?}");
    }

    #[test]
    fn symlinks_out_of_the_call_s_directory_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let ws = Workspace::new(tmp.path());
        let own = ws.dir_for("r", 1, "").unwrap();
        std::os::unix::fs::symlink(outside.path(), own.join("link")).unwrap();
        // A link to the root the call lives under is a way out as well.
        std::os::unix::fs::symlink(tmp.path(), own.join("up")).unwrap();
        for cwd in ["link/sub", "link", "up", "up/r/2"] {
            assert!(
                ws.dir_for("r", 1, cwd)
                    .unwrap_err()
                    .message
                    .contains("symlink"),
                "{cwd:?}"
            );
        }
        assert!(
            !outside.path().join("sub").exists(),
            "nothing is created outside"
        );
        assert!(!tmp.path().join("r").join("2").exists());
    }
}
