//! Who drives a run, when no etcd says so: owner records in the run's storage.
//!
//! Two processes must never drive one run, nor resume one run twice at once (W52): the
//! second copy would pay for every agent again. A process that starts a run, or resumes one,
//! takes the run by writing the next record of `runs/{run}/owner/{seq}.json` create-only —
//! of two that try at once, exactly one succeeds. A record names its holder (the run that
//! holds it, host, boot, pid and the pid's start time) and is followed by a `released` record
//! once the holder's report is stored. A record that was never released belongs to a live
//! holder while that holder's process still exists (same host and boot: the pid with the same
//! start time) or, from another host, while its heartbeat (`{seq}.beat`, rewritten every
//! [`BEAT`]) is younger than [`STALE_AFTER`]; otherwise it is stale and the next taker writes
//! over it with the next sequence number.
//!
//! On the fleet with etcd, runs are owned in etcd instead ([`crate::leader`]).

use std::time::Duration;

use bytes::Bytes;
use object_store::ObjectStoreExt;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::store::{Error, Store, keys};

/// How often a holder rewrites its heartbeat.
pub const BEAT: Duration = Duration::from_secs(15);
/// A holder on another host whose heartbeat is older than this is gone.
pub const STALE_AFTER: Duration = Duration::from_secs(90);

/// One owner record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerRecord {
    /// The run that holds it: the run itself, or the run that resumes it.
    pub holder: String,
    pub host: String,
    #[serde(default)]
    pub boot: String,
    pub pid: u32,
    /// The pid's start time (clock ticks since boot), so a reused pid is not taken for it.
    #[serde(default)]
    pub pid_start: u64,
    /// RFC 3339, when it was taken.
    pub at: String,
    /// The holder let go (its report is stored).
    #[serde(default)]
    pub released: bool,
}

impl OwnerRecord {
    fn mine(holder: &str, released: bool) -> OwnerRecord {
        let me = Process::current();
        OwnerRecord {
            holder: holder.to_owned(),
            host: me.host,
            boot: me.boot,
            pid: me.pid,
            pid_start: me.pid_start,
            at: humantime::format_rfc3339_seconds(flotilla_proto::clock::now()).to_string(),
            released,
        }
    }

    /// Where its holder runs, for messages.
    pub fn describe(&self) -> String {
        format!(
            "run {} (pid {} on {}, since {})",
            self.holder, self.pid, self.host, self.at
        )
    }
}

/// This process, as owner records name it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Process {
    host: String,
    boot: String,
    pid: u32,
    pid_start: u64,
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// The start time of `pid` (field 22 of `/proc/PID/stat`), if it exists.
fn pid_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields resume after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Process {
    fn current() -> Process {
        let pid = std::process::id();
        Process {
            host: read_trimmed("/proc/sys/kernel/hostname"),
            boot: read_trimmed("/proc/sys/kernel/random/boot_id"),
            pid,
            pid_start: pid_start(pid).unwrap_or(0),
        }
    }
}

/// Whether a record's holder can still be driving the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Its process is alive (or its heartbeat is fresh).
    Live,
    /// It let go.
    Released,
    /// Its process is gone: the run was interrupted.
    Gone,
}

/// The newest owner record of `run`, its sequence number and whether its holder is live.
pub async fn current(
    store: &Store,
    run: &str,
) -> Result<Option<(u64, OwnerRecord, Liveness)>, Error> {
    let mut newest: Option<(u64, object_store::path::Path)> = None;
    for k in store.list_objects(&keys::owner_dir(run)).await? {
        let Some(seq) = k
            .filename()
            .and_then(|f| f.strip_suffix(".json"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if newest.as_ref().is_none_or(|(s, _)| seq > *s) {
            newest = Some((seq, k));
        }
    }
    let Some((seq, key)) = newest else {
        return Ok(None);
    };
    let Some(body) = store.get(&key).await? else {
        return Ok(None);
    };
    let record: OwnerRecord = serde_json::from_slice(&body).map_err(|e| Error::Corrupt {
        key: key.to_string(),
        reason: e.to_string(),
    })?;
    let live = liveness(store, run, seq, &record).await;
    Ok(Some((seq, record, live)))
}

/// The records this process holds now (run, sequence): a record naming this very process is
/// live only while its [`Held`] is (a run that ended without letting go, in a process that
/// lives on, does not hold its run forever).
static HELD: std::sync::Mutex<std::collections::BTreeSet<(String, u64)>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn held_here() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<(String, u64)>> {
    HELD.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn liveness(store: &Store, run: &str, seq: u64, r: &OwnerRecord) -> Liveness {
    if r.released {
        return Liveness::Released;
    }
    let me = Process::current();
    if r.host == me.host && r.boot == me.boot && r.pid == me.pid && r.pid_start == me.pid_start {
        return if held_here().contains(&(run.to_owned(), seq)) {
            Liveness::Live
        } else {
            Liveness::Gone
        };
    }
    if r.host == me.host && r.boot == me.boot {
        // Same machine: the process itself says.
        return match pid_start(r.pid) {
            Some(start) if r.pid_start == 0 || start == r.pid_start => Liveness::Live,
            _ => Liveness::Gone,
        };
    }
    let beat_ms = store
        .inner
        .head(&keys::owner_beat(run, seq))
        .await
        .ok()
        .map(|m| m.last_modified.timestamp_millis());
    let now_ms = flotilla_proto::clock::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let fresh = beat_ms.is_some_and(|t| now_ms.saturating_sub(t) < STALE_AFTER.as_millis() as i64);
    if fresh {
        Liveness::Live
    } else {
        Liveness::Gone
    }
}

/// Why a run cannot be taken.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TakeError {
    #[error("{0}")]
    Held(String),
    #[error("cannot read or write the run's owner record: {0}")]
    Store(String),
}

/// A run held by this process; [`Held::release`] lets go once its report is stored.
#[derive(Debug)]
pub struct Held {
    store: Store,
    run: String,
    holder: String,
    seq: u64,
    beat: CancellationToken,
}

/// Takes `run` for `holder` (the run itself, or a run resuming it).
pub async fn take(
    store: &Store,
    run: &str,
    holder: &str,
    tasks: &crate::tasks::Tasks,
) -> Result<Held, TakeError> {
    let store_err = |e: Error| TakeError::Store(e.to_string());
    let seq = match current(store, run).await.map_err(store_err)? {
        None => 1,
        Some((_, r, Liveness::Live)) => return Err(TakeError::Held(refusal(run, holder, &r))),
        Some((seq, _, _)) => seq + 1,
    };
    let record = OwnerRecord::mine(holder, false);
    let body = serde_json::to_vec(&record).map_err(|e| TakeError::Store(e.to_string()))?;
    match store
        .put_create_exclusive(&keys::owner(run, seq), Bytes::from(body))
        .await
    {
        Ok(true) => {}
        Ok(false) => {
            // Another process took it between our read and our write.
            let now = current(store, run).await.map_err(store_err)?;
            let why = match now {
                Some((_, r, _)) => refusal(run, holder, &r),
                None => format!("run {run} was taken by another process just now"),
            };
            return Err(TakeError::Held(why));
        }
        Err(e) => return Err(store_err(e)),
    }
    held_here().insert((run.to_owned(), seq));
    let beat = CancellationToken::new();
    // Ends when the hold does (released or dropped), or with its owner's tasks.
    tasks.spawn_until_stopped(heartbeat(store.clone(), run.to_owned(), seq, beat.clone()));
    Ok(Held {
        store: store.clone(),
        run: run.to_owned(),
        holder: holder.to_owned(),
        seq,
        beat,
    })
}

fn refusal(run: &str, holder: &str, r: &OwnerRecord) -> String {
    if r.holder == run && holder != run {
        format!(
            "run {run} is still running ({}); stop it (Ctrl-C there, or kill {}) and wait for it to end, then resume",
            r.describe(),
            r.pid
        )
    } else if r.holder == run {
        format!("run {run} is already driven by {}", r.describe())
    } else {
        format!(
            "run {run} is being resumed already, by {}; wait for that one to end (or stop it), or resume that run instead",
            r.describe()
        )
    }
}

async fn heartbeat(store: Store, run: String, seq: u64, stop: CancellationToken) {
    loop {
        let _ = store
            .put_overwrite(&keys::owner_beat(&run, seq), Bytes::from_static(b"{}"))
            .await;
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(BEAT) => {}
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.beat.cancel();
        held_here().remove(&(self.run.clone(), self.seq));
    }
}

impl Held {
    /// Lets go: the next record says `released` (nothing is written if someone took the run
    /// over meanwhile, which only happens once this process was taken for gone).
    pub async fn release(self) {
        self.beat.cancel();
        let record = OwnerRecord::mine(&self.holder, true);
        let Ok(body) = serde_json::to_vec(&record) else {
            return;
        };
        if let Err(e) = self
            .store
            .put_create_exclusive(&keys::owner(&self.run, self.seq + 1), Bytes::from(body))
            .await
        {
            tracing::warn!(run = %self.run, error = %e, "cannot release the run's owner record");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_hold_dropped_without_letting_go_frees_the_run_in_a_process_that_lives_on() {
        let store = crate::store::open("memory://").unwrap();
        let held = take(&store, "wf_dropped", "wf_dropped", &Default::default())
            .await
            .unwrap();
        assert_eq!(
            current(&store, "wf_dropped").await.unwrap().unwrap().2,
            Liveness::Live
        );
        drop(held);
        assert_eq!(
            current(&store, "wf_dropped").await.unwrap().unwrap().2,
            Liveness::Gone,
            "interrupted, though this process is alive"
        );
        let again = take(&store, "wf_dropped", "wf_resume", &Default::default())
            .await
            .unwrap();
        again.release().await;
    }

    #[tokio::test]
    async fn one_process_holds_a_run_until_it_lets_go() {
        let store = crate::store::open("memory://").unwrap();
        let held = take(&store, "wf_a", "wf_a", &Default::default())
            .await
            .unwrap();
        // This process is alive, so its record holds: a resume is refused, with who holds it.
        let e = take(&store, "wf_a", "wf_b", &Default::default())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("still running"), "{e}");
        let (_, r, live) = current(&store, "wf_a").await.unwrap().unwrap();
        assert_eq!((r.holder.as_str(), live), ("wf_a", Liveness::Live));
        held.release().await;
        assert_eq!(
            current(&store, "wf_a").await.unwrap().unwrap().2,
            Liveness::Released
        );
        // Now a resume takes it, and a second resume at the same time is refused.
        let resume = take(&store, "wf_a", "wf_b", &Default::default())
            .await
            .unwrap();
        let e = take(&store, "wf_a", "wf_c", &Default::default())
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("being resumed already, by run wf_b"),
            "{e}"
        );
        resume.release().await;
    }

    #[tokio::test]
    async fn a_record_of_a_process_that_is_gone_is_stale() {
        let store = crate::store::open("memory://").unwrap();
        let mut dead = OwnerRecord::mine("wf_d", false);
        // A pid that is not running (pid_max is below this).
        dead.pid = 4_000_000_000;
        store
            .put_create(
                &keys::owner("wf_d", 1),
                Bytes::from(serde_json::to_vec(&dead).unwrap()),
            )
            .await
            .unwrap();
        assert_eq!(
            current(&store, "wf_d").await.unwrap().unwrap().2,
            Liveness::Gone
        );
        // Another host whose heartbeat never came: gone too.
        let mut far = OwnerRecord::mine("wf_e", false);
        far.host = "elsewhere".into();
        store
            .put_create(
                &keys::owner("wf_e", 1),
                Bytes::from(serde_json::to_vec(&far).unwrap()),
            )
            .await
            .unwrap();
        assert_eq!(
            current(&store, "wf_e").await.unwrap().unwrap().2,
            Liveness::Gone
        );
        let held = take(&store, "wf_d", "wf_f", &Default::default())
            .await
            .unwrap();
        assert_eq!(held.seq, 2);
        held.release().await;
    }

    #[test]
    fn this_process_has_a_start_time() {
        assert!(pid_start(std::process::id()).unwrap() > 0);
        assert_eq!(pid_start(4_000_000_000), None);
    }
}
