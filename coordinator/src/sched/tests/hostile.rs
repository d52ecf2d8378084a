//! A worker speaks only for its own attempts, as a hostile one would test it: outcomes under
//! another call's fence or key, into another run, sent twice; usage reports no attempt can
//! reach; transcripts, progress and source requests for attempts it was never given; a second
//! process claiming an attached worker's name.

use super::*;

/// Everything `rx` heard so far.
fn heard(rx: &mut mpsc::UnboundedReceiver<CallEvent>) -> Vec<CallEvent> {
    let mut out = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        out.push(ev);
    }
    out
}

/// The texts of the completed calls, and the usage reports, by call.
type Heard = (Vec<(u64, String)>, Vec<(u64, v1::Usage)>);

/// What `events` say of the calls' results and usage.
fn results_and_usage(events: &[CallEvent]) -> Heard {
    let mut done = Vec::new();
    let mut usage = Vec::new();
    for ev in events {
        match ev {
            CallEvent::Finished {
                call,
                result: CallResult::Completed(c),
            } => done.push((*call, c.text.clone())),
            CallEvent::Finished { call, result } => panic!("call {call} ended {result:?}"),
            CallEvent::Usage { call, usage: u, .. } => usage.push((*call, *u)),
            _ => {}
        }
    }
    done.sort();
    usage.sort_by_key(|(c, _)| *c);
    (done, usage)
}

fn huge() -> v1::Usage {
    v1::Usage {
        input_tokens: 1_000_000_000_000_000,
        output_tokens: 1_000_000_000_000_000,
        cache_read_tokens: u64::MAX,
        cost_usd: 1e12,
        ..v1::Usage::default()
    }
}

fn forged(run: &str, call: u64, attempt: u32, fence: i64, key: &str, text: &str) -> v1::Outcome {
    v1::Outcome {
        run_id: run.into(),
        call,
        attempt,
        result: Some(outcome::Result::Completed(v1::Completed {
            text: text.into(),
            ..v1::Completed::default()
        })),
        usage: Some(huge()),
        fence,
        call_key: key.into(),
    }
}

#[tokio::test(start_paused = true)]
async fn an_outcome_counts_only_for_the_attempt_it_was_given_with_its_key_and_fence() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach_as(&d, "hostile", 2, &[]);
    let (run, mut events) = register(&d, "wf_mine", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    let a = w.assignment().await;
    d.submit(&run, ticket(1));
    let b = w.assignment().await;
    assert_ne!(
        a.fence, b.fence,
        "keys written apart carry fences of their own"
    );
    // Another run (another namespace's), its call on an honest worker.
    let mut honest = FakeWorker::attach_as(&d, "honest", 1, &[]);
    let (other, mut other_events) = register(&d, "wf_theirs", 4, Duration::from_secs(600));
    d.submit(&other, ticket(0));
    let theirs = honest.assignment().await;
    // What the hostile worker tries.
    for o in [
        // Call B's result under call A's fence and key.
        forged(&b.run_id, b.call, b.attempt, a.fence, &a.call_key, "B as A"),
        // Call B under its own fence with another key, and with the other call's key.
        forged(
            &b.run_id,
            b.call,
            b.attempt,
            b.fence,
            "v1:0000000000000000:0",
            "B, no key",
        ),
        forged(
            &b.run_id,
            b.call,
            b.attempt,
            b.fence,
            &a.call_key,
            "B, A's key",
        ),
        // The next attempt of A, not given yet; A with a fence of 0.
        forged(
            &a.run_id,
            a.call,
            a.attempt + 1,
            a.fence,
            &a.call_key,
            "A again",
        ),
        forged(&a.run_id, a.call, a.attempt, 0, &a.call_key, "A unfenced"),
        // Exactly the honest worker's attempt, from the hostile one.
        forged(
            &theirs.run_id,
            theirs.call,
            theirs.attempt,
            theirs.fence,
            &theirs.call_key,
            "stolen",
        ),
        // A run that does not exist here.
        forged("wf_nowhere", 0, 1, a.fence, &a.call_key, "nowhere"),
    ] {
        w.send(worker_message::Msg::Outcome(o));
    }
    w.send(worker_message::Msg::Transcript(v1::TranscriptChunk {
        run_id: theirs.run_id.clone(),
        call: theirs.call,
        attempt: theirs.attempt,
        events: vec!["{\"type\":\"text\",\"text\":\"planted\"}".into()],
    }));
    w.send(worker_message::Msg::Progress(v1::Progress {
        run_id: theirs.run_id.clone(),
        call: theirs.call,
        attempt: theirs.attempt,
        kind: ProgressKind::Output as i32,
        output_tokens: u64::MAX,
        detail: String::new(),
        session: None,
    }));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (done, usage) = results_and_usage(&heard(&mut events));
    assert!(done.is_empty() && usage.is_empty(), "{done:?} {usage:?}");
    let theirs_heard = heard(&mut other_events);
    assert!(
        theirs_heard
            .iter()
            .all(|e| matches!(e, CallEvent::Started { .. })),
        "{theirs_heard:?}"
    );
    // The real outcomes are taken, each once however often it comes.
    w.complete(&a, "A");
    w.complete(&b, "B");
    w.complete(&a, "A, sent again");
    honest.complete(&theirs, "theirs");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (done, usage) = results_and_usage(&heard(&mut events));
    assert_eq!(done, [(0, "A".to_owned()), (1, "B".to_owned())]);
    assert_eq!(
        usage
            .iter()
            .map(|(c, u)| (*c, u.output_tokens))
            .collect::<Vec<_>>(),
        [(0, 1), (1, 1)],
        "one report per attempt, the real ones"
    );
    let (done, usage) = results_and_usage(&heard(&mut other_events));
    assert_eq!(done, [(0, "theirs".to_owned())]);
    assert_eq!(usage.len(), 1);
    // The hostile worker's link goes on: it still gets work.
    d.submit(&run, ticket(2));
    let c = w.assignment().await;
    assert_eq!(c.call, 2);
}

#[tokio::test(start_paused = true)]
async fn an_implausible_usage_report_is_clipped_to_what_one_attempt_can_use() {
    let bounds = UsageBounds {
        context_tokens: 1_000,
        output_tokens: 100,
        requests_at_once: 2,
        requests_per_second: 1,
        ..UsageBounds::default()
    };
    let d = spawn_with(
        MemoryLeaseStore::new(),
        DispatchOptions {
            usage: bounds.clone(),
            ..DispatchOptions::default()
        },
        None,
        CancellationToken::new(),
    );
    let mut w = FakeWorker::attach(&d, 2);
    let (run, mut events) = register(&d, "wf_usage", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    d.submit(&run, ticket(1));
    let a = w.assignment().await;
    let b = w.assignment().await;
    // Its progress is held to the same ceiling (1 s: 2 requests at once, 1 more that second).
    w.send(worker_message::Msg::Progress(v1::Progress {
        run_id: a.run_id.clone(),
        call: a.call,
        attempt: a.attempt,
        kind: ProgressKind::Output as i32,
        output_tokens: u64::MAX,
        detail: String::new(),
        session: None,
    }));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let progress: Vec<u64> = heard(&mut events)
        .into_iter()
        .filter_map(|e| match e {
            CallEvent::Progress { output_tokens, .. } => Some(output_tokens),
            _ => None,
        })
        .collect();
    assert_eq!(progress, [300]);
    // A runs 10 s more: its ceiling grows by 10 requests.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let mut o = forged(&a.run_id, a.call, a.attempt, a.fence, &a.call_key, "A");
    o.usage = Some(v1::Usage {
        cost_usd: f64::NAN,
        ..huge()
    });
    w.send(worker_message::Msg::Outcome(o));
    let honest = v1::Usage {
        input_tokens: 900,
        output_tokens: 80,
        cache_read_tokens: 1_500,
        cost_usd: 0.01,
        tool_calls: 3,
        ..v1::Usage::default()
    };
    let mut o = forged(&b.run_id, b.call, b.attempt, b.fence, &b.call_key, "B");
    o.usage = Some(honest);
    w.send(worker_message::Msg::Outcome(o));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (done, usage) = results_and_usage(&heard(&mut events));
    assert_eq!(done.len(), 2, "both results are taken: {done:?}");
    // 2 at once plus 1 a second for the 11 s (rounded up) A held its slot.
    let requests = 2 + 11;
    assert_eq!(
        usage[0].1,
        v1::Usage {
            input_tokens: requests * 1_000,
            output_tokens: requests * 100,
            cache_read_tokens: requests * 1_000,
            cost_usd: 0.0,
            ..v1::Usage::default()
        },
        "clipped, and a cost that is no number counts nothing"
    );
    assert_eq!(
        usage[1].1, honest,
        "a plausible report is counted as it came"
    );
}

#[tokio::test(start_paused = true)]
async fn a_worker_fetches_only_the_sources_of_the_attempts_it_runs() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let mut w = FakeWorker::attach(&d, 1);
    let (run, _events) = register(&d, "wf_src", 4, Duration::from_secs(600));
    let base = "a".repeat(40);
    let mut t = ticket(0);
    t.task.source_repo = "r1".into();
    t.task.source_commit = base.clone();
    d.submit(&run, t);
    let a = w.assignment().await;
    assert_eq!(a.task.as_ref().unwrap().source_commit, base);
    let ask = |id: u64, repo: &str, commit: &str| {
        w.send(worker_message::Msg::SourceRequest(v1::SourceRequest {
            id,
            repo: repo.into(),
            commit: commit.into(),
            ..v1::SourceRequest::default()
        }));
    };
    // Another repository (another namespace's), another commit of its own repository.
    ask(1, "r2", &base);
    ask(2, "r1", &"b".repeat(40));
    // Its own attempt's source passes the check (this dispatcher keeps no sources to send).
    ask(3, "r1", &base);
    let mut answers = Vec::new();
    while answers.len() < 3 {
        match w.next().await {
            coordinator_message::Msg::SourceData(s) => answers.push((s.request, s.error)),
            other => panic!("{other:?}"),
        }
    }
    answers.sort();
    assert!(
        answers[0]
            .1
            .contains("is not the source of an attempt this worker runs"),
        "{answers:?}"
    );
    assert!(
        answers[1]
            .1
            .contains("is not the source of an attempt this worker runs"),
        "{answers:?}"
    );
    assert_eq!(answers[2].1, "this coordinator keeps no sources");
}

#[tokio::test(start_paused = true)]
async fn a_second_process_claiming_an_attached_worker_s_name_is_refused_naming_both() {
    let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let hello = |incarnation: &str| v1::Hello {
        protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
        name: "w1".into(),
        backends: vec!["echo".into()],
        slots: 1,
        incarnation: incarnation.into(),
        ..v1::Hello::default()
    };
    let attach = |incarnation: &str, peer: &str| {
        let (link, end) = link_pair();
        link.tx
            .send(WorkerMessage {
                msg: Some(worker_message::Msg::Hello(hello(incarnation))),
            })
            .unwrap();
        (FakeWorker { link }, d.attach_remote(end, peer))
    };
    let (mut first, verdict) = attach("one", "10.0.0.1:40000");
    assert_eq!(verdict.await.unwrap(), Ok(()));
    // Another process with the same name, and one that says no incarnation at all.
    for (incarnation, peer) in [("two", "10.0.0.2:40001"), ("", "10.0.0.3:40002")] {
        let (mut second, verdict) = attach(incarnation, peer);
        let refused = verdict.await.unwrap().unwrap_err();
        assert_eq!(
            refused,
            NameTaken {
                name: "w1".into(),
                attached_from: "10.0.0.1:40000".into(),
                refused_from: peer.into(),
            }
        );
        let said = refused.to_string();
        assert!(
            said.contains("10.0.0.1:40000") && said.contains(peer) && said.contains("--name"),
            "{said}"
        );
        assert!(second.link.rx.recv().await.is_none(), "its link is closed");
    }
    // The attached one never noticed, and keeps serving.
    let (run, mut events) = register(&d, "wf_named", 4, Duration::from_secs(600));
    d.submit(&run, ticket(0));
    let a = first.assignment().await;
    first.complete(&a, "served");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(finished(&mut events).await.len(), 1);
    // The same process, back before its old link closed, takes its own place.
    let (mut back, verdict) = attach("one", "10.0.0.1:40003");
    assert_eq!(verdict.await.unwrap(), Ok(()));
    assert!(
        first.link.rx.recv().await.is_none(),
        "the old link is closed"
    );
    d.submit(&run, ticket(1));
    assert_eq!(back.assignment().await.call, 1);
}
