//! Group-committed writers of a run's calls and events.
//!
//! [`Journal`] takes completed calls and writes every call that arrives while the previous
//! write is in flight into one create-only segment (`runs/{run}/calls/{gen}-{seq}.jsonl`), then
//! acknowledges the whole batch. The run engine hands a result to the script only after its
//! acknowledgement: **a result the script has seen is durable.** One PUT per batch instead of
//! one per call keeps fan-outs of thousands of calls cheap on S3.
//!
//! [`TranscriptLog`] group-commits transcript chunks the same way as the journal (every chunk
//! that arrives while a write is in flight goes into the next segment); each line names its
//! call and attempt. One object per attempt would cost a PUT per agent call, which caps a
//! fan-out at the store's PUT rate.
//!
//! A coordinator that takes a run over (failover) writes a [`Seal`] first: the segments it
//! listed and took as the run's history. Readers take the newest seal's segments and every
//! segment of its generation or later, nothing else, so a segment of an earlier generation
//! that lands afterwards (a frozen coordinator's write that was on its way when it froze,
//! delivered when it woke) is never read: those calls were run again by the adopter, and a
//! result counts once.
//!
//! [`EventLog`] batches run events by time (flushing at least every [`EVENT_FLUSH`]) into
//! `runs/{run}/events/{gen}-{seq}.jsonl`; events are for display and diagnosis, so they are not
//! on the result path.

use std::time::Duration;
use tokio_util::task::TaskTracker;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::records::{CallRecord, EventRecord};
use super::{Store, keys};

/// Results whose JSON is larger than this are stored once under `payloads/`.
pub const PAYLOAD_THRESHOLD: usize = 256 * 1024;
/// Most calls per segment.
const MAX_BATCH: usize = 4096;
/// Longest time an event waits before it is written.
pub const EVENT_FLUSH: Duration = Duration::from_millis(250);

/// Acknowledgement of a journal write.
#[derive(Debug)]
pub enum JournalAck {
    /// These call indices are durable.
    Durable(Vec<u64>),
    /// The write failed for good (storage retries exhausted).
    Failed { indices: Vec<u64>, error: String },
}

/// A run's call journal: its writer task and the queue to it. The run owns it, appends to
/// it, and closes it at its end, which waits for what was queued to be written.
#[derive(Debug)]
pub struct Journal {
    tx: Option<mpsc::UnboundedSender<CallRecord>>,
    task: Option<JoinHandle<()>>,
}

impl Journal {
    /// Starts the writer among `tasks`; acknowledgements arrive on `acks`.
    pub fn spawn(
        store: Store,
        run: String,
        generation: u64,
        acks: mpsc::UnboundedSender<JournalAck>,
        tasks: &TaskTracker,
    ) -> Journal {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tasks.spawn(journal_loop(store, run, generation, rx, acks));
        Journal {
            tx: Some(tx),
            task: Some(task),
        }
    }

    /// Queues a completed call; its acknowledgement follows once it is durable. `false`: the
    /// writer is gone (or the journal closed), and the call will never be.
    pub fn append(&self, record: CallRecord) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(record).is_ok())
    }

    /// Takes no more, and waits until the writer has written (or given up on) what it had.
    pub async fn close(&mut self) {
        self.tx = None;
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

async fn journal_loop(
    store: Store,
    run: String,
    generation: u64,
    mut rx: mpsc::UnboundedReceiver<CallRecord>,
    acks: mpsc::UnboundedSender<JournalAck>,
) {
    let mut seq = 0u64;
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        // What is queued now, and whatever a burst still adds while the producer gets a
        // turn: a lone record waits for nothing, a burst (a resume's cached calls) goes out
        // in a few big segments instead of many small ones.
        loop {
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
            if batch.len() >= MAX_BATCH {
                break;
            }
            tokio::task::yield_now().await;
            if rx.is_empty() {
                break;
            }
        }
        let indices: Vec<u64> = batch.iter().map(|r| r.index).collect();
        match write_segment(&store, &run, generation, seq, batch).await {
            Ok(()) => {
                let _ = acks.send(JournalAck::Durable(indices));
            }
            Err(e) => {
                tracing::error!(run = %run, error = %e, "journal write failed");
                let _ = acks.send(JournalAck::Failed {
                    indices,
                    error: e.to_string(),
                });
            }
        }
        seq += 1;
    }
}

async fn write_segment(
    store: &Store,
    run: &str,
    generation: u64,
    seq: u64,
    batch: Vec<CallRecord>,
) -> Result<(), super::Error> {
    let mut body = Vec::with_capacity(batch.len() * 256);
    for mut record in batch {
        if let Some(result) = &record.result {
            let json = result.get().to_owned();
            if json.len() > PAYLOAD_THRESHOLD {
                let sha = hex::encode(Sha256::digest(json.as_bytes()));
                store
                    .put_create(&keys::payload(&sha), Bytes::from(json))
                    .await?;
                record.result = None;
                record.payload = Some(sha);
            }
        }
        let line = serde_json::to_vec(&record).map_err(|e| super::Error::Corrupt {
            key: keys::calls_dir(run).to_string(),
            reason: e.to_string(),
        })?;
        body.extend_from_slice(&line);
        body.push(b'\n');
    }
    store
        .put_create(
            &keys::calls_segment(run, generation, seq),
            Bytes::from(body),
        )
        .await
}

/// The generation after every one that has written segments or a seal of `run` (1 when
/// none has).
pub async fn next_generation(store: &Store, run: &str) -> Result<u64, super::Error> {
    let mut max = 0u64;
    for dir in [
        keys::calls_dir(run),
        keys::events_dir(run),
        keys::transcripts_dir(run),
        keys::seals_dir(run),
    ] {
        for key in store.list_objects(&dir).await? {
            if let Some(g) = generation_of(&key) {
                max = max.max(g);
            }
        }
    }
    Ok(max + 1)
}

/// The generation a segment (`{gen}-{seq}.jsonl`) or seal (`{gen}.json`) was written by.
fn generation_of(key: &object_store::path::Path) -> Option<u64> {
    let name = key.filename()?;
    let stem = name.split_once(['-', '.']).map_or(name, |(g, _)| g);
    stem.parse().ok()
}

/// What a coordinator that took a run over as `generation` took as its history: the journal
/// segments (of earlier generations) it listed. See the module doc.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Seal {
    pub generation: u64,
    pub segments: Vec<String>,
}

/// Writes the seal of `generation` over `segments`, create-only. `Ok(false)`: another
/// coordinator sealed this generation first (it took the run over; this one must not).
pub async fn seal(
    store: &Store,
    run: &str,
    generation: u64,
    segments: &[object_store::path::Path],
) -> Result<bool, super::Error> {
    let seal = Seal {
        generation,
        segments: segments.iter().map(ToString::to_string).collect(),
    };
    let body = serde_json::to_vec(&seal).map_err(|e| super::Error::Corrupt {
        key: keys::seal(run, generation).to_string(),
        reason: e.to_string(),
    })?;
    store
        .put_create_exclusive(&keys::seal(run, generation), Bytes::from(body))
        .await
}

/// The journal segments of `run` that make its history, in write order: every segment when
/// the run was never taken over; otherwise the newest seal's and those of its generation and
/// later. A seal that does not parse is an error naming it (reading on without it could
/// count a result twice).
pub async fn segments(
    store: &Store,
    run: &str,
) -> Result<Vec<object_store::path::Path>, super::Error> {
    let all = store.list_objects(&keys::calls_dir(run)).await?;
    let newest = store
        .list_objects(&keys::seals_dir(run))
        .await?
        .into_iter()
        .filter_map(|k| generation_of(&k).map(|g| (g, k)))
        .max_by_key(|(g, _)| *g);
    let Some((_, key)) = newest else {
        return Ok(all);
    };
    let Some(body) = store.get(&key).await? else {
        // Listed, then gone: the run is being deleted.
        return Ok(all);
    };
    let seal: Seal = serde_json::from_slice(&body).map_err(|e| super::Error::Corrupt {
        key: key.to_string(),
        reason: format!("not a journal seal ({e}); restore it from a backup or delete the run"),
    })?;
    let taken: std::collections::HashSet<&str> = seal.segments.iter().map(String::as_str).collect();
    Ok(all
        .into_iter()
        .filter(|k| {
            taken.contains(k.as_ref()) || generation_of(k).is_some_and(|g| g >= seal.generation)
        })
        .collect())
}

/// A stored object, or part of one, that could not be read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    pub key: String,
    /// Records (lines) of it that were skipped.
    pub records: usize,
    pub reason: String,
}

/// The completed calls of a run as read back, and what could not be read.
#[derive(Debug, Clone, Default)]
pub struct CallsRead {
    pub calls: Vec<CallRecord>,
    pub unreadable: Vec<Unreadable>,
}

impl CallsRead {
    /// One line for the user when something was skipped: which files, how many records.
    pub fn summary(&self) -> Option<String> {
        if self.unreadable.is_empty() {
            return None;
        }
        let records: usize = self.unreadable.iter().map(|u| u.records).sum();
        let files: Vec<String> = self
            .unreadable
            .iter()
            .map(|u| format!("{} ({})", u.key, u.reason))
            .collect();
        Some(format!(
            "skipped {records} unreadable journal record(s) in {}: those calls run again",
            files.join(", ")
        ))
    }
}

/// Journal segments read at once.
const READ_AHEAD: usize = 32;

/// Reads every completed call of a run, resolving payload references. A line that does not
/// parse (a truncated or corrupt segment) or whose payload is missing is skipped and listed
/// in `unreadable`, so one damaged object costs only its own calls, never the run.
pub async fn read_calls_checked(store: &Store, run: &str) -> Result<CallsRead, super::Error> {
    read_segments(store, segments(store, run).await?).await
}

/// [`read_calls_checked`] of the given segments (those [`segments`] listed).
pub async fn read_segments(
    store: &Store,
    segments: Vec<object_store::path::Path>,
) -> Result<CallsRead, super::Error> {
    use futures::StreamExt;
    let mut out = CallsRead::default();
    // Several segments in flight at once (a remote store answers each in a round trip), taken
    // in order.
    let mut bodies = futures::stream::iter(segments)
        .map(|key| async move {
            let body = store.get(&key).await;
            (key, body)
        })
        .buffered(READ_AHEAD);
    while let Some((key, body)) = bodies.next().await {
        let Some(bytes) = body? else {
            continue;
        };
        let mut bad = 0usize;
        let mut reason = String::new();
        for (n, line) in bytes.split(|b| *b == b'\n').enumerate() {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let mut record: CallRecord = match serde_json::from_slice(line) {
                Ok(r) => r,
                Err(e) => {
                    bad += 1;
                    if reason.is_empty() {
                        reason = format!("line {}: {e}", n + 1);
                    }
                    continue;
                }
            };
            if let (None, Some(sha)) = (&record.result, &record.payload) {
                let pkey = keys::payload(sha);
                let value = match store.get(&pkey).await? {
                    Some(body) => serde_json::from_slice(&body).ok(),
                    None => None,
                };
                match value {
                    Some(v) => record.result = Some(v),
                    None => {
                        bad += 1;
                        if reason.is_empty() {
                            reason =
                                format!("line {}: its payload {pkey} is missing or corrupt", n + 1);
                        }
                        continue;
                    }
                }
            }
            out.calls.push(record);
        }
        if bad > 0 {
            tracing::warn!(%key, records = bad, reason = %reason, "skipped unreadable journal records");
            out.unreadable.push(Unreadable {
                key: key.to_string(),
                records: bad,
                reason,
            });
        }
    }
    Ok(out)
}

/// [`read_calls_checked`] without the list of what was skipped.
pub async fn read_calls(store: &Store, run: &str) -> Result<Vec<CallRecord>, super::Error> {
    Ok(read_calls_checked(store, run).await?.calls)
}

/// Handle of a background writer that takes items through a channel: pushing never waits,
/// closing waits until everything pushed is written.
#[derive(Debug)]
pub struct BatchWriter<T> {
    tx: Option<mpsc::UnboundedSender<T>>,
    task: Option<JoinHandle<()>>,
}

impl<T: Send + 'static> BatchWriter<T> {
    fn start<F, Fut>(tasks: &TaskTracker, writer: F) -> Self
    where
        F: FnOnce(mpsc::UnboundedReceiver<T>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        BatchWriter {
            tx: Some(tx),
            task: Some(tasks.spawn(writer(rx))),
        }
    }

    pub fn push(&self, item: T) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(item);
        }
    }

    /// Writes what is queued and stops the writer.
    pub async fn close(&mut self) {
        self.tx = None;
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

/// The writer of a run's events.
pub type EventLog = BatchWriter<EventRecord>;

impl BatchWriter<EventRecord> {
    pub fn spawn(store: Store, run: String, generation: u64, tasks: &TaskTracker) -> EventLog {
        BatchWriter::start(tasks, move |rx| event_loop(store, run, generation, rx))
    }
}

async fn event_loop(
    store: Store,
    run: String,
    generation: u64,
    mut rx: mpsc::UnboundedReceiver<EventRecord>,
) {
    let mut seq = 0u64;
    let mut open = true;
    // The last segment's size: the next one starts with room for as much, so a busy run's
    // segments are not grown by doubling (each doubling touches fresh pages).
    let mut room = 0usize;
    while open {
        let Some(first) = rx.recv().await else { break };
        // Each event is written into the segment as it comes: no batch of records is held.
        let mut body = Vec::with_capacity(room);
        let mut n = usize::from(add_line(&mut body, &first));
        let flush = tokio::time::sleep(EVENT_FLUSH);
        tokio::pin!(flush);
        while n < 10_000 {
            tokio::select! {
                next = rx.recv() => match next {
                    Some(e) => n += usize::from(add_line(&mut body, &e)),
                    None => { open = false; break; }
                },
                _ = &mut flush => break,
            }
        }
        room = body.len().min(8 << 20);
        if body.is_empty() {
            continue;
        }
        // A quiet segment after a busy one: the stored bytes do not keep the busy one's room.
        if body.capacity() > 2 * body.len() {
            body.shrink_to_fit();
        }
        if let Err(e) = store
            .put_create(
                &keys::events_segment(&run, generation, seq),
                Bytes::from(body),
            )
            .await
        {
            tracing::warn!(run = %run, error = %e, "cannot write run events");
        }
        seq += 1;
    }
}

/// Appends `e` to `body` as one JSON line; false (and `body` as it was) if it cannot be.
fn add_line(body: &mut Vec<u8>, e: &EventRecord) -> bool {
    let before = body.len();
    if serde_json::to_writer(&mut *body, e).is_err() {
        body.truncate(before);
        return false;
    }
    body.push(b'\n');
    true
}

/// Reads a run's events in order.
pub async fn read_events(store: &Store, run: &str) -> Result<Vec<EventRecord>, super::Error> {
    let mut out = Vec::new();
    for key in store.list_objects(&keys::events_dir(run)).await? {
        let Some(bytes) = store.get(&key).await? else {
            continue;
        };
        for line in bytes.split(|b| *b == b'\n') {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if let Ok(e) = serde_json::from_slice(line) {
                out.push(e);
            }
        }
    }
    Ok(out)
}

/// One line of a transcript segment: some events of one attempt.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct TranscriptLine {
    pub call: u64,
    pub attempt: u32,
    /// Normalized transcript events, in order, as the worker sent them.
    pub events: Vec<super::records::RawJson>,
}

/// The writer of a run's transcripts.
pub type TranscriptLog = BatchWriter<TranscriptLine>;

impl BatchWriter<TranscriptLine> {
    pub fn spawn(store: Store, run: String, generation: u64, tasks: &TaskTracker) -> TranscriptLog {
        BatchWriter::start(tasks, move |rx| transcript_loop(store, run, generation, rx))
    }
}

async fn transcript_loop(
    store: Store,
    run: String,
    generation: u64,
    mut rx: mpsc::UnboundedReceiver<TranscriptLine>,
) {
    let mut seq = 0u64;
    while let Some(first) = rx.recv().await {
        let mut body = Vec::new();
        let mut n = 0usize;
        let mut next = Some(first);
        while let Some(line) = next {
            if let Ok(bytes) = serde_json::to_vec(&line) {
                body.extend_from_slice(&bytes);
                body.push(b'\n');
            }
            n += 1;
            next = if n < MAX_BATCH {
                rx.try_recv().ok()
            } else {
                None
            };
        }
        if let Err(e) = store
            .put_create(
                &keys::transcript_segment(&run, generation, seq),
                Bytes::from(body),
            )
            .await
        {
            tracing::warn!(run = %run, error = %e, "cannot store transcripts");
        }
        seq += 1;
    }
}

/// The transcript of one attempt, in order.
pub async fn read_transcript(
    store: &Store,
    run: &str,
    call: u64,
    attempt: u32,
) -> Result<Vec<serde_json::Value>, super::Error> {
    let mut out = Vec::new();
    for key in store.list_objects(&keys::transcripts_dir(run)).await? {
        let Some(bytes) = store.get(&key).await? else {
            continue;
        };
        for line in bytes.split(|b| *b == b'\n') {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if let Ok(t) = serde_json::from_slice::<TranscriptLine>(line)
                && t.call == call
                && t.attempt == attempt
            {
                out.extend(t.events.iter().map(super::records::RawJson::value));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(indices: &[u64]) -> Bytes {
        let mut body = String::new();
        for i in indices {
            body.push_str(&format!(
                r#"{{"index":{i},"key":"v1:k:{i}","label":"a{i}","group":"","result":"r{i}","attempts":1}}"#
            ));
            body.push('\n');
        }
        Bytes::from(body)
    }

    async fn indices(store: &Store, run: &str) -> Vec<u64> {
        let mut out: Vec<u64> = read_calls(store, run)
            .await
            .unwrap()
            .iter()
            .map(|c| c.index)
            .collect();
        out.sort_unstable();
        out
    }

    /// Two takeovers, each followed by a late segment of the generation it replaced: the
    /// history is what each adopter sealed plus its own, and the generations go on past the
    /// seals.
    #[tokio::test]
    async fn late_segments_of_sealed_generations_are_not_read() {
        let store = crate::open("memory://").unwrap();
        let run = "wf_seal-001";
        let put = |g: u64, seq: u64, idx: &'static [u64]| {
            let store = store.clone();
            async move {
                store
                    .put_create(&keys::calls_segment(run, g, seq), segment(idx))
                    .await
                    .unwrap();
            }
        };
        put(1, 0, &[0, 1]).await;
        let taken = segments(&store, run).await.unwrap();
        assert_eq!(next_generation(&store, run).await.unwrap(), 2);
        assert!(seal(&store, run, 2, &taken).await.unwrap());
        assert!(!seal(&store, run, 2, &taken).await.unwrap(), "sealed once");
        put(1, 1, &[2, 3]).await; // generation 1, late
        put(2, 0, &[2, 3]).await;
        assert_eq!(indices(&store, run).await, [0, 1, 2, 3]);
        // The second adopter seals before the successor wrote anything more.
        assert_eq!(next_generation(&store, run).await.unwrap(), 3);
        let taken = segments(&store, run).await.unwrap();
        assert!(seal(&store, run, 3, &taken).await.unwrap());
        // A seal alone moves the generation on (an adopter that wrote nothing yet).
        assert_eq!(next_generation(&store, run).await.unwrap(), 4);
        put(2, 1, &[4]).await; // generation 2, late
        put(1, 2, &[5]).await; // generation 1, later still
        put(3, 0, &[4, 5]).await;
        assert_eq!(indices(&store, run).await, [0, 1, 2, 3, 4, 5]);
    }

    #[tokio::test]
    async fn a_seal_that_does_not_parse_is_an_error_naming_it() {
        let store = crate::open("memory://").unwrap();
        let run = "wf_seal-002";
        store
            .put_create(&keys::calls_segment(run, 1, 0), segment(&[0]))
            .await
            .unwrap();
        store
            .put_create(&keys::seal(run, 2), Bytes::from_static(b"{\"generation\":"))
            .await
            .unwrap();
        let e = read_calls(&store, run).await.unwrap_err().to_string();
        assert!(
            e.contains("seals/000002.json") && e.contains("not a journal seal"),
            "{e}"
        );
    }
}

/// Property-based fuzzing of the journal reader (`tools/fuzz` runs it long): segments of any
/// bytes, and valid records with garbage lines between them.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    }

    fn record(index: u64) -> String {
        format!(
            r#"{{"index":{index},"key":"v1:k:{index}","label":"a{index}","group":"","result":"r{index}","attempts":1}}"#
        )
    }

    proptest! {
        #[test]
        fn any_bytes_in_a_segment_are_read_without_a_panic(segments in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..600), 1..4)) {
            let rt = runtime();
            let store = crate::open("memory://").expect("store");
            rt.block_on(async {
                for (seq, bytes) in segments.into_iter().enumerate() {
                    store
                        .put_create(&keys::calls_segment("wf_fuzz-000", 1, seq as u64), bytes.into())
                        .await
                        .expect("write");
                }
                let _ = read_calls_checked(&store, "wf_fuzz-000").await;
            });
        }

        /// Every valid record is read back, whatever lines of garbage sit between them, and
        /// each garbage line is either skipped as blank or counted as unreadable.
        #[test]
        fn valid_records_survive_garbage_lines(
            lines in prop::collection::vec(prop_oneof![
                (0u64..1000).prop_map(Ok),
                prop::collection::vec(any::<u8>().prop_filter("no newline", |b| *b != b'\n'), 0..80).prop_map(Err),
            ], 0..40),
        ) {
            let rt = runtime();
            let store = crate::open("memory://").expect("store");
            let mut text = Vec::new();
            let mut valid = std::collections::BTreeSet::new();
            let mut garbage = 0usize;
            for line in &lines {
                match line {
                    Ok(i) => {
                        if valid.insert(*i) {
                            text.extend_from_slice(record(*i).as_bytes());
                        } else {
                            continue;
                        }
                    }
                    Err(bytes) => {
                        if !bytes.iter().all(u8::is_ascii_whitespace) {
                            garbage += 1;
                        }
                        text.extend_from_slice(bytes);
                    }
                }
                text.push(b'\n');
            }
            let read = rt.block_on(async {
                store
                    .put_create(&keys::calls_segment("wf_fuzz-001", 1, 0), text.into())
                    .await
                    .expect("write");
                read_calls_checked(&store, "wf_fuzz-001").await.expect("read")
            });
            let got: std::collections::BTreeSet<u64> = read.calls.iter().map(|c| c.index).collect();
            prop_assert!(valid.is_subset(&got), "lost {:?}", valid.difference(&got).collect::<Vec<_>>());
            let unreadable: usize = read.unreadable.iter().map(|u| u.records).sum();
            prop_assert!(read.calls.len() + unreadable <= valid.len() + garbage);
        }
    }
}
