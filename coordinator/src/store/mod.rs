//! Object storage: where runs live.
//!
//! There is no storage trait of our own: a store is an `Arc<dyn ObjectStore>` built by
//! [`open`] from a URL (`file:///path`, `memory://`; `s3://bucket/prefix` comes with the fleet).
//! Object keys are built only in [`keys`]. Writers:
//! - [`journal::Journal`]: completed calls, group-committed into create-only segments; a result
//!   is handed to the script only after its segment is durable.
//! - [`journal::EventLog`]: run events (status, phases, logs, call transitions), batched.
//! - transcripts and payloads through [`put_create`].
//!
//! Every write retries transient errors with backoff; a create-only write that finds its
//! object already there counts as done (a retried write is idempotent).

pub mod faulty;
pub mod journal;
pub mod keys;
pub mod records;

use std::sync::Arc;
use std::time::Duration;

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
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("url", &self.url).finish()
    }
}

/// Errors of the storage layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("unsupported store URL {url:?}: use file:///absolute/path or memory://")]
    BadUrl { url: String },
    #[error("cannot open store {url}: {source}")]
    Open {
        url: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{what} not found in {url}")]
    NotFound { what: String, url: String },
    #[error("storage error on {key}: {source}")]
    Storage {
        key: String,
        source: object_store::Error,
    },
    #[error("stored object {key} is corrupt: {reason}")]
    Corrupt { key: String, reason: String },
}

impl Error {
    pub fn kind(&self) -> flotilla_proto::ErrorKind {
        use flotilla_proto::ErrorKind;
        match self {
            Error::BadUrl { .. } => ErrorKind::Invalid,
            Error::NotFound { .. } => ErrorKind::NotFound,
            Error::Open { .. } | Error::Storage { .. } => ErrorKind::Unavailable,
            Error::Corrupt { .. } => ErrorKind::Internal,
        }
    }
}

/// Opens a store from a URL.
pub fn open(url: &str) -> Result<Store, Error> {
    if url == "memory://" || url == "memory:///" || url == "memory" {
        return Ok(Store {
            url: "memory://".into(),
            inner: Arc::new(InMemory::new()),
            local_root: None,
        });
    }
    if let Some(path) = url.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(Error::BadUrl { url: url.into() });
        }
        std::fs::create_dir_all(path).map_err(|e| Error::Open {
            url: url.into(),
            source: Box::new(e),
        })?;
        let fs = object_store::local::LocalFileSystem::new_with_prefix(path).map_err(|e| {
            Error::Open {
                url: url.into(),
                source: Box::new(e),
            }
        })?;
        return Ok(Store {
            url: url.into(),
            inner: Arc::new(fs),
            local_root: Some(path.into()),
        });
    }
    Err(Error::BadUrl { url: url.into() })
}

/// How long transient storage errors are retried before a write gives up.
pub const RETRY_FOR: Duration = Duration::from_secs(600);

fn transient(e: &object_store::Error) -> bool {
    !matches!(
        e,
        object_store::Error::NotFound { .. }
            | object_store::Error::AlreadyExists { .. }
            | object_store::Error::Precondition { .. }
            | object_store::Error::NotSupported { .. }
            | object_store::Error::NotImplemented { .. }
            | object_store::Error::InvalidPath { .. }
            | object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. }
    )
}

async fn backoff(attempt: u32) {
    let ms = (50u64 << attempt.min(7)).min(5_000);
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

impl Store {
    /// Writes an object that must not exist yet. Finding it already there counts as success
    /// (a retry of a write that landed).
    pub async fn put_create(&self, key: &Path, body: Bytes) -> Result<(), Error> {
        let started = tokio::time::Instant::now();
        let mut attempt = 0;
        loop {
            let opts = PutOptions {
                mode: PutMode::Create,
                ..PutOptions::default()
            };
            match self
                .inner
                .put_opts(key, PutPayload::from(body.clone()), opts)
                .await
            {
                Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => return Ok(()),
                Err(e) if transient(&e) && started.elapsed() < RETRY_FOR => {
                    tracing::warn!(%key, error = %e, attempt, "storage write failed; retrying");
                    backoff(attempt).await;
                    attempt += 1;
                }
                Err(source) => {
                    return Err(Error::Storage {
                        key: key.to_string(),
                        source,
                    });
                }
            }
        }
    }

    /// Writes (or replaces) an object.
    pub async fn put_overwrite(&self, key: &Path, body: Bytes) -> Result<(), Error> {
        let started = tokio::time::Instant::now();
        let mut attempt = 0;
        loop {
            match self.inner.put(key, PutPayload::from(body.clone())).await {
                Ok(_) => return Ok(()),
                Err(e) if transient(&e) && started.elapsed() < RETRY_FOR => {
                    tracing::warn!(%key, error = %e, attempt, "storage write failed; retrying");
                    backoff(attempt).await;
                    attempt += 1;
                }
                Err(source) => {
                    return Err(Error::Storage {
                        key: key.to_string(),
                        source,
                    });
                }
            }
        }
    }

    /// Reads an object; `Ok(None)` when it does not exist.
    pub async fn get(&self, key: &Path) -> Result<Option<Bytes>, Error> {
        let mut attempt = 0;
        loop {
            let res = match self.inner.get(key).await {
                Ok(r) => r.bytes().await,
                Err(e) => Err(e),
            };
            match res {
                Ok(b) => return Ok(Some(b)),
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) if transient(&e) && attempt < 5 => {
                    backoff(attempt).await;
                    attempt += 1;
                }
                Err(source) => {
                    return Err(Error::Storage {
                        key: key.to_string(),
                        source,
                    });
                }
            }
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

    /// A path a user can open for a stored object, when the store is on the local disk.
    pub fn display_path(&self, key: &Path) -> String {
        match &self.local_root {
            Some(root) => root.join(key.as_ref()).display().to_string(),
            None => format!("{}/{}", self.url.trim_end_matches('/'), key),
        }
    }
}
