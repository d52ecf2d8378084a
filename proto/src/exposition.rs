//! The Prometheus text exposition the coordinator and the worker serve on `/metrics`, written
//! by `prometheus-client`. Each scrape fills an [`Exposition`] with what it may show: figures
//! read at that moment become fresh families here, and the long-lived ones (the process's
//! counters and histograms) are registered by handle.

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Metric, Registry};
use std::sync::atomic::AtomicU64;

use crate::histogram::Histogram;

/// `text/plain; version=0.0.4`: what Prometheus scrapes.
pub use prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// A sample's labels, in the order they are written.
pub type Labels = Vec<(&'static str, String)>;

/// One label.
pub fn label(key: &'static str, value: impl Into<String>) -> Labels {
    vec![(key, value.into())]
}

/// The crate ends each help text with a period.
fn help(text: &str) -> &str {
    text.trim_end_matches('.')
}

/// A counter's name as the crate takes it: it writes the `_total` itself.
fn counter_name(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

/// One scrape's exposition, family by family.
#[derive(Default)]
pub struct Exposition(Registry);

impl Exposition {
    /// A family of gauges, one sample per label set of `rows`.
    pub fn gauges(
        &mut self,
        name: &str,
        text: &str,
        rows: impl IntoIterator<Item = (Labels, i64)>,
    ) {
        let family = Family::<Labels, Gauge>::default();
        for (labels, value) in rows {
            family.get_or_create(&labels).set(value);
        }
        self.0.register(name, help(text), family);
    }

    pub fn gauge(&mut self, name: &str, text: &str, value: i64) {
        let g = Gauge::<i64>::default();
        g.set(value);
        self.0.register(name, help(text), g);
    }

    /// A family of gauges with fractional values (dollars).
    pub fn float_gauges(
        &mut self,
        name: &str,
        text: &str,
        rows: impl IntoIterator<Item = (Labels, f64)>,
    ) {
        let family = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        for (labels, value) in rows {
            family.get_or_create(&labels).set(value);
        }
        self.0.register(name, help(text), family);
    }

    /// A family of counters read at this moment; `name` ends in `_total`.
    pub fn counters(
        &mut self,
        name: &str,
        text: &str,
        rows: impl IntoIterator<Item = (Labels, u64)>,
    ) {
        let family = Family::<Labels, Counter>::default();
        for (labels, value) in rows {
            family.get_or_create(&labels).inc_by(value);
        }
        self.0.register(counter_name(name), help(text), family);
    }

    pub fn counter(&mut self, name: &str, text: &str, value: u64) {
        let c = Counter::<u64>::default();
        c.inc_by(value);
        self.0.register(counter_name(name), help(text), c);
    }

    /// A family of counters with fractional values (dollars); `name` ends in `_total`.
    pub fn float_counters(
        &mut self,
        name: &str,
        text: &str,
        rows: impl IntoIterator<Item = (Labels, f64)>,
    ) {
        let family = Family::<Labels, Counter<f64, AtomicU64>>::default();
        for (labels, value) in rows {
            family.get_or_create(&labels).inc_by(value);
        }
        self.0.register(counter_name(name), help(text), family);
    }

    /// One of the process's lock-free histograms.
    pub fn histogram(&mut self, name: &str, text: &str, h: &'static Histogram) {
        self.0.register(name, help(text), Held(h));
    }

    /// A long-lived metric (a family of the crate's counters or histograms), by handle; a
    /// counter's `name` ends in `_total`.
    pub fn metric(&mut self, name: &str, text: &str, m: impl Metric) {
        let name = if m.metric_type() == MetricType::Counter {
            counter_name(name)
        } else {
            name
        };
        self.0.register(name, help(text), m);
    }

    /// What every Flotilla process says of itself: its build (version and commit) and what
    /// became of its trace export.
    pub fn process(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.gauges(
            "flotilla_build_info",
            "The build this process runs: its version and commit (always 1).",
            [(
                vec![
                    ("version", env!("CARGO_PKG_VERSION").into()),
                    ("commit", crate::build::commit().into()),
                ],
                1,
            )],
        );
        let t = &crate::traces::SPANS_EXPORTED;
        self.counter(
            "flotilla_trace_spans_exported_total",
            "Spans delivered to the OpenTelemetry collector (OTLP).",
            t.load(Relaxed),
        );
        self.counter(
            "flotilla_trace_spans_dropped_total",
            "Spans lost because the OTLP exporter could not deliver their batch.",
            crate::traces::SPANS_DROPPED.load(Relaxed),
        );
        self.counter(
            "flotilla_trace_export_failures_total",
            "Batches of spans the OTLP exporter could not deliver.",
            crate::traces::EXPORT_FAILURES.load(Relaxed),
        );
    }

    /// The text Prometheus reads.
    pub fn finish(self) -> String {
        let mut out = String::new();
        // Writing to a String does not fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.0);
        out
    }
}

/// A [`Histogram`] as the crate encodes one.
#[derive(Debug)]
struct Held(&'static Histogram);

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("count", &self.count())
            .finish()
    }
}

impl EncodeMetric for Held {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (buckets, sum, count) = self.0.snapshot();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn families_are_declared_once_with_escaped_labels_and_counters_end_in_total() {
        static H: Histogram = Histogram::new(&[0.5]);
        H.observe(Duration::from_millis(100));
        H.observe(Duration::from_secs(3));
        let mut e = Exposition::default();
        e.gauges("g", "A gauge.", [(label("k", "a\"b\\c"), 2)]);
        e.counters(
            "c_total",
            "A counter.",
            [(label("k", "x"), 3), (label("k", "y"), 4)],
        );
        e.float_counters("cost_total", "Dollars.", [(label("k", "x"), 0.25)]);
        e.histogram("h_seconds", "A histogram.", &H);
        let text = e.finish();
        assert!(
            text.contains("# HELP g A gauge.\n# TYPE g gauge\n"),
            "{text}"
        );
        assert!(text.contains("g{k=\"a\\\"b\\\\c\"} 2\n"), "{text}");
        assert!(text.contains("# TYPE c_total counter\n"), "{text}");
        assert!(text.contains("c_total{k=\"y\"} 4\n"), "{text}");
        assert!(text.contains("cost_total{k=\"x\"} 0.25\n"), "{text}");
        assert!(text.contains("h_seconds_bucket{le=\"0.5\"} 1\n"), "{text}");
        assert!(text.contains("h_seconds_bucket{le=\"+Inf\"} 2\n"), "{text}");
        assert!(text.contains("h_seconds_count 2\n"), "{text}");
        assert!(!text.contains(".."), "one period after a help text: {text}");
    }
}
