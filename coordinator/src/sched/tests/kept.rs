//! What an interrupted attempt left is in the store too (issue 33, 3): a dispatcher of another
//! coordinator, registering the run adopted with what `kept::load` reads, gives the call's next
//! attempt the conversation; the call's end deletes it.

use super::*;

/// A claude-code call of `run` whose key is `k{call}`.
fn talking(call: u64) -> Ticket {
    let mut t = ticket(call);
    t.task.backend = "claude-code".into();
    t
}

/// Waits (in paused time, letting the writer's task run) until `run`'s kept leftovers are as
/// `want` says: how many calls, and each one's session turns.
async fn kept_until(store: &crate::store::Store, run: &str, want: &[(&str, u32)]) {
    for _ in 0..200 {
        let kept = super::super::kept::load(store, run).await;
        let mut seen: Vec<(&str, u32)> = kept
            .iter()
            .map(|(k, v)| (k.as_str(), v.session.as_ref().map_or(0, |s| s.turns)))
            .collect();
        seen.sort();
        if seen == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let kept = super::super::kept::load(store, run).await;
    panic!("the store never held {want:?}: {kept:?}");
}

#[tokio::test(start_paused = true)]
async fn a_coordinator_that_adopts_a_run_continues_the_conversation_the_last_one_kept() {
    let store = crate::store::open("memory://").unwrap();
    let first_one = CancellationToken::new();
    let d = spawn_with(
        MemoryLeaseStore::new(),
        DispatchOptions::default(),
        Some(store.clone()),
        first_one.clone(),
    );
    let mut w = FakeWorker::attach_offering(&d, "w1", 1, &[], &["claude-code"]);
    let (run, _events) = register(&d, "wf_kept", 1, Duration::from_secs(300));
    d.submit(&run, talking(0));
    d.submit(&run, talking(1));
    let first = w.assignment().await;
    w.send(worker_message::Msg::Outcome(v1::Outcome {
        run_id: first.run_id.clone(),
        call: first.call,
        attempt: first.attempt,
        result: Some(outcome::Result::Failure(v1::Failure {
            kind: v1::FailureKind::Retryable as i32,
            message: "the connection dropped".into(),
            session: Some(v1::Session {
                backend: "claude-code".into(),
                state: b"four turns".to_vec(),
                prompt_sha256: "p".into(),
                turns: 4,
                ..v1::Session::default()
            }),
            ..v1::Failure::default()
        })),
        usage: None,
        fence: first.fence,
        call_key: first.call_key.clone(),
    }));
    kept_until(&store, "wf_kept", &[(first.call_key.as_str(), 4)]).await;
    // This coordinator is gone; the next one adopts the run and replays it.
    first_one.cancel();
    drop(w);
    let d2 = spawn_with(
        MemoryLeaseStore::new(),
        DispatchOptions::default(),
        Some(store.clone()),
        CancellationToken::new(),
    );
    let mut w2 = FakeWorker::attach_offering(&d2, "w2", 1, &[], &["claude-code"]);
    let kept = super::super::kept::load(&store, "wf_kept").await;
    let (run, mut events) = register_kept(&d2, "wf_kept", 1, Duration::from_secs(300), kept);
    d2.submit(&run, talking(0));
    let next = w2.assignment().await;
    let given = next.task.as_ref().unwrap().session.clone();
    assert_eq!(
        given.as_ref().map(|s| (s.state.as_slice(), s.turns)),
        Some((&b"four turns"[..], 4)),
        "the adopted call continues the conversation kept in the store"
    );
    w2.complete(&next, "done");
    kept_until(&store, "wf_kept", &[]).await;
    // The other call, never interrupted, starts with nothing.
    d2.submit(&run, talking(1));
    let other = w2.assignment().await;
    assert_eq!(other.task.as_ref().unwrap().session, None);
    w2.complete(&other, "done");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(finished(&mut events).await.len(), 2);
}

/// A running attempt's checkpoints (issue 33, 3): the newest one from the worker that holds the
/// attempt is what the call's next attempt continues when that worker is lost; one sent by
/// another worker for an attempt it does not hold is dropped.
#[tokio::test(start_paused = true)]
async fn a_lost_worker_s_agent_continues_from_its_last_checkpoint_and_no_one_else_s() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut first = FakeWorker::attach_offering(&d, "w1", 1, &[], &["claude-code"]);
    let (run, mut events) = register(&d, "wf_lost_talk", 1, Duration::from_secs(600));
    d.submit(&run, talking(0));
    let a = first.assignment().await;
    let mut second = FakeWorker::attach_offering(&d, "w2", 1, &[], &["claude-code"]);
    let checkpoint = |turns: u32| {
        worker_message::Msg::Progress(v1::Progress {
            run_id: a.run_id.clone(),
            call: a.call,
            attempt: a.attempt,
            kind: ProgressKind::SessionCheckpoint as i32,
            session: Some(v1::Session {
                backend: "claude-code".into(),
                state: format!("{turns} turns").into_bytes(),
                turns,
                ..v1::Session::default()
            }),
            ..v1::Progress::default()
        })
    };
    first.send(checkpoint(2));
    first.send(checkpoint(3));
    // The other worker forges one for the attempt it was never given.
    second.send(checkpoint(9));
    tokio::time::sleep(Duration::from_millis(10)).await;
    drop(first);
    let b = second.assignment().await;
    assert_eq!((b.call, b.attempt), (0, 2));
    let given = b.task.as_ref().unwrap().session.clone();
    assert_eq!(
        given.map(|s| (s.turns, s.state)),
        Some((3, b"3 turns".to_vec())),
        "the holder's newest checkpoint, not the forged one"
    );
    second.complete(&b, "done");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(finished(&mut events).await.len(), 1);
}
