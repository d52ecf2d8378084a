//! The page listener's server: HTTP/1 on a [`Limited`] listener, where a slow client costs
//! one connection for a bounded time.
//!
//! A request's headers must arrive within [`ConnLimits::read`] of its first byte (hyper's header
//! timeout), and then its body within as long again ([`ReadBy`]); a connection that trickles
//! bytes is closed at the deadline even though it is never idle. Bodies of more than
//! [`MAX_BODY_BYTES`] are refused. The same server carries the fleet's pages and the embedded
//! `run --serve` page.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::time::Sleep;
use tokio_util::task::TaskTracker;

use axum::Router;
use tokio_util::sync::CancellationToken;

use crate::listen::{ConnLimits, Limited};

/// The largest request body a page takes (a control action is a few dozen bytes).
pub const MAX_BODY_BYTES: usize = 64 << 10;

/// A request body that must arrive whole by a deadline.
struct ReadBy {
    inner: Body,
    deadline: Pin<Box<Sleep>>,
    limit: Duration,
}

impl HttpBody for ReadBy {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame),
            Poll::Pending if self.deadline.as_mut().poll(cx).is_ready() => {
                Poll::Ready(Some(Err(axum::Error::new(format!(
                    "the request body did not arrive within {:?}",
                    self.limit
                )))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Serves `router` on `listener` until `cancel` fires, then lets open requests finish.
pub async fn serve_router(listener: Limited, router: Router, cancel: CancellationToken) {
    let limits: ConnLimits = listener.limits();
    let router = bounded(router, limits.read);
    let tracker = TaskTracker::new();
    loop {
        let conn = tokio::select! {
            _ = cancel.cancelled() => break,
            c = listener.accept() => c,
        };
        tracker.spawn(serve_conn(
            conn,
            router.clone(),
            limits.read,
            cancel.clone(),
        ));
    }
    tracker.close();
    tracker.wait().await;
}

/// Serves `router` over mutual TLS on `listener` (`config` asks every client for a
/// certificate of its CA) until `cancel` fires, then lets open requests finish. The
/// listener's limits hold as for [`serve_router`], the handshake's timeout too.
pub async fn serve_router_tls(
    listener: tokio::net::TcpListener,
    config: std::sync::Arc<tokio_rustls::rustls::ServerConfig>,
    limits: ConnLimits,
    router: Router,
    cancel: CancellationToken,
) {
    use futures::StreamExt;
    // This server speaks HTTP/1.1: say so, whatever the config offered (gRPC's is h2).
    let mut config = (*config).clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let config = std::sync::Arc::new(config);
    let router = bounded(router, limits.read);
    let tracker = TaskTracker::new();
    let mut incoming = crate::listen::tls(listener, config, limits, cancel.clone(), &tracker);
    loop {
        let conn = tokio::select! {
            _ = cancel.cancelled() => break,
            c = incoming.next() => match c {
                Some(Ok(conn)) => conn,
                Some(Err(_)) => continue,
                None => break,
            },
        };
        tracker.spawn(serve_conn(
            conn,
            router.clone(),
            limits.read,
            cancel.clone(),
        ));
    }
    tracker.close();
    tracker.wait().await;
}

/// `router` with the request bounds: a body of at most [`MAX_BODY_BYTES`], whole within `read`.
fn bounded(router: Router, read: Duration) -> Router {
    router
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::map_request(
            move |req: axum::extract::Request| async move {
                req.map(|inner| {
                    Body::new(ReadBy {
                        inner,
                        deadline: Box::pin(tokio::time::sleep(read)),
                        limit: read,
                    })
                })
            },
        ))
}

/// One connection's HTTP/1, its headers within `read`, until it ends or `cancel` fires (then
/// its open request finishes).
async fn serve_conn<C>(conn: C, router: Router, read: Duration, cancel: CancellationToken)
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = TowerToHyperService::new(router);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(read);
    let served = http.serve_connection(TokioIo::new(conn), service);
    tokio::pin!(served);
    tokio::select! {
        _ = served.as_mut() => {}
        _ = cancel.cancelled() => {
            served.as_mut().graceful_shutdown();
            let _ = served.await;
        }
    }
}
