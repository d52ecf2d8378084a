//! Where tracing goes: log lines on stderr (filtered by `FLOTILLA_LOG`, default `warn`), and
//! OpenTelemetry traces over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set. Nothing is exported otherwise, and
//! `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn export off. The exporter follows
//! the standard `OTEL_*` variables: `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` (`grpc`, the
//! default, or `http/protobuf`), endpoints, `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`, timeout,
//! batch settings, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`. A batch it cannot deliver
//! is counted (`flotilla_trace_spans_dropped_total`) and said once on stderr, then again at
//! most every ten minutes while it goes on.
//!
//! Spans: `run {workflow}` → `phase` → `agent` (one per call) → `invoke_agent {label}` (one
//! per attempt, in the GenAI conventions) on the coordinator, and `attempt.run` on the worker,
//! whose parent comes with the assignment.
//!
//! Metrics go over OTLP too with the same endpoint (or `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`),
//! unless `OTEL_METRICS_EXPORTER=none`: the coordinator's `gen_ai.client.token.usage` and
//! `gen_ai.client.operation.duration` (one operation per attempt) and `flotilla.attempts`,
//! pushed every `OTEL_METRIC_EXPORT_INTERVAL` ms.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// What `--help` of the coordinator and the worker says of logs, traces and metrics.
pub const HELP: &str = "\
Logs, traces and metrics:
  FLOTILLA_LOG                     what goes to stderr (a tracing filter: warn, info, flotilla_coordinator=debug...) [default: warn]
  OTEL_EXPORTER_OTLP_ENDPOINT      export OpenTelemetry traces over OTLP to this collector (…_TRACES_ENDPOINT: traces only); none is sent without it
  OTEL_EXPORTER_OTLP_PROTOCOL      grpc (port 4317) or http/protobuf (port 4318) [default: grpc]
  OTEL_EXPORTER_OTLP_HEADERS       key=value,... sent with each export (an API key of a hosted backend)
  OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES   name and attributes of this process in traces
  OTEL_METRIC_EXPORT_INTERVAL      ms between OTLP metrics pushes (gen_ai.client.token.usage, gen_ai.client.operation.duration, flotilla.attempts) [default: 60000]
  OTEL_METRICS_EXPORTER=none       traces but no OTLP metrics (…_METRICS_ENDPOINT, …_METRICS_PROTOCOL: metrics only)
  OTEL_SDK_DISABLED=true           no export even with an endpoint
Spans follow the OpenTelemetry GenAI conventions (invoke_agent per attempt, gen_ai.* attributes).
--metrics-listen ADDR serves Prometheus metrics with no sign-in; bind it to a private address.";

/// The installed exporters, if any; flush them before the process ends.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    meters: Option<opentelemetry_sdk::metrics::SdkMeterProvider>,
}

fn set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.trim().is_empty())
}

fn wanted() -> bool {
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
        || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.eq_ignore_ascii_case("none"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Installs the subscriber. Call inside the tokio runtime (the exporter's channel needs it).
/// `service` names this process in traces unless `OTEL_SERVICE_NAME` says otherwise.
pub fn init(service: &str) -> Telemetry {
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            tracing_subscriber::EnvFilter::try_from_env("FLOTILLA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        );
    let meters = meters_wanted()
        .then(|| meter_provider(service))
        .and_then(|m| {
            m.map_err(|e| eprintln!("warning: OpenTelemetry metrics are off: {}", e.message))
                .ok()
        });
    if let Some(m) = &meters {
        opentelemetry::global::set_meter_provider(m.clone());
        flotilla_proto::traces::METRICS_ON.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    if !wanted() {
        tracing_subscriber::registry().with(logs).init();
        return Telemetry {
            provider: None,
            meters,
        };
    }
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let exporter = match exporter() {
        Ok(e) => e,
        Err(e) => {
            tracing_subscriber::registry().with(logs).init();
            eprintln!("warning: OpenTelemetry export is off: {}", e.message);
            return Telemetry {
                provider: None,
                meters,
            };
        }
    };
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource(service))
        .build();
    let tracer = provider.tracer("flotilla");
    // Only this project's spans, at info and above, become trace spans.
    let spans = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_target("flotilla_coordinator", tracing::Level::INFO)
                .with_target("flotilla_worker", tracing::Level::INFO),
        );
    tracing_subscriber::registry().with(logs).with(spans).init();
    Telemetry {
        provider: Some(provider),
        meters,
    }
}

/// This process in traces and metrics: `service` unless `OTEL_SERVICE_NAME` says otherwise,
/// with `OTEL_RESOURCE_ATTRIBUTES`.
fn resource(service: &str) -> opentelemetry_sdk::Resource {
    let mut resource = opentelemetry_sdk::Resource::builder();
    if !set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name(service.to_owned());
    }
    resource.build()
}

fn meters_wanted() -> bool {
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
        || std::env::var("OTEL_METRICS_EXPORTER").is_ok_and(|v| v.eq_ignore_ascii_case("none"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))
}

/// OTLP metrics of the protocol asked for (`OTEL_EXPORTER_OTLP_METRICS_PROTOCOL`, else the
/// general one), pushed every `OTEL_METRIC_EXPORT_INTERVAL` ms [default: 60 s].
fn meter_provider(
    service: &str,
) -> Result<opentelemetry_sdk::metrics::SdkMeterProvider, flotilla_proto::Problem> {
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    let built = match protocol_of("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL").as_str() {
        "grpc" => opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .build(),
        "http/protobuf" => opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build(),
        other => {
            return Err(flotilla_proto::Problem::invalid(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={other:?} is not one this build speaks; set it to grpc or http/protobuf"
            )));
        }
    };
    let inner = built.map_err(|e| {
        flotilla_proto::Problem::invalid(format!("cannot build the OTLP metrics exporter: {e}"))
    })?;
    let exporter = OnRuntime {
        inner,
        runtime: tokio::runtime::Handle::current(),
        warned: std::sync::Mutex::new(None),
    };
    let reader = opentelemetry_sdk::metrics::PeriodicReader::builder(exporter).build();
    Ok(opentelemetry_sdk::metrics::SdkMeterProvider::builder()
        .with_reader(reader)
        .with_resource(resource(service))
        .build())
}

/// The OTLP metrics exporter, run on the process's runtime (the reader calls from a thread of
/// its own, and the HTTP client needs the runtime's reactor); a failed export is said on
/// stderr once, then at most every ten minutes while failures go on.
#[derive(Debug)]
struct OnRuntime {
    inner: opentelemetry_otlp::MetricExporter,
    runtime: tokio::runtime::Handle,
    warned: std::sync::Mutex<Option<std::time::Instant>>,
}

impl opentelemetry_sdk::metrics::exporter::PushMetricExporter for OnRuntime {
    async fn export(
        &self,
        metrics: &opentelemetry_sdk::metrics::data::ResourceMetrics,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        let result = self.runtime.block_on(self.inner.export(metrics));
        if let Err(e) = &result {
            let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
            if warned.is_none_or(|at| at.elapsed() >= std::time::Duration::from_secs(600)) {
                *warned = Some(std::time::Instant::now());
                eprintln!(
                    "warning: cannot export metrics to the OpenTelemetry collector ({e}); check OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_PROTOCOL"
                );
            }
        }
        result
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> opentelemetry_sdk::metrics::Temporality {
        self.inner.temporality()
    }
}

/// The protocol the OTel variables ask for: the traces' own, else the general one.
fn protocol() -> String {
    protocol_of("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
}

/// The protocol a signal's variable (`own`) asks for, else the general one, else grpc.
fn protocol_of(own: &str) -> String {
    [own, "OTEL_EXPORTER_OTLP_PROTOCOL"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
        .map_or_else(|| "grpc".to_owned(), |v| v.trim().to_ascii_lowercase())
}

/// The OTLP exporter of the protocol asked for, watched ([`Watched`]).
fn exporter() -> Result<Watched, flotilla_proto::Problem> {
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    let built = match protocol().as_str() {
        "grpc" => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build(),
        "http/protobuf" => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build(),
        other => {
            return Err(flotilla_proto::Problem::invalid(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={other:?} is not one this build speaks; set it to grpc or http/protobuf"
            )));
        }
    };
    built
        .map(|inner| Watched {
            inner: std::sync::Arc::new(inner),
            runtime: tokio::runtime::Handle::current(),
            warned: std::sync::Mutex::new(None),
        })
        .map_err(|e| {
            flotilla_proto::Problem::invalid(format!("cannot build the OTLP exporter: {e}"))
        })
}

/// The OTLP exporter, counting what it delivers and what it loses: a failed batch is counted
/// and said on stderr, once and then at most every ten minutes while failures go on. Exports
/// run on the process's runtime (the batch processor calls from a thread of its own, and the
/// HTTP client needs the runtime's reactor).
#[derive(Debug)]
struct Watched {
    inner: std::sync::Arc<opentelemetry_otlp::SpanExporter>,
    runtime: tokio::runtime::Handle,
    warned: std::sync::Mutex<Option<std::time::Instant>>,
}

impl opentelemetry_sdk::trace::SpanExporter for Watched {
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        use std::sync::atomic::Ordering::Relaxed;
        let spans = batch.len() as u64;
        let inner = self.inner.clone();
        let result = match self
            .runtime
            .spawn(async move { inner.export(batch).await })
            .await
        {
            Ok(r) => r,
            Err(e) => Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                format!("the export task ended: {e}"),
            )),
        };
        match &result {
            Ok(()) => {
                flotilla_proto::traces::SPANS_EXPORTED.fetch_add(spans, Relaxed);
            }
            Err(e) => {
                flotilla_proto::traces::EXPORT_FAILURES.fetch_add(1, Relaxed);
                let dropped =
                    flotilla_proto::traces::SPANS_DROPPED.fetch_add(spans, Relaxed) + spans;
                let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
                let due =
                    warned.is_none_or(|at| at.elapsed() >= std::time::Duration::from_secs(600));
                if due {
                    *warned = Some(std::time::Instant::now());
                    eprintln!(
                        "warning: cannot export traces to the OpenTelemetry collector ({e}); {dropped} spans dropped so far (flotilla_trace_spans_dropped_total); check OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_PROTOCOL"
                    );
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        // Called once, before the first export: nothing else holds the exporter yet.
        if let Some(inner) = std::sync::Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}

impl Telemetry {
    /// Sends what is still buffered. The SDK's shutdown blocks, so it runs off the runtime's
    /// worker threads.
    pub async fn shutdown(self) {
        let Telemetry { provider, meters } = self;
        let _ = tokio::task::spawn_blocking(move || {
            if let Some(p) = provider
                && let Err(e) = p.shutdown()
            {
                eprintln!("warning: cannot flush OpenTelemetry spans: {e}");
            }
            if let Some(m) = meters
                && let Err(e) = m.shutdown()
            {
                eprintln!("warning: cannot flush OpenTelemetry metrics: {e}");
            }
        })
        .await;
    }
}
