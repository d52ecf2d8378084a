//! Ending an attempt's processes: its process group and every process descended from it.
//!
//! A backend starts its command in a process group of its own. Commands can start children
//! in groups (or sessions) of their own too — the Claude Code CLI does for its tools, and
//! `timeout` or a shell may — so killing the group alone can leave them running. The tree is
//! read from `/proc` before anything is killed: a killed parent's children would be
//! re-parented out of reach.

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// Kills the process group `pgid` (led by the attempt's command) and every descendant of its
/// leader, ignoring processes that are already gone.
pub(crate) fn kill_group(pgid: Option<u32>) {
    let Some(root) = pgid.and_then(|id| i32::try_from(id).ok()) else {
        return;
    };
    for _ in 0..3 {
        let tree = descendants(root);
        let _ = killpg(Pid::from_raw(root), Signal::SIGKILL);
        for pid in &tree {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
        }
        if tree.is_empty() {
            break;
        }
    }
}

/// Every process below `root` (not `root` itself), from `/proc/*/stat`.
fn descendants(root: i32) -> Vec<i32> {
    let mut parent_of: Vec<(i32, i32)> = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        if let Some(ppid) = after.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
            parent_of.push((pid, ppid));
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (child, _) in parent_of.iter().filter(|(_, pp)| *pp == p) {
            if !out.contains(child) {
                out.push(*child);
                frontier.push(*child);
            }
        }
    }
    out
}

/// Kills an attempt's processes when dropped, however the attempt ends.
pub(crate) struct GroupGuard(pub(crate) Option<u32>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        kill_group(self.0);
    }
}
