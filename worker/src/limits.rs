//! Limits of one attempt's processes (issue 13): memory and processes through a cgroup of
//! the attempt's own (cgroup v2 where this worker may make one, else v1's `memory` and
//! `pids` controllers), through rlimits when neither is writable; which one is said at start.
//! Wall time is the worker's `--max-attempt-time`. An attempt that goes over one ends with a
//! failure naming it; the worker and its other attempts go on.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What the worker allows one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub memory: Option<u64>,
    pub procs: Option<u64>,
    /// Size of the sandbox's private `/tmp`.
    pub tmp: u64,
    pub wall: Option<Duration>,
    /// What one attempt may write to its checkout or scratch directory, in bytes.
    pub disk: Option<u64>,
    /// The longest the worker may take to make an attempt's workspace (fetch and check out
    /// the run's source) before its agent starts.
    pub prepare: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            memory: Some(4 << 30),
            procs: Some(1024),
            tmp: 1 << 30,
            wall: Some(Duration::from_secs(4 * 3600)),
            disk: Some(10 << 30),
            prepare: Duration::from_secs(30 * 60),
        }
    }
}

/// How memory and process limits are enforced here.
#[derive(Debug, Clone)]
enum How {
    /// A cgroup v2 directory this worker made attempts' groups in.
    V2(PathBuf),
    /// cgroup v1: the worker's groups under the `memory` and `pids` hierarchies.
    V1 {
        memory: PathBuf,
        pids: PathBuf,
    },
    Rlimits,
    None,
}

/// The worker's limits and how it enforces them.
#[derive(Debug, Clone)]
pub struct Limits {
    pub settings: Settings,
    how: How,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            settings: Settings {
                memory: None,
                procs: None,
                tmp: 1 << 30,
                wall: None,
                disk: None,
                prepare: Duration::from_secs(30 * 60),
            },
            how: How::None,
        }
    }
}

/// This process's own cgroup in the hierarchy `controller` names (`""`: v2's).
fn own_cgroup(controller: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let matches = if controller.is_empty() {
            controllers.is_empty()
        } else {
            controllers.split(',').any(|c| c == controller)
        };
        matches.then(|| path.to_owned())
    })
}

/// Makes `dir` (a cgroup) if it can; `true` when it is there and writable.
/// Removes the groups of workers that are gone (`flotilla-<pid>` beside `base` whose pid no
/// longer runs): a worker killed outright leaves its groups behind.
fn sweep(base: &Path) {
    let Some(parent) = base.parent() else { return };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("flotilla-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new("/proc").join(pid.to_string()).exists() {
            continue;
        }
        if let Ok(children) = std::fs::read_dir(e.path()) {
            for c in children.flatten() {
                if c.path().join("cgroup.procs").exists() {
                    let _ = std::fs::remove_dir(c.path());
                }
            }
        }
        let _ = std::fs::remove_dir(e.path());
    }
}

fn make_group(dir: &Path) -> bool {
    std::fs::create_dir_all(dir).is_ok() && dir.join("cgroup.procs").exists()
}

fn is_cgroup2(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
}

impl Limits {
    /// Finds how `settings` can be enforced on this machine (cgroup v2, v1, else rlimits).
    pub fn detect(settings: Settings) -> Limits {
        Self::detect_with(settings, false)
    }

    /// [`Limits::detect`]; `rlimits`: through rlimits even where a cgroup could be made.
    pub fn detect_with(settings: Settings, rlimits: bool) -> Limits {
        let tag = format!("flotilla-{}", std::process::id());
        let root = Path::new("/sys/fs/cgroup");
        let how = if rlimits {
            How::Rlimits
        } else if is_cgroup2(root) {
            own_cgroup("")
                .map(|own| root.join(own.trim_start_matches('/')))
                .and_then(|own| {
                    // The worker's group takes its processes' place; attempts' groups go
                    // next to it, under a parent with the controllers on.
                    let base = own.join(&tag);
                    let ok = make_group(&base)
                        && std::fs::write(own.join("cgroup.subtree_control"), "+memory +pids")
                            .is_ok()
                        && std::fs::write(base.join("cgroup.subtree_control"), "+memory +pids")
                            .is_ok();
                    ok.then_some(How::V2(base))
                })
                .unwrap_or(How::Rlimits)
        } else {
            let memory = own_cgroup("memory").map(|own| {
                root.join("memory")
                    .join(own.trim_start_matches('/'))
                    .join(&tag)
            });
            let pids = own_cgroup("pids").map(|own| {
                root.join("pids")
                    .join(own.trim_start_matches('/'))
                    .join(&tag)
            });
            match (memory, pids) {
                (Some(m), Some(p)) if make_group(&m) && make_group(&p) => {
                    How::V1 { memory: m, pids: p }
                }
                _ => How::Rlimits,
            }
        };
        match &how {
            How::V2(base) => sweep(base),
            How::V1 { memory, pids } => {
                sweep(memory);
                sweep(pids);
            }
            How::Rlimits | How::None => {}
        }
        Limits { settings, how }
    }

    /// Removes this worker's own groups (at its end; attempts' groups go with them).
    pub fn cleanup(&self) {
        let bases: Vec<&PathBuf> = match &self.how {
            How::V2(base) => vec![base],
            How::V1 { memory, pids } => vec![memory, pids],
            How::Rlimits | How::None => Vec::new(),
        };
        for base in bases {
            if let Ok(children) = std::fs::read_dir(base) {
                for c in children.flatten() {
                    if c.path().join("cgroup.procs").exists() {
                        let _ = std::fs::remove_dir(c.path());
                    }
                }
            }
            let _ = std::fs::remove_dir(base);
        }
    }

    /// What is enforced and how, for the worker's start.
    pub fn describe(&self) -> String {
        let s = &self.settings;
        let mib =
            |b: Option<u64>| b.map_or_else(|| "none".to_owned(), |b| format!("{} MiB", b >> 20));
        let how = match &self.how {
            How::V2(_) => "a cgroup v2 group per attempt",
            How::V1 { .. } => "cgroup v1 memory and pids groups per attempt",
            How::Rlimits => {
                "rlimits (no writable cgroup here: the memory limit is of address space, and the process limit does not bind a worker running as root)"
            }
            How::None => "not enforced",
        };
        format!(
            "attempt limits: memory {}, processes {}, /tmp {} MiB, disk {}, wall time {}; through {how}",
            mib(s.memory),
            s.procs.map_or_else(|| "none".to_owned(), |p| p.to_string()),
            s.tmp >> 20,
            mib(s.disk),
            s.wall
                .map_or_else(|| "none".to_owned(), |w| format!("{}s", w.as_secs())),
        )
    }

    /// A group for the worker's own git on checkouts (what an agent left there could make it
    /// run): 2 GiB and 256 processes at most, for the worker's life.
    pub fn worker_git(&self) -> Attempt {
        let mut l = self.clone();
        l.settings.memory = Some(2 << 30);
        l.settings.procs = Some(256);
        l.settings.disk = None;
        l.attempt("worker-git")
    }

    /// Under rlimits, which say nothing of why a process ended: what the limits are, to
    /// add to an attempt's failure.
    pub fn rlimits_hint(&self) -> Option<String> {
        matches!(self.how, How::Rlimits).then(|| {
            format!(
                " (this worker holds each attempt to {} of address space and {} processes by rlimits)",
                self.settings
                    .memory
                    .map_or_else(|| "any amount".to_owned(), |m| format!("{} MiB", m >> 20)),
                self.settings
                    .procs
                    .map_or_else(|| "any number of".to_owned(), |p| p.to_string()),
            )
        })
    }

    /// The limits of one attempt: its groups are made when its first process is started
    /// through them ([`Attempt::prefix`]) — an attempt that starts none (echo, the HTTP
    /// backends) costs no cgroup — and go when it is dropped.
    pub fn attempt(&self, name: &str) -> Attempt {
        Attempt {
            settings: self.settings.clone(),
            how: self.how.clone(),
            name: name.to_owned(),
            groups: std::sync::OnceLock::new(),
            rlimits: matches!(self.how, How::Rlimits),
        }
    }
}

/// Makes the groups of attempt `name` under `how`, with `settings`' limits written in.
fn make_groups(how: &How, settings: &Settings, name: &str) -> Vec<PathBuf> {
    let put = |dir: &Path, file: &str, value: u64| {
        std::fs::write(dir.join(file), value.to_string()).is_ok()
    };
    let mut groups = Vec::new();
    match how {
        How::V2(base) => {
            let dir = base.join(name);
            if make_group(&dir) {
                if let Some(m) = settings.memory {
                    put(&dir, "memory.max", m);
                    put(&dir, "memory.swap.max", 0);
                }
                if let Some(p) = settings.procs {
                    put(&dir, "pids.max", p);
                }
                groups.push(dir);
            }
        }
        How::V1 { memory, pids } => {
            let (m, p) = (memory.join(name), pids.join(name));
            if make_group(&m) {
                if let Some(limit) = settings.memory {
                    put(&m, "memory.limit_in_bytes", limit);
                    put(&m, "memory.memsw.limit_in_bytes", limit);
                }
                groups.push(m);
            }
            if make_group(&p) {
                if let Some(limit) = settings.procs {
                    put(&p, "pids.max", limit);
                }
                groups.push(p);
            }
        }
        How::Rlimits | How::None => {}
    }
    groups
}

/// One attempt's groups.
#[derive(Debug)]
pub struct Attempt {
    settings: Settings,
    how: How,
    name: String,
    /// Made on first use.
    groups: std::sync::OnceLock<Vec<PathBuf>>,
    rlimits: bool,
}

impl Attempt {
    /// A command that puts the attempt's process (and so all it starts) in the attempt's
    /// groups, or under its rlimits, then runs it: `sh` writing its own pid to each group's
    /// `cgroup.procs` before it `exec`s, or `prlimit`.
    pub fn prefix(&self) -> Vec<OsString> {
        let mut p = self.groups_prefix();
        // No one file larger than the attempt's disk quota (the disk watch sees the rest).
        if let Some(disk) = self.settings.disk
            && let Some(prlimit) = find_on_path("prlimit")
        {
            let fsize = [format!("--fsize={disk}").into(), "--".into()];
            if self.rlimits && p.first().map(OsString::as_os_str) == Some(prlimit.as_os_str()) {
                // One prlimit sets them all: `prlimit --as=… --fsize=… --`.
                p.pop();
                p.extend(fsize);
            } else {
                p.push(prlimit.into_os_string());
                p.extend(fsize);
            }
        }
        p
    }

    fn groups_prefix(&self) -> Vec<OsString> {
        let groups = self
            .groups
            .get_or_init(|| make_groups(&self.how, &self.settings, &self.name));
        if !groups.is_empty() {
            let mut p: Vec<OsString> = vec![
                "/bin/sh".into(),
                "-c".into(),
                "n=$1; shift; while [ \"$n\" -gt 0 ]; do echo $$ > \"$1\" || exit 125; shift; n=$((n-1)); done; exec \"$@\"".into(),
                "flotilla-limits".into(),
                groups.len().to_string().into(),
            ];
            p.extend(
                groups
                    .iter()
                    .map(|g| g.join("cgroup.procs").into_os_string()),
            );
            return p;
        }
        if self.rlimits
            && let Some(prlimit) = find_on_path("prlimit")
        {
            let mut p: Vec<OsString> = vec![prlimit.into_os_string()];
            if let Some(m) = self.settings.memory {
                p.push(format!("--as={m}").into());
            }
            if let Some(n) = self.settings.procs {
                p.push(format!("--nproc={n}").into());
            }
            p.push("--".into());
            return p;
        }
        Vec::new()
    }

    /// The limit the attempt went over, if it did (read from its groups' event counters).
    pub fn exceeded(&self) -> Option<String> {
        let count = |file: PathBuf, key: &str| -> u64 {
            std::fs::read_to_string(file)
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix(key).map(|n| n.trim().parse().unwrap_or(0)))
                .unwrap_or(0)
        };
        let (mut oom, mut pids) = (0, 0);
        // v2 counts OOM kills in memory.events, v1 in memory.oom_control (the other is
        // missing and counts 0); pids.events is the same in both.
        for g in self.groups.get().into_iter().flatten() {
            oom += count(g.join("memory.events"), "oom_kill ")
                + count(g.join("memory.oom_control"), "oom_kill ");
            pids += count(g.join("pids.events"), "max ");
        }
        // Processes first: a fork bomb runs into both, and that is what it did.
        if pids > 0 {
            return Some(format!(
                "the agent tried to run more than {} processes at once (the worker's --max-procs)",
                self.settings.procs.unwrap_or(0)
            ));
        }
        if oom > 0 {
            return Some(format!(
                "the agent went over its memory limit of {} MiB and was killed (the worker's --memory-mib)",
                self.settings.memory.unwrap_or(0) >> 20
            ));
        }
        None
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        for g in self.groups.get().into_iter().flatten() {
            // What is left in the group dies with the attempt; then the group goes.
            for _ in 0..50 {
                let left = std::fs::read_to_string(g.join("cgroup.procs")).unwrap_or_default();
                let pids: Vec<i32> = left.lines().filter_map(|l| l.trim().parse().ok()).collect();
                if pids.is_empty() {
                    break;
                }
                for pid in pids {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = std::fs::remove_dir(g);
        }
    }
}

/// Watches what one attempt writes to its directory (its checkout or scratch directory) while
/// it runs: once what it added since it started — bytes, or entries at 4 KiB each, so a
/// million empty files count too — passes the worker's disk quota, it says so and cancels
/// the attempt. (No one file can pass the quota at all: the attempt runs under
/// `RLIMIT_FSIZE`.) What was there when it started (the checkout itself, an earlier
/// attempt's files) does not count.
#[derive(Debug)]
pub struct DiskWatch {
    base: crate::workspace::Usage,
    limit: u64,
    over: std::sync::Arc<std::sync::OnceLock<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl DiskWatch {
    /// Takes what `dir` (which may not be there yet) holds now, then watches it against
    /// `limit` bytes; `cancel` is the attempt's.
    pub async fn start(
        dir: PathBuf,
        limit: u64,
        cancel: tokio_util::sync::CancellationToken,
    ) -> DiskWatch {
        // A directory not made yet (an agent that may never use one) holds nothing.
        let base = if std::fs::symlink_metadata(&dir).is_ok() {
            let d = dir.clone();
            tokio::task::spawn_blocking(move || crate::workspace::usage_of(&d, false))
                .await
                .unwrap_or_default()
        } else {
            crate::workspace::Usage::default()
        };
        let over = std::sync::Arc::new(std::sync::OnceLock::new());
        let said = over.clone();
        let task = tokio::spawn(async move {
            let mut pause = Duration::from_millis(250);
            loop {
                tokio::time::sleep(pause).await;
                let started = std::time::Instant::now();
                let d = dir.clone();
                let Ok(now) =
                    tokio::task::spawn_blocking(move || crate::workspace::usage_of(&d, false))
                        .await
                else {
                    return;
                };
                if let Some(why) = past(base, now, limit) {
                    let _ = said.set(why);
                    cancel.cancel();
                    return;
                }
                // A large tree is walked less often: at most 5% of the time goes to it.
                pause = (started.elapsed() * 20)
                    .clamp(Duration::from_millis(250), Duration::from_secs(5));
            }
        });
        DiskWatch {
            base,
            limit,
            over,
            task,
        }
    }

    /// Why the attempt was stopped, if the watch stopped it; else whether `now` (what its
    /// directory holds at its end) is past the quota.
    pub fn over(&self, now: crate::workspace::Usage) -> Option<String> {
        self.over
            .get()
            .cloned()
            .or_else(|| past(self.base, now, self.limit))
    }
}

/// Why an attempt whose directory went from `base` to `now` is past `limit`, if it is.
fn past(base: crate::workspace::Usage, now: crate::workspace::Usage, limit: u64) -> Option<String> {
    let bytes = now.bytes.saturating_sub(base.bytes);
    let entries = now.entries.saturating_sub(base.entries);
    // One file as large as the quota ran into `RLIMIT_FSIZE` (a write past it failed).
    let capped = now.largest >= limit && now.largest > base.largest;
    (bytes >= limit || capped || entries >= (limit / 4096).max(1))
        .then(|| disk_quota_message(limit))
}

impl Drop for DiskWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why an attempt that wrote past `limit` bytes (or `limit / 4096` files) ended.
pub fn disk_quota_message(limit: u64) -> String {
    format!(
        "the agent wrote past its disk quota of {} MiB ({} files) to its directory (the worker's --disk-mib); what it wrote is gone",
        limit >> 20,
        limit / 4096
    )
}

/// `name` on the worker's `PATH`, as an absolute path.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(PathBuf::from(name));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod disk_tests {
    use super::*;
    use crate::workspace::Usage;

    #[test]
    fn the_quota_is_of_what_an_attempt_adds_in_bytes_or_in_files() {
        let limit = 64 << 20;
        let checkout = Usage {
            bytes: 500 << 20,
            entries: 20_000,
            largest: 1 << 20,
        };
        // A checkout larger than the quota is not the agent's doing.
        assert_eq!(past(checkout, checkout, limit), None);
        let wrote = |bytes: u64, entries: u64| Usage {
            bytes: checkout.bytes + bytes,
            entries: checkout.entries + entries,
            largest: checkout.largest.max(bytes),
        };
        assert_eq!(past(checkout, wrote((64 << 20) - 1, 1), limit), None);
        let message = past(checkout, wrote(64 << 20, 1), limit).unwrap();
        assert!(
            message.contains("64 MiB") && message.contains("--disk-mib"),
            "{message}"
        );
        // Empty files by the thousand cost no bytes and still count.
        assert!(past(checkout, wrote(0, limit / 4096), limit).is_some());
        assert!(past(checkout, wrote(0, limit / 4096 - 1), limit).is_none());
        // What went away since it started is not a credit beyond zero.
        let less = Usage::default();
        assert_eq!(past(checkout, less, limit), None);
        // A file cut off at the quota by RLIMIT_FSIZE, while the agent deleted as much
        // elsewhere: the cut says it went over.
        let cut = Usage {
            bytes: checkout.bytes,
            entries: checkout.entries,
            largest: limit,
        };
        assert!(past(checkout, cut, limit).is_some());
    }
}

#[cfg(test)]
mod group_tests {
    use super::*;

    /// Where the attempt named `name` has its groups under `how`.
    fn places(how: &How, name: &str) -> Vec<PathBuf> {
        match how {
            How::V2(base) => vec![base.join(name)],
            How::V1 { memory, pids } => vec![memory.join(name), pids.join(name)],
            How::Rlimits | How::None => Vec::new(),
        }
    }

    #[test]
    fn an_attempt_makes_its_cgroups_only_when_it_starts_a_process() {
        let limits = Limits::detect(Settings::default());
        if !nix::unistd::geteuid().is_root() {
            // Only root makes cgroups (the suite's machines run as root).
            return;
        }
        let places = places(&limits.how, "lazy-1");
        assert!(
            !places.is_empty(),
            "as root this machine should give attempts cgroups: {}",
            limits.describe()
        );
        let attempt = limits.attempt("lazy-1");
        // An attempt that starts no process (echo, the HTTP backends) costs no cgroup.
        assert!(places.iter().all(|p| !p.exists()), "{places:?}");
        assert!(attempt.exceeded().is_none());
        let prefix = attempt.prefix();
        assert!(!prefix.is_empty());
        assert!(places.iter().all(|p| p.exists()), "{places:?}");
        drop(attempt);
        assert!(places.iter().all(|p| !p.exists()), "{places:?}");
        limits.cleanup();
    }
}
