//! Process-wide counters and histograms for `/metrics` (Prometheus text format), fed by the
//! dispatcher, the worker leases and the object store. Plain atomics: recording is a few
//! relaxed adds on hot paths, and nothing here locks.

use std::sync::atomic::{AtomicU64, Ordering};

pub use flotilla_proto::histogram::Histogram;
use flotilla_proto::histogram::LATENCY_SECONDS as LATENCY;

/// From a call being ready to run to its attempt's assignment going to a worker.
pub static DISPATCH_LATENCY: Histogram = Histogram::new(LATENCY);
/// One object-store write, retries included (kept by the store's write meter).
pub use crate::store::metered::WRITE_LATENCY as STORAGE_WRITE_LATENCY;

/// Attempts ended by the stall watchdog (W58).
pub static STALLS: AtomicU64 = AtomicU64::new(0);
/// Calls started again, by reason.
pub static RESTARTS_STALL: AtomicU64 = AtomicU64::new(0);
pub static RESTARTS_TRANSIENT: AtomicU64 = AtomicU64::new(0);
pub static RESTARTS_USER: AtomicU64 = AtomicU64::new(0);
pub static RESTARTS_LAPSE: AtomicU64 = AtomicU64::new(0);
/// Attempts a provider refused for rate or load (429, 529), each waited out.
pub static THROTTLES: AtomicU64 = AtomicU64::new(0);
/// Failed renewals of a worker's lease (each retried).
pub static LEASE_RENEWAL_FAILURES: AtomicU64 = AtomicU64::new(0);
/// Failed object-store writes that were retried (counted by the store's retry layer).
pub use crate::store::metered::WRITE_RETRIES as STORAGE_WRITE_RETRIES;
/// Messages from workers that named no attempt they hold (dropped; nothing of them counted).
pub static WORKER_STRAYS: AtomicU64 = AtomicU64::new(0);
/// Usage reports from workers above what one attempt can use (clipped before counting).
pub static USAGE_CLIPPED: AtomicU64 = AtomicU64::new(0);

pub fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}
