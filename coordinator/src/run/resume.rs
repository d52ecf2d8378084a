//! The resume source: the completed calls of an earlier run, by key and by start order.

use std::collections::HashMap;

use crate::store::records::{CallRecord, Manifest};
use crate::store::{self, Store, journal, keys};

/// Completed calls of the run being resumed.
#[derive(Debug, Clone, Default)]
pub struct ResumeSource {
    pub run_id: String,
    /// Each record once; the map points into it (a big run's journal is not copied twice).
    records: Vec<CallRecord>,
    by_key: HashMap<String, usize>,
    /// The answers its questions got (`ask()`), by question key.
    answers: HashMap<String, crate::store::records::AnswerRecord>,
    /// What could not be read back (those calls run again), for the run's log.
    pub warnings: Vec<String>,
}

/// Why a run cannot be resumed.
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    #[error("nothing to resume: no run {run} in {store}")]
    NoSuchRun { run: String, store: String },
    #[error("nothing to resume: run {run} has no completed agent results{why}")]
    NoResults { run: String, why: String },
    #[error(transparent)]
    Store(#[from] store::Error),
}

impl ResumeSource {
    /// Loads a run's manifest and completed calls.
    pub async fn load(store: &Store, run: &str) -> Result<(Manifest, ResumeSource), ResumeError> {
        let valid = run.starts_with("wf_")
            && run.len() > 3
            && run[3..]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-');
        let no_run = || ResumeError::NoSuchRun {
            run: run.to_owned(),
            store: store.url.clone(),
        };
        if !valid {
            return Err(no_run());
        }
        let Some(body) = store.get(&keys::manifest(run)).await? else {
            return Err(no_run());
        };
        let manifest: Manifest =
            serde_json::from_slice(&body).map_err(|e| store::Error::Corrupt {
                key: keys::manifest(run).to_string(),
                reason: e.to_string(),
            })?;
        let started = std::time::Instant::now();
        let read = journal::read_calls_checked(store, run).await?;
        tracing::info!(
            run,
            calls = read.calls.len(),
            ms = started.elapsed().as_millis() as u64,
            "read the journal of the run resumed"
        );
        let warning = read.summary();
        let answers = crate::run::ask::read_answers(store, run).await?;
        if read.calls.is_empty() && answers.is_empty() {
            return Err(ResumeError::NoResults {
                run: run.to_owned(),
                why: warning.map(|w| format!(" ({w})")).unwrap_or_default(),
            });
        }
        let mut src = ResumeSource::from_records(run, read.calls);
        src.answers = answers.into_iter().map(|a| (a.key.clone(), a)).collect();
        src.warnings
            .extend(warning.map(|w| format!("[resume] {w}")));
        Ok((manifest, src))
    }

    pub fn from_records(run: &str, records: Vec<CallRecord>) -> ResumeSource {
        let mut by_key = HashMap::with_capacity(records.len());
        for (i, r) in records.iter().enumerate() {
            by_key.insert(r.key.clone(), i);
        }
        ResumeSource {
            run_id: run.to_owned(),
            records,
            by_key,
            answers: HashMap::new(),
            warnings: Vec::new(),
        }
    }

    /// Content-keyed lookup.
    pub fn by_key(&self, key: &str) -> Option<&CallRecord> {
        self.by_key.get(key).map(|&i| &self.records[i])
    }

    /// The answer a question got (`ask()`), by its key.
    pub fn answer(&self, key: &str) -> Option<&crate::store::records::AnswerRecord> {
        self.answers.get(key)
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}
