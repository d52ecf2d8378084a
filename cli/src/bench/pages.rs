//! `flotilla bench pages`: what the session pages cost.
//!
//! In one process: an embedded coordinator with, for each size, a finished run of N echo
//! agents in two phases (its page read from storage) and a live run of N agents that sleep
//! (its page rendered from the running engine), the pages served on loopback. It reports,
//! medians of `--rounds` requests over raw HTTP/1.1:
//! - time to the first byte and to the complete run page, with the timeline and without it
//!   (`?timeline=0`), and their ratio;
//! - the coordinator's CPU per SSE viewer per second: `--viewers` readers of the live run's
//!   event stream (the largest size up to 1,000 agents), the process's CPU over a window less
//!   the readers' own threads' and less the same window with no reader, with the timeline
//!   and without. CPU is read from `/proc` (clock ticks, so windows are seconds long).

use flotilla_proto::Problem;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use flotilla_coordinator::host::{self, RunRegistry};
use flotilla_coordinator::{LaunchRequest, RunSettings};
use flotilla_local::workflows::NoWorkflows;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::embedded::Embedded;

#[derive(Debug, Args)]
pub struct PagesArgs {
    /// Agents per run, one size after another.
    #[arg(long, value_delimiter = ',', default_values_t = [100u64, 1000, 10_000])]
    agents: Vec<u64>,
    /// Requests timed per figure.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Readers of the live run's event stream.
    #[arg(long, default_value_t = 100)]
    viewers: usize,
    /// Seconds of each CPU window.
    #[arg(long, default_value_t = 4)]
    window: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize, Default)]
pub struct PageFigures {
    agents: u64,
    /// The finished run, read from storage.
    stored_first_byte_ms: f64,
    stored_complete_ms: f64,
    stored_no_timeline_ms: f64,
    /// The running one, rendered from its engine.
    live_first_byte_ms: f64,
    live_complete_ms: f64,
    live_no_timeline_ms: f64,
    /// The complete page against the same page without the timeline.
    stored_ratio: f64,
    live_ratio: f64,
    /// Agents of the live run on slots while it was timed (the rest queued).
    live_running: u64,
    page_bytes: usize,
}

#[derive(Debug, Serialize, Default)]
pub struct ViewerFigures {
    agents: u64,
    viewers: usize,
    /// The coordinator's CPU for all the readers, in % of one core.
    cpu_percent: f64,
    cpu_percent_no_timeline: f64,
    /// Per reader per second, in % of one core.
    per_viewer_percent: f64,
    per_viewer_percent_no_timeline: f64,
    /// Updates the readers got, all of them.
    updates: u64,
}

#[derive(Debug, Serialize, Default)]
pub struct PagesReport {
    pages: Vec<PageFigures>,
    viewers: Option<ViewerFigures>,
}

/// N echo agents in two phases, all started at once; with `sleep`, each sleeps that long.
const SCRIPT: &str = "export const meta = { name: 'bench-pages', description: 'a run to look at' };\n\
const half = Math.floor(args.n / 2);\n\
const say = (p, i) => p + ' ' + i + (args.sleep ? ' [[sleep:' + args.sleep + ']]' : '');\n\
phase('First');\n\
const a = Promise.all(Array.from({ length: half }, (_, i) => agent(say('first', i), { label: 'first ' + i })));\n\
phase('Second');\n\
const b = Promise.all(Array.from({ length: args.n - half }, (_, i) => agent(say('second', i), { label: 'second ' + i })));\n\
return (await a).length + (await b).length;\n";

fn launch(n: u64, sleep_ms: u64) -> LaunchRequest {
    LaunchRequest {
        source: SCRIPT.into(),
        origin: Some("bench".into()),
        args: serde_json::value::to_raw_value(&serde_json::json!({ "n": n, "sleep": sleep_ms }))
            .ok(),
        settings: RunSettings {
            backend: "echo".into(),
            concurrency: u32::try_from(n).unwrap_or(u32::MAX),
            max_agents: n.max(1),
            stagger_ms: 0,
            ..RunSettings::default()
        },
        resume_from: None,
        inherit: false,
        resolver: Arc::new(NoWorkflows),
    }
}

fn fail(e: impl std::fmt::Display) -> Problem {
    Problem::internal(e.to_string())
}

/// One GET over a fresh connection: (ms to the first byte, ms to the end, bytes).
async fn get(port: u16, path: &str) -> Result<(f64, f64, usize), Problem> {
    let t0 = Instant::now();
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(fail)?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.map_err(fail)?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut first = None;
    let mut total = 0usize;
    let mut head = Vec::new();
    loop {
        let n = s.read(&mut buf).await.map_err(fail)?;
        if n == 0 {
            break;
        }
        first.get_or_insert_with(|| t0.elapsed());
        if head.len() < 16 {
            head.extend_from_slice(&buf[..n.min(16)]);
        }
        total += n;
    }
    if !head.starts_with(b"HTTP/1.1 200") {
        return Err(Problem::internal(format!(
            "GET {path}: {}",
            String::from_utf8_lossy(&head)
        )));
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    Ok((ms(first.unwrap_or_default()), ms(t0.elapsed()), total))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Medians of `rounds` GETs of `path`: first byte, complete, bytes.
async fn timed(port: u16, path: &str, rounds: usize) -> Result<(f64, f64, usize), Problem> {
    let (mut first, mut done, mut bytes) = (Vec::new(), Vec::new(), 0);
    // One unmeasured request warms the store's cache and the allocator.
    get(port, path).await?;
    for _ in 0..rounds.max(1) {
        let (f, d, b) = get(port, path).await?;
        first.push(f);
        done.push(d);
        bytes = b;
    }
    Ok((median(first), median(done), bytes))
}

/// CPU seconds (user + system) of this process, or of its threads whose name starts with
/// `prefix`, from `/proc`.
fn cpu_seconds(prefix: Option<&str>) -> f64 {
    let ticks = |stat: &str| -> u64 {
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            return 0;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        // After the name: state is field 3, utime 14 and stime 15 (1-based, whole line).
        f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
            + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
    };
    let hz = 100.0;
    match prefix {
        None => ticks(&std::fs::read_to_string("/proc/self/stat").unwrap_or_default()) as f64 / hz,
        Some(p) => {
            let mut sum = 0;
            for t in std::fs::read_dir("/proc/self/task")
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
                if name.trim_end().starts_with(p) {
                    sum +=
                        ticks(&std::fs::read_to_string(t.path().join("stat")).unwrap_or_default());
                }
            }
            sum as f64 / hz
        }
    }
}

/// The coordinator's CPU (% of one core) over `window` while `viewers` readers follow
/// `path`'s event stream from their own threads; and the updates they got.
fn followed(
    port: u16,
    path: &str,
    viewers: usize,
    window: Duration,
) -> Result<(f64, u64), Problem> {
    let readers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("bench-viewer")
        .enable_all()
        .build()
        .map_err(fail)?;
    let updates = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = CancellationToken::new();
    for _ in 0..viewers {
        let (path, updates, stop) = (path.to_owned(), updates.clone(), stop.clone());
        readers.spawn(async move {
            let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                return;
            };
            let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
            if s.write_all(req.as_bytes()).await.is_err() {
                return;
            }
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    n = s.read(&mut buf) => match n {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            let seen = buf[..n].windows(13).filter(|w| w == b"event: update").count();
                            updates.fetch_add(seen as u64, std::sync::atomic::Ordering::Relaxed);
                        }
                    },
                }
            }
        });
    }
    // Let every reader connect and get its first update before the window opens.
    std::thread::sleep(Duration::from_secs(1));
    let (all0, readers0) = (cpu_seconds(None), cpu_seconds(Some("bench-viewer")));
    let before = updates.load(std::sync::atomic::Ordering::Relaxed);
    std::thread::sleep(window);
    let (all1, readers1) = (cpu_seconds(None), cpu_seconds(Some("bench-viewer")));
    let got = updates.load(std::sync::atomic::Ordering::Relaxed) - before;
    stop.cancel();
    readers.shutdown_timeout(Duration::from_secs(2));
    let cpu = ((all1 - all0) - (readers1 - readers0)).max(0.0);
    Ok((cpu / window.as_secs_f64() * 100.0, got))
}

/// What `a.viewers` readers of live run `run`'s events cost the coordinator, with the
/// timeline and without, above the same window with no reader.
async fn viewer_figures(
    port: u16,
    run: &str,
    n: u64,
    a: &PagesArgs,
) -> Result<ViewerFigures, Problem> {
    let window = Duration::from_secs(a.window.max(1));
    let events = format!("/runs/{run}/events");
    let no_tl = format!("/runs/{run}/events?timeline=0");
    let viewers = a.viewers;
    let (idle, with, without) = tokio::task::spawn_blocking(move || -> Result<_, Problem> {
        let (idle, _) = followed(port, &events, 0, window)?;
        let with = followed(port, &events, viewers, window)?;
        let without = followed(port, &no_tl, viewers, window)?;
        Ok((idle, with, without))
    })
    .await
    .map_err(fail)??;
    let per = |cpu: f64| ((cpu - idle).max(0.0)) / viewers as f64;
    Ok(ViewerFigures {
        agents: n,
        viewers,
        cpu_percent: (with.0 - idle).max(0.0),
        cpu_percent_no_timeline: (without.0 - idle).max(0.0),
        per_viewer_percent: per(with.0),
        per_viewer_percent_no_timeline: per(without.0),
        updates: with.1,
    })
}

pub async fn measure(a: &PagesArgs) -> Result<PagesReport, Problem> {
    let dir = tempfile::tempdir().map_err(fail)?;
    let store = dir.path().join("store");
    std::fs::create_dir_all(&store).map_err(fail)?;
    let most = a.agents.iter().copied().max().unwrap_or(0);
    let e = Embedded::start(
        &format!("file://{}", store.display()),
        u32::try_from(most.max(1)).unwrap_or(u32::MAX),
        dir.path().join("ws"),
        None,
    )
    .map_err(fail)?;
    let registry = Arc::new(RunRegistry::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(fail)?;
    let port = listener.local_addr().map_err(fail)?.port();
    let app = host::pages_router(
        e.coordinator.clone(),
        registry.clone(),
        host::Access::Loopback { port },
    );
    let pages = CancellationToken::new();
    let served = tokio::spawn(host::serve_pages_router(
        host::Limited::new(listener, host::ConnLimits::default()),
        app,
        pages.clone(),
    ));
    let mut report = PagesReport::default();
    let mut sse: Option<(String, tokio::sync::mpsc::UnboundedSender<host::Control>)> = None;
    for &n in &a.agents {
        let done = e
            .coordinator
            .launch(launch(n, 0))
            .await
            .map_err(|r| fail(format!("refused: {r}")))?;
        let finished = done.run_id.clone();
        let r = done.wait().await;
        if r.usage.agents != n {
            return Err(fail(format!(
                "the finished run has {} agents, not {n}: {} {}",
                r.usage.agents,
                r.status.as_str(),
                r.error.unwrap_or_default()
            )));
        }
        // Agents that sleep ten minutes: running for as long as the bench looks at them.
        let live = e
            .coordinator
            .launch(launch(n, 600_000))
            .await
            .map_err(|r| fail(format!("refused: {r}")))?;
        let live_id = live.run_id.clone();
        let stopper = live.stopper();
        registry.track(live);
        // Wait until all its agents are made and as many run as will (a second without change).
        let t0 = Instant::now();
        let (mut running, mut steady) = (0, Instant::now());
        loop {
            let s = registry.summary(&live_id).unwrap_or_default();
            if s.running != running {
                (running, steady) = (s.running, Instant::now());
            }
            if s.agents == n && running > 0 && steady.elapsed() > Duration::from_secs(1) {
                break;
            }
            if t0.elapsed() > Duration::from_secs(120) {
                return Err(fail(format!(
                    "the live run of {n} agents never settled ({} made, {running} running)",
                    s.agents
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let page = |run: &str, q: &str| format!("/runs/{run}{q}");
        let (sf, sc, bytes) = timed(port, &page(&finished, ""), a.rounds).await?;
        let (_, sn, _) = timed(port, &page(&finished, "?timeline=0"), a.rounds).await?;
        let (lf, lc, _) = timed(port, &page(&live_id, ""), a.rounds).await?;
        let (_, ln, _) = timed(port, &page(&live_id, "?timeline=0"), a.rounds).await?;
        report.pages.push(PageFigures {
            agents: n,
            stored_first_byte_ms: sf,
            stored_complete_ms: sc,
            stored_no_timeline_ms: sn,
            live_first_byte_ms: lf,
            live_complete_ms: lc,
            live_no_timeline_ms: ln,
            stored_ratio: sc / sn.max(0.001),
            live_ratio: lc / ln.max(0.001),
            live_running: running,
            page_bytes: bytes,
        });
        if n <= 1000 && a.viewers > 0 {
            if let Some((_, old)) = sse.take() {
                let _ = old.send(host::Control::Stop);
            }
            sse = Some((live_id, stopper));
        } else {
            let _ = stopper.send(host::Control::Stop);
        }
    }
    if let Some((run, stopper)) = sse {
        let n = report
            .pages
            .iter()
            .filter(|p| p.agents <= 1000)
            .map(|p| p.agents)
            .max()
            .unwrap_or(0);
        report.viewers = Some(viewer_figures(port, &run, n, a).await?);
        let _ = stopper.send(host::Control::Stop);
    }
    pages.cancel();
    let _ = served.await;
    e.shutdown();
    Ok(report)
}

pub async fn run(a: PagesArgs) -> i32 {
    match measure(&a).await {
        Ok(r) => {
            if a.json {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
                return 0;
            }
            println!("run page, median of {} requests (ms):", a.rounds);
            println!(
                "  {:>7} {:>10} {:>10} {:>10} {:>7} {:>10} {:>10} {:>10} {:>7} {:>9} {:>8}",
                "agents",
                "stored 1st",
                "complete",
                "no tl",
                "ratio",
                "live 1st",
                "complete",
                "no tl",
                "ratio",
                "bytes",
                "running"
            );
            for p in &r.pages {
                println!(
                    "  {:>7} {:>10.1} {:>10.1} {:>10.1} {:>6.2}× {:>10.1} {:>10.1} {:>10.1} {:>6.2}× {:>9} {:>8}",
                    p.agents,
                    p.stored_first_byte_ms,
                    p.stored_complete_ms,
                    p.stored_no_timeline_ms,
                    p.stored_ratio,
                    p.live_first_byte_ms,
                    p.live_complete_ms,
                    p.live_no_timeline_ms,
                    p.live_ratio,
                    p.page_bytes,
                    p.live_running
                );
            }
            if let Some(v) = &r.viewers {
                println!(
                    "{} readers of a live {}-agent run's events: {:.2}% of a core in all ({:.4}% each), {:.2}% without the timeline ({:.4}% each); {} updates",
                    v.viewers,
                    v.agents,
                    v.cpu_percent,
                    v.per_viewer_percent,
                    v.cpu_percent_no_timeline,
                    v.per_viewer_percent_no_timeline,
                    v.updates
                );
            }
            0
        }
        Err(e) => crate::refuse(e),
    }
}
