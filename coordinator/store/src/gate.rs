//! The gate of a group coordinator's store: an [`ObjectStore`] decorator that lets a write
//! through only while the coordinator's [`Tenure`] holds. A coordinator cut off from etcd, or
//! frozen and woken after its successor took over (a zombie), then writes nothing — no
//! journal segment, event, transcript or report — that could land after a successor started.
//! Reads go through: they change nothing.
//!
//! It sits under the retrying layer, so every try asks it again. While the tenure is
//! suspended the refusal is transient ([`Suspended`]): the write waits, as it would through a
//! storage outage, and goes through once a renewal proves nobody took over. Once the tenure
//! has ended the refusal is permanent ([`Deposed`]).

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

use flotilla_lease::Tenure;

/// Why a write was refused: this coordinator's tenure is over.
#[derive(Debug, thiserror::Error)]
#[error(
    "this coordinator's lease in etcd ran out before it could renew it, so another coordinator may own its runs now; it writes nothing more"
)]
pub struct Deposed;

/// Why a write waits: this coordinator could not renew its lease in time.
#[derive(Debug, thiserror::Error)]
#[error(
    "this coordinator could not renew its lease in etcd in time; its writes wait until it does (or it stops, if the lease is gone)"
)]
pub struct Suspended;

fn refused(location: &Path) -> object_store::Error {
    object_store::Error::Generic {
        store: "gate",
        source: Box::new(GateRefusal {
            key: location.to_string(),
            source: Deposed,
        }),
    }
}

fn waits(location: &Path) -> object_store::Error {
    object_store::Error::Generic {
        store: "gate",
        source: format!("not writing {location} yet: {Suspended}").into(),
    }
}

/// [`Deposed`], with the key it was about.
#[derive(Debug, thiserror::Error)]
#[error("not writing {key}: {source}")]
struct GateRefusal {
    key: String,
    #[source]
    source: Deposed,
}

/// Whether `e` is a refusal of this gate.
pub fn is_deposed(e: &object_store::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if err.is::<Deposed>() || err.is::<GateRefusal>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// Wraps a store; see the module doc.
pub struct Gate {
    inner: Arc<dyn ObjectStore>,
    tenure: Arc<Tenure>,
}

impl Gate {
    pub fn new(inner: Arc<dyn ObjectStore>, tenure: Arc<Tenure>) -> Gate {
        Gate { inner, tenure }
    }

    fn check(&self, location: &Path) -> Result<()> {
        if self.tenure.holds() {
            Ok(())
        } else if self.tenure.ended() {
            Err(refused(location))
        } else {
            Err(waits(location))
        }
    }
}

impl fmt::Debug for Gate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gate")
            .field("tenure", &self.tenure)
            .finish()
    }
}

impl fmt::Display for Gate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gate({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for Gate {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.check(location)?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.check(location)?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let tenure = self.tenure.clone();
        let checked = locations
            .map(move |l| match l {
                Ok(p) if tenure.ended() => Err(refused(&p)),
                Ok(p) if !tenure.holds() => Err(waits(&p)),
                other => other,
            })
            .boxed();
        self.inner.delete_stream(checked)
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
        self.check(to)?;
        self.inner.copy_opts(from, to, options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::time::{Duration, Instant};

    #[tokio::test]
    async fn a_deposed_coordinator_writes_nothing_and_still_reads() {
        let tenure = Arc::new(Tenure::open());
        let store = crate::open("memory://").unwrap().gated(tenure.clone());
        let key = crate::keys::calls_segment("wf_gate-001", 1, 0);
        store
            .put_create(&key, Bytes::from_static(b"{}\n"))
            .await
            .unwrap();
        tenure.renewed(Instant::now(), Duration::from_secs(10));
        let other = crate::keys::calls_segment("wf_gate-001", 1, 1);
        store
            .put_create(&other, Bytes::from_static(b"{}\n"))
            .await
            .unwrap();
        // Suspended: a write waits (retried) and lands once the tenure is renewed.
        let suspended = Arc::new(Tenure::open());
        suspended.renewed(
            Instant::now() - Duration::from_secs(9),
            Duration::from_secs(10),
        );
        let waiting = crate::open("memory://").unwrap().gated(suspended.clone());
        let write = {
            let waiting = waiting.clone();
            let key = key.clone();
            tokio::spawn(async move { waiting.put_create(&key, Bytes::from_static(b"late")).await })
        };
        while waiting.health.problem().is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            waiting
                .health
                .problem()
                .unwrap()
                .contains("could not renew its lease")
        );
        assert_eq!(
            waiting.get(&key).await.unwrap(),
            None,
            "nothing written while suspended"
        );
        suspended.renewed(Instant::now(), Duration::from_secs(10));
        write.await.unwrap().unwrap();
        assert_eq!(
            waiting.get(&key).await.unwrap(),
            Some(Bytes::from_static(b"late"))
        );
        tenure.end();
        let late = crate::keys::calls_segment("wf_gate-001", 1, 2);
        let e = store
            .put_create(&late, Bytes::from_static(b"{}\n"))
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("another coordinator may own its runs"),
            "{e}"
        );
        assert!(matches!(e, crate::Error::Refused { .. }), "{e:?}");
        assert!(store.put_overwrite(&key, Bytes::new()).await.is_err());
        assert_eq!(
            store.get(&key).await.unwrap(),
            Some(Bytes::from_static(b"{}\n"))
        );
        assert_eq!(store.get(&late).await.unwrap(), None);
    }
}
