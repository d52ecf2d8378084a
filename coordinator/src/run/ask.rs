//! `ask()`, an extension of the dialect: the script waits for a person's answer.
//!
//! A question is never dispatched: it is a promise of the script, a small record in the
//! engine and two objects in the store — `runs/{run}/questions/{id}.json` (what was asked,
//! when, and its deadline) and `runs/{run}/answers/{id}.json` (the answer, written once: the
//! first one wins). Its id comes from its content key (question, schema, occurrence), so a
//! replay asks the same question under the same id: an adopting coordinator, a restarted
//! `flotilla run` and a resume find the stored answer and do not ask again, and a replay keeps
//! the first ask's time and deadline. The script sees an answer only once it is stored.
//!
//! Answers come through [`Control::Answer`] (the `Control` RPC, the page, `WorkflowAnswer`),
//! checked against the schema (a wrong one is refused with the reason, and the question stays
//! open); an embedded run also picks up answers `flotilla answer` writes into its store. A
//! question past its deadline is answered `null` (by `timeout`), the same way on every path.

use super::*;
use crate::store::records::{AnswerRecord, Question, QuestionRecord};
use flotilla_proto::{ErrorKind, Problem};
use std::time::SystemTime;

/// How often a run that takes answers from its store looks there while a question is open.
const POLL_EVERY: Duration = Duration::from_secs(1);
/// How much of a question a log line quotes.
const QUOTED: usize = 160;

/// Where the answer to a control goes.
pub(super) type Reply = oneshot::Sender<Result<String, Problem>>;

/// What the engine's store tasks for questions report back.
#[derive(Debug)]
pub enum AskEvent {
    /// The stored record of a question just asked (the first ask's, for a replay), and
    /// whether this engine stored it.
    Asked {
        record: QuestionRecord,
        created: bool,
    },
    /// An answer is stored: written here, or found there. `reply` goes to who answered.
    Answered {
        record: AnswerRecord,
        reply: Option<(Reply, Result<String, Problem>)>,
    },
    /// An answer could not be stored; the question stays open.
    NotStored {
        id: String,
        problem: Problem,
        reply: Option<Reply>,
    },
    /// A look into the store ended with these answers to open questions.
    Found(Vec<AnswerRecord>),
}

/// An open question.
struct Open {
    promise: u64,
    deadline: Option<SystemTime>,
    validator: Option<flotilla_proto::schema::Validator>,
    /// An answer (or its timeout) is being written.
    writing: bool,
}

/// The run's questions.
pub(super) struct Asks {
    occurrences: HashMap<String, u32>,
    /// Every question asked, in order, with its answer once it has one.
    asked: Vec<Question>,
    open: HashMap<String, Open>,
    events: mpsc::UnboundedSender<AskEvent>,
    polling: bool,
    last_poll: Option<Instant>,
}

impl Asks {
    pub(super) fn new() -> (Asks, mpsc::UnboundedReceiver<AskEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let asks = Asks {
            occurrences: HashMap::new(),
            asked: Vec::new(),
            open: HashMap::new(),
            events: tx,
            polling: false,
            last_poll: None,
        };
        (asks, rx)
    }

    /// The open questions, in the order asked.
    pub(super) fn open(&self) -> Vec<QuestionRecord> {
        self.asked
            .iter()
            .filter(|q| q.answer.is_none())
            .map(|q| q.asked.clone())
            .collect()
    }

    /// Every question with its answer, for the report.
    pub(super) fn all(&self) -> Vec<Question> {
        self.asked.clone()
    }

    /// Why the run waits, when nothing else runs and questions are open.
    pub(super) fn waiting(&self, run: &str) -> Option<String> {
        let open = self.open();
        match open.as_slice() {
            [] => None,
            [q] => Some(format!(
                "waiting for an answer to {} ({}): `flotilla answer {run} --json VALUE`",
                q.id,
                quote(&q.question)
            )),
            many => Some(format!(
                "waiting for answers to {} questions ({}): `flotilla answer {run} --question ID --json VALUE`",
                many.len(),
                many.iter()
                    .map(|q| q.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    fn entry(&mut self, id: &str) -> Option<&mut Question> {
        self.asked.iter_mut().find(|q| q.asked.id == id)
    }
}

/// The question shortened for a log line, quoted.
fn quote(q: &str) -> String {
    let one: String = q.split_whitespace().collect::<Vec<_>>().join(" ");
    let cut: String = one.chars().take(QUOTED).collect();
    if cut.len() < one.len() {
        format!("“{cut}…”")
    } else {
        format!("“{cut}”")
    }
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// `ask()`'s options as the prelude sends them.
#[derive(serde::Deserialize)]
struct AskOpts {
    #[serde(default)]
    schema: Option<Value>,
    #[serde(default, rename = "timeoutMs")]
    timeout_ms: Option<u64>,
    #[serde(default)]
    label: Option<String>,
}

/// The content key of a question (its text and schema; not its label or timeout, so
/// changing those does not ask again) and its id.
pub fn question_key(question: &str, schema: Option<&Value>, occurrence: u32) -> (String, String) {
    use sha2::{Digest, Sha256};
    let content =
        serde_json::json!({ "question": question, "schema": schema.map(crate::spec::canonical) });
    let hash = hex::encode(Sha256::digest(content.to_string().as_bytes()));
    let key = format!("ask:{hash}:{occurrence}");
    let id = format!("q_{}", &hex::encode(Sha256::digest(key.as_bytes()))[..12]);
    (key, id)
}

/// Stores `record` as the answer to its question unless one is there; says what happened
/// to the one who answered (`reply`), and tells the engine the answer that stands.
async fn store_answer(
    store: Store,
    run: String,
    record: AnswerRecord,
    reply: Option<Reply>,
    events: mpsc::UnboundedSender<AskEvent>,
) {
    let key = keys::answer(&run, &record.id);
    let body = Bytes::from(serde_json::to_vec_pretty(&record).unwrap_or_default());
    let id = record.id.clone();
    let event = match store.put_create_exclusive(&key, body).await {
        Ok(true) => {
            let said = Ok(format!("{id} of {run} answered; the run goes on"));
            AskEvent::Answered {
                record,
                reply: reply.map(|r| (r, said)),
            }
        }
        Ok(false) => match read_answer(&store, &run, &id).await {
            Ok(Some(first)) => {
                let said = Err(Problem::new(
                    ErrorKind::Conflict,
                    format!(
                        "{id} of {run} was answered already, by {} at {}",
                        first.by, first.at
                    ),
                ));
                AskEvent::Answered {
                    record: first,
                    reply: reply.map(|r| (r, said)),
                }
            }
            Ok(None) | Err(_) => AskEvent::NotStored {
                id,
                problem: Problem::new(
                    ErrorKind::Unavailable,
                    "another answer is being stored; ask again in a moment",
                ),
                reply,
            },
        },
        Err(e) => AskEvent::NotStored {
            id,
            problem: Problem::new(e.kind(), format!("cannot store the answer: {e}")),
            reply,
        },
    };
    let _ = events.send(event);
}

/// The answer stored for question `id` of `run`, if any.
pub async fn read_answer(
    store: &Store,
    run: &str,
    id: &str,
) -> Result<Option<AnswerRecord>, crate::store::Error> {
    let Some(body) = store.get(&keys::answer(run, id)).await? else {
        return Ok(None);
    };
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(|e| crate::store::Error::Corrupt {
            key: keys::answer(run, id).to_string(),
            reason: e.to_string(),
        })
}

/// Every answer stored for `run`'s questions.
pub async fn read_answers(
    store: &Store,
    run: &str,
) -> Result<Vec<AnswerRecord>, crate::store::Error> {
    let mut out = Vec::new();
    for path in store.list_objects(&keys::answers_dir(run)).await? {
        let Some(id) = path.filename().and_then(|f| f.strip_suffix(".json")) else {
            continue;
        };
        if let Some(a) = read_answer(store, run, id).await? {
            out.push(a);
        }
    }
    Ok(out)
}

/// `run`'s questions as its store keeps them, each with its answer if it has one, in the
/// order they were asked.
pub async fn stored_questions(
    store: &Store,
    run: &str,
) -> Result<Vec<Question>, crate::store::Error> {
    let answers: HashMap<String, AnswerRecord> = read_answers(store, run)
        .await?
        .into_iter()
        .map(|a| (a.id.clone(), a))
        .collect();
    let mut out = Vec::new();
    for path in store.list_objects(&keys::questions_dir(run)).await? {
        let Some(body) = store.get(&path).await? else {
            continue;
        };
        let Ok(asked) = serde_json::from_slice::<QuestionRecord>(&body) else {
            continue;
        };
        let answer = answers.get(&asked.id).cloned();
        out.push(Question { asked, answer });
    }
    out.sort_by(|a, b| a.asked.asked_at.cmp(&b.asked.asked_at));
    Ok(out)
}

/// Answers a question of a run from outside its engine, through the store (an embedded run,
/// which looks there while a question is open): the question named, or the run's only open
/// one; checked against its schema; refused once the run has ended. The first answer wins.
pub async fn answer_in_store(
    store: &Store,
    run: &str,
    question: Option<&str>,
    value: Value,
    by: &str,
) -> Result<String, Problem> {
    let stored = |e: crate::store::Error| Problem::new(e.kind(), e.to_string());
    if store
        .get(&keys::manifest(run))
        .await
        .map_err(stored)?
        .is_none()
    {
        return Err(Problem::not_found(format!("no run {run} in {}", store.url)));
    }
    if store
        .get(&keys::result(run))
        .await
        .map_err(stored)?
        .is_some()
    {
        return Err(Problem::new(
            ErrorKind::Conflict,
            format!("run {run} has ended; its questions are closed"),
        ));
    }
    let questions = stored_questions(store, run).await.map_err(stored)?;
    let open: Vec<&QuestionRecord> = questions
        .iter()
        .filter(|q| q.answer.is_none())
        .map(|q| &q.asked)
        .collect();
    let ids = open
        .iter()
        .map(|q| q.id.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let q = match question.filter(|q| !q.is_empty()) {
        Some(id) => match questions.iter().find(|q| q.asked.id == id) {
            Some(Question {
                answer: Some(a), ..
            }) => {
                return Err(Problem::new(
                    ErrorKind::Conflict,
                    format!(
                        "{id} of {run} was answered already, by {} at {}",
                        a.by, a.at
                    ),
                ));
            }
            Some(q) => &q.asked,
            None => {
                return Err(Problem::not_found(format!(
                    "run {run} has no question {id}{}",
                    if ids.is_empty() {
                        String::new()
                    } else {
                        format!("; open: {ids}")
                    }
                )));
            }
        },
        None => match open.as_slice() {
            [] => {
                return Err(Problem::not_found(format!(
                    "run {run} has no open question"
                )));
            }
            [q] => q,
            many => {
                return Err(Problem::invalid(format!(
                    "run {run} has {} open questions ({ids}): name one with --question",
                    many.len()
                )));
            }
        },
    };
    if let Some(schema) = &q.schema {
        flotilla_proto::schema::Validator::new(schema)
            .and_then(|v| v.validate(&value))
            .map_err(|e| {
                Problem::invalid(format!(
                    "the answer does not match the schema of {}: {e}; the question stays open",
                    q.id
                ))
            })?;
    }
    let record = AnswerRecord {
        id: q.id.clone(),
        key: q.key.clone(),
        value,
        by: by.to_owned(),
        at: rfc3339(flotilla_proto::clock::now()),
        timed_out: false,
        answered_in: None,
    };
    let body = Bytes::from(serde_json::to_vec_pretty(&record).unwrap_or_default());
    if store
        .put_create_exclusive(&keys::answer(run, &q.id), body)
        .await
        .map_err(stored)?
    {
        Ok(format!("{} of {run} answered; the run goes on", q.id))
    } else {
        Err(Problem::new(
            ErrorKind::Conflict,
            format!("{} of {run} was answered already", q.id),
        ))
    }
}

/// Keeps a question just asked: an answer already stored comes back at once; else the first
/// ask's record stands (a replay keeps its time and deadline), or this one is stored.
async fn store_question(
    store: Store,
    run: String,
    record: QuestionRecord,
    events: mpsc::UnboundedSender<AskEvent>,
) {
    let id = record.id.clone();
    match read_answer(&store, &run, &id).await {
        Ok(Some(answer)) => {
            let _ = events.send(AskEvent::Answered {
                record: answer,
                reply: None,
            });
            return;
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(run, question = %id, error = %e, "cannot read a question's answer")
        }
    }
    let key = keys::question(&run, &id);
    let earlier = match store.get(&key).await {
        Ok(Some(body)) => serde_json::from_slice::<QuestionRecord>(&body).ok(),
        _ => None,
    };
    let event = match earlier {
        Some(first) => AskEvent::Asked {
            record: first,
            created: false,
        },
        None => {
            let body = Bytes::from(serde_json::to_vec_pretty(&record).unwrap_or_default());
            let created = match store.put_create_exclusive(&key, body).await {
                Ok(created) => created,
                Err(e) => {
                    tracing::warn!(run, question = %id, error = %e, "cannot store a question; it is open, but a successor would ask it anew");
                    false
                }
            };
            AskEvent::Asked { record, created }
        }
    };
    let _ = events.send(event);
}

/// The answers in `run`'s store to the questions `open`.
async fn look_for_answers(
    store: Store,
    run: String,
    open: Vec<String>,
    events: mpsc::UnboundedSender<AskEvent>,
) {
    let mut found = Vec::new();
    if let Ok(listed) = store.list_objects(&keys::answers_dir(&run)).await {
        for path in listed {
            let Some(id) = path.filename().and_then(|f| f.strip_suffix(".json")) else {
                continue;
            };
            if !open.iter().any(|o| o == id) {
                continue;
            }
            if let Ok(Some(a)) = read_answer(&store, &run, id).await {
                found.push(a);
            }
        }
    }
    let _ = events.send(AskEvent::Found(found));
}

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
        let content = question_key(&question, opts.schema.as_ref(), 0).0;
        let occ = self.asks.occurrences.entry(content).or_insert(0);
        let (key, id) = question_key(&question, opts.schema.as_ref(), *occ);
        *occ += 1;
        let now = flotilla_proto::clock::now();
        let deadline = opts.timeout_ms.map(|ms| now + Duration::from_millis(ms));
        let record = QuestionRecord {
            id: id.clone(),
            key: key.clone(),
            question,
            label: opts.label.unwrap_or_default(),
            schema: opts.schema,
            asked_at: rfc3339(now),
            deadline: deadline.map(rfc3339),
        };
        self.asks.asked.push(Question {
            asked: record.clone(),
            answer: None,
        });
        let served = self.init.resume.as_ref().and_then(|r| {
            r.answer(&key).map(|a| AnswerRecord {
                answered_in: a.answered_in.clone().or_else(|| Some(r.run_id.clone())),
                ..a.clone()
            })
        });
        self.asks.open.insert(
            id.clone(),
            Open {
                promise,
                deadline,
                validator,
                writing: served.is_some(),
            },
        );
        let (store, run, events) = (
            self.init.store.clone(),
            self.init.run_id.clone(),
            self.asks.events.clone(),
        );
        if let Some(answer) = served {
            // Kept in this run too, so its own resume or adopter finds it here.
            self.init
                .tasks
                .spawn_until_stopped(store_answer(store, run, answer, None, events));
            return;
        }
        self.note(format!(
            "[ask] {id} {}: answer with `flotilla answer {} --question {id} --json VALUE`",
            quote(&record.question),
            self.init.run_id
        ));
        self.init
            .tasks
            .spawn_until_stopped(store_question(store, run, record, events));
    }

    pub(super) fn on_ask_event(&mut self, ev: AskEvent) {
        self.dirty = true;
        match ev {
            AskEvent::Asked { record, created } => {
                if let Some(open) = self.asks.open.get_mut(&record.id) {
                    open.deadline = record
                        .deadline
                        .as_deref()
                        .and_then(|d| humantime::parse_rfc3339(d).ok());
                }
                if created {
                    self.announce(&record);
                }
                if let Some(q) = self.asks.entry(&record.id) {
                    q.asked = record;
                }
            }
            AskEvent::Answered { record, reply } => self.answered(record, reply),
            AskEvent::NotStored { id, problem, reply } => {
                if let Some(open) = self.asks.open.get_mut(&id) {
                    open.writing = false;
                }
                tracing::warn!(run = %self.run, question = %id, error = %problem, "an answer was not stored");
                if let Some(r) = reply {
                    let _ = r.send(Err(problem));
                }
            }
            AskEvent::Found(records) => {
                self.asks.polling = false;
                for r in records {
                    self.answered(r, None);
                }
            }
        }
    }

    /// An answer stands: the script gets it, and the question is closed.
    fn answered(&mut self, record: AnswerRecord, reply: Option<(Reply, Result<String, Problem>)>) {
        let Some(open) = self.asks.open.remove(&record.id) else {
            if let Some((r, _)) = reply {
                let _ = r.send(Err(Problem::new(
                    ErrorKind::Conflict,
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
            id: open.promise,
            result: Ok(record.value.to_string()),
        });
        if let Some((r, said)) = reply {
            let _ = r.send(said);
        }
        if let Some(q) = self.asks.entry(&record.id) {
            q.answer = Some(record);
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
        let id = match self.pick_question(question) {
            Ok(id) => id,
            Err(p) => {
                let _ = reply.send(Err(p));
                return;
            }
        };
        let Some(open) = self.asks.open.get_mut(&id) else {
            return;
        };
        if let Some(v) = &open.validator
            && let Err(e) = v.validate(&value)
        {
            let _ = reply.send(Err(Problem::invalid(format!(
                "the answer does not match the schema of {id}: {e}; the question stays open"
            ))));
            return;
        }
        if open.writing {
            let _ = reply.send(Err(Problem::new(
                ErrorKind::Conflict,
                format!("an answer to {id} is being stored already"),
            )));
            return;
        }
        open.writing = true;
        let key = self
            .asks
            .entry(&id)
            .map(|q| q.asked.key.clone())
            .unwrap_or_default();
        let record = AnswerRecord {
            id,
            key,
            value,
            by,
            at: rfc3339(flotilla_proto::clock::now()),
            timed_out: false,
            answered_in: None,
        };
        let (store, run, events) = (
            self.init.store.clone(),
            self.init.run_id.clone(),
            self.asks.events.clone(),
        );
        self.init
            .tasks
            .spawn_until_stopped(store_answer(store, run, record, Some(reply), events));
    }

    /// The open question an answer is for: the one named, or the only one.
    fn pick_question(&self, question: Option<String>) -> Result<String, Problem> {
        let run = &self.run;
        let open = self.asks.open();
        let ids = || {
            open.iter()
                .map(|q| q.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        match question.filter(|q| !q.is_empty()) {
            Some(q) if self.asks.open.contains_key(&q) => Ok(q),
            Some(q) => match self.asks.asked.iter().find(|a| a.asked.id == q) {
                Some(Question {
                    answer: Some(a), ..
                }) => Err(Problem::new(
                    ErrorKind::Conflict,
                    format!("{q} of {run} was answered already, by {} at {}", a.by, a.at),
                )),
                _ if open.is_empty() => Err(Problem::not_found(format!(
                    "run {run} has no question {q}, and none is open"
                ))),
                _ => Err(Problem::not_found(format!(
                    "run {run} has no open question {q}; open: {}",
                    ids()
                ))),
            },
            None => match open.len() {
                0 => Err(Problem::not_found(format!(
                    "run {run} has no open question"
                ))),
                1 => Ok(open[0].id.clone()),
                n => Err(Problem::invalid(format!(
                    "run {run} has {n} open questions ({}): name one with --question",
                    ids()
                ))),
            },
        }
    }

    /// Each tick: questions past their deadline end `null`; a run that takes answers from its
    /// store looks there.
    pub(super) fn ask_tick(&mut self) {
        if self.asks.open.is_empty() {
            return;
        }
        let now = flotilla_proto::clock::now();
        let due: Vec<String> = self
            .asks
            .open
            .iter()
            .filter(|(_, o)| !o.writing && o.deadline.is_some_and(|d| d <= now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            let key = self
                .asks
                .entry(&id)
                .map(|q| q.asked.key.clone())
                .unwrap_or_default();
            if let Some(o) = self.asks.open.get_mut(&id) {
                o.writing = true;
            }
            let record = AnswerRecord {
                id,
                key,
                value: Value::Null,
                by: "timeout".into(),
                at: rfc3339(now),
                timed_out: true,
                answered_in: None,
            };
            let (store, run, events) = (
                self.init.store.clone(),
                self.init.run_id.clone(),
                self.asks.events.clone(),
            );
            self.init
                .tasks
                .spawn_until_stopped(store_answer(store, run, record, None, events));
        }
        let waiting: Vec<String> = self
            .asks
            .open
            .iter()
            .filter(|(_, o)| !o.writing)
            .map(|(id, _)| id.clone())
            .collect();
        if self.init.answers_from_store
            && !self.asks.polling
            && !waiting.is_empty()
            && self
                .asks
                .last_poll
                .is_none_or(|t| t.elapsed() >= POLL_EVERY)
        {
            self.asks.polling = true;
            self.asks.last_poll = Some(Instant::now());
            let (store, run, events) = (
                self.init.store.clone(),
                self.init.run_id.clone(),
                self.asks.events.clone(),
            );
            self.init
                .tasks
                .spawn_until_stopped(look_for_answers(store, run, waiting, events));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_question_keys_on_its_text_schema_and_occurrence_only() {
        let s = serde_json::json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "number"}}});
        let reordered = serde_json::json!({"properties": {"b": {"type": "number"}, "a": {"type": "string"}}, "type": "object"});
        let (k1, id1) = question_key("Ship?", Some(&s), 0);
        assert_eq!(
            question_key("Ship?", Some(&reordered), 0),
            (k1.clone(), id1.clone())
        );
        assert_ne!(question_key("Ship?", Some(&s), 1).1, id1);
        assert_ne!(question_key("Ship?", None, 0).1, id1);
        assert_ne!(question_key("Ship it?", Some(&s), 0).1, id1);
        assert!(id1.starts_with("q_") && id1.len() == 14, "{id1}");
        assert!(k1.starts_with("ask:") && k1.ends_with(":0"), "{k1}");
    }

    #[test]
    fn a_long_question_is_quoted_short() {
        assert_eq!(quote("a  b\nc"), "“a b c”");
        let long = "x".repeat(500);
        assert!(quote(&long).ends_with("…”"));
        assert!(quote(&long).chars().count() < 170);
    }
}
