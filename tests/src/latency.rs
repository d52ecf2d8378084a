//! Link latency without `netem` (this machine's kernel has none): a host's packets to a
//! delayed peer are routed into a TUN device, held by a relay thread for the link's delay,
//! and sent on through `eth0` from a raw socket. Whole IP packets are delayed, so TCP sees a
//! longer round trip (its timers, windows and retransmits behave as on a slow link); nothing
//! is rewritten or reordered within a link.
//!
//! How a packet goes, in host A delaying its traffic to B:
//! - A's route to B (`B/32 dev dly0`) hands the packet to the TUN device `dly0`;
//! - the relay reads it, keeps it until its time, and sends it with a raw socket whose packets
//!   carry firewall mark [`MARK`];
//! - marked packets are routed by table [`TABLE`], which sends the bed's subnet out of `eth0`.
//!
//! Each host that delays anything has one relay thread; it lives in the host's network
//! namespace and stops (its device with it) when the bed is dropped. (The TUN device is made
//! by the `tun` crate: attaching to one takes an ioctl, and this workspace has no unsafe code.)

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::socket::{self, AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType};

/// The firewall mark of packets the relay sends on.
pub const MARK: u32 = 0x77;
/// The routing table marked packets follow.
pub const TABLE: u32 = 77;
/// The TUN device of a host's relay (it lives as long as the relay).
pub const DEVICE: &str = "dly0";

/// One host's relay.
pub struct Relay {
    delays: Arc<Mutex<HashMap<Ipv4Addr, Duration>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    /// Starts the relay of the namespace at `ns_path`, whose TUN device [`DEVICE`] exists.
    pub fn start(ns_path: String) -> Result<Relay, String> {
        let delays = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let (delays, stop) = (delays.clone(), stop.clone());
            std::thread::spawn(move || match open(&ns_path) {
                Ok((tun, raw)) => {
                    let _ = ready_tx.send(Ok(()));
                    relay(&tun, &raw, &delays, &stop);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
        };
        ready_rx
            .recv()
            .map_err(|_| "the relay thread died".to_owned())??;
        Ok(Relay {
            delays,
            stop,
            thread: Some(thread),
        })
    }

    /// Holds packets to `to` for `delay` from now on (zero: no delay).
    pub fn set(&self, to: Ipv4Addr, delay: Duration) {
        let mut delays = self.delays.lock().unwrap_or_else(|e| e.into_inner());
        if delay.is_zero() {
            delays.remove(&to);
        } else {
            delays.insert(to, delay);
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Enters the namespace, makes the TUN device there (up) and opens the raw socket.
fn open(ns_path: &str) -> Result<(tun::Device, OwnedFd), String> {
    let ns = std::fs::File::open(ns_path).map_err(|e| format!("open {ns_path}: {e}"))?;
    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|e| format!("cannot enter {ns_path}: {e}"))?;
    let mut config = tun::Configuration::default();
    config.tun_name(DEVICE).mtu(1500).up();
    let dev = tun::create(&config).map_err(|e| format!("cannot make {DEVICE}: {e}"))?;
    dev.set_nonblock()
        .map_err(|e| format!("cannot make {DEVICE} non-blocking: {e}"))?;
    let raw = socket::socket(
        AddressFamily::Inet,
        SockType::Raw,
        SockFlag::empty(),
        SockProtocol::Raw,
    )
    .map_err(|e| format!("cannot open a raw socket: {e}"))?;
    socket::setsockopt(&raw, socket::sockopt::Mark, &MARK)
        .map_err(|e| format!("cannot mark the raw socket: {e}"))?;
    Ok((dev, raw))
}

/// Reads packets from the TUN device and sends each on once its delay has passed.
fn relay(
    tun: &tun::Device,
    raw: &OwnedFd,
    delays: &Mutex<HashMap<Ipv4Addr, Duration>>,
    stop: &AtomicBool,
) {
    let mut held: BinaryHeap<Reverse<(Instant, u64, Vec<u8>)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Acquire) {
        let now = Instant::now();
        let wait = held
            .peek()
            .map_or(Duration::from_millis(50), |Reverse((due, _, _))| {
                due.saturating_duration_since(now)
            })
            .clamp(Duration::from_millis(1), Duration::from_millis(50));
        // The first packet within `wait`, then whatever else is there.
        let mut got = tun.recv_timeout(&mut buf, wait);
        while let Ok(n) = got {
            if n >= 20 && buf[0] >> 4 == 4 {
                let to = Ipv4Addr::new(buf[16], buf[17], buf[18], buf[19]);
                let delay = delays
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&to)
                    .copied()
                    .unwrap_or_default();
                seq += 1;
                held.push(Reverse((Instant::now() + delay, seq, buf[..n].to_vec())));
            }
            // (Not IPv4: the kernel's own IPv6 chatter on a new link, not the bed's.)
            got = tun.recv(&mut buf);
        }
        let now = Instant::now();
        while held.peek().is_some_and(|Reverse((due, _, _))| *due <= now) {
            let Reverse((_, _, packet)) = held.pop().expect("peeked");
            let to = Ipv4Addr::new(packet[16], packet[17], packet[18], packet[19]);
            let addr = socket::SockaddrIn::from(std::net::SocketAddrV4::new(to, 0));
            // A send that fails is a packet lost, as on a real link.
            let _ = socket::sendto(raw.as_raw_fd(), &packet, &addr, MsgFlags::empty());
        }
    }
}
