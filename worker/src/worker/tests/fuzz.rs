//! Property-based fuzzing of the worker's end of the link (`tools/fuzz` runs it long): a
//! hostile coordinator sends any messages — bytes decoded as protocol messages, and
//! welcomes, assignments, cancels and source data with arbitrary fields, among them run ids
//! and working directories that climb out of the workspace — and then an honest assignment.
//! The worker keeps serving: the honest attempt completes, every outcome it sends is for an
//! attempt it was given, it stops when told, and nothing is made outside its workspace.

use super::*;
use proptest::prelude::*;

/// Names that try to leave the workspace (at most three levels up: the test's directory
/// nests the workspace three deep, so any escape shows there), and some of anything.
fn path_like() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just(".".to_owned()),
        Just("..".to_owned()),
        Just("../escaped".to_owned()),
        Just("../../escaped".to_owned()),
        Just("../../../escaped".to_owned()),
        Just("/etc".to_owned()),
        Just("sub/../../escaped".to_owned()),
        Just("ok/dir".to_owned()),
        "\\PC{0,10}",
    ]
}

fn task() -> impl Strategy<Value = v1::TaskSpec> {
    (
        "\\PC{0,24}",
        prop_oneof![
            Just("echo".to_owned()),
            Just("nope".to_owned()),
            "\\PC{0,5}"
        ],
        path_like(),
        prop::option::of(prop_oneof![
            Just(r#"{"type":"object","required":["x"]}"#.to_owned()),
            "\\PC{0,20}",
        ]),
        prop_oneof![
            Just(String::new()),
            Just("worktree".to_owned()),
            "\\PC{0,6}"
        ],
        0u64..3000,
        "\\PC{0,20}",
        "\\PC{0,20}",
        path_like(),
        // Never a network address: a fuzzer sends no traffic anywhere.
        prop_oneof![
            Just(String::new()),
            Just("file:///nonexistent/repo".to_owned())
        ],
    )
        .prop_map(
            |(
                prompt,
                backend,
                cwd,
                schema_json,
                isolation,
                timeout_ms,
                options_json,
                agent_def_json,
                source_repo,
                source_url,
            )| v1::TaskSpec {
                prompt,
                backend,
                cwd,
                schema_json,
                isolation,
                timeout_ms,
                options_json,
                agent_def_json,
                source_repo,
                source_url,
                ..v1::TaskSpec::default()
            },
        )
}

fn hostile() -> impl Strategy<Value = coordinator_message::Msg> {
    // Most random bytes do not decode; those send an empty message instead.
    let decoded = prop::collection::vec(any::<u8>(), 0..160).prop_map(|bytes| {
        <CoordinatorMessage as prost::Message>::decode(bytes.as_slice())
            .unwrap_or_default()
            .msg
            .unwrap_or(coordinator_message::Msg::Fragment(v1::Fragment::default()))
    });
    let welcome = ("\\PC{0,6}", any::<u64>()).prop_map(|(protocol_version, lease_ttl_ms)| {
        coordinator_message::Msg::Welcome(v1::Welcome {
            protocol_version,
            worker_id: "w".into(),
            coordinator: "hostile".into(),
            lease_ttl_ms,
        })
    });
    let assign = (
        path_like(),
        0u64..4,
        0u32..3,
        "\\PC{0,6}",
        prop::option::of(task()),
        any::<i64>(),
        any::<u64>(),
    )
        .prop_map(
            |(run_id, call, attempt, call_key, task, fence, stall_timeout_ms)| {
                coordinator_message::Msg::Assign(Assignment {
                    run_id,
                    call,
                    attempt,
                    call_key,
                    task,
                    trace_context: HashMap::new(),
                    fence,
                    stall_timeout_ms,
                })
            },
        );
    let cancel = (path_like(), 0u64..4, 0u32..3, "\\PC{0,10}").prop_map(
        |(run_id, call, attempt, reason)| {
            coordinator_message::Msg::Cancel(v1::Cancel {
                run_id,
                call,
                attempt,
                reason,
            })
        },
    );
    let source = (
        any::<u64>(),
        path_like(),
        prop::collection::vec(any::<u8>(), 0..64),
        any::<bool>(),
        any::<bool>(),
        "\\PC{0,10}",
    )
        .prop_map(|(request, pack, data, last_of_pack, done, error)| {
            coordinator_message::Msg::SourceData(v1::SourceData {
                request,
                pack,
                tip: String::new(),
                data,
                last_of_pack,
                done,
                error,
            })
        });
    prop_oneof![decoded, welcome, assign, cancel, source]
}

/// Every entry under `dir`, as paths relative to it.
fn tree(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            out.push(p.strip_prefix(dir).unwrap_or(&p).to_owned());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(p);
            }
        }
    }
    out
}

proptest! {
    #[test]
    fn a_hostile_coordinator_never_stops_the_worker(messages in prop::collection::vec(hostile(), 0..20)) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("a/b/workspace");
        std::fs::create_dir_all(&root).expect("workspace");
        let w = worker(&root);
        let (assigned, outcomes, honest) = rt.block_on(async move {
            let (links_tx, cancel, serving) = serving(w);
            let (link, mut end) = link_pair();
            links_tx.send(link).expect("a link");
            let mut assigned = std::collections::HashSet::new();
            for m in messages {
                if let coordinator_message::Msg::Assign(a) = &m {
                    assigned.insert((a.run_id.clone(), a.call, a.attempt));
                }
                send(&end, m);
            }
            // Then an honest coordinator.
            send(&end, welcome(Duration::from_secs(30)));
            let mut a = assignment("honest", 7);
            a.run_id = "wf_honest".into();
            a.call = 99;
            assigned.insert((a.run_id.clone(), a.call, a.attempt));
            send(&end, coordinator_message::Msg::Assign(a));
            let mut outcomes = Vec::new();
            let mut honest = None;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while honest.is_none() {
                let m = tokio::time::timeout_at(deadline, end.rx.recv()).await;
                let Ok(Some(m)) = m else { break };
                if let Some(worker_message::Msg::Outcome(o)) = m.msg {
                    if o.run_id == "wf_honest" && o.call == 99 {
                        honest = Some(o.result.clone());
                    }
                    outcomes.push((o.run_id, o.call, o.attempt));
                }
            }
            cancel.cancel();
            tokio::time::timeout(Duration::from_secs(60), serving)
                .await
                .expect("the worker stops when cancelled")
                .expect("the worker never panics");
            (assigned, outcomes, honest)
        });
        prop_assert!(
            matches!(&honest, Some(Some(outcome::Result::Completed(c))) if c.text.contains("honest")),
            "the honest attempt did not complete: {:?}", honest
        );
        for o in &outcomes {
            prop_assert!(assigned.contains(o), "an outcome for an attempt never given: {:?}", o);
        }
        // Nothing outside the workspace: the directories above it hold only the way down.
        let outside: Vec<_> = tree(dir.path())
            .into_iter()
            .filter(|p| !p.starts_with("a/b/workspace") && p != std::path::Path::new("a") && p != std::path::Path::new("a/b"))
            .collect();
        prop_assert!(outside.is_empty(), "made outside the workspace: {:?}", outside);
    }
}
