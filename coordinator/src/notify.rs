//! Webhooks: a run launched with `--notify URL` has its end POSTed there, signed, and so is
//! a pause at its money budget.
//!
//! The body is one JSON object (`event: "run.ended"`, the run, its status, error, usage,
//! labels and times; or `event: "run.paused"`, with why and the budget).
//! `X-Flotilla-Event` names the event. The signature is `X-Flotilla-Signature: t=UNIX,v1=HEX`, where HEX is
//! the HMAC-SHA256 of `UNIX.BODY` under the notifier's secret, so a receiver checks both the
//! body and its age. Each delivery has an id (`X-Flotilla-Delivery`) a receiver can use to
//! drop a repeat.
//!
//! A delivery is retried with backoff (1 s, doubling) on a network error, a timeout, 408,
//! 429 or 5xx, up to [`ATTEMPTS`] attempts; any other answer ends it. Addresses that are
//! link-local (cloud metadata services live there) are refused. What happened is recorded as
//! an event of the run and at `runs/{run}/notify.json`, which `show` reports. Deliveries run
//! beside the run's end; [`Notifier::drain`] waits for those still going (a process about to
//! exit).

use flotilla_proto::Problem;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;
use tokio::task::JoinSet;

use crate::report::{Delivery, Report};
use crate::store::records::{EventRecord, RunEvent};
use crate::store::{Store, keys};

/// Attempts per delivery.
pub const ATTEMPTS: u32 = 6;
/// Longest one attempt may take.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
pub use crate::ids::MAX_NOTIFY_URL as MAX_URL;

/// Signs and sends webhooks.
pub struct Notifier {
    key: ring::hmac::Key,
    client: reqwest::Client,
    pending: std::sync::Mutex<JoinSet<()>>,
    /// The outbox keys of the deliveries this process is making now.
    in_flight: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// The first backoff; doubled after each retry.
    backoff: Duration,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Notifier")
    }
}

pub use crate::ids::check_notify_url as check_url;

impl Notifier {
    /// A notifier signing with `secret` (at least 16 bytes).
    pub fn new(secret: &[u8]) -> Result<Notifier, Problem> {
        if secret.len() < 16 {
            return Err(Problem::invalid(
                "the webhook secret must be at least 16 bytes",
            ));
        }
        flotilla_proto::tls::install_crypto_provider();
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(ATTEMPT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| Problem::invalid(format!("cannot make the webhook client: {e}")))?;
        Ok(Notifier {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret),
            client,
            pending: std::sync::Mutex::new(JoinSet::new()),
            in_flight: Arc::default(),
            backoff: Duration::from_secs(1),
        })
    }

    /// The signature header's value for `body` sent at `unix`.
    pub fn sign(&self, unix: u64, body: &[u8]) -> String {
        let mut signed = format!("{unix}.").into_bytes();
        signed.extend_from_slice(body);
        let tag = ring::hmac::sign(&self.key, &signed);
        format!("t={unix},v1={}", hex::encode(tag.as_ref()))
    }

    /// Delivers `report`'s end to `url` in the background, then records how it went.
    pub fn spawn(
        self: &Arc<Self>,
        store: Store,
        generation: u64,
        url: String,
        report: &Report,
        labels: &std::collections::BTreeMap<String, String>,
        elapsed_ms: u64,
    ) {
        let body = json!({
            "event": "run.ended",
            "run_id": report.run_id,
            "workflow": report.workflow.name,
            "status": report.status.as_str(),
            "error": report.error,
            "usage": {
                "agents": report.usage.agents,
                "attempts": report.usage.attempts,
                "errors": report.usage.errors,
                "input_tokens": report.usage.input_tokens,
                "output_tokens": report.usage.output_tokens,
                "cost_usd": report.usage.cost_usd,
                "duration_ms": report.usage.duration_ms,
            },
            "labels": labels,
            "parent_run_id": report.parent_run_id,
        });
        let run = report.run_id.clone();
        let letter = Letter {
            delivery: format!(
                "{run}-{}",
                crate::ids::new_run_id().trim_start_matches("wf_")
            ),
            run_id: run,
            url,
            generation,
            elapsed_ms,
            body,
        };
        self.send(store, letter, true);
    }

    /// Announces that run `run_id` is paused at its money budget or its namespace's daily
    /// quota (`why`, as its status says it; `reason`: `money_budget` or `namespace_quota`), in
    /// the background; kept in the outbox until delivered, like the end.
    #[allow(clippy::too_many_arguments)]
    pub fn spawn_paused(
        self: &Arc<Self>,
        store: Store,
        (generation, elapsed_ms): (u64, u64),
        url: String,
        (run_id, workflow): (&str, &str),
        (why, reason): (&str, &str),
        (cost_usd, budget_usd): (f64, Option<f64>),
        labels: &std::collections::BTreeMap<String, String>,
    ) {
        let body = json!({
            "event": "run.paused",
            "run_id": run_id,
            "workflow": workflow,
            "status": "paused",
            "reason": reason,
            "waiting": why,
            "usage": { "cost_usd": cost_usd },
            "budget_usd": budget_usd,
            "labels": labels,
        });
        self.send_during(store, (generation, elapsed_ms), url, run_id, body);
    }

    /// Announces that run `run_id` asks a question (`ask()`): its id, text, schema and
    /// deadline, the run's page (`page`) and the command that answers it.
    #[allow(clippy::too_many_arguments)]
    pub fn spawn_question(
        self: &Arc<Self>,
        store: Store,
        (generation, elapsed_ms): (u64, u64),
        url: String,
        (run_id, workflow): (&str, &str),
        q: &crate::store::records::QuestionRecord,
        page: Option<String>,
        labels: &std::collections::BTreeMap<String, String>,
    ) {
        let body = json!({
            "event": "run.question",
            "run_id": run_id,
            "workflow": workflow,
            "question": {
                "id": q.id,
                "question": q.question,
                "label": q.label,
                "schema": q.schema,
                "asked_at": q.asked_at,
                "deadline": q.deadline,
            },
            "url": page,
            "answer": format!("flotilla answer {run_id} --question {} --json VALUE", q.id),
            "labels": labels,
        });
        self.send_during(store, (generation, elapsed_ms), url, run_id, body);
    }

    /// Sends a webhook of a run's life before its end, under a delivery id of its own.
    fn send_during(
        self: &Arc<Self>,
        store: Store,
        (generation, elapsed_ms): (u64, u64),
        url: String,
        run_id: &str,
        body: serde_json::Value,
    ) {
        let letter = Letter {
            delivery: format!(
                "{run_id}-{}",
                crate::ids::new_run_id().trim_start_matches("wf_")
            ),
            run_id: run_id.to_owned(),
            url,
            generation,
            elapsed_ms,
            body,
        };
        self.send(store, letter, true);
    }

    /// Delivers `letter` in the background; `new`: it is kept in the outbox first, so a
    /// coordinator that restarts before it is done sends it then ([`Notifier::resume`]).
    fn send(self: &Arc<Self>, store: Store, letter: Letter, new: bool) {
        {
            let mut flying = self
                .in_flight
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if !flying.insert(letter.outbox().to_string()) {
                return;
            }
        }
        let me = self.clone();
        let mut pending = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Finished deliveries are reaped here, so the set holds only those still going.
        while pending.try_join_next().is_some() {}
        pending.spawn(async move {
            let key = letter.outbox();
            if new {
                let body = serde_json::to_vec(&letter).unwrap_or_default();
                if let Err(e) = store.put_overwrite(&key, Bytes::from(body)).await {
                    tracing::warn!(run = %letter.run_id, error = %e, "cannot keep the webhook in the outbox; it is sent, but not again after a restart");
                }
            }
            let body = serde_json::to_vec(&letter.body).unwrap_or_default();
            let delivery = me
                .deliver(&letter.url, (&letter.delivery, letter.event()), &body)
                .await;
            if letter.ends() {
                record(&store, &letter.run_id, letter.generation, letter.elapsed_ms, &delivery).await;
            } else if !delivery.delivered {
                tracing::warn!(run = %letter.run_id, event = letter.event(), url = %delivery.url, error = ?delivery.error, "webhook not delivered");
            }
            if let Err(e) = store.delete(&key).await {
                tracing::warn!(run = %letter.run_id, error = %e, "cannot take the webhook out of the outbox");
            }
            me.in_flight
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(key.as_ref());
        });
    }

    /// Sends what the outbox holds that this process is not sending already: deliveries a
    /// coordinator that stopped or died did not finish. How many it took up.
    pub async fn resume(self: &Arc<Self>, store: &Store) -> Result<usize, crate::store::Error> {
        let mut n = 0;
        for key in store.list_objects(&keys::notify_outboxes()).await? {
            let Some(body) = store.get(&key).await? else {
                continue;
            };
            let Ok(letter) = serde_json::from_slice::<Letter>(&body) else {
                tracing::warn!(key = %key, "an unreadable webhook in the outbox; dropping it");
                let _ = store.delete(&key).await;
                continue;
            };
            tracing::info!(run = %letter.run_id, "sending a webhook an earlier coordinator did not finish");
            self.send(store.clone(), letter, false);
            n += 1;
        }
        Ok(n)
    }

    /// Waits (at most `limit`) for the deliveries still going.
    pub async fn drain(&self, limit: Duration) {
        let mut set = std::mem::take(
            &mut *self
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let _ =
            tokio::time::timeout(limit, async { while set.join_next().await.is_some() {} }).await;
    }

    async fn deliver(&self, url: &str, (id, event): (&str, &str), body: &[u8]) -> Delivery {
        let mut out = Delivery {
            url: url.to_owned(),
            delivered: false,
            attempts: 0,
            status: None,
            error: None,
            at: String::new(),
        };
        let mut wait = self.backoff;
        for attempt in 1..=ATTEMPTS {
            out.attempts = attempt;
            out.at = humantime::format_rfc3339_seconds(flotilla_proto::clock::now()).to_string();
            if let Err(e) = not_link_local(url).await {
                out.error = Some(e.into());
                return out;
            }
            let unix = flotilla_proto::clock::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let sent = self
                .client
                .post(url)
                .header("content-type", "application/json")
                .header(
                    "user-agent",
                    concat!("flotilla/", env!("CARGO_PKG_VERSION")),
                )
                .header("x-flotilla-event", event)
                .header("x-flotilla-delivery", id)
                .header("x-flotilla-signature", self.sign(unix, body))
                .body(body.to_vec())
                .send()
                .await;
            let retry = match sent {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    out.status = Some(status);
                    if resp.status().is_success() {
                        out.delivered = true;
                        out.error = None;
                        return out;
                    }
                    out.error = Some(format!("the receiver answered HTTP {status}"));
                    status == 408 || status == 429 || status >= 500
                }
                Err(e) => {
                    out.error = Some(format!(
                        "cannot reach the receiver: {}",
                        flotilla_proto::tls::error_chain(&e)
                    ));
                    true
                }
            };
            if !retry || attempt == ATTEMPTS {
                break;
            }
            tokio::time::sleep(wait).await;
            wait = wait.saturating_mul(2);
        }
        out
    }
}

/// A delivery to make: what it sends, where, and under which id (kept in the outbox until it
/// is done).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Letter {
    run_id: String,
    url: String,
    delivery: String,
    generation: u64,
    elapsed_ms: u64,
    body: serde_json::Value,
}

impl Letter {
    /// What it announces (`run.ended`, `run.paused`).
    fn event(&self) -> &str {
        self.body["event"].as_str().unwrap_or("run.ended")
    }

    /// Whether it is the run's end (recorded with the run, one per run).
    fn ends(&self) -> bool {
        self.event() == "run.ended"
    }

    /// Where it waits until delivered.
    fn outbox(&self) -> object_store::path::Path {
        if self.ends() {
            keys::notify_outbox(&self.run_id)
        } else {
            keys::notify_outbox_delivery(&self.delivery)
        }
    }
}

/// Refuses a URL whose host is, or resolves to, a link-local address (169.254.0.0/16,
/// fe80::/10), where cloud metadata services answer.
async fn not_link_local(url: &str) -> Result<(), Problem> {
    let parsed = reqwest::Url::parse(url).map_err(|e| Problem::invalid(e.to_string()))?;
    let host = parsed
        .host_str()
        .unwrap_or_default()
        .trim_matches(['[', ']']);
    let port = parsed.port_or_known_default().unwrap_or(443);
    let addrs: Vec<IpAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![ip],
        Err(_) => tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| Problem::invalid(format!("cannot resolve {host}: {e}")))?
            .map(|a| a.ip())
            .collect(),
    };
    let link_local = |ip: &IpAddr| match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    };
    if addrs.iter().any(link_local) {
        return Err(Problem::invalid(format!(
            "{host} is a link-local address; webhooks are not sent there"
        )));
    }
    Ok(())
}

/// Records a delivery: an event of the run, and `runs/{run}/notify.json`.
async fn record(store: &Store, run: &str, generation: u64, elapsed_ms: u64, d: &Delivery) {
    let event = EventRecord {
        t: elapsed_ms,
        event: RunEvent::Notified {
            url: d.url.clone(),
            delivered: d.delivered,
            attempts: d.attempts,
            status: d.status,
            error: d.error.clone(),
        },
    };
    let mut line = serde_json::to_vec(&event).unwrap_or_default();
    line.push(b'\n');
    // After every segment of the run's own event log.
    let seg = keys::events_segment(run, generation, 99_999_999);
    if let Err(e) = store.put_overwrite(&seg, Bytes::from(line)).await {
        tracing::warn!(run, error = %e, "cannot record the webhook delivery as an event");
    }
    let body = serde_json::to_vec_pretty(d).unwrap_or_default();
    if let Err(e) = store
        .put_overwrite(&keys::notify(run), Bytes::from(body))
        .await
    {
        tracing::warn!(run, error = %e, "cannot record the webhook delivery");
    }
    if d.delivered {
        tracing::info!(run, url = %d.url, attempts = d.attempts, "webhook delivered");
    } else {
        tracing::warn!(run, url = %d.url, attempts = d.attempts, error = ?d.error, "webhook not delivered");
    }
}

/// A stored run's delivery record, if it has one.
pub async fn stored(store: &Store, run: &str) -> Option<Delivery> {
    let body = store.get(&keys::notify(run)).await.ok()??;
    serde_json::from_slice(&body).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_and_signatures_cover_time_and_body() {
        assert!(check_url("https://hooks.example/x").is_ok());
        assert!(check_url("http://127.0.0.1:9/x").is_ok());
        for bad in [
            "ftp://x/y",
            "not a url",
            "https://user:pw@hooks.example/",
            "file:///etc/passwd",
        ] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
        assert!(check_url(&format!("https://h/{}", "a".repeat(MAX_URL))).is_err());
        let n = Notifier::new(b"0123456789abcdef").unwrap();
        let a = n.sign(100, b"{}");
        assert!(a.starts_with("t=100,v1="), "{a}");
        assert_ne!(a, n.sign(101, b"{}"));
        assert_ne!(a, n.sign(100, b"{ }"));
        assert!(Notifier::new(b"short").is_err());
    }
}
