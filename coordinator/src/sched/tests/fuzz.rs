//! Property-based fuzzing of the dispatcher's worker link (`tools/fuzz` runs it long): a
//! hostile link sends any messages — bytes decoded as protocol messages, and outcomes, hellos
//! and progress with arbitrary fields, including JSON results that are not JSON — and then an
//! honest worker attaches. Every call still ends exactly once, and the dispatcher still works.

use super::*;
use proptest::prelude::*;

fn hostile() -> impl Strategy<Value = WorkerMessage> {
    // Most random bytes do not decode; those send an empty message instead.
    let decoded = prop::collection::vec(any::<u8>(), 0..120).prop_map(|bytes| {
        <WorkerMessage as prost::Message>::decode(bytes.as_slice()).unwrap_or_default()
    });
    let outcome = (
        prop_oneof![Just("wf_fuzz".to_owned()), "[a-z_]{0,8}"],
        0u64..5,
        0u32..4,
        any::<i64>(),
        prop_oneof![Just("k0".to_owned()), "[a-z0-9]{0,4}"],
        prop_oneof![
            "\\PC{0,20}".prop_map(|t| outcome::Result::Completed(v1::Completed {
                text: t.clone(),
                json: Some(t),
                change: None,
                model: String::new(),
            })),
            ("\\PC{0,20}", 0i32..12, any::<u64>()).prop_map(|(m, kind, retry_after_ms)| {
                outcome::Result::Failure(v1::Failure {
                    kind,
                    message: m,
                    retry_after_ms,
                    partial: None,
                    session: None,
                })
            }),
        ],
    )
        .prop_map(
            |(run_id, call, attempt, fence, call_key, result)| WorkerMessage {
                msg: Some(worker_message::Msg::Outcome(v1::Outcome {
                    run_id,
                    call,
                    attempt,
                    result: Some(result),
                    usage: None,
                    fence,
                    call_key,
                })),
            },
        );
    let hello =
        ("\\PC{0,12}", 0u32..4, "\\PC{0,6}").prop_map(|(name, slots, version)| WorkerMessage {
            msg: Some(worker_message::Msg::Hello(v1::Hello {
                protocol_version: if version.is_empty() {
                    flotilla_proto::PROTOCOL_VERSION.into()
                } else {
                    version
                },
                name,
                backends: vec!["echo".into()],
                slots,
                ..v1::Hello::default()
            })),
        });
    prop_oneof![decoded, outcome, hello, Just(WorkerMessage { msg: None })]
}

proptest! {
    #[test]
    fn a_hostile_link_never_stops_the_dispatcher(messages in prop::collection::vec(hostile(), 0..30)) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        let ended = rt.block_on(async {
            let d = spawn(MemoryLeaseStore::new(), CancellationToken::new());
            let (run, mut events) = register(&d, "wf_fuzz", 4, Duration::from_secs(60));
            let (bad, end) = link_pair();
            d.attach(end);
            for m in messages {
                let _ = bad.tx.send(m);
            }
            for i in 0..3 {
                d.submit(&run, ticket(i));
            }
            // The honest worker completes whatever it is given.
            let mut w = FakeWorker::attach(&d, 4);
            let mut ended = std::collections::HashMap::<u64, usize>::new();
            let deadline = Instant::now() + Duration::from_secs(3600);
            while ended.len() < 3 && Instant::now() < deadline {
                tokio::select! {
                    m = w.link.rx.recv() => {
                        if let Some(CoordinatorMessage { msg: Some(coordinator_message::Msg::Assign(a)) }) = m {
                            w.complete(&a, "done");
                        }
                    }
                    ev = events.recv() => {
                        if let Some(CallEvent::Finished { call, .. }) = ev {
                            *ended.entry(call).or_default() += 1;
                        }
                    }
                }
            }
            drop(bad);
            // Nothing ends twice, even after the hostile link goes.
            tokio::time::sleep(Duration::from_secs(600)).await;
            while let Ok(ev) = events.try_recv() {
                if let CallEvent::Finished { call, .. } = ev {
                    *ended.entry(call).or_default() += 1;
                }
            }
            ended
        });
        prop_assert_eq!(ended.len(), 3, "calls ended: {:?}", ended);
        prop_assert!(ended.values().all(|n| *n == 1), "a call ended twice: {:?}", ended);
    }
}
