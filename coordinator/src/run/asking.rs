//! The run's half of `ask()` (`ask.rs` keeps the questions and their store): a question the
//! script asks becomes an open question — or is answered at once from the run it resumes,
//! or from this run's own store (a replay) —, an answer from outside is checked and stored,
//! and only a stored answer settles the script's promise.

use std::sync::atomic::Ordering;
use std::time::Duration;

use flotilla_proto::Problem;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::ask::{self, AskEvent, AskOpts, Reply};
use super::{Parked, RunEngine};
use crate::reject::RejectCode;
use crate::script::{HostReply, ScriptOp};
use crate::store::records::{AnswerRecord, QuestionRecord, RunEvent};

/// How long a parked run's script is given to end.
const PARK_GRACE: Duration = Duration::from_secs(5);

impl RunEngine {
    /// `ask(question, opts)` from the script.
    pub(super) fn on_ask(&mut self, promise: u64, question: String, opts_json: &str) {
        let opts: AskOpts = match serde_json::from_str(opts_json) {
            Ok(o) => o,
            Err(e) => {
                return self.reject(
                    promise,
                    RejectCode::InvalidOption,
                    format!("ask() options: {e}"),
                );
            }
        };
        // Any JSON Schema: an answer need not be an object, as an agent's result must.
        let validator = match opts
            .schema
            .as_ref()
            .map(flotilla_proto::schema::Validator::new)
        {
            Some(Err(e)) => {
                return self.reject(
                    promise,
                    RejectCode::SchemaInvalid,
                    format!("ask() schema: {e}"),
                );
            }
            Some(Ok(v)) => Some(v),
            None => None,
        };
        let (key, id) = self.asks.next_key(&question, opts.schema.as_ref());
        let now = flotilla_proto::clock::now();
        let deadline = opts.timeout_ms.map(|ms| now + Duration::from_millis(ms));
        let record = QuestionRecord {
            id: id.clone(),
            key: key.clone(),
            question,
            label: opts.label.unwrap_or_default(),
            schema: opts.schema,
            asked_at: ask::rfc3339(now),
            deadline: deadline.map(ask::rfc3339),
        };
        let served = self.init.resume.as_ref().and_then(|r| {
            r.answer(&key).map(|a| AnswerRecord {
                answered_in: a.answered_in.clone().or_else(|| Some(r.run_id.clone())),
                ..a.clone()
            })
        });
        self.asks
            .open_question(promise, record.clone(), validator, served.is_some());
        let (store, run, events) = (
            self.init.store.clone(),
            self.init.run_id.clone(),
            self.asks.events(),
        );
        if let Some(answer) = served {
            // Kept in this run too, so its own resume or adopter finds it here.
            self.init
                .tasks
                .spawn_until_stopped(ask::store_answer(store, run, answer, None, events));
            return;
        }
        self.init
            .tasks
            .spawn_until_stopped(ask::store_question(store, run, record, events));
    }

    pub(super) fn on_ask_event(&mut self, ev: AskEvent) {
        self.dirty = true;
        match ev {
            AskEvent::Asked { record, created } => {
                // Said when it is asked first (a replay that finds it open says nothing new).
                if created {
                    self.note(format!(
                        "[ask] {} {}: answer with `flotilla answer {} --question {} --json VALUE`",
                        record.id,
                        ask::quote(&record.question),
                        self.init.run_id,
                        record.id
                    ));
                    self.announce(&record);
                }
                self.asks.asked_first(record);
            }
            AskEvent::Answered { record, reply } => self.answered(record, reply),
            AskEvent::NotStored { id, problem, reply } => {
                self.asks.not_stored(&id);
                tracing::warn!(run = %self.run, question = %id, error = %problem, "an answer was not stored");
                if let Some(r) = reply {
                    let _ = r.send(Err(problem));
                }
            }
            AskEvent::Found(records) => {
                self.asks.looked();
                for r in records {
                    self.answered(r, None);
                }
            }
        }
    }

    /// An answer stands: the script gets it, and the question is closed.
    fn answered(&mut self, record: AnswerRecord, reply: Option<(Reply, Result<String, Problem>)>) {
        let Some(promise) = self.asks.close(&record) else {
            if let Some((r, _)) = reply {
                let _ = r.send(Err(Problem::new(
                    flotilla_proto::ErrorKind::Conflict,
                    format!("{} of {} was answered already", record.id, self.run),
                )));
            }
            return;
        };
        let line = if record.timed_out {
            format!("[ask] {} timed out unanswered: ask() gives null", record.id)
        } else if let Some(from) = &record.answered_in {
            format!("[ask] {} answered in {from} by {}", record.id, record.by)
        } else {
            format!("[ask] {} answered by {}", record.id, record.by)
        };
        self.note(line);
        (self.reply)(HostReply::Agent {
            id: promise,
            result: Ok(record.value.to_string()),
        });
        if let Some((r, said)) = reply {
            let _ = r.send(said);
        }
    }

    /// An answer from outside (`flotilla answer`, the page, `WorkflowAnswer`).
    pub(super) fn answer(
        &mut self,
        question: Option<String>,
        value: Value,
        by: String,
        reply: Reply,
    ) {
        match self.asks.answering(&self.init.run_id, question, value, by) {
            Err(p) => {
                let _ = reply.send(Err(p));
            }
            Ok(record) => {
                let (store, run, events) = (
                    self.init.store.clone(),
                    self.init.run_id.clone(),
                    self.asks.events(),
                );
                self.init.tasks.spawn_until_stopped(ask::store_answer(
                    store,
                    run,
                    record,
                    Some(reply),
                    events,
                ));
            }
        }
    }

    /// Each tick: questions past their deadline end `null`; a run that takes answers from its
    /// store looks there.
    pub(super) fn ask_tick(&mut self) {
        if !self.asks.any_open() {
            return;
        }
        for record in self.asks.due(flotilla_proto::clock::now()) {
            let (store, run, events) = (
                self.init.store.clone(),
                self.init.run_id.clone(),
                self.asks.events(),
            );
            self.init
                .tasks
                .spawn_until_stopped(ask::store_answer(store, run, record, None, events));
        }
        if self.init.answers_from_store
            && let Some(open) = self.asks.look_for()
        {
            let (store, run, events) = (
                self.init.store.clone(),
                self.init.run_id.clone(),
                self.asks.events(),
            );
            self.init
                .tasks
                .spawn_until_stopped(ask::look_for_answers(store, run, open, events));
        }
    }

    /// Whether the run has waited on its questions alone long enough to be parked: questions
    /// open with no answer on its way, every agent ended and journaled, not held or stopping,
    /// and its script waiting with every op it sent read.
    pub(super) fn park_due(&mut self, ops: &mpsc::UnboundedReceiver<ScriptOp>) -> bool {
        let Some(after) = self.init.park_after else {
            return false;
        };
        let idle = self.asks.only_waiting()
            && self.book.all_settled()
            && !self.stopping
            && self.held.is_none()
            && self.quota_held.is_none()
            && self.init.shared.waiting.load(Ordering::Acquire)
            && ops.is_empty();
        if !idle {
            self.idle_since = None;
            return false;
        }
        let since = *self.idle_since.get_or_insert_with(Instant::now);
        since.elapsed() >= after
    }

    /// Parks the run: its script goes (a replay brings it back to where it waits), its
    /// writers finish, and what wakes it is handed back with the owner records it holds.
    pub(super) async fn park(
        mut self,
        mut ops: mpsc::UnboundedReceiver<ScriptOp>,
        applied_rx: &mut mpsc::UnboundedReceiver<crate::head::Applied>,
        controls: mpsc::UnboundedReceiver<super::Control>,
    ) -> Parked {
        (self.reply)(HostReply::Stop);
        let _ = tokio::time::timeout(PARK_GRACE, async {
            while let Some(op) = ops.recv().await {
                if matches!(op, ScriptOp::Finished(_)) {
                    break;
                }
            }
        })
        .await;
        self.init.dispatch.close_run(&self.run);
        if self.head.take().is_some() {
            while let Some(a) = applied_rx.recv().await {
                self.on_applied(a);
            }
        }
        if let Some(mut journal) = self.journal.take() {
            journal.close().await;
        }
        self.transcripts.close().await;
        let line = "[ask] the run waits on its questions alone: parked (its script set aside, no agent running) until an answer or a question's deadline wakes it".to_owned();
        self.logs.push(line.clone());
        self.event(RunEvent::Log { line });
        self.events.close().await;
        self.waiting = self
            .asks
            .waiting(&self.init.run_id)
            .map(|w| format!("parked, {w}"));
        self.dirty = true;
        self.publish();
        tracing::info!(run = %self.run, "parked while it waits for answers");
        Parked {
            run_id: self.init.run_id.clone(),
            deadline: self.asks.earliest_deadline(),
            owners: std::mem::take(&mut self.init.owners),
            controls,
        }
    }

    /// Tells the run's webhook that it asks something.
    fn announce(&self, q: &QuestionRecord) {
        let (Some(url), Some(n)) = (&self.init.settings.notify, &self.init.notifier) else {
            return;
        };
        let page = self
            .init
            .page_base
            .as_deref()
            .map(|b| format!("{}/runs/{}", b.trim_end_matches('/'), self.init.run_id));
        n.spawn_question(
            self.init.store.clone(),
            (self.init.generation, self.now_ms()),
            url.clone(),
            (&self.init.run_id, &self.init.workflow.name),
            q,
            page,
            &self.init.settings.labels,
        );
    }
}
