//! Prefix affinity, a placement policy (issue 30, 2): where a worker's model server keeps a
//! prefix cache of its own, the calls of a prefix group go back to the worker that served the
//! group first, when it has a free slot. The placer asks it which queued call to take and
//! which worker to prefer, and tells it where each call went; it owns the groups' homes.

use std::collections::HashMap;

use flotilla_proto::v1;

use super::fleet::Fleet;

/// Queued calls of a run looked at for one whose prefix's worker has room.
pub(super) const SCAN: usize = 32;
/// Times a queued call lets others go first because its prefix's worker is busy, at most.
pub(super) const PATIENCE: u32 = 64;
/// Prefix groups remembered at most; past it the map starts over.
const GROUPS: usize = 65_536;

/// Each prefix group's home worker, when affinity is on (`FLOTILLA_AFFINITY=off` turns it off).
pub(super) struct Affinity {
    on: bool,
    home: HashMap<u64, u64>,
}

impl Affinity {
    pub(super) fn new(on: bool) -> Affinity {
        Affinity {
            on,
            home: HashMap::new(),
        }
    }

    /// Whether it can change the order of a queue: it is on and some group has a home.
    pub(super) fn reorders(&self) -> bool {
        self.on && !self.home.is_empty()
    }

    /// The worker prefix group `group` goes back to, if it has one.
    pub(super) fn home(&self, group: u64) -> Option<u64> {
        if self.on {
            self.home.get(&group).copied()
        } else {
            None
        }
    }

    /// Which of a queue's first [`SCAN`] calls (each its prefix group and task; `None`: a
    /// call no longer there) to place next: the first whose group has no home, whose home is
    /// not ready (gone or cut off), or whose home has room for it.
    pub(super) fn pick<'a>(
        &self,
        queue: impl Iterator<Item = Option<(u64, &'a v1::TaskSpec)>>,
        fleet: &Fleet,
    ) -> Option<usize> {
        queue.take(SCAN).position(|call| {
            let Some((group, task)) = call else {
                return true;
            };
            match self.home(group) {
                None => true,
                Some(wid) => !fleet.is_ready(wid) || fleet.has_room_for(wid, task),
            }
        })
    }

    /// Worker `wid` was given a call of `group` for `backend`: the first worker to serve a
    /// group through a local prefix cache becomes its home (until it is gone).
    pub(super) fn served(&mut self, group: u64, wid: u64, backend: &str, fleet: &Fleet) {
        if !self.on || !fleet.caches_locally(wid, backend) {
            return;
        }
        let kept = self.home.get(&group).is_some_and(|w| fleet.is_ready(*w));
        if !kept {
            if self.home.len() >= GROUPS {
                self.home.clear();
            }
            self.home.insert(group, wid);
        }
    }
}
