//! The run's timeline: its agents over time, phase by phase, each attempt a segment coloured
//! by how it ended, drawn as one SVG that travels with the page's live part.
//!
//! Agents of a phase share lanes (an agent takes the first lane free when it starts), so a
//! phase is as tall as its peak concurrency. Past [`MAX_LANES`] lanes in all, agents share
//! lanes (a denser picture; nothing is left out). Tooltips (`<title>`: label, worker, times,
//! cost, each attempt) are written for runs of up to [`TITLED`] agents; every bar opens its
//! agent's page (the page's script follows `data-a`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt::Write;

use super::escape::{esc, fmt_ms};
use crate::report::{AgentReport, Report};

/// The drawing's width in SVG units (it scales to the page).
const WIDTH: f64 = 1000.0;
/// Lanes drawn in all before agents share them.
pub(super) const MAX_LANES: usize = 240;
/// Runs of up to this many agents get a tooltip on every bar.
pub(super) const TITLED: usize = 2000;
const AXIS: f64 = 16.0;
const PHASE_HEAD: f64 = 16.0;

/// An agent placed on the timeline.
struct Placed<'a> {
    agent: &'a AgentReport,
    start: u64,
    lane: usize,
}

/// When an agent first held a slot, if it did.
fn first_start(a: &AgentReport) -> Option<u64> {
    a.segments.first().map(|s| s.start_ms).or(a.start_ms)
}

/// When it last left one (or `now` while it holds one).
fn last_end(a: &AgentReport, now: u64) -> u64 {
    match a.segments.last() {
        Some(s) => s.end_ms.unwrap_or(now),
        None => a.end_ms.unwrap_or(now),
    }
}

/// Puts a phase's started agents in lanes, at most `cap` of them: each takes the lane that
/// freed first if it is free by its start, else a new lane, else (at the cap) the lane that
/// frees first anyway. Returns the agents placed and the lanes used.
fn place<'a>(agents: &[&'a AgentReport], now: u64, cap: usize) -> (Vec<Placed<'a>>, usize) {
    let mut started: Vec<Placed<'a>> = agents
        .iter()
        .filter_map(|a| {
            first_start(a).map(|start| Placed {
                agent: a,
                start,
                lane: 0,
            })
        })
        .collect();
    started.sort_by_key(|p| (p.start, p.agent.index));
    let mut free: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut lanes = 0usize;
    for p in &mut started {
        let end = last_end(p.agent, now).max(p.start + 1);
        let lane = match free.peek() {
            Some(Reverse((at, lane))) if *at <= p.start || lanes >= cap => {
                let lane = *lane;
                free.pop();
                lane
            }
            _ => {
                lanes += 1;
                lanes - 1
            }
        };
        p.lane = lane;
        free.push(Reverse((end, lane)));
    }
    (started, lanes)
}

/// The class of a segment's bar: how its attempt ended.
fn class_of(outcome: Option<&str>) -> &'static str {
    match outcome {
        None => "run",
        Some("completed") => "ok",
        Some("failed") => "fail",
        Some("cancelled") => "cancel",
        Some(_) => "retry",
    }
}

/// The timeline of report `r` as it stands at `now` (ms since the run started).
pub(super) fn timeline(r: &Report, now: u64) -> String {
    let span = r
        .agents
        .iter()
        .filter(|a| first_start(a).is_some())
        .map(|a| last_end(a, now))
        .max()
        .unwrap_or(0)
        .max(now)
        .max(1);
    // Phases in display order, each with its agents.
    let mut order: HashMap<&str, usize> = HashMap::new();
    let mut phases: Vec<(&str, Vec<&AgentReport>)> = Vec::new();
    for g in &r.groups {
        order.entry(g.title.as_str()).or_insert_with(|| {
            phases.push((g.title.as_str(), Vec::new()));
            phases.len() - 1
        });
    }
    for a in &r.agents {
        let at = *order.entry(a.group.as_str()).or_insert_with(|| {
            phases.push((a.group.as_str(), Vec::new()));
            phases.len() - 1
        });
        phases[at].1.push(a);
    }
    phases.retain(|(_, agents)| !agents.is_empty());
    if phases.is_empty() {
        return String::new();
    }
    let cap = (MAX_LANES / phases.len()).max(8);
    let placed: Vec<(Vec<Placed>, usize)> = phases
        .iter()
        .map(|(_, agents)| place(agents, now, cap))
        .collect();
    let lanes: usize = placed.iter().map(|(_, n)| *n).sum();
    let row = match lanes {
        0..=40 => 12.0,
        41..=100 => 6.0,
        _ => 3.0,
    };
    let height = AXIS + phases.len() as f64 * PHASE_HEAD + lanes as f64 * row + 4.0;
    let titled = r.agents.len() <= TITLED;

    let mut out = String::with_capacity(r.agents.len() * 90 + 2048);
    let drawn: usize = placed.iter().map(|(p, _)| p.len()).sum();
    let _ = write!(
        out,
        "<section id=timeline><h2>Timeline <small>{drawn} of {} agents started · {}{}</small></h2>\
         <svg class=tl viewBox=\"0 0 {WIDTH} {height:.0}\" role=img aria-label=\"the run's agents over time\">",
        r.agents.len(),
        fmt_ms(span),
        if lanes >= MAX_LANES {
            " · dense: agents share lanes"
        } else {
            ""
        }
    );
    axis(&mut out, span, height);
    let mut y = AXIS;
    for ((title, agents), (placed, lanes)) in phases.iter().zip(&placed) {
        let queued = agents.len() - placed.len();
        let _ = write!(
            out,
            "<text class=ph x=2 y={:.0}>{} · {} agents{}</text>",
            y + 12.0,
            esc(title),
            agents.len(),
            if queued > 0 {
                format!(", {queued} not started")
            } else {
                String::new()
            }
        );
        y += PHASE_HEAD;
        let scale = Scale { span, now, row };
        for p in placed {
            agent_bars(&mut out, p, y + p.lane as f64 * row, &scale, titled);
        }
        y += *lanes as f64 * row;
    }
    out.push_str(
        "</svg><p class=legend><span class=\"k run\"></span>running <span class=\"k ok\"></span>completed \
         <span class=\"k retry\"></span>ended and retried <span class=\"k fail\"></span>failed \
         <span class=\"k cancel\"></span>cancelled <span class=\"k cached\"></span>from the resumed run \
         · a bar opens its agent</p></section>",
    );
    out
}

/// The time axis: five ticks with their times.
fn axis(out: &mut String, span: u64, height: f64) {
    for i in 0..=4u64 {
        let t = span * i / 4;
        let tx = x_of(t, span);
        let anchor = match i {
            0 => "start",
            4 => "end",
            _ => "middle",
        };
        let _ = write!(
            out,
            "<line class=tick x1={tx:.1} x2={tx:.1} y1={AXIS} y2={height:.0} />\
             <text class=ax x={tx:.1} y=11 text-anchor={anchor}>{}</text>",
            fmt_ms(t)
        );
    }
}

/// Where time `t` falls across the drawing.
fn x_of(t: u64, span: u64) -> f64 {
    (t as f64 / span as f64 * WIDTH).min(WIDTH)
}

/// What places a bar: the time the drawing spans, now, and a lane's height.
struct Scale {
    span: u64,
    now: u64,
    row: f64,
}

/// One agent's group of bars at `top`: a segment per attempt (or one bar for an agent
/// served from the run it resumes), with its tooltip when `titled`.
fn agent_bars(out: &mut String, p: &Placed, top: f64, s: &Scale, titled: bool) {
    let a = p.agent;
    let x = |t: u64| x_of(t, s.span);
    let _ = write!(out, "<g data-a={}>", a.index);
    if titled {
        out.push_str("<title>");
        out.push_str(&esc(&tooltip(a, s.now)));
        out.push_str("</title>");
    }
    if a.segments.is_empty() {
        let class = if a.cached {
            "cached"
        } else {
            class_of(a.end_ms.map(|_| a.status.as_str()))
        };
        bar(out, x(p.start), x(last_end(a, s.now)), top, s.row, class);
    }
    for seg in &a.segments {
        bar(
            out,
            x(seg.start_ms),
            x(seg.end_ms.unwrap_or(s.now)),
            top,
            s.row,
            class_of(seg.outcome.as_deref()),
        );
    }
    out.push_str("</g>");
}

fn bar(out: &mut String, x0: f64, x1: f64, top: f64, row: f64, class: &str) {
    let w = (x1 - x0).max(0.6);
    let h = if row > 4.0 { row - 2.0 } else { row - 0.5 };
    let _ = write!(
        out,
        "<rect class={class} x={x0:.1} y={top:.1} width={w:.1} height={h:.1} />"
    );
}

/// What hovering an agent's bar says: who it is, when it ran, what it cost, and each attempt
/// with its worker and how it ended.
fn tooltip(a: &AgentReport, now: u64) -> String {
    let mut t = format!("#{} {} · {}", a.index, a.label, a.status.as_str());
    if let Some(s) = first_start(a) {
        let _ = write!(
            t,
            " · started {} · {}",
            fmt_ms(s),
            fmt_ms(last_end(a, now).saturating_sub(s))
        );
    }
    if a.cost_usd > 0.0 {
        let _ = write!(t, " · ${:.4}", a.cost_usd);
    }
    for s in a.attempt_segments().iter() {
        let _ = write!(
            t,
            "\nattempt {} on {}: {} to {}, {}",
            s.attempt,
            if s.worker.is_empty() { "?" } else { &s.worker },
            fmt_ms(s.start_ms),
            s.end_ms.map_or_else(|| "now".to_owned(), fmt_ms),
            s.outcome.as_deref().unwrap_or("running")
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::AttemptSegment;

    fn agent(index: u64, group: &str, segs: &[(u64, Option<u64>, &str)]) -> AgentReport {
        let mut segments = Vec::new();
        for (n, (s, e, w)) in segs.iter().enumerate() {
            AttemptSegment::open(&mut segments, n as u32 + 1, *s, w);
            if let Some(e) = e {
                AttemptSegment::close(
                    &mut segments,
                    *e,
                    if n + 1 < segs.len() {
                        "stalled"
                    } else {
                        "completed"
                    },
                );
            }
        }
        AgentReport {
            label: format!("a{index}"),
            group: group.into(),
            status: serde_json::from_value(serde_json::json!("completed")).unwrap(),
            attempts: segs.len() as u32,
            cached: false,
            start_ms: segs.first().map(|s| s.0),
            end_ms: segs.last().and_then(|s| s.1),
            error: None,
            index,
            key: String::new(),
            model: String::new(),
            input_tokens: 0,
            output_tokens: 0,
            disk_bytes: 0,
            waiting: None,
            cost_usd: 0.25,
            segments,
            worker: String::new(),
        }
    }

    #[test]
    fn agents_that_follow_each_other_share_a_lane_and_overlapping_ones_do_not() {
        let a = agent(0, "G", &[(0, Some(10), "w1")]);
        let b = agent(1, "G", &[(10, Some(20), "w1")]);
        let c = agent(2, "G", &[(5, Some(30), "w2")]);
        let (placed, lanes) = place(&[&a, &b, &c], 40, 100);
        assert_eq!(lanes, 2);
        let lane = |i: u64| placed.iter().find(|p| p.agent.index == i).unwrap().lane;
        assert_eq!(lane(0), lane(1), "b starts when a ends");
        assert_ne!(lane(0), lane(2));
        // At the cap, agents share lanes instead of being left out.
        let (placed, lanes) = place(&[&a, &b, &c], 40, 1);
        assert_eq!((placed.len(), lanes), (3, 1));
    }

    #[test]
    fn each_attempt_is_a_segment_with_its_worker_and_its_end_and_text_is_escaped() {
        let mut r = crate::report::Report::rejected("wf_t", Default::default(), String::new());
        r.agents = vec![
            agent(
                0,
                "<Phase>",
                &[(0, Some(100), "w-a"), (150, Some(400), "w-b")],
            ),
            agent(1, "<Phase>", &[(0, None, "w-c")]),
        ];
        let svg = timeline(&r, 500);
        assert_eq!(svg.matches("<rect ").count(), 3, "{svg}");
        assert!(
            svg.contains("class=retry"),
            "the stalled first attempt: {svg}"
        );
        assert!(svg.contains("class=ok"), "{svg}");
        assert!(svg.contains("class=run"), "the running one: {svg}");
        assert!(
            svg.contains("attempt 1 on w-a: 0ms to 100ms, stalled"),
            "{svg}"
        );
        assert!(svg.contains("attempt 2 on w-b"), "{svg}");
        assert!(svg.contains("&lt;Phase&gt; · 2 agents"), "{svg}");
        assert!(!svg.contains("<Phase>"));
        assert!(svg.contains("data-a=1>"));
    }

    #[test]
    fn ten_thousand_agents_at_once_stay_within_the_lane_cap() {
        let all: Vec<_> = (0..10_000)
            .map(|i| agent(i, "G", &[(i, Some(i + 5000), "w")]))
            .collect();
        let mut r = crate::report::Report::rejected("wf_t", Default::default(), String::new());
        r.agents = all;
        let svg = timeline(&r, 20_000);
        assert_eq!(
            svg.matches("<g data-a=").count(),
            10_000,
            "nothing left out"
        );
        assert!(svg.contains("dense"));
        assert!(!svg.contains("<title>"), "no tooltips past {TITLED} agents");
    }
}
