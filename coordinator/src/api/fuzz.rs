//! Property-based fuzzing of the client API (`tools/fuzz` runs it long): a real gRPC server on
//! loopback (a file store, leases in memory, no TLS) takes any requests on every call a client
//! can make — launches of broken and odd scripts with odd arguments and settings, run ids that
//! are paths, controls, pushes, transcripts, tokens, source uploads and fetches — one case
//! after another. Every answer comes in time, every refusal names its problem (no `Internal`
//! or `Unknown` status, no empty message), and after each case the server still answers, a
//! run stored before is still read back whole, and a new run still completes.

use std::time::Duration;

use flotilla_proto::v1::client_service_client::ClientServiceClient;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tonic::transport::Channel;

use super::*;
use crate::lease::memory::MemoryLeaseStore;
use flotilla_proto::v1;
use tonic::{Request, Status};

/// Run ids and names that are paths, and some of anything.
fn name_like() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("..".to_owned()),
        Just("../../etc/passwd".to_owned()),
        Just("/abs".to_owned()),
        Just("wf_00000000000000000000000000".to_owned()),
        Just("a/b".to_owned()),
        Just("x".repeat(5000)),
        "\\PC{0,16}",
    ]
}

/// Scripts, most with a meta (those without are refused before they run).
fn script() -> impl Strategy<Value = String> {
    (any::<bool>(), body()).prop_map(|(meta, body)| {
        if meta {
            format!("export const meta = {{ name: 'fuzz', description: 'a fuzz case' }};\n{body}")
        } else {
            body
        }
    })
}

fn body() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("return 1".to_owned()),
        Just("return args".to_owned()),
        Just("export const meta = { name: 'f', description: 'd' };\nreturn 2".to_owned()),
        Just("export const meta = { name: 7 };\nreturn 1".to_owned()),
        Just("return await workflow({ scriptPath: '/etc/passwd' })".to_owned()),
        Just("return await workflow('nope')".to_owned()),
        Just("throw new Error('no')".to_owned()),
        Just("return (".to_owned()),
        Just("return budget.remainingCost()".to_owned()),
        Just(String::new()),
        "\\PC{0,60}",
    ]
}

fn json_like() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("{}".to_owned()),
        Just("null".to_owned()),
        Just("[1,2]".to_owned()),
        Just(r#"{"concurrency":-1}"#.to_owned()),
        Just(r#"{"concurrency":1e300,"max_agents":18446744073709551616}"#.to_owned()),
        Just(r#"{"stall_timeout":"soon","backend":"nope"}"#.to_owned()),
        Just(r#"{"model":"opus","stagger":"-1s"}"#.to_owned()),
        "\\PC{0,30}",
    ]
}

fn version() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => Just(flotilla_proto::PROTOCOL_VERSION.to_owned()),
        1 => "\\PC{0,6}",
    ]
}

/// One request to one of the client API's calls.
#[derive(Debug, Clone)]
enum Call {
    Launch(v1::LaunchRequest),
    Wait(String),
    Report(String),
    Status(String),
    Stop(String),
    Changes(String),
    Control(v1::ControlRequest),
    Push(v1::PushWorkflowRequest),
    Transcripts(v1::TranscriptsRequest),
    Token(u64),
    Have(v1::SourceHaveRequest),
    Fetch(v1::FetchSourceRequest),
    Put(Vec<v1::SourceUpload>),
    Lists,
    /// A listing with a filter: odd JSON, or a filter with odd values.
    ListRuns(String),
}

fn filter_like() -> impl Strategy<Value = String> {
    (
        name_like(),
        name_like(),
        any::<u64>(),
        prop_oneof![Just("failed".to_owned()), "\\PC{0,8}"],
        any::<u64>(),
    )
        .prop_map(|(workflow, after, limit, status, since)| {
            serde_json::json!({
                "workflow": workflow,
                "after": after,
                "limit": limit,
                "status": status,
                "since_unix": since,
                "before_unix": since,
                "labels": { workflow.clone(): after },
            })
            .to_string()
        })
}

fn launch() -> impl Strategy<Value = v1::LaunchRequest> {
    (
        (version(), script(), name_like()),
        (prop::option::of(json_like()), json_like(), name_like()),
        prop::collection::vec((name_like(), script()), 0..3),
        prop::collection::vec((name_like(), "\\PC{0,8}"), 0..3),
        any::<bool>(),
        name_like(),
    )
        .prop_map(
            |(
                (protocol_version, script, origin),
                (args_json, settings_json, resume_from),
                workflows,
                types,
                inherit,
                saved_name,
            )| v1::LaunchRequest {
                protocol_version,
                script,
                origin,
                args_json,
                settings_json,
                resume_from,
                workflows: workflows
                    .into_iter()
                    .map(|(name, source)| v1::SavedWorkflow {
                        name,
                        source,
                        origin: String::new(),
                    })
                    .collect(),
                agent_types: types.into_iter().collect(),
                inherit,
                agent_definitions: Vec::new(),
                saved_name,
            },
        )
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        4 => launch().prop_map(Call::Launch),
        1 => name_like().prop_map(Call::Wait),
        1 => name_like().prop_map(Call::Report),
        1 => name_like().prop_map(Call::Status),
        1 => name_like().prop_map(Call::Stop),
        1 => name_like().prop_map(Call::Changes),
        1 => (
            name_like(),
            prop_oneof![Just("pause".to_owned()), Just("resume".to_owned()), Just("restart".to_owned()), Just("answer".to_owned()), "\\PC{0,8}"],
            name_like(),
            "\\PC{0,24}"
        )
            .prop_map(|(run_id, action, agent, answer_json)| Call::Control(v1::ControlRequest { run_id, action, question: agent.clone(), agent, answer_json, ..Default::default() })),
        1 => (version(), script(), name_like()).prop_map(|(protocol_version, source, namespace)| Call::Push(v1::PushWorkflowRequest { protocol_version, source, namespace })),
        1 => (version(), name_like(), name_like(), any::<u32>()).prop_map(|(protocol_version, run_id, agent, attempt)| {
            Call::Transcripts(v1::TranscriptsRequest { protocol_version, run_id, agent, attempt })
        }),
        1 => any::<u64>().prop_map(Call::Token),
        1 => (version(), name_like(), prop::collection::vec(name_like(), 0..3), name_like())
            .prop_map(|(protocol_version, repo, commits, namespace)| Call::Have(v1::SourceHaveRequest { protocol_version, repo, commits, namespace })),
        1 => (version(), name_like(), name_like(), prop::collection::vec(name_like(), 0..2), name_like()).prop_map(
            |(protocol_version, repo, commit, have_packs, namespace)| Call::Fetch(v1::FetchSourceRequest { protocol_version, repo, commit, have_packs, namespace })
        ),
        1 => prop::collection::vec(
            (name_like(), name_like(), any::<u64>(), prop::collection::vec(any::<u8>(), 0..64), name_like()).prop_map(
                |(repo, tip, total_bytes, data, namespace)| v1::SourceUpload {
                    repo,
                    tip,
                    total_bytes,
                    data,
                    namespace,
                    ..v1::SourceUpload::default()
                }
            ),
            0..3
        )
        .prop_map(Call::Put),
        1 => Just(Call::Lists),
        1 => prop_oneof![json_like(), filter_like()].prop_map(Call::ListRuns),
    ]
}

/// What a refusal must be: a named problem, not a crash.
fn named(what: &str, status: &Status) -> Result<(), TestCaseError> {
    prop_assert!(
        !matches!(status.code(), tonic::Code::Internal | tonic::Code::Unknown)
            && !status.message().trim().is_empty(),
        "{what}: an unnamed or internal refusal: {status:?}"
    );
    Ok(())
}

/// Sends `call`; `Ok` whether the server took it or refused it in a named way.
async fn send(client: &mut ClientServiceClient<Channel>, call: Call) -> Result<(), TestCaseError> {
    // A wait may rightly last as long as its run: a live run's is cut short by the client.
    fn req<T>(t: T) -> Request<T> {
        let mut r = Request::new(t);
        r.set_timeout(Duration::from_secs(2));
        r
    }
    let what: String = format!("{call:?}").chars().take(300).collect();
    let what = what.as_str();
    let answer: Result<(), Status> = match call {
        Call::Launch(l) => client.launch(req(l)).await.map(drop),
        Call::Wait(run_id) => match client.wait(req(v1::RunRef { run_id })).await {
            Err(s)
                if s.code() == tonic::Code::Cancelled
                    || s.code() == tonic::Code::DeadlineExceeded =>
            {
                Ok(())
            }
            other => other.map(drop),
        },
        Call::Report(run_id) => client.report(req(v1::RunRef { run_id })).await.map(drop),
        Call::Status(run_id) => client.status(req(v1::RunRef { run_id })).await.map(drop),
        Call::Stop(run_id) => client.stop(req(v1::RunRef { run_id })).await.map(drop),
        Call::Changes(run_id) => client.changes(req(v1::RunRef { run_id })).await.map(drop),
        Call::Control(c) => client.control(req(c)).await.map(drop),
        Call::Push(p) => client.push_workflow(req(p)).await.map(drop),
        Call::Transcripts(t) => client.transcripts(req(t)).await.map(drop),
        Call::Token(ttl_secs) => client
            .create_token(req(v1::CreateTokenRequest { ttl_secs }))
            .await
            .map(drop),
        Call::Have(h) => client.source_have(req(h)).await.map(drop),
        Call::Fetch(f) => match client.fetch_source(req(f)).await {
            Ok(stream) => {
                let mut stream = stream.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(_)) => {}
                        Ok(None) => break Ok(()),
                        Err(s) => break Err(s),
                    }
                }
            }
            Err(s) => Err(s),
        },
        Call::Put(pieces) => client
            .put_source(req(tokio_stream::iter(pieces)))
            .await
            .map(drop),
        Call::ListRuns(filter_json) => client
            .list_runs(req(v1::ListRunsRequest { filter_json }))
            .await
            .map(drop),
        Call::Lists => {
            let runs = client
                .list_runs(req(v1::ListRunsRequest::default()))
                .await
                .map(drop);
            let workers = client
                .list_workers(req(v1::ListWorkersRequest::default()))
                .await
                .map(drop);
            let flows = client
                .list_workflows(req(v1::ListWorkflowsRequest {
                    protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
                    namespace: String::new(),
                }))
                .await
                .map(drop);
            // Listing never fails on a healthy server.
            prop_assert!(
                runs.is_ok() && workers.is_ok() && flows.is_ok(),
                "{runs:?} {workers:?} {flows:?}"
            );
            Ok(())
        }
    };
    match answer {
        Ok(()) => Ok(()),
        Err(s) => named(what, &s),
    }
}

/// Launches `script` and waits for its result.
async fn honest(
    client: &mut ClientServiceClient<Channel>,
    script: &str,
) -> (String, serde_json::Value) {
    let launched = client
        .launch(v1::LaunchRequest {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            script: script.into(),
            ..v1::LaunchRequest::default()
        })
        .await
        .expect("an honest launch")
        .into_inner();
    assert!(
        launched.error.is_empty() && !launched.run_id.is_empty(),
        "an honest launch was refused: {launched:?}"
    );
    let report = client
        .wait(v1::RunRef {
            run_id: launched.run_id.clone(),
        })
        .await
        .expect("its report")
        .into_inner();
    (
        launched.run_id,
        serde_json::from_str(&report.report_json).expect("a JSON report"),
    )
}

const META: &str = "export const meta = { name: 'honest', description: 'an honest run' };\n";

/// A server on loopback with a store of its own, and a run stored in it before the cases.
struct Server {
    _dir: tempfile::TempDir,
    cancel: CancellationToken,
    served: tokio::task::JoinHandle<Result<(), flotilla_proto::Problem>>,
    client: ClientServiceClient<Channel>,
    kept: String,
    kept_result: serde_json::Value,
}

impl Server {
    async fn start() -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = crate::store::open(&format!("file://{}", dir.path().display())).expect("store");
        let coordinator = Arc::new(Coordinator::new(store, MemoryLeaseStore::new()));
        let listen = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
            l.local_addr().expect("its address")
        };
        let opts = ServerOptions {
            listen,
            tls: None,
            limits: crate::listen::ConnLimits::default(),
            session_base: "http://127.0.0.1:1".into(),
            keepalive: Duration::from_secs(10),
            tokens: None,
            policy: LaunchPolicy::default(),
            peer_name: None,
        };
        let cancel = CancellationToken::new();
        let served = tokio::spawn(serve(
            coordinator,
            Arc::new(RunRegistry::default()),
            opts,
            cancel.clone(),
        ));
        let endpoint = Channel::from_shared(format!("http://{listen}")).expect("endpoint");
        let mut client = None;
        for _ in 0..100 {
            if let Ok(c) = endpoint.connect().await {
                client = Some(ClientServiceClient::new(c));
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut client = client.unwrap_or_else(|| panic!("the server never listened on {listen}"));
        let (kept, report) =
            honest(&mut client, &format!("{META}return {{ kept: [1, 2, 3] }}")).await;
        assert_eq!(
            report["result"]["kept"],
            serde_json::json!([1, 2, 3]),
            "{report}"
        );
        Server {
            _dir: dir,
            cancel,
            served,
            client,
            kept,
            kept_result: report["result"].clone(),
        }
    }

    async fn stop(self) {
        self.cancel.cancel();
        let _ = self.served.await;
    }
}

/// Cases one server takes before a fresh one (with a fresh store) takes over: a long run
/// stays linear in its cases.
const CASES_PER_SERVER: u32 = 200;

#[test]
fn hostile_clients_get_named_refusals_and_the_server_keeps_serving() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let server = std::cell::RefCell::new(Some(rt.block_on(Server::start())));
    let cases = std::cell::Cell::new(0u32);
    let mut runner = TestRunner::new(Config::default());
    let result = runner.run(&prop::collection::vec(call(), 1..8), |calls| {
        cases.set(cases.get() + 1);
        if cases.get().is_multiple_of(CASES_PER_SERVER) {
            let old = server.borrow_mut().take().expect("a server");
            rt.block_on(old.stop());
            *server.borrow_mut() = Some(rt.block_on(Server::start()));
        }
        let (mut client, kept, kept_result) = {
            let s = server.borrow();
            let s = s.as_ref().expect("a server");
            (s.client.clone(), s.kept.clone(), s.kept_result.clone())
        };
        rt.block_on(async {
            for c in calls {
                send(&mut client, c).await?;
            }
            // Still serving: the stored run reads back whole, a new one completes.
            let report = client
                .report(v1::RunRef { run_id: kept })
                .await
                .map_err(|s| TestCaseError::fail(format!("the stored run is gone: {s:?}")))?
                .into_inner();
            let report: serde_json::Value =
                serde_json::from_str(&report.report_json).expect("JSON");
            prop_assert_eq!(&report["result"], &kept_result);
            let (_, fresh) = honest(&mut client, &format!("{META}return 40 + 2")).await;
            prop_assert_eq!(&fresh["result"], &serde_json::json!(42));
            Ok(())
        })
    });
    if let Some(s) = server.borrow_mut().take() {
        rt.block_on(s.stop());
    }
    if let Err(e) = result {
        panic!("{e}");
    }
}
