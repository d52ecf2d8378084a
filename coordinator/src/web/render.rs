//! HTML: a run's page (live and final), one agent's detail, and the page frame with its style
//! and script. Everything shown is escaped ([`esc`]).

use std::sync::Arc;

use crate::history;

pub(super) use super::escape::{esc, fmt_ms};
use crate::report::{Report, RunStatus, Summary};

/// Rows a phase lists unless the reader asks for all of them (`?all=1`): a big fan-out
/// would otherwise send thousands of rows on every update.
pub(super) const PHASE_ROWS: usize = 100;

/// Which agents of a big phase are listed, [`PHASE_ROWS`] at most: the failed ones, then the
/// running ones, then the latest completed ones, then the next queued ones; in index order.
/// (Ten thousand agents in flight still make a hundred rows.)
pub(super) fn rows_to_show<'a>(
    agents: &[&'a crate::report::AgentReport],
) -> Vec<&'a crate::report::AgentReport> {
    if agents.len() <= PHASE_ROWS {
        return agents.to_vec();
    }
    let mut keep = std::collections::BTreeSet::new();
    let take = |keep: &mut std::collections::BTreeSet<u64>,
                limit: usize,
                it: &mut dyn Iterator<Item = &&'a crate::report::AgentReport>,
                pick: &dyn Fn(&crate::report::AgentReport) -> bool| {
        for a in it {
            if keep.len() >= limit {
                break;
            }
            if pick(a) {
                keep.insert(a.index);
            }
        }
    };
    // Room is left for some completed and queued ones whatever fails or runs.
    let urgent = PHASE_ROWS - 20;
    take(&mut keep, urgent / 2, &mut agents.iter(), &|a| {
        a.status == "failed"
    });
    take(&mut keep, urgent, &mut agents.iter(), &|a| {
        a.status == "running"
    });
    take(&mut keep, PHASE_ROWS - 10, &mut agents.iter().rev(), &|a| {
        !matches!(a.status.as_str(), "queued" | "running" | "failed")
    });
    take(&mut keep, PHASE_ROWS, &mut agents.iter(), &|a| {
        a.status == "queued"
    });
    agents
        .iter()
        .filter(|a| keep.contains(&a.index))
        .copied()
        .collect()
}

/// What a reader asked of a run's page: every agent of every phase (`?all=1`), and the
/// timeline (unless `?timeline=0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct View {
    pub(super) all: bool,
    pub(super) timeline: bool,
}

impl View {
    /// The view as one byte (the live cache's key).
    pub(super) fn key(self) -> u8 {
        u8::from(self.all) | (u8::from(self.timeline) << 1)
    }
}

/// The part of the page that changes while the run goes on (sent again over SSE).
pub(super) fn render_live(d: &PageData, view: View) -> String {
    let mut out = counters(d);
    if view.timeline {
        out.push_str(&super::timeline::timeline(
            &d.report,
            d.report.usage.duration_ms,
        ));
    }
    out.push_str("<div id=phases>");
    for g in &d.report.groups {
        out.push_str(&phase_table(d, &g.title, view.all));
    }
    out.push_str("</div>");
    out.push_str(&outcome(&d.report));
    out
}

/// A run's status as a table cell: its headline (`completed, 2 failed`), colored by status,
/// and in the warning color when its script returned although agents failed.
pub(super) fn status_cell(s: &Summary) -> String {
    let failures = if s.completed_with_failures() {
        " failures"
    } else {
        ""
    };
    format!(
        "<td class=\"st {}{failures}\">{}</td>",
        s.status.as_str(),
        esc(&s.headline())
    )
}

/// The counters (the run's [`Summary`]), the warnings, the changes line, the run's buttons
/// and its log.
fn counters(d: &PageData) -> String {
    let r = &*d.report;
    let u = &r.usage;
    let s = &d.summary;
    let failures = if s.completed_with_failures() {
        " failures"
    } else {
        ""
    };
    let mut out = String::new();
    out.push_str(&format!(
        "<p class=counters><span class=\"st {status}{failures}\" id=status>{headline}</span> \
         · agents <b id=done>{done}</b> done / <b id=agents>{total}</b> \
         · queued <b id=queued>{queued}</b> · running <b id=running>{running}</b> \
         · failed <b id=failed>{failed}</b>{cancelled} \
         · tokens <b id=tokens>{tin} in / {tout} out</b> · cost <b id=cost>${cost:.4}</b> \
         · elapsed <b id=elapsed>{elapsed}</b>{waits}</p>",
        status = s.status.as_str(),
        headline = esc(&s.headline()),
        done = s.done,
        total = s.agents,
        queued = s.queued,
        running = s.running,
        failed = s.failed,
        cancelled = if s.cancelled > 0 {
            format!(" · cancelled <b id=cancelled>{}</b>", s.cancelled)
        } else {
            String::new()
        },
        waits = if u.waits > 0 {
            format!(
                " · waits <b id=waits>{}</b> (throttles and usage limits, not attempts)",
                u.waits
            )
        } else {
            String::new()
        },
        tin = s.input_tokens,
        tout = s.output_tokens,
        cost = s.cost_usd,
        elapsed = fmt_ms(s.elapsed_ms),
    ));
    let mut warnings = Vec::new();
    if u.large_workflow().is_some() {
        warnings.push(format!(
            "Large workflow: {} agents, {} tokens so far",
            u.agents,
            u.input_tokens + u.output_tokens
        ));
    }
    if let Some(w) = &s.waiting {
        warnings.push(w.clone());
    }
    for w in warnings {
        out.push_str(&format!("<p class=warn>{}</p>", esc(&w)));
    }
    if let Some(c) = &r.changes {
        let changed = c.merged + c.isolated + c.conflicted;
        if changed > 0 {
            out.push_str(&format!(
                "<p class=changes>{changed} agents changed files ({} merged into the run head, {} on their own branches, {} in conflict) — <a href=\"/runs/{}/diff\">the run's diff</a>; <code>{}</code> brings them home</p>",
                c.merged,
                c.isolated,
                c.conflicted,
                esc(&r.run_id),
                esc(&c.apply)
            ));
        }
    }
    let at_quota = s
        .waiting
        .as_deref()
        .is_some_and(|w| w.starts_with(crate::run::HELD_AT_QUOTA));
    if d.here && d.live() && s.status != RunStatus::Stopping && at_quota {
        // Held until its namespace's quota resets: it goes on by itself; it can be stopped.
        out.push_str("<p class=buttons><button data-action=stop class=danger data-ask=\"Stop the run? Its agents are cancelled and it cannot be resumed here.\">Stop run</button></p>");
    } else if d.here && d.live() && s.status != RunStatus::Stopping {
        let at_budget = s
            .waiting
            .as_deref()
            .is_some_and(|w| w.starts_with(crate::run::HELD_AT_BUDGET));
        let (action, label) = if at_budget {
            // Paused at its money budget: only a new budget lets it go on.
            ("budget", "Raise budget")
        } else if s.status == RunStatus::Paused {
            ("resume", "Resume")
        } else {
            ("pause", "Pause")
        };
        let ask = match action {
            "pause" => {
                " data-ask=\"Pause the run? Its running agents are interrupted (their work is kept) and nothing new starts until it resumes.\""
            }
            "budget" => " data-budget=1",
            _ => "",
        };
        out.push_str(&format!(
            "<p class=buttons><button data-action={action}{ask}>{label}</button> \
             <button data-action=stop class=danger data-ask=\"Stop the run? Its agents are cancelled and it cannot be resumed here.\">Stop run</button></p>"
        ));
    }
    out.push_str(&questions(d));
    if !r.logs.is_empty() {
        out.push_str("<pre id=logs>");
        for line in &r.logs {
            out.push_str(&esc(line));
            out.push('\n');
        }
        out.push_str("</pre>");
    }
    out
}

/// The questions the run's script asked (`ask()`): the open ones, each with an *Answer*
/// button where the run runs (its form, made from the question's schema, is outside the live
/// part), then those answered, with who answered and what.
fn questions(d: &PageData) -> String {
    let qs = &d.report.questions;
    if qs.is_empty() {
        return String::new();
    }
    let mut out = String::from("<section class=questions><h3>Questions</h3>");
    for q in qs.iter().filter(|q| q.answer.is_none()) {
        let a = &q.asked;
        let schema = a.schema.as_ref().map(|s| s.to_string()).unwrap_or_default();
        let until = a
            .deadline
            .as_deref()
            .map(|t| {
                format!(
                    " <small>unanswered by {}, it ends with null</small>",
                    esc(t)
                )
            })
            .unwrap_or_default();
        let button = if d.here && d.live() {
            format!(
                " <button data-answer=\"{}\" data-schema=\"{}\" data-text=\"{}\">Answer</button>",
                esc(&a.id),
                esc(&schema),
                esc(&a.question)
            )
        } else {
            String::new()
        };
        out.push_str(&format!(
            "<div class=\"question open\" id=\"{}\"><b>{}</b> {}{until}{button}</div>",
            esc(&a.id),
            esc(&a.id),
            esc(&a.question)
        ));
    }
    for q in qs.iter() {
        let Some(ans) = &q.answer else { continue };
        let said = if ans.timed_out {
            "timed out: null".to_owned()
        } else {
            format!("answered by {}: {}", ans.by, ans.value)
        };
        out.push_str(&format!(
            "<div class=\"question answered\"><b>{}</b> {} <small>{}</small></div>",
            esc(&q.asked.id),
            esc(&q.asked.question),
            esc(&said)
        ));
    }
    out.push_str("</section>");
    out
}

/// One phase: its summary and its agents' rows (the running and failed always, the rest up to
/// [`PHASE_ROWS`] unless `all`).
fn phase_table(d: &PageData, title: &str, all: bool) -> String {
    let (r, mut out) = (&*d.report, String::new());
    let u = &r.usage;
    let agents: Vec<_> = r.agents.iter().filter(|a| a.group == title).collect();
    let done = agents.iter().filter(|a| a.status == "completed").count();
    let tokens: u64 = agents
        .iter()
        .map(|a| a.input_tokens + a.output_tokens)
        .sum();
    let elapsed = span_ms(agents.iter().map(|a| (a.start_ms, a.end_ms)), u.duration_ms);
    out.push_str(&format!(
        "<section class=phase><h3>{} <small>{done}/{} agents · {tokens} tokens · {}</small></h3>\
         <table><thead><tr><th>#</th><th>agent</th><th>status</th><th>model</th><th>tokens</th><th>cost</th><th>attempts</th><th>started</th><th>elapsed</th><th></th></tr></thead><tbody>",
        esc(title),
        agents.len(),
        fmt_ms(elapsed),
    ));
    let shown = if all {
        agents.clone()
    } else {
        rows_to_show(&agents)
    };
    let hidden = agents.len() - shown.len();
    for a in shown {
        let elapsed = match (a.start_ms, a.end_ms) {
            (Some(s), Some(e)) => fmt_ms(e.saturating_sub(s)),
            (Some(s), None) if d.live() => fmt_ms(u.duration_ms.saturating_sub(s)),
            _ => String::new(),
        };
        let buttons = match a.status.as_str() {
            "running" if d.here && d.live() => format!(
                "<button data-action=stop_agent data-target={i} data-ask=\"Stop agent #{i}? Its agent() resolves null.\">stop</button> \
                 <button data-action=restart_agent data-target={i}>restart</button>",
                i = a.index
            ),
            "queued" if d.here && d.live() => format!(
                "<button data-action=stop_agent data-target={i} data-ask=\"Stop agent #{i}? Its agent() resolves null.\">stop</button>",
                i = a.index
            ),
            _ => String::new(),
        };
        let cached = if a.cached { " (cached)" } else { "" };
        let why = match &a.waiting {
            Some(w) if a.status == "queued" => {
                format!("<div class=why>{}</div>", esc(w))
            }
            _ => String::new(),
        };
        out.push_str(&format!(
            "<tr id=agent-{i}><td>{i}</td><td><a href=\"/runs/{run}/agents/{i}\" data-agent={i}>{label}</a></td>\
             <td class=\"st {st}\">{st}{cached}{why}</td><td>{model}</td><td>{tokens}</td><td>{cost}</td><td>{attempts}</td><td>{started}</td><td>{elapsed}</td><td>{buttons}</td></tr>",
            i = a.index,
            run = esc(&r.run_id),
            label = esc(&a.label),
            st = a.status.as_str(),
            model = esc(&a.model),
            tokens = a.input_tokens + a.output_tokens,
            cost = if a.cost_usd > 0.0 {
                format!("${:.4}", a.cost_usd)
            } else {
                String::new()
            },
            attempts = a.attempts,
            started = a.start_ms.map(fmt_ms).unwrap_or_default(),
        ));
    }
    if hidden > 0 {
        out.push_str(&format!(
            "<tr class=more><td colspan=10>{hidden} more agents of this phase are not listed \
             (running and failed ones always are) · <a href=\"?all=1\">show all</a></td></tr>"
        ));
    }
    out.push_str("</tbody></table></section>");
    out
}

/// The run's error, its failure lines and, once it ended, its result.
fn outcome(r: &Report) -> String {
    let mut out = String::new();
    if let Some(err) = &r.error {
        out.push_str(&format!("<h2>Error</h2><pre class=err>{}</pre>", esc(err)));
    }
    if !r.failures.is_empty() {
        out.push_str("<h2>Failures</h2><pre>");
        for f in &r.failures {
            out.push_str(&esc(f));
            out.push('\n');
        }
        out.push_str("</pre>");
    }
    if r.status.is_final() {
        let result = serde_json::to_string_pretty(&r.result).unwrap_or_default();
        out.push_str(&format!(
            "<h2>Result</h2><pre id=result>{}</pre>",
            esc(&result)
        ));
    }
    out
}

/// Wall time covered by a set of agents (first start to last end, or now).
pub(super) fn span_ms(spans: impl Iterator<Item = (Option<u64>, Option<u64>)>, now: u64) -> u64 {
    let mut first = None::<u64>;
    let mut last = 0u64;
    for (s, e) in spans {
        if let Some(s) = s {
            first = Some(first.map_or(s, |f| f.min(s)));
            last = last.max(e.unwrap_or(now));
        }
    }
    first.map_or(0, |f| last.saturating_sub(f))
}

pub(super) fn render_run(d: &PageData, view: View) -> String {
    let r = &*d.report;
    let name = if r.workflow.name.is_empty() {
        "workflow"
    } else {
        &r.workflow.name
    };
    let body = format!(
        "<h1>{} <small>{}</small></h1><p class=desc>{}</p><p id=notice></p>{CONFIRM}{BUDGET}{ANSWER}\
         <div id=live>{}</div>",
        esc(name),
        esc(&r.run_id),
        esc(&r.workflow.description),
        render_live(d, view),
    );
    page_with(
        &format!("{name} · flotilla"),
        &body,
        &[
            ("run", r.run_id.as_str()),
            ("live", if d.live() { "1" } else { "0" }),
        ],
    )
}

/// One agent's page (a URL of its own): where it ran and what it cost, its prompt, error and
/// result, each attempt's transcript as turns; the caller adds its change.
pub(super) fn render_agent(
    run: &str,
    a: &crate::report::AgentReport,
    d: &history::AgentDetail,
) -> String {
    let mut out = format!(
        "<p class=crumbs><a href=\"/runs/{r}\">run {r}</a> › agent #{i}</p>\
         <section class=agent><h1>#{i} {label} <small class=\"st {st}\" id=agent-status>{st}</small></h1>",
        r = esc(run),
        i = a.index,
        label = esc(&a.label),
        st = a.status.as_str()
    );
    let elapsed = match (a.start_ms, a.end_ms) {
        (Some(s), Some(e)) => fmt_ms(e.saturating_sub(s)),
        _ => String::new(),
    };
    let segments = a.attempt_segments();
    let workers: Vec<&str> = segments
        .iter()
        .map(|s| s.worker.as_str())
        .filter(|w| !w.is_empty())
        .collect();
    let mut facts = vec![
        ("phase", esc(&a.group)),
        ("model", esc(&a.model)),
        ("attempts", a.attempts.to_string()),
        ("started", a.start_ms.map(fmt_ms).unwrap_or_default()),
        ("elapsed", elapsed),
        (
            "tokens",
            format!("{} in / {} out", a.input_tokens, a.output_tokens),
        ),
        ("cost", format!("${:.4}", a.cost_usd)),
    ];
    if !workers.is_empty() {
        let mut seen = workers.clone();
        seen.dedup();
        facts.push(("workers", esc(&seen.join(", "))));
    }
    if let Some(w) = &a.waiting {
        facts.push(("waits", esc(w)));
    }
    out.push_str("<table class=facts>");
    for (k, v) in facts {
        out.push_str(&format!("<tr><th>{k}</th><td>{v}</td></tr>"));
    }
    out.push_str("</table>");
    if !segments.is_empty() {
        out.push_str("<h3>Attempts</h3><table class=attempts><thead><tr><th>attempt</th><th>worker</th><th>from</th><th>to</th><th>ended</th></tr></thead><tbody>");
        for s in segments.iter() {
            out.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"st {o}\">{o}</td></tr>",
                s.attempt,
                esc(&s.worker),
                fmt_ms(s.start_ms),
                s.end_ms.map(fmt_ms).unwrap_or_else(|| "now".into()),
                o = esc(s.outcome.as_deref().unwrap_or("running")),
            ));
        }
        out.push_str("</tbody></table>");
    }
    out.push_str(&format!(
        "<h3>Prompt</h3><pre class=prompt>{}</pre>",
        esc(d.prompt.as_deref().unwrap_or("(not stored)"))
    ));
    if let Some(err) = &a.error {
        out.push_str(&format!("<h3>Error</h3><pre class=err>{}</pre>", esc(err)));
    }
    match &d.result {
        Some(serde_json::Value::String(t)) => {
            out.push_str(&format!(
                "<h3>Result</h3><pre class=result>{}</pre>",
                esc(t)
            ));
        }
        Some(v) => out.push_str(&format!(
            "<h3>Result</h3><pre class=result>{}</pre>",
            esc(&serde_json::to_string_pretty(v).unwrap_or_default())
        )),
        None => {}
    }
    if d.attempts.is_empty() {
        let why = if a.cached {
            "served from an earlier run: no transcript here"
        } else {
            "no transcript stored yet"
        };
        out.push_str(&format!("<p class=note>{why}</p>"));
    }
    for (n, events) in &d.attempts {
        out.push_str(&format!(
            "<h3>Transcript, attempt {n}</h3><div class=transcript>{}</div>",
            super::turns::transcript(events)
        ));
    }
    out.push_str("</section>");
    out
}

/// The provider accounts the workers call through, and their admission: the window, calls
/// in flight, attempts started, throttles (429, 529) and calls that waited for room.
pub(super) fn accounts_table(accounts: &[crate::sched::AccountView]) -> String {
    if accounts.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "<h2>Provider accounts</h2><table id=accounts><thead><tr><th>account</th><th>window</th><th>in flight</th><th>started</th><th>throttled</th><th>waited for room</th><th>input tokens/min</th></tr></thead><tbody>",
    );
    for a in accounts {
        out.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&a.id),
            a.window,
            a.in_flight,
            a.started,
            a.throttled,
            a.held,
            if a.itpm == 0 {
                "not paced".to_owned()
            } else {
                a.itpm.to_string()
            }
        ));
    }
    out.push_str("</tbody></table>");
    out
}

/// What raising a run's money budget asks: the new budget, in dollars.
const BUDGET: &str = "<form id=budget-form hidden><label>Money budget, $ <input id=budget-usd type=number step=any min=0 required></label> \
<button type=submit id=budget-go>Raise and go on</button> <button type=button id=budget-cancel>Cancel</button></form>";

/// The answer to a question: its fields are made from the question's schema when its Answer
/// button is pressed.
const ANSWER: &str = "<form id=answer-form hidden><p id=answer-what></p><div id=answer-fields></div>\
<button type=submit id=answer-go>Send answer</button> <button type=button id=answer-cancel>Cancel</button></form>";

/// What a stop or pause asks first: confirmation and a reason (kept in the run's events).
const CONFIRM: &str = "<form id=confirm hidden><p id=confirm-what></p>\
<label>Reason <input id=reason name=reason maxlength=500 required placeholder=\"why (kept in the run's log)\"></label> \
<button type=submit id=confirm-go class=danger>Confirm</button> <button type=button id=confirm-cancel>Cancel</button></form>";

pub(super) const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}\
h1 small,h3 small{color:#888;font-weight:normal;font-size:70%}table{border-collapse:collapse}\
td,th{padding:2px 10px;border-bottom:1px solid #eee;text-align:left}\
pre{background:#f6f6f6;padding:8px;max-height:30em;overflow:auto;white-space:pre-wrap}.err{color:#b00}\
.warn{color:#a60;font-weight:bold}.danger{color:#b00}#notice{color:#06c}\
.st.completed{color:#070}.st.failed,.st.rejected{color:#b00}.st.running{color:#06c}.st.paused,.st.stopping{color:#a60}\
.st.completed.failures{color:#a60;font-weight:bold}\
svg.tl{width:100%;height:auto;background:#fcfcfc;border:1px solid #eee}svg.tl rect{cursor:pointer}\
svg.tl .ok,.k.ok{fill:#4a4;background:#4a4}svg.tl .run,.k.run{fill:#39f;background:#39f}svg.tl .fail,.k.fail{fill:#d33;background:#d33}\
svg.tl .retry,.k.retry{fill:#e90;background:#e90}svg.tl .cancel,.k.cancel{fill:#aaa;background:#aaa}svg.tl .cached,.k.cached{fill:#9c9;background:#9c9}\
svg.tl g:hover rect{stroke:#000;stroke-width:.6}svg.tl .tick{stroke:#eee}svg.tl text{font-size:10px;fill:#666}svg.tl .ph{fill:#222;font-weight:bold}\
.k{display:inline-block;width:10px;height:10px;margin:0 3px 0 10px}.legend{color:#666;font-size:12px}\
.why{color:#a60;font-size:12px}#confirm{border:1px solid #d99;background:#fff6f6;padding:8px;margin:8px 0}#confirm input{width:30em}\
.turns{display:flex;flex-direction:column;gap:6px}.turn{border-left:3px solid #ccc;padding:4px 8px}.turn.said{border-color:#39f}\
.turn .who{font-size:11px;color:#888}.turn .body{white-space:pre-wrap}.turn.tool{border-color:#999}.turn.tool.error{border-color:#d33}\
.turn.end{border-color:#4a4}.turn.end.failed{border-color:#d33}.turn.note{color:#888;font-size:12px}.turn summary{cursor:pointer}\
.turn .label{font-size:11px;color:#888}.turn .state{font-size:11px;color:#888}.facts th{color:#888;font-weight:normal}\
pre.diff{max-height:none}.diff .da{color:#060;background:#e6ffe6}.diff .dr{color:#a00;background:#ffecec}\
.diff .dk{color:#06c}.diff .dh{font-weight:bold}.diff .df{font-weight:bold;color:#444}\
.crumbs{color:#888}.filters input,.filters select{margin-right:6px}.pager{margin:8px 0}";

/// The page's script: follows the run over server-sent events (the server sends the changing
/// part of the page as HTML), opens an agent's page from its bar on the timeline, and sends the
/// buttons' actions to the same control path the CLI uses — stop and pause only once the
/// reader confirmed and gave a reason.
pub(super) const SCRIPT: &str = r#"const run=document.body.dataset.run;
async function act(action,agent,reason,usd){const r=await fetch('/runs/'+run+'/control',{method:'POST',credentials:'same-origin',
headers:{'content-type':'application/json','x-flotilla':'1'},body:JSON.stringify({action:action,agent:agent||'',reason:reason||'',usd:usd})});
const v=await r.json();document.getElementById('notice').textContent=v.message||v.error;}
function ask(b){const f=document.getElementById('confirm'),r=document.getElementById('reason');
document.getElementById('confirm-what').textContent=b.dataset.ask;r.value='';f.hidden=false;r.focus();
f.onsubmit=e=>{e.preventDefault();f.hidden=true;act(b.dataset.action,b.dataset.target,r.value);};}
function raise(){const f=document.getElementById('budget-form'),u=document.getElementById('budget-usd');
u.value='';f.hidden=false;u.focus();f.onsubmit=e=>{e.preventDefault();f.hidden=true;act('budget','','',Number(u.value));};}
function opt(e,v,t){const o=document.createElement('option');o.value=v;o.textContent=t;e.appendChild(o);}
function field(s){const t=s&&s.type;let e;
if(s&&Array.isArray(s.enum)){e=document.createElement('select');s.enum.forEach(v=>opt(e,JSON.stringify(v),typeof v==='string'?v:JSON.stringify(v)));e.get=()=>JSON.parse(e.value);}
else if(t==='boolean'){e=document.createElement('select');opt(e,'true','yes');opt(e,'false','no');e.get=()=>e.value==='true';}
else if(t==='number'||t==='integer'){e=document.createElement('input');e.type='number';e.step=t==='integer'?'1':'any';e.get=()=>e.value===''?undefined:Number(e.value);}
else if(!s||t==='string'){e=document.createElement('textarea');e.rows=2;e.get=()=>e.value;}
else{e=document.createElement('textarea');e.rows=4;e.placeholder='JSON';e.get=()=>JSON.parse(e.value);}
return e;}
function answer(b){const f=document.getElementById('answer-form'),box=document.getElementById('answer-fields');
const s=b.dataset.schema?JSON.parse(b.dataset.schema):null;document.getElementById('answer-what').textContent=b.dataset.answer+': '+b.dataset.text;
box.innerHTML='';let get;
if(s&&s.type==='object'&&s.properties){const fs={},req=s.required||[];Object.keys(s.properties).forEach(k=>{const l=document.createElement('label');
l.textContent=k+(req.includes(k)?' * ':' ');const e=field(s.properties[k]);e.name=k;l.appendChild(e);box.appendChild(l);box.appendChild(document.createElement('br'));fs[k]=e;});
get=()=>{const o={};for(const k in fs){const v=fs[k].get();if(req.includes(k)||(v!==undefined&&v!==''))o[k]=v;}return o;};}
else{const e=field(s);e.name='answer';box.appendChild(e);get=()=>e.get();}
f.hidden=false;f.onsubmit=async e=>{e.preventDefault();let v;try{v=get();}catch(x){document.getElementById('notice').textContent='the answer is not JSON: '+x.message;return;}
const r=await fetch('/runs/'+run+'/control',{method:'POST',credentials:'same-origin',headers:{'content-type':'application/json','x-flotilla':'1'},
body:JSON.stringify({action:'answer',question:b.dataset.answer,answer:v===undefined?null:v})});
const j=await r.json();document.getElementById('notice').textContent=j.message||j.error;if(r.ok)f.hidden=true;};}
function bind(){document.querySelectorAll('[data-action]').forEach(b=>b.onclick=()=>b.dataset.budget?raise():b.dataset.ask?ask(b):act(b.dataset.action,b.dataset.target,''));
document.querySelectorAll('[data-answer]').forEach(b=>b.onclick=()=>answer(b));}
function show(html){document.getElementById('live').innerHTML=html;bind();}
const live=document.getElementById('live');
if(live)live.addEventListener('click',e=>{const g=e.target.closest('svg [data-a]');if(g)location.href='/runs/'+run+'/agents/'+g.dataset.a;});
const cancel=document.getElementById('confirm-cancel');if(cancel)cancel.onclick=()=>{document.getElementById('confirm').hidden=true;};
const drop=document.getElementById('answer-cancel');if(drop)drop.onclick=()=>{document.getElementById('answer-form').hidden=true;};
const keep=document.getElementById('budget-cancel');if(keep)keep.onclick=()=>{document.getElementById('budget-form').hidden=true;};
if(run&&document.body.dataset.live==='1'){const es=new EventSource('/runs/'+run+'/events'+location.search);
es.addEventListener('update',e=>show(e.data));es.addEventListener('end',e=>{show(e.data);es.close();});}
bind();"#;

pub(super) fn page(title: &str, body: &str) -> String {
    page_with(title, body, &[])
}

pub(super) fn page_with(title: &str, body: &str, data: &[(&str, &str)]) -> String {
    let attrs: String = data
        .iter()
        .map(|(k, v)| format!(" data-{k}=\"{}\"", esc(v)))
        .collect();
    format!(
        "<!doctype html><html><head><meta charset=utf-8><title>{}</title><style>{STYLE}</style></head>\
         <body{attrs}><nav><a href=\"/runs\">runs</a> · <a href=\"/fleet\">fleet</a></nav>{body}<script>{SCRIPT}</script></body></html>",
        esc(title)
    )
}

/// What the page shows of a run: its summary (what every view says of it), its report (final,
/// or as it stands now with live states) for the agents' rows, and whether it can still
/// change.
pub(super) struct PageData {
    pub(super) summary: Summary,
    pub(super) report: Arc<Report>,
    /// Running on this coordinator (buttons work, updates every half second).
    pub(super) here: bool,
}

impl PageData {
    pub(super) fn live(&self) -> bool {
        !self.summary.status.is_final()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::TokenKey;
    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use std::time::Duration;

    fn agent(index: u64, status: &str) -> crate::report::AgentReport {
        crate::report::AgentReport {
            label: format!("a{index}"),
            group: "G".into(),
            status: serde_json::from_value(serde_json::json!(status)).expect("a status"),
            attempts: 1,
            cached: false,
            start_ms: Some(index),
            end_ms: None,
            error: None,
            index,
            key: String::new(),
            model: String::new(),
            input_tokens: 0,
            output_tokens: 0,
            disk_bytes: 0,
            waiting: None,
            cost_usd: 0.0,
            segments: Vec::new(),
            worker: String::new(),
        }
    }

    #[test]
    fn ten_thousand_agents_in_flight_still_make_a_page_of_rows() {
        let all: Vec<_> = (0..12_000u64)
            .map(|i| match i {
                0..1000 => agent(i, "completed"),
                1000..1500 => agent(i, "failed"),
                1500..11_500 => agent(i, "running"),
                _ => agent(i, "queued"),
            })
            .collect();
        let refs: Vec<_> = all.iter().collect();
        let shown = rows_to_show(&refs);
        assert_eq!(shown.len(), PHASE_ROWS);
        for status in ["failed", "running", "completed", "queued"] {
            assert!(shown.iter().any(|a| a.status == status), "{status}");
        }
    }

    #[test]
    fn a_big_phase_lists_running_and_failed_agents_and_says_how_many_it_hides() {
        let all: Vec<_> = (0..1000u64)
            .map(|i| match i {
                500 => agent(i, "failed"),
                600..=615 => agent(i, "running"),
                i if i < 600 => agent(i, "completed"),
                _ => agent(i, "queued"),
            })
            .collect();
        let refs: Vec<_> = all.iter().collect();
        let shown = rows_to_show(&refs);
        assert_eq!(shown.len(), PHASE_ROWS);
        for must in [500, 600, 615] {
            assert!(shown.iter().any(|a| a.index == must), "{must}");
        }
        assert!(shown.iter().any(|a| a.status == "queued"));
        assert!(
            shown.windows(2).all(|w| w[0].index < w[1].index),
            "index order"
        );
        let small: Vec<_> = all.iter().take(10).collect();
        assert_eq!(rows_to_show(&small).len(), 10);

        let report = Report {
            run_id: "wf_x".into(),
            status: RunStatus::Running,
            result: serde_json::Value::Null,
            error: None,
            workflow: Default::default(),
            usage: Default::default(),
            agents: all.clone(),
            groups: vec![crate::report::GroupReport {
                title: "G".into(),
                agents: Vec::new(),
                agents_omitted: 0,
            }],
            logs: Vec::new(),
            failures: Vec::new(),
            script_path: None,
            parent_run_id: None,
            store: None,
            changes: None,
            agents_omitted: 0,
            warnings: Vec::new(),
            notify: None,
            namespace: String::new(),
            questions: Vec::new(),
        };
        let d = PageData {
            summary: Summary::of_report(&report),
            report: Arc::new(report),
            here: true,
        };
        let page = render_live(
            &d,
            View {
                all: false,
                timeline: true,
            },
        );
        assert!(
            page.contains("900 more agents of this phase are not listed"),
            "{page}"
        );
        assert_eq!(page.matches("<tr id=agent-").count(), PHASE_ROWS);
        let full = render_live(
            &d,
            View {
                all: true,
                timeline: true,
            },
        );
        assert_eq!(full.matches("<tr id=agent-").count(), 1000);
        assert!(!full.contains("more agents of this phase"));
        // Restart only where an agent runs; a queued one can only be stopped.
        assert!(full.contains("data-action=restart_agent data-target=600>"));
        assert!(!full.contains("data-action=restart_agent data-target=700>"));
        assert!(full.contains("data-action=stop_agent data-target=700 data-ask="));
        // Stopping asks first; restarting does not.
        assert!(full.contains("data-action=restart_agent data-target=600>"));
        // The timeline draws every started agent, and the rows open each agent's own page.
        assert_eq!(full.matches("<g data-a=").count(), 1000, "each has a start");
        assert!(full.contains("<a href=\"/runs/wf_x/agents/615\""));
    }

    #[test]
    fn tokens_verify_only_with_their_key_and_until_they_expire() {
        let key = TokenKey::derive(b"secret");
        let t = key.issue("alice", Duration::from_secs(60));
        assert_eq!(key.verify(&t).unwrap().sub, "alice");
        assert!(TokenKey::derive(b"other").verify(&t).is_err());
        // A changed body breaks the signature.
        let mut parts: Vec<&str> = t.split('.').collect();
        let forged = URL_SAFE_NO_PAD.encode(br#"{"sub":"mallory","exp":99999999999}"#);
        parts[1] = &forged;
        assert!(key.verify(&parts.join(".")).is_err());
        assert!(key.verify("garbage").is_err());
        let expired = key.issue("alice", Duration::ZERO);
        assert!(key.verify(&expired).unwrap_err().contains("expired"));
    }

    #[test]
    fn the_accounts_table_shows_each_account_s_admission_escaped() {
        assert_eq!(accounts_table(&[]), "", "no account, no table");
        let t = accounts_table(&[crate::sched::AccountView {
            id: "anthropic@<host>#0a1b2c3d".into(),
            window: 14,
            in_flight: 9,
            started: 300,
            throttled: 4,
            held: 120,
            itpm: 400_000,
        }]);
        assert!(t.contains("anthropic@&lt;host&gt;#0a1b2c3d"), "{t}");
        for cell in [
            "<td>14</td>",
            "<td>9</td>",
            "<td>4</td>",
            "<td>120</td>",
            "<td>400000</td>",
        ] {
            assert!(t.contains(cell), "{cell}: {t}");
        }
    }

    #[test]
    fn html_is_escaped() {
        assert_eq!(
            esc("<a href='x'>&\""),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;"
        );
    }
}
