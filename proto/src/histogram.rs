//! A Prometheus histogram of durations in plain atomics: recording is a few relaxed adds on
//! hot paths and never locks; [`Histogram::render`] writes the text exposition format. The
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

    /// The histogram's lines: cumulative buckets, sum and count.
    pub fn render(&self, name: &str, help: &str) -> String {
        let mut out = format!("# HELP {name} {help}\n# TYPE {name} histogram\n");
        let mut total = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            total += self.buckets[i].load(Ordering::Relaxed);
            out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {total}\n"));
        }
        total += self.buckets[self.bounds.len()].load(Ordering::Relaxed);
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {total}\n"));
        out.push_str(&format!(
            "{name}_sum {}\n{name}_count {total}\n",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
        ));
        out
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
    fn buckets_are_cumulative_and_sum_in_seconds() {
        static H: Histogram = Histogram::new(&[0.01, 0.1]);
        H.observe(Duration::from_millis(5));
        H.observe(Duration::from_millis(50));
        H.observe(Duration::from_secs(2));
        let text = H.render("x", "help");
        assert!(text.contains("x_bucket{le=\"0.01\"} 1\n"), "{text}");
        assert!(text.contains("x_bucket{le=\"0.1\"} 2\n"), "{text}");
        assert!(text.contains("x_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(text.contains("x_sum 2.055\n"), "{text}");
        assert!(text.contains("x_count 3\n"), "{text}");
    }
}
