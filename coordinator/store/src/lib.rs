//! Object storage: where runs live.
//!
//! There is no storage trait of our own: a store is an `Arc<dyn ObjectStore>` built by
//! [`open`] from a URL (`file:///path`, `memory://`, `s3://bucket/prefix`).
//! Object keys are built only in [`keys`]. Writers:
//! - [`journal::Journal`]: completed calls, group-committed into create-only segments; a result
//!   is handed to the script only after its segment is durable.
//! - [`journal::EventLog`]: run events (status, phases, logs, call transitions), batched.
//! - transcripts and payloads through [`put_create`].
//!
//! Every store is layered ([`Store::over`]): [`metered::Metered`] times each write,
//! [`retry::Retrying`] retries transient failures with backoff, then the store itself. No
//! caller writes a retry loop of its own; a create-only write that finds its object already
//! there counts as done (a retried write is idempotent).

pub mod explain;
#[cfg(any(test, feature = "faults"))]
pub mod faulty;
pub mod gate;
pub mod journal;
pub mod keys;
pub mod metered;
pub mod records;
pub mod retry;

pub use retry::{Health, Patience, RETRY_FOR};

use std::sync::Arc;

use bytes::Bytes;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

/// A store and the URL it was opened from.
#[derive(Clone)]
pub struct Store {
    pub url: String,
    pub inner: Arc<dyn ObjectStore>,
    /// Local directory behind a `file://` store (used to show file paths to users).
    pub local_root: Option<std::path::PathBuf>,
    /// Whether writes are failing right now (shared by every clone).
    pub health: Arc<Health>,
    /// The store under the layers (see [`Store::gated`]).
    raw: Arc<dyn ObjectStore>,
    /// Where an S3 store is, to explain its errors ([`explain`]); `None` for other stores.
    s3: Option<Arc<explain::S3Place>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("url", &self.url).finish()
    }
}

/// Errors of the storage layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "unsupported store URL {url:?}: use file:///absolute/path, s3://bucket/prefix or memory://"
    )]
    BadUrl { url: String },
    #[error("cannot use store {url}: {why}; {fix}")]
    Unusable {
        url: String,
        why: String,
        fix: &'static str,
    },
    #[error("cannot open store {url}: {source}")]
    Open {
        url: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{what} not found in {url}")]
    NotFound { what: String, url: String },
    /// A store set up wrong (a missing bucket, credentials the server refuses, nothing at
    /// the endpoint), found when it was checked.
    #[error("cannot use store {url}: {problem}; {fix}")]
    Misconfigured {
        url: String,
        problem: String,
        fix: String,
        kind: flotilla_proto::ErrorKind,
    },
    #[error("storage error on {key}: {}", explain::brief(source))]
    Storage {
        key: String,
        source: object_store::Error,
    },
    #[error("stored object {key} is corrupt: {reason}")]
    Corrupt { key: String, reason: String },
    /// A write the store refuses for good (no permission, no space, a path that is a file, a
    /// missing bucket): retrying cannot help, so it is not retried.
    #[error("cannot write {key}: {problem} ({}); {fix}", explain::brief(source.as_ref()))]
    Refused {
        key: String,
        problem: &'static str,
        fix: &'static str,
        source: Box<object_store::Error>,
    },
}

/// A store error as a [`Problem`](flotilla_proto::Problem) of its [`kind`](Error::kind).
impl From<Error> for flotilla_proto::Problem {
    fn from(e: Error) -> flotilla_proto::Problem {
        flotilla_proto::Problem::new(e.kind(), e.to_string())
    }
}

impl Error {
    pub fn kind(&self) -> flotilla_proto::ErrorKind {
        use flotilla_proto::ErrorKind;
        match self {
            Error::BadUrl { .. } | Error::Unusable { .. } => ErrorKind::Invalid,
            Error::NotFound { .. } => ErrorKind::NotFound,
            Error::Open { .. } | Error::Storage { .. } => ErrorKind::Unavailable,
            Error::Corrupt { .. } => ErrorKind::Internal,
            Error::Refused { .. } => ErrorKind::Invalid,
            Error::Misconfigured { kind, .. } => *kind,
        }
    }
}

/// Opens a store from a URL, an S3 one configured from this process's environment.
pub fn open(url: &str) -> Result<Store, Error> {
    open_with(url, &std::env::vars().collect())
}

/// Opens a store from a URL, an S3 one configured from `env` (the `AWS_*` and
/// `FLOTILLA_S3_*` variables, as a map: nothing is read from the process's environment).
pub fn open_with(
    url: &str,
    env: &std::collections::HashMap<String, String>,
) -> Result<Store, Error> {
    if url == "memory://" || url == "memory:///" || url == "memory" {
        return Ok(Store::over("memory://", Arc::new(InMemory::new()), None));
    }
    if let Some(path) = url.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(Error::BadUrl { url: url.into() });
        }
        if std::path::Path::new(path).is_file() {
            return Err(Error::Unusable {
                url: url.into(),
                why: format!("{path} is a file, not a directory"),
                fix: "pass --store file:///a/directory (it is created if missing)",
            });
        }
        std::fs::create_dir_all(path).map_err(|e| Error::Unusable {
            url: url.into(),
            why: format!("cannot create the store directory {path}: {e}"),
            fix: match e.kind() {
                std::io::ErrorKind::PermissionDenied => {
                    "pick a directory this user may write, e.g. --store file://$HOME/flotilla"
                }
                std::io::ErrorKind::NotADirectory | std::io::ErrorKind::AlreadyExists => {
                    "a part of that path is a file; pass --store file:///a/directory"
                }
                _ => "pass --store file:///another/directory",
            },
        })?;
        let fs = object_store::local::LocalFileSystem::new_with_prefix(path).map_err(|e| {
            Error::Open {
                url: url.into(),
                source: Box::new(e),
            }
        })?;
        return Ok(Store::over(url, Arc::new(fs), Some(path.into())));
    }
    if let Some(rest) = url.strip_prefix("s3://") {
        return open_s3(url, rest, env);
    }
    Err(Error::BadUrl { url: url.into() })
}

/// `s3://bucket[/prefix]`, configured from the usual `AWS_*` variables (`AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`/`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` or
/// `AWS_ENDPOINT` for S3-compatible servers, `AWS_ALLOW_HTTP`). Path-style requests; an
/// `http://` endpoint allows plain HTTP.
fn open_s3(
    url: &str,
    rest: &str,
    env: &std::collections::HashMap<String, String>,
) -> Result<Store, Error> {
    use object_store::aws::AmazonS3Builder;
    let (bucket, prefix) = match rest.split_once('/') {
        Some((b, p)) => (b, p.trim_matches('/')),
        None => (rest, ""),
    };
    if bucket.is_empty() {
        return Err(Error::BadUrl { url: url.into() });
    }
    // Without credentials the S3 client asks the cloud instance metadata service, an address
    // outside this machine that hangs or answers for someone else's role: only when asked.
    let var = |k: &str| env.get(k).cloned();
    let set = |k: &str| var(k).is_some_and(|v| !v.is_empty());
    let instance = var("FLOTILLA_S3_INSTANCE_CREDENTIALS").is_some_and(|v| v == "1" || v == "true");
    let have = (set("AWS_ACCESS_KEY_ID") && set("AWS_SECRET_ACCESS_KEY"))
        || set("AWS_WEB_IDENTITY_TOKEN_FILE")
        || set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        || set("AWS_CONTAINER_CREDENTIALS_FULL_URI");
    if !have && !instance {
        return Err(Error::Unusable {
            url: url.into(),
            why: "no S3 credentials".into(),
            fix: "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_WEB_IDENTITY_TOKEN_FILE), or FLOTILLA_S3_INSTANCE_CREDENTIALS=1 to use the cloud instance's metadata service",
        });
    }
    // What `AmazonS3Builder::from_env` reads, from the map.
    let mut builder = AmazonS3Builder::new();
    for (key, value) in env {
        if key.starts_with("AWS_")
            && let Ok(config_key) = key.to_ascii_lowercase().parse()
        {
            builder = builder.with_config(config_key, value);
        }
    }
    let mut builder = builder
        .with_bucket_name(bucket)
        .with_virtual_hosted_style_request(false)
        .with_client_options(
            object_store::ClientOptions::new()
                .with_timeout(std::time::Duration::from_secs(30))
                .with_connect_timeout(std::time::Duration::from_secs(5)),
        );
    let endpoint = var("AWS_ENDPOINT_URL_S3")
        .or_else(|| var("AWS_ENDPOINT_URL"))
        .or_else(|| var("AWS_ENDPOINT"));
    if let Some(ep) = &endpoint {
        builder = builder.with_endpoint(ep.clone());
        if ep.starts_with("http://") {
            builder = builder.with_allow_http(true);
        }
    }
    let region = var("AWS_REGION")
        .or_else(|| var("AWS_DEFAULT_REGION"))
        .unwrap_or_else(|| "us-east-1".to_owned());
    if var("AWS_REGION").is_none() && var("AWS_DEFAULT_REGION").is_none() {
        builder = builder.with_region("us-east-1");
    } else if let Some(region) = var("AWS_REGION") {
        builder = builder.with_region(region);
    }
    let place = explain::S3Place {
        bucket: bucket.to_owned(),
        prefix: prefix.to_owned(),
        endpoint: endpoint.clone(),
        region,
        key_id: var("AWS_ACCESS_KEY_ID").filter(|k| !k.is_empty()),
    };
    let s3 = builder.build().map_err(|e| Error::Open {
        url: url.into(),
        source: Box::new(e),
    })?;
    let inner: Arc<dyn ObjectStore> = if prefix.is_empty() {
        Arc::new(s3)
    } else {
        Arc::new(object_store::prefix::PrefixStore::new(s3, prefix))
    };
    let mut store = Store::over(url, inner, None);
    store.s3 = Some(Arc::new(place));
    Ok(store)
}

impl Store {
    /// The store at `url` over `raw`, with the layers every store has: writes metered, then
    /// transient failures retried.
    pub fn over(
        url: &str,
        raw: Arc<dyn ObjectStore>,
        local_root: Option<std::path::PathBuf>,
    ) -> Store {
        Store::layered(url, raw, local_root, Arc::default())
    }

    /// `raw` with the retrying and metering layers on top, reporting to `health`.
    fn layered(
        url: &str,
        raw: Arc<dyn ObjectStore>,
        local_root: Option<std::path::PathBuf>,
        health: Arc<Health>,
    ) -> Store {
        let retrying = retry::Retrying::new(raw.clone(), url, health.clone());
        Store {
            url: url.into(),
            inner: Arc::new(metered::Metered::new(Arc::new(retrying))),
            local_root,
            health,
            raw,
            s3: None,
        }
    }

    /// This store with a [`gate::Gate`] under its retries: once `tenure` is over, no write
    /// goes through, not even one that was being retried (each try asks the gate).
    pub fn gated(&self, tenure: Arc<flotilla_lease::Tenure>) -> Store {
        let gate = Arc::new(gate::Gate::new(self.raw.clone(), tenure));
        let mut store = Store::layered(
            &self.url,
            gate,
            self.local_root.clone(),
            self.health.clone(),
        );
        store.s3 = self.s3.clone();
        store
    }

    /// Checks that the store answers (a missing bucket, wrong keys, another region or
    /// nothing at the endpoint show up here, at startup, instead of at the first run): an
    /// S3 store's refusal comes back [`Error::Misconfigured`], naming the bucket, the
    /// endpoint and what to change. One listing, retried only by the S3 client itself.
    pub async fn check(&self) -> Result<(), Error> {
        let Err(source) = self.raw.list_with_delimiter(Some(&keys::runs())).await else {
            return Ok(());
        };
        match self.s3.as_deref().and_then(|p| explain::s3(p, &source)) {
            Some(x) => Err(Error::Misconfigured {
                url: self.url.clone(),
                problem: x.problem,
                fix: x.fix,
                kind: x.kind,
            }),
            None => Err(Error::Storage {
                key: format!("{} (listing runs/)", self.url),
                source,
            }),
        }
    }
}

/// The error of a write that gave up on `key`.
fn write_error(key: &Path, source: object_store::Error) -> Error {
    match retry::permanent(&source) {
        Some((problem, fix)) => Error::Refused {
            key: key.to_string(),
            problem,
            fix,
            source: Box::new(source),
        },
        None => Error::Storage {
            key: key.to_string(),
            source,
        },
    }
}

impl Store {
    /// Writes an object that must not exist yet. Finding it already there counts as success
    /// (a retry of a write that landed).
    pub async fn put_create(&self, key: &Path, body: Bytes) -> Result<(), Error> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        match self.inner.put_opts(key, PutPayload::from(body), opts).await {
            Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
            Err(source) => Err(write_error(key, source)),
        }
    }

    /// Writes an object that must not exist yet, and says whether this call created it:
    /// `false` when another writer's object is there (a claim lost to someone else). A retry
    /// that finds its own earlier write (same bytes) counts as created ([`retry`]). A claim
    /// does not wait out an outage: it is retried briefly.
    pub async fn put_create_exclusive(&self, key: &Path, body: Bytes) -> Result<bool, Error> {
        let mut opts = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        opts.extensions.insert(Patience::Brief);
        match self.inner.put_opts(key, PutPayload::from(body), opts).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(source) => Err(write_error(key, source)),
        }
    }

    /// Writes (or replaces) an object.
    pub async fn put_overwrite(&self, key: &Path, body: Bytes) -> Result<(), Error> {
        self.inner
            .put(key, PutPayload::from(body))
            .await
            .map(|_| ())
            .map_err(|source| write_error(key, source))
    }

    /// Reads an object; `Ok(None)` when it does not exist.
    pub async fn get(&self, key: &Path) -> Result<Option<Bytes>, Error> {
        let read = match self.inner.get(key).await {
            Ok(r) => r.bytes().await,
            Err(e) => Err(e),
        };
        match read {
            Ok(b) => Ok(Some(b)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(source) => Err(Error::Storage {
                key: key.to_string(),
                source,
            }),
        }
    }

    /// Lists the objects directly under a prefix (sorted by key).
    pub async fn list_objects(&self, prefix: &Path) -> Result<Vec<Path>, Error> {
        let res = self
            .inner
            .list_with_delimiter(Some(prefix))
            .await
            .map_err(|source| Error::Storage {
                key: prefix.to_string(),
                source,
            })?;
        let mut out: Vec<Path> = res.objects.into_iter().map(|o| o.location).collect();
        out.sort();
        Ok(out)
    }

    /// Lists the "directories" directly under a prefix.
    pub async fn list_prefixes(&self, prefix: &Path) -> Result<Vec<Path>, Error> {
        let res = self
            .inner
            .list_with_delimiter(Some(prefix))
            .await
            .map_err(|source| Error::Storage {
                key: prefix.to_string(),
                source,
            })?;
        let mut out = res.common_prefixes;
        out.sort();
        Ok(out)
    }

    /// Up to `max` objects under `prefix` (at any depth) whose keys sort after
    /// `prefix/after`, in key order.
    pub async fn list_from(
        &self,
        prefix: &Path,
        after: Option<&str>,
        max: usize,
    ) -> Result<Vec<Path>, Error> {
        use futures::StreamExt;
        let offset = after.map(|a| Path::from(format!("{prefix}/{a}")));
        let stream = match &offset {
            Some(o) => self.inner.list_with_offset(Some(prefix), o),
            None => self.inner.list(Some(prefix)),
        };
        // S3 and memory list in key order, so a page is the listing's first `max`; a directory
        // on disk lists in no order, so it is read whole and sorted.
        let sorted = self.local_root.is_none();
        let mut all: Vec<Path> = Vec::new();
        let mut stream = stream;
        while let Some(item) = stream.next().await {
            let meta = item.map_err(|source| Error::Storage {
                key: prefix.to_string(),
                source,
            })?;
            all.push(meta.location);
            if sorted && all.len() >= max {
                break;
            }
        }
        all.sort();
        all.truncate(max);
        Ok(all)
    }

    /// Every object under `prefix` (at any depth) with its size and time.
    pub async fn list_all(&self, prefix: &Path) -> Result<Vec<object_store::ObjectMeta>, Error> {
        use futures::TryStreamExt;
        let mut all: Vec<object_store::ObjectMeta> = self
            .inner
            .list(Some(prefix))
            .try_collect()
            .await
            .map_err(|source| Error::Storage {
                key: prefix.to_string(),
                source,
            })?;
        all.sort_by(|a, b| a.location.cmp(&b.location));
        Ok(all)
    }

    /// On a store on the local disk, removes the directories under `prefix` that deletes left
    /// empty (object stores have no directories; a disk keeps them). Elsewhere nothing.
    pub fn prune_empty_dirs(&self, prefix: &Path) {
        fn prune(dir: &std::path::Path) -> bool {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return false;
            };
            let mut empty = true;
            for e in entries.flatten() {
                let p = e.path();
                // Only real directories: a symlink is never followed.
                let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
                if !(is_dir && prune(&p)) {
                    empty = false;
                }
            }
            empty && std::fs::remove_dir(dir).is_ok()
        }
        if let Some(root) = &self.local_root {
            prune(&root.join(prefix.as_ref()));
        }
    }

    /// Deletes an object; one that is not there counts as deleted.
    pub async fn delete(&self, key: &Path) -> Result<(), Error> {
        use futures::StreamExt;
        let mut done = self
            .inner
            .delete_stream(futures::stream::once(futures::future::ready(Ok(key.clone()))).boxed());
        while let Some(r) = done.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(source) => return Err(write_error(key, source)),
            }
        }
        Ok(())
    }

    /// A path a user can open for a stored object, when the store is on the local disk.
    pub fn display_path(&self, key: &Path) -> String {
        match &self.local_root {
            Some(root) => root.join(key.as_ref()).display().to_string(),
            None => format!("{}/{}", self.url.trim_end_matches('/'), key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_tests::services::S3;

    fn env_of(vars: &[(String, String)]) -> std::collections::HashMap<String, String> {
        vars.iter().cloned().collect()
    }

    #[test]
    fn an_s3_store_is_configured_from_the_map_it_is_given_and_nothing_else() {
        flotilla_proto::tls::install_crypto_provider();
        // Whatever this process's environment holds, an empty map has no credentials.
        let e = open_with("s3://bucket", &std::collections::HashMap::new()).unwrap_err();
        assert!(e.to_string().contains("no S3 credentials"), "{e}");
        let env = env_of(&[
            ("AWS_ACCESS_KEY_ID".into(), "k".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "s".into()),
            ("AWS_ENDPOINT_URL".into(), "http://127.0.0.1:9".into()),
        ]);
        let s = open_with("s3://bucket/team", &env).unwrap();
        assert_eq!(s.url, "s3://bucket/team");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn s3_store_writes_once_lists_and_reads_back() {
        flotilla_proto::tls::install_crypto_provider();
        let s3 = S3::start();
        let env = env_of(&s3.env());
        let store = open_with(&format!("s3://{}/team-a", s3.bucket), &env).unwrap();
        store.check().await.unwrap();
        let key = keys::calls_segment("wf_s3test-001", 1, 0);
        store
            .put_create(&key, Bytes::from_static(b"{\"a\":1}\n"))
            .await
            .unwrap();
        // A create-only write that finds its object counts as done, and does not overwrite.
        store
            .put_create(&key, Bytes::from_static(b"other"))
            .await
            .unwrap();
        assert_eq!(
            store.get(&key).await.unwrap().unwrap(),
            Bytes::from_static(b"{\"a\":1}\n")
        );
        assert_eq!(
            store
                .list_objects(&keys::calls_dir("wf_s3test-001"))
                .await
                .unwrap(),
            vec![key.clone()]
        );
        assert_eq!(store.list_prefixes(&keys::runs()).await.unwrap().len(), 1);
        assert!(
            store
                .get(&keys::result("wf_nope-000"))
                .await
                .unwrap()
                .is_none()
        );
        // The prefix keeps teams apart.
        let other = open_with(&format!("s3://{}/team-b", s3.bucket), &env).unwrap();
        assert!(other.list_prefixes(&keys::runs()).await.unwrap().is_empty());
        // A missing bucket is an error at check time.
        let missing = open_with("s3://no-such-bucket", &env).unwrap();
        assert!(missing.check().await.is_err());
    }
}
