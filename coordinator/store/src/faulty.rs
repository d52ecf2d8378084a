//! A fault-injecting object store decorator, for tests of what happens when storage is slow
//! or down (as SlateDB tests its writers). Writes whose key starts with a chosen prefix can be
//! held until released, or failed with a transient error.

use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};
use tokio::sync::watch;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Faults {
    hold_prefix: Option<String>,
    fail_prefix: Option<String>,
    /// With `fail_prefix`: fail as the local file system does with this OS error (ENOSPC,
    /// EACCES, ...) instead of a transient outage.
    os_error: Option<i32>,
}

/// Wraps a store; writes under a prefix can be held or failed.
pub struct FaultyStore {
    inner: Arc<dyn ObjectStore>,
    faults: watch::Sender<Faults>,
    held: Mutex<usize>,
}

impl fmt::Debug for FaultyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyStore").finish_non_exhaustive()
    }
}

impl fmt::Display for FaultyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FaultyStore({})", self.inner)
    }
}

impl FaultyStore {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Arc<Self> {
        Arc::new(FaultyStore {
            inner,
            faults: watch::channel(Faults::default()).0,
            held: Mutex::new(0),
        })
    }

    /// Writes under `prefix` wait until [`FaultyStore::release`].
    pub fn hold_writes(&self, prefix: &str) {
        self.faults
            .send_modify(|f| f.hold_prefix = Some(prefix.to_owned()));
    }

    /// Writes under `prefix` fail with a transient error until [`FaultyStore::release`].
    pub fn fail_writes(&self, prefix: &str) {
        self.faults
            .send_modify(|f| f.fail_prefix = Some(prefix.to_owned()));
    }

    /// Writes under `prefix` fail as a local file system fails with OS error `errno` (28 is a
    /// full disk, 13 no permission) until [`FaultyStore::release`].
    pub fn fail_writes_with_os_error(&self, prefix: &str, errno: i32) {
        self.faults.send_modify(|f| {
            f.fail_prefix = Some(prefix.to_owned());
            f.os_error = Some(errno);
        });
    }

    /// Ends every fault; held writes go through.
    pub fn release(&self) {
        self.faults.send_modify(|f| *f = Faults::default());
    }

    /// Writes waiting right now.
    pub fn held(&self) -> usize {
        *self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn gate(&self, location: &Path) -> Result<()> {
        let key = location.as_ref();
        let mut rx = self.faults.subscribe();
        let mut counted = false;
        loop {
            let f = rx.borrow_and_update().clone();
            if f.fail_prefix.as_deref().is_some_and(|p| key.starts_with(p)) {
                if counted {
                    *self
                        .held
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) -= 1;
                }
                return Err(object_store::Error::Generic {
                    store: "faulty",
                    source: match f.os_error {
                        Some(errno) => Box::new(std::io::Error::from_raw_os_error(errno)),
                        None => "injected outage".into(),
                    },
                });
            }
            if !f.hold_prefix.as_deref().is_some_and(|p| key.starts_with(p)) {
                if counted {
                    *self
                        .held
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) -= 1;
                }
                return Ok(());
            }
            if !counted {
                *self
                    .held
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
                counted = true;
            }
            if rx.changed().await.is_err() {
                return Ok(());
            }
        }
    }
}

#[async_trait]
impl ObjectStore for FaultyStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.gate(location).await?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.gate(location).await?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.gate(to).await?;
        self.inner.copy_opts(from, to, options).await
    }
}
