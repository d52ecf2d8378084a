//! Wall time: the one place the workspace reads it.
//!
//! Every timestamp a run stores (created, ended, owner records, quotas' days, token expiry,
//! retention) comes from [`now`]. `clippy.toml` bans `SystemTime::now` everywhere else, so a
//! test that needs another time, or a fix to how time is read, changes this file only.
//! Durations and deadlines use the monotonic clock (`std::time::Instant`, `tokio::time`),
//! which this module does not cover.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The current wall time.
#[allow(clippy::disallowed_methods)]
pub fn now() -> SystemTime {
    SystemTime::now()
}

/// Time since the Unix epoch (zero for a clock set before it).
pub fn since_epoch() -> Duration {
    now().duration_since(UNIX_EPOCH).unwrap_or_default()
}

/// Seconds since the Unix epoch.
pub fn unix_secs() -> u64 {
    since_epoch().as_secs()
}

/// Milliseconds since the Unix epoch.
pub fn unix_millis() -> u64 {
    u64::try_from(since_epoch().as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_reads_after_2020_and_its_units_agree() {
        let (s, ms) = (unix_secs(), unix_millis());
        assert!(s > 1_577_836_800, "{s}");
        assert!(ms / 1000 >= s && ms / 1000 - s <= 1, "{ms} {s}");
    }
}
