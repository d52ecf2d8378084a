//! Prefix stagger (W60): calls that share a prompt prefix share the backend's prompt cache if
//! one of them goes first. The first call of a group leads alone; the others are held until
//! the leader's response begins (the cache is warm, and stays warm for [`WARM_FOR`]), the
//! leader ends without beginning one (the lead passes on), or the hold cap passes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

/// How long a warm prefix group stays warm after its leader's response began (the prompt
/// cache TTL).
pub(super) const WARM_FOR: Duration = Duration::from_secs(300);

/// Whether a call of a group may start now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Turn {
    /// The group is open (or stagger is off): it goes.
    Go,
    /// Nobody leads: it goes first, and leads once placed ([`Stagger::lead`]).
    Lead,
    /// It waits for the leader: held until [`Stagger::release`] hands it back.
    Held,
}

#[derive(Debug, Default)]
struct Group {
    leader: Option<u64>,
    /// When the leader was placed.
    since: Option<Instant>,
    /// Warm until then: everyone goes.
    open_until: Option<Instant>,
    /// Calls waiting for the leader, in the order they came.
    held: Vec<u64>,
}

/// The prefix groups of every run.
#[derive(Debug, Default)]
pub(super) struct Stagger {
    groups: HashMap<(Arc<str>, u64), Group>,
}

impl Stagger {
    /// Whether `call` of `group` may start at `now`, with hold cap `cap` (zero: stagger off).
    /// A held call is remembered and comes back from [`Stagger::release`].
    pub fn turn(
        &mut self,
        run: &Arc<str>,
        group: u64,
        call: u64,
        cap: Duration,
        now: Instant,
    ) -> Turn {
        if cap.is_zero() {
            return Turn::Go;
        }
        let g = self.groups.entry((run.clone(), group)).or_default();
        let open = g.open_until.is_some_and(|t| t > now) || g.since.is_some_and(|s| s + cap <= now);
        if open {
            return Turn::Go;
        }
        match g.leader {
            None => Turn::Lead,
            Some(leader) if leader == call => Turn::Go,
            Some(_) => {
                g.held.push(call);
                Turn::Held
            }
        }
    }

    /// `call` was placed as its group's leader at `now`; its hold cap runs from now.
    pub fn lead(&mut self, run: &Arc<str>, group: u64, call: u64, now: Instant) {
        let g = self.groups.entry((run.clone(), group)).or_default();
        g.leader = Some(call);
        g.since = Some(now);
    }

    pub fn is_leader(&self, run: &Arc<str>, group: u64, call: u64) -> bool {
        self.groups
            .get(&(run.clone(), group))
            .is_some_and(|g| g.leader == Some(call))
    }

    /// Lets the held calls of a group go (returned in the order they came). `leader`: only if
    /// it still leads; `warm`: its response began, so the group stays open for [`WARM_FOR`].
    pub fn release(
        &mut self,
        run: &Arc<str>,
        group: u64,
        leader: Option<u64>,
        warm: bool,
        now: Instant,
    ) -> Vec<u64> {
        let Some(g) = self.groups.get_mut(&(run.clone(), group)) else {
            return Vec::new();
        };
        if leader.is_some() && g.leader != leader {
            return Vec::new();
        }
        if warm {
            g.open_until = Some(now + WARM_FOR);
        }
        std::mem::take(&mut g.held)
    }

    /// `call` stopped running. A leader that ends without its response beginning hands the
    /// lead on: the held calls are returned, to go now.
    pub fn ended(&mut self, run: &Arc<str>, group: u64, call: u64, now: Instant) -> Vec<u64> {
        if !self.is_leader(run, group, call) {
            return Vec::new();
        }
        if let Some(g) = self.groups.get_mut(&(run.clone(), group)) {
            g.leader = None;
            g.since = None;
        }
        self.release(run, group, None, false, now)
    }

    pub fn forget_run(&mut self, run: &Arc<str>) {
        self.groups.retain(|(r, _), _| r != run);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = Duration::from_secs(2);

    fn run() -> Arc<str> {
        Arc::from("wf_stagger")
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_call_leads_alone_and_the_others_wait_for_its_response() {
        let (mut s, r) = (Stagger::default(), run());
        let now = Instant::now();
        assert_eq!(s.turn(&r, 7, 0, CAP, now), Turn::Lead);
        s.lead(&r, 7, 0, now);
        assert_eq!(
            s.turn(&r, 7, 0, CAP, now),
            Turn::Go,
            "the leader itself goes"
        );
        assert_eq!(s.turn(&r, 7, 1, CAP, now), Turn::Held);
        assert_eq!(s.turn(&r, 7, 2, CAP, now), Turn::Held);
        assert_eq!(
            s.turn(&r, 8, 3, CAP, now),
            Turn::Lead,
            "another group has its own lead"
        );
        assert!(
            s.release(&r, 7, Some(1), true, now).is_empty(),
            "only the leader opens it"
        );
        assert_eq!(s.release(&r, 7, Some(0), true, now), [1, 2]);
        tokio::time::advance(WARM_FOR - Duration::from_secs(1)).await;
        assert_eq!(
            s.turn(&r, 7, 4, CAP, Instant::now()),
            Turn::Go,
            "warm: everyone goes"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_hold_cap_opens_a_group_whose_leader_is_slow() {
        let (mut s, r) = (Stagger::default(), run());
        s.lead(&r, 1, 0, Instant::now());
        assert_eq!(s.turn(&r, 1, 1, CAP, Instant::now()), Turn::Held);
        tokio::time::advance(CAP).await;
        assert_eq!(s.turn(&r, 1, 2, CAP, Instant::now()), Turn::Go);
        assert_eq!(s.release(&r, 1, Some(0), false, Instant::now()), [1]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_that_ends_without_a_response_hands_the_lead_on() {
        let (mut s, r) = (Stagger::default(), run());
        let now = Instant::now();
        s.lead(&r, 1, 0, now);
        assert_eq!(s.turn(&r, 1, 1, CAP, now), Turn::Held);
        assert!(
            s.ended(&r, 1, 5, now).is_empty(),
            "not the leader: nothing changes"
        );
        assert_eq!(s.ended(&r, 1, 0, now), [1]);
        assert!(!s.is_leader(&r, 1, 0));
        assert_eq!(s.turn(&r, 1, 1, CAP, now), Turn::Lead, "the next one leads");
    }

    #[test]
    fn without_stagger_everyone_goes_and_nothing_is_kept() {
        let (mut s, r) = (Stagger::default(), run());
        assert_eq!(s.turn(&r, 1, 0, Duration::ZERO, Instant::now()), Turn::Go);
        assert!(s.groups.is_empty());
        s.lead(&r, 1, 0, Instant::now());
        s.forget_run(&r);
        assert!(s.groups.is_empty());
    }
}
