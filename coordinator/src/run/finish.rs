//! Results to the journal, and a run's end: a result reaches the script only once it is
//! durable; at the end, what is still live is cancelled, what is journaling is waited for,
//! and the report is stored.

use super::*;

impl RunEngine {
    pub(super) fn journal_call(&mut self, index: u64) {
        let Some(c) = self.book.get(index) else {
            return;
        };
        let record = CallRecord {
            index,
            key: c.key.clone(),
            label: c.label.clone(),
            group: c.group.clone(),
            result: c.result.clone(),
            payload: None,
            usage: c.usage,
            attempts: c.attempts,
            cached_from: c.cached_from.clone(),
            worker: c.worker.as_ref().map(|w| w.to_string()),
            change: c.change.clone(),
        };
        let queued = self.journal.as_ref().is_some_and(|j| j.append(record));
        if !queued {
            self.on_ack(JournalAck::Failed {
                indices: vec![index],
                error: "the journal writer is gone".into(),
            });
        }
    }

    pub(super) fn on_ack(&mut self, ack: JournalAck) {
        match ack {
            JournalAck::Durable(indices) => {
                for index in indices {
                    let Some(c) = self.book.get_mut(index) else {
                        continue;
                    };
                    if c.stage != Stage::Journaling {
                        continue;
                    }
                    c.set(Stage::Completed);
                    let json = c
                        .result
                        .as_ref()
                        .map_or_else(|| "null".to_owned(), |r| r.get().to_owned());
                    let (id, label, group) = (c.script_id, c.label.clone(), c.group.clone());
                    if !self.stopping {
                        (self.reply)(HostReply::Agent {
                            id,
                            result: Ok(json),
                        });
                    }
                    self.event(RunEvent::Call {
                        index,
                        label,
                        group,
                        state: Mark::Completed,
                        attempt: None,
                        detail: None,
                    });
                }
            }
            JournalAck::Failed { indices, error } => {
                // Results that cannot be stored are never handed to the script: the run fails
                // rather than pretend they are durable.
                tracing::error!(run = %self.run, error = %error, "cannot store completed calls");
                if self.error.is_none() {
                    self.error = Some(format!(
                        "cannot store completed agent results ({} calls): {error}",
                        indices.len()
                    ));
                }
                self.begin_stop();
                self.status = RunStatus::Failed;
            }
        }
    }

    pub(super) async fn finish(
        mut self,
        end: ScriptEnd,
        ack_rx: &mut mpsc::UnboundedReceiver<JournalAck>,
        applied_rx: &mut mpsc::UnboundedReceiver<crate::head::Applied>,
    ) -> Report {
        match end {
            ScriptEnd::Returned(json) => {
                if self.status != RunStatus::Failed {
                    self.status = if self.stopping {
                        RunStatus::Stopped
                    } else {
                        RunStatus::Completed
                    };
                }
                self.result = json
                    .as_deref()
                    .and_then(|j| serde_json::from_str(j).ok())
                    .unwrap_or(Value::Null);
            }
            ScriptEnd::Failed(f) => {
                if self.status != RunStatus::Failed {
                    self.status = if f.kind == script::FailureKind::Stopped && self.stopping {
                        RunStatus::Stopped
                    } else {
                        RunStatus::Failed
                    };
                }
                if self.error.is_none() && self.status == RunStatus::Failed {
                    self.error = Some(f.message);
                }
            }
        }
        // Whatever is still queued or running is cancelled: the script no longer waits for it.
        self.init.dispatch.close_run(&self.run);
        self.cancel_live();
        // Changes still being applied to the head are journaled first.
        if self.head.take().is_some() {
            while let Some(a) = applied_rx.recv().await {
                self.on_applied(a);
            }
        }
        // Let the journal finish what it has: results completed after the script ended are
        // still worth keeping for a resume.
        if let Some(mut journal) = self.journal.take() {
            journal.close().await;
        }
        let mut durable = Vec::new();
        while let Ok(ack) = ack_rx.try_recv() {
            if let JournalAck::Durable(indices) = ack {
                durable.extend(indices);
            }
        }
        self.book.settle_journaling(durable);
        self.transcripts.close().await;
        let status = self.status;
        let error = self.error.clone();
        self.event(RunEvent::Status {
            status: status.as_str().into(),
            error,
        });
        self.events.close().await;
        let report = self.report();
        crate::counters::run_ended(
            status.as_str(),
            std::time::Duration::from_millis(report.usage.duration_ms),
        );
        if self.init.write_result {
            match serde_json::to_vec_pretty(&report) {
                Ok(body) => {
                    if let Err(e) = self
                        .init
                        .store
                        .put_overwrite(&keys::result(&self.init.run_id), Bytes::from(body))
                        .await
                    {
                        tracing::error!(run = %self.run, error = %e, "cannot store the run report");
                    }
                }
                Err(e) => tracing::error!(error = %e, "cannot encode the run report"),
            }
            if let Some(entry) = &self.init.indexed
                && let Err(e) =
                    crate::index::record(&self.init.store, &crate::index::ended(entry, &report))
                        .await
            {
                // Listing reads the report of a run whose entry still says running.
                tracing::warn!(run = %self.run, error = %e, "cannot update the run index");
            }
            if let (Some(url), Some(n)) = (&self.init.settings.notify, &self.init.notifier) {
                n.spawn(
                    self.init.store.clone(),
                    self.init.generation,
                    url.clone(),
                    &report,
                    &self.init.settings.labels,
                    report.usage.duration_ms,
                );
            }
        }
        for held in std::mem::take(&mut self.init.owners) {
            held.release().await;
        }
        self.publish();
        report
    }
}
