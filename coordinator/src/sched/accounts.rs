//! Accounts per provider account (an account is a backend's endpoint and key, named by the
//! workers that call through it): how many calls may be in flight through it at once, and
//! how fast they may start.
//!
//! - **The window** adapts to what the provider takes. While calls succeed and the window is
//!   full, it grows: by half a call per success until the first throttle (one and a half
//!   times per round of calls), then by one call per window's worth of successes, and more
//!   slowly still once it is back at the size that was throttled last (probing). A throttle
//!   (429, 529, "overloaded") shrinks it to [`BETA`] of the calls in flight, once per epoch:
//!   throttles of attempts that started before the last shrink are the same burst, not news.
//! - **A cap** the workers declare (`--account-concurrency`) bounds the window.
//! - **Pacing**: when the workers declare the account's input tokens per minute
//!   (`--account-itpm`), starts draw on a token bucket refilled at that rate; a call's draw is
//!   an estimate (its prompt, or what the account's calls took on average, whichever is more),
//!   corrected by what the attempt reports.
//!
//! A throttled call waits its `retry-after` (a backoff without one) outside the window and is
//! never counted as an attempt, so a burst of rate limits delays a run and never fails it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

/// Where a new account's window starts.
pub(super) const INITIAL: f64 = 16.0;
/// What a throttle leaves of the calls in flight.
pub(super) const BETA: f64 = 0.85;
/// Growth per round of calls once the window is back at the size throttled last: one call
/// per ten rounds (a throttle costs a refused request and its call's wait).
const PROBE: f64 = 0.1;
/// Rounds of calls above the last throttle's size after which that size is forgotten (longer
/// than a probe takes to reach the next throttle, 1 / [`PROBE`] rounds).
const STALE_ROUNDS: f64 = 20.0;
/// The smallest window.
const MIN: f64 = 1.0;
/// The largest window, when nothing else caps it.
const MAX: f64 = 4096.0;
/// Input tokens a call is taken to need before the account has any measure of its calls.
const FIRST_ESTIMATE: u64 = 1_000;

/// What a call took of an account when it started.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Draw {
    pub account: Arc<str>,
    /// The window's epoch when it started.
    pub epoch: u64,
    /// Input tokens drawn from the bucket for it.
    pub estimate: u64,
}

/// How an admitted attempt ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum End {
    /// It succeeded, with this many input tokens.
    Succeeded { input_tokens: u64 },
    /// The provider refused it for rate or load.
    Throttled,
    /// Anything else (a failure, a stall, a cancel, a lost worker): no verdict on the window.
    Other { input_tokens: u64 },
}

/// Why a call cannot start through an account now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Full {
    /// As many calls are in flight as the window allows.
    Window,
    /// The token bucket has too little; enough by then.
    Paced(Instant),
}

#[derive(Debug)]
struct Bucket {
    per_minute: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refill(&mut self, now: Instant) {
        let gained = self.per_minute * now.saturating_duration_since(self.at).as_secs_f64() / 60.0;
        self.tokens = (self.tokens + gained).min(self.per_minute);
        self.at = now;
    }

    /// When `need` tokens will be there (`now` if they are).
    fn ready_at(&self, need: f64, now: Instant) -> Instant {
        // A call larger than the whole bucket goes when the bucket is full.
        let need = need.min(self.per_minute);
        if self.tokens >= need {
            return now;
        }
        let secs = (need - self.tokens) * 60.0 / self.per_minute;
        now + Duration::from_secs_f64(secs.min(3600.0))
    }
}

/// One account's state.
#[derive(Debug)]
pub(super) struct Window {
    limit: f64,
    /// The size it was throttled at last (`None`: never throttled: it grows fast).
    ceiling: Option<f64>,
    in_flight: u32,
    epoch: u64,
    /// Declared by its workers: most at once (0: none).
    cap: u32,
    bucket: Option<Bucket>,
    /// Input tokens its calls took, on average (exponentially weighted).
    mean_input: Option<f64>,
    /// Calls found it full since it was last clearly underused: it may grow.
    saturated: bool,
    /// Successes since it reached the last throttle's size.
    above: u64,
    /// Counters: attempts started, throttles, shrinks, calls held back.
    pub started: u64,
    pub throttled: u64,
    pub shrinks: u64,
    pub held: u64,
}

impl Window {
    fn new() -> Window {
        Window {
            limit: INITIAL,
            ceiling: None,
            in_flight: 0,
            epoch: 0,
            cap: 0,
            bucket: None,
            mean_input: None,
            saturated: false,
            above: 0,
            started: 0,
            throttled: 0,
            shrinks: 0,
            held: 0,
        }
    }

    /// Calls it lets in at once now.
    pub fn allowed(&self) -> u32 {
        let w = self.limit.floor().max(MIN) as u32;
        if self.cap > 0 { w.min(self.cap) } else { w }
    }

    fn estimate(&self, prompt_tokens: u64) -> u64 {
        let mean = self.mean_input.map_or(FIRST_ESTIMATE, |m| m.round() as u64);
        prompt_tokens.max(mean)
    }

    fn grow(&mut self) {
        // Only a window that calls wait for grows (a run of three agents proves nothing
        // about 64).
        if !self.saturated {
            return;
        }
        let step = match self.ceiling {
            None => 0.5,
            Some(c) if self.limit < c => 1.0 / self.limit,
            Some(_) => {
                // Long above the last throttle's size with no throttle: that size is stale
                // (a storm left it low, or the provider takes more now): grow fast again.
                self.above += 1;
                if self.above as f64 >= STALE_ROUNDS * self.limit {
                    self.ceiling = None;
                    self.above = 0;
                }
                PROBE / self.limit
            }
        };
        self.limit = (self.limit + step).min(MAX);
    }

    fn shrink(&mut self) {
        self.ceiling = Some((self.limit - 1.0).max(MIN));
        self.above = 0;
        self.limit = (self.limit * BETA).max(MIN);
        self.epoch += 1;
        self.shrinks += 1;
    }
}

/// What the page and `/metrics` show of an account.
#[derive(Debug, Clone, PartialEq)]
pub struct AccountView {
    pub id: String,
    /// Calls it lets in at once now.
    pub window: u32,
    pub in_flight: u32,
    pub started: u64,
    /// Attempts the provider refused for rate or load.
    pub throttled: u64,
    /// Calls that waited for room in it.
    pub held: u64,
    /// Declared input tokens per minute (0: not paced).
    pub itpm: u64,
}

/// Every account the attached workers named.
#[derive(Debug, Default)]
pub(super) struct Accounts {
    accounts: HashMap<Arc<str>, Window>,
}

impl Accounts {
    /// A worker names account `id` with its declared limits (the largest declaration holds).
    pub fn declare(&mut self, id: &str, itpm: u64, cap: u32, now: Instant) {
        let w = self
            .accounts
            .entry(Arc::from(id))
            .or_insert_with(Window::new);
        w.cap = w.cap.max(cap);
        if itpm > 0 {
            let per_minute = itpm as f64;
            match &mut w.bucket {
                Some(b) if b.per_minute >= per_minute => {}
                Some(b) => b.per_minute = per_minute,
                None => {
                    w.bucket = Some(Bucket {
                        per_minute,
                        tokens: per_minute,
                        at: now,
                    });
                }
            }
        }
    }

    /// Whether a call of about `prompt_tokens` may start through `id` now.
    pub fn room(&mut self, id: &str, prompt_tokens: u64, now: Instant) -> Result<(), Full> {
        let Some(w) = self.accounts.get_mut(id) else {
            return Ok(());
        };
        if w.in_flight >= w.allowed() {
            w.saturated = true;
            return Err(Full::Window);
        }
        let need = w.estimate(prompt_tokens) as f64;
        if let Some(b) = &mut w.bucket {
            b.refill(now);
            let at = b.ready_at(need, now);
            if at > now {
                return Err(Full::Paced(at));
            }
        }
        Ok(())
    }

    /// A call was held back by `id`.
    pub fn held(&mut self, id: &str) {
        if let Some(w) = self.accounts.get_mut(id) {
            w.held += 1;
        }
    }

    /// A call starts through `id` (after [`Accounts::room`] said it may).
    pub fn start(&mut self, id: &str, prompt_tokens: u64, now: Instant) -> Option<Draw> {
        let key = self.accounts.get_key_value(id)?.0.clone();
        let w = self.accounts.get_mut(&key)?;
        let estimate = w.estimate(prompt_tokens);
        if let Some(b) = &mut w.bucket {
            b.refill(now);
            b.tokens -= estimate as f64;
        }
        if w.in_flight < w.allowed() / 2 {
            w.saturated = false;
        }
        w.in_flight += 1;
        w.started += 1;
        Some(Draw {
            account: key,
            epoch: w.epoch,
            estimate,
        })
    }

    /// An admitted attempt ended.
    pub fn ended(&mut self, a: &Draw, end: End, now: Instant) {
        let Some(w) = self.accounts.get_mut(&a.account) else {
            return;
        };
        // Counted out first: the window's verdicts see the calls still in flight.
        w.in_flight = w.in_flight.saturating_sub(1);
        let used = match end {
            End::Succeeded { input_tokens } | End::Other { input_tokens } => Some(input_tokens),
            End::Throttled => None,
        };
        if let Some(b) = &mut w.bucket {
            b.refill(now);
            // What it really took (a throttled attempt took nothing).
            b.tokens += a.estimate as f64 - used.unwrap_or(0) as f64;
            b.tokens = b.tokens.min(b.per_minute);
        }
        if let Some(n) = used.filter(|n| *n > 0) {
            let n = n as f64;
            w.mean_input = Some(w.mean_input.map_or(n, |m| m * 0.8 + n * 0.2));
        }
        match end {
            End::Succeeded { .. } => w.grow(),
            End::Throttled => {
                w.throttled += 1;
                if a.epoch == w.epoch {
                    w.shrink();
                }
            }
            End::Other { .. } => {}
        }
    }

    pub fn views(&self) -> Vec<AccountView> {
        let mut out: Vec<AccountView> = self
            .accounts
            .iter()
            .map(|(id, w)| AccountView {
                id: id.to_string(),
                window: w.allowed(),
                in_flight: w.in_flight,
                started: w.started,
                throttled: w.throttled,
                held: w.held,
                itpm: w.bucket.as_ref().map_or(0, |b| b.per_minute as u64),
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A provider that takes `limit` calls at once, each a round long, and throttles the
    /// rest: `rounds` rounds of a fan-out far wider than `limit`. Calls done and throttles.
    fn against(limit: u32, rounds: usize) -> (u64, u64, Accounts) {
        let mut a = Accounts::default();
        let now = Instant::now();
        a.declare("anthropic@api#1", 0, 0, now);
        let (mut done, mut refused) = (0, 0);
        for _ in 0..rounds {
            let mut flight = Vec::new();
            while a.room("anthropic@api#1", 10, now).is_ok() {
                flight.push(a.start("anthropic@api#1", 10, now).unwrap());
            }
            for (i, t) in flight.iter().enumerate() {
                if (i as u32) < limit {
                    done += 1;
                    a.ended(t, End::Succeeded { input_tokens: 10 }, now);
                } else {
                    refused += 1;
                    a.ended(t, End::Throttled, now);
                }
            }
        }
        (done, refused, a)
    }

    #[test]
    fn the_window_settles_near_what_the_provider_takes_with_few_throttles() {
        // Small windows throttle more often per request: each probe is one of few.
        for (limit, most_refused_pct) in [(4u32, 8), (16, 2), (50, 1), (64, 1)] {
            let rounds = 300;
            let (done, refused, a) = against(limit, rounds);
            let ideal = u64::from(limit) * rounds as u64;
            assert!(
                done * 100 >= ideal * 90,
                "limit {limit}: {done} of {ideal} ({refused} refused)"
            );
            assert!(
                refused * 100 <= (done + refused) * most_refused_pct,
                "limit {limit}: {refused} refused of {}",
                done + refused
            );
            let v = &a.views()[0];
            assert!(v.window <= limit + 2, "{v:?}");
            assert_eq!(v.in_flight, 0);
        }
    }

    #[test]
    fn a_burst_of_throttles_from_one_wave_shrinks_the_window_once() {
        let mut a = Accounts::default();
        let now = Instant::now();
        a.declare("acct", 0, 0, now);
        let wave: Vec<Draw> = (0..16).map(|_| a.start("acct", 1, now).unwrap()).collect();
        assert_eq!(a.room("acct", 1, now), Err(Full::Window), "16 at first");
        for t in &wave {
            a.ended(t, End::Throttled, now);
        }
        let v = &a.views()[0];
        assert_eq!(v.throttled, 16);
        assert_eq!(v.window, 13, "one shrink: 16 × {BETA}");
        // A throttle of a call started after the shrink is news.
        let late = a.start("acct", 1, now).unwrap();
        a.ended(&late, End::Throttled, now);
        assert_eq!(a.views()[0].window, 11, "13.6 × {BETA}");
    }

    #[test]
    fn after_a_storm_the_window_grows_back_to_what_the_provider_takes() {
        let mut a = Accounts::default();
        let now = Instant::now();
        a.declare("acct", 0, 0, now);
        // Everything refused for a while: the window collapses.
        for _ in 0..40 {
            let wave: Vec<Draw> = std::iter::from_fn(|| {
                a.room("acct", 1, now).ok()?;
                a.start("acct", 1, now)
            })
            .collect();
            for t in &wave {
                a.ended(t, End::Throttled, now);
            }
        }
        assert_eq!(a.views()[0].window, 1, "collapsed");
        // The storm is over; the provider takes 32 at once again.
        let mut rounds = 0;
        while a.views()[0].window < 30 {
            rounds += 1;
            assert!(rounds < 400, "the window never grew back: {:?}", a.views());
            let wave: Vec<Draw> = std::iter::from_fn(|| {
                a.room("acct", 1, now).ok()?;
                a.start("acct", 1, now)
            })
            .collect();
            for (i, t) in wave.iter().enumerate() {
                let end = if i < 32 {
                    End::Succeeded { input_tokens: 1 }
                } else {
                    End::Throttled
                };
                a.ended(t, end, now);
            }
        }
    }

    #[test]
    fn a_declared_cap_bounds_the_window_and_unknown_accounts_are_not_held() {
        let mut a = Accounts::default();
        let now = Instant::now();
        a.declare("acct", 0, 3, now);
        for _ in 0..3 {
            assert!(a.room("acct", 1, now).is_ok());
            a.start("acct", 1, now).unwrap();
        }
        assert_eq!(a.room("acct", 1, now), Err(Full::Window));
        assert!(a.room("nobody-declared-it", 1, now).is_ok());
        assert!(a.start("nobody-declared-it", 1, now).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn starts_are_paced_to_the_declared_tokens_per_minute() {
        let mut a = Accounts::default();
        let t0 = Instant::now();
        // 6,000 tokens a minute: 100 a second; calls of 1,000.
        a.declare("acct", 6_000, 0, t0);
        let mut started = 0;
        let mut now = t0;
        let mut tickets = Vec::new();
        while now < t0 + Duration::from_secs(120) {
            match a.room("acct", 1_000, now) {
                Ok(()) => {
                    tickets.push(a.start("acct", 1_000, now).unwrap());
                    started += 1;
                }
                Err(Full::Paced(at)) => {
                    assert!(at > now);
                    now = at;
                }
                Err(Full::Window) => panic!("the window is not what holds these"),
            }
            // Each call takes what it was estimated at, at once.
            for t in tickets.drain(..) {
                a.ended(
                    &t,
                    End::Other {
                        input_tokens: 1_000,
                    },
                    now,
                );
            }
        }
        // A full bucket at first (6 calls), then 6 a minute: 6 + 12 in two minutes.
        assert!((17..=19).contains(&started), "{started}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_took_more_than_its_estimate_draws_the_difference() {
        let mut a = Accounts::default();
        let t0 = Instant::now();
        a.declare("acct", 6_000, 0, t0);
        let t = a.start("acct", 100, t0).unwrap();
        assert_eq!(
            t.estimate, FIRST_ESTIMATE,
            "no measure yet: the first estimate"
        );
        // It took the whole minute's tokens: nothing starts until they are back.
        a.ended(
            &t,
            End::Other {
                input_tokens: 6_000,
            },
            t0,
        );
        let Err(Full::Paced(at)) = a.room("acct", 100, t0) else {
            panic!("paced");
        };
        assert!(at >= t0 + Duration::from_secs(30), "{:?}", at - t0);
        // Estimates follow what calls take.
        tokio::time::advance(Duration::from_secs(60)).await;
        let t = a.start("acct", 100, Instant::now()).unwrap();
        assert_eq!(t.estimate, 6_000);
    }
}
