//! What the client service reads of requests, before tonic decodes them.
//!
//! tonic reads a whole message into memory before a handler sees it, so the bounds on what a
//! client makes the coordinator hold come before tonic. [`Intake`] wraps the service and
//! reads the gRPC framing of each request as it arrives:
//!
//! - every message is at most its method's limit ([`limit_of`]: a launch
//!   [`LAUNCH_BYTES`], anything else [`REQUEST_BYTES`]); a larger one is refused by its
//!   announced length, before its bytes are read, with the limit and the parts' limits named;
//! - a request whose message is over [`REQUEST_BYTES`] (only a large launch can be) waits
//!   for that many bytes of [`BUDGET_BYTES`] before it is read, and holds them until its
//!   handler has answered; so at most two maximal launches are decoded and checked at once,
//!   however many arrive, and ordinary requests never wait. Once admitted, its message must
//!   arrive within [`ARRIVAL`], so a client that trickles one cannot hold the budget.
//!
//! The fields inside are checked by the handlers ([`super::sizes`]).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use flotilla_proto::ErrorKind;
use hyper::body::Frame;
use tokio::sync::Semaphore;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::codegen::{Bytes, Service};
use tonic::server::NamedService;

use crate::reads::{
    ARGS_BYTES, CARRIED_BYTES, LAUNCH_BYTES, REQUEST_BYTES, SCRIPT_BYTES, SETTINGS_BYTES,
    human_bytes, measured,
};

/// Bytes of large requests read and handled at once: two maximal launches.
pub const BUDGET_BYTES: usize = 2 * LAUNCH_BYTES;
/// How long a large request's message may take to arrive once it is admitted.
pub const ARRIVAL: Duration = Duration::from_secs(120);

const LAUNCH: &str = "/flotilla.v1.ClientService/Launch";

/// The largest message a client may send to the method at `path`.
pub fn limit_of(path: &str) -> usize {
    if path == LAUNCH {
        LAUNCH_BYTES
    } else {
        REQUEST_BYTES
    }
}

/// Why a message of `len` bytes to `path` is refused.
fn too_large(path: &str, len: usize) -> Status {
    let limit = limit_of(path);
    let method = path.rsplit('/').next().unwrap_or(path);
    let parts = if path == LAUNCH {
        format!(
            " (a script of at most {}, args of at most {} as with --args-file, settings of at most {}, and {} of carried workflows and agent definitions)",
            human_bytes(SCRIPT_BYTES),
            human_bytes(ARGS_BYTES),
            human_bytes(SETTINGS_BYTES),
            human_bytes(CARRIED_BYTES)
        )
    } else {
        String::new()
    };
    ErrorKind::Invalid.status(format!(
        "the {method} request is {}, over the limit of {}{parts}: send less",
        measured(len),
        human_bytes(limit)
    ))
}

/// The client service behind the intake's bounds.
#[derive(Clone)]
pub struct Intake<S> {
    inner: S,
    budget: Arc<Semaphore>,
}

impl<S> Intake<S> {
    pub fn new(inner: S) -> Self {
        Intake {
            inner,
            budget: Arc::new(Semaphore::new(BUDGET_BYTES >> 10)),
        }
    }
}

impl<S: NamedService> NamedService for Intake<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<Request<Body>> for Intake<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The clone that was made ready is the one called.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let budget = self.budget.clone();
        Box::pin(async move {
            let path = req.uri().path().to_owned();
            let (parts, body) = req.into_parts();
            let mut framed = Framed::new(body, path.clone());
            let first = match framed.first_len().await {
                Ok(len) => len,
                Err(status) => return Ok(status.into_http()),
            };
            let _held = if first > REQUEST_BYTES {
                let kib = u32::try_from(first.div_ceil(1 << 10)).unwrap_or(u32::MAX);
                let Ok(permit) = budget.acquire_many_owned(kib).await else {
                    return Ok(ErrorKind::Unavailable
                        .status("the coordinator is shutting down; try again")
                        .into_http());
                };
                framed.deadline = Some(Box::pin(tokio::time::sleep(ARRIVAL)));
                Some(permit)
            } else {
                None
            };
            inner
                .call(Request::from_parts(parts, Body::new(framed)))
                .await
        })
    }
}

/// A request body whose gRPC messages are checked against their method's limit as they
/// arrive (the 5-byte prefix of each gives its length).
struct Framed {
    inner: Body,
    path: String,
    /// Frames read ahead (to learn the first message's length), given out first.
    ahead: VecDeque<Bytes>,
    /// Bytes of the current message still to come; then a prefix.
    left: usize,
    prefix: [u8; 5],
    have: usize,
    first: Option<usize>,
    ended: bool,
    /// Once admitted as large: when the message must have arrived.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Framed {
    fn new(inner: Body, path: String) -> Self {
        Framed {
            inner,
            path,
            ahead: VecDeque::new(),
            left: 0,
            prefix: [0; 5],
            have: 0,
            first: None,
            ended: false,
            deadline: None,
        }
    }

    /// Follows the framing through `data`; `Err` at a message over the limit.
    fn scan(&mut self, data: &[u8]) -> Result<(), Status> {
        let mut i = 0;
        while i < data.len() {
            if self.left > 0 {
                let take = self.left.min(data.len() - i);
                self.left -= take;
                i += take;
                continue;
            }
            self.prefix[self.have] = data[i];
            self.have += 1;
            i += 1;
            if self.have == self.prefix.len() {
                self.have = 0;
                let [_, a, b, c, d] = self.prefix;
                let len = u32::from_be_bytes([a, b, c, d]) as usize;
                if len > limit_of(&self.path) {
                    return Err(too_large(&self.path, len));
                }
                self.first.get_or_insert(len);
                self.left = len;
            }
        }
        Ok(())
    }

    /// The length the first message announces (0 for a request without one), reading ahead
    /// as far as its prefix.
    async fn first_len(&mut self) -> Result<usize, Status> {
        use tonic::codegen::Body as _;
        while self.first.is_none() && !self.ended {
            let next = std::future::poll_fn(|cx| Pin::new(&mut self.inner).poll_frame(cx)).await;
            match next {
                None => self.ended = true,
                Some(Err(e)) => return Err(e),
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        self.scan(data)?;
                        self.ahead.push_back(data.clone());
                    }
                }
            }
        }
        Ok(self.first.unwrap_or(0))
    }
}

impl tonic::codegen::Body for Framed {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(data) = self.ahead.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if self.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && let Err(e) = self.scan(data)
                {
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(other) => Poll::Ready(other),
            Poll::Pending => {
                let late = self
                    .deadline
                    .as_mut()
                    .is_some_and(|d| d.as_mut().poll(cx).is_ready());
                if late {
                    return Poll::Ready(Some(Err(ErrorKind::Unavailable.status(format!(
                        "the request did not arrive within {}s of being admitted; send it again over a faster link",
                        ARRIVAL.as_secs()
                    )))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.is_empty() && (self.ended || self.inner.is_end_stream())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn framed(path: &str) -> Framed {
        Framed::new(Body::empty(), path.into())
    }

    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m
    }

    #[test]
    fn the_framing_is_followed_across_chunks_and_a_large_message_is_refused_by_its_prefix() {
        let mut f = framed("/flotilla.v1.ClientService/Status");
        let mut bytes = message(3);
        bytes.extend_from_slice(b"abc");
        bytes.extend(message(REQUEST_BYTES));
        // In chunks of one byte: prefixes split across frames are put together.
        for b in &bytes {
            f.scan(std::slice::from_ref(b)).unwrap();
        }
        assert_eq!(f.first, Some(3));
        assert_eq!(f.left, REQUEST_BYTES);
        let mut g = framed("/flotilla.v1.ClientService/Status");
        let e = g.scan(&message(REQUEST_BYTES + 1)).unwrap_err();
        assert!(
            e.message().contains("the Status request is 4194305 bytes")
                && e.message().contains("over the limit of 4 MiB"),
            "{e:?}"
        );
        let mut l = framed(LAUNCH);
        l.scan(&message(LAUNCH_BYTES)).unwrap();
        let e = framed(LAUNCH).scan(&message(200_000_000)).unwrap_err();
        assert!(
            e.message()
                .contains("the Launch request is 200000000 bytes")
                && e.message().contains("args of at most 16 MiB"),
            "{e:?}"
        );
    }
}
