//! Terminal progress of a run: progress bars on a TTY (indicatif), plain lines otherwise.
//!
//! Both read the run engine's live [`Snapshot`]: one header (workflow, agents done/total,
//! tokens, elapsed, usage-limit waits), one bar or line per group in display order, and the
//! script's `log()` lines above them as they arrive.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_proto::wire::Report;
use flotilla_proto::wire::Snapshot;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::term::clean;

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Bars,
    Lines,
    Quiet,
}

impl Mode {
    pub fn pick(bars: bool, lines: bool) -> Mode {
        if bars {
            Mode::Bars
        } else if lines {
            Mode::Lines
        } else {
            Mode::Quiet
        }
    }
}

/// A running progress display.
pub struct View {
    task: Option<JoinHandle<()>>,
    done: Option<tokio::sync::oneshot::Sender<()>>,
}

impl View {
    /// Draws the last state and stops.
    pub async fn finish(mut self) {
        if let Some(done) = self.done.take() {
            let _ = done.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

pub fn start(mode: Mode, rx: watch::Receiver<Arc<Snapshot>>) -> View {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let task = match mode {
        Mode::Quiet => None,
        Mode::Bars => Some(tokio::spawn(bars(rx, done_rx))),
        Mode::Lines => Some(tokio::spawn(lines(rx, done_rx))),
    };
    View {
        task,
        done: Some(done_tx),
    }
}

fn tokens(n: u64) -> String {
    if n >= 1_000_000 {
        format!("{:.1}M", n as f64 / 1e6)
    } else if n >= 10_000 {
        format!("{:.1}k", n as f64 / 1e3)
    } else {
        n.to_string()
    }
}

pub(crate) fn elapsed(ms: u64) -> String {
    let s = ms / 1000;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{:.1}s", ms as f64 / 1000.0)
    }
}

/// The header: workflow, status (`running`, `paused`, `stopping`, `completed, 2 failed`, ...),
/// agents by state, tokens, cost, elapsed and why agents wait: the run's summary, as every
/// view has it.
fn header(s: &Snapshot) -> String {
    let u = &s.summary;
    let mut h = format!(
        "{} · {} · {} · {} tokens",
        clean(&s.workflow.name),
        u.headline(),
        u.agents_line(),
        tokens(u.output_tokens),
    );
    if u.cost_usd > 0.0 {
        h.push_str(&format!(" · ${:.4}", u.cost_usd));
    }
    h.push_str(&format!(" · {}", elapsed(s.elapsed_now_ms())));
    if u.agents > 25 {
        h.push_str(" · Large workflow");
    }
    if let Some(w) = &u.waiting {
        h.push_str(&format!(" · {}", clean(w)));
    }
    h
}

fn group_title(t: &str) -> std::borrow::Cow<'_, str> {
    if t.is_empty() {
        "(no phase)".into()
    } else {
        clean(t)
    }
}

async fn bars(
    mut rx: watch::Receiver<Arc<Snapshot>>,
    mut done: tokio::sync::oneshot::Receiver<()>,
) {
    let mp = MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(10));
    let head = mp.add(ProgressBar::new_spinner());
    head.set_style(
        ProgressStyle::with_template("{spinner} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    head.enable_steady_tick(Duration::from_millis(120));
    let style = ProgressStyle::with_template("  {prefix:<24} [{bar:30}] {pos}/{len} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    let mut groups: HashMap<String, ProgressBar> = HashMap::new();
    let mut printed = 0usize;
    let mut finished = false;
    loop {
        let snap = rx.borrow_and_update().clone();
        for line in snap.logs.iter().skip(printed) {
            let _ = mp.println(format!("  {}", clean(line)));
        }
        printed = printed.max(snap.logs.len());
        for g in &snap.groups {
            if g.total == 0 {
                continue;
            }
            let bar = groups.entry(g.title.clone()).or_insert_with(|| {
                let b = mp.add(ProgressBar::new(g.total));
                b.set_style(style.clone());
                b.set_prefix(group_title(&g.title).into_owned());
                b
            });
            bar.set_length(g.total);
            bar.set_position(g.done + g.failed);
            let mut msg = format!("{} tok", tokens(g.output_tokens));
            if g.running > 0 {
                msg.push_str(&format!(" · {} running", g.running));
            }
            if g.failed > 0 {
                msg.push_str(&format!(" · {} failed", g.failed));
            }
            bar.set_message(msg);
        }
        head.set_message(header(&snap));
        if finished {
            break;
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { finished = true; },
            _ = &mut done => finished = true,
        }
    }
    for b in groups.values() {
        b.finish();
    }
    head.finish_and_clear();
}

async fn lines(
    mut rx: watch::Receiver<Arc<Snapshot>>,
    mut done: tokio::sync::oneshot::Receiver<()>,
) {
    let mut printed = 0usize;
    let mut last: HashMap<String, (u64, u64)> = HashMap::new();
    let mut last_header = tokio::time::Instant::now();
    // The header also goes out whenever the run's status changes (paused, resumed, stopping).
    let mut last_status = None;
    let mut finished = false;
    loop {
        let snap = rx.borrow_and_update().clone();
        for line in snap.logs.iter().skip(printed) {
            eprintln!("log: {}", clean(line));
        }
        printed = printed.max(snap.logs.len());
        for g in &snap.groups {
            let now = (g.done + g.failed, g.total);
            let before = last.get(&g.title).copied().unwrap_or((0, 0));
            // A line when a group starts and when it completes; counts in between come with
            // the periodic header.
            if g.total > 0
                && (before.1 == 0 || (now.0 == now.1 && before.0 != before.1))
                && now != before
            {
                eprintln!(
                    "[{}] {}/{} agents done{}",
                    group_title(&g.title),
                    now.0,
                    now.1,
                    if g.failed > 0 {
                        format!(", {} failed", g.failed)
                    } else {
                        String::new()
                    }
                );
            }
            last.insert(g.title.clone(), now);
        }
        let status = snap.summary.status;
        let changed = last_status.is_some_and(|s| s != status);
        if (changed || last_header.elapsed() >= Duration::from_secs(5)) && !finished {
            eprintln!("{}", header(&snap));
            last_header = tokio::time::Instant::now();
        }
        if !snap.run_id.is_empty() {
            last_status = Some(status);
        }
        if finished {
            break;
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { finished = true; },
            _ = &mut done => finished = true,
        }
    }
}

/// One line after the result: status, agents, tokens, time, run id.
pub fn summary(report: &Report) {
    let u = &report.usage;
    let mut line = format!(
        "{} in {} · {} agents",
        flotilla_proto::wire::Summary::of_report(report).headline(),
        elapsed(u.duration_ms),
        u.agents
    );
    if u.cached > 0 {
        line.push_str(&format!(" ({} cached)", u.cached));
    }
    if u.errors > 0 {
        line.push_str(&format!(" · {} errors", u.errors));
    }
    line.push_str(&format!(
        " · {} in / {} out tokens · run {}",
        tokens(u.input_tokens),
        tokens(u.output_tokens),
        report.run_id
    ));
    eprintln!("{line}");
    for w in &report.warnings {
        eprintln!("  warning: {}", clean(w));
    }
    if let Some(c) = &report.changes {
        let changed = c.merged + c.isolated + c.conflicted;
        if changed > 0 {
            eprintln!(
                "  {changed} agents changed files ({} in the run head, {} on their own branches, {} in conflict): `{}` brings them into your repository",
                c.merged, c.isolated, c.conflicted, c.apply
            );
        }
    }
    for f in &report.failures {
        eprintln!("  failure: {}", clean(f));
    }
    if let Some(e) = &report.error {
        eprintln!("error: {}", clean(e));
    }
}
