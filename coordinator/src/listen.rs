//! Listeners a peer without a certificate cannot wear down.
//!
//! Every connection the coordinator accepts (gRPC and the session pages) takes a place among
//! [`ConnLimits::max_connections`], and at most [`ConnLimits::max_per_peer`] of them belong to one
//! peer (an IPv4 address, or an IPv6 /64): past its share a peer's new connection is closed
//! at once. When the listener is full, a newcomer holding fewer connections than the busiest
//! peer takes the place of that peer's oldest connection, which is closed; so a peer that
//! opens few connections (a kubelet's probe, a person's browser) always gets in, however
//! many addresses an attacker spreads its connections over, unless every connection belongs
//! to a peer with no more than the newcomer's. A TLS handshake that has not finished within
//! [`ConnLimits::handshake`] is dropped, and a connection with no bytes in either direction for
//! [`ConnLimits::idle`] is closed (healthy gRPC peers are never idle that long: the server pings
//! them every keep-alive interval). Each of these says so in the log, at most once a second,
//! with how many it suppressed.
//!
//! A connection that trickles bytes is never idle: the page server bounds how long a
//! request's headers and body may take ([`ConnLimits::read`], `web::serve_router`).
//!
//! The gRPC face gets its connections from [`tls`] (or [`plain`] with `--insecure`) through
//! `serve_with_incoming`; the pages from [`Limited`].

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio_util::task::TaskTracker;

use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::sync::CancellationToken;

/// What one listener allows.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Longest a TLS handshake may take.
    pub handshake: Duration,
    /// Longest a connection may go without a byte either way.
    pub idle: Duration,
    /// Connections open at once (handshaking ones included).
    pub max_connections: usize,
    /// Connections one peer (an IPv4 address, an IPv6 /64) may hold open at once.
    pub max_per_peer: usize,
    /// The pages: longest a request's headers may take to arrive, and then its body.
    pub read: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(300),
            max_connections: 4096,
            max_per_peer: 256,
            read: Duration::from_secs(10),
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
    per_peer: Throttled,
    evicted: Throttled,
    handshake: Throttled,
    idle: Throttled,
}

/// Who a connection counts against: its IPv4 address, or the /64 of its IPv6 address (one
/// host gets a /64, and would otherwise have 2^64 addresses to spread over).
fn peer_of(addr: &SocketAddr) -> IpAddr {
    match addr.ip() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        },
    }
}

/// One open connection's place in its listener.
#[derive(Debug)]
struct Slot {
    id: u64,
    peer: IpAddr,
    /// Set when a newcomer took this place; the connection fails its next read or write.
    evicted: AtomicBool,
    /// Set once its peer proved who it is (a finished mutual-TLS handshake): such a
    /// connection is never closed to make room for a newcomer.
    authenticated: AtomicBool,
    waker: AtomicWaker,
}

/// The connections a listener holds, by peer, oldest first.
#[derive(Debug, Default)]
struct Table {
    total: usize,
    peers: HashMap<IpAddr, VecDeque<Arc<Slot>>>,
}

/// Who holds a listener's places: the connection limit, the per-peer cap, and the eviction
/// of the busiest peer's oldest connection when the listener is full.
#[derive(Debug)]
struct Gate {
    limits: ConnLimits,
    logs: Logs,
    table: Mutex<Table>,
    next: AtomicU64,
}

impl Gate {
    fn new(what: &'static str, limits: ConnLimits) -> Arc<Gate> {
        Arc::new(Gate {
            limits,
            logs: Logs {
                what,
                full: Throttled::default(),
                per_peer: Throttled::default(),
                evicted: Throttled::default(),
                handshake: Throttled::default(),
                idle: Throttled::default(),
            },
            table: Mutex::new(Table::default()),
            next: AtomicU64::new(0),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for a new connection from `addr`, or `None` (logged) when it gets none.
    fn admit(&self, addr: SocketAddr) -> Option<Arc<Slot>> {
        let peer = peer_of(&addr);
        let (what, max, per_peer) = (
            self.logs.what,
            self.limits.max_connections,
            self.limits.max_per_peer,
        );
        let mut t = self.table();
        let mine = t.peers.get(&peer).map_or(0, VecDeque::len);
        if mine >= per_peer {
            drop(t);
            self.logs.per_peer.say(|held| {
                tracing::warn!(listener = what, peer = %peer, limit = per_peer, suppressed = held,
                    "a peer reached its connection cap; closed its new connection at once (raise --max-connections-per-peer if many clients share this address, e.g. behind a proxy)");
            });
            return None;
        }
        if t.total >= max {
            // The busiest peer gives up its oldest connection that has not authenticated, if
            // it holds more of them than the newcomer would: no one who has not proved who
            // they are closes the link of someone who has.
            let open = |q: &VecDeque<Arc<Slot>>| {
                q.iter()
                    .filter(|s| !s.authenticated.load(Ordering::Acquire))
                    .count()
            };
            let busiest = t
                .peers
                .iter()
                .map(|(p, q)| (*p, open(q)))
                .max_by_key(|(_, n)| *n)
                .filter(|(_, n)| *n > mine + 1)
                .map(|(p, _)| p);
            let Some(victim) = busiest.and_then(|p| {
                let q = t.peers.get_mut(&p)?;
                let at = q
                    .iter()
                    .position(|s| !s.authenticated.load(Ordering::Acquire))?;
                let v = q.remove(at);
                if q.is_empty() {
                    t.peers.remove(&p);
                }
                v
            }) else {
                drop(t);
                self.logs.full.say(|held| {
                    tracing::warn!(listener = what, peer = %addr, limit = max, suppressed = held,
                        "connection limit reached; closed a new connection at once (raise --max-connections if this is real load)");
                });
                return None;
            };
            t.total -= 1;
            victim.evicted.store(true, Ordering::Release);
            victim.waker.wake();
            let (from, to) = (victim.peer, peer);
            self.logs.evicted.say(|held| {
                tracing::warn!(listener = what, limit = max, evicted_peer = %from, for_peer = %to, suppressed = held,
                    "connection limit reached; closed the oldest connection of the peer holding the most to let a new peer in");
            });
        }
        let slot = Arc::new(Slot {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            peer,
            evicted: AtomicBool::new(false),
            authenticated: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        });
        t.peers.entry(peer).or_default().push_back(slot.clone());
        t.total += 1;
        Some(slot)
    }

    /// Gives `slot`'s place back (an evicted one gave it already).
    fn release(&self, slot: &Slot) {
        let mut t = self.table();
        let Some(q) = t.peers.get_mut(&slot.peer) else {
            return;
        };
        let Some(i) = q.iter().position(|s| s.id == slot.id) else {
            return;
        };
        q.remove(i);
        if q.is_empty() {
            t.peers.remove(&slot.peer);
        }
        t.total -= 1;
    }

    /// Connections held now, all and by `addr`'s peer (for tests).
    #[cfg(test)]
    fn held(&self, addr: SocketAddr) -> (usize, usize) {
        let t = self.table();
        let mine = t.peers.get(&peer_of(&addr)).map_or(0, VecDeque::len);
        (t.total, mine)
    }
}

/// A connection that holds its place and closes itself when idle or evicted.
pub struct Guarded<T> {
    inner: T,
    idle: Duration,
    last_io: Instant,
    timer: Pin<Box<Sleep>>,
    peer: SocketAddr,
    gate: Arc<Gate>,
    slot: Arc<Slot>,
}

impl<T> std::fmt::Debug for Guarded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guarded")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl<T> Drop for Guarded<T> {
    fn drop(&mut self) {
        self.gate.release(&self.slot);
    }
}

impl<T> Guarded<T> {
    fn new(inner: T, peer: SocketAddr, gate: Arc<Gate>, slot: Arc<Slot>) -> Self {
        let now = Instant::now();
        let idle = gate.limits.idle;
        Guarded {
            inner,
            idle,
            last_io: now,
            timer: Box::pin(tokio::time::sleep_until(now + idle)),
            peer,
            gate,
            slot,
        }
    }

    /// `Err` once a newcomer took this connection's place.
    fn check_evicted(&self, cx: &mut Context<'_>) -> io::Result<()> {
        self.slot.waker.register(cx.waker());
        if self.slot.evicted.load(Ordering::Acquire) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room for a peer with fewer connections",
            ));
        }
        Ok(())
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
            let (what, peer, idle) = (self.gate.logs.what, self.peer, self.idle);
            self.gate.logs.idle.say(|held| {
                tracing::warn!(listener = what, peer = %peer, idle = ?idle, suppressed = held,
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
        self.check_evicted(cx)?;
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
        self.check_evicted(cx)?;
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

/// An `accept` that failed (out of file descriptors, say): said, and retried shortly.
async fn accept_failed(logs: &Logs, e: &io::Error) {
    logs.full.say(|held| {
        tracing::warn!(listener = logs.what, error = %e, suppressed = held, "cannot accept a connection");
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// The next connection `gate` admits.
async fn accept_one(listener: &TcpListener, gate: &Arc<Gate>) -> Guarded<TcpStream> {
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                accept_failed(&gate.logs, &e).await;
                continue;
            }
        };
        let Some(slot) = gate.admit(peer) else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        return Guarded::new(tcp, peer, gate.clone(), slot);
    }
}

/// Accepts until `cancel` or until `each` says stop.
async fn accept_loop(
    listener: TcpListener,
    gate: Arc<Gate>,
    cancel: CancellationToken,
    mut each: impl FnMut(Guarded<TcpStream>) -> bool,
) {
    loop {
        let conn = tokio::select! {
            _ = cancel.cancelled() => return,
            c = accept_one(&listener, &gate) => c,
        };
        if !each(conn) {
            return;
        }
    }
}

/// Connections of a TLS listener, handshaken, for `serve_with_incoming`.
pub fn tls(
    listener: TcpListener,
    config: Arc<tokio_rustls::rustls::ServerConfig>,
    limits: ConnLimits,
    cancel: CancellationToken,
    tasks: &TaskTracker,
) -> UnboundedReceiverStream<io::Result<tokio_rustls::server::TlsStream<Guarded<TcpStream>>>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let gate = Gate::new("grpc", limits);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let handshakes = tasks.clone();
    tasks.spawn(accept_loop(listener, gate.clone(), cancel, move |conn| {
        if tx.is_closed() {
            return false;
        }
        let (tx, acceptor, gate) = (tx.clone(), acceptor.clone(), gate.clone());
        let peer = conn.peer;
        // Ends with the handshake, which has a timeout.
        handshakes.spawn(async move {
            match tokio::time::timeout(limits.handshake, acceptor.accept(conn)).await {
                Ok(Ok(tls)) => {
                    // The client's certificate checked out: this connection is no longer
                    // one a newcomer may take the place of.
                    tls.get_ref()
                        .0
                        .slot
                        .authenticated
                        .store(true, Ordering::Release);
                    let _ = tx.send(Ok(tls));
                }
                Ok(Err(e)) => tracing::debug!(peer = %peer, error = %e, "TLS handshake failed"),
                Err(_) => gate.logs.handshake.say(|held| {
                    tracing::warn!(peer = %peer, timeout = ?limits.handshake, suppressed = held,
                        "closed a connection that did not finish its TLS handshake in time");
                }),
            }
        });
        true
    }));
    UnboundedReceiverStream::new(rx)
}

/// Connections of a plain-text listener (`--insecure` on loopback), for `serve_with_incoming`.
pub fn plain(
    listener: TcpListener,
    limits: ConnLimits,
    cancel: CancellationToken,
    tasks: &TaskTracker,
) -> UnboundedReceiverStream<io::Result<Guarded<TcpStream>>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let gate = Gate::new("grpc", limits);
    tasks.spawn(accept_loop(listener, gate, cancel, move |conn| {
        tx.send(Ok(conn)).is_ok()
    }));
    UnboundedReceiverStream::new(rx)
}

/// The pages' listener, with the same limits.
pub struct Limited {
    inner: TcpListener,
    gate: Arc<Gate>,
}

impl std::fmt::Debug for Limited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limited")
            .field("limits", &self.gate.limits)
            .finish_non_exhaustive()
    }
}

impl Limited {
    pub fn new(inner: TcpListener, limits: ConnLimits) -> Self {
        Limited {
            inner,
            gate: Gate::new("http", limits),
        }
    }

    /// The next connection admitted.
    pub async fn accept(&self) -> Guarded<TcpStream> {
        accept_one(&self.inner, &self.gate).await
    }

    pub fn limits(&self) -> ConnLimits {
        self.gate.limits
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
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
        let limits = ConnLimits {
            handshake: Duration::from_secs(1),
            idle: Duration::from_millis(300),
            max_connections: 2,
            ..ConnLimits::default()
        };
        let cancel = CancellationToken::new();
        let mut incoming = plain(listener, limits, cancel.clone(), &TaskTracker::new());
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

    /// An echo server on `plain` connections with `limits`; its address.
    async fn echo(limits: ConnLimits, cancel: &CancellationToken) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = plain(listener, limits, cancel.clone(), &TaskTracker::new());
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
        addr
    }

    /// A connection to `to` from the loopback address `from` (all of 127/8 is loopback).
    async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
        socket.connect(to).await.unwrap()
    }

    /// Whether `conn` still echoes (false: the listener closed it).
    async fn echoes(conn: &mut TcpStream) -> bool {
        let mut one = [0u8; 1];
        conn.write_all(b"x").await.is_ok() && matches!(conn.read(&mut one).await, Ok(1))
    }

    #[tokio::test]
    async fn a_peer_past_its_cap_is_refused_and_a_full_listener_lets_a_new_peer_in() {
        let cancel = CancellationToken::new();
        let limits = ConnLimits {
            max_connections: 4,
            max_per_peer: 3,
            ..ConnLimits::default()
        };
        let addr = echo(limits, &cancel).await;
        let mut attacker = Vec::new();
        for _ in 0..3 {
            let mut c = connect_from("127.0.0.2", addr).await;
            assert!(echoes(&mut c).await);
            attacker.push(c);
        }
        // Past its cap: closed at once, though the listener has room.
        let mut fourth = connect_from("127.0.0.2", addr).await;
        assert!(
            !echoes(&mut fourth).await,
            "the peer's 4th connection is refused"
        );
        // Another address of the attacker's fills the listener.
        let mut other = connect_from("127.0.0.3", addr).await;
        assert!(echoes(&mut other).await);
        // A newcomer still gets in: the busiest peer's oldest connection makes room.
        let mut probe = connect_from("127.0.0.1", addr).await;
        assert!(echoes(&mut probe).await, "the new peer is served");
        assert!(
            !echoes(&mut attacker[0]).await,
            "the busiest peer's oldest is closed"
        );
        assert!(echoes(&mut attacker[2]).await && echoes(&mut other).await);
        // Full, and nobody holds more than a newcomer from 127.0.0.3 would: refused.
        let mut again = connect_from("127.0.0.3", addr).await;
        assert!(
            !echoes(&mut again).await,
            "no peer holds more than the newcomer's share"
        );
        cancel.cancel();
    }

    #[test]
    fn an_ipv6_peer_is_its_64_and_a_mapped_ipv4_is_its_address() {
        let a: SocketAddr = "[2001:db8:1:2:aaaa::1]:5".parse().unwrap();
        let b: SocketAddr = "[2001:db8:1:2:bbbb::9]:6".parse().unwrap();
        let c: SocketAddr = "[2001:db8:1:3::1]:6".parse().unwrap();
        assert_eq!(peer_of(&a), peer_of(&b));
        assert_ne!(peer_of(&a), peer_of(&c));
        let mapped: SocketAddr = "[::ffff:10.0.0.7]:1".parse().unwrap();
        assert_eq!(peer_of(&mapped), "10.0.0.7".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn a_newcomer_never_takes_the_place_of_an_authenticated_connection() {
        let gate = Gate::new(
            "test",
            ConnLimits {
                max_connections: 4,
                max_per_peer: 4,
                ..ConnLimits::default()
            },
        );
        let workers: SocketAddr = "10.0.0.1:1".parse().unwrap();
        let held: Vec<Arc<Slot>> = (0..4).map(|_| gate.admit(workers).unwrap()).collect();
        for s in &held {
            s.authenticated.store(true, Ordering::Release);
        }
        // Many newcomers from many addresses (an attacker's): none gets a worker's place.
        for i in 2..40 {
            let addr: SocketAddr = format!("10.0.{i}.9:1").parse().unwrap();
            assert!(gate.admit(addr).is_none(), "{addr}");
        }
        assert!(held.iter().all(|s| !s.evicted.load(Ordering::Acquire)));
        assert_eq!(gate.held(workers), (4, 4));
        // Two of them still in their handshakes: the busiest peer's oldest of those goes.
        held[1].authenticated.store(false, Ordering::Release);
        held[2].authenticated.store(false, Ordering::Release);
        assert!(gate.admit("10.0.99.9:1".parse().unwrap()).is_some());
        assert!(held[1].evicted.load(Ordering::Acquire));
        assert!(
            !held[0].evicted.load(Ordering::Acquire) && !held[3].evicted.load(Ordering::Acquire)
        );
    }

    #[test]
    fn a_place_given_back_is_counted_once() {
        let gate = Gate::new(
            "test",
            ConnLimits {
                max_connections: 2,
                max_per_peer: 2,
                ..ConnLimits::default()
            },
        );
        let a: SocketAddr = "127.0.0.2:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let s1 = gate.admit(a).unwrap();
        let _s2 = gate.admit(a).unwrap();
        assert_eq!(gate.held(a), (2, 2));
        // Full: the newcomer takes s1's place; s1's own release later changes nothing.
        let _s3 = gate.admit(b).unwrap();
        assert!(s1.evicted.load(Ordering::Acquire));
        assert_eq!(gate.held(a), (2, 1));
        gate.release(&s1);
        assert_eq!(gate.held(b), (2, 1));
    }
}
