//! `/fleet`: the workers (labels, backends, slots in use, attempts, when last heard), the
//! provider accounts (window, in flight, throttles) and the namespaces the reader's sign-in
//! shows (what they run and queue, their daily use against their quotas).

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{Html, IntoResponse, Response};

use super::auth::{check, refuse};
use super::render::{accounts_table, esc, page};
use super::state::Web;
use crate::namespace::{QuotaView, Scope};
use crate::sched::{NamespaceView, WorkerView};

pub(super) async fn fleet_page(State(web): State<Web>, headers: HeaderMap) -> Response {
    let scope = match check(&web, &headers) {
        Ok(s) => s,
        Err(why) => return refuse(why, false),
    };
    let workers = web.coordinator.dispatch().workers().await;
    let stats = web.coordinator.dispatch().stats().await.unwrap_or_default();
    let quotas = web
        .coordinator
        .quotas()
        .map(|q| q.views())
        .unwrap_or_default();
    let mut body = String::from("<h1>Fleet</h1>");
    body.push_str(&workers_table(&workers));
    body.push_str(&accounts_table(&stats.accounts));
    body.push_str(&namespaces_table(&scope, &stats.namespaces, &quotas));
    Html(page("Fleet", &body)).into_response()
}

fn workers_table(workers: &[WorkerView]) -> String {
    let slots: u32 = workers.iter().map(|w| w.slots).sum();
    let busy: u32 = workers.iter().map(|w| w.busy).sum();
    let mut out = format!(
        "<h2>Workers <small>{} · {busy} of {slots} slots in use</small></h2>",
        workers.len()
    );
    if workers.is_empty() {
        out.push_str("<p class=note id=no-workers>no worker is attached: start one with <code>flotilla worker --coordinator …</code></p>");
        return out;
    }
    out.push_str(
        "<table id=workers><thead><tr><th>worker</th><th>state</th><th>slots used</th><th>attempts</th><th>last heard</th><th>backends</th><th>models</th><th>labels</th></tr></thead><tbody>",
    );
    for w in workers {
        let labels: Vec<String> = w.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        out.push_str(&format!(
            "<tr id=\"worker-{name}\"><td>{name}</td><td class=\"st {cls}\">{state}</td><td>{busy} / {slots}</td><td>{attempts}</td><td>{heard}s ago</td><td>{backends}</td><td>{models}</td><td>{labels}</td></tr>",
            name = esc(&w.name),
            cls = if w.attached { "completed" } else { "failed" },
            state = if w.attached { "attached" } else { "cut off" },
            busy = w.busy,
            slots = w.slots,
            attempts = w.attempts,
            heard = w.heard_secs_ago,
            backends = esc(&w.backends.join(", ")),
            models = esc(&w.models.join(", ")),
            labels = esc(&labels.join(", ")),
        ));
    }
    out.push_str("</tbody></table>");
    out
}

/// The namespaces `scope` shows: runs, agents running and queued, weight and cap, and today's
/// use against each daily quota.
fn namespaces_table(scope: &Scope, live: &[NamespaceView], quotas: &[QuotaView]) -> String {
    let mut names: Vec<&str> = live
        .iter()
        .map(|n| n.name.as_str())
        .chain(quotas.iter().map(|q| q.namespace.as_str()))
        .filter(|n| scope.may(n))
        .collect();
    names.sort_unstable();
    names.dedup();
    if names.is_empty() {
        return String::new();
    }
    let against = |used: String, limit: Option<String>| match limit {
        Some(l) => format!("{used} / {l}"),
        None => used,
    };
    let mut out = String::from(
        "<h2>Namespaces</h2><table id=namespaces><thead><tr><th>namespace</th><th>runs</th><th>running</th><th>queued</th><th>weight</th><th>agents today</th><th>tokens today</th><th>cost today</th></tr></thead><tbody>",
    );
    for name in names {
        let l = live.iter().find(|n| n.name == name);
        let q = quotas.iter().find(|q| q.namespace == name);
        let (agents, tokens, cost) = match q {
            Some(q) => (
                against(
                    q.used.agents.to_string(),
                    q.policy.agents_per_day.map(|n| n.to_string()),
                ),
                against(
                    q.used.tokens.to_string(),
                    q.policy.tokens_per_day.map(|n| n.to_string()),
                ),
                against(
                    format!("${:.4}", q.used.cost_usd),
                    q.policy.usd_per_day.map(|n| format!("${n:.2}")),
                ),
            ),
            None => (String::new(), String::new(), String::new()),
        };
        out.push_str(&format!(
            "<tr id=\"ns-{n}\"><td>{n}</td><td>{runs}</td><td>{running}</td><td>{queued}</td><td>{weight}</td><td>{agents}</td><td>{tokens}</td><td>{cost}</td></tr>",
            n = esc(name),
            runs = l.map_or(0, |l| l.runs),
            running = l.map_or(0, |l| l.running),
            queued = l.map_or(0, |l| l.queued),
            weight = l.map_or(String::new(), |l| match l.max_agents {
                Some(m) => format!("{} (at most {m} agents)", l.weight),
                None => l.weight.to_string(),
            }),
        ));
    }
    out.push_str("</tbody></table>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_namespaces_table_shows_only_the_readers_namespaces() {
        let live = vec![
            NamespaceView {
                name: "team-a".into(),
                weight: 2,
                max_agents: Some(10),
                runs: 1,
                running: 3,
                queued: 4,
            },
            NamespaceView {
                name: "team-b".into(),
                weight: 1,
                max_agents: None,
                runs: 5,
                running: 6,
                queued: 7,
            },
        ];
        let t = namespaces_table(&Scope::from_organisation(Some("team-a")), &live, &[]);
        assert!(t.contains("id=\"ns-team-a\""), "{t}");
        assert!(!t.contains("team-b"), "another namespace's figures: {t}");
        assert!(t.contains("2 (at most 10 agents)"));
        let all = namespaces_table(&Scope::All, &live, &[]);
        assert!(all.contains("team-b"));
        assert_eq!(
            namespaces_table(&Scope::from_organisation(Some("nobody")), &live, &[]),
            ""
        );
    }

    #[test]
    fn a_worker_row_says_its_state_slots_attempts_and_labels_escaped() {
        let t = workers_table(&[WorkerView {
            name: "w<1>".into(),
            attached: false,
            slots: 8,
            busy: 3,
            backends: vec!["echo".into()],
            models: vec![],
            labels: [("zone".to_owned(), "a&b".to_owned())].into(),
            attempts: 42,
            heard_secs_ago: 7,
        }]);
        for want in [
            "w&lt;1&gt;",
            "cut off",
            "3 / 8",
            "<td>42</td>",
            "7s ago",
            "zone=a&amp;b",
        ] {
            assert!(t.contains(want), "{want}: {t}");
        }
        assert!(workers_table(&[]).contains("no worker is attached"));
    }
}
