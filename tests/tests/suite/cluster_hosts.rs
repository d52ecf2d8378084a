//! The fleet on many hosts (issue 15): etcd, S3, coordinators and workers each in a network
//! namespace of its own, joined by a switch, with faults made where they happen — links cut
//! (packets dropped, not refused), slowed and lossy, processes frozen and killed, etcd members
//! lost. Every link the fleet uses has a latency of its own ([`Plan::latency`], 5 ms each way)
//! through all of it.
//!
//! Each nemesis runs a fan-out of sleeping echo agents and checks the invariants: the run
//! completes, every call's result is journaled exactly once (none lost, none accepted
//! twice), and the faults cost a bounded number of extra attempts.
//! (Module name `cluster_*`: nextest runs these one at a time, see .config/nextest.toml.)

use std::time::{Duration, Instant};

use flotilla_tests::hostfleet::{HostFleet, Plan, coordinator_host, etcd_host, worker_host};
use serde_json::Value;

const CALLS: usize = 200;

/// A fan-out of `CALLS` agents that sleep `ms` each.
fn fan_out(f: &HostFleet, at: usize, name: &str, ms: u64) -> String {
    f.launch(
        at,
        name,
        &format!(
            "return (await parallel(Array.from({{ length: {CALLS} }}, (_, i) => () => agent('job ' + i + ' [[sleep:{ms}]]')))).filter(Boolean).length;"
        ),
        &["--stagger", "0", "--concurrency", "32", "--stall-timeout", "10m"],
    )
}

fn wait_until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Completed calls, as coordinator `at` reports them.
fn done(f: &HostFleet, at: usize, run: &str) -> u64 {
    f.status(at, run)["done"].as_u64().unwrap_or(0)
}

/// The worker entry named `name` in `workers --json` from coordinator `at`.
fn worker_entry(f: &HostFleet, at: usize, name: &str) -> Option<Value> {
    let out = f.client_at(at, &["workers", "--json"]);
    if out.code != 0 {
        return None;
    }
    out.json()
        .as_array()?
        .iter()
        .find(|w| w["name"] == name)
        .cloned()
}

/// The extra attempts a run took: attempts beyond one per call.
fn extra_attempts(report: &Value) -> u64 {
    report["usage"]["attempts"]
        .as_u64()
        .unwrap_or(0)
        .saturating_sub(CALLS as u64)
}

/// When a line containing `needle` was first logged by `label` (the log line's RFC 3339 time).
fn logged_at(f: &HostFleet, label: &str, needle: &str) -> Option<String> {
    f.log_text(label)
        .lines()
        .find(|l| l.contains(needle))
        .and_then(|l| l.split_whitespace().next())
        .map(strip_ansi)
}

/// `text` without terminal colour codes (`ESC [ ... m`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Milliseconds into the day of an RFC 3339 time (`2026-12-01T22:10:01.123456Z`).
fn seconds_of_day(t: &str) -> i64 {
    let time = t
        .split('T')
        .nth(1)
        .unwrap_or_default()
        .trim_end_matches('Z');
    let mut parts = time.split(':');
    let h: f64 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0.0);
    let m: f64 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0.0);
    let s: f64 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0.0);
    ((h * 3600.0 + m * 60.0 + s) * 1000.0) as i64
}

#[test]
fn the_bed_cuts_heals_and_loses_packets_between_its_hosts_only() {
    use flotilla_tests::netbed::NetBed;
    use std::net::{SocketAddr, TcpListener, TcpStream};
    let bed = NetBed::new(&["a", "b", "c"]);
    let addr: SocketAddr = format!("{}:9000", bed.ip("a")).parse().unwrap();
    // A listener opened inside host a belongs to a's network, whichever thread accepts.
    let listener = bed.within("a", move || TcpListener::bind(addr).unwrap());
    std::thread::spawn(move || for _ in listener.incoming() {});
    let connect = |from: &str| {
        bed.within(from, move || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(700)).map(|_| ())
        })
    };
    connect("b").unwrap();
    connect("c").unwrap();
    // A cut drops packets: the connection times out, it is not refused; other hosts still
    // reach a.
    bed.cut("a", "b");
    let e = connect("b").unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    connect("c").unwrap();
    bed.heal("a", "b");
    bed.heal("a", "b");
    connect("b").unwrap();
    bed.isolate("a");
    assert!(connect("c").is_err());
    bed.heal_all();
    connect("c").unwrap();
    // All packets lost, then none.
    bed.loss("a", 100);
    assert!(connect("b").is_err());
    bed.loss("a", 0);
    connect("b").unwrap();
    // Latency: 40 ms each way on the link a–b. A connection takes a round trip at least, and
    // a megabyte echoed through it arrives whole and in order.
    let echo: SocketAddr = format!("{}:9001", bed.ip("a")).parse().unwrap();
    let listener = bed.within("a", move || TcpListener::bind(echo).unwrap());
    std::thread::spawn(move || {
        for mut c in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut back = c.try_clone().unwrap();
                let _ = std::io::copy(&mut c, &mut back);
            });
        }
    });
    let echoed = |from: &str| {
        bed.within(from, move || {
            use std::io::{Read, Write};
            let sent: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
            let start = std::time::Instant::now();
            let mut c = TcpStream::connect_timeout(&echo, Duration::from_secs(5)).unwrap();
            let connected = start.elapsed();
            let mut r = c.try_clone().unwrap();
            let reader = std::thread::spawn(move || {
                let mut got = vec![0u8; 1_000_000];
                r.read_exact(&mut got).map(|()| got)
            });
            c.write_all(&sent).unwrap();
            let got = reader.join().unwrap().unwrap();
            assert!(got == sent, "the echo came back changed");
            connected
        })
    };
    bed.delay("a", "b", Duration::from_millis(40));
    let connected = echoed("b");
    assert!(
        connected >= Duration::from_millis(80),
        "a connection over a link of 40 ms each way took {connected:?}"
    );
    // Other links keep no delay of a–b's, and healing ends it.
    echoed("c");
    bed.heal_all();
    echoed("b");
    // The network's own latency stays through a fault and its heal.
    bed.latency("a", "c", Duration::from_millis(30));
    bed.delay("a", "c", Duration::from_millis(100));
    bed.heal_all();
    let connected = echoed("c");
    assert!(
        connected >= Duration::from_millis(60),
        "a link of 30 ms each way lost its latency in a heal: {connected:?}"
    );
}

#[test]
fn a_worker_cut_off_past_its_ttl_is_fenced_and_nothing_is_lost() {
    let f = HostFleet::start(Plan::default());
    let run = fan_out(&f, 0, "cut-worker", 1500);
    wait_until("worker-0 runs attempts", Duration::from_secs(60), || {
        worker_entry(&f, 0, "worker-0").is_some_and(|w| w["busy"].as_u64() > Some(0))
    });
    for c in 0..f.plan.coordinators {
        f.bed.cut(&worker_host(0), &coordinator_host(c));
    }
    // Past its TTL its lease lapses: the coordinator forgets it and runs its calls elsewhere.
    f.wait_for_log("coord-0", "worker lease lapsed", Duration::from_secs(60));
    wait_until("worker-0 to be gone", Duration::from_secs(30), || {
        worker_entry(&f, 0, "worker-0").is_none()
    });
    f.bed.heal_all();
    // It comes back and reports what it held: every such outcome is refused.
    f.wait_for_workers(f.plan.workers, Duration::from_secs(60));
    let report = f.assert_completed_once_each(0, &run, CALLS);
    assert_eq!(report["result"], CALLS);
    let extra = extra_attempts(&report);
    assert!(
        extra <= 2 * u64::from(f.plan.slots),
        "{extra} extra attempts for one worker's {} slots",
        f.plan.slots
    );
}

#[test]
fn the_leader_cut_off_from_etcd_stops_leading_before_its_successor_leads() {
    let f = HostFleet::start(Plan::default());
    let run = fan_out(&f, 0, "cut-leader", 1500);
    wait_until("some calls done", Duration::from_secs(60), || {
        done(&f, 0, &run) >= 20
    });
    // Cut from etcd only: its workers and the store still reach it.
    f.bed.cut(&coordinator_host(0), &etcd_host(0));
    f.wait_for_log("coord-1", "this coordinator leads", Duration::from_secs(60));
    let suspended = logged_at(&f, "coord-0", "it stops leading and writing until it can")
        .expect("the cut-off leader never stopped leading");
    let successor = logged_at(&f, "coord-1", "this coordinator leads").expect("logged");
    // RFC 3339 times of one clock compare as strings.
    assert!(
        suspended < successor,
        "the old leader stopped leading at {suspended}, after its successor led at {successor}"
    );
    // Suspended, it hands its workers back: they attach to the successor, which adopts the
    // run and carries it on while the old leader is still cut off.
    f.wait_for_workers(f.plan.workers, Duration::from_secs(60));
    let at = done(&f, 1, &run);
    wait_until(
        "progress under the successor during the cut",
        Duration::from_secs(60),
        || done(&f, 1, &run) >= at + 20,
    );
    // Healed, the old leader learns its lease is gone and stops; the successor carries the
    // run to the end.
    f.bed.heal_all();
    f.wait_for_log("coord-0", "lease in etcd lapsed", Duration::from_secs(60));
    let report = f.assert_completed_once_each(1, &run, CALLS);
    assert_eq!(report["result"], CALLS);
    eprintln!(
        "the old leader stopped leading {} ms before its successor led ({suspended}, {successor})",
        seconds_of_day(&successor) - seconds_of_day(&suspended)
    );
}

#[test]
fn a_frozen_leader_wakes_as_a_zombie_and_writes_nothing() {
    let mut f = HostFleet::start(Plan::default());
    let run = fan_out(&f, 0, "zombie", 1500);
    wait_until("some calls done", Duration::from_secs(60), || {
        done(&f, 0, &run) >= 20
    });
    f.bed.signal("coord-0", "STOP");
    // Frozen past its TTL: the standby leads and adopts the run, and the workers move to it.
    f.wait_for_log(
        "coord-1",
        "adopted a run whose coordinator is gone",
        Duration::from_secs(60),
    );
    f.wait_for_workers(f.plan.workers, Duration::from_secs(60));
    wait_until(
        "progress under the successor",
        Duration::from_secs(60),
        || done(&f, 1, &run) >= 40,
    );
    f.bed.signal("coord-0", "CONT");
    // Awake, it finds its tenure over before anything else, then that its lease is gone.
    wait_until("the zombie to stop", Duration::from_secs(60), || {
        f.bed.exited("coord-0").is_some()
    });
    // Awake, it counts first: its tenure ran out while it was frozen, so it stops leading
    // and writing (the unit tests of `GatedLeases` and of the store's gate check that what it
    // then goes to write is held back), and stops once etcd says its lease is gone.
    let log = strip_ansi(&f.log_text("coord-0"));
    // The leader's own line (the store's gate says "could not renew" too, whenever a write
    // it holds back is retried, also after the deposition).
    let suspended = log
        .find("it stops leading and writing until it can")
        .expect("the zombie never stopped leading");
    let gone = log
        .find("lease in etcd lapsed")
        .expect("never learned it was deposed");
    assert!(suspended < gone, "{log}");
    let report = f.assert_completed_once_each(1, &run, CALLS);
    assert_eq!(report["result"], CALLS);
}

#[test]
fn the_store_cut_off_for_thirty_seconds_pauses_the_run_and_loses_nothing() {
    let f = HostFleet::start(Plan::default());
    let run = fan_out(&f, 0, "store-outage", 1000);
    wait_until("some calls done", Duration::from_secs(60), || {
        done(&f, 0, &run) >= 20
    });
    // Packets to and from the S3 server vanish: requests hang until their timeouts, and
    // writes are retried; the outage is the scenario's thirty seconds.
    f.bed.isolate("s3");
    std::thread::sleep(Duration::from_secs(30));
    let status = f.status(0, &run);
    assert_ne!(status["status"], "failed", "{status}");
    f.bed.heal_all();
    let report = f.assert_completed_once_each(0, &run, CALLS);
    assert_eq!(report["result"], CALLS);
}

#[test]
fn the_store_slowed_to_300_ms_round_trips_slows_the_run_and_loses_nothing() {
    let f = HostFleet::start(Plan::default());
    let run = fan_out(&f, 0, "store-slow", 1000);
    wait_until("some calls done", Duration::from_secs(60), || {
        done(&f, 0, &run) >= 20
    });
    // Every request to the S3 server now takes 300 ms more (150 ms each way, on every
    // packet): journal writes queue up behind it, yet the run goes on.
    for c in 0..f.plan.coordinators {
        f.bed
            .delay(&coordinator_host(c), "s3", Duration::from_millis(150));
    }
    let at = done(&f, 0, &run);
    wait_until(
        "progress with a slow store",
        Duration::from_secs(90),
        || done(&f, 0, &run) >= at + 40,
    );
    f.bed.heal_all();
    let report = f.assert_completed_once_each(0, &run, CALLS);
    assert_eq!(report["result"], CALLS);
    assert_eq!(
        extra_attempts(&report),
        0,
        "a slow store restarted attempts"
    );
}

#[test]
fn workers_over_slow_lossy_links_lose_nothing() {
    let f = HostFleet::start(Plan::default());
    // Links of 40 ms each way to every worker, and one worker loses 5% of what it receives.
    for w in 0..f.plan.workers {
        for c in 0..f.plan.coordinators {
            f.bed.delay(
                &worker_host(w),
                &coordinator_host(c),
                Duration::from_millis(40),
            );
        }
    }
    f.bed.loss(&worker_host(0), 5);
    let run = fan_out(&f, 0, "slow-links", 500);
    let report = f.assert_completed_once_each(0, &run, CALLS);
    assert_eq!(report["result"], CALLS);
    // Slow and lossy, not partitioned: TCP carries it, nothing needs to run again.
    assert!(
        extra_attempts(&report) <= u64::from(f.plan.slots),
        "{} extra attempts over slow links",
        extra_attempts(&report)
    );
}

#[test]
fn etcd_loses_one_member_unnoticed_and_two_without_failing_a_run() {
    let mut f = HostFleet::start(Plan {
        etcd_members: 3,
        ..Plan::default()
    });
    let run = fan_out(&f, 0, "etcd-members", 1000);
    wait_until("some calls done", Duration::from_secs(60), || {
        done(&f, 0, &run) >= 20
    });
    // One of three: quorum stays.
    f.bed.signal(&etcd_host(2), "KILL");
    let at = done(&f, 0, &run);
    wait_until(
        "progress without one member",
        Duration::from_secs(60),
        || done(&f, 0, &run) >= at + 20,
    );
    // Two of three: no quorum. Dispatch waits, no run fails; an outage of ten seconds.
    f.bed.signal(&etcd_host(1), "KILL");
    std::thread::sleep(Duration::from_secs(10));
    let status = f.status(0, &run);
    assert_ne!(status["status"], "failed", "{status}");
    f.start_etcd(1);
    f.start_etcd(2);
    f.wait_for_etcd();
    // On a loaded machine the outage can outlast the leader's lease: it steps down (and
    // exits, by design) and the other coordinator adopts the run. Either way the run ends
    // once, complete; it is asked of whichever coordinator leads.
    restart_stopped_coordinators(&mut f);
    let at = leader_now(&f);
    let report = f.assert_completed_once_each(at, &run, CALLS);
    assert_eq!(report["result"], CALLS);
}

/// A small deterministic generator (xorshift64*): a seed gives the same schedule again.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// A number in `lo..=hi`.
    fn within(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// Whichever coordinator leads now, waiting for one (a fault may leave the seat empty for a
/// TTL or so).
fn leader_now(f: &HostFleet) -> usize {
    let mut found = None;
    wait_until("a leader", Duration::from_secs(60), || {
        found = f.leader();
        found.is_some()
    });
    found.expect("a leader")
}

/// Restarts what a fault left stopped: a coordinator that stepped down for good (it exits,
/// by design) comes back as a standby.
fn restart_stopped_coordinators(f: &mut HostFleet) {
    for c in 0..f.plan.coordinators {
        if f.bed.exited(&coordinator_host(c)).is_some() {
            f.bed.forget(&coordinator_host(c));
            f.start_coordinator(c);
        }
    }
}

/// A random schedule of the faults above, one at a time, for `FLOTILLA_NEMESIS_SECS` seconds
/// (default 30) from seed `FLOTILLA_NEMESIS_SEED` (default 1; printed, so a failing schedule
/// can be run again). `tools/nemesis` runs long ones.
#[test]
fn a_random_schedule_of_faults_loses_nothing() {
    let seed: u64 = std::env::var("FLOTILLA_NEMESIS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let secs: u64 = std::env::var("FLOTILLA_NEMESIS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    eprintln!("nemesis schedule: seed {seed}, {secs} s (FLOTILLA_NEMESIS_SEED={seed} replays it)");
    let mut rng = Rng::new(seed);
    let mut f = HostFleet::start(Plan {
        etcd_members: 3,
        ..Plan::default()
    });
    // Enough work to outlast the schedule on 32 slots: a second per agent, up to the 4,096
    // items one parallel() takes, then longer agents.
    let calls = ((secs * 32) as usize).clamp(CALLS, 4096);
    let sleep_ms = (secs * 32_000 / calls as u64).max(1000);
    let run = f.launch(
        0,
        "nemesis",
        &format!(
            "return (await parallel(Array.from({{ length: {calls} }}, (_, i) => () => agent('job ' + i + ' [[sleep:{sleep_ms}]]')))).filter(Boolean).length;"
        ),
        &[
            "--stagger",
            "0",
            "--concurrency",
            "32",
            "--stall-timeout",
            "10m",
            "--max-agents",
            &calls.to_string(),
        ],
    );
    let started = Instant::now();
    let mut step = 0;
    while started.elapsed() < Duration::from_secs(secs) {
        step += 1;
        let hold = Duration::from_millis(rng.within(1_000, 6_000));
        let at = started.elapsed().as_secs_f32();
        match rng.within(0, 7) {
            0 => {
                let w = worker_host(rng.within(0, f.plan.workers as u64 - 1) as usize);
                eprintln!("{at:6.1}s #{step}: cut {w} from the coordinators for {hold:?}");
                for c in 0..f.plan.coordinators {
                    f.bed.cut(&w, &coordinator_host(c));
                }
                std::thread::sleep(hold);
            }
            1 => {
                let l = coordinator_host(leader_now(&f));
                eprintln!("{at:6.1}s #{step}: cut the leader {l} from etcd for {hold:?}");
                for e in 0..f.plan.etcd_members {
                    f.bed.cut(&l, &etcd_host(e));
                }
                std::thread::sleep(hold);
            }
            2 => {
                let l = coordinator_host(leader_now(&f));
                eprintln!("{at:6.1}s #{step}: freeze the leader {l} for {hold:?}");
                f.bed.signal(&l, "STOP");
                std::thread::sleep(hold);
                f.bed.signal(&l, "CONT");
            }
            3 => {
                let e = etcd_host(rng.within(0, f.plan.etcd_members as u64 - 1) as usize);
                eprintln!("{at:6.1}s #{step}: kill etcd member {e} for {hold:?}");
                f.bed.signal(&e, "KILL");
                std::thread::sleep(hold);
                let i = e.trim_start_matches("etcd-").parse().expect("member");
                f.start_etcd(i);
            }
            4 => {
                eprintln!("{at:6.1}s #{step}: cut the store off for {hold:?}");
                f.bed.isolate("s3");
                std::thread::sleep(hold);
            }
            5 => {
                let w = worker_host(rng.within(0, f.plan.workers as u64 - 1) as usize);
                eprintln!("{at:6.1}s #{step}: {w} loses 30% of its packets for {hold:?}");
                f.bed.loss(&w, 30);
                std::thread::sleep(hold);
            }
            6 => {
                let ms = rng.within(50, 400);
                eprintln!("{at:6.1}s #{step}: the store {ms} ms slower each way for {hold:?}");
                for c in 0..f.plan.coordinators {
                    f.bed
                        .delay(&coordinator_host(c), "s3", Duration::from_millis(ms));
                }
                std::thread::sleep(hold);
            }
            _ => {
                let w = worker_host(rng.within(0, f.plan.workers as u64 - 1) as usize);
                let ms = rng.within(20, 200);
                eprintln!("{at:6.1}s #{step}: {w}'s links {ms} ms each way for {hold:?}");
                for c in 0..f.plan.coordinators {
                    f.bed
                        .delay(&w, &coordinator_host(c), Duration::from_millis(ms));
                }
                std::thread::sleep(hold);
            }
        }
        f.bed.heal_all();
        // A calm moment between faults.
        std::thread::sleep(Duration::from_millis(rng.within(300, 2_000)));
        restart_stopped_coordinators(&mut f);
    }
    f.bed.heal_all();
    f.wait_for_etcd();
    // A leader whose lease lapsed in the last fault stops a moment after it learns so.
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        restart_stopped_coordinators(&mut f);
        if f.leader().is_some()
            && (0..f.plan.coordinators).all(|c| f.bed.exited(&coordinator_host(c)).is_none())
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    f.wait_for_workers(f.plan.workers, Duration::from_secs(120));
    let leader = leader_now(&f);
    let report = f.assert_completed_once_each(leader, &run, calls);
    assert_eq!(report["result"], calls);
    eprintln!(
        "seed {seed}: {step} faults in {secs} s; {} attempts for {calls} calls",
        report["usage"]["attempts"]
    );
}
