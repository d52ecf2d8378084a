//! The fleet under the dispatcher: workers lost, back in time or too late, runs taken over,
//! attempt keys the store refuses, calls no attached worker can run.

use super::*;

#[tokio::test(start_paused = true)]
async fn a_lost_worker_s_attempts_restart_elsewhere_once_its_lease_lapses() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut first = FakeWorker::attach(&d, 1);
    let (run, mut events) = register(&d, "wf_lost", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    let a = first.assignment().await;
    assert_eq!(a.attempt, 1);
    assert!(a.fence > 0, "the assignment carries its key's revision");
    let mut second = FakeWorker::attach(&d, 1);
    drop(first);
    // The first worker may come back within its lease TTL: nothing moves before that.
    second.no_message_for(WORKER_LEASE_TTL * 9 / 10).await;
    let b = second.assignment().await;
    assert_eq!((b.call, b.attempt), (0, 2));
    assert!(b.fence > a.fence);
    second.complete(&b, "done");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let done = finished(&mut events).await;
    assert_eq!(done.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_worker_that_comes_back_in_time_keeps_its_attempts() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut first = FakeWorker::attach_as(&d, "w1", 1, &[]);
    let mut other = FakeWorker::attach(&d, 1);
    let (run, mut events) = register(&d, "wf_back", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    let a = tokio::select! {
        a = first.assignment() => a,
        _ = other.assignment() => panic!("the first worker has more free slots"),
    };
    drop(first);
    tokio::time::sleep(WORKER_LEASE_TTL / 2).await;
    let mut back = FakeWorker::attach_as(&d, "w1", 1, &[&a]);
    back.no_message_for(WORKER_LEASE_TTL * 2).await;
    other.no_message_for(Duration::from_millis(1)).await;
    back.complete(&a, "kept");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let done = finished(&mut events).await;
    assert_eq!(done.len(), 1);
    match &done[0].1 {
        CallResult::Completed(c) => assert_eq!(c.text, "kept"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn an_outcome_sent_right_after_the_reattaching_hello_is_accepted() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut first = FakeWorker::attach_as(&d, "w1", 1, &[]);
    let (run, mut events) = register(&d, "wf_burst", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    let a = first.assignment().await;
    drop(first);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Hello and the kept outcome in one burst, before the dispatcher has seen either.
    let back = FakeWorker::attach_as(&d, "w1", 1, &[&a]);
    back.complete(&a, "kept");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let done = finished(&mut events).await;
    assert_eq!(done.len(), 1, "the kept outcome is accepted");
    // And the slot came back: the next call goes to the same worker.
    let mut back = back;
    d.submit(&run, ticket(1));
    let b = back.assignment().await;
    assert_eq!(b.call, 1);
}

#[tokio::test(start_paused = true)]
async fn a_link_that_closes_before_its_hello_is_handled_leaves_the_worker_cut_off() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut first = FakeWorker::attach_as(&d, "w1", 1, &[]);
    let (run, mut events) = register(&d, "wf_flap", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    let a = first.assignment().await;
    drop(first);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Reattaches and vanishes at once; it never comes back.
    drop(FakeWorker::attach_as(&d, "w1", 1, &[&a]));
    let mut other = FakeWorker::attach_as(&d, "w2", 1, &[]);
    let b = other.assignment().await;
    assert_eq!(
        (b.call, b.attempt),
        (0, 2),
        "restarted once w1's lease lapsed"
    );
    other.complete(&b, "done");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(finished(&mut events).await.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_run_taken_over_claims_the_attempts_workers_still_run() {
    // A fresh dispatcher (the new coordinator); the worker still runs attempt 3 of call 0
    // from the old one, and one attempt of a call whose key no longer matches.
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let held = v1::Assignment {
        run_id: "wf_taken".into(),
        call: 0,
        attempt: 3,
        call_key: "k0".into(),
        fence: 99,
        ..v1::Assignment::default()
    };
    let stale = v1::Assignment {
        run_id: "wf_taken".into(),
        call: 1,
        attempt: 1,
        call_key: "not-k1".into(),
        fence: 98,
        ..v1::Assignment::default()
    };
    let mut w = FakeWorker::attach_as(&d, "w1", 4, &[&held, &stale]);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (run, mut events) = register(&d, "wf_taken", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    d.submit(&run, ticket(1));
    // Call 1 is a new attempt; call 0 is not sent again.
    let a = w.assignment().await;
    assert_eq!((a.call, a.attempt), (1, 1));
    // The stale attempt is cancelled once nobody claimed it.
    match w.next().await {
        coordinator_message::Msg::Cancel(c) => assert_eq!((c.call, c.attempt), (1, 1)),
        other => panic!("expected a cancel, got {other:?}"),
    }
    w.complete(&held, "kept across the failover");
    w.complete(&a, "new");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut done = finished(&mut events).await;
    done.sort_by_key(|(c, _)| *c);
    assert_eq!(done.len(), 2, "{done:?}");
    match &done[0].1 {
        CallResult::Completed(c) => assert_eq!(c.text, "kept across the failover"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn orphans_keep_their_slots_until_claimed_so_no_other_orphan_s_call_starts_there() {
    // After a failover, w1 is back first and holds calls 2 and 3 of the run; w2, still on
    // its way, holds calls 0 and 1. The run is taken over and submits 0 and 1 first: they
    // must wait for w2 instead of starting again in w1's slots, which would leave w1's own
    // attempts unclaimed and cancelled.
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let held = |call: u64| v1::Assignment {
        run_id: "wf_busy".into(),
        call,
        attempt: 1,
        call_key: format!("k{call}"),
        fence: 10 + call as i64,
        ..v1::Assignment::default()
    };
    let (h0, h1, h2, h3) = (held(0), held(1), held(2), held(3));
    let mut w1 = FakeWorker::attach_as(&d, "w1", 2, &[&h2, &h3]);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (run, mut events) = register(&d, "wf_busy", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    d.submit(&run, ticket(1));
    w1.no_message_for(Duration::from_millis(50)).await;
    d.submit(&run, ticket(2));
    d.submit(&run, ticket(3));
    let mut w2 = FakeWorker::attach_as(&d, "w2", 2, &[&h0, &h1]);
    tokio::time::sleep(Duration::from_millis(10)).await;
    for (w, a) in [(&w1, &h2), (&w1, &h3), (&w2, &h0), (&w2, &h1)] {
        w.complete(a, &format!("kept {}", a.call));
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut done = finished(&mut events).await;
    done.sort_by_key(|(c, _)| *c);
    assert_eq!(done.len(), 4, "{done:?}");
    for (call, r) in &done {
        match r {
            CallResult::Completed(c) => assert_eq!(c.text, format!("kept {call}")),
            other => panic!("call {call}: {other:?}"),
        }
    }
    // Nothing was started again, and no orphan was cancelled.
    w1.no_message_for(Duration::from_millis(50)).await;
    w2.no_message_for(Duration::from_millis(50)).await;
}

#[tokio::test(start_paused = true)]
async fn an_outcome_sent_before_the_run_is_taken_over_is_kept_for_it() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let held = v1::Assignment {
        run_id: "wf_early".into(),
        call: 0,
        attempt: 2,
        call_key: "k0".into(),
        fence: 42,
        ..v1::Assignment::default()
    };
    let mut w = FakeWorker::attach_as(&d, "w1", 2, &[&held]);
    // Finished while its coordinator was gone: the outcome follows the Hello at once.
    w.complete(&held, "done before the takeover");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (run, mut events) = register(&d, "wf_early", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let done = finished(&mut events).await;
    assert_eq!(done.len(), 1, "{done:?}");
    match &done[0].1 {
        CallResult::Completed(c) => assert_eq!(c.text, "done before the takeover"),
        other => panic!("{other:?}"),
    }
    // Nothing was sent again, and the slot is free for the next call.
    d.submit(&run, ticket(1));
    let a = w.assignment().await;
    assert_eq!(a.call, 1);
}

#[tokio::test(start_paused = true)]
async fn a_worker_that_comes_back_without_an_attempt_loses_it_at_once() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut first = FakeWorker::attach_as(&d, "w1", 1, &[]);
    let (run, _events) = register(&d, "wf_forgot", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    let a = first.assignment().await;
    drop(first);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut back = FakeWorker::attach_as(&d, "w1", 1, &[]);
    let b = tokio::time::timeout(Duration::from_secs(1), back.assignment())
        .await
        .expect("restarted without waiting for the lease");
    assert_eq!((b.call, b.attempt), (a.call, 2));
}

#[tokio::test(start_paused = true)]
async fn a_worker_back_after_its_lease_lapsed_is_fenced() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut first = FakeWorker::attach_as(&d, "w1", 1, &[]);
    let (run, mut events) = register(&d, "wf_late", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    let a = first.assignment().await;
    drop(first);
    let mut second = FakeWorker::attach_as(&d, "w2", 1, &[]);
    let b = second.assignment().await;
    assert_eq!(b.attempt, 2);
    // Back too late, still holding attempt 1: told to stop it, and its outcome is dropped.
    let mut late = FakeWorker::attach_as(&d, "w1", 1, &[&a]);
    match late.next().await {
        coordinator_message::Msg::Cancel(c) => assert_eq!((c.call, c.attempt), (0, 1)),
        other => panic!("expected a cancel, got {other:?}"),
    }
    late.complete(&a, "zombie");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(finished(&mut events).await.is_empty());
    second.complete(&b, "real");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let done = finished(&mut events).await;
    assert_eq!(done.len(), 1);
    match &done[0].1 {
        CallResult::Completed(c) => assert_eq!(c.text, "real"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_worker_with_another_protocol_major_is_refused() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let (mut link, end) = link_pair();
    d.attach(end);
    link.tx
        .send(WorkerMessage {
            msg: Some(worker_message::Msg::Hello(v1::Hello {
                protocol_version: "9.0".into(),
                slots: 4,
                ..v1::Hello::default()
            })),
        })
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), link.rx.recv())
        .await
        .unwrap();
    assert!(got.is_none(), "the link is closed without a welcome");
    assert_eq!(d.stats().await.unwrap().workers, 0);
}

#[tokio::test(start_paused = true)]
async fn a_stall_restart_writes_each_attempt_key_once_per_batch_and_the_next_run_goes_on() {
    let store = EtcdLike::new(None);
    let d = spawn(store.clone(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 4);
    let (run, mut events) = register(&d, "wf_twice", 4, Duration::from_millis(300));
    d.submit(&run, ticket(0));
    let first = w.assignment().await;
    // No progress: the restart deletes attempt 1's key and puts attempt 2's.
    match w.next().await {
        coordinator_message::Msg::Cancel(c) => assert_eq!(c.attempt, 1),
        other => panic!("expected a cancel, got {other:?}"),
    }
    let second = w.assignment().await;
    assert_eq!((second.call, second.attempt), (0, 2));
    assert!(second.fence > first.fence);
    w.complete(&second, "done");
    // Another run on the same dispatcher is not held up by the first one's keys.
    let (other, mut other_events) = register(&d, "wf_after", 4, Duration::from_secs(60));
    d.submit(&other, ticket(0));
    let a = w.assignment().await;
    assert_eq!(&*a.run_id, "wf_after");
    w.complete(&a, "after");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(finished(&mut events).await.len(), 1);
    assert_eq!(finished(&mut other_events).await.len(), 1);
    for batch in store.batches.lock().unwrap().iter() {
        let mut keys = HashSet::new();
        assert!(
            batch.iter().all(|op| keys.insert(op.key().to_owned())),
            "a batch named a key twice: {batch:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_key_the_store_refuses_fails_its_call_and_blocks_nothing_else() {
    let store = EtcdLike::new(Some("/flotilla/attempts/wf_poison/"));
    let d = spawn(store.clone(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 4);
    let (poison, mut poison_events) = register(&d, "wf_poison", 4, Duration::from_secs(60));
    let (fine, mut fine_events) = register(&d, "wf_fine", 4, Duration::from_secs(60));
    d.submit(&poison, ticket(0));
    d.submit(&fine, ticket(0));
    let a = w.assignment().await;
    assert_eq!(
        &*a.run_id, "wf_fine",
        "only the call whose key was written goes out"
    );
    w.complete(&a, "fine");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let failed = finished(&mut poison_events).await;
    match failed.as_slice() {
        [
            (
                0,
                CallResult::Failed {
                    failure: CallFailure::Terminal,
                    message,
                },
            ),
        ] => {
            assert!(message.contains("request is too large"), "{message}");
        }
        other => panic!("expected the poisoned call to fail, got {other:?}"),
    }
    assert_eq!(finished(&mut fine_events).await.len(), 1);
    // Its slot came back: four more calls go out at once.
    for i in 1..5 {
        d.submit(&fine, ticket(i));
    }
    for _ in 1..5 {
        let a = w.assignment().await;
        w.complete(&a, "more");
    }
}

fn ticket_for(call: u64, backend: &str) -> Ticket {
    let mut t = ticket(call);
    t.task.backend = backend.into();
    t
}

#[tokio::test(start_paused = true)]
async fn a_call_no_worker_can_run_says_why_blocks_nothing_and_fails_after_its_wait() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 2);
    let (run, mut events) = register(&d, "wf_nobackend", 4, Duration::from_secs(600));
    d.submit(&run, ticket_for(0, "claude-code"));
    d.submit(&run, ticket_for(1, "echo"));
    // The echo call behind it goes out at once.
    let a = w.assignment().await;
    assert_eq!(a.call, 1);
    w.complete(&a, "echoed");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut reason = None;
    while let Ok(ev) = events.try_recv() {
        if let CallEvent::Waiting { call: 0, reason: r } = ev {
            reason = r;
        }
    }
    let reason = reason.expect("a reason for the wait");
    assert!(
        reason.contains("no attached worker offers backend \"claude-code\"")
            && reason.contains("echo"),
        "{reason}"
    );
    // Nothing changes until the wait (600 s in `register`) runs out; then it fails.
    tokio::time::sleep(Duration::from_secs(599)).await;
    assert!(finished(&mut events).await.is_empty());
    tokio::time::sleep(Duration::from_secs(2)).await;
    match finished(&mut events).await.as_slice() {
        [
            (
                0,
                CallResult::Failed {
                    failure: CallFailure::Terminal,
                    message,
                },
            ),
        ] => {
            assert!(
                message.contains("claude-code") && message.contains("gave up"),
                "{message}"
            );
        }
        other => panic!("expected call 0 to fail, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_set_aside_runs_once_a_worker_that_offers_its_backend_attaches() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let _echo = FakeWorker::attach(&d, 2);
    let (run, mut events) = register(&d, "wf_later", 4, Duration::from_secs(600));
    d.submit(&run, ticket_for(0, "claude-code"));
    tokio::time::sleep(Duration::from_secs(30)).await;
    let mut claude = FakeWorker::attach_offering(&d, "claude-1", 1, &[], &["claude-code"]);
    let a = claude.assignment().await;
    assert_eq!(a.call, 0);
    claude.complete(&a, "done");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut cleared = false;
    let mut done = 0;
    while let Ok(ev) = events.try_recv() {
        match ev {
            CallEvent::Waiting {
                call: 0,
                reason: None,
            } => cleared = true,
            CallEvent::Finished {
                result: CallResult::Completed(_),
                ..
            } => done += 1,
            _ => {}
        }
    }
    assert!(cleared, "the wait is over once it runs");
    assert_eq!(done, 1);
    // Its old wait never fails it afterwards.
    tokio::time::sleep(Duration::from_secs(900)).await;
    assert!(finished(&mut events).await.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_call_set_aside_whose_worker_is_merely_busy_when_its_wait_ends_keeps_waiting() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let _echo = FakeWorker::attach(&d, 2);
    // (A stall timeout past the worker wait, so only the wait can end a call here.)
    let (run, mut events) = register(&d, "wf_busy", 4, Duration::from_secs(3600));
    d.submit(&run, ticket_for(0, "claude-code"));
    d.submit(&run, ticket_for(1, "claude-code"));
    tokio::time::sleep(Duration::from_secs(30)).await;
    // One slot: call 0 runs, call 1 waits for the slot, past the end of its wait.
    let mut claude = FakeWorker::attach_offering(&d, "claude-1", 1, &[], &["claude-code"]);
    let a = claude.assignment().await;
    tokio::time::sleep(Duration::from_secs(700)).await;
    assert!(
        finished(&mut events).await.is_empty(),
        "a call with a capable worker is not failed for want of one"
    );
    claude.complete(&a, "first");
    let b = claude.assignment().await;
    assert_ne!(a.call, b.call);
    claude.complete(&b, "second");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let done = finished(&mut events).await;
    assert_eq!(done.len(), 2, "{done:?}");
    assert!(
        done.iter()
            .all(|(_, r)| matches!(r, CallResult::Completed(_))),
        "{done:?}"
    );
}
