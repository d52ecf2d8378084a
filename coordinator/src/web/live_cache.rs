//! The live part of a run's page, rendered at most once per [`FRESH`] for every reader of it:
//! a hundred readers of a run's event stream cost one rendering per tick, not a hundred.
//!
//! Each run and view (`?all=1`, `?timeline=0`) has a slot; the first reader after the slot
//! went stale renders while the others wait for that rendering (one at a time per slot, so a
//! crowd arriving together renders once). What is rendered depends on the run alone, never
//! on who reads it: the namespace check happens before a reader reaches the cache.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a rendering serves every reader.
pub(super) const FRESH: Duration = Duration::from_millis(400);
/// Slots kept before idle ones are dropped (a slot is idle once nobody renders or reads it
/// and its rendering is older than [`IDLE`]).
const MAX_SLOTS: usize = 512;
const IDLE: Duration = Duration::from_secs(10);

/// One rendering of a run's live part, and the server-sent event that carries it.
#[derive(Debug, Clone)]
pub(super) struct Rendered {
    at: Instant,
    pub(super) html: Arc<str>,
    /// `update` while the run can change, else `end`, framed once for every reader.
    pub(super) frame: bytes::Bytes,
    /// The run can still change.
    pub(super) live: bool,
    /// It runs on this coordinator (updates every half second, else every two).
    pub(super) here: bool,
}

impl Rendered {
    pub(super) fn new(html: String, live: bool, here: bool) -> Rendered {
        Rendered {
            at: Instant::now(),
            frame: sse_frame(if live { "update" } else { "end" }, &html),
            html: html.into(),
            live,
            here,
        }
    }
}

/// `data` as one server-sent event named `event`: a `data:` line per line of it (a carriage
/// return, which would end a line too, is left out).
pub(super) fn sse_frame(event: &str, data: &str) -> bytes::Bytes {
    let mut out = String::with_capacity(data.len() + data.len() / 40 + 32);
    out.push_str("event: ");
    out.push_str(event);
    out.push('\n');
    for line in data.split('\n') {
        out.push_str("data: ");
        out.extend(line.chars().filter(|&c| c != '\r'));
        out.push('\n');
    }
    out.push('\n');
    out.into()
}

type Slot = Arc<tokio::sync::Mutex<Option<Rendered>>>;

/// The slots, by run and view.
#[derive(Default)]
pub(super) struct LiveCache {
    slots: std::sync::Mutex<HashMap<(String, u8), Slot>>,
}

impl LiveCache {
    /// Run `run`'s live part in view `view`: the slot's rendering while fresh, else what
    /// `render` makes now (kept for the next readers). An error is not kept.
    pub(super) async fn get<E, F>(&self, run: &str, view: u8, render: F) -> Result<Rendered, E>
    where
        F: Future<Output = Result<Rendered, E>>,
    {
        let slot = self.slot(run, view);
        let mut held = slot.lock().await;
        if let Some(r) = held.as_ref()
            && r.at.elapsed() < FRESH
        {
            return Ok(r.clone());
        }
        let r = render.await?;
        *held = Some(r.clone());
        Ok(r)
    }

    fn slot(&self, run: &str, view: u8) -> Slot {
        let mut slots = self
            .slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slots.len() >= MAX_SLOTS {
            slots.retain(|_, s| match s.try_lock() {
                Ok(r) => r.as_ref().is_some_and(|r| r.at.elapsed() < IDLE),
                Err(_) => true,
            });
        }
        slots.entry((run.to_owned(), view)).or_default().clone()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.lock().map(|s| s.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn readers_together_share_one_rendering_until_it_is_stale() {
        let cache = Arc::new(LiveCache::default());
        let renders = Arc::new(AtomicUsize::new(0));
        let read = |cache: Arc<LiveCache>, renders: Arc<AtomicUsize>, view: u8| async move {
            cache
                .get("wf_a", view, async {
                    renders.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Ok::<_, ()>(Rendered::new("<p>x</p>".into(), true, true))
                })
                .await
                .unwrap()
        };
        let crowd: Vec<_> = (0..100)
            .map(|_| tokio::spawn(read(cache.clone(), renders.clone(), 0)))
            .collect();
        for r in crowd {
            assert_eq!(&*r.await.unwrap().html, "<p>x</p>");
        }
        assert_eq!(
            renders.load(Ordering::SeqCst),
            1,
            "one rendering for 100 readers"
        );
        // Another view is another slot; a stale slot renders again.
        read(cache.clone(), renders.clone(), 1).await;
        assert_eq!(renders.load(Ordering::SeqCst), 2);
        tokio::time::sleep(FRESH + Duration::from_millis(50)).await;
        read(cache.clone(), renders.clone(), 0).await;
        assert_eq!(renders.load(Ordering::SeqCst), 3);
        // An error is not kept.
        let failed = cache
            .get("wf_b", 0, async { Err::<Rendered, _>("gone") })
            .await;
        assert_eq!(failed.unwrap_err(), "gone");
        assert!(
            cache
                .get("wf_b", 0, async {
                    Ok::<_, ()>(Rendered::new("y".into(), false, false))
                })
                .await
                .is_ok()
        );
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn an_event_has_a_data_line_per_line_and_no_carriage_return() {
        assert_eq!(
            &sse_frame("update", "<p>a\r\nb</p>\n")[..],
            b"event: update\ndata: <p>a\ndata: b</p>\ndata: \n\n"
        );
        assert_eq!(&sse_frame("end", "x")[..], b"event: end\ndata: x\n\n");
    }

    #[tokio::test]
    async fn idle_slots_go_once_there_are_many() {
        let cache = LiveCache::default();
        for i in 0..MAX_SLOTS + 10 {
            cache
                .get(&format!("wf_{i}"), 0, async {
                    Ok::<_, ()>(Rendered {
                        at: Instant::now() - IDLE - Duration::from_secs(1),
                        frame: bytes::Bytes::new(),
                        html: "".into(),
                        live: false,
                        here: false,
                    })
                })
                .await
                .unwrap();
        }
        assert!(cache.len() <= 11, "{} slots kept", cache.len());
    }
}
