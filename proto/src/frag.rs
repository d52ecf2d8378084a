//! Size limits of the worker stream, and the fragments that carry big messages over it.
//!
//! gRPC refuses a frame over its decode limit and ends the whole stream, so one big prompt or
//! result would take the link down with every attempt on it. Instead:
//! - every frame on the worker stream is at most [`MAX_FRAME_BYTES`] (set explicitly on both
//!   ends, so no default decides it);
//! - a message whose encoding is over [`FRAGMENT_BYTES`] travels as [`v1::Fragment`]s
//!   ([`Splitter`]) and is put back together on the other end ([`Reassembler`]);
//! - no message is over [`MAX_MESSAGE_BYTES`]: the worker turns a bigger result into a
//!   failure of that one call ([`fit_outcome`]), the coordinator refuses a bigger `agent()`
//!   call before it is queued, and transcript events are cut to [`MAX_EVENT_BYTES`].
//!
//! Fragments of one message are sent back to back on one ordered stream, so a receiver holds
//! at most one message in pieces; a sequence that is over the limit or malformed is dropped
//! (and said so) without touching the stream.

use crate::Problem;
use prost::Message;

use crate::v1::{self, CoordinatorMessage, WorkerMessage, coordinator_message, worker_message};

/// A message bigger than this, encoded, is sent in fragments of this size.
pub const FRAGMENT_BYTES: usize = 1 << 20;
/// The gRPC decode and encode limit of the worker stream (a fragment and its framing fit).
pub const MAX_FRAME_BYTES: usize = 4 << 20;
/// The largest message either end sends or accepts, whole: a prompt, a result, a report.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;
/// The largest conversation an interrupted attempt hands its call's next attempt
/// (`Failure.session`, `TaskSpec.session`); a larger one is not kept, and the next attempt
/// starts over.
pub const MAX_SESSION_BYTES: usize = 32 << 20;
/// The largest transcript event a worker sends; a bigger one is cut (the transcript is for
/// reading, the result travels whole).
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// A size in MiB for messages people read.
pub fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

/// The two stream message types, which can carry a fragment.
pub trait Framed: Message + Default + Sized {
    fn from_fragment(f: v1::Fragment) -> Self;
    /// The fragment this message carries, or the message itself.
    fn into_fragment(self) -> Result<v1::Fragment, Self>;
}

impl Framed for WorkerMessage {
    fn from_fragment(f: v1::Fragment) -> Self {
        WorkerMessage {
            msg: Some(worker_message::Msg::Fragment(f)),
        }
    }
    fn into_fragment(self) -> Result<v1::Fragment, Self> {
        match self.msg {
            Some(worker_message::Msg::Fragment(f)) => Ok(f),
            msg => Err(WorkerMessage { msg }),
        }
    }
}

impl Framed for CoordinatorMessage {
    fn from_fragment(f: v1::Fragment) -> Self {
        CoordinatorMessage {
            msg: Some(coordinator_message::Msg::Fragment(f)),
        }
    }
    fn into_fragment(self) -> Result<v1::Fragment, Self> {
        match self.msg {
            Some(coordinator_message::Msg::Fragment(f)) => Ok(f),
            msg => Err(CoordinatorMessage { msg }),
        }
    }
}

/// A message that cannot be sent or was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FragError {
    #[error("a message of {} is over the limit of {}", mib(*bytes), mib(*limit))]
    TooLarge { bytes: usize, limit: usize },
    #[error("malformed fragments: {0}")]
    Malformed(String),
}

/// Splits outgoing messages; one per stream (fragment ids count up).
#[derive(Debug, Default)]
pub struct Splitter {
    next_id: u64,
}

impl Splitter {
    /// The message itself when it is small, else its fragments in order.
    pub fn split<M: Framed>(&mut self, msg: M) -> Result<Vec<M>, FragError> {
        let mut out = std::collections::VecDeque::new();
        self.split_into(msg, &mut out)?;
        Ok(out.into())
    }

    /// [`Splitter::split`] onto the end of `out` (which keeps its room from one message to
    /// the next).
    pub fn split_into<M: Framed>(
        &mut self,
        msg: M,
        out: &mut std::collections::VecDeque<M>,
    ) -> Result<(), FragError> {
        let len = msg.encoded_len();
        if len <= FRAGMENT_BYTES {
            out.push_back(msg);
            return Ok(());
        }
        if len > MAX_MESSAGE_BYTES {
            return Err(FragError::TooLarge {
                bytes: len,
                limit: MAX_MESSAGE_BYTES,
            });
        }
        self.next_id += 1;
        let bytes = msg.encode_to_vec();
        let n = bytes.len().div_ceil(FRAGMENT_BYTES);
        out.extend(bytes.chunks(FRAGMENT_BYTES).enumerate().map(|(i, data)| {
            M::from_fragment(v1::Fragment {
                id: self.next_id,
                total_bytes: len as u64,
                data: data.to_vec(),
                last: i + 1 == n,
            })
        }));
        Ok(())
    }
}

/// The messages of a channel, split for the wire (the gRPC bridge's outgoing side): a stream
/// polled by the connection itself, so a message takes no extra task or channel on its way
/// out. `to` names the peer in the log line of a message too large to send at all (which the
/// sender's own limits should never let through).
pub fn splitting<M: Framed>(
    rx: tokio::sync::mpsc::UnboundedReceiver<M>,
    to: &'static str,
) -> Splitting<M> {
    Splitting {
        rx,
        to,
        splitter: Splitter::default(),
        parts: std::collections::VecDeque::new(),
    }
}

/// See [`splitting`].
#[derive(Debug)]
pub struct Splitting<M> {
    rx: tokio::sync::mpsc::UnboundedReceiver<M>,
    to: &'static str,
    splitter: Splitter,
    /// The fragments of a big message not yet taken.
    parts: std::collections::VecDeque<M>,
}

impl<M: Framed + Unpin> tokio_stream::Stream for Splitting<M> {
    type Item = M;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<M>> {
        use std::task::Poll;
        let this = self.get_mut();
        loop {
            if let Some(p) = this.parts.pop_front() {
                return Poll::Ready(Some(p));
            }
            let Some(m) = std::task::ready!(this.rx.poll_recv(cx)) else {
                return Poll::Ready(None);
            };
            if let Err(e) = this.splitter.split_into(m, &mut this.parts) {
                tracing::error!(error = %e, to = this.to, "a message is too large to send; dropped");
            }
        }
    }
}

/// Puts incoming fragments back together; one per stream.
#[derive(Debug)]
pub struct Reassembler {
    limit: usize,
    /// The message being put together: its id, size and the bytes so far.
    current: Option<(u64, usize, Vec<u8>)>,
    /// A sequence refused as too large: its remaining fragments are dropped.
    skipping: Option<u64>,
}

impl Default for Reassembler {
    fn default() -> Self {
        Reassembler::new(MAX_MESSAGE_BYTES)
    }
}

impl Reassembler {
    pub fn new(limit: usize) -> Self {
        Reassembler {
            limit,
            current: None,
            skipping: None,
        }
    }

    /// A whole message: `msg` itself, or the message its last fragment completes. `Ok(None)`
    /// while fragments are missing; `Err` for a sequence that is dropped (once per sequence).
    pub fn push<M: Framed>(&mut self, msg: M) -> Result<Option<M>, FragError> {
        let f = match msg.into_fragment() {
            Ok(f) => f,
            Err(whole) => return Ok(Some(whole)),
        };
        if self.skipping == Some(f.id) {
            if f.last {
                self.skipping = None;
            }
            return Ok(None);
        }
        let total = usize::try_from(f.total_bytes).unwrap_or(usize::MAX);
        if total > self.limit {
            self.current = None;
            self.skipping = (!f.last).then_some(f.id);
            return Err(FragError::TooLarge {
                bytes: total,
                limit: self.limit,
            });
        }
        let (id, expected, buf) = match self.current.take() {
            Some(cur) if cur.0 == f.id => cur,
            // A new sequence (a sender that went away mid-message leaves its pieces behind).
            _ => (
                f.id,
                total,
                Vec::with_capacity(total.min(FRAGMENT_BYTES * 4)),
            ),
        };
        let mut buf = buf;
        if expected != total || buf.len() + f.data.len() > expected {
            self.skipping = (!f.last).then_some(id);
            return Err(FragError::Malformed(format!(
                "fragment {id} runs past the {expected} bytes it announced"
            )));
        }
        buf.extend_from_slice(&f.data);
        if !f.last {
            self.current = Some((id, expected, buf));
            return Ok(None);
        }
        if buf.len() != expected {
            return Err(FragError::Malformed(format!(
                "fragment {id} ended after {} of the {expected} bytes it announced",
                buf.len()
            )));
        }
        M::decode(buf.as_slice())
            .map(Some)
            .map_err(|e| FragError::Malformed(format!("fragment {id} does not decode: {e}")))
    }
}

/// An outcome that fits the stream: a completed result over `limit` becomes a terminal
/// failure of its call that says how big it was and what to do.
pub fn fit_outcome(mut o: v1::Outcome, limit: usize) -> v1::Outcome {
    let limit = limit.min(MAX_MESSAGE_BYTES);
    if o.encoded_len() > limit
        && let Some(v1::outcome::Result::Failure(f)) = o.result.as_mut()
    {
        // An unfinished attempt's conversation and leftovers are niceties: the failure goes
        // without them (the conversation first).
        f.session = None;
    }
    if o.encoded_len() > limit
        && let Some(v1::outcome::Result::Failure(f)) = o.result.as_mut()
    {
        f.partial = None;
    }
    let len = o.encoded_len();
    if len <= limit {
        return o;
    }
    o.result = Some(v1::outcome::Result::Failure(v1::Failure {
        kind: v1::FailureKind::Terminal as i32,
        message: format!(
            "the agent's result is {}, over the limit of {} for one result; have the agent write large output to files and return a summary or their paths",
            mib(len),
            mib(limit)
        ),
        retry_after_ms: 0,
        partial: None,
        session: None,
    }));
    o
}

/// Whether one agent call of `len` bytes (its prompt and options) fits the stream: `Err`
/// says how big it is and what to do. An assignment carries them twice at most (the
/// options as given and normalized) plus a few small fields.
pub fn check_call_size(len: usize) -> Result<(), Problem> {
    let limit = MAX_MESSAGE_BYTES / 2 - (64 << 10);
    if len <= limit {
        return Ok(());
    }
    Err(Problem::invalid(format!(
        "agent() prompt and options are {}, over the limit of {} for one agent call; pass a smaller prompt (for large inputs, have the agent read them from files)",
        mib(len),
        mib(limit)
    )))
}

/// A transcript event cut to [`MAX_EVENT_BYTES`] (on a character boundary, with a note).
pub fn fit_event(event: String) -> String {
    if event.len() <= MAX_EVENT_BYTES {
        return event;
    }
    let mut end = MAX_EVENT_BYTES;
    while !event.is_char_boundary(end) {
        end -= 1;
    }
    serde_json::json!({
        "type": "truncated",
        "bytes": event.len(),
        "start": &event[..end],
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn outcome(text: String) -> v1::Outcome {
        v1::Outcome {
            run_id: "wf_big".into(),
            call: 3,
            attempt: 1,
            result: Some(v1::outcome::Result::Completed(v1::Completed {
                text,
                json: None,
                change: None,
                model: String::new(),
            })),
            ..v1::Outcome::default()
        }
    }

    fn message(text: String) -> WorkerMessage {
        WorkerMessage {
            msg: Some(worker_message::Msg::Outcome(outcome(text))),
        }
    }

    #[test]
    fn a_big_message_travels_in_fragments_that_each_fit_a_frame() {
        let big = message("x".repeat(5 * FRAGMENT_BYTES + 17));
        let mut s = Splitter::default();
        let parts = s.split(big.clone()).unwrap();
        assert_eq!(parts.len(), 6);
        assert!(parts.iter().all(|p| p.encoded_len() <= MAX_FRAME_BYTES));
        let mut r = Reassembler::default();
        let mut out = Vec::new();
        for p in parts {
            if let Some(m) = r.push(p).unwrap() {
                out.push(m);
            }
        }
        assert_eq!(out, vec![big]);
        // Small messages pass through untouched, before and after.
        let small = message("hi".into());
        assert_eq!(s.split(small.clone()).unwrap(), vec![small.clone()]);
        assert_eq!(r.push(small.clone()).unwrap(), Some(small));
    }

    #[tokio::test]
    async fn the_outgoing_stream_splits_big_messages_keeps_order_and_drops_only_the_oversized() {
        use tokio_stream::StreamExt;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let first = message("a".into());
        let big = message("x".repeat(3 * FRAGMENT_BYTES + 5));
        let last = message("z".into());
        tx.send(first.clone()).unwrap();
        tx.send(big.clone()).unwrap();
        tx.send(message("o".repeat(MAX_MESSAGE_BYTES + 1))).unwrap();
        tx.send(last.clone()).unwrap();
        drop(tx);
        let sent: Vec<WorkerMessage> = splitting(rx, "test").collect().await;
        assert_eq!(sent.len(), 1 + 4 + 1, "{} messages went out", sent.len());
        assert!(sent.iter().all(|p| p.encoded_len() <= MAX_FRAME_BYTES));
        let mut r = Reassembler::default();
        let mut out = Vec::new();
        for p in sent {
            if let Some(m) = r.push(p).unwrap() {
                out.push(m);
            }
        }
        assert_eq!(out, vec![first, big, last]);
    }

    #[test]
    fn a_sequence_over_the_limit_is_dropped_and_the_next_message_gets_through() {
        let mut s = Splitter::default();
        let parts = s.split(message("y".repeat(3 * FRAGMENT_BYTES))).unwrap();
        let mut r = Reassembler::new(2 * FRAGMENT_BYTES);
        let mut errors = 0;
        for p in parts {
            match r.push(p) {
                Ok(None) => {}
                Ok(Some(m)) => panic!("accepted an oversized message: {}", m.encoded_len()),
                Err(FragError::TooLarge { .. }) => errors += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(errors, 1, "said once per sequence");
        let next = message("after".into());
        assert_eq!(r.push(next.clone()).unwrap(), Some(next));
    }

    #[test]
    fn fragments_that_lie_about_their_size_are_refused() {
        let mut r = Reassembler::default();
        let lie = WorkerMessage::from_fragment(v1::Fragment {
            id: 1,
            total_bytes: 4,
            data: vec![0; 10],
            last: true,
        });
        assert!(matches!(r.push(lie), Err(FragError::Malformed(_))));
        let short = WorkerMessage::from_fragment(v1::Fragment {
            id: 2,
            total_bytes: 10,
            data: vec![0; 4],
            last: true,
        });
        assert!(matches!(r.push(short), Err(FragError::Malformed(_))));
        let garbage = WorkerMessage::from_fragment(v1::Fragment {
            id: 3,
            total_bytes: 3,
            data: vec![0xff, 0xff, 0xff],
            last: true,
        });
        assert!(matches!(r.push(garbage), Err(FragError::Malformed(_))));
    }

    #[test]
    fn an_oversized_result_becomes_a_failure_that_names_both_sizes() {
        let o = fit_outcome(outcome("z".repeat(3000)), 1000);
        match o.result {
            Some(v1::outcome::Result::Failure(f)) => {
                assert_eq!(f.kind, v1::FailureKind::Terminal as i32);
                assert!(
                    f.message.contains("over the limit of 0.0 MiB"),
                    "{}",
                    f.message
                );
            }
            other => panic!("{other:?}"),
        }
        let fine = outcome("ok".into());
        assert_eq!(fit_outcome(fine.clone(), 1000), fine);
        let cut = fit_event("é".repeat(MAX_EVENT_BYTES));
        assert!(cut.len() < MAX_EVENT_BYTES + 100);
        assert!(cut.contains("\"truncated\""));
    }
}
