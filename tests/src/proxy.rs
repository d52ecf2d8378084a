//! A TCP proxy on loopback whose connections a test can cut, to cut a worker off from its
//! coordinator without touching either process. New connections are accepted again at once
//! (a reconnecting worker gets through), unless the proxy is [`Proxy::block`]ed.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub struct Proxy {
    pub port: u16,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    blocked: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    /// Forwards 127.0.0.1:`port` (a free port) to 127.0.0.1:`upstream`.
    pub fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let blocked = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (conns, blocked, stop) = (conns.clone(), blocked.clone(), stop.clone());
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    if blocked.load(Ordering::SeqCst) {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    }
                    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    if let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) {
                        let mut held = conns.lock().unwrap_or_else(|e| e.into_inner());
                        held.push(c2);
                        held.push(s2);
                    }
                    pipe(&client, &server);
                    pipe(&server, &client);
                }
            });
        }
        Proxy {
            port,
            conns,
            blocked,
            stop,
        }
    }

    /// Cuts every connection open now.
    pub fn cut(&self) {
        for s in self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Refuses (`true`) or accepts (`false`) new connections.
    pub fn block(&self, blocked: bool) {
        self.blocked.store(blocked, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.cut();
        // Wake the accept loop so it sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn pipe(from: &TcpStream, to: &TcpStream) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}
