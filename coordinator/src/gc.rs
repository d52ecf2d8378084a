//! Retention: deletes runs older than a cutoff, and the shared objects nothing else uses.
//!
//! A run is deleted when it was created before the cutoff, has ended (a run still running,
//! paused, or driven by a live owner is never touched), is not being run by this process,
//! is not the run a live resume reads from, and — with `keep_failed` — did not fail. Its
//! objects go first, its manifest after them, its index entry last, so a sweep cut short is
//! finished by the next one and never leaves a listed run without its objects silently.
//!
//! Shared objects are deleted only when no remaining run references them and they are older
//! than the cutoff themselves (a newer one may belong to a run being written now):
//! `payloads/` (large results, referenced by the runs' journals) and every namespace's sources
//! (`sources/` for `default`, `namespaces/{ns}/sources/` for the others: commit records and
//! packs, referenced by the manifests of the namespace's runs and by each other's
//! prerequisites; a run of another namespace also holds what it names under `sources/`,
//! where runs from before namespaces had sources of their own kept them).
//! A payload is looked at once more just before it is deleted, and kept if it was written
//! again meanwhile (a new run that stored the same result).

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::index::{self, Entry};
use crate::report::RunStatus;
use crate::source::CommitRecord;
use crate::store::records::Manifest;
use crate::store::{Error, Store, keys};
use object_store::ObjectStoreExt;

/// What a sweep deletes.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Runs created longer ago than this go.
    pub older_than: Duration,
    /// Keep failed and interrupted runs whatever their age.
    pub keep_failed: bool,
    /// Say what would go, delete nothing.
    pub dry_run: bool,
}

/// What a sweep deleted (or, dry, would delete).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Swept {
    pub dry_run: bool,
    /// The runs deleted, oldest last.
    pub runs: Vec<String>,
    /// Old runs kept: still running or driven, resumed from, or failed with `keep_failed`.
    pub kept: Vec<Kept>,
    pub objects: u64,
    pub bytes: u64,
    pub payloads: u64,
    pub source_objects: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Kept {
    pub run_id: String,
    pub why: String,
}

/// Deletes what `policy` says from `store`; `running_here` names the runs this process
/// drives (never deleted, whatever their entries say).
pub async fn sweep(
    store: &Store,
    policy: &Policy,
    running_here: &HashSet<String>,
) -> Result<Swept, Error> {
    let started = flotilla_proto::clock::now();
    let cutoff = started
        .checked_sub(policy.older_than)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let cutoff_ms = cutoff
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let mut out = Swept {
        dry_run: policy.dry_run,
        ..Swept::default()
    };
    let every = read_index(store, None).await?;
    // Runs that a run not yet ended resumes from: its journal is still being read.
    let resumed: HashSet<&str> = every
        .iter()
        .filter(|e| !e.status().is_final())
        .filter_map(|e| e.parent_run_id.as_deref())
        .collect();
    let created_before = |e: &Entry| {
        humantime::parse_rfc3339_weak(&e.created)
            .ok()
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .is_some_and(|d| d.as_millis() < cutoff_ms)
    };
    let mut victims = Vec::new();
    for e in every.iter().filter(|e| created_before(e)) {
        let why = if !e.status().is_final() {
            Some(format!("it is {}", e.status().as_str()))
        } else if running_here.contains(&e.run_id) {
            Some("this coordinator runs it".to_owned())
        } else if resumed.contains(e.run_id.as_str()) {
            Some("a running run resumes from it".to_owned())
        } else if policy.keep_failed
            && matches!(e.status(), RunStatus::Failed | RunStatus::Interrupted)
        {
            Some(format!("it {} (--keep-failed)", e.status().as_str()))
        } else {
            None
        };
        match why {
            Some(why) => out.kept.push(Kept {
                run_id: e.run_id.clone(),
                why,
            }),
            None => victims.push(e.clone()),
        }
    }
    for e in &victims {
        let (n, bytes) = delete_run(store, e, policy.dry_run).await?;
        out.objects += n;
        out.bytes += bytes;
        out.runs.push(e.run_id.clone());
    }
    let gone: HashSet<&str> = victims.iter().map(|e| e.run_id.as_str()).collect();
    let remaining: Vec<&Entry> = every
        .iter()
        .filter(|e| !gone.contains(e.run_id.as_str()))
        .collect();
    let (payloads, pbytes) = sweep_payloads(store, &remaining, cutoff, policy.dry_run).await?;
    out.payloads = payloads;
    out.bytes += pbytes;
    let (sources, sbytes) =
        sweep_sources(store, &remaining, cutoff, started, policy.dry_run).await?;
    out.source_objects = sources;
    out.bytes += sbytes;
    Ok(out)
}

/// Every entry of the index (its statuses checked against the runs' owners).
async fn read_index(store: &Store, before_unix: Option<u64>) -> Result<Vec<Entry>, Error> {
    read_index_where(
        store,
        index::Filter {
            before_unix,
            ..index::Filter::default()
        },
    )
    .await
}

async fn read_index_where(store: &Store, filter: index::Filter) -> Result<Vec<Entry>, Error> {
    let mut filter = index::Filter {
        limit: Some(index::MAX_PAGE),
        ..filter
    };
    let mut all = Vec::new();
    loop {
        let page = index::page(store, &filter).await?;
        all.extend(page.runs);
        match page.next {
            Some(n) => filter.after = Some(n),
            None => return Ok(all),
        }
    }
}

/// Deletes one run: its objects, then its manifest, then its index entry. How many objects
/// and bytes.
async fn delete_run(store: &Store, e: &Entry, dry: bool) -> Result<(u64, u64), Error> {
    let objects = store.list_all(&keys::run_dir(&e.run_id)).await?;
    let manifest = keys::manifest(&e.run_id);
    let (mut n, mut bytes) = (0u64, 0u64);
    for o in objects.iter().filter(|o| o.location != manifest) {
        n += 1;
        bytes += o.size;
        if !dry {
            store.delete(&o.location).await?;
        }
    }
    if let Some(m) = objects.iter().find(|o| o.location == manifest) {
        n += 1;
        bytes += m.size;
        if !dry {
            store.delete(&manifest).await?;
        }
    }
    if !dry {
        index::forget(store, e).await?;
        store.prune_empty_dirs(&keys::run_dir(&e.run_id));
    }
    Ok((n, bytes))
}

/// The payloads the runs' journals reference.
async fn referenced_payloads(store: &Store, runs: &[&Entry]) -> Result<HashSet<String>, Error> {
    let mut out = HashSet::new();
    for e in runs {
        for seg in store.list_objects(&keys::calls_dir(&e.run_id)).await? {
            let Some(body) = store.get(&seg).await? else {
                continue;
            };
            for line in body.split(|b| *b == b'\n') {
                if let Ok(v) = serde_json::from_slice::<serde_json::Value>(line)
                    && let Some(sha) = v.get("payload").and_then(|p| p.as_str())
                {
                    out.insert(sha.to_owned());
                }
            }
        }
    }
    Ok(out)
}

async fn sweep_payloads(
    store: &Store,
    remaining: &[&Entry],
    cutoff: SystemTime,
    dry: bool,
) -> Result<(u64, u64), Error> {
    let Some(all) = listed(store, "payloads").await? else {
        return Ok((0, 0));
    };
    let wanted = referenced_payloads(store, remaining).await?;
    let mut candidates = Vec::new();
    for o in all {
        let unused = o
            .location
            .filename()
            .is_some_and(|sha| !wanted.contains(sha));
        if unused && SystemTime::from(o.last_modified) < cutoff {
            // Written again since the listing (a new run stored the same result): keep it.
            if dry || still_old(store, &o.location, cutoff).await? {
                candidates.push(o);
            }
        }
    }
    let swept = delete_all(store, candidates, dry).await?;
    if !dry {
        store.prune_empty_dirs(&object_store::path::Path::from("payloads"));
    }
    Ok(swept)
}

/// Everything under `prefix`, or `None` when there is nothing.
async fn listed(
    store: &Store,
    prefix: &str,
) -> Result<Option<Vec<object_store::ObjectMeta>>, Error> {
    let all = store
        .list_all(&object_store::path::Path::from(prefix))
        .await?;
    Ok((!all.is_empty()).then_some(all))
}

/// Deletes `objects` in order (unless `dry`); how many and their bytes.
async fn delete_all(
    store: &Store,
    objects: Vec<object_store::ObjectMeta>,
    dry: bool,
) -> Result<(u64, u64), Error> {
    let (mut n, mut bytes) = (0, 0);
    for o in objects {
        n += 1;
        bytes += o.size;
        if !dry {
            store.delete(&o.location).await?;
        }
    }
    Ok((n, bytes))
}

async fn still_old(
    store: &Store,
    key: &object_store::path::Path,
    cutoff: SystemTime,
) -> Result<bool, Error> {
    match store.inner.head(key).await {
        Ok(meta) => Ok(SystemTime::from(meta.last_modified) < cutoff),
        Err(object_store::Error::NotFound { .. }) => Ok(false),
        Err(source) => Err(Error::Storage {
            key: key.to_string(),
            source,
        }),
    }
}

/// A namespace's source commit: (namespace, repository, commit).
type SourceCommit = (String, String, String);

/// The source objects the remaining runs and the `young` commits need: their commits'
/// records and the packs of those and of every prerequisite, transitively, each within its
/// own namespace.
async fn referenced_sources(
    store: &Store,
    runs: &[&Entry],
    young: Vec<SourceCommit>,
) -> Result<BTreeSet<object_store::path::Path>, Error> {
    let mut keep = BTreeSet::new();
    let mut todo: Vec<SourceCommit> = young;
    for e in runs {
        let Some(body) = store.get(&keys::manifest(&e.run_id)).await? else {
            continue;
        };
        let Ok(m) = serde_json::from_slice::<Manifest>(&body) else {
            continue;
        };
        if let Some(src) = m.settings.source
            && src.url.is_none()
        {
            let ns = crate::namespace::effective(&m.settings.namespace).to_owned();
            // Runs launched before namespaces had sources of their own kept theirs in
            // default's place: what they name there is kept too (kept, never served).
            if ns != crate::namespace::DEFAULT {
                todo.push((
                    crate::namespace::DEFAULT.to_owned(),
                    src.repo.clone(),
                    src.commit.clone(),
                ));
            }
            todo.push((ns, src.repo, src.commit));
        }
    }
    while let Some((ns, repo, commit)) = todo.pop() {
        let key = keys::source_commit(&ns, &repo, &commit);
        if !keep.insert(key.clone()) {
            continue;
        }
        let Some(body) = store.get(&key).await? else {
            continue;
        };
        let Ok(record) = serde_json::from_slice::<CommitRecord>(&body) else {
            continue;
        };
        keep.insert(keys::source_pack(&ns, &repo, &record.pack));
        todo.extend(
            record
                .prerequisites
                .into_iter()
                .map(|c| (ns.clone(), repo.clone(), c)),
        );
    }
    Ok(keep)
}

/// Every source object of every namespace.
async fn all_sources(store: &Store) -> Result<Vec<object_store::ObjectMeta>, Error> {
    let mut all = store
        .list_all(&object_store::path::Path::from(keys::sources_of("")))
        .await?;
    all.extend(
        store
            .list_all(&keys::namespaces())
            .await?
            .into_iter()
            .filter(|o| {
                keys::parse_source(o.location.as_ref()).is_some_and(|(ns, ..)| {
                    ns != crate::namespace::DEFAULT && crate::namespace::valid_name(ns)
                })
            }),
    );
    Ok(all)
}

async fn sweep_sources(
    store: &Store,
    remaining: &[&Entry],
    cutoff: SystemTime,
    started: SystemTime,
    dry: bool,
) -> Result<(u64, u64), Error> {
    let all = all_sources(store).await?;
    if all.is_empty() {
        return Ok((0, 0));
    }
    // Runs launched since this pass read the index hold their sources too (a launch may
    // have been told a commit was held before its run existed).
    let since = started
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs().saturating_sub(1));
    let newer = read_index_where(
        store,
        index::Filter {
            since_unix: Some(since),
            ..index::Filter::default()
        },
    )
    .await?;
    let runs: Vec<&Entry> = remaining.iter().copied().chain(newer.iter()).collect();
    // A commit recorded since the cutoff keeps what it builds on, however old.
    let young: Vec<SourceCommit> = all
        .iter()
        .filter(|o| SystemTime::from(o.last_modified) >= cutoff)
        .filter_map(|o| {
            let (ns, repo, rest) = keys::parse_source(o.location.as_ref())?;
            let commit = rest.strip_prefix("commits/")?.strip_suffix(".json")?;
            Some((ns.to_owned(), repo.to_owned(), commit.to_owned()))
        })
        .collect();
    let keep = referenced_sources(store, &runs, young).await?;
    let dirs: BTreeSet<String> = all
        .iter()
        .filter_map(|o| keys::parse_source(o.location.as_ref()))
        .map(|(ns, ..)| keys::sources_of(ns))
        .collect();
    // Commit records before packs: a record never names a pack that is gone.
    let (records, others): (Vec<_>, Vec<_>) = all
        .into_iter()
        .filter(|o| !keep.contains(&o.location) && SystemTime::from(o.last_modified) < cutoff)
        .partition(|o| o.location.as_ref().contains("/commits/"));
    let swept = delete_all(store, records.into_iter().chain(others).collect(), dry).await?;
    if !dry {
        for dir in dirs {
            store.prune_empty_dirs(&object_store::path::Path::from(dir));
        }
    }
    Ok(swept)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::source::{Repo, put_pack};

    /// A stored run of namespace `ns` whose source is `repo` at `commit`, as an index entry.
    async fn run_of(store: &Store, run: &str, ns: &str, repo: &str, commit: &str) -> Entry {
        let mut settings = crate::RunSettings::default();
        settings.namespace = ns.into();
        settings.source = Some(crate::settings::SourceRef {
            repo: repo.into(),
            commit: commit.into(),
            url: None,
            origin: "here".into(),
            submodules: Vec::new(),
        });
        let m = Manifest {
            run_id: run.into(),
            workflow: Default::default(),
            script_sha256: String::new(),
            script_origin: None,
            args: None,
            settings,
            created: "2020-01-01T00:00:00Z".into(),
            parent_run_id: None,
            generation: 1,
            flotilla_version: String::new(),
        };
        store
            .put_overwrite(
                &keys::manifest(run),
                bytes::Bytes::from(serde_json::to_vec(&m).unwrap()),
            )
            .await
            .unwrap();
        crate::index::created(&m)
    }

    /// Each namespace's sources are swept by the runs of that namespace alone: a run keeps
    /// its own namespace's commit and what it builds on, never another namespace's copy of
    /// the same ids; `default`'s sources stay where stores always had them, and a
    /// namespace's other objects (its daily use) are left alone.
    #[tokio::test]
    async fn sources_are_swept_per_namespace_by_that_namespace_s_runs() {
        let store = crate::store::open("memory://").unwrap();
        let (c1, c2) = ("c1".repeat(20), "c2".repeat(20));
        let default = Repo::new("", "r1").unwrap();
        let a = Repo::new("team-a", "r1").unwrap();
        let b = Repo::new("team-b", "r1").unwrap();
        put_pack(&store, &default, &c1, vec![], b"default's".to_vec())
            .await
            .unwrap();
        put_pack(&store, &a, &c1, vec![], b"team a's".to_vec())
            .await
            .unwrap();
        put_pack(&store, &b, &c1, vec![], b"team b's".to_vec())
            .await
            .unwrap();
        put_pack(&store, &b, &c2, vec![c1.clone()], b"team b's next".to_vec())
            .await
            .unwrap();
        let usage = keys::namespace_usage("team-a", "2020-01-01");
        store
            .put_overwrite(&usage, bytes::Bytes::from_static(b"{}"))
            .await
            .unwrap();
        let old = run_of(&store, "wf_old", "", "r1", &c1).await;
        let team_b = run_of(&store, "wf_b", "team-b", "r1", &c2).await;
        let later = flotilla_proto::clock::now() + Duration::from_secs(3600);
        let (swept, _) = sweep_sources(&store, &[&old, &team_b], later, later, false)
            .await
            .unwrap();
        assert_eq!(swept, 2, "team a's record and pack, nothing else");
        for (repo, commit, held) in [
            (&default, &c1, true),
            (&a, &c1, false),
            (&b, &c1, true),
            (&b, &c2, true),
        ] {
            assert_eq!(
                crate::source::complete(&store, repo, commit).await.is_ok(),
                held,
                "{repo} {commit}"
            );
        }
        assert!(store.get(&usage).await.unwrap().is_some());
        // Without the team-b run, team b's chain goes too.
        let (swept, _) = sweep_sources(&store, &[&old], later, later, false)
            .await
            .unwrap();
        assert_eq!(swept, 4);
        assert!(crate::source::complete(&store, &default, &c1).await.is_ok());
        // A team-b run from before namespaces had sources of their own holds what it names
        // in default's place.
        let older = run_of(&store, "wf_older", "team-b", "r1", &c1).await;
        let (swept, _) = sweep_sources(&store, &[&older], later, later, false)
            .await
            .unwrap();
        assert_eq!(swept, 0);
        assert!(crate::source::complete(&store, &default, &c1).await.is_ok());
    }
}
