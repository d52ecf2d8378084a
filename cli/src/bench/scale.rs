//! `flotilla bench fleet`: the fleet at scale, through real processes, in one run.
//!
//! It starts an etcd, two coordinators sharing it and a file store, and W worker processes
//! (this same binary, over mTLS with a fresh development CA), then:
//!
//! 1. **In flight**: one run of N sleeping echo agents, all at once. It reports the leader's
//!    RSS per in-flight call, dispatch latency p50/p99 (from the leader's own histogram),
//!    and etcd transactions and puts per second while the calls go out.
//! 2. **Adoption**: with all N in flight it kills the leader with SIGKILL and times the
//!    other coordinator to serve the run again (its status answers with all N calls); the
//!    run must then complete with every result, each call's attempt count bounded.
//! 3. **A big run**: C no-op echo calls through the fleet; the leader's RSS per completed
//!    call; then the same run resumed with its last prompt changed: the time to the first
//!    new dispatch, against `cat` of the run's journal files (the floor of reading them).
//! 4. **Failover**: a run with a backlog; the leader killed with SIGKILL in the middle; the
//!    time to the first attempt the successor assigns, against the lease TTL.
//!
//! Each figure is measured in this one run, and each phase checks its run's result: a
//! benchmark that lost or doubled a result fails instead of printing a figure. The processes
//! log at the level `FLOTILLA_LOG` gives (warn by default): at `info` every call's trace span
//! is formatted for the log, which costs about 9 µs and some memory per call.

use flotilla_proto::Problem;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use flotilla_proto::tls::TlsFiles;
use flotilla_proto::v1::client_service_client::ClientServiceClient;
use flotilla_proto::v1::{self};
use serde::Serialize;
use tonic::transport::Channel;

use crate::bench::fleet::{Procs, free_port, spawn, start_etcd};

#[derive(Debug, Args)]
pub struct FleetArgs {
    /// Worker processes.
    #[arg(long, default_value_t = 20)]
    workers: u32,
    /// Agents in flight at once in the first phase (worker slots are this over --workers).
    #[arg(long, default_value_t = 10_000)]
    inflight: u64,
    /// How long each in-flight agent sleeps; long enough for all of them to be out, and for
    /// the adoption after the leader is killed.
    #[arg(long, default_value = "90s")]
    hold: String,
    /// Calls in the big run (resumed afterwards).
    #[arg(long, default_value_t = 100_000)]
    calls: u64,
    /// Lease TTL of the coordinators and workers.
    #[arg(long, default_value = "5s")]
    ttl: String,
    /// Launch every run from a generated repository of this many files (0: no source): its
    /// snapshot sent as a launch sends it, and first a fan-out of echo calls with it against
    /// the same without it.
    #[arg(long, default_value_t = 0)]
    source_files: usize,
    /// Keep the processes' logs and the store here instead of a temporary directory.
    #[arg(long)]
    keep: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// The figures.
#[derive(Debug, Default, Serialize)]
pub struct FleetReport {
    pub workers: u32,
    pub inflight: u64,
    pub calls: u64,
    pub ttl_ms: u64,
    /// Files of the repository every run is launched from (0: none).
    pub source_files: usize,
    /// A fan-out of echo calls (`min(calls, 10000)`) launched from that repository (its
    /// snapshot and upload included, as a launch does them), and without a source: medians.
    pub fanout_calls: u64,
    pub fanout_source_ms: f64,
    pub fanout_none_ms: f64,
    /// Without over with: 1 when the source costs nothing.
    pub fanout_source_ratio: f64,
    /// From the launch to all N calls running.
    pub all_out_ms: f64,
    pub rss_base_kib: u64,
    pub rss_inflight_kib: u64,
    /// (RSS with N in flight − RSS before) / N.
    pub rss_per_inflight_call_bytes: f64,
    pub dispatch_p50_ms: f64,
    pub dispatch_p99_ms: f64,
    /// etcd transactions and puts per second between the launch and all calls running.
    pub etcd_txn_per_s: f64,
    pub etcd_put_per_s: f64,
    /// From SIGKILL of the leader to the successor serving the run with all N calls.
    pub adopt_ms: f64,
    /// Attempts the successor started for the adopted run (0: it took over every attempt
    /// still running on the workers).
    pub adopted_restarts: u64,
    pub big_run_ms: f64,
    pub big_calls_per_s: f64,
    /// (the most RSS during the big run − RSS before) / C.
    pub rss_per_completed_call_bytes: f64,
    /// From the resume's launch to its first new dispatch.
    pub resume_first_dispatch_ms: f64,
    pub resume_ms: f64,
    pub journal_files: u64,
    pub journal_bytes: u64,
    /// `cat` of the same journal files.
    pub cat_journal_ms: f64,
    /// resume_first_dispatch_ms / cat_journal_ms.
    pub resume_over_cat: f64,
    /// From SIGKILL of the leader to the successor's first assigned attempt.
    pub failover_ms: f64,
    /// failover_ms / ttl_ms.
    pub failover_over_ttl: f64,
}

/// One coordinator process and its ports.
struct Coord {
    child: Option<Child>,
    grpc: u16,
    http: u16,
}

impl Coord {
    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Coord {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Bed {
    dir: PathBuf,
    pki: PathBuf,
    exe: PathBuf,
    etcd: String,
    store: String,
    ttl: String,
    coords: Vec<Coord>,
    token: Option<String>,
    /// The repository runs are launched from, and its source as last sent.
    repo: Option<PathBuf>,
    source: Option<flotilla_proto::settings::SourceRef>,
}

const SCRIPT: &str = "export const meta = { name: 'bench-fleet', description: 'N echo agents at once' };\n\
const calls = [];\n\
for (let i = 0; i < args.n; i++) calls.push(agent(i === args.n - 1 ? args.last : args.prompt + ' ' + i));\n\
return (await Promise.all(calls)).length;\n";

impl Bed {
    fn start_coordinator(&mut self, i: usize) -> Result<(), Problem> {
        let (grpc, http) = match self.coords.get(i) {
            Some(c) => (c.grpc, c.http),
            None => (free_port()?, free_port()?),
        };
        let log = self.dir.join(format!("coordinator-{i}.log"));
        let mut cmd = Command::new(&self.exe);
        cmd.args(["coordinator", "--listen", &format!("127.0.0.1:{grpc}")])
            .args(["--http", &format!("127.0.0.1:{http}")])
            .args(["--store", &self.store, "--etcd", &self.etcd])
            .args(["--worker-ttl", &self.ttl])
            .arg("--tls-dir")
            .arg(&self.pki);
        let child = spawn(&mut cmd, &log)?;
        let c = Coord {
            child: Some(child),
            grpc,
            http,
        };
        if i < self.coords.len() {
            self.coords[i] = c;
        } else {
            self.coords.push(c);
        }
        Ok(())
    }

    fn client(&self, i: usize) -> Result<ClientServiceClient<Channel>, Problem> {
        let files = TlsFiles::in_dir(&self.pki, "bench-client");
        let url = format!("https://127.0.0.1:{}", self.coords[i].grpc);
        let channel = flotilla_proto::tls::channel(&url, Some(&files))?;
        Ok(ClientServiceClient::new(channel)
            .max_decoding_message_size(flotilla_proto::frag::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(flotilla_proto::frag::MAX_MESSAGE_BYTES))
    }

    /// A coordinator's `/metrics`, or None while it does not answer.
    fn metrics(&self, i: usize) -> Option<String> {
        let token = self.token.as_deref()?;
        http_get(self.coords[i].http, "/metrics", Some(token))
    }

    /// The coordinator that has all `workers` attached: the leader.
    async fn wait_leader(&self, workers: u64) -> Result<usize, Problem> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            for i in 0..self.coords.len() {
                if self.coords[i].child.is_none() {
                    continue;
                }
                if let Some(m) = self.metrics(i)
                    && gauge(&m, "flotilla_workers{state=\"attached\"}") == Some(workers as f64)
                {
                    return Ok(i);
                }
            }
            if Instant::now() > deadline {
                return Err(Problem::internal(format!(
                    "no coordinator had all {workers} workers attached within 120 s; see the logs in {}",
                    self.dir.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Launches [`SCRIPT`]: `n` echo agents, `prompt` plus the index for each but the last,
/// `last` for the last one.
async fn launch(
    client: &mut ClientServiceClient<Channel>,
    n: u64,
    (prompt, last): (&str, &str),
    concurrency: u32,
    resume_from: Option<&str>,
    source: Option<&flotilla_proto::settings::SourceRef>,
) -> Result<String, Problem> {
    crate::bench::fleet::launch_echo_from(
        client,
        SCRIPT,
        serde_json::json!({ "n": n, "prompt": prompt, "last": last }),
        (n, concurrency),
        resume_from,
        source,
    )
    .await
}

/// What a launch from `repo` sends: its snapshot, and what the coordinator lacks of it.
async fn send_source(
    client: &mut ClientServiceClient<Channel>,
    repo: &std::path::Path,
) -> Result<flotilla_proto::settings::SourceRef, Problem> {
    let snap = crate::source::snapshot(repo)?
        .ok_or(Problem::internal("the generated repository is not one"))?;
    crate::source::upload(client, &snap, u64::MAX, "").await?;
    Ok(flotilla_proto::settings::SourceRef {
        repo: snap.repo,
        commit: snap.commit,
        url: None,
        origin: snap.origin,
        submodules: snap.submodules,
    })
}

/// After phase 3 (with `--source-files`): a fan-out of echo calls launched from the repository
/// (snapshot and upload included) against the same launched with no source, in turns.
async fn source_fanout(
    bed: &mut Bed,
    client: &mut Client,
    a: &FleetArgs,
    concurrency: u32,
    report: &mut FleetReport,
) -> Result<(), Problem> {
    let Some(repo) = bed.repo.clone() else {
        return Ok(());
    };
    let n = a.calls.min(10_000);
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = Instant::now();
        let source = send_source(client, &repo).await?;
        let run = launch(
            client,
            n,
            ("fan", "fan last"),
            concurrency,
            None,
            Some(&source),
        )
        .await?;
        finished(client, &run, n).await?;
        with.push(ms(t.elapsed()));
        bed.source = Some(source);
        let t = Instant::now();
        let run = launch(client, n, ("fan", "fan last"), concurrency, None, None).await?;
        finished(client, &run, n).await?;
        without.push(ms(t.elapsed()));
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    report.fanout_calls = n;
    report.fanout_source_ms = median(with);
    report.fanout_none_ms = median(without);
    report.fanout_source_ratio = report.fanout_none_ms / report.fanout_source_ms;
    Ok(())
}

/// A plain HTTP GET on loopback; the body of a 200, or None.
fn http_get(port: u16, path: &str, token: Option<&str>) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
}

/// The value of one exposition line `name` (labels included), if present.
fn gauge(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let (n, v) = l.rsplit_once(' ')?;
        (n == name).then(|| v.parse().ok())?
    })
}

/// A histogram's cumulative buckets `(upper bound, count)`, +Inf last.
fn buckets(metrics: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.parse().ok()?))
        })
        .collect()
}

/// Quantile `q` of the observations between two scrapes of one histogram, interpolated
/// linearly inside its bucket (in the histogram's unit).
fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> f64 {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|&(le, n)| {
            let was = before.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
            (le, n - was)
        })
        .collect();
    let Some(&(_, total)) = delta.last() else {
        return f64::NAN;
    };
    if total <= 0.0 {
        return f64::NAN;
    }
    let want = q * total;
    let (mut lo, mut below) = (0.0, 0.0);
    for &(le, cum) in &delta {
        if cum >= want {
            if le.is_infinite() {
                return lo;
            }
            let inside = cum - below;
            return if inside > 0.0 {
                lo + (le - lo) * (want - below) / inside
            } else {
                le
            };
        }
        (lo, below) = (le, cum);
    }
    lo
}

/// A counter of etcd's own `/metrics`.
fn etcd_counter(port: u16, name: &str) -> f64 {
    http_get(port, "/metrics", None)
        .and_then(|m| gauge(&m, name))
        .unwrap_or(0.0)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

async fn snapshot(
    client: &mut ClientServiceClient<Channel>,
    run: &str,
) -> Option<flotilla_proto::wire::SnapshotView> {
    let r = client
        .status(v1::RunRef { run_id: run.into() })
        .await
        .ok()?
        .into_inner();
    serde_json::from_str(&r.snapshot_json).ok()
}

/// Polls the run's status until `ready` holds of it.
async fn until_status(
    what: &str,
    limit: Duration,
    client: &ClientServiceClient<Channel>,
    run: &str,
    ready: impl Fn(&flotilla_proto::wire::SnapshotView) -> bool,
) -> Result<(), Problem> {
    let ready = &ready;
    poll(what, limit, || {
        let mut c = client.clone();
        async move { snapshot(&mut c, run).await.filter(|s| ready(s)).map(|_| ()) }
    })
    .await
}

/// Waits for the run's report and checks that every call's result is in it.
async fn finished(
    client: &mut ClientServiceClient<Channel>,
    run: &str,
    n: u64,
) -> Result<flotilla_proto::wire::Report, Problem> {
    let report = client
        .wait(v1::RunRef { run_id: run.into() })
        .await
        .map_err(|e| crate::client::call_problem(&e))?
        .into_inner();
    let r: flotilla_proto::wire::Report =
        serde_json::from_str(&report.report_json).map_err(|e| Problem::internal(e.to_string()))?;
    if r.status != flotilla_proto::wire::RunStatus::Completed || r.result != serde_json::json!(n) {
        return Err(Problem::internal(format!(
            "bench run {run} ended {} with result {} ({:?})",
            r.status.as_str(),
            r.result,
            r.error
        )));
    }
    Ok(r)
}

/// Polls `until` every few milliseconds for at most `limit`.
async fn poll<T, F, Fut>(what: &str, limit: Duration, mut until: F) -> Result<T, Problem>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = until().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            return Err(Problem::internal(format!(
                "{what} did not happen within {} s",
                limit.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The segments of a run's call journal in a file store (what a resume reads).
fn journal_files(store_dir: &Path, run: &str) -> Vec<PathBuf> {
    let dir = store_dir.join("runs").join(run).join("calls");
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    out.sort();
    out
}

/// `workers` worker processes of `slots` slots each, attached to the coordinators at `urls`.
fn start_workers(
    bed: &Bed,
    urls: &str,
    (workers, slots): (u32, u64),
    procs: &mut Procs,
) -> Result<(), Problem> {
    for i in 0..workers {
        let mut w = Command::new(&bed.exe);
        w.args(["worker", "--coordinator", urls])
            .args(["--name", &format!("bench-worker-{i}")])
            .args(["--slots", &slots.to_string(), "--tls-dir"])
            .arg(&bed.pki)
            .arg("--workspace")
            .arg(bed.dir.join(format!("ws-{i}")));
        procs
            .0
            .push(spawn(&mut w, &bed.dir.join(format!("worker-{i}.log")))?);
    }
    Ok(())
}

pub async fn fleet(a: &FleetArgs) -> Result<FleetReport, Problem> {
    if a.workers == 0 || a.inflight == 0 || a.calls < 2 {
        return Err(Problem::internal(
            "--workers and --inflight must be at least 1, --calls at least 2",
        ));
    }
    let hold = crate::config::parse_duration("--hold", &a.hold)?;
    let ttl = crate::config::parse_duration("--ttl", &a.ttl)?;
    let tmp = tempfile::tempdir().map_err(|e| Problem::internal(e.to_string()))?;
    let dir = match &a.keep {
        Some(k) => {
            std::fs::create_dir_all(k)
                .map_err(|e| Problem::internal(format!("{}: {e}", k.display())))?;
            k.clone()
        }
        None => tmp.path().to_path_buf(),
    };
    let pki = dir.join("pki");
    crate::bench::fleet::bench_pki(&pki, a.workers)?;
    let mut procs = Procs(Vec::new());
    let (etcd, etcd_port) = start_etcd(&dir, &mut procs)?;
    let store_dir = dir.join("store");
    std::fs::create_dir_all(&store_dir).map_err(|e| Problem::internal(e.to_string()))?;
    let mut bed = Bed {
        store: format!("file://{}", store_dir.display()),
        dir: dir.clone(),
        pki: pki.clone(),
        exe: std::env::current_exe().map_err(|e| Problem::internal(e.to_string()))?,
        etcd,
        ttl: a.ttl.clone(),
        coords: Vec::new(),
        token: None,
        repo: None,
        source: None,
    };
    if a.source_files > 0 {
        let repo = dir.join("repo");
        std::fs::create_dir_all(&repo).map_err(|e| Problem::internal(e.to_string()))?;
        crate::bench::source::generate(&repo, a.source_files, 20, 2)?;
        bed.repo = Some(repo);
    }
    bed.start_coordinator(0)?;
    bed.start_coordinator(1)?;
    let urls = bed
        .coords
        .iter()
        .map(|c| format!("https://127.0.0.1:{}", c.grpc))
        .collect::<Vec<_>>()
        .join(",");
    let slots = a.inflight.div_ceil(u64::from(a.workers));
    start_workers(&bed, &urls, (a.workers, slots), &mut procs)?;
    // A token for /metrics, from whichever coordinator answers first.
    bed.token = Some(
        poll("a sign-in token", Duration::from_secs(60), || {
            let clients = [bed.client(0), bed.client(1)];
            async move {
                for c in clients {
                    if let Ok(mut c) = c
                        && let Ok(r) = c.create_token(v1::CreateTokenRequest { ttl_secs: 0 }).await
                    {
                        return Some(r.into_inner().token);
                    }
                }
                None
            }
        })
        .await?,
    );
    let workers = u64::from(a.workers);
    let leader = bed.wait_leader(workers).await?;
    let mut client = bed.client(leader)?;
    let mut report = FleetReport {
        workers: a.workers,
        inflight: a.inflight,
        calls: a.calls,
        ttl_ms: ttl.as_millis() as u64,
        ..FleetReport::default()
    };
    let concurrency = u32::try_from(a.inflight).unwrap_or(u32::MAX);

    // Warm up: connections, the script engine, the workers' slots.
    let warm = a.inflight.min(1000);
    let run = launch(
        &mut client,
        warm,
        ("warm", "warm last"),
        concurrency,
        None,
        None,
    )
    .await?;
    finished(&mut client, &run, warm).await?;
    // Every run from here on is launched from the repository, if there is one: its first
    // upload happens before any figure is taken.
    report.source_files = a.source_files;
    if let Some(repo) = bed.repo.clone() {
        bed.source = Some(send_source(&mut client, &repo).await?);
    }

    // 1. All in flight at once.
    let run = all_in_flight(&bed, leader, &mut client, a, hold, etcd_port, &mut report).await?;

    // 2. The leader killed with everything in flight; the other one adopts the run.
    let leader = adopted(&mut bed, leader, &run, a, ttl, &mut report).await?;
    let mut client = bed.client(leader)?;

    // 3. A big run, then the same run resumed with its last prompt changed.
    let concurrency = u32::try_from(slots * workers).unwrap_or(u32::MAX);
    big_and_resume(
        &bed,
        leader,
        &mut client,
        a,
        concurrency,
        &store_dir,
        &mut report,
    )
    .await?;

    // With a source: a fan-out from the repository against one with none, in turns.
    source_fanout(&mut bed, &mut client, a, concurrency, &mut report).await?;

    // 4. Failover with a backlog.
    failover(&mut bed, leader, &mut client, concurrency, ttl, &mut report).await?;
    drop(bed);
    drop(procs);
    Ok(report)
}

/// Phase 4: failover with a backlog — the `leader` killed, the time to the first attempt
/// the successor assigns. A tenth of the slots at a time, a second each: a steady stream of
/// dispatches, not a saturated leader.
async fn failover(
    bed: &mut Bed,
    leader: usize,
    client: &mut Client,
    concurrency: u32,
    ttl: Duration,
    report: &mut FleetReport,
) -> Result<(), Problem> {
    let concurrency = (concurrency / 10).max(1);
    let n = u64::from(concurrency) * 4;
    let run = launch(
        client,
        n,
        ("[[sleep:1000]] backlog", "[[sleep:1000]] backlog last"),
        concurrency,
        None,
        bed.source.as_ref(),
    )
    .await?;
    let limit = Duration::from_secs(300);
    until_status("a quarter of the backlog done", limit, client, &run, |s| {
        s.summary.done >= n / 4
    })
    .await?;
    let successor = 1 - leader;
    let before = assigned(&bed.metrics(successor).unwrap_or_default());
    let killed = Instant::now();
    bed.coords[leader].kill();
    poll(
        "the successor's first dispatch",
        Duration::from_secs(60) + ttl * 4,
        || {
            let m = bed.metrics(successor);
            async move { m.filter(|m| assigned(m) > before).map(|_| ()) }
        },
    )
    .await?;
    report.failover_ms = ms(killed.elapsed());
    report.failover_over_ttl = report.failover_ms / ms(ttl);
    let mut next = bed.client(successor)?;
    finished(&mut next, &run, n).await?;
    Ok(())
}

type Client = ClientServiceClient<Channel>;

/// Attempts the coordinator whose `/metrics` text is `m` has assigned.
fn assigned(m: &str) -> f64 {
    gauge(m, "flotilla_attempts_assigned_total").unwrap_or(0.0)
}

/// Phase 1: `a.inflight` sleeping calls out at once on the `leader`: the leader's memory per
/// call in flight, dispatch latency, etcd's writes per second. The run, still going.
async fn all_in_flight(
    bed: &Bed,
    leader: usize,
    client: &mut Client,
    a: &FleetArgs,
    hold: Duration,
    etcd_port: u16,
    report: &mut FleetReport,
) -> Result<String, Problem> {
    let pid = bed.coords[leader]
        .pid()
        .ok_or(Problem::internal("the leader is not running"))?;
    report.rss_base_kib = rss_kib(pid);
    let m0 = bed.metrics(leader).unwrap_or_default();
    let (txn0, put0) = (
        etcd_counter(etcd_port, "etcd_mvcc_txn_total"),
        etcd_counter(etcd_port, "etcd_mvcc_put_total"),
    );
    let sleep = format!("[[sleep:{}]] hold", hold.as_millis());
    let started = Instant::now();
    let concurrency = u32::try_from(a.inflight).unwrap_or(u32::MAX);
    let run = launch(
        client,
        a.inflight,
        (&sleep, &sleep),
        concurrency,
        None,
        bed.source.as_ref(),
    )
    .await?;
    let limit = hold
        .saturating_sub(Duration::from_secs(1))
        .max(Duration::from_secs(1));
    until_status("all calls running", limit, client, &run, |s| {
        s.summary.running >= a.inflight
    })
    .await
    .map_err(|e| Problem::internal(format!("{e}: raise --hold or lower --inflight")))?;
    let out = started.elapsed();
    report.all_out_ms = ms(out);
    let (txn1, put1) = (
        etcd_counter(etcd_port, "etcd_mvcc_txn_total"),
        etcd_counter(etcd_port, "etcd_mvcc_put_total"),
    );
    report.rss_inflight_kib = rss_kib(pid);
    report.rss_per_inflight_call_bytes =
        (report.rss_inflight_kib as f64 - report.rss_base_kib as f64) * 1024.0 / a.inflight as f64;
    let m1 = bed.metrics(leader).unwrap_or_default();
    let (b0, b1) = (
        buckets(&m0, "flotilla_queue_wait_seconds"),
        buckets(&m1, "flotilla_queue_wait_seconds"),
    );
    report.dispatch_p50_ms = quantile(&b0, &b1, 0.5) * 1e3;
    report.dispatch_p99_ms = quantile(&b0, &b1, 0.99) * 1e3;
    report.etcd_txn_per_s = (txn1 - txn0) / out.as_secs_f64();
    report.etcd_put_per_s = (put1 - put0) / out.as_secs_f64();
    Ok(run)
}

/// Phase 2: the `leader` killed with `run` in flight; the other coordinator adopts it
/// (adoption time, attempts restarted). The leader comes back; the one that leads now.
async fn adopted(
    bed: &mut Bed,
    leader: usize,
    run: &str,
    a: &FleetArgs,
    ttl: Duration,
    report: &mut FleetReport,
) -> Result<usize, Problem> {
    let successor = 1 - leader;
    let standby_assigned = assigned(&bed.metrics(successor).unwrap_or_default());
    let killed = Instant::now();
    bed.coords[leader].kill();
    let mut next = bed.client(successor)?;
    let limit = Duration::from_secs(60) + ttl * 4;
    until_status("the adoption", limit, &next, run, |s| {
        s.summary.agents >= a.inflight
    })
    .await?;
    report.adopt_ms = ms(killed.elapsed());
    finished(&mut next, run, a.inflight).await?;
    let restarts = assigned(&bed.metrics(successor).unwrap_or_default()) - standby_assigned;
    report.adopted_restarts = restarts.max(0.0) as u64;
    bed.start_coordinator(leader)?;
    bed.wait_leader(u64::from(a.workers)).await
}

/// Phase 3: a big run of `a.calls`, then the same run resumed with its last prompt changed
/// (time to its first dispatch, against `cat` of its journal files).
async fn big_and_resume(
    bed: &Bed,
    leader: usize,
    client: &mut Client,
    a: &FleetArgs,
    concurrency: u32,
    store_dir: &std::path::Path,
    report: &mut FleetReport,
) -> Result<(), Problem> {
    let pid = bed.coords[leader]
        .pid()
        .ok_or(Problem::internal("the leader is not running"))?;
    let before = rss_kib(pid);
    // The most it holds during the run: every completed call is in the run until it ends.
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = std::thread::spawn({
        let sampling = sampling.clone();
        move || {
            let mut peak = 0;
            while sampling.load(Ordering::Relaxed) {
                peak = peak.max(rss_kib(pid));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak.max(rss_kib(pid))
        }
    });
    let started = Instant::now();
    let big = launch(
        client,
        a.calls,
        ("big", "big last"),
        concurrency,
        None,
        bed.source.as_ref(),
    )
    .await?;
    let first = finished(client, &big, a.calls).await;
    sampling.store(false, Ordering::Relaxed);
    let peak = sampler.join().unwrap_or(0);
    drop(first?);
    let took = started.elapsed();
    report.big_run_ms = ms(took);
    report.big_calls_per_s = a.calls as f64 / took.as_secs_f64();
    report.rss_per_completed_call_bytes = (peak as f64 - before as f64) * 1024.0 / a.calls as f64;
    let before = assigned(&bed.metrics(leader).unwrap_or_default());
    let started = Instant::now();
    let resumed = launch(
        client,
        a.calls,
        ("big", "big last, edited"),
        concurrency,
        Some(&big),
        bed.source.as_ref(),
    )
    .await?;
    poll(
        "the resume's first dispatch",
        Duration::from_secs(600),
        || {
            let m = bed.metrics(leader);
            async move { m.filter(|m| assigned(m) > before).map(|_| ()) }
        },
    )
    .await?;
    report.resume_first_dispatch_ms = ms(started.elapsed());
    let r = finished(client, &resumed, a.calls).await?;
    report.resume_ms = ms(started.elapsed());
    if r.usage.dispatched != 1 {
        return Err(Problem::internal(format!(
            "the resume dispatched {} calls; only the edited one should have run",
            r.usage.dispatched
        )));
    }
    let files = journal_files(store_dir, &big);
    if files.is_empty() {
        return Err(Problem::internal(format!(
            "no journal files of run {big} in {}",
            store_dir.display()
        )));
    }
    report.journal_files = files.len() as u64;
    report.journal_bytes = files
        .iter()
        .filter_map(|f| f.metadata().ok())
        .map(|m| m.len())
        .sum();
    let started = Instant::now();
    let cat = Command::new("cat")
        .args(&files)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| Problem::internal(format!("cannot run cat: {e}")))?;
    if !cat.success() {
        return Err(Problem::internal("cat of the journal files failed"));
    }
    report.cat_journal_ms = ms(started.elapsed());
    report.resume_over_cat = report.resume_first_dispatch_ms / report.cat_journal_ms;
    Ok(())
}

pub async fn run(a: FleetArgs) -> i32 {
    match fleet(&a).await {
        Ok(r) => {
            if a.json {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
            } else {
                println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
            }
            0
        }
        Err(e) => crate::refuse(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_come_from_the_difference_of_two_scrapes() {
        let before = [
            (0.001, 10.0),
            (0.01, 10.0),
            (0.1, 10.0),
            (f64::INFINITY, 10.0),
        ];
        // 100 new observations: 50 under 1 ms, 40 in (1, 10] ms, 10 in (10, 100] ms.
        let after = [
            (0.001, 60.0),
            (0.01, 100.0),
            (0.1, 110.0),
            (f64::INFINITY, 110.0),
        ];
        assert!((quantile(&before, &after, 0.5) - 0.001).abs() < 1e-9);
        let p99 = quantile(&before, &after, 0.99);
        assert!(p99 > 0.01 && p99 < 0.1, "{p99}");
        assert!(quantile(&before, &before, 0.5).is_nan());
    }

    #[test]
    fn exposition_lines_are_read_by_their_full_name() {
        let m = "# TYPE x gauge\nflotilla_workers{state=\"attached\"} 20\nflotilla_workers{state=\"cut_off\"} 1\nh_bucket{le=\"0.5\"} 3\nh_bucket{le=\"+Inf\"} 4\n";
        assert_eq!(gauge(m, "flotilla_workers{state=\"attached\"}"), Some(20.0));
        assert_eq!(gauge(m, "flotilla_workers"), None);
        assert_eq!(buckets(m, "h"), vec![(0.5, 3.0), (f64::INFINITY, 4.0)]);
    }
}
