//! The link suite: what every worker link must do, checked the same way for the in-process
//! pair ([`link_pair`]) and for a gRPC `Attach` stream over loopback, bridged by the real
//! bridges of both ends (the worker's [`flotilla_worker::remote::link_over`], the
//! coordinator's [`bridge`]).
//!
//! A link delivers every message, in order, both ways; a message far over a gRPC frame
//! arrives whole; when either end lets go, the other end sees the link end.

use std::time::Duration;

use flotilla_proto::link::{CoordinatorEnd, Link, link_pair};
use flotilla_proto::v1::worker_service_server::{WorkerService, WorkerServiceServer};
use flotilla_proto::v1::{
    self, CoordinatorMessage, WorkerMessage, coordinator_message, outcome, worker_message,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use super::{StreamOf, bridge};

/// A gRPC server whose `Attach` hands each bridged stream's end to the test.
struct Bridged {
    ends: mpsc::UnboundedSender<CoordinatorEnd>,
}

#[tonic::async_trait]
impl WorkerService for Bridged {
    type AttachStream = StreamOf<CoordinatorMessage>;

    async fn attach(
        &self,
        req: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let mut inbound = req.into_inner();
        let first = inbound.message().await?;
        let Some(WorkerMessage {
            msg: Some(worker_message::Msg::Hello(hello)),
        }) = first
        else {
            return Err(Status::invalid_argument("Hello first"));
        };
        let (end, out) = bridge(hello, inbound, &tokio_util::task::TaskTracker::new());
        let _ = self.ends.send(end);
        Ok(Response::new(out))
    }
}

fn hello() -> WorkerMessage {
    WorkerMessage {
        msg: Some(worker_message::Msg::Hello(v1::Hello {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            name: "suite".into(),
            slots: 1,
            ..v1::Hello::default()
        })),
    }
}

/// A link that says Hello, and the coordinator's end with that Hello waiting in it. The
/// guard keeps a gRPC link's server and stream up.
type Pair = (Link, CoordinatorEnd, Option<CancellationToken>);

async fn in_process() -> Pair {
    let (link, end) = link_pair();
    link.tx.send(hello()).unwrap();
    (link, end, None)
}

async fn over_grpc() -> Pair {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (ends_tx, mut ends) = mpsc::unbounded_channel();
    let stop = CancellationToken::new();
    let server = WorkerServiceServer::new(Bridged { ends: ends_tx })
        .max_decoding_message_size(flotilla_proto::frag::MAX_FRAME_BYTES)
        .max_encoding_message_size(flotilla_proto::frag::MAX_FRAME_BYTES);
    let until = stop.clone();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(server)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                until.cancelled_owned(),
            ),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    let (link, _carried) = flotilla_worker::remote::link_over(channel, stop.child_token())
        .await
        .expect("a link");
    link.tx.send(hello()).unwrap();
    let end = within(ends.recv()).await.expect("the bridged end");
    (link, end, Some(stop))
}

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("the link answered within 30 s")
}

fn progress(call: u64) -> WorkerMessage {
    WorkerMessage {
        msg: Some(worker_message::Msg::Progress(v1::Progress {
            run_id: "wf_links".into(),
            call,
            attempt: 1,
            ..v1::Progress::default()
        })),
    }
}

fn cancel(call: u64) -> CoordinatorMessage {
    CoordinatorMessage {
        msg: Some(coordinator_message::Msg::Cancel(v1::Cancel {
            run_id: "wf_links".into(),
            call,
            attempt: 1,
            reason: format!("#{call}"),
        })),
    }
}

async fn every_message_arrives_in_order_both_ways(pair: Pair) {
    let (mut link, mut end, _guard) = pair;
    assert_eq!(
        within(end.rx.recv()).await,
        Some(hello()),
        "Hello comes first"
    );
    for call in 0..200 {
        link.tx.send(progress(call)).unwrap();
        end.tx.send(cancel(call)).unwrap();
    }
    for call in 0..200 {
        assert_eq!(within(end.rx.recv()).await, Some(progress(call)));
        assert_eq!(within(link.rx.recv()).await, Some(cancel(call)));
    }
}

async fn a_message_far_over_a_frame_arrives_whole(pair: Pair) {
    let (mut link, mut end, _guard) = pair;
    within(end.rx.recv()).await;
    let big = "x".repeat(3 * flotilla_proto::frag::MAX_FRAME_BYTES / 2 + 12_345);
    let done = WorkerMessage {
        msg: Some(worker_message::Msg::Outcome(v1::Outcome {
            run_id: "wf_links".into(),
            call: 7,
            attempt: 1,
            result: Some(outcome::Result::Completed(v1::Completed {
                text: big.clone(),
                json: None,
                change: None,
                model: String::new(),
            })),
            ..v1::Outcome::default()
        })),
    };
    link.tx.send(done.clone()).unwrap();
    link.tx.send(progress(8)).unwrap();
    assert_eq!(within(end.rx.recv()).await, Some(done));
    assert_eq!(
        within(end.rx.recv()).await,
        Some(progress(8)),
        "and the next one after it"
    );
    let assign = CoordinatorMessage {
        msg: Some(coordinator_message::Msg::Assign(v1::Assignment {
            run_id: "wf_links".into(),
            call: 9,
            attempt: 1,
            task: Some(v1::TaskSpec {
                prompt: big,
                ..v1::TaskSpec::default()
            }),
            ..v1::Assignment::default()
        })),
    };
    end.tx.send(assign.clone()).unwrap();
    end.tx.send(cancel(10)).unwrap();
    assert_eq!(within(link.rx.recv()).await, Some(assign));
    assert_eq!(within(link.rx.recv()).await, Some(cancel(10)));
}

async fn a_worker_that_lets_go_ends_the_link_for_the_coordinator(pair: Pair) {
    let (link, mut end, _guard) = pair;
    within(end.rx.recv()).await;
    link.tx.send(progress(1)).unwrap();
    drop(link);
    assert_eq!(
        within(end.rx.recv()).await,
        Some(progress(1)),
        "what was sent arrives"
    );
    assert_eq!(within(end.rx.recv()).await, None, "then the link ends");
}

async fn a_coordinator_that_lets_go_ends_the_link_for_the_worker(pair: Pair) {
    let (mut link, mut end, _guard) = pair;
    within(end.rx.recv()).await;
    end.tx.send(cancel(1)).unwrap();
    drop(end);
    assert_eq!(
        within(link.rx.recv()).await,
        Some(cancel(1)),
        "what was sent arrives"
    );
    assert_eq!(within(link.rx.recv()).await, None, "then the link ends");
}

/// Runs each rule on a fresh pair of the kind `make` builds.
async fn conforms<F, Fut>(make: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Pair>,
{
    every_message_arrives_in_order_both_ways(make().await).await;
    a_message_far_over_a_frame_arrives_whole(make().await).await;
    a_worker_that_lets_go_ends_the_link_for_the_coordinator(make().await).await;
    a_coordinator_that_lets_go_ends_the_link_for_the_worker(make().await).await;
}

#[tokio::test]
async fn the_in_process_link_conforms() {
    conforms(in_process).await;
}

#[tokio::test]
async fn a_grpc_link_over_loopback_conforms() {
    flotilla_proto::tls::install_crypto_provider();
    conforms(over_grpc).await;
}
