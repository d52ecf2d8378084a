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
//! This file is the questions' state and their store; the run's half (`asking.rs`) settles
//! the script's promises. Answers come through `Control::Answer` (the `Control` RPC, the page, `WorkflowAnswer`),
//! checked against the schema (a wrong one is refused with the reason, and the question stays
//! open); an embedded run also picks up answers `flotilla answer` writes into its store. A
//! question past its deadline is answered `null` (by `timeout`), the same way on every path.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use flotilla_proto::{ErrorKind, Problem};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::store::records::{AnswerRecord, Question, QuestionRecord};
use crate::store::{Store, keys};

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
    /// Its record is in the store (what a parked run's answers are checked against).
    stored: bool,
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

    /// Where the questions' store tasks report back.
    pub(super) fn events(&self) -> mpsc::UnboundedSender<AskEvent> {
        self.events.clone()
    }

    /// The key and id of a question asked now: its `occurrence` counts the same question
    /// (text and schema) asked before in the run.
    pub(super) fn next_key(&mut self, question: &str, schema: Option<&Value>) -> (String, String) {
        let content = question_key(question, schema, 0).0;
        let occ = self.occurrences.entry(content).or_insert(0);
        let key = question_key(question, schema, *occ);
        *occ += 1;
        key
    }

    /// Question `record` is open, its answer settling the script's `promise`; `storing`: an
    /// answer is on its way to the store already (one a resume serves).
    pub(super) fn open_question(
        &mut self,
        promise: u64,
        record: QuestionRecord,
        validator: Option<flotilla_proto::schema::Validator>,
        storing: bool,
    ) {
        let deadline = record
            .deadline
            .as_deref()
            .and_then(|d| humantime::parse_rfc3339_weak(d).ok());
        self.open.insert(
            record.id.clone(),
            Open {
                promise,
                deadline,
                validator,
                writing: storing,
                stored: false,
            },
        );
        self.asked.push(Question {
            asked: record,
            answer: None,
        });
    }

    /// The record of the question's first ask stands (its time and deadline).
    pub(super) fn asked_first(&mut self, record: QuestionRecord) {
        if let Some(open) = self.open.get_mut(&record.id) {
            open.deadline = record
                .deadline
                .as_deref()
                .and_then(|d| humantime::parse_rfc3339_weak(d).ok());
            open.stored = true;
        }
        if let Some(q) = self.entry(&record.id) {
            q.asked = record;
        }
    }

    /// Storing an answer to `id` failed: another may be given.
    pub(super) fn not_stored(&mut self, id: &str) {
        if let Some(open) = self.open.get_mut(id) {
            open.writing = false;
        }
    }

    /// A look into the store ended.
    pub(super) fn looked(&mut self) {
        self.polling = false;
    }

    /// Question `record.id` has its answer: closed, and the promise it settles (`None`: it
    /// was not open).
    pub(super) fn close(&mut self, record: &AnswerRecord) -> Option<u64> {
        let open = self.open.remove(&record.id)?;
        if let Some(q) = self.entry(&record.id) {
            q.answer = Some(record.clone());
        }
        Some(open.promise)
    }

    /// An answer from outside to the question named (or the only open one) of `run`, checked
    /// against its schema: the record to store, or why it is refused (the question stays open).
    pub(super) fn answering(
        &mut self,
        run: &str,
        question: Option<String>,
        value: Value,
        by: String,
    ) -> Result<AnswerRecord, Problem> {
        let id = self.pick(run, question)?;
        let key = self
            .asked
            .iter()
            .find(|q| q.asked.id == id)
            .map(|q| q.asked.key.clone())
            .unwrap_or_default();
        let Some(open) = self.open.get_mut(&id) else {
            return Err(Problem::not_found(format!(
                "run {run} has no open question {id}"
            )));
        };
        if let Some(v) = &open.validator
            && let Err(e) = v.validate(&value)
        {
            return Err(Problem::invalid(format!(
                "the answer does not match the schema of {id}: {e}; the question stays open"
            )));
        }
        if open.writing {
            return Err(Problem::new(
                ErrorKind::Conflict,
                format!("an answer to {id} is being stored already"),
            ));
        }
        open.writing = true;
        Ok(AnswerRecord {
            id,
            key,
            value,
            by,
            at: rfc3339(flotilla_proto::clock::now()),
            timed_out: false,
            answered_in: None,
        })
    }

    /// The open question an answer is for: the one named, or the only one.
    fn pick(&self, run: &str, question: Option<String>) -> Result<String, Problem> {
        let open = self.open();
        let ids = || {
            open.iter()
                .map(|q| q.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        match question.filter(|q| !q.is_empty()) {
            Some(q) if self.open.contains_key(&q) => Ok(q),
            Some(q) => match self.asked.iter().find(|a| a.asked.id == q) {
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

    /// The questions past their deadline at `now`, each being answered `null` now (by
    /// `timeout`): their answers to store.
    pub(super) fn due(&mut self, now: SystemTime) -> Vec<AnswerRecord> {
        let mut out = Vec::new();
        for q in &self.asked {
            let Some(open) = self.open.get_mut(&q.asked.id) else {
                continue;
            };
            if open.writing || open.deadline.is_none_or(|d| d > now) {
                continue;
            }
            open.writing = true;
            out.push(AnswerRecord {
                id: q.asked.id.clone(),
                key: q.asked.key.clone(),
                value: Value::Null,
                by: "timeout".into(),
                at: rfc3339(now),
                timed_out: true,
                answered_in: None,
            });
        }
        out
    }

    /// The open questions to look for in the store, when it is time to look (one look at a
    /// time, at most every [`POLL_EVERY`]).
    pub(super) fn look_for(&mut self) -> Option<Vec<String>> {
        let waiting: Vec<String> = self
            .open
            .iter()
            .filter(|(_, o)| !o.writing)
            .map(|(id, _)| id.clone())
            .collect();
        if self.polling
            || waiting.is_empty()
            || self.last_poll.is_some_and(|t| t.elapsed() < POLL_EVERY)
        {
            return None;
        }
        self.polling = true;
        self.last_poll = Some(Instant::now());
        Some(waiting)
    }

    /// Whether any question is open.
    pub(super) fn any_open(&self) -> bool {
        !self.open.is_empty()
    }

    /// Whether questions are open, each stored, none with an answer on its way.
    pub(super) fn only_waiting(&self) -> bool {
        !self.open.is_empty() && self.open.values().all(|o| !o.writing && o.stored)
    }

    /// The earliest deadline of the open questions.
    pub(super) fn earliest_deadline(&self) -> Option<SystemTime> {
        self.open.values().filter_map(|o| o.deadline).min()
    }
}

/// The question shortened for a log line, quoted.
pub(super) fn quote(q: &str) -> String {
    let one: String = q.split_whitespace().collect::<Vec<_>>().join(" ");
    let cut: String = one.chars().take(QUOTED).collect();
    if cut.len() < one.len() {
        format!("“{cut}…”")
    } else {
        format!("“{cut}”")
    }
}

pub(super) fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// `ask()`'s options as the prelude sends them.
#[derive(serde::Deserialize)]
pub(super) struct AskOpts {
    #[serde(default)]
    pub(super) schema: Option<Value>,
    #[serde(default, rename = "timeoutMs")]
    pub(super) timeout_ms: Option<u64>,
    #[serde(default)]
    pub(super) label: Option<String>,
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
pub(super) async fn store_answer(
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
pub(super) async fn store_question(
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
                    // Open all the same (answered through its run's controls), but never
                    // parked: a parked run's answers are checked against the stored record.
                    tracing::warn!(run, question = %id, error = %e, "cannot store a question; it is open, but a successor would ask it anew");
                    return;
                }
            };
            AskEvent::Asked { record, created }
        }
    };
    let _ = events.send(event);
}

/// The answers in `run`'s store to the questions `open`.
pub(super) async fn look_for_answers(
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
