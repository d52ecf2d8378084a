//! What a client cannot make the coordinator hold or do, tried the way an attacker would
//! against a real coordinator on loopback: connections on its listeners (per peer, and for
//! how long a slow request may take), the sign-in redirect, and the sizes of what it sends
//! (each field, each request, and memory under several maximal launches at once).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use flotilla_tests::cluster::Cluster;
use flotilla_tests::{connect_from, http_get};

const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// Whether the server closed `conn` (EOF or reset) within `within`; `false` if it still
/// holds it open then.
fn closed_within(conn: &mut TcpStream, within: Duration) -> bool {
    conn.set_read_timeout(Some(within)).expect("timeout");
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

/// A connection that sends `start`, then one more byte of `trickle` every 200 ms until the
/// server closes it; counts itself in `closed` when that happens.
fn trickler(
    from: Ipv4Addr,
    port: u16,
    start: String,
    trickle: &'static [u8],
    closed: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<()> {
    let mut conn = connect_from(from, port);
    std::thread::spawn(move || {
        let _ = conn.write_all(start.as_bytes());
        conn.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let mut buf = [0u8; 4096];
        // Bounded: 600 bytes at 5 a second is two minutes, far past any read timeout here.
        for &b in trickle.iter().cycle().take(600) {
            match conn.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
            if conn.write_all(&[b]).is_err() {
                break;
            }
        }
        closed.fetch_add(1, Ordering::SeqCst);
    })
}

/// Slowloris on the page port: one peer's connections past its cap are refused at once, the
/// ones it holds are cut off at the read timeout though they keep sending (headers or a
/// body), and `/healthz` and `/livez` answer another peer all along.
#[test]
fn cluster_bounds_slow_clients_cannot_hold_the_page_listener() {
    const CAP: usize = 12;
    let c = Cluster::start_with_env(
        0,
        1,
        vec![
            ("FLOTILLA_MAX_CONNECTIONS_PER_PEER".into(), CAP.to_string()),
            ("FLOTILLA_READ_TIMEOUT".into(), "2s".into()),
        ],
    );
    let port = c.http_port;
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the pages never came up");
        std::thread::sleep(Duration::from_millis(100));
    }
    let closed = Arc::new(AtomicUsize::new(0));
    let mut held = Vec::new();
    // Headers, one byte at a time, never finished.
    for _ in 0..CAP - 2 {
        held.push(trickler(
            ATTACKER,
            port,
            format!("GET /runs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-A: "),
            b"a",
            closed.clone(),
        ));
    }
    // A body, one byte at a time, to a route that reads one (before any sign-in).
    for _ in 0..2 {
        held.push(trickler(
            ATTACKER,
            port,
            format!(
                "POST /runs/wf_00000000-000/control HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nx-flotilla: 1\r\nContent-Length: 60000\r\n\r\n{{\"action\":\""
            ),
            b"x",
            closed.clone(),
        ));
    }
    // Past the cap: closed at once, the listener being far from full.
    for _ in 0..5 {
        let mut extra = connect_from(ATTACKER, port);
        assert!(
            closed_within(&mut extra, Duration::from_secs(5)),
            "a connection past the peer's cap is refused"
        );
    }
    // Another peer is served while they trickle.
    for path in ["/healthz", "/livez"] {
        let r = http_get(port, path, &[]);
        assert_eq!(r.status, 200, "{path} while a peer trickles: {r:?}");
    }
    // Every trickling connection is cut off although it never went quiet (bounded poll).
    let deadline = Instant::now() + Duration::from_secs(60);
    while closed.load(Ordering::SeqCst) < CAP {
        assert!(
            Instant::now() < deadline,
            "only {} of {CAP} trickling connections were closed",
            closed.load(Ordering::SeqCst)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for t in held {
        t.join().expect("trickler");
    }
    // Their places are given back: the same peer is served again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut again = connect_from(ATTACKER, port);
        again
            .write_all(
                format!(
                    "GET /livez HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
                )
                .as_bytes(),
            )
            .expect("send");
        let mut answer = String::new();
        again
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let _ = again.read_to_string(&mut answer);
        if answer.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the peer is never served again: {answer:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = std::fs::read_to_string(c.path().join("coordinator.log")).expect("log");
    assert!(
        log.contains("a peer reached its connection cap")
            && log.contains("max-connections-per-peer"),
        "the cap says so in the log, with the flag: {log}"
    );
}

/// The gRPC listener has the same per-peer cap: connections that never finish a handshake
/// from one peer stop at its cap, and a client elsewhere is served.
#[test]
fn cluster_bounds_one_peer_cannot_fill_the_grpc_listener() {
    const CAP: usize = 8;
    let c = Cluster::start_with_env(
        0,
        1,
        vec![("FLOTILLA_MAX_CONNECTIONS_PER_PEER".into(), CAP.to_string())],
    );
    let mut held: Vec<TcpStream> = (0..CAP).map(|_| connect_from(ATTACKER, c.port)).collect();
    let mut extra = connect_from(ATTACKER, c.port);
    assert!(
        closed_within(&mut extra, Duration::from_secs(5)),
        "a connection past the peer's cap is refused before any handshake"
    );
    let out = c.client(&["workers", "--json"]);
    assert_eq!(out.code, 0, "another peer is served: {out:?}");
    // The held ones are still open (they are within the cap; the handshake timeout, not the
    // cap, ends them).
    assert!(!closed_within(&mut held[0], Duration::from_millis(300)));
}

/// After sign-in the browser goes only to a path on this site: `next` values that a browser
/// would read as another host (`/\host`, `/<tab>/host`, `//host`, a scheme) go to `/runs`.
#[test]
fn cluster_bounds_sign_in_never_redirects_off_site() {
    let c = Cluster::start(0, 1);
    let t = c.client(&["token", "create", "--json", "--ttl", "1h"]);
    assert_eq!(t.code, 0, "{t:?}");
    let login = t.json()["login_url"]
        .as_str()
        .expect("login url")
        .to_owned();
    let login_path = login
        .split_once(&format!(":{}", c.http_port))
        .expect("the pages' port")
        .1
        .to_owned();
    for next in [
        "/%5Cevil.com",
        "/%09/evil.com",
        "%2F%2Fevil.com",
        "//evil.com",
        "/%5C%5Cevil.com",
        "/%0D%0A/evil.com",
        "https://evil.com/",
        "/%EF%BC%8Fevil.com",
    ] {
        let r = http_get(c.http_port, &format!("{login_path}&next={next}"), &[]);
        assert_eq!(r.status, 303, "{next}: {r:?}");
        assert_eq!(r.header("location"), Some("/runs"), "{next}: {r:?}");
    }
    let r = http_get(
        c.http_port,
        &format!("{login_path}&next=/runs/wf_00000000-000"),
        &[],
    );
    assert_eq!(r.header("location"), Some("/runs/wf_00000000-000"), "{r:?}");
}

/// A client of the cluster's coordinator that skips every check the CLI makes.
async fn raw_client(
    c: &Cluster,
) -> flotilla_proto::v1::client_service_client::ClientServiceClient<tonic::transport::Channel> {
    let tls = flotilla_proto::tls::TlsFiles::in_dir(&c.pki(), "client");
    let channel = flotilla_proto::tls::channel(&c.url(), Some(&tls)).expect("channel");
    flotilla_proto::v1::client_service_client::ClientServiceClient::new(channel)
}

/// A launch of a script that ends at once, with `settings` as its settings.
fn small_launch(settings: &str) -> flotilla_proto::v1::LaunchRequest {
    flotilla_proto::v1::LaunchRequest {
        protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
        script: "export const meta = { name: 'big', description: 'd' };\nreturn typeof args;\n"
            .into(),
        settings_json: settings.into(),
        ..Default::default()
    }
}

/// A launch with every part at (just under) its limit: a 2 MiB script, 16 MiB of args in
/// the shape that costs a parser most (an array of zeros), 1 MiB of settings and 8 MiB of
/// carried workflows. Its script gets the least memory, so its run fails at once: the
/// launches, not the runs, are measured.
fn maximal_launch() -> flotilla_proto::v1::LaunchRequest {
    const MIB: usize = 1 << 20;
    let mut script = String::from("export const meta = { name: 'big', description: 'd' };\n// ");
    // 4-byte characters: 2 MiB of bytes within the 524,288 characters a script may have.
    script.push_str(&"\u{1F600}".repeat((2 * MIB - 1024) / 4));
    script.push_str("\nreturn typeof args;\n");
    let zeros = (16 * MIB - 2) / 2;
    let mut args = String::with_capacity(16 * MIB);
    args.push('[');
    args.push_str(&"0,".repeat(zeros - 1));
    args.push_str("0]");
    let mut settings = String::from(r#"{"script_memory_mb":8}"#);
    settings.push_str(&" ".repeat(MIB - 64));
    let workflows = (0..4)
        .map(|i| flotilla_proto::v1::SavedWorkflow {
            name: format!("w{i}"),
            source: format!("// {}", "x".repeat(2 * MIB - 1024)),
            origin: String::new(),
        })
        .collect();
    flotilla_proto::v1::LaunchRequest {
        script,
        args_json: Some(args),
        settings_json: settings,
        workflows,
        ..small_launch("{}")
    }
}

/// A process's peak resident memory (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM")
        * 1024
}

/// Every size a client sends is bounded on the server, whatever the client: each field past
/// its limit is refused by name with its size and the limit, a whole request past its
/// method's limit is refused before it is read, and the coordinator goes on serving.
#[test]
fn cluster_bounds_oversized_fields_are_refused_by_name() {
    use flotilla_proto::v1;
    const MIB: usize = 1 << 20;
    let c = Cluster::start(0, 1);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let ran = rt.block_on(async {
        let mut client = raw_client(&c).await;
        let over = |what: &str, r: v1::LaunchRequest| (what.to_owned(), r);
        let mut big_settings = String::from("{}");
        big_settings.push_str(&" ".repeat(MIB));
        let cases = [
            over(
                "args: 16777217 bytes (16.0 MiB), over the limit of 16 MiB",
                v1::LaunchRequest {
                    args_json: Some(format!("\"{}\"", "a".repeat(16 * MIB - 1))),
                    ..small_launch("{}")
                },
            ),
            over(
                "the script: 2097153 bytes (2.0 MiB), over the limit of 2 MiB",
                v1::LaunchRequest {
                    script: format!("return 1;{}", " ".repeat(2 * MIB + 1 - 9)),
                    ..small_launch("{}")
                },
            ),
            over(
                "the run settings: 1048578 bytes (1.0 MiB), over the limit of 1 MiB",
                small_launch(&big_settings),
            ),
            over(
                "what the launch carries (workflows and agent definitions)",
                v1::LaunchRequest {
                    agent_definitions: vec![v1::AgentDefinition {
                        name: "huge".into(),
                        prompt: "p".repeat(9 * MIB),
                        ..Default::default()
                    }],
                    ..small_launch("{}")
                },
            ),
            over(
                "the script's origin: 5000 bytes (4.9 KiB), over the limit of 4 KiB",
                v1::LaunchRequest {
                    origin: "o".repeat(5000),
                    ..small_launch("{}")
                },
            ),
            // The whole request: refused by its length, before it is read.
            over(
                "the Launch request is 67108",
                v1::LaunchRequest {
                    args_json: Some(format!("\"{}\"", "a".repeat(64 * MIB))),
                    ..small_launch("{}")
                },
            ),
        ];
        for (says, req) in cases {
            let e = client.launch(req).await.expect_err(&says);
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{says}: {e:?}");
            assert!(e.message().contains(&says), "{says}: {}", e.message());
        }
        // Other methods: their fields, and the whole request.
        let e = client
            .control(v1::ControlRequest {
                run_id: "wf_00000000-000".into(),
                action: "pause".into(),
                agent: "a".repeat(5000),
                ..Default::default()
            })
            .await
            .expect_err("a long agent name");
        assert!(
            e.message().contains("the agent: 5000 bytes"),
            "{}",
            e.message()
        );
        let e = client
            .control(v1::ControlRequest {
                run_id: "wf_00000000-000".into(),
                action: "answer".into(),
                answer_json: format!("\"{}\"", "a".repeat(2 * MIB)),
                ..Default::default()
            })
            .await
            .expect_err("a 2 MiB answer");
        assert!(
            e.message().contains("the answer: 2097154 bytes (2.0 MiB)"),
            "{}",
            e.message()
        );
        let e = client
            .control(v1::ControlRequest {
                run_id: "wf_00000000-000".into(),
                action: "a".repeat(5 * MIB),
                ..Default::default()
            })
            .await
            .expect_err("a 5 MiB control request");
        assert!(
            e.message().contains("the Control request is")
                && e.message().contains("over the limit of 4 MiB"),
            "{}",
            e.message()
        );
        // The coordinator goes on: a launch within the limits runs, its args as sent.
        let ok = client
            .launch(v1::LaunchRequest {
                script:
                    "export const meta = { name: 'ok', description: 'd' };\nreturn args.n + 1;\n"
                        .into(),
                args_json: Some(" { \"n\" : 41 } ".into()),
                ..small_launch("{}")
            })
            .await
            .expect("a launch within the limits")
            .into_inner();
        assert_eq!(ok.status, "running", "{ok:?}");
        ok.run_id
    });
    let (_, report) = c.wait(&ran);
    assert_eq!(report["result"], 42, "{report}");
    // The CLI checks the same limits before it sends, in the same words: a project whose
    // workflows come to more than a launch carries.
    let project = c.path().join("project");
    let flows = project.join(".flotilla").join("workflows");
    std::fs::create_dir_all(&flows).expect("workflow dir");
    for i in 0..5 {
        std::fs::write(
            flows.join(format!("w{i}.js")),
            format!(
                "export const meta = {{ name: 'w{i}', description: 'd' }};\n// {}\nreturn 1;\n",
                "\u{1F600}".repeat(480_000)
            ),
        )
        .expect("workflow");
    }
    std::fs::write(
        project.join("s.js"),
        "export const meta = { name: 's', description: 'd' };\nreturn 1;\n",
    )
    .expect("script");
    let out = c.client_in(&project, &["launch", "s.js"]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr
            .contains("what the launch carries (workflows and agent definitions)")
            && out.stderr.contains("over the limit of 8 MiB"),
        "{out:?}"
    );
}

/// Several maximal launches at once, and some far past the limit, from as many clients: each
/// is answered (started, or refused with the limit), and the coordinator's peak memory grows
/// by no more than the intake's budget and the runs themselves account for.
#[test]
fn cluster_bounds_several_maximal_launches_keep_memory_bounded() {
    const MIB: u64 = 1 << 20;
    const MAXIMAL: usize = 6;
    const OVER: usize = 2;
    let c = Cluster::start(0, 1);
    let pid = c.coordinator_pid();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let before = peak_rss(pid);
    let answers = rt.block_on(async {
        let mut tasks = Vec::new();
        for i in 0..MAXIMAL + OVER {
            let mut client = raw_client(&c).await;
            let req = if i < MAXIMAL {
                maximal_launch()
            } else {
                v1_over_limit()
            };
            tasks.push(tokio::spawn(async move { client.launch(req).await }));
        }
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(t.await.expect("task"));
        }
        answers
    });
    let after = peak_rss(pid);
    for (i, a) in answers.iter().enumerate() {
        if i < MAXIMAL {
            let reply = a.as_ref().expect("a maximal launch is taken");
            assert_eq!(reply.get_ref().status, "running", "{:?}", reply.get_ref());
        } else {
            let e = a.as_ref().expect_err("a launch past the limit is refused");
            assert!(
                e.message().contains("over the limit of 28 MiB"),
                "{}",
                e.message()
            );
        }
    }
    // What may be held at once: the intake's budget of large requests being read and
    // handled (each costs about three times its size while tonic buffers it, decodes it and
    // the handler stores its script, manifest and carried workflows), and what each started
    // run keeps (its script, args and carried workflows as text, a script heap of at most
    // 8 MiB); 64 MiB for the rest.
    // `reads::LAUNCH_BYTES` and the intake's budget (`api::BUDGET_BYTES`), two of them.
    let launch = 28 * MIB;
    let budget = 2 * launch;
    let bound = 3 * budget + MAXIMAL as u64 * (launch + 8 * MIB) + 64 * MIB;
    let grew = after.saturating_sub(before);
    eprintln!(
        "peak RSS {} MiB before, {} MiB after ({} MiB more; bound {} MiB)",
        before / MIB,
        after / MIB,
        grew / MIB,
        bound / MIB
    );
    assert!(
        grew <= bound,
        "the coordinator's peak memory grew by {} MiB, more than {} MiB",
        grew / MIB,
        bound / MIB
    );
    // It goes on serving.
    assert_eq!(c.client(&["workers", "--json"]).code, 0);
}

/// A launch whose args alone are 64 MiB: past the whole request's limit.
fn v1_over_limit() -> flotilla_proto::v1::LaunchRequest {
    flotilla_proto::v1::LaunchRequest {
        args_json: Some(format!("[{}0]", "0,".repeat(32 << 20))),
        ..small_launch("{}")
    }
}
