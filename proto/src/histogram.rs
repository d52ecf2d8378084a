//! A Prometheus histogram of durations in plain atomics: recording is a few relaxed adds on
//! hot paths and never locks; [`Histogram::snapshot`] is what an exposition encoder writes out. The
//! coordinator's counters and its object store's write meter both keep theirs in one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A histogram with fixed bucket bounds in seconds.
pub struct Histogram {
    bounds: &'static [f64],
    /// One counter per bound, plus the `+Inf` bucket; not cumulative (summed when rendered).
    buckets: [AtomicU64; 16],
    count: AtomicU64,
    /// Sum of observations, in microseconds.
    sum_us: AtomicU64,
}

impl Histogram {
    pub const fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: [const { AtomicU64::new(0) }; 16],
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(self.bounds.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// What it holds now: each bucket's own count (not cumulative) by upper bound, the last
    /// one `+Inf`; the sum of observations in seconds; their count. An exposition encoder
    /// (`prometheus-client`'s) writes them out.
    pub fn snapshot(&self) -> (Vec<(f64, u64)>, f64, u64) {
        let buckets: Vec<(f64, u64)> = self
            .bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(&self.buckets)
            .map(|(b, n)| (b, n.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        (buckets, sum, count)
    }
}

/// Bucket bounds for latencies, in seconds: a millisecond to five minutes.
pub const LATENCY_SECONDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bucket_keeps_its_own_count_and_the_sum_is_in_seconds() {
        static H: Histogram = Histogram::new(&[0.01, 0.1]);
        H.observe(Duration::from_millis(5));
        H.observe(Duration::from_millis(50));
        H.observe(Duration::from_secs(2));
        let (buckets, sum, count) = H.snapshot();
        assert_eq!(
            buckets,
            vec![(0.01, 1), (0.1, 1), (f64::INFINITY, 1)],
            "each bucket its own count"
        );
        assert!((sum - 2.055).abs() < 1e-9, "{sum}");
        assert_eq!(count, 3);
    }
}
