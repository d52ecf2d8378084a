use super::*;
use crate::lease::memory::MemoryLeaseStore;
use crate::lease::{LeaseId, Revision, WatchEvent};
use flotilla_proto::link::{Link, link_pair};
use flotilla_proto::v1::{CoordinatorMessage, coordinator_message};
use std::sync::atomic::Ordering;

struct FakeWorker {
    link: Link,
}

impl FakeWorker {
    fn attach(d: &DispatchHandle, slots: u32) -> FakeWorker {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Self::attach_as(d, &format!("fake-{n}"), slots, &[])
    }

    /// Attaches as `name`, holding `held` from an earlier link.
    fn attach_as(
        d: &DispatchHandle,
        name: &str,
        slots: u32,
        held: &[&v1::Assignment],
    ) -> FakeWorker {
        Self::attach_offering(d, name, slots, held, &["echo"])
    }

    fn attach_offering(
        d: &DispatchHandle,
        name: &str,
        slots: u32,
        held: &[&v1::Assignment],
        backends: &[&str],
    ) -> FakeWorker {
        Self::attach_with_accounts(d, name, slots, held, backends, Vec::new())
    }

    fn attach_with_accounts(
        d: &DispatchHandle,
        name: &str,
        slots: u32,
        held: &[&v1::Assignment],
        backends: &[&str],
        accounts: Vec<v1::Account>,
    ) -> FakeWorker {
        Self::attach_hello(
            d,
            v1::Hello {
                accounts,
                protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
                name: name.into(),
                backends: backends.iter().map(|b| (*b).to_owned()).collect(),
                slots,
                held: held
                    .iter()
                    .map(|a| v1::AttemptRef {
                        run_id: a.run_id.clone(),
                        call: a.call,
                        attempt: a.attempt,
                        fence: a.fence,
                        call_key: a.call_key.clone(),
                        ended: false,
                    })
                    .collect(),
                ..v1::Hello::default()
            },
        )
    }

    /// Attaches with this `Hello`.
    fn attach_hello(d: &DispatchHandle, hello: v1::Hello) -> FakeWorker {
        let (link, end) = link_pair();
        d.attach(end);
        let w = FakeWorker { link };
        w.send(worker_message::Msg::Hello(hello));
        w
    }

    fn send(&self, msg: worker_message::Msg) {
        self.link.tx.send(WorkerMessage { msg: Some(msg) }).unwrap();
    }

    /// Next assignment or cancel (skipping the welcome).
    async fn next(&mut self) -> coordinator_message::Msg {
        loop {
            let m = tokio::time::timeout(Duration::from_secs(60), self.link.rx.recv())
                .await
                .expect("a message from the dispatcher")
                .expect("link open")
                .msg
                .unwrap();
            if !matches!(m, coordinator_message::Msg::Welcome(_)) {
                return m;
            }
        }
    }

    async fn assignment(&mut self) -> v1::Assignment {
        match self.next().await {
            coordinator_message::Msg::Assign(a) => a,
            other => panic!("expected an assignment, got {other:?}"),
        }
    }

    /// Says the agent of `a` started (its workspace made): the stall timer runs from now.
    fn started(&self, a: &v1::Assignment) {
        self.send(worker_message::Msg::Progress(v1::Progress {
            run_id: a.run_id.clone(),
            call: a.call,
            attempt: a.attempt,
            kind: v1::ProgressKind::AgentStarted as i32,
            ..v1::Progress::default()
        }));
    }

    fn complete(&self, a: &v1::Assignment, text: &str) {
        self.send(worker_message::Msg::Outcome(v1::Outcome {
            run_id: a.run_id.clone(),
            call: a.call,
            attempt: a.attempt,
            result: Some(outcome::Result::Completed(v1::Completed {
                text: text.into(),
                json: None,
                change: None,
                model: String::new(),
            })),
            usage: Some(v1::Usage {
                output_tokens: 1,
                ..v1::Usage::default()
            }),
            fence: a.fence,
            call_key: a.call_key.clone(),
        }));
    }

    /// Nothing but a welcome arrives for `d`.
    async fn no_message_for(&mut self, d: Duration) {
        let until = Instant::now() + d;
        while let Ok(Some(m)) = tokio::time::timeout_at(until, self.link.rx.recv()).await {
            if !matches!(m.msg, Some(coordinator_message::Msg::Welcome(_))) {
                panic!("unexpected message {m:?}");
            }
        }
    }
}

mod fleet;
mod fuzz;
mod hostile;
mod kept;

fn register(
    d: &DispatchHandle,
    run: &str,
    concurrency: usize,
    stall: Duration,
) -> (Arc<str>, mpsc::UnboundedReceiver<CallEvent>) {
    register_kept(d, run, concurrency, stall, Default::default())
}

/// [`register`], the run adopted with what `kept` says its interrupted calls left.
fn register_kept(
    d: &DispatchHandle,
    run: &str,
    concurrency: usize,
    stall: Duration,
    kept: std::collections::HashMap<String, v1::KeptLeftovers>,
) -> (Arc<str>, mpsc::UnboundedReceiver<CallEvent>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let id: Arc<str> = Arc::from(run);
    d.register(RunRegistration {
        run_id: id.clone(),
        concurrency,
        stall_timeout: stall,
        max_attempts: 3,
        stagger: Duration::ZERO,
        worker_wait: Duration::from_secs(600),
        retry_budget: None,
        throttle_wait: Duration::from_secs(900),
        head: None,
        events: tx,
        share: crate::sched::Share::default(),
        kept,
    });
    (id, rx)
}

fn ticket(call: u64) -> Ticket {
    Ticket {
        call,
        key: format!("k{call}"),
        task: v1::TaskSpec {
            prompt: format!("p{call}"),
            backend: "echo".into(),
            ..v1::TaskSpec::default()
        },
        prefix_group: 1,
        span: tracing::Span::none(),
    }
}

/// The `Finished` events already sent.
async fn finished(rx: &mut mpsc::UnboundedReceiver<CallEvent>) -> Vec<(u64, CallResult)> {
    let mut out = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        keep_finished(ev, &mut out);
    }
    out
}

fn keep_finished(ev: CallEvent, out: &mut Vec<(u64, CallResult)>) {
    if let CallEvent::Finished { call, result } = ev {
        out.push((call, result));
    }
}

#[tokio::test(start_paused = true)]
async fn a_late_outcome_of_a_stalled_attempt_is_never_accepted() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 4);
    let (run, mut events) = register(&d, "wf_fence", 4, Duration::from_millis(300));
    d.submit(&run, ticket(0));
    let first = w.assignment().await;
    assert_eq!(first.attempt, 1);
    // No progress: the watchdog cancels attempt 1 and starts attempt 2.
    match w.next().await {
        coordinator_message::Msg::Cancel(c) => assert_eq!(c.attempt, 1),
        other => panic!("expected a cancel, got {other:?}"),
    }
    let second = w.assignment().await;
    assert_eq!(second.attempt, 2);
    // The stalled attempt answers late: dropped.
    w.complete(&first, "stale");
    w.complete(&second, "fresh");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let done = finished(&mut events).await;
    assert_eq!(done.len(), 1, "exactly one accepted result: {done:?}");
    assert_eq!(
        done[0].1,
        CallResult::Completed(v1::Completed {
            text: "fresh".into(),
            json: None,
            change: None,
            model: String::new(),
        })
    );
    // Usage of both attempts is still counted.
    w.no_message_for(Duration::from_millis(500)).await;
}

/// A worker's source request is answered from the namespace of the attempt it holds, never
/// from another namespace that has the same repository and commit ids, whatever the request
/// says; a request no attempt of the worker wants gets an error and no data.
#[tokio::test(start_paused = true)]
async fn a_worker_gets_sources_only_from_the_namespace_of_an_attempt_it_holds() {
    let store = crate::store::open("memory://").unwrap();
    let d = spawn_with(
        MemoryLeaseStore::new(),
        DispatchOptions::default(),
        Some(store.clone()),
        CancellationToken::new(),
    );
    let mut w = FakeWorker::attach(&d, 4);
    let base = "a".repeat(40);
    for (ns, bytes) in [("team-a", &b"team a's"[..]), ("team-b", b"team b's")] {
        let repo = crate::source::Repo::new(ns, "r1").unwrap();
        crate::source::put_pack(&store, &repo, &base, vec![], bytes.to_vec())
            .await
            .unwrap();
    }
    let (tx, _events) = mpsc::unbounded_channel();
    let run: Arc<str> = Arc::from("wf_team_b");
    let (_head_tx, head) = tokio::sync::watch::channel(base.clone());
    d.register(RunRegistration {
        run_id: run.clone(),
        concurrency: 4,
        stall_timeout: Duration::from_secs(600),
        max_attempts: 1,
        stagger: Duration::ZERO,
        worker_wait: Duration::from_secs(600),
        retry_budget: None,
        throttle_wait: Duration::from_secs(900),
        head: Some(head),
        events: tx,
        share: crate::sched::Share::default(),
        kept: Default::default(),
    });
    let mut t = ticket(0);
    t.task.source_repo = "r1".into();
    t.task.namespace = "team-b".into();
    d.submit(&run, t);
    let a = w.assignment().await;
    assert_eq!(a.task.as_ref().unwrap().source_commit, base);
    let ask = |id: u64, repo: &str, commit: &str, namespace: &str| {
        w.send(worker_message::Msg::SourceRequest(v1::SourceRequest {
            id,
            repo: repo.into(),
            commit: commit.into(),
            namespace: namespace.into(),
            ..v1::SourceRequest::default()
        }));
    };
    ask(1, "r1", &base, "team-a");
    ask(2, "r1", &"b".repeat(40), "team-b");
    ask(3, "r2", &base, "team-b");
    let mut answers: std::collections::BTreeMap<u64, (Vec<u8>, String)> = Default::default();
    while answers.len() < 3 || !answers.values().all(|(_, e)| e != "pending") {
        match w.next().await {
            coordinator_message::Msg::SourceData(d) => {
                let e = answers
                    .entry(d.request)
                    .or_insert_with(|| (Vec::new(), "pending".into()));
                e.0.extend_from_slice(&d.data);
                if d.done {
                    e.1 = d.error;
                }
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(answers[&1], (b"team b's".to_vec(), String::new()));
    for id in [2, 3] {
        let (data, error) = &answers[&id];
        assert!(data.is_empty(), "{id}: {data:?}");
        assert!(
            error.contains("is not the source of an attempt this worker runs"),
            "{id}: {error}"
        );
    }
}

/// `git` in `dir`, with an identity; its output.
fn git_in(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@t"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

// Real time until the leftovers are stored (they are checked with git, which paused time
// would race), paused from then on.
#[tokio::test]
async fn a_stall_restart_waits_for_what_the_interrupted_attempt_left_and_starts_from_it() {
    let repo = tempfile::tempdir().unwrap();
    git_in(repo.path(), &["init", "-q"]);
    std::fs::write(repo.path().join("a.txt"), "one\n").unwrap();
    git_in(repo.path(), &["add", "."]);
    git_in(repo.path(), &["commit", "-q", "-m", "base"]);
    let base = git_in(repo.path(), &["rev-parse", "HEAD"]);
    std::fs::write(repo.path().join("a.txt"), "left\n").unwrap();
    git_in(repo.path(), &["commit", "-q", "-am", "left"]);
    let partial = git_in(repo.path(), &["rev-parse", "HEAD"]);
    let left = {
        use std::io::Write;
        let mut child = std::process::Command::new("git")
            .arg("-C")
            .arg(repo.path())
            .args(["pack-objects", "--revs", "--stdout", "-q"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let revs = format!("{partial}\n^{base}\n");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(revs.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap().stdout
    };
    let store = crate::store::open("memory://").unwrap();
    let d = spawn_with(
        MemoryLeaseStore::new(),
        DispatchOptions::default(),
        Some(store.clone()),
        CancellationToken::new(),
    );
    let mut w = FakeWorker::attach(&d, 4);
    let (tx, _events) = mpsc::unbounded_channel();
    let run: Arc<str> = Arc::from("wf_salvage");
    crate::source::put_pack(
        &store,
        &crate::source::Repo::new("", "r1").unwrap(),
        &base,
        vec![],
        b"the source".to_vec(),
    )
    .await
    .unwrap();
    let (_head_tx, head) = tokio::sync::watch::channel(base.clone());
    d.register(RunRegistration {
        run_id: run.clone(),
        concurrency: 4,
        stall_timeout: Duration::from_millis(300),
        max_attempts: 4,
        stagger: Duration::ZERO,
        worker_wait: Duration::from_secs(600),
        retry_budget: None,
        throttle_wait: Duration::from_secs(900),
        head: Some(head),
        events: tx,
        share: crate::sched::Share::default(),
        kept: Default::default(),
    });
    let mut t = ticket(0);
    t.task.source_repo = "r1".into();
    d.submit(&run, t);
    let first = w.assignment().await;
    assert_eq!(first.task.as_ref().unwrap().source_commit, base);
    // Its checkout is made (the stall timer held meanwhile); then its agent stalls.
    w.no_message_for(Duration::from_millis(600)).await;
    w.started(&first);
    assert!(matches!(
        w.next().await,
        coordinator_message::Msg::Cancel(_)
    ));
    // The interrupted attempt answers with what it left: the restart starts from that.
    w.send(worker_message::Msg::Outcome(v1::Outcome {
        run_id: first.run_id.clone(),
        call: 0,
        attempt: first.attempt,
        result: Some(outcome::Result::Failure(v1::Failure {
            kind: FailureKind::Cancelled as i32,
            message: "cancelled".into(),
            retry_after_ms: 0,
            partial: Some(v1::Change {
                repo: "r1".into(),
                base: base.clone(),
                commit: partial.clone(),
                pack: left,
                ..v1::Change::default()
            }),
            session: None,
        })),
        usage: None,
        fence: first.fence,
        call_key: first.call_key.clone(),
    }));
    let second = w.assignment().await;
    tokio::time::pause();
    w.started(&second);
    assert_eq!(second.attempt, 2);
    let task = second.task.as_ref().unwrap();
    assert_eq!(
        (&task.source_commit, &task.source_partial),
        (&base, &partial)
    );
    let stored = crate::source::chain(
        &store,
        &crate::source::Repo::new("", "r1").unwrap(),
        &partial,
    )
    .await
    .unwrap();
    assert_eq!(
        stored.len(),
        2,
        "the leftovers are in the store: {stored:?}"
    );
    // An attempt that never answers holds the restart back leftovers::WAIT at most, and the
    // next one still starts from the last leftovers.
    assert!(matches!(
        w.next().await,
        coordinator_message::Msg::Cancel(_)
    ));
    let asked = Instant::now();
    let third = w.assignment().await;
    w.started(&third);
    assert_eq!(third.attempt, 3);
    let waited = asked.elapsed();
    assert!(
        waited >= leftovers::WAIT && waited < leftovers::WAIT + Duration::from_secs(1),
        "{waited:?}"
    );
    assert_eq!(third.task.as_ref().unwrap().source_partial, partial);
    // Leftovers that do not match the attempt (another base) are not taken.
    assert!(matches!(
        w.next().await,
        coordinator_message::Msg::Cancel(_)
    ));
    w.send(worker_message::Msg::Outcome(v1::Outcome {
        run_id: third.run_id.clone(),
        call: 0,
        attempt: third.attempt,
        result: Some(outcome::Result::Failure(v1::Failure {
            kind: FailureKind::Cancelled as i32,
            message: "cancelled".into(),
            retry_after_ms: 0,
            partial: Some(v1::Change {
                repo: "r1".into(),
                base: "c".repeat(40),
                commit: "d".repeat(40),
                pack: b"objects".to_vec(),
                ..v1::Change::default()
            }),
            session: None,
        })),
        usage: None,
        fence: third.fence,
        call_key: third.call_key.clone(),
    }));
    let fourth = w.assignment().await;
    assert_eq!(fourth.task.as_ref().unwrap().source_partial, partial);
}

#[tokio::test(start_paused = true)]
async fn assignments_never_exceed_free_slots_or_the_run_cap() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 2);
    let (run, mut events) = register(&d, "wf_slots", 10, Duration::from_secs(60));
    for i in 0..5 {
        d.submit(&run, ticket(i));
    }
    let a = w.assignment().await;
    let b = w.assignment().await;
    w.no_message_for(Duration::from_millis(100)).await;
    w.complete(&a, "a");
    let c = w.assignment().await;
    assert_eq!(c.call, 2, "submission order");
    w.no_message_for(Duration::from_millis(100)).await;
    w.complete(&b, "b");
    w.complete(&c, "c");
    let d1 = w.assignment().await;
    let d2 = w.assignment().await;
    w.complete(&d1, "d");
    w.complete(&d2, "e");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(finished(&mut events).await.len(), 5);
}

#[tokio::test(start_paused = true)]
async fn runs_take_turns() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 1);
    let (a, _ea) = register(&d, "wf_a", 10, Duration::from_secs(60));
    let (b, _eb) = register(&d, "wf_b", 10, Duration::from_secs(60));
    for i in 0..3 {
        d.submit(&a, ticket(i));
    }
    for i in 0..3 {
        d.submit(&b, ticket(i));
    }
    let mut order = Vec::new();
    for _ in 0..6 {
        let x = w.assignment().await;
        order.push(x.run_id.clone());
        w.complete(&x, "ok");
    }
    let switches = order.windows(2).filter(|p| p[0] != p[1]).count();
    assert!(switches >= 4, "runs alternate: {order:?}");
}

#[tokio::test(start_paused = true)]
async fn the_stagger_cap_holds_for_the_current_leader_however_long_it_runs() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 8);
    let (tx, _events) = mpsc::unbounded_channel();
    let run: Arc<str> = Arc::from("wf_stagger");
    d.register(RunRegistration {
        run_id: run.clone(),
        concurrency: 8,
        stall_timeout: Duration::from_secs(3600),
        max_attempts: 3,
        stagger: Duration::from_secs(1),
        worker_wait: Duration::from_secs(600),
        retry_budget: None,
        throttle_wait: Duration::from_secs(900),
        head: None,
        events: tx,
        share: crate::sched::Share::default(),
        kept: Default::default(),
    });
    d.submit(&run, ticket(0));
    let leader = w.assignment().await;
    assert_eq!(leader.call, 0);
    d.submit(&run, ticket(1));
    let started = Instant::now();
    let held = w.assignment().await;
    assert_eq!(held.call, 1);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "held until the cap"
    );
    // Long after the cap, the leader still has not answered: new calls go at once.
    tokio::time::sleep(Duration::from_secs(400)).await;
    d.submit(&run, ticket(2));
    let at = Instant::now();
    let late = w.assignment().await;
    assert_eq!(late.call, 2);
    assert!(at.elapsed() < Duration::from_millis(10), "not held again");
}

/// A lease store that behaves like etcd where the memory store is lenient: no immediate
/// writes (the key writer runs), a transaction naming a key twice is refused, and writes
/// of keys under `poison` are refused as etcd refuses a malformed request.
struct EtcdLike {
    inner: Arc<MemoryLeaseStore>,
    poison: Option<String>,
    batches: std::sync::Mutex<Vec<Vec<lease::BatchOp>>>,
}

impl EtcdLike {
    fn new(poison: Option<&str>) -> Arc<Self> {
        Arc::new(EtcdLike {
            inner: MemoryLeaseStore::new(),
            poison: poison.map(str::to_owned),
            batches: std::sync::Mutex::default(),
        })
    }
}

#[async_trait::async_trait]
impl LeaseStore for EtcdLike {
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, lease::Error> {
        self.inner.grant(ttl).await
    }
    async fn keep_alive(&self, l: LeaseId) -> Result<(), lease::Error> {
        self.inner.keep_alive(l).await
    }
    async fn revoke(&self, l: LeaseId) -> Result<(), lease::Error> {
        self.inner.revoke(l).await
    }
    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        l: Option<LeaseId>,
    ) -> Result<Revision, lease::Error> {
        self.inner.put(key, value, l).await
    }
    async fn campaign(
        &self,
        key: &str,
        value: Vec<u8>,
        l: LeaseId,
    ) -> Result<Option<Revision>, lease::Error> {
        self.inner.campaign(key, value, l).await
    }
    async fn get(&self, key: &str) -> Result<Option<lease::KeyValue>, lease::Error> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<lease::KeyValue>, lease::Error> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, key: &str) -> Result<bool, lease::Error> {
        self.inner.delete(key).await
    }
    async fn write_batch(&self, ops: Vec<lease::BatchOp>) -> Result<Revision, lease::Error> {
        self.batches.lock().unwrap().push(ops.clone());
        let mut keys = HashSet::new();
        if !ops.iter().all(|op| keys.insert(op.key().to_owned())) {
            return Err(lease::Error::Refused(
                "etcdserver: duplicate key given in txn request".into(),
            ));
        }
        if let Some(p) = &self.poison
            && ops.iter().any(|op| op.key().starts_with(p.as_str()))
        {
            return Err(lease::Error::Refused(
                "etcdserver: request is too large".into(),
            ));
        }
        self.inner.write_batch(ops).await
    }
    async fn watch(
        &self,
        prefix: &str,
    ) -> Result<mpsc::UnboundedReceiver<WatchEvent>, lease::Error> {
        self.inner.watch(prefix).await
    }
}

/// Waits for `n` `Finished` events of a run.
async fn finished_n(
    rx: &mut mpsc::UnboundedReceiver<CallEvent>,
    n: usize,
) -> Vec<(u64, CallResult)> {
    let mut out = Vec::new();
    while out.len() < n {
        let ev = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .expect("an event")
            .expect("events open");
        keep_finished(ev, &mut out);
    }
    out
}

#[tokio::test(start_paused = true)]
async fn a_spent_budget_ends_the_calls_that_have_not_started_and_lets_running_ones_finish() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 1);
    let (run, mut events) = register(&d, "wf_budget", 1, Duration::from_secs(600));
    for call in 0..3 {
        d.submit(&run, ticket(call));
    }
    let running = w.assignment().await;
    assert_eq!(running.call, 0);
    d.budget_spent(&run, "token budget exceeded (9 / 9 output tokens)");
    let ended = finished_n(&mut events, 2).await;
    let mut calls: Vec<u64> = ended.iter().map(|(c, _)| *c).collect();
    calls.sort_unstable();
    assert_eq!(calls, [1, 2], "only the calls that had not started end");
    for (_, r) in &ended {
        assert!(
            matches!(r, CallResult::Failed { failure: CallFailure::Budget, message } if message.contains("9 / 9")),
            "{r:?}"
        );
    }
    // The running one completes, and what is submitted later ends at dispatch.
    w.complete(&running, "done");
    d.submit(&run, ticket(3));
    let later = finished_n(&mut events, 2).await;
    assert!(
        matches!(later[0], (0, CallResult::Completed(_))),
        "{later:?}"
    );
    assert!(
        matches!(
            later[1],
            (
                3,
                CallResult::Failed {
                    failure: CallFailure::Budget,
                    ..
                }
            )
        ),
        "{later:?}"
    );
    w.no_message_for(Duration::from_millis(200)).await;
}

#[tokio::test(start_paused = true)]
async fn a_stop_that_meets_an_outcome_already_in_keeps_the_result() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 2);
    let (run, mut events) = register(&d, "wf_stop_race", 2, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    d.submit(&run, ticket(1));
    let a0 = w.assignment().await;
    let a1 = w.assignment().await;
    w.complete(&a0, "kept");
    // The run stops both once call 0's outcome is in: call 0 keeps its result.
    let first = finished_n(&mut events, 1).await;
    d.stop_call(&run, 0, CallFailure::Budget, "money budget exceeded");
    d.stop_call(&run, 1, CallFailure::Budget, "money budget exceeded");
    let rest = finished_n(&mut events, 1).await;
    assert!(
        matches!(&first[0], (0, CallResult::Completed(c)) if c.text == "kept"),
        "{first:?}"
    );
    assert!(
        matches!(
            rest[0],
            (
                1,
                CallResult::Failed {
                    failure: CallFailure::Budget,
                    ..
                }
            )
        ),
        "{rest:?}"
    );
    match w.next().await {
        coordinator_message::Msg::Cancel(c) => assert_eq!((c.call, c.attempt), (a1.call, 1)),
        other => panic!("expected a cancel of call 1, got {other:?}"),
    }
    w.no_message_for(Duration::from_millis(200)).await;
    let again = finished(&mut events).await;
    assert!(again.is_empty(), "each call ends once: {again:?}");
}

/// A worker whose model server caches prefixes locally, as its `Hello` says.
fn attach_caching(d: &DispatchHandle, name: &str, slots: u32) -> FakeWorker {
    let account = v1::Account {
        backend: "echo".into(),
        id: format!("echo@{name}"),
        local_cache: true,
        ..v1::Account::default()
    };
    FakeWorker::attach_with_accounts(d, name, slots, &[], &["echo"], vec![account])
}

fn grouped(call: u64, group: u64) -> Ticket {
    Ticket {
        prefix_group: group,
        ..ticket(call)
    }
}

/// Prefix affinity: once a worker with a local prefix cache served a group, the group's calls
/// go back to it — when it has room, and past queued calls whose worker is full — and without
/// affinity they go wherever most slots are free.
#[tokio::test(start_paused = true)]
async fn calls_sharing_a_prefix_go_back_to_the_worker_that_served_it() {
    for affinity in [true, false] {
        let d = spawn_with(
            MemoryLeaseStore::new(),
            DispatchOptions {
                admission: false,
                affinity,
                ..DispatchOptions::default()
            },
            None,
            CancellationToken::new(),
        );
        let mut a = attach_caching(&d, "a", 2);
        let mut b = attach_caching(&d, "b", 2);
        let (run, _events) = register(
            &d,
            &format!("wf_affinity-{affinity}"),
            4,
            Duration::from_secs(600),
        );
        // The first calls of groups 10 and 20: a (most free slots, first) then b.
        d.submit(&run, grouped(0, 10));
        let first = a.assignment().await;
        d.submit(&run, grouped(1, 20));
        let second = b.assignment().await;
        assert_eq!((first.call, second.call), (0, 1));
        a.complete(&first, "x");
        b.complete(&second, "x");
        tokio::time::sleep(Duration::from_millis(10)).await;
        // Group 20 first: with affinity both its calls go to b, group 10's to a.
        for (call, group) in [(2, 20), (3, 20), (4, 10), (5, 10)] {
            d.submit(&run, grouped(call, group));
        }
        let on_a = vec![a.assignment().await, a.assignment().await];
        let on_b = vec![b.assignment().await, b.assignment().await];
        let calls = |v: &[v1::Assignment]| {
            let mut c: Vec<u64> = v.iter().map(|a| a.call).collect();
            c.sort_unstable();
            c
        };
        if !affinity {
            assert_ne!(calls(&on_b), [2, 3], "without affinity, free slots decide");
            continue;
        }
        assert_eq!((calls(&on_a), calls(&on_b)), (vec![4, 5], vec![2, 3]));
        // Full, with group 20's call (b's) queued before group 10's (a's): a slot frees on a,
        // and group 10's call takes it; group 20's waits for b.
        d.submit(&run, grouped(6, 20));
        d.submit(&run, grouped(7, 10));
        tokio::time::sleep(Duration::from_millis(10)).await;
        a.complete(&on_a[0], "x");
        assert_eq!(a.assignment().await.call, 7);
        b.complete(&on_b[0], "x");
        assert_eq!(b.assignment().await.call, 6);
    }
}

/// A stopped run is `stopping` while its agents are still on their workers: once the run is
/// closed, each attempt a worker holds stays in flight until that worker answers its cancel.
#[tokio::test(start_paused = true)]
async fn a_closed_run_s_attempts_are_in_flight_until_their_worker_answers_the_cancel() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 4);
    let (run, _events) = register(&d, "wf_drain", 4, Duration::from_secs(300));
    let (other, _other_events) = register(&d, "wf_other", 4, Duration::from_secs(300));
    d.submit(&run, ticket(0));
    d.submit(&run, ticket(1));
    let a = w.assignment().await;
    let b = w.assignment().await;
    d.submit(&other, ticket(0));
    let o = w.assignment().await;
    assert_eq!(d.in_flight(&run).await, 2);
    d.close_run(&run);
    for _ in 0..2 {
        match w.next().await {
            coordinator_message::Msg::Cancel(c) => assert_eq!(c.run_id, "wf_drain"),
            other => panic!("expected a cancel, got {other:?}"),
        }
    }
    assert_eq!(d.in_flight(&run).await, 2, "cancelled, not answered yet");
    let cancelled = |a: &v1::Assignment| {
        worker_message::Msg::Outcome(v1::Outcome {
            run_id: a.run_id.clone(),
            call: a.call,
            attempt: a.attempt,
            result: Some(outcome::Result::Failure(v1::Failure {
                kind: v1::FailureKind::Cancelled as i32,
                message: "cancelled".into(),
                ..v1::Failure::default()
            })),
            usage: None,
            fence: a.fence,
            call_key: a.call_key.clone(),
        })
    };
    // The worker's messages reach the dispatcher through its link's task.
    let settle = || tokio::time::sleep(Duration::from_millis(10));
    w.send(cancelled(&a));
    settle().await;
    assert_eq!(d.in_flight(&run).await, 1);
    // Another run's outcome, or a forged one for the attempt that is left, frees nothing.
    w.complete(&o, "other run");
    let mut forged = b.clone();
    forged.fence += 1;
    w.send(cancelled(&forged));
    settle().await;
    assert_eq!(d.in_flight(&run).await, 1);
    w.send(cancelled(&b));
    settle().await;
    assert_eq!(d.in_flight(&run).await, 0);
    assert_eq!(d.in_flight(&other).await, 0);
}

/// Issue 33, 3: the conversation an interrupted attempt hands back goes to the call's next
/// attempt, whichever worker takes it; a later attempt's replaces it; one over the size
/// limit is not kept; and the call's end drops it.
#[tokio::test(start_paused = true)]
async fn an_interrupted_attempt_s_conversation_goes_to_the_call_s_next_attempt() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach_offering(&d, "w1", 1, &[], &["claude-code"]);
    let (run, mut events) = register(&d, "wf_talk", 1, Duration::from_secs(300));
    let mut t = ticket(0);
    t.task.backend = "claude-code".into();
    d.submit(&run, t);
    let session = |attempt_said: &str, bytes: usize| v1::Session {
        backend: "claude-code".into(),
        id: "6f1c2d3e-4a5b-4c6d-8e7f-0123456789ab".into(),
        state: vec![b'x'; bytes.max(1)],
        prompt_sha256: attempt_said.into(),
        turns: 2,
        attempt: 0,
    };
    let failed = |a: &v1::Assignment, s: Option<v1::Session>| {
        worker_message::Msg::Outcome(v1::Outcome {
            run_id: a.run_id.clone(),
            call: a.call,
            attempt: a.attempt,
            result: Some(outcome::Result::Failure(v1::Failure {
                kind: v1::FailureKind::Retryable as i32,
                message: "the connection dropped".into(),
                session: s,
                ..v1::Failure::default()
            })),
            usage: None,
            fence: a.fence,
            call_key: a.call_key.clone(),
        })
    };
    let first = w.assignment().await;
    assert_eq!(first.task.as_ref().unwrap().session, None);
    w.send(failed(&first, Some(session("one", 10))));
    let second = w.assignment().await;
    let given = second
        .task
        .as_ref()
        .unwrap()
        .session
        .clone()
        .expect("a session");
    assert_eq!(
        (given.prompt_sha256.as_str(), given.attempt),
        ("one", first.attempt)
    );
    // Too big to keep: the next attempt continues the one before.
    w.send(failed(
        &second,
        Some(session("two", flotilla_proto::frag::MAX_SESSION_BYTES + 1)),
    ));
    let third = w.assignment().await;
    let given = third
        .task
        .as_ref()
        .unwrap()
        .session
        .clone()
        .expect("a session");
    assert_eq!(given.prompt_sha256, "one");
    w.complete(&third, "done");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let done = finished(&mut events).await;
    assert_eq!(done.len(), 1, "{done:?}");
    // A new call of the same run starts with nothing of the last one's.
    let mut t = ticket(1);
    t.task.backend = "claude-code".into();
    d.submit(&run, t);
    assert_eq!(w.assignment().await.task.as_ref().unwrap().session, None);
}

/// `flotilla restart --fresh`: the new attempt gets nothing of the session the abandoned one
/// hands back; a plain restart continues it.
#[tokio::test(start_paused = true)]
async fn a_fresh_restart_keeps_nothing_of_the_abandoned_attempt_s_session() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach_offering(&d, "w1", 1, &[], &["claude-code"]);
    let (run, _events) = register(&d, "wf_fresh", 1, Duration::from_secs(300));
    let mut t = ticket(0);
    t.task.backend = "claude-code".into();
    d.submit(&run, t);
    let cancelled_with_session = |a: &v1::Assignment| {
        worker_message::Msg::Outcome(v1::Outcome {
            run_id: a.run_id.clone(),
            call: a.call,
            attempt: a.attempt,
            result: Some(outcome::Result::Failure(v1::Failure {
                kind: v1::FailureKind::Cancelled as i32,
                message: "cancelled".into(),
                session: Some(v1::Session {
                    backend: "claude-code".into(),
                    state: b"turns".to_vec(),
                    turns: 3,
                    ..v1::Session::default()
                }),
                ..v1::Failure::default()
            })),
            usage: None,
            fence: a.fence,
            call_key: a.call_key.clone(),
        })
    };
    let first = w.assignment().await;
    w.started(&first);
    d.restart_call(&run, 0, false);
    assert!(matches!(
        w.next().await,
        coordinator_message::Msg::Cancel(_)
    ));
    w.send(cancelled_with_session(&first));
    let second = w.assignment().await;
    assert_eq!(
        second
            .task
            .as_ref()
            .unwrap()
            .session
            .as_ref()
            .map(|s| s.turns),
        Some(3),
        "a plain restart continues"
    );
    w.started(&second);
    d.restart_call(&run, 0, true);
    assert!(matches!(
        w.next().await,
        coordinator_message::Msg::Cancel(_)
    ));
    w.send(cancelled_with_session(&second));
    let third = w.assignment().await;
    assert_eq!(
        third.task.as_ref().unwrap().session,
        None,
        "a fresh one starts over"
    );
}
