//! The retrying layer of every store: an [`ObjectStore`] decorator that retries transient
//! failures with backoff, so no caller writes its own loop.
//!
//! - A write waits as long as the run does ([`Patience::Durable`]: [`RETRY_FOR`]); while it
//!   keeps failing, [`Health`] says so (a log line a minute, and the run's status), and each
//!   retry is counted. A write that must not wait — a claim — says
//!   [`Patience::Brief`] in its `PutOptions::extensions`.
//! - Reads, listings and copies get a few tries ([`Patience::Brief`]). A small object's body
//!   is read inside the retry too, so a connection lost half way through is retried; a large
//!   one streams to its caller.
//! - A create-only write that, on a retry, finds an object with its own bytes counts as
//!   created: its earlier try landed and only the answer was lost.
//! - Failures retrying cannot fix (a full disk, no permission, a missing bucket) are not
//!   retried ([`permanent`]).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

/// How long transient storage errors are retried before a write gives up.
pub const RETRY_FOR: Duration = Duration::from_secs(600);
/// Bodies up to this size are read inside the retry.
const BUFFERED_BYTES: u64 = 8 << 20;
/// Tries of a [`Patience::Brief`] call.
const BRIEF_TRIES: u32 = 6;

/// How long one store call goes on through transient failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Patience {
    /// A write the run waits for: retried for [`RETRY_FOR`], each failure counted and shown
    /// in [`Health`] while it lasts.
    Durable,
    /// A read or a claim: a few tries, then the error.
    Brief,
}

/// Writes that keep failing with transient errors: since when and why. They are retried
/// (nothing is lost), and the user is told: a log line at most once a minute, and in the
/// run's status.
#[derive(Debug, Default)]
pub struct Health {
    failing: std::sync::Mutex<Option<(std::time::Instant, String)>>,
}

/// When a storage warning was last logged (seconds since the epoch; one line a minute).
static LAST_SAID: AtomicU64 = AtomicU64::new(0);

fn unix_secs() -> u64 {
    flotilla_proto::clock::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Health {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(std::time::Instant, String)>> {
        self.failing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn failed(&self, url: &str, key: &Path, e: &object_store::Error) {
        let mut f = self.lock();
        let now = std::time::Instant::now();
        let (since, last_said) = match f.as_ref() {
            Some((since, _)) => (*since, LAST_SAID.load(Ordering::Relaxed)),
            None => (now, 0),
        };
        let said = super::explain::brief(e);
        *f = Some((since, said.clone()));
        drop(f);
        let now_s = unix_secs();
        if now_s.saturating_sub(last_said) >= 60 {
            LAST_SAID.store(now_s, Ordering::Relaxed);
            tracing::warn!(store = url, %key, error = %said, failing_for = ?since.elapsed(),
                "storage writes are failing; retrying (results wait until the store answers; nothing is lost)");
        }
    }

    fn answered(&self, url: &str) {
        let mut f = self.lock();
        if let Some((since, _)) = f.take() {
            tracing::warn!(store = url, after = ?since.elapsed(), "the store answers again");
            LAST_SAID.store(0, Ordering::Relaxed);
        }
    }

    /// What is wrong right now, for a status line.
    pub fn problem(&self) -> Option<String> {
        self.lock().as_ref().map(|(since, e)| {
            format!(
                "storage writes failing for {}s, retrying: {e}",
                since.elapsed().as_secs()
            )
        })
    }
}

/// A storage error that retrying cannot fix: what is wrong, and what to do.
pub(super) fn permanent(e: &object_store::Error) -> Option<(&'static str, &'static str)> {
    use std::io::ErrorKind as K;
    if super::gate::is_deposed(e) {
        return Some((
            "this coordinator is no longer in office",
            "nothing: another coordinator of the group carries its runs on",
        ));
    }
    // An S3 server's refusal names its cause (the S3 error text never appears: see
    // `explain`); the store's start-up check says the same with the bucket and endpoint.
    if let Some(code) = super::explain::code(e) {
        use super::explain::S3Code;
        return Some(match code {
            S3Code::NoSuchBucket => (
                "the bucket does not exist",
                "create it, or fix the bucket in --store s3://BUCKET/prefix",
            ),
            S3Code::UnknownKey => (
                "the S3 server does not know the access key id",
                "check AWS_ACCESS_KEY_ID, and that AWS_ENDPOINT_URL is the server it belongs to",
            ),
            S3Code::WrongSecret => (
                "the S3 server refuses the secret key",
                "check AWS_SECRET_ACCESS_KEY: it must be the secret of AWS_ACCESS_KEY_ID",
            ),
            S3Code::Denied => (
                "the credentials may not use the bucket",
                "grant them s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject on the store's bucket and prefix",
            ),
            S3Code::BadToken => (
                "the S3 server refuses the session token",
                "refresh the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN)",
            ),
            S3Code::OtherRegion => (
                "the bucket is in another region",
                "set AWS_REGION to the bucket's region",
            ),
        });
    }
    match e {
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => {
            return Some((
                "the store refuses this identity",
                "check the store's credentials and permissions",
            ));
        }
        object_store::Error::NotSupported { .. } | object_store::Error::NotImplemented { .. } => {
            return Some(("the store does not support this write", "use another store"));
        }
        _ => {}
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            let found = match (io.kind(), io.raw_os_error()) {
                (K::PermissionDenied, _) | (_, Some(1 | 13)) => Some((
                    "permission denied",
                    "make the store directory writable by this user, or pass --store file:///a/writable/dir",
                )),
                (K::StorageFull | K::QuotaExceeded, _) | (_, Some(28 | 122)) => Some((
                    "no space left on the store's disk",
                    "free some space (nothing stored is lost), then resume the run",
                )),
                (K::ReadOnlyFilesystem, _) | (_, Some(30)) => Some((
                    "the store's file system is read-only",
                    "pass --store file:///a/writable/dir",
                )),
                // Creating a parent directory where a file is (the object store reports
                // a file in the way of the object itself as `AlreadyExists`, not this).
                (K::NotADirectory | K::AlreadyExists, _) | (_, Some(17 | 20)) => Some((
                    "a part of the store path is a file, not a directory",
                    "pass --store file:///a/directory",
                )),
                (K::IsADirectory, _) | (_, Some(21)) => Some((
                    "a directory is in the way of a stored object",
                    "remove it from the store directory",
                )),
                (K::FileTooLarge, _) | (_, Some(27)) => Some((
                    "the object is larger than the file system allows",
                    "use a store on another file system",
                )),
                _ => None,
            };
            if found.is_some() {
                return found;
            }
        }
        source = err.source();
    }
    None
}

fn transient(e: &object_store::Error) -> bool {
    if permanent(e).is_some() {
        return false;
    }
    !matches!(
        e,
        object_store::Error::NotFound { .. }
            | object_store::Error::AlreadyExists { .. }
            | object_store::Error::Precondition { .. }
            | object_store::Error::NotModified { .. }
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

/// Wraps a store; see the module doc.
pub struct Retrying {
    inner: Arc<dyn ObjectStore>,
    url: String,
    health: Arc<Health>,
}

impl fmt::Debug for Retrying {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retrying").field("url", &self.url).finish()
    }
}

impl fmt::Display for Retrying {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Retrying({})", self.inner)
    }
}

impl Retrying {
    /// `health` is shared with the [`super::Store`] that shows it.
    pub fn new(inner: Arc<dyn ObjectStore>, url: &str, health: Arc<Health>) -> Retrying {
        Retrying {
            inner,
            url: url.to_owned(),
            health,
        }
    }

    /// Runs `op` until it answers, retrying transient failures as `patience` says.
    async fn run<T, F, Fut>(&self, key: &Path, patience: Patience, mut op: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let started = tokio::time::Instant::now();
        let mut attempt = 0;
        loop {
            match op().await {
                Ok(v) => {
                    if patience == Patience::Durable {
                        self.health.answered(&self.url);
                    }
                    return Ok(v);
                }
                Err(e) if transient(&e) => {
                    let more = match patience {
                        Patience::Durable => started.elapsed() < RETRY_FOR,
                        Patience::Brief => attempt + 1 < BRIEF_TRIES,
                    };
                    if !more {
                        return Err(e);
                    }
                    if patience == Patience::Durable {
                        crate::metered::WRITE_RETRIES
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        self.health.failed(&self.url, key, &e);
                    }
                    backoff(attempt).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the object at `key` holds exactly `payload`.
    async fn holds(&self, key: &Path, payload: &PutPayload) -> bool {
        let Ok(got) = self.inner.get_opts(key, GetOptions::default()).await else {
            return false;
        };
        if got.meta.size != payload.content_length() as u64 {
            return false;
        }
        let Ok(body) = got.bytes().await else {
            return false;
        };
        body == Bytes::from(payload.clone())
    }
}

#[async_trait]
impl ObjectStore for Retrying {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let patience = opts
            .extensions
            .get::<Patience>()
            .copied()
            .unwrap_or(Patience::Durable);
        let create = matches!(opts.mode, PutMode::Create);
        let tries = AtomicU32::new(0);
        let put = || {
            tries.fetch_add(1, Ordering::Relaxed);
            self.inner.put_opts(location, payload.clone(), opts.clone())
        };
        match self.run(location, patience, put).await {
            Err(object_store::Error::AlreadyExists { .. })
                if create
                    && tries.load(Ordering::Relaxed) > 1
                    && self.holds(location, &payload).await =>
            {
                Ok(PutResult {
                    e_tag: None,
                    version: None,
                    extensions: Default::default(),
                })
            }
            other => other,
        }
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.run(location, Patience::Brief, || {
            self.inner.put_multipart_opts(location, opts.clone())
        })
        .await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.run(location, Patience::Brief, || async {
            let got = self.inner.get_opts(location, options.clone()).await?;
            let length = got.range.end.saturating_sub(got.range.start);
            if options.head
                || length > BUFFERED_BYTES
                || matches!(got.payload, GetResultPayload::File(..))
            {
                return Ok(got);
            }
            let GetResult {
                payload,
                meta,
                range,
                attributes,
                extensions,
            } = got;
            let GetResultPayload::Stream(stream) = payload else {
                unreachable!("a file payload was returned above")
            };
            let body: Vec<Bytes> = stream.try_collect().await?;
            Ok(GetResult {
                payload: GetResultPayload::Stream(
                    futures::stream::iter(body.into_iter().map(Ok)).boxed(),
                ),
                meta,
                range,
                attributes,
                extensions,
            })
        })
        .await
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
        let key = prefix.cloned().unwrap_or_default();
        self.run(&key, Patience::Brief, || {
            self.inner.list_with_delimiter(prefix)
        })
        .await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.run(to, Patience::Brief, || {
            self.inner.copy_opts(from, to, options.clone())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;
    use object_store::memory::InMemory;
    use std::sync::Mutex;

    /// A store whose next calls fail as told, counting every call.
    #[derive(Debug, Default)]
    struct Flaky {
        inner: InMemory,
        /// Puts that fail with a transient error before reaching the store.
        fail_puts: Mutex<u32>,
        /// Puts that land, then answer with a transient error (the answer is lost).
        lose_answers: Mutex<u32>,
        /// Gets whose body breaks off after the first byte.
        break_bodies: Mutex<u32>,
        /// Gets that fail outright.
        fail_gets: Mutex<u32>,
        /// Whether failures are for good (a full disk) instead of transient.
        full_disk: bool,
        calls: AtomicU32,
    }

    impl fmt::Display for Flaky {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "Flaky")
        }
    }

    fn take(n: &Mutex<u32>) -> bool {
        let mut n = n.lock().unwrap();
        let some = *n > 0;
        *n = n.saturating_sub(1);
        some
    }

    impl Flaky {
        fn error(&self) -> object_store::Error {
            object_store::Error::Generic {
                store: "flaky",
                source: if self.full_disk {
                    Box::new(std::io::Error::from_raw_os_error(28))
                } else {
                    "connection reset".into()
                },
            }
        }
    }

    #[async_trait]
    impl ObjectStore for Flaky {
        async fn put_opts(&self, l: &Path, p: PutPayload, o: PutOptions) -> Result<PutResult> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if take(&self.fail_puts) {
                return Err(self.error());
            }
            let landed = self.inner.put_opts(l, p, o).await?;
            if take(&self.lose_answers) {
                return Err(self.error());
            }
            Ok(landed)
        }
        async fn put_multipart_opts(
            &self,
            l: &Path,
            o: PutMultipartOptions,
        ) -> Result<Box<dyn MultipartUpload>> {
            self.inner.put_multipart_opts(l, o).await
        }
        async fn get_opts(&self, l: &Path, o: GetOptions) -> Result<GetResult> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if take(&self.fail_gets) {
                return Err(self.error());
            }
            let got = self.inner.get_opts(l, o).await?;
            if !take(&self.break_bodies) {
                return Ok(got);
            }
            let (meta, range, attributes) =
                (got.meta.clone(), got.range.clone(), got.attributes.clone());
            let body = got.bytes().await?;
            let first = Ok(body.slice(..1));
            let broken = Err(self.error());
            Ok(GetResult {
                payload: GetResultPayload::Stream(futures::stream::iter([first, broken]).boxed()),
                meta,
                range,
                attributes,
                extensions: Default::default(),
            })
        }
        fn delete_stream(
            &self,
            l: BoxStream<'static, Result<Path>>,
        ) -> BoxStream<'static, Result<Path>> {
            self.inner.delete_stream(l)
        }
        fn list(&self, p: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
            self.inner.list(p)
        }
        async fn list_with_delimiter(&self, p: Option<&Path>) -> Result<ListResult> {
            self.inner.list_with_delimiter(p).await
        }
        async fn copy_opts(&self, f: &Path, t: &Path, o: CopyOptions) -> Result<()> {
            self.inner.copy_opts(f, t, o).await
        }
    }

    fn layered(flaky: Flaky) -> (Arc<Flaky>, Retrying, Arc<Health>) {
        let flaky = Arc::new(flaky);
        let health = Arc::<Health>::default();
        let store = Retrying::new(flaky.clone(), "memory://", health.clone());
        (flaky, store, health)
    }

    fn create(patience: Patience) -> PutOptions {
        let mut opts = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        opts.extensions.insert(patience);
        opts
    }

    /// A claim: a create-only write that does not wait out an outage.
    async fn claim(store: &Retrying, key: &Path, body: &'static [u8]) -> Result<PutResult> {
        store
            .put_opts(key, PutPayload::from_static(body), create(Patience::Brief))
            .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_waits_out_transient_failures_and_the_health_says_so_meanwhile() {
        let (flaky, store, health) = layered(Flaky {
            fail_puts: Mutex::new(40),
            ..Flaky::default()
        });
        let key = Path::from("runs/a");
        let write = store.put(&key, PutPayload::from_static(b"x"));
        tokio::pin!(write);
        // Part way through, the failures show in the health.
        tokio::select! {
            _ = &mut write => panic!("the write ended while the store was failing"),
            () = tokio::time::sleep(Duration::from_secs(30)) => {}
        }
        assert!(
            health
                .problem()
                .is_some_and(|p| p.contains("connection reset"))
        );
        write.await.unwrap();
        assert_eq!(flaky.calls.load(Ordering::Relaxed), 41);
        assert_eq!(health.problem(), None);
        assert_eq!(
            store.get(&key).await.unwrap().bytes().await.unwrap(),
            Bytes::from_static(b"x")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_cannot_succeed_is_tried_once() {
        let (flaky, store, health) = layered(Flaky {
            fail_puts: Mutex::new(1),
            full_disk: true,
            ..Flaky::default()
        });
        let e = store
            .put(&Path::from("a"), PutPayload::from_static(b"x"))
            .await
            .unwrap_err();
        assert!(permanent(&e).is_some_and(|(problem, _)| problem.contains("no space")));
        assert_eq!(flaky.calls.load(Ordering::Relaxed), 1);
        assert_eq!(health.problem(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_create_whose_answer_was_lost_counts_as_created_and_another_s_object_does_not() {
        let (_, store, _) = layered(Flaky {
            lose_answers: Mutex::new(1),
            ..Flaky::default()
        });
        let key = Path::from("claims/c");
        claim(&store, &key, b"mine").await.unwrap();
        let e = claim(&store, &key, b"yours").await.unwrap_err();
        assert!(
            matches!(e, object_store::Error::AlreadyExists { .. }),
            "{e}"
        );
        // Someone else's object found on a retry is still someone else's.
        let (flaky, store, _) = layered(Flaky {
            lose_answers: Mutex::new(1),
            ..Flaky::default()
        });
        store
            .put(&key, PutPayload::from_static(b"theirs"))
            .await
            .unwrap();
        *flaky.fail_puts.lock().unwrap() = 1;
        let e = claim(&store, &key, b"mine").await.unwrap_err();
        assert!(
            matches!(e, object_store::Error::AlreadyExists { .. }),
            "{e}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_brief_call_gives_up_after_a_few_tries() {
        let (flaky, store, health) = layered(Flaky {
            fail_puts: Mutex::new(100),
            fail_gets: Mutex::new(100),
            ..Flaky::default()
        });
        let key = Path::from("claims/c");
        claim(&store, &key, b"x").await.unwrap_err();
        assert_eq!(flaky.calls.load(Ordering::Relaxed), BRIEF_TRIES);
        store.get(&key).await.unwrap_err();
        assert_eq!(flaky.calls.load(Ordering::Relaxed), 2 * BRIEF_TRIES);
        // A brief call is no outage of the store's writes.
        assert_eq!(health.problem(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_small_body_that_breaks_off_is_read_again() {
        let (flaky, store, _) = layered(Flaky {
            break_bodies: Mutex::new(2),
            fail_gets: Mutex::new(1),
            ..Flaky::default()
        });
        let key = Path::from("runs/r/manifest.json");
        store
            .put(&key, PutPayload::from_static(b"{\"whole\":true}"))
            .await
            .unwrap();
        let body = store.get(&key).await.unwrap().bytes().await.unwrap();
        assert_eq!(body, Bytes::from_static(b"{\"whole\":true}"));
        // One put, one failed get, two broken bodies, one whole.
        assert_eq!(flaky.calls.load(Ordering::Relaxed), 5);
    }
}
