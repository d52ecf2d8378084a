//! Where tracing goes: log lines on stderr (filtered by `FLOTILLA_LOG`, default `warn`), and
//! OpenTelemetry traces over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set. Nothing is exported otherwise, and
//! `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn export off. The exporter reads
//! the standard `OTEL_*` variables (endpoint, headers, timeout, batch settings,
//! `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`).
//!
//! Spans: `run` → `phase` → `agent` (one per call) → `attempt` on the coordinator, and
//! `attempt.run` on the worker, whose parent comes with the assignment.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The installed exporter, if any; flush it before the process ends.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
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
    if !wanted() {
        tracing_subscriber::registry().with(logs).init();
        return Telemetry { provider: None };
    }
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
    {
        Ok(e) => e,
        Err(e) => {
            tracing_subscriber::registry().with(logs).init();
            eprintln!("warning: OpenTelemetry export is off: cannot build the OTLP exporter: {e}");
            return Telemetry { provider: None };
        }
    };
    let mut resource = opentelemetry_sdk::Resource::builder();
    if !set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name(service.to_owned());
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
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
    }
}

impl Telemetry {
    /// Sends what is still buffered. The SDK's shutdown blocks, so it runs off the runtime's
    /// worker threads.
    pub async fn shutdown(self) {
        if let Some(p) = self.provider {
            let _ = tokio::task::spawn_blocking(move || {
                if let Err(e) = p.shutdown() {
                    eprintln!("warning: cannot flush OpenTelemetry spans: {e}");
                }
            })
            .await;
        }
    }
}
