use super::*;
use crate::lease::memory::MemoryLeaseStore;
use crate::store::faulty::FaultyStore;
use crate::workflows::NoWorkflows;
use flotilla_worker::backend::echo::Echo;
use flotilla_worker::{Worker, WorkerOptions, link_pair};
use object_store::memory::InMemory;
use tokio_util::sync::CancellationToken;

struct Harness {
    store: Store,
    faulty: Arc<FaultyStore>,
    dispatch: DispatchHandle,
    _workspace: tempfile::TempDir,
}

fn harness() -> Harness {
    let faulty = FaultyStore::new(Arc::new(InMemory::new()));
    let store = Store::over("memory://", faulty.clone(), None);
    let dispatch = crate::sched::spawn(MemoryLeaseStore::new(), CancellationToken::new());
    let workspace = tempfile::tempdir().unwrap();
    let worker = Worker::new(
        WorkerOptions::unsandboxed("test", 4, workspace.path().into()),
        vec![Arc::new(Echo)],
    );
    let (link, end) = link_pair();
    dispatch.attach(end);
    tokio::spawn(async move { worker.run(link, CancellationToken::new()).await });
    Harness {
        store,
        faulty,
        dispatch,
        _workspace: workspace,
    }
}

fn engine(
    h: &Harness,
    run_id: &str,
) -> (
    mpsc::UnboundedSender<ScriptOp>,
    mpsc::UnboundedReceiver<HostReply>,
    RunHandle,
) {
    let (ops_tx, ops_rx) = mpsc::unbounded_channel();
    let (rep_tx, rep_rx) = mpsc::unbounded_channel();
    let init = EngineInit {
        run_id: run_id.into(),
        workflow: WorkflowInfo::default(),
        phases: Vec::new(),
        settings: RunSettings {
            stagger_ms: 0,
            ..RunSettings::default()
        },
        store: h.store.clone(),
        generation: 1,
        dispatch: h.dispatch.clone(),
        resolver: Arc::new(NoWorkflows),
        resume: None,
        shared: Arc::new(ScriptShared::default()),
        script_path: None,
        parent_run_id: None,
        write_result: true,
        owners: Vec::new(),
        cache_dir: None,
        indexed: None,
        notifier: None,
        quotas: None,
        tasks: Default::default(),
        budget_pauses: false,
        answers_from_store: false,
        page_base: None,
        park_after: None,
        logs_before: Vec::new(),
        kept: Default::default(),
    };
    let handle = start(
        init,
        ops_rx,
        Box::new(move |r| {
            let _ = rep_tx.send(r);
        }),
    );
    (ops_tx, rep_rx, handle)
}

fn agent_op(id: u64, prompt: &str) -> ScriptOp {
    ScriptOp::Agent {
        id,
        prompt: prompt.into(),
        opts_json: "{}".into(),
        group: String::new(),
        child: String::new(),
    }
}

#[tokio::test]
async fn a_result_reaches_the_script_only_after_its_journal_segment_is_durable() {
    let h = harness();
    let run = "wf_journal-001";
    h.faulty.hold_writes(&format!("runs/{run}/calls/"));
    let (ops, mut replies, handle) = engine(&h, run);
    ops.send(agent_op(1, "hello")).unwrap();
    // The echo agent answers at once; its journal write is held.
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.faulty.held() == 0 {
        assert!(Instant::now() < deadline, "the journal write never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(300), replies.recv())
            .await
            .is_err(),
        "the script must not see a result that is not stored"
    );
    h.faulty.release();
    match tokio::time::timeout(Duration::from_secs(10), replies.recv()).await {
        Ok(Some(HostReply::Agent {
            id: 1,
            result: Ok(json),
        })) => assert_eq!(json, "\"hello\""),
        other => panic!("expected the result after the write, got {other:?}"),
    }
    let stored = crate::store::journal::read_calls(&h.store, run)
        .await
        .unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(
        stored[0].result,
        Some(crate::store::records::RawJson::string("hello"))
    );
    ops.send(ScriptOp::Finished(ScriptEnd::Returned(None)))
        .unwrap();
    assert_eq!(handle.wait().await.status, RunStatus::Completed);
}

#[tokio::test]
async fn a_storage_outage_delays_results_and_loses_none() {
    let h = harness();
    let run = "wf_outage-001";
    h.faulty.fail_writes(&format!("runs/{run}/calls/"));
    let (ops, mut replies, handle) = engine(&h, run);
    for i in 0..5 {
        ops.send(agent_op(i + 1, &format!("item {i}"))).unwrap();
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(400), replies.recv())
            .await
            .is_err()
    );
    // The user sees the outage in the run's status while it lasts.
    let mut snap = handle.snapshot.clone();
    let seen = tokio::time::timeout(
        Duration::from_secs(10),
        snap.wait_for(|s| {
            s.summary
                .waiting
                .as_deref()
                .is_some_and(|w| w.contains("storage writes failing"))
        }),
    )
    .await
    .is_ok_and(|r| r.is_ok());
    assert!(seen, "the status never said storage was failing");
    h.faulty.release();
    let mut got = Vec::new();
    while got.len() < 5 {
        match tokio::time::timeout(Duration::from_secs(15), replies.recv()).await {
            Ok(Some(HostReply::Agent { id, result: Ok(_) })) => got.push(id),
            other => panic!("expected results after the outage, got {other:?}"),
        }
    }
    got.sort_unstable();
    assert_eq!(got, vec![1, 2, 3, 4, 5]);
    ops.send(ScriptOp::Finished(ScriptEnd::Returned(None)))
        .unwrap();
    let report = handle.wait().await;
    assert_eq!(report.status, RunStatus::Completed);
    let stored = crate::store::journal::read_calls(&h.store, run)
        .await
        .unwrap();
    let mut indices: Vec<u64> = stored.iter().map(|c| c.index).collect();
    indices.sort_unstable();
    assert_eq!(
        indices,
        vec![0, 1, 2, 3, 4],
        "each call journaled exactly once"
    );
}

#[tokio::test]
async fn a_full_disk_fails_the_run_at_once_with_the_fix_and_keeps_what_was_stored() {
    let h = harness();
    let run = "wf_full-001";
    let (ops, mut replies, handle) = engine(&h, run);
    ops.send(agent_op(1, "stored first")).unwrap();
    match tokio::time::timeout(Duration::from_secs(10), replies.recv()).await {
        Ok(Some(HostReply::Agent {
            id: 1,
            result: Ok(_),
        })) => {}
        other => panic!("{other:?}"),
    }
    // ENOSPC from the file system: not retried for ten minutes, the run stops now.
    h.faulty
        .fail_writes_with_os_error(&format!("runs/{run}/calls/"), 28);
    ops.send(agent_op(2, "never stored")).unwrap();
    // The script is told to stop (it never sees the result that was not stored).
    match tokio::time::timeout(Duration::from_secs(20), replies.recv()).await {
        Ok(Some(HostReply::Stop)) => {}
        other => panic!("expected the script to be stopped, got {other:?}"),
    }
    ops.send(ScriptOp::Finished(ScriptEnd::Returned(None)))
        .unwrap();
    let report = tokio::time::timeout(Duration::from_secs(20), handle.wait())
        .await
        .expect("the run ends instead of retrying");
    assert_eq!(report.status, RunStatus::Failed);
    let error = report.error.unwrap();
    assert!(error.contains("no space left"), "{error}");
    assert!(error.contains("resume"), "{error}");
    h.faulty.release();
    let stored = crate::store::journal::read_calls(&h.store, run)
        .await
        .unwrap();
    assert_eq!(stored.len(), 1, "what was stored before stays");
    assert_eq!(stored[0].index, 0);
}
