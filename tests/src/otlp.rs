//! An in-process OTLP receiver on loopback, over gRPC (`TraceService` and `MetricsService` from
//! `opentelemetry-proto`) or HTTP (`http/protobuf`): it keeps every span and every metric data
//! point it is sent, flattened for assertions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;

/// One received data point of a histogram or a sum.
#[derive(Debug, Clone)]
pub struct MetricPoint {
    pub service: String,
    pub name: String,
    pub unit: String,
    pub attributes: HashMap<String, String>,
    /// A histogram's sum, or a sum's value.
    pub value: f64,
    /// A histogram's count (1 for a sum's point).
    pub count: u64,
}

/// One received span.
#[derive(Debug, Clone)]
pub struct SpanRecord {
    /// `service.name` of the process that sent it.
    pub service: String,
    pub name: String,
    pub trace_id: Vec<u8>,
    pub span_id: Vec<u8>,
    pub parent_span_id: Vec<u8>,
    pub attributes: HashMap<String, String>,
}

#[derive(Clone, Default)]
struct Svc {
    spans: Arc<Mutex<Vec<SpanRecord>>>,
    points: Arc<Mutex<Vec<MetricPoint>>>,
}

fn service_of(r: Option<&opentelemetry_proto::tonic::resource::v1::Resource>) -> String {
    r.iter()
        .flat_map(|r| r.attributes.iter())
        .find(|kv| kv.key == "service.name")
        .map(|kv| text(kv.value.as_ref()))
        .unwrap_or_default()
}

fn attrs(kvs: &[opentelemetry_proto::tonic::common::v1::KeyValue]) -> HashMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
        .collect()
}

impl Svc {
    /// Keeps the histogram and sum points of one metrics export request.
    fn keep_metrics(&self, req: ExportMetricsServiceRequest) {
        use opentelemetry_proto::tonic::metrics::v1::metric::Data;
        use opentelemetry_proto::tonic::metrics::v1::number_data_point::Value as Num;
        let mut got = Vec::new();
        for rm in req.resource_metrics {
            let service = service_of(rm.resource.as_ref());
            for sm in rm.scope_metrics {
                for m in sm.metrics {
                    let point = |attributes, value, count| MetricPoint {
                        service: service.clone(),
                        name: m.name.clone(),
                        unit: m.unit.clone(),
                        attributes,
                        value,
                        count,
                    };
                    match &m.data {
                        Some(Data::Histogram(h)) => {
                            for p in &h.data_points {
                                got.push(point(
                                    attrs(&p.attributes),
                                    p.sum.unwrap_or(0.0),
                                    p.count,
                                ));
                            }
                        }
                        Some(Data::Sum(s)) => {
                            for p in &s.data_points {
                                let v = match p.value {
                                    Some(Num::AsInt(i)) => i as f64,
                                    Some(Num::AsDouble(d)) => d,
                                    None => 0.0,
                                };
                                got.push(point(attrs(&p.attributes), v, 1));
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        self.points
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(got);
    }
}

#[tonic::async_trait]
impl MetricsService for Svc {
    async fn export(
        &self,
        req: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.keep_metrics(req.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}

/// OTLP metrics over HTTP: `POST /v1/metrics` with a protobuf body.
async fn http_metrics(
    axum::extract::State(svc): axum::extract::State<Svc>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> (axum::http::StatusCode, Vec<u8>) {
    use prost::Message;
    let protobuf = headers
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes() == b"application/x-protobuf");
    if !protobuf {
        return (axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE, Vec::new());
    }
    match ExportMetricsServiceRequest::decode(body) {
        Ok(req) => {
            svc.keep_metrics(req);
            let reply = ExportMetricsServiceResponse {
                partial_success: None,
            };
            (axum::http::StatusCode::OK, reply.encode_to_vec())
        }
        Err(_) => (axum::http::StatusCode::BAD_REQUEST, Vec::new()),
    }
}

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Any::StringValue(s)) => s.clone(),
        Some(Any::IntValue(i)) => i.to_string(),
        Some(Any::BoolValue(b)) => b.to_string(),
        Some(Any::DoubleValue(d)) => d.to_string(),
        _ => String::new(),
    }
}

impl Svc {
    /// Keeps the spans of one export request.
    fn keep(&self, req: ExportTraceServiceRequest) {
        let mut got = Vec::new();
        for rs in req.resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .map(|kv| text(kv.value.as_ref()))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(SpanRecord {
                        service: service.clone(),
                        name: s.name,
                        trace_id: s.trace_id,
                        span_id: s.span_id,
                        parent_span_id: s.parent_span_id,
                        attributes: s
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                            .collect(),
                    });
                }
            }
        }
        self.spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(got);
    }
}

#[tonic::async_trait]
impl TraceService for Svc {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.keep(req.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// OTLP over HTTP: `POST /v1/traces` with a protobuf body (`http/protobuf`); anything else is
/// refused, so a test sees which encoding came.
async fn http_export(
    axum::extract::State(svc): axum::extract::State<Svc>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> (axum::http::StatusCode, Vec<u8>) {
    use prost::Message;
    let protobuf = headers
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes() == b"application/x-protobuf");
    if !protobuf {
        return (axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE, Vec::new());
    }
    match ExportTraceServiceRequest::decode(body) {
        Ok(req) => {
            svc.keep(req);
            let reply = ExportTraceServiceResponse {
                partial_success: None,
            };
            (axum::http::StatusCode::OK, reply.encode_to_vec())
        }
        Err(_) => (axum::http::StatusCode::BAD_REQUEST, Vec::new()),
    }
}

/// The running receiver; stops when dropped.
pub struct Receiver {
    pub port: u16,
    spans: Arc<Mutex<Vec<SpanRecord>>>,
    points: Arc<Mutex<Vec<MetricPoint>>>,
    _rt: tokio::runtime::Runtime,
}

impl Receiver {
    /// A receiver of OTLP over gRPC (`TraceService`).
    pub fn start() -> Receiver {
        Receiver::serving(|listener, svc| async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(svc.clone()))
                .add_service(MetricsServiceServer::new(svc))
                .serve_with_incoming(incoming)
                .await;
        })
    }

    /// A receiver of OTLP over HTTP (`http/protobuf`, `POST /v1/traces`).
    pub fn start_http() -> Receiver {
        Receiver::serving(|listener, svc| async move {
            let app = axum::Router::new()
                .route("/v1/traces", axum::routing::post(http_export))
                .route("/v1/metrics", axum::routing::post(http_metrics))
                .with_state(svc);
            let _ = axum::serve(listener, app).await;
        })
    }

    /// A loopback listener on a runtime of its own, served by what `serve` makes of it.
    fn serving<F>(serve: impl FnOnce(tokio::net::TcpListener, Svc) -> F) -> Receiver
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime for the receiver");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind the OTLP receiver");
        let port = listener.local_addr().expect("address").port();
        let svc = Svc::default();
        let (spans, points) = (svc.spans.clone(), svc.points.clone());
        rt.spawn(serve(listener, svc));
        Receiver {
            port,
            spans,
            points,
            _rt: rt,
        }
    }

    /// `http://127.0.0.1:PORT`, for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every metric point received so far.
    pub fn points(&self) -> Vec<MetricPoint> {
        self.points
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The points received, once `ready` says all it waits for are there (within 20 s).
    pub fn points_when(&self, ready: impl Fn(&[MetricPoint]) -> bool) -> Vec<MetricPoint> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let all = self.points();
            if ready(&all) {
                return all;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "metrics never arrived; have {:?}",
                all.iter()
                    .map(|p| &p.name)
                    .collect::<std::collections::BTreeSet<_>>()
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    pub fn spans(&self) -> Vec<SpanRecord> {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The spans of run `run` (their `flotilla.run_id`), and the spans under them, once
    /// `ready` says all it waits for are there (within 20 s).
    pub fn spans_of_run(
        &self,
        run: &str,
        ready: impl Fn(&[SpanRecord]) -> bool,
    ) -> Vec<SpanRecord> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let all = self.spans();
            let mut of_run: Vec<SpanRecord> = all
                .iter()
                .filter(|s| s.attributes.get("flotilla.run_id").map(String::as_str) == Some(run))
                .cloned()
                .collect();
            // Spans without the run's id (a tool call's) belong to it through their parents.
            loop {
                let more: Vec<SpanRecord> = all
                    .iter()
                    .filter(|s| {
                        !of_run.iter().any(|o| o.span_id == s.span_id)
                            && of_run.iter().any(|o| o.span_id == s.parent_span_id)
                    })
                    .cloned()
                    .collect();
                if more.is_empty() {
                    break;
                }
                of_run.extend(more);
            }
            if ready(&of_run) {
                return of_run;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "spans never arrived; have {:?}",
                of_run.iter().map(|s| &s.name).collect::<Vec<_>>()
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}
