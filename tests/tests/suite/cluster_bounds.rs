//! What a client cannot make the coordinator hold or do, tried the way an attacker would
//! against a real coordinator on loopback: connections on its listeners (per peer, and for
//! how long a slow request may take), the sign-in redirect, and the sizes of what it sends
//! (each field, each request, and memory under several maximal launches at once).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use flotilla_tests::cluster::Cluster;
use flotilla_tests::{connect_from, http_get};

const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// Whether the server closed `conn` (EOF or reset) within `within`; `false` if it still
/// holds it open then.
fn closed_within(conn: &mut TcpStream, within: Duration) -> bool {
    conn.set_read_timeout(Some(within)).expect("timeout");
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

/// A connection that sends `start`, then one more byte of `trickle` every 200 ms until the
/// server closes it; counts itself in `closed` when that happens.
fn trickler(
    from: Ipv4Addr,
    port: u16,
    start: String,
    trickle: &'static [u8],
    closed: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<()> {
    let mut conn = connect_from(from, port);
    std::thread::spawn(move || {
        let _ = conn.write_all(start.as_bytes());
        conn.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let mut buf = [0u8; 4096];
        // Bounded: 600 bytes at 5 a second is two minutes, far past any read timeout here.
        for &b in trickle.iter().cycle().take(600) {
            match conn.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
            if conn.write_all(&[b]).is_err() {
                break;
            }
        }
        closed.fetch_add(1, Ordering::SeqCst);
    })
}

/// Slowloris on the page port: one peer's connections past its cap are refused at once, the
/// ones it holds are cut off at the read timeout though they keep sending (headers or a
/// body), and `/healthz` and `/livez` answer another peer all along.
#[test]
fn cluster_bounds_slow_clients_cannot_hold_the_page_listener() {
    const CAP: usize = 12;
    let c = Cluster::start_with_env(
        0,
        1,
        vec![
            ("FLOTILLA_MAX_CONNECTIONS_PER_PEER".into(), CAP.to_string()),
            ("FLOTILLA_READ_TIMEOUT".into(), "2s".into()),
        ],
    );
    let port = c.http_port;
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the pages never came up");
        std::thread::sleep(Duration::from_millis(100));
    }
    let closed = Arc::new(AtomicUsize::new(0));
    let mut held = Vec::new();
    // Headers, one byte at a time, never finished.
    for _ in 0..CAP - 2 {
        held.push(trickler(
            ATTACKER,
            port,
            format!("GET /runs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-A: "),
            b"a",
            closed.clone(),
        ));
    }
    // A body, one byte at a time, to a route that reads one (before any sign-in).
    for _ in 0..2 {
        held.push(trickler(
            ATTACKER,
            port,
            format!(
                "POST /runs/wf_00000000-000/control HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nx-flotilla: 1\r\nContent-Length: 60000\r\n\r\n{{\"action\":\""
            ),
            b"x",
            closed.clone(),
        ));
    }
    // Past the cap: closed at once, the listener being far from full.
    for _ in 0..5 {
        let mut extra = connect_from(ATTACKER, port);
        assert!(
            closed_within(&mut extra, Duration::from_secs(5)),
            "a connection past the peer's cap is refused"
        );
    }
    // Another peer is served while they trickle.
    for path in ["/healthz", "/livez"] {
        let r = http_get(port, path, &[]);
        assert_eq!(r.status, 200, "{path} while a peer trickles: {r:?}");
    }
    // Every trickling connection is cut off although it never went quiet (bounded poll).
    let deadline = Instant::now() + Duration::from_secs(60);
    while closed.load(Ordering::SeqCst) < CAP {
        assert!(
            Instant::now() < deadline,
            "only {} of {CAP} trickling connections were closed",
            closed.load(Ordering::SeqCst)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for t in held {
        t.join().expect("trickler");
    }
    // Their places are given back: the same peer is served again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut again = connect_from(ATTACKER, port);
        again
            .write_all(
                format!(
                    "GET /livez HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
                )
                .as_bytes(),
            )
            .expect("send");
        let mut answer = String::new();
        again
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let _ = again.read_to_string(&mut answer);
        if answer.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the peer is never served again: {answer:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).expect("log");
    assert!(
        log.contains("a peer reached its connection cap")
            && log.contains("max-connections-per-peer"),
        "the cap says so in the log, with the flag: {log}"
    );
}

/// The gRPC listener has the same per-peer cap: connections that never finish a handshake
/// from one peer stop at its cap, and a client elsewhere is served.
#[test]
fn cluster_bounds_one_peer_cannot_fill_the_grpc_listener() {
    const CAP: usize = 8;
    let c = Cluster::start_with_env(
        0,
        1,
        vec![("FLOTILLA_MAX_CONNECTIONS_PER_PEER".into(), CAP.to_string())],
    );
    let mut held: Vec<TcpStream> = (0..CAP).map(|_| connect_from(ATTACKER, c.port)).collect();
    let mut extra = connect_from(ATTACKER, c.port);
    assert!(
        closed_within(&mut extra, Duration::from_secs(5)),
        "a connection past the peer's cap is refused before any handshake"
    );
    let out = c.client(&["workers", "--json"]);
    assert_eq!(out.code, 0, "another peer is served: {out:?}");
    // The held ones are still open (they are within the cap; the handshake timeout, not the
    // cap, ends them).
    assert!(!closed_within(&mut held[0], Duration::from_millis(300)));
}

/// After sign-in the browser goes only to a path on this site: `next` values that a browser
/// would read as another host (`/\host`, `/<tab>/host`, `//host`, a scheme) go to `/runs`.
#[test]
fn cluster_bounds_sign_in_never_redirects_off_site() {
    let c = Cluster::start(0, 1);
    let t = c.client(&["token", "create", "--json", "--ttl", "1h"]);
    assert_eq!(t.code, 0, "{t:?}");
    let login = t.json()["login_url"]
        .as_str()
        .expect("login url")
        .to_owned();
    let login_path = login
        .split_once(&format!(":{}", c.http_port))
        .expect("the pages' port")
        .1
        .to_owned();
    for next in [
        "/%5Cevil.com",
        "/%09/evil.com",
        "%2F%2Fevil.com",
        "//evil.com",
        "/%5C%5Cevil.com",
        "/%0D%0A/evil.com",
        "https://evil.com/",
        "/%EF%BC%8Fevil.com",
    ] {
        let r = http_get(c.http_port, &format!("{login_path}&next={next}"), &[]);
        assert_eq!(r.status, 303, "{next}: {r:?}");
        assert_eq!(r.header("location"), Some("/runs"), "{next}: {r:?}");
    }
    let r = http_get(
        c.http_port,
        &format!("{login_path}&next=/runs/wf_00000000-000"),
        &[],
    );
    assert_eq!(r.header("location"), Some("/runs/wf_00000000-000"), "{r:?}");
}
