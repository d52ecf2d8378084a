//! Listeners a peer without a certificate cannot wear down.
//!
//! Every connection the coordinator accepts (gRPC and the session pages) holds one permit of
//! [`Limits::max_connections`]; past that, a new connection is closed at once. A TLS
//! handshake that has not finished within [`Limits::handshake`] is dropped, and a connection
//! with no bytes in either direction for [`Limits::idle`] is closed (healthy gRPC peers are
//! never idle that long: the server pings them every keep-alive interval). Each of the three
//! says so in the log, at most once a second, with how many it suppressed.
//!
//! The gRPC face gets its connections from [`tls`] (or [`plain`] with `--insecure`) through
//! `serve_with_incoming`; the pages use [`Limited`] as an axum listener.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::{Instant, Sleep};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::sync::CancellationToken;

/// What one listener allows.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest a TLS handshake may take.
    pub handshake: Duration,
    /// Longest a connection may go without a byte either way.
    pub idle: Duration,
    /// Connections open at once (handshaking ones included).
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(300),
            max_connections: 4096,
        }
    }
}

/// A log line that says itself at most once a second and counts what it held back.
#[derive(Debug, Default)]
pub struct Throttled {
    /// Milliseconds since `base` when it last spoke.
    last: AtomicU64,
    held: AtomicU64,
}

fn now_ms() -> u64 {
    static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    BASE.get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
        + 1_000
}

impl Throttled {
    /// Calls `say` with the number of lines held back since it last spoke, or counts this one.
    pub fn say(&self, say: impl FnOnce(u64)) {
        let now = now_ms();
        let last = self.last.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 1_000
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            say(self.held.swap(0, Ordering::Relaxed));
        } else {
            self.held.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The log lines of one listener.
#[derive(Debug)]
struct Logs {
    what: &'static str,
    full: Throttled,
    handshake: Throttled,
    idle: Throttled,
}

impl Logs {
    fn new(what: &'static str) -> Arc<Logs> {
        Arc::new(Logs {
            what,
            full: Throttled::default(),
            handshake: Throttled::default(),
            idle: Throttled::default(),
        })
    }
}

/// A connection that holds its permit and closes itself when idle.
pub struct Guarded<T> {
    inner: T,
    idle: Duration,
    last_io: Instant,
    timer: Pin<Box<Sleep>>,
    peer: Option<SocketAddr>,
    logs: Arc<Logs>,
    _permit: OwnedSemaphorePermit,
}

impl<T> std::fmt::Debug for Guarded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guarded")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl<T> Guarded<T> {
    fn new(
        inner: T,
        idle: Duration,
        peer: Option<SocketAddr>,
        logs: Arc<Logs>,
        permit: OwnedSemaphorePermit,
    ) -> Self {
        let now = Instant::now();
        Guarded {
            inner,
            idle,
            last_io: now,
            timer: Box::pin(tokio::time::sleep_until(now + idle)),
            peer,
            logs,
            _permit: permit,
        }
    }

    /// `Err` once the connection has been idle for its limit; re-arms the timer otherwise.
    fn check_idle(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Ok(());
            }
            let due = self.last_io + self.idle;
            if due > Instant::now() {
                self.timer.as_mut().reset(due);
                continue;
            }
            let (what, peer, idle) = (self.logs.what, self.peer, self.idle);
            self.logs.idle.say(|held| {
                tracing::warn!(listener = what, peer = ?peer, idle = ?idle, suppressed = held,
                    "closed a connection that sent and received nothing for the idle timeout");
            });
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection idle for longer than the idle timeout",
            ));
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Guarded<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.last_io = Instant::now();
                }
                Poll::Ready(r)
            }
            Poll::Pending => match self.check_idle(cx) {
                Ok(()) => Poll::Pending,
                Err(e) => Poll::Ready(Err(e)),
            },
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Guarded<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.last_io = Instant::now();
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Guarded<T> {
    type ConnectInfo = T::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// One accepted connection's permit, or `None` (logged) when the listener is full.
fn admit(
    permits: &Arc<Semaphore>,
    logs: &Logs,
    max: usize,
    peer: SocketAddr,
) -> Option<OwnedSemaphorePermit> {
    let permit = permits.clone().try_acquire_owned().ok();
    if permit.is_none() {
        logs.full.say(|held| {
            tracing::warn!(listener = logs.what, peer = %peer, limit = max, suppressed = held,
                "connection limit reached; closed a new connection at once (raise --max-connections if this is real load)");
        });
    }
    permit
}

/// An `accept` that failed (out of file descriptors, say): said, and retried shortly.
async fn accept_failed(logs: &Logs, e: &io::Error) {
    logs.full.say(|held| {
        tracing::warn!(listener = logs.what, error = %e, suppressed = held, "cannot accept a connection");
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Accepts until `cancel`, taking a permit per connection.
async fn accept_loop(
    listener: TcpListener,
    limits: Limits,
    logs: Arc<Logs>,
    cancel: CancellationToken,
    mut each: impl FnMut(TcpStream, SocketAddr, OwnedSemaphorePermit) -> bool,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let max = limits.max_connections;
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                accept_failed(&logs, &e).await;
                continue;
            }
        };
        let Some(permit) = admit(&permits, &logs, max, peer) else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        if !each(tcp, peer, permit) {
            return;
        }
    }
}

/// Connections of a TLS listener, handshaken, for `serve_with_incoming`.
pub fn tls(
    listener: TcpListener,
    config: Arc<tokio_rustls::rustls::ServerConfig>,
    limits: Limits,
    cancel: CancellationToken,
) -> UnboundedReceiverStream<io::Result<Guarded<tokio_rustls::server::TlsStream<TcpStream>>>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let logs = Logs::new("grpc");
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(accept_loop(
        listener,
        limits,
        logs.clone(),
        cancel,
        move |tcp, peer, permit| {
            if tx.is_closed() {
                return false;
            }
            let (tx, acceptor, logs) = (tx.clone(), acceptor.clone(), logs.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(limits.handshake, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ =
                            tx.send(Ok(Guarded::new(tls, limits.idle, Some(peer), logs, permit)));
                    }
                    Ok(Err(e)) => tracing::debug!(peer = %peer, error = %e, "TLS handshake failed"),
                    Err(_) => logs.handshake.say(|held| {
                        tracing::warn!(peer = %peer, timeout = ?limits.handshake, suppressed = held,
                            "closed a connection that did not finish its TLS handshake in time");
                    }),
                }
            });
            true
        },
    ));
    UnboundedReceiverStream::new(rx)
}

/// Connections of a plain-text listener (`--insecure` on loopback), for `serve_with_incoming`.
pub fn plain(
    listener: TcpListener,
    limits: Limits,
    cancel: CancellationToken,
) -> UnboundedReceiverStream<io::Result<Guarded<TcpStream>>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let logs = Logs::new("grpc");
    tokio::spawn(accept_loop(
        listener,
        limits,
        logs.clone(),
        cancel,
        move |tcp, peer, permit| {
            tx.send(Ok(Guarded::new(
                tcp,
                limits.idle,
                Some(peer),
                logs.clone(),
                permit,
            )))
            .is_ok()
        },
    ));
    UnboundedReceiverStream::new(rx)
}

/// An axum listener with the same connection limit and idle timeout.
pub struct Limited {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    limits: Limits,
    logs: Arc<Logs>,
}

impl std::fmt::Debug for Limited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limited")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Limited {
    pub fn new(inner: TcpListener, limits: Limits) -> Self {
        Limited {
            inner,
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            logs: Logs::new("http"),
        }
    }
}

impl axum::serve::Listener for Limited {
    type Io = Guarded<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (tcp, peer) = match self.inner.accept().await {
                Ok(a) => a,
                Err(e) => {
                    accept_failed(&self.logs, &e).await;
                    continue;
                }
            };
            let max = self.limits.max_connections;
            let Some(permit) = admit(&self.permits, &self.logs, max, peer) else {
                continue;
            };
            let io = Guarded::new(tcp, self.limits.idle, Some(peer), self.logs.clone(), permit);
            return (io, peer);
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn a_throttled_line_speaks_once_a_second_and_counts_the_rest() {
        let t = Throttled::default();
        let mut said = Vec::new();
        for _ in 0..5 {
            t.say(|held| said.push(held));
        }
        assert_eq!(said, vec![0]);
        t.last.store(0, Ordering::Relaxed);
        t.say(|held| said.push(held));
        assert_eq!(said, vec![0, 4]);
    }

    #[tokio::test]
    async fn the_connection_limit_and_the_idle_timeout_close_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            handshake: Duration::from_secs(1),
            idle: Duration::from_millis(300),
            max_connections: 2,
        };
        let cancel = CancellationToken::new();
        let mut incoming = plain(listener, limits, cancel.clone());
        // An echo server on the accepted connections.
        tokio::spawn(async move {
            use tokio_stream::StreamExt;
            while let Some(Ok(mut conn)) = incoming.next().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let mut a = TcpStream::connect(addr).await.unwrap();
        let mut b = TcpStream::connect(addr).await.unwrap();
        a.write_all(b"a").await.unwrap();
        let mut one = [0u8; 1];
        a.read_exact(&mut one).await.unwrap();
        // Over the limit: closed at once.
        let mut c = TcpStream::connect(addr).await.unwrap();
        assert_eq!(
            c.read(&mut one).await.unwrap(),
            0,
            "the third connection is closed"
        );
        // Idle ones are closed after the idle timeout, which frees their permits.
        assert_eq!(b.read(&mut one).await.unwrap_or(0), 0);
        assert_eq!(a.read(&mut one).await.unwrap_or(0), 0);
        let mut d = TcpStream::connect(addr).await.unwrap();
        d.write_all(b"d").await.unwrap();
        d.read_exact(&mut one).await.unwrap();
        assert_eq!(&one, b"d");
        cancel.cancel();
    }
}
