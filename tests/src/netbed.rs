//! Many hosts on one machine: each host is a network namespace with one interface (`eth0`),
//! joined to a switch — a bridge in a namespace of its own — by a veth pair. Addresses
//! (`10.77.0.0/24`) exist only inside the bed's namespaces, so nothing a test starts here can
//! reach, or be reached from, any other network.
//!
//! Faults are made where they happen on a real network:
//! - [`NetBed::cut`] drops every packet between two hosts, both ways, at each host's input
//!   (nftables): a silent partition, as a broken switch port makes, not a refused connection.
//!   [`NetBed::isolate`] cuts one host from all others; [`NetBed::heal`] and
//!   [`NetBed::heal_all`] undo it.
//! - [`NetBed::loss`] drops a share of the packets a host receives, at random (nftables
//!   `numgen random`).
//! - [`NetBed::delay`] gives the link between two hosts a latency: each host's packets to the
//!   other are held that long (see [`crate::latency`]; the kernel here has no `netem`).
//! - Processes are started in a host ([`NetBed::spawn`]) and can be killed or frozen by
//!   signal ([`NetBed::signal`]).
//!
//! A bed is torn down when dropped — its processes killed by PID, its namespaces (and with
//! them every veth) deleted — also when the test fails. A bed left by a test process that was
//! killed outright is removed by the next bed that starts.

use std::ffi::OsStr;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The bed's subnet: host `i` is `10.77.0.{10 + i}`.
const SUBNET: &str = "10.77.0";

/// One host of the bed.
#[derive(Debug, Clone)]
pub struct Host {
    pub name: String,
    /// Its network namespace (`/run/netns/{ns}`).
    pub ns: String,
    pub ip: String,
}

/// A process the bed started.
struct Started {
    label: String,
    host: String,
    child: Child,
}

/// The bed.
pub struct NetBed {
    tag: String,
    hosts: Vec<Host>,
    started: Vec<Started>,
    /// Each host's latency relay, started when it first delays a link.
    relays: std::sync::Mutex<std::collections::HashMap<String, crate::latency::Relay>>,
    /// The network's own one-way latency from one host to another ([`NetBed::latency`]):
    /// what [`NetBed::heal_all`] returns a delayed link to.
    base: std::sync::Mutex<std::collections::HashMap<(String, String), Duration>>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip (install iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn must_ip(args: &[&str]) {
    if let Err(e) = ip(args) {
        panic!("{e}");
    }
}

/// Deletes namespaces of beds whose test process is gone.
fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let ns = line.split_whitespace().next().unwrap_or_default();
        let Some(rest) = ns.strip_prefix("fb") else {
            continue;
        };
        let pid = rest.split(['x', '-']).next().unwrap_or_default();
        if !pid.is_empty()
            && pid.chars().all(|c| c.is_ascii_digit())
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

impl NetBed {
    /// A bed with one host per name, all joined to one switch and able to reach each other.
    /// Needs root (network namespaces), iproute2 and nftables (`.ci/run` installs them).
    pub fn new(names: &[&str]) -> NetBed {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        assert!(
            names.len() <= 200,
            "a bed holds at most 200 hosts, not {}",
            names.len()
        );
        sweep_stale();
        for tool in ["ip", "nft"] {
            assert!(
                Command::new(tool)
                    .arg("-V")
                    .output()
                    .is_ok_and(|o| o.status.success()),
                "{tool} is not installed; install iproute2 and nftables (`.ci/run` does)"
            );
        }
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("fb{}x{seq}", std::process::id());
        let mut bed = NetBed {
            tag: tag.clone(),
            hosts: Vec::new(),
            started: Vec::new(),
            relays: Default::default(),
            base: Default::default(),
        };
        let switch = format!("{tag}-switch");
        must_ip(&["netns", "add", &switch]);
        must_ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"]);
        must_ip(&["-n", &switch, "link", "set", "br0", "up"]);
        for (i, name) in names.iter().enumerate() {
            assert!(
                name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
                "host name {name:?}: letters, digits and '-'"
            );
            let ns = format!("{tag}-{name}");
            let host_if = format!("h{seq}x{i}");
            let port_if = format!("s{seq}x{i}");
            let ip_addr = format!("{SUBNET}.{}", 10 + i);
            bed.hosts.push(Host {
                name: (*name).to_owned(),
                ns: ns.clone(),
                ip: ip_addr.clone(),
            });
            must_ip(&["netns", "add", &ns]);
            must_ip(&[
                "link", "add", &host_if, "netns", &ns, "type", "veth", "peer", "name", &port_if,
                "netns", &switch,
            ]);
            must_ip(&["-n", &ns, "link", "set", &host_if, "name", "eth0"]);
            must_ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{ip_addr}/24"),
                "dev",
                "eth0",
            ]);
            must_ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            must_ip(&["-n", &ns, "link", "set", "lo", "up"]);
            must_ip(&["-n", &switch, "link", "set", &port_if, "master", "br0"]);
            must_ip(&["-n", &switch, "link", "set", &port_if, "up"]);
            bed.nft(
                name,
                "table inet bed {\n\
                   set cut { type ipv4_addr; }\n\
                   chain loss { }\n\
                   chain input {\n\
                     type filter hook input priority 0; policy accept;\n\
                     ip saddr @cut drop\n\
                     iifname \"eth0\" jump loss\n\
                   }\n\
                 }\n",
            );
        }
        bed
    }

    /// The host named `name`.
    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name:?} in this bed"))
    }

    /// The address of host `name`.
    pub fn ip(&self, name: &str) -> &str {
        &self.host(name).ip
    }

    /// Every host.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Runs `nft -f -` with `rules` in host `name`.
    fn nft(&self, name: &str, rules: &str) {
        use std::io::Write;
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.host(name).ns, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run nft");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(rules.as_bytes())
            .expect("write nft rules");
        let out = child.wait_with_output().expect("nft");
        assert!(
            out.status.success(),
            "nft in {name} refused {rules:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A command that runs `program` in host `name`.
    pub fn command(&self, name: &str, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.host(name).ns])
            .arg(program)
            .stdin(Stdio::null());
        cmd
    }

    /// Starts `cmd` (from [`NetBed::command`]) as `label`, its output appended to `log`.
    pub fn spawn(&mut self, label: &str, host: &str, mut cmd: Command, log: &Path) -> u32 {
        assert!(
            self.started.iter().all(|s| s.label != label),
            "{label} is already started"
        );
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("log file");
        let child = cmd
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {label}: {e}"));
        let pid = child.id();
        self.started.push(Started {
            label: label.to_owned(),
            host: host.to_owned(),
            child,
        });
        pid
    }

    /// The PID of process `label` (`ip netns exec` execs the program: it is the program's).
    pub fn pid(&self, label: &str) -> u32 {
        self.started(label).child.id()
    }

    fn started(&self, label: &str) -> &Started {
        self.started
            .iter()
            .find(|s| s.label == label)
            .unwrap_or_else(|| panic!("no process {label:?} in this bed"))
    }

    /// The host process `label` runs in.
    pub fn host_of(&self, label: &str) -> &str {
        &self.started(label).host
    }

    /// Sends `signal` (`KILL`, `STOP`, `CONT`, `TERM`) to process `label`. A killed process is
    /// reaped and forgotten, so its label can be started again.
    pub fn signal(&mut self, label: &str, signal: &str) {
        let pid = self.pid(label);
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "cannot send SIG{signal} to {label} ({pid})");
        if signal == "KILL" {
            let i = self
                .started
                .iter()
                .position(|s| s.label == label)
                .expect("started");
            let mut s = self.started.remove(i);
            let _ = s.child.wait();
        }
    }

    /// Forgets process `label`, which has exited, so its label can be started again.
    pub fn forget(&mut self, label: &str) {
        if let Some(i) = self.started.iter().position(|s| s.label == label) {
            let mut s = self.started.remove(i);
            let _ = s.child.kill();
            let _ = s.child.wait();
        }
    }

    /// Whether process `label` has exited (and how).
    pub fn exited(&mut self, label: &str) -> Option<std::process::ExitStatus> {
        let s = self
            .started
            .iter_mut()
            .find(|s| s.label == label)
            .unwrap_or_else(|| panic!("no process {label:?} in this bed"));
        s.child.try_wait().ok().flatten()
    }

    fn set_cut(&self, on: &str, from: &str, cut: bool) {
        let verb = if cut { "add" } else { "delete" };
        let rule = format!("{verb} element inet bed cut {{ {} }}\n", self.ip(from));
        // Deleting an element that is not there is an error to nft; healing twice is not one.
        if !cut && !self.is_cut(on, from) {
            return;
        }
        if cut && self.is_cut(on, from) {
            return;
        }
        self.nft(on, &rule);
    }

    fn is_cut(&self, on: &str, from: &str) -> bool {
        let out = self
            .command(on, "nft")
            .args(["list", "set", "inet", "bed", "cut"])
            .output()
            .expect("nft list");
        let listing = String::from_utf8_lossy(&out.stdout);
        let ip = self.ip(from);
        listing
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .any(|w| w == ip)
    }

    /// Drops every packet between hosts `a` and `b`, both ways.
    pub fn cut(&self, a: &str, b: &str) {
        self.set_cut(a, b, true);
        self.set_cut(b, a, true);
    }

    /// Lets packets between `a` and `b` through again.
    pub fn heal(&self, a: &str, b: &str) {
        self.set_cut(a, b, false);
        self.set_cut(b, a, false);
    }

    /// Cuts host `a` from every other host.
    pub fn isolate(&self, a: &str) {
        for h in &self.hosts {
            if h.name != a {
                self.cut(a, &h.name);
            }
        }
    }

    /// Heals every cut and ends every loss; a delayed link gets back the network's own
    /// latency ([`NetBed::latency`], none unless given).
    pub fn heal_all(&self) {
        for h in &self.hosts {
            self.nft(
                &h.name,
                "flush set inet bed cut\nflush chain inet bed loss\n",
            );
        }
        let delayed: Vec<String> = self.lock_relays().keys().cloned().collect();
        for a in delayed {
            for b in &self.hosts {
                if b.name != a {
                    let base = self.base_latency(&a, &b.name);
                    self.delay_one_way(&a, &b.name, base);
                }
            }
        }
    }

    /// The network's own latency on the link between `a` and `b`, each way: it stays through
    /// faults and heals ([`NetBed::delay`] is a fault on top of it).
    pub fn latency(&self, a: &str, b: &str, one_way: Duration) {
        let mut base = self.base.lock().unwrap_or_else(|e| e.into_inner());
        base.insert((a.to_owned(), b.to_owned()), one_way);
        base.insert((b.to_owned(), a.to_owned()), one_way);
        drop(base);
        self.delay(a, b, one_way);
    }

    fn base_latency(&self, from: &str, to: &str) -> Duration {
        self.base
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(from.to_owned(), to.to_owned()))
            .copied()
            .unwrap_or_default()
    }

    /// A fault: the link between `a` and `b` gets a latency of `one_way` each way (the round
    /// trip takes twice that) until it is set again or healed. Packets already held still
    /// arrive.
    pub fn delay(&self, a: &str, b: &str, one_way: Duration) {
        self.delay_one_way(a, b, one_way);
        self.delay_one_way(b, a, one_way);
    }

    /// Host `from` holds its packets to `to` for `delay`.
    fn delay_one_way(&self, from: &str, to: &str, delay: Duration) {
        let ns = self.host(from).ns.clone();
        let to_ip: std::net::Ipv4Addr = self.ip(to).parse().expect("an IPv4 address");
        let mut relays = self.lock_relays();
        if !relays.contains_key(from) {
            if delay.is_zero() {
                return;
            }
            relays.insert(from.to_owned(), self.start_relay(from));
        }
        let route = format!("{to_ip}/32");
        if delay.is_zero() {
            // Straight out of eth0 again; nothing new is held.
            let _ = ip(&[
                "-n",
                &ns,
                "route",
                "del",
                &route,
                "dev",
                crate::latency::DEVICE,
            ]);
        } else {
            must_ip(&[
                "-n",
                &ns,
                "route",
                "replace",
                &route,
                "dev",
                crate::latency::DEVICE,
                "src",
                self.ip(from),
            ]);
        }
        relays[from].set(to_ip, delay);
    }

    /// Sets host `name` up for delays: the relay (with its TUN device) and the routing of the
    /// packets it sends on.
    fn start_relay(&self, name: &str) -> crate::latency::Relay {
        use crate::latency::{DEVICE, MARK, Relay, TABLE};
        let ns = self.host(name).ns.clone();
        let (mark, table) = (format!("{MARK:#x}"), TABLE.to_string());
        let relay = Relay::start(format!("/run/netns/{ns}")).unwrap_or_else(|e| panic!("{e}"));
        must_ip(&[
            "-n", &ns, "rule", "add", "fwmark", &mark, "lookup", &table, "priority", "100",
        ]);
        must_ip(&[
            "-n",
            &ns,
            "route",
            "add",
            &format!("{SUBNET}.0/24"),
            "dev",
            "eth0",
            "table",
            &table,
        ]);
        // Replies from a delayed peer come in on eth0 while the route to it points at the TUN
        // device: strict reverse-path filtering would drop them.
        self.within(name, || {
            for conf in ["all", "default", "eth0", DEVICE] {
                let path = format!("/proc/sys/net/ipv4/conf/{conf}/rp_filter");
                std::fs::write(&path, "0").unwrap_or_else(|e| panic!("write {path}: {e}"));
            }
        });
        relay
    }

    fn lock_relays(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, crate::latency::Relay>> {
        self.relays.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Host `a` drops `percent` of the packets it receives, at random (0 ends it).
    pub fn loss(&self, a: &str, percent: u32) {
        assert!(percent <= 100, "a loss of {percent}%");
        let mut rules = "flush chain inet bed loss\n".to_owned();
        match percent {
            0 => {}
            // (nft's `numgen random mod 100` is 0 to 99: `< 100` is out of its range.)
            100 => rules.push_str("add rule inet bed loss drop\n"),
            p => rules.push_str(&format!(
                "add rule inet bed loss numgen random mod 100 < {p} drop\n"
            )),
        }
        self.nft(a, &rules);
    }

    /// Runs `f` on a thread that has entered host `name`'s network namespace: every socket it
    /// opens is the host's (so the test itself can talk to the bed's servers).
    pub fn within<T: Send + 'static>(
        &self,
        name: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let path = format!("/run/netns/{}", self.host(name).ns);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .unwrap_or_else(|e| panic!("cannot enter {path}: {e}"));
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }

    /// Whether something in host `to` accepts TCP connections on `port`, tried from host
    /// `from`.
    pub fn answers(&self, from: &str, to: &str, port: u16) -> bool {
        let addr: SocketAddr = format!("{}:{port}", self.ip(to)).parse().expect("address");
        self.within(from, move || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
        })
    }

    /// Waits until host `to` accepts connections on `port` from host `from`.
    pub fn wait_listening(&self, from: &str, to: &str, port: u16, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.answers(from, to, port) {
            assert!(
                Instant::now() < deadline,
                "{what} never listened on {}:{port}",
                self.ip(to)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for NetBed {
    fn drop(&mut self) {
        for s in &mut self.started {
            let _ = s.child.kill();
            let _ = s.child.wait();
        }
        self.lock_relays().clear();
        for h in &self.hosts {
            let _ = ip(&["netns", "del", &h.ns]);
        }
        let _ = ip(&["netns", "del", &format!("{}-switch", self.tag)]);
    }
}
