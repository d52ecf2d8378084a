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
    let read = limits.read;
    let router = router
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
        ));
    let tracker = TaskTracker::new();
    loop {
        let conn = tokio::select! {
            _ = cancel.cancelled() => break,
            c = listener.accept() => c,
        };
        let service = TowerToHyperService::new(router.clone());
        let cancel = cancel.clone();
        tracker.spawn(async move {
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
        });
    }
    tracker.close();
    tracker.wait().await;
}
