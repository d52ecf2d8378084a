//! The run index: one small object per run under `index/runs/`, so runs are listed, filtered
//! and paged without reading every run's report.
//!
//! An entry is written when a run is created (status `running`) and written again when it
//! ends (its final status, agents and end time). Its key starts with the run's creation time
//! counted down from a far date, so a listing in key order is newest first, and a page ends
//! where the next begins (`after`, the last key of a page). A store written before the index
//! existed is indexed on its first listing, from the runs' manifests and reports.
//!
//! A run whose entry says `running` is checked against its owner when listed: one whose
//! driver is gone shows as `interrupted`, as [`crate::history::load_report`] says. A run the
//! listing coordinator runs itself is shown as its engine has it ([`Live`]): its entry's
//! status and counts are those of its start, and a listing overlays them (and filters by
//! what it overlaid), so `runs --status paused` finds a paused run.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::report::{Report, RunStatus, Summary};
use crate::store::records::Manifest;
use crate::store::{Error, Store, keys};

/// What the index knows of a run (also a row of `flotilla runs`): the wire's [`RunSummary`].
pub type Entry = RunSummary;
pub use flotilla_proto::wire::RunSummary;

/// The entry of a run just created from manifest `m`.
pub fn created(m: &Manifest) -> Entry {
    Entry {
        run_id: m.run_id.clone(),
        summary: Summary {
            status: RunStatus::Running,
            ..Summary::default()
        },
        workflow: m.workflow.name.clone(),
        created: m.created.clone(),
        ended: None,
        parent_run_id: m.parent_run_id.clone(),
        labels: m.settings.labels.clone(),
        namespace: crate::namespace::effective(&m.settings.namespace).to_owned(),
    }
}

/// This entry once the run has ended with `report`.
/// `e` once its run ended with `report`.
pub fn ended(e: &Entry, report: &Report) -> Entry {
    Entry {
        summary: Summary::of_report(report),
        ended: Some(now_rfc3339()),
        ..e.clone()
    }
}

fn created_ms(e: &Entry) -> u64 {
    humantime::parse_rfc3339_weak(&e.created)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

/// Its key: newest first in key order.
/// Where `e` is kept: its key starts with its creation time counted down.
pub fn key(e: &Entry) -> object_store::path::Path {
    keys::index_entry(countdown(created_ms(e)), &e.run_id)
}

/// Milliseconds of a date far ahead (the year 2286): creation times count down from it.
const FAR_MS: u64 = 9_999_999_999_999;

fn countdown(ms: u64) -> u64 {
    FAR_MS.saturating_sub(ms)
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(flotilla_proto::clock::now()).to_string()
}

/// Writes (or rewrites) a run's entry.
pub async fn record(store: &Store, entry: &Entry) -> Result<(), Error> {
    let body = serde_json::to_vec(entry).map_err(|e| Error::Corrupt {
        key: key(entry).to_string(),
        reason: e.to_string(),
    })?;
    store.put_overwrite(&key(entry), Bytes::from(body)).await
}

pub use flotilla_proto::wire::Filter;

/// Runs per page unless the caller says.
pub const PAGE: usize = 100;
/// The most a page holds.
pub const MAX_PAGE: usize = 1000;

/// A page of runs, newest first; `next` is set while more may follow.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Page {
    pub runs: Vec<Entry>,
    pub next: Option<String>,
}

/// Whether `f` wants the run of entry `e`.
fn wants(f: &Filter, e: &Entry) -> bool {
    let ns = crate::namespace::effective(&e.namespace);
    f.workflow.as_ref().is_none_or(|w| *w == e.workflow)
        && f.namespace.as_ref().is_none_or(|n| n == ns)
        && f.within.as_ref().is_none_or(|w| w.iter().any(|n| n == ns))
        && f.status.is_none_or(|s| s == e.summary.status)
        && f.labels
            .iter()
            .all(|(k, v)| e.labels.get(k).is_some_and(|have| have == v))
}

/// The runs a listing coordinator runs itself: their summaries as their engines have them.
pub trait Live: Sync {
    /// `None`: the run is not running here (its entry or its report says what it is).
    fn summary(&self, run: &str) -> Option<Summary>;
}

/// No run is live here (a listing straight from a store).
pub struct NoneLive;

impl Live for NoneLive {
    fn summary(&self, _: &str) -> Option<Summary> {
        None
    }
}

/// A page of the runs `filter` wants, as the store's index has them.
pub async fn page(store: &Store, filter: &Filter) -> Result<Page, Error> {
    page_with(store, filter, &NoneLive).await
}

/// A page of the runs `filter` wants, the ones `live` runs shown (and filtered) as it has them.
pub async fn page_with(store: &Store, filter: &Filter, live: &dyn Live) -> Result<Page, Error> {
    match backfill_if_new(store).await {
        Ok(()) => {}
        // A store this caller may read but not write (read-only credentials) that has no
        // index yet: the page is made from the runs themselves, and nothing is written.
        Err(Error::Refused { .. }) => return page_unindexed(store, filter, live).await,
        Err(e) => return Err(e),
    }
    let mut pager = Pager::new(filter, live);
    let mut cursor = pager.start.clone();
    loop {
        let batch = store
            .list_from(&keys::index_runs(), cursor.as_deref(), 512)
            .await?;
        if batch.is_empty() {
            break;
        }
        let names: Vec<String> = batch
            .iter()
            .filter_map(|p| p.filename().map(str::to_owned))
            .collect();
        cursor = names.last().cloned();
        let bodies = futures::future::join_all(batch.iter().map(|k| store.get(k))).await;
        for (name, body) in names.iter().zip(bodies) {
            let Some(body) = body? else { continue };
            let Ok(entry) = serde_json::from_slice::<Entry>(&body) else {
                continue;
            };
            if !pager.offer(store, name, entry).await? {
                return Ok(pager.out);
            }
        }
        if batch.len() < 512 {
            break;
        }
    }
    Ok(pager.out)
}

/// The page of an unindexed store, from every run's manifest (and report), in key order.
async fn page_unindexed(store: &Store, filter: &Filter, live: &dyn Live) -> Result<Page, Error> {
    let mut entries = entries_of_runs(store).await?;
    entries.sort_by_cached_key(|e| key(e).filename().unwrap_or("").to_owned());
    let mut pager = Pager::new(filter, live);
    for entry in entries {
        let name = key(&entry).filename().unwrap_or("").to_owned();
        if pager.start.as_ref().is_some_and(|s| name <= *s) {
            continue;
        }
        if !pager.offer(store, &name, entry).await? {
            break;
        }
    }
    Ok(pager.out)
}

/// A page being filled, entry by entry in key order (newest first).
struct Pager<'a> {
    filter: &'a Filter,
    live: &'a dyn Live,
    limit: usize,
    /// The listing starts after this key: the `after` token, or the `before` time.
    start: Option<String>,
    /// Keys past this are older than `since`.
    stop: Option<String>,
    out: Page,
}

impl<'a> Pager<'a> {
    fn new(filter: &'a Filter, live: &'a dyn Live) -> Pager<'a> {
        // Keys are newest first: `before` starts the listing at its time, `since` ends it.
        let start = match (&filter.after, filter.before_unix) {
            (Some(after), _) => Some(after.clone()),
            (None, Some(before)) => {
                Some(format!("{:013}.", countdown(before.saturating_mul(1000))))
            }
            (None, None) => None,
        };
        let stop = filter
            .since_unix
            .map(|since| format!("{:013}.", countdown(since.saturating_mul(1000))));
        Pager {
            filter,
            live,
            limit: filter.limit.unwrap_or(PAGE).clamp(1, MAX_PAGE),
            start,
            stop,
            out: Page::default(),
        }
    }

    /// Takes the entry at key `name`: `false` once the page is done (full, with `next` set,
    /// or past `since`).
    async fn offer(&mut self, store: &Store, name: &str, mut entry: Entry) -> Result<bool, Error> {
        if self.stop.as_ref().is_some_and(|s| name > s.as_str()) {
            return Ok(false);
        }
        if let Some(now) = self.live.summary(&entry.run_id) {
            entry.summary = now;
        } else if !entry.summary.status.is_final() {
            entry.summary.status = live_status(store, &entry).await?;
        }
        if !wants(self.filter, &entry) {
            return Ok(true);
        }
        if self.out.runs.len() == self.limit {
            // One more matches: the page ends at the entry before it.
            self.out.next = self
                .out
                .runs
                .last()
                .map(|e| key(e).filename().unwrap_or("").to_owned());
            return Ok(false);
        }
        self.out.runs.push(entry);
        Ok(true)
    }
}

/// A `running` entry's status as its owner has it: `interrupted` when its driver is gone.
async fn live_status(store: &Store, e: &Entry) -> Result<RunStatus, Error> {
    let status = e.summary.status;
    if store.get(&keys::result(&e.run_id)).await?.is_some() {
        // It ended, but the entry was not rewritten (the end's write failed): the report.
        return Ok(crate::history::load_report(store, &e.run_id)
            .await
            .map_or(status, |r| r.status));
    }
    match crate::owner::current(store, &e.run_id).await? {
        Some((_, _, live)) if live != crate::owner::Liveness::Live => Ok(RunStatus::Interrupted),
        _ => Ok(status),
    }
}

/// Indexes a store that has runs and no index (written before there was one).
async fn backfill_if_new(store: &Store) -> Result<(), Error> {
    if !store
        .list_from(&keys::index_runs(), None, 1)
        .await?
        .is_empty()
    {
        return Ok(());
    }
    backfill(store).await.map(|_| ())
}

/// Writes an entry for every run of the store that has a manifest; how many.
pub async fn backfill(store: &Store) -> Result<usize, Error> {
    let entries = entries_of_runs(store).await?;
    for entry in &entries {
        record(store, entry).await?;
    }
    Ok(entries.len())
}

/// The entry of every run of the store that has a manifest, read from the run itself.
async fn entries_of_runs(store: &Store) -> Result<Vec<Entry>, Error> {
    let mut out = Vec::new();
    for dir in store.list_prefixes(&keys::runs()).await? {
        let Some(run) = dir.filename() else { continue };
        let Some(body) = store.get(&keys::manifest(run)).await? else {
            continue;
        };
        let Ok(m) = serde_json::from_slice::<Manifest>(&body) else {
            continue;
        };
        let mut entry = created(&m);
        if let Ok(report) = crate::history::load_report(store, run).await
            && report.status.is_final()
        {
            entry.summary = Summary::of_report(&report);
        }
        out.push(entry);
    }
    Ok(out)
}

/// Removes a run's entry (retention).
pub async fn forget(store: &Store, entry: &Entry) -> Result<(), Error> {
    store.delete(&key(entry)).await
}

/// The newest runs of the store, at most [`MAX_PAGE`], the ones `live` runs
/// as it has them ([`page_with`] filters and pages).
pub async fn list_runs(
    store: &Store,
    within: Option<Vec<String>>,
    live: &dyn Live,
) -> Result<Vec<RunSummary>, Error> {
    let all = Filter {
        limit: Some(MAX_PAGE),
        within,
        ..Default::default()
    };
    Ok(page_with(store, &all, live).await?.runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(run: &str, created: &str, workflow: &str, status: RunStatus) -> Entry {
        Entry {
            run_id: run.into(),
            summary: Summary {
                status,
                agents: 1,
                ..Summary::default()
            },
            workflow: workflow.into(),
            created: created.into(),
            ended: None,
            parent_run_id: None,
            labels: Default::default(),
            namespace: String::new(),
        }
    }

    #[tokio::test]
    async fn pages_are_newest_first_filtered_and_end_where_the_next_begins() {
        let store = crate::store::open("memory://").unwrap();
        let mut all = Vec::new();
        for i in 0..25u32 {
            let mut e = entry(
                &format!("wf_{i:08x}-000"),
                &format!("2026-11-{:02}T10:00:00Z", 1 + i),
                if i % 2 == 0 { "even" } else { "odd" },
                if i % 5 == 0 {
                    RunStatus::Failed
                } else {
                    RunStatus::Completed
                },
            );
            if i % 3 == 0 {
                e.labels.insert("team".into(), "core".into());
            }
            record(&store, &e).await.unwrap();
            all.push(e);
        }
        // Every run, a page of 10 at a time, newest first.
        let mut seen = Vec::new();
        let mut filter = Filter {
            limit: Some(10),
            ..Filter::default()
        };
        loop {
            let p = page(&store, &filter).await.unwrap();
            seen.extend(p.runs.iter().map(|e| e.run_id.clone()));
            match p.next {
                Some(n) => filter.after = Some(n),
                None => break,
            }
        }
        let newest_first: Vec<String> = all.iter().rev().map(|e| e.run_id.clone()).collect();
        assert_eq!(seen, newest_first);
        // Filters, each and together.
        let ids = |f: Filter| {
            let store = store.clone();
            async move {
                page(&store, &f)
                    .await
                    .unwrap()
                    .runs
                    .into_iter()
                    .map(|e| e.run_id)
                    .collect::<Vec<_>>()
            }
        };
        let failed_even = ids(Filter {
            workflow: Some("even".into()),
            status: Some(RunStatus::Failed),
            ..Filter::default()
        })
        .await;
        assert_eq!(
            failed_even,
            ["wf_00000014-000", "wf_0000000a-000", "wf_00000000-000"]
        );
        let core = ids(Filter {
            labels: [("team".to_owned(), "core".to_owned())].into(),
            ..Filter::default()
        })
        .await;
        assert_eq!(core.len(), 9);
        let since = humantime::parse_rfc3339("2026-11-20T10:00:00Z")
            .unwrap()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let recent = ids(Filter {
            since_unix: Some(since),
            ..Filter::default()
        })
        .await;
        assert_eq!(recent.len(), 6, "{recent:?}");
        let older = ids(Filter {
            before_unix: Some(since),
            ..Filter::default()
        })
        .await;
        assert_eq!(older.len(), 19, "{older:?}");
        assert_eq!(recent.len() + older.len(), all.len());
    }
}

#[cfg(test)]
mod read_only_tests {
    use std::sync::Arc;

    use object_store::memory::InMemory;
    use object_store::{ObjectStore, ObjectStoreExt};

    use super::*;
    use crate::store::faulty::FaultyStore;

    /// A store written before the index existed, listed by a caller who may not write there
    /// (index writes refused: no permission): the runs are listed from their manifests,
    /// filtered and paged as the index would, and nothing is written.
    #[tokio::test]
    async fn an_unindexed_store_that_refuses_writes_is_listed_from_its_runs() {
        let raw = Arc::new(InMemory::new());
        for i in 0..7u32 {
            let run = format!("wf_{i:08x}-000");
            let manifest = serde_json::json!({
                "run_id": run,
                "workflow": { "name": if i % 2 == 0 { "even" } else { "odd" }, "description": "" },
                "script_sha256": "00",
                "settings": {},
                "created": format!("2026-10-{:02}T10:00:00.000Z", 1 + i),
                "generation": 1,
                "flotilla_version": "0.1.0",
            });
            raw.put(
                &keys::manifest(&run),
                serde_json::to_vec(&manifest).unwrap().into(),
            )
            .await
            .unwrap();
        }
        let faulty = FaultyStore::new(raw.clone());
        faulty.fail_writes_with_os_error("index/", 13);
        let store = Store::over("memory://", faulty, None);
        let mut filter = Filter {
            limit: Some(3),
            ..Filter::default()
        };
        let mut seen = Vec::new();
        loop {
            let p = page(&store, &filter).await.unwrap();
            seen.extend(p.runs.iter().map(|e| e.run_id.clone()));
            match p.next {
                Some(next) => filter.after = Some(next),
                None => break,
            }
        }
        let newest_first: Vec<String> =
            (0..7u32).rev().map(|i| format!("wf_{i:08x}-000")).collect();
        assert_eq!(seen, newest_first);
        let odd = page(
            &store,
            &Filter {
                workflow: Some("odd".into()),
                ..Filter::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(odd.runs.len(), 3);
        assert!(odd.runs.iter().all(|e| e.workflow == "odd"));
        let since = page(
            &store,
            &Filter {
                since_unix: humantime::parse_rfc3339("2026-10-05T00:00:00Z")
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_secs()),
                ..Filter::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(since.runs.len(), 3, "{:?}", since.runs);
        let listed = raw
            .list_with_delimiter(Some(&keys::index_runs()))
            .await
            .unwrap();
        assert!(listed.objects.is_empty(), "nothing was indexed");
    }
}
