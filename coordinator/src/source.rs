//! Run sources in the store: the git objects of the code a run's agents work on.
//!
//! A client uploads a run's source as packs of git objects (`git pack-objects`), each leaving
//! out what the store already holds ([`have`], then [`Receiver`]). A pack is stored once,
//! under the SHA-256 of its bytes (`{sources}/{repo}/packs/{sha}.pack`); for the commits it
//! completes, a small record (`{sources}/{repo}/commits/{commit}.json`) names the pack and the
//! commits it builds on. A worker that lacks a commit asks its coordinator, which answers
//! with every pack of that commit's chain, dependencies first, in chunks ([`serve`]) — so
//! workers never touch storage themselves.
//!
//! Sources belong to a namespace ([`Repo`]: `{sources}` is the namespace's own directory,
//! `store::keys::sources_of`). **Invariant:** every read and write of a source goes through
//! a `Repo`, whose namespace the caller's scope chose (the API) or the run's settings name (a
//! run's head, its workers' fetches): a namespace never finds, confirms, sends or builds on
//! another's commits, so knowing another team's repository and commit ids gains nothing.
//!
//! `repo` names a repository, not a clone: clients derive it from the repository's root
//! commit, so every clone of one project shares its objects within a namespace. The id is
//! checked against what the namespace uploaded (a commit is found only under the id it was
//! uploaded with), not against the root commit: the coordinator streams uploads to the store
//! without reading them, and an id is only a name inside its namespace's own sources, so a
//! wrong one can reach nothing of another namespace.

use bytes::Bytes;
use flotilla_proto::v1::{self, CoordinatorMessage, coordinator_message};
use object_store::{ObjectStoreExt, WriteMultipart};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::store::{Error, Store, keys};

/// Bytes per chunk of a pack sent to a worker.
pub const CHUNK: usize = 1 << 20;
/// The largest pack the coordinator takes.
pub const MAX_PACK_BYTES: u64 = 8 << 30;

/// Why a source could not be taken, found, sent or merged.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("a source upload must name its repository and commit")]
    Unnamed,
    #[error("the source pack is {0} bytes, more than this coordinator takes ({MAX_PACK_BYTES})")]
    TooLarge(u64),
    #[error("the source pack is larger than this coordinator takes ({MAX_PACK_BYTES} bytes)")]
    Overran,
    #[error(
        "the source upload ended after {got} of the {announced} bytes it announced; launch again"
    )]
    Short { got: u64, announced: u64 },
    #[error("{0:?} is not a commit id")]
    NotACommit(String),
    #[error("{0:?} does not name a source repository")]
    NotARepo(String),
    #[error(
        "the store has no commit {commit} of source {repo} in namespace {namespace}; launch the run again from its repository"
    )]
    NoCommit {
        namespace: String,
        repo: String,
        commit: String,
    },
    #[error("{0:?} does not name a namespace")]
    NotANamespace(String),
    #[error("the record of commit {commit} is unreadable: {reason}")]
    BadRecord { commit: String, reason: String },
    #[error("source pack {0} is missing from the store")]
    MissingPack(String),
    #[error("cannot read source pack {pack}: {source}")]
    ReadPack {
        pack: String,
        #[source]
        source: object_store::Error,
    },
    #[error("cannot store the source: {0}")]
    Write(#[from] object_store::Error),
    #[error("cannot read the source's records: {0}")]
    Store(#[from] Error),
    #[error("cannot run git on the coordinator: {0}; install git there")]
    NoGit(#[source] std::io::Error),
    #[error("git {args} failed: {stderr}")]
    Git { args: String, stderr: String },
    #[error("cannot use the coordinator's source cache: {0}")]
    Cache(#[source] std::io::Error),
}

impl SourceError {
    pub fn kind(&self) -> flotilla_proto::ErrorKind {
        use flotilla_proto::ErrorKind;
        match self {
            SourceError::Unnamed
            | SourceError::TooLarge(_)
            | SourceError::Overran
            | SourceError::Short { .. }
            | SourceError::NotACommit(_)
            | SourceError::NotARepo(_)
            | SourceError::NotANamespace(_) => ErrorKind::Invalid,
            SourceError::NoCommit { .. } => ErrorKind::NotFound,
            SourceError::ReadPack { .. } | SourceError::Write(_) => ErrorKind::Unavailable,
            SourceError::Store(e) => e.kind(),
            SourceError::BadRecord { .. }
            | SourceError::MissingPack(_)
            | SourceError::NoGit(_)
            | SourceError::Git { .. }
            | SourceError::Cache(_) => ErrorKind::Internal,
        }
    }
}

/// Where a commit is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitRecord {
    pub pack: String,
    /// Commits whose objects the pack leaves out.
    pub prerequisites: Vec<String>,
}

pub use crate::ids::valid_source_id as valid_id;

/// A namespace's source repository: where its packs and commit records are.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Repo {
    /// Never empty: a run that names none is in `default`.
    pub namespace: String,
    pub id: String,
}

impl Repo {
    /// Repository `id` of namespace `namespace` (empty: `default`), both checked.
    pub fn new(namespace: &str, id: &str) -> Result<Repo, SourceError> {
        let namespace = crate::ids::effective_namespace(namespace);
        if !crate::ids::valid_namespace(namespace) {
            return Err(SourceError::NotANamespace(namespace.to_owned()));
        }
        if !valid_id(id) {
            return Err(SourceError::NotARepo(id.to_owned()));
        }
        Ok(Repo {
            namespace: namespace.to_owned(),
            id: id.to_owned(),
        })
    }

    pub fn pack(&self, sha256_hex: &str) -> object_store::path::Path {
        keys::source_pack(&self.namespace, &self.id, sha256_hex)
    }

    pub fn commit(&self, commit: &str) -> object_store::path::Path {
        keys::source_commit(&self.namespace, &self.id, commit)
    }

    fn no_commit(&self, commit: &str) -> SourceError {
        SourceError::NoCommit {
            namespace: self.namespace.clone(),
            repo: self.id.clone(),
            commit: commit.to_owned(),
        }
    }
}

impl std::fmt::Display for Repo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.id)
    }
}

/// Which of `commits` the store holds whole for `repo` (record, pack and the chain it builds
/// on: a commit whose chain lost a pack is uploaded again).
pub async fn have(store: &Store, repo: &Repo, commits: &[String]) -> Result<Vec<String>, Error> {
    let mut held = Vec::new();
    for c in commits.iter().filter(|c| valid_id(c)) {
        if store.get(&repo.commit(c)).await?.is_none() {
            continue;
        }
        match complete(store, repo, c).await {
            Ok(()) => held.push(c.clone()),
            Err(SourceError::Store(e)) => return Err(e),
            Err(_) => {}
        }
    }
    Ok(held)
}

/// Takes one pack in chunks, streams it to the store (never whole in memory) and files it
/// under its hash.
pub struct Receiver {
    store: Store,
    repo: Repo,
    tip: String,
    also: Vec<String>,
    prerequisites: Vec<String>,
    hasher: Sha256,
    bytes: u64,
    /// The size the client announced: a pack that ends short (or long) is not filed.
    total: u64,
    incoming: object_store::path::Path,
    upload: WriteMultipart,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver")
            .field("repo", &self.repo)
            .field("tip", &self.tip)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl Receiver {
    /// From the first chunk's header, for `namespace` (the caller's scope chose it; the
    /// header's own `namespace` is not read here).
    pub async fn start(
        store: Store,
        namespace: &str,
        first: &v1::SourceUpload,
    ) -> Result<Receiver, SourceError> {
        if !valid_id(&first.repo) || !valid_id(&first.tip) {
            return Err(SourceError::Unnamed);
        }
        let repo = Repo::new(namespace, &first.repo)?;
        if first.total_bytes > MAX_PACK_BYTES {
            return Err(SourceError::TooLarge(first.total_bytes));
        }
        if let Some(bad) = first
            .also
            .iter()
            .chain(&first.prerequisites)
            .find(|c| !valid_id(c))
        {
            return Err(SourceError::NotACommit(bad.clone()));
        }
        let incoming = keys::source_incoming(&repo.namespace, &repo.id, &crate::ids::new_run_id());
        let upload = store.inner.put_multipart(&incoming).await?;
        Ok(Receiver {
            store,
            repo,
            tip: first.tip.clone(),
            also: first.also.clone(),
            prerequisites: first.prerequisites.clone(),
            hasher: Sha256::new(),
            bytes: 0,
            total: first.total_bytes,
            incoming,
            upload: WriteMultipart::new(upload),
        })
    }

    pub async fn push(&mut self, data: &[u8]) -> Result<(), SourceError> {
        self.bytes += data.len() as u64;
        if self.bytes > MAX_PACK_BYTES {
            return Err(SourceError::Overran);
        }
        self.hasher.update(data);
        self.upload.wait_for_capacity(4).await?;
        self.upload.write(data);
        Ok(())
    }

    /// Gives the upload up: its parts are dropped from the store.
    pub async fn abort(self) {
        let _ = self.upload.abort().await;
    }

    /// Files the pack under its hash (a pack already there stays) and records the commits.
    /// A commit already recorded with its pack in the store keeps its record: an upload
    /// never repoints a commit other runs use.
    pub async fn finish(self) -> Result<(String, u64), SourceError> {
        if self.bytes != self.total {
            let _ = self.upload.abort().await;
            return Err(SourceError::Short {
                got: self.bytes,
                announced: self.total,
            });
        }
        let sha = hex::encode(self.hasher.finalize());
        self.upload.finish().await?;
        let pack = self.repo.pack(&sha);
        let copied = self.store.inner.copy(&self.incoming, &pack).await;
        let _ = self.store.inner.delete(&self.incoming).await;
        copied?;
        let record = CommitRecord {
            pack: sha.clone(),
            prerequisites: self.prerequisites,
        };
        let body = Bytes::from(serde_json::to_vec(&record).unwrap_or_default());
        // The tip last: a commit is only ever recorded once its pack is stored.
        for c in self.also.iter().chain(std::iter::once(&self.tip)) {
            let key = self.repo.commit(c);
            if intact(&self.store, &self.repo, &key).await {
                continue;
            }
            self.store.put_overwrite(&key, body.clone()).await?;
        }
        Ok((sha, self.bytes))
    }
}

/// Whether the commit record at `key` is readable and its pack is in the store.
async fn intact(store: &Store, repo: &Repo, key: &object_store::path::Path) -> bool {
    let Ok(Some(body)) = store.get(key).await else {
        return false;
    };
    let Ok(record) = serde_json::from_slice::<CommitRecord>(&body) else {
        return false;
    };
    valid_id(&record.pack) && store.inner.head(&repo.pack(&record.pack)).await.is_ok()
}

/// The packs that make `commit` complete, dependencies first: `(pack, tip)` pairs.
pub async fn chain(
    store: &Store,
    repo: &Repo,
    commit: &str,
) -> Result<Vec<(String, String)>, SourceError> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut todo = vec![commit.to_owned()];
    let mut seen = std::collections::HashSet::new();
    while let Some(c) = todo.pop() {
        if !seen.insert(c.clone()) {
            continue;
        }
        if !valid_id(&c) {
            return Err(SourceError::NotACommit(c));
        }
        let body = store
            .get(&repo.commit(&c))
            .await?
            .ok_or_else(|| repo.no_commit(&c))?;
        let r: CommitRecord =
            serde_json::from_slice(&body).map_err(|e| SourceError::BadRecord {
                commit: c.clone(),
                reason: e.to_string(),
            })?;
        if !out.iter().any(|(p, _)| *p == r.pack) {
            out.push((r.pack, c));
        }
        todo.extend(r.prerequisites);
    }
    // Found tip first; a dependency must be applied before what builds on it.
    out.reverse();
    Ok(out)
}

/// What a launch refused by [`complete`] says (a client sends such a launch once more).
pub const SWEPT_WHILE_LAUNCHING: &str = "retention removed it while this run was being launched";

/// Checks that `commit` is whole in the store: its record, every prerequisite's, and every
/// pack of the chain. A launch asks this once its run's manifest is written: retention that
/// swept the commit between the client's `SourceHave` and then would otherwise leave a run
/// whose agents find no source.
pub async fn complete(store: &Store, repo: &Repo, commit: &str) -> Result<(), SourceError> {
    for (pack, _) in chain(store, repo, commit).await? {
        match store.inner.head(&repo.pack(&pack)).await {
            Ok(_) => {}
            Err(object_store::Error::NotFound { .. }) => {
                return Err(repo.no_commit(commit));
            }
            Err(e) => {
                return Err(SourceError::ReadPack { pack, source: e });
            }
        }
    }
    Ok(())
}

/// Data a worker may leave unacknowledged (`SourceRequest.acked`) before more is read.
pub const WINDOW: u64 = 16 << 20;
/// Longest wait for a worker's acknowledgment before the transfer is given up (a worker
/// indexing a pack of gigabytes takes a while before it reads on).
const ACK_WAIT: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// Where a source transfer goes.
#[derive(Debug)]
pub enum Sink {
    /// A worker's link, with the worker's acknowledgments (`SourceRequest.acked`): at most
    /// [`WINDOW`] bytes are ahead of them, so the link's queue never holds a whole pack.
    Link {
        tx: mpsc::UnboundedSender<CoordinatorMessage>,
        acked: tokio::sync::watch::Receiver<u64>,
        sent: u64,
    },
    /// A client's stream; the bounded channel is its own flow control.
    Stream(mpsc::Sender<Result<v1::SourceData, tonic::Status>>),
}

impl Sink {
    /// Sends one piece; `false`: the other end is gone (or stopped taking it).
    async fn send(&mut self, d: v1::SourceData) -> bool {
        match self {
            Sink::Link { tx, acked, sent } => {
                while sent.saturating_sub(*acked.borrow()) > WINDOW {
                    tokio::select! {
                        r = tokio::time::timeout(ACK_WAIT, acked.changed()) => {
                            if !matches!(r, Ok(Ok(()))) {
                                return false;
                            }
                        }
                        () = tx.closed() => return false,
                    }
                }
                *sent += d.data.len() as u64;
                tx.send(CoordinatorMessage {
                    msg: Some(coordinator_message::Msg::SourceData(d)),
                })
                .is_ok()
            }
            Sink::Stream(tx) => tx.send(Ok(d)).await.is_ok(),
        }
    }
}

/// Answers a worker's `SourceRequest` on its link from `namespace`'s sources (the namespace
/// of the attempt the worker fetches for, as the dispatcher gave it).
pub async fn serve(
    store: Store,
    namespace: String,
    req: v1::SourceRequest,
    tx: mpsc::UnboundedSender<CoordinatorMessage>,
    acked: tokio::sync::watch::Receiver<u64>,
) {
    serve_to(store, &namespace, req, Sink::Link { tx, acked, sent: 0 }).await;
}

/// Every pack of the commit's chain in `namespace`'s sources that the requester does not
/// have, in chunks, then `done` (or `error`), to `sink`. The request's own `namespace` is
/// not read: the caller decided which namespace it may be answered from.
pub async fn serve_to(store: Store, namespace: &str, req: v1::SourceRequest, mut sink: Sink) {
    let fail = |error: SourceError| v1::SourceData {
        request: req.id,
        error: error.to_string(),
        done: true,
        ..v1::SourceData::default()
    };
    let repo = match Repo::new(namespace, &req.repo) {
        Ok(r) => r,
        Err(e) => {
            sink.send(fail(e)).await;
            return;
        }
    };
    let packs = match chain(&store, &repo, &req.commit).await {
        Ok(p) => p,
        Err(e) => {
            sink.send(fail(e)).await;
            return;
        }
    };
    let mut sent = 0u64;
    let mut count = 0usize;
    for (pack, tip) in packs {
        if req.have_packs.contains(&pack) {
            continue;
        }
        let key = repo.pack(&pack);
        let size = match store.inner.head(&key).await {
            Ok(m) => m.size,
            Err(e) => {
                sink.send(fail(SourceError::ReadPack {
                    pack: pack.clone(),
                    source: e,
                }))
                .await;
                return;
            }
        };
        let mut at = 0u64;
        loop {
            let end = (at + CHUNK as u64).min(size);
            let data = match store.inner.get_range(&key, at..end).await {
                Ok(d) => d,
                Err(e) => {
                    sink.send(fail(SourceError::ReadPack {
                        pack: pack.clone(),
                        source: e,
                    }))
                    .await;
                    return;
                }
            };
            let last = end >= size;
            if !sink
                .send(v1::SourceData {
                    request: req.id,
                    pack: pack.clone(),
                    tip: tip.clone(),
                    data: data.to_vec(),
                    last_of_pack: last,
                    ..v1::SourceData::default()
                })
                .await
            {
                return;
            }
            at = end;
            if last {
                break;
            }
        }
        sent += size;
        count += 1;
    }
    tracing::info!(repo = %req.repo, namespace = %repo.namespace, commit = %req.commit, packs = count, bytes = sent, "sent a source");
    sink.send(v1::SourceData {
        request: req.id,
        done: true,
        ..v1::SourceData::default()
    })
    .await;
}

/// Stores `bytes` as a pack completing `tip` (tests and embedded callers).
pub async fn put_pack(
    store: &Store,
    repo: &Repo,
    tip: &str,
    prerequisites: Vec<String>,
    bytes: Vec<u8>,
) -> Result<String, SourceError> {
    let mut r = Receiver::start(
        store.clone(),
        &repo.namespace,
        &v1::SourceUpload {
            repo: repo.id.clone(),
            tip: tip.into(),
            prerequisites,
            total_bytes: bytes.len() as u64,
            ..v1::SourceUpload::default()
        },
    )
    .await?;
    r.push(&bytes).await?;
    Ok(r.finish().await?.0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn r1() -> Repo {
        Repo::new("", "r1").unwrap()
    }

    #[tokio::test]
    async fn a_commit_s_chain_lists_its_packs_dependencies_first() {
        let store = crate::store::open("memory://").unwrap();
        let a = put_pack(&store, &r1(), "c1", vec![], b"first".to_vec())
            .await
            .unwrap();
        let b = put_pack(&store, &r1(), "c2", vec!["c1".into()], b"second".to_vec())
            .await
            .unwrap();
        assert_eq!(
            have(&store, &r1(), &["c1".into(), "c2".into(), "c3".into()])
                .await
                .unwrap(),
            ["c1", "c2"]
        );
        assert_eq!(
            chain(&store, &r1(), "c2").await.unwrap(),
            [(a.clone(), "c1".to_owned()), (b.clone(), "c2".to_owned())]
        );
        let e = chain(&store, &r1(), "c9").await.unwrap_err();
        assert!(
            matches!(&e, SourceError::NoCommit { commit, .. } if commit == "c9"),
            "{e}"
        );
        assert_eq!(e.kind(), flotilla_proto::ErrorKind::NotFound);
        // A worker that has the first pack gets only the second, in chunks, then done.
        let (tx, mut rx) = mpsc::unbounded_channel();
        serve(
            store.clone(),
            "default".into(),
            v1::SourceRequest {
                id: 7,
                repo: "r1".into(),
                commit: "c2".into(),
                have_packs: vec![a],
                ..v1::SourceRequest::default()
            },
            tx,
            tokio::sync::watch::channel(0).1,
        )
        .await;
        let mut got = Vec::new();
        while let Ok(m) = rx.try_recv() {
            if let Some(coordinator_message::Msg::SourceData(d)) = m.msg {
                got.push(d);
            }
        }
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(
            (got[0].pack.as_str(), got[0].data.as_slice()),
            (b.as_str(), &b"second"[..])
        );
        assert!(got[0].last_of_pack && got[1].done && got[1].error.is_empty());
    }

    /// Team B, knowing team A's repository and commit ids, finds nothing: no confirmation,
    /// no pack, and an upload of its own that claims to build on A's commit stays unusable
    /// (it never borrows A's objects).
    #[tokio::test]
    async fn a_namespace_never_finds_another_s_commits() {
        let store = crate::store::open("memory://").unwrap();
        let a = Repo::new("team-a", "r1").unwrap();
        let b = Repo::new("team-b", "r1").unwrap();
        put_pack(&store, &a, "c1", vec![], b"team a's secrets".to_vec())
            .await
            .unwrap();
        assert_eq!(have(&store, &a, &["c1".into()]).await.unwrap(), ["c1"]);
        assert!(have(&store, &b, &["c1".into()]).await.unwrap().is_empty());
        assert!(
            have(&store, &Repo::new("", "r1").unwrap(), &["c1".into()])
                .await
                .unwrap()
                .is_empty()
        );
        let e = chain(&store, &b, "c1").await.unwrap_err();
        assert!(
            matches!(&e, SourceError::NoCommit { namespace, .. } if namespace == "team-b"),
            "{e}"
        );
        let (tx, mut rx) = mpsc::channel(8);
        serve_to(
            store.clone(),
            "team-b",
            v1::SourceRequest {
                repo: "r1".into(),
                commit: "c1".into(),
                // What the request says of its namespace is not what decides.
                namespace: "team-a".into(),
                ..v1::SourceRequest::default()
            },
            Sink::Stream(tx),
        )
        .await;
        let only = rx.recv().await.unwrap().unwrap();
        assert!(only.done && only.data.is_empty(), "{only:?}");
        assert!(only.error.contains("no commit c1"), "{}", only.error);
        put_pack(&store, &b, "c2", vec!["c1".into()], b"team b's".to_vec())
            .await
            .unwrap();
        assert!(have(&store, &b, &["c2".into()]).await.unwrap().is_empty());
        assert!(complete(&store, &b, "c2").await.is_err());
        // Names that are not namespaces or repositories are refused before any key is built.
        for (ns, id) in [
            ("..", "r1"),
            ("team-a/x", "r1"),
            ("Team", "r1"),
            ("team-a", "../r1"),
        ] {
            assert!(Repo::new(ns, id).is_err(), "{ns} {id}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_that_acknowledges_nothing_gets_a_window_and_no_more() {
        let store = crate::store::open("memory://").unwrap();
        let size = 40usize << 20;
        put_pack(&store, &r1(), "c1", vec![], vec![7u8; size])
            .await
            .unwrap();
        let request = |id| v1::SourceRequest {
            id,
            repo: "r1".into(),
            commit: "c1".into(),
            ..v1::SourceRequest::default()
        };
        let data = |m: CoordinatorMessage| match m.msg {
            Some(coordinator_message::Msg::SourceData(d)) => d,
            other => panic!("{other:?}"),
        };
        // No acknowledgment ever: a window's worth comes, then the transfer is given up.
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (_acks, acked) = tokio::sync::watch::channel(0u64);
        tokio::spawn(serve(
            store.clone(),
            "default".into(),
            request(1),
            tx,
            acked,
        ));
        let mut got = 0u64;
        while let Some(m) = rx.recv().await {
            let d = data(m);
            assert!(!d.done, "never all of it");
            got += d.data.len() as u64;
        }
        assert!(got > 0 && got <= WINDOW + CHUNK as u64, "{got}");
        // Acknowledged as it comes: all of it, then done.
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (acks, acked) = tokio::sync::watch::channel(0u64);
        tokio::spawn(serve(store, "default".into(), request(2), tx, acked));
        let mut got = 0u64;
        loop {
            let d = data(rx.recv().await.unwrap());
            if d.done {
                break;
            }
            got += d.data.len() as u64;
            acks.send_replace(got);
        }
        assert_eq!(got, size as u64);
    }

    #[tokio::test]
    async fn an_upload_never_repoints_a_recorded_commit_and_a_short_one_is_not_filed() {
        let store = crate::store::open("memory://").unwrap();
        let a = put_pack(&store, &r1(), "c1", vec![], b"first".to_vec())
            .await
            .unwrap();
        // Another upload claiming c1 (a different pack): c1 keeps its own.
        put_pack(&store, &r1(), "c1", vec![], b"not c1".to_vec())
            .await
            .unwrap();
        assert_eq!(
            chain(&store, &r1(), "c1").await.unwrap(),
            [(a, "c1".to_owned())]
        );
        // A pack that ends before the size it announced is refused and records nothing.
        let mut r = Receiver::start(
            store.clone(),
            "default",
            &v1::SourceUpload {
                repo: "r1".into(),
                tip: "c5".into(),
                total_bytes: 100,
                ..v1::SourceUpload::default()
            },
        )
        .await
        .unwrap();
        r.push(b"only ten b").await.unwrap();
        let e = r.finish().await.unwrap_err();
        assert!(e.to_string().contains("10 of the 100 bytes"), "{e}");
        assert_eq!(e.kind(), flotilla_proto::ErrorKind::Invalid);
        assert!(
            have(&store, &r1(), &["c5".into()])
                .await
                .unwrap()
                .is_empty()
        );
    }
}
