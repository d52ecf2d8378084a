//! The metering layer of every store: an [`ObjectStore`] decorator that observes how long each
//! write takes, retries included (it wraps [`super::retry::Retrying`]), as the storage write
//! latency on `/metrics`.

use std::fmt;
use std::sync::Arc;

use std::sync::atomic::AtomicU64;

use async_trait::async_trait;
use flotilla_proto::histogram::{Histogram, LATENCY_SECONDS};
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

/// One object-store write, retries included (`/metrics`: the storage write latency).
pub static WRITE_LATENCY: Histogram = Histogram::new(LATENCY_SECONDS);
/// Failed object-store writes that were retried ([`super::retry::Retrying`] counts them).
pub static WRITE_RETRIES: AtomicU64 = AtomicU64::new(0);

/// Wraps a store; see the module doc.
pub struct Metered {
    inner: Arc<dyn ObjectStore>,
}

impl Metered {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Metered {
        Metered { inner }
    }
}

impl fmt::Debug for Metered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metered").finish_non_exhaustive()
    }
}

impl fmt::Display for Metered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Metered({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for Metered {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let started = std::time::Instant::now();
        let out = self.inner.put_opts(location, payload, opts).await;
        WRITE_LATENCY.observe(started.elapsed());
        out
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
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
        self.inner.copy_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;

    #[tokio::test]
    async fn every_write_is_observed_once_and_reads_are_not() {
        let store = crate::open("memory://").unwrap();
        let before = WRITE_LATENCY.count();
        let key = Path::from("runs/r/a");
        store
            .put_create(&key, bytes::Bytes::from_static(b"x"))
            .await
            .unwrap();
        store
            .put_overwrite(&key, bytes::Bytes::from_static(b"y"))
            .await
            .unwrap();
        store.inner.get(&key).await.unwrap();
        store.list_objects(&Path::from("runs/r")).await.unwrap();
        // Other tests of this process may write too: at least ours, counted once each.
        let after = WRITE_LATENCY.count();
        assert!(after >= before + 2, "{before} -> {after}");
        let raw = Metered::new(Arc::new(object_store::memory::InMemory::new()));
        let before = WRITE_LATENCY.count();
        raw.get(&key).await.unwrap_err();
        raw.list_with_delimiter(None).await.unwrap();
        assert_eq!(WRITE_LATENCY.count(), before);
    }
}
