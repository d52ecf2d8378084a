//! What a launch can know is wrong is said at launch, with the fix (issue 28, cases 17 and
//! 18): a source URL the workers would not fetch (refused by the CLI and again by the
//! coordinator, which a hostile client talks to directly), and an object store set up wrong
//! (a missing bucket, refused credentials, nothing at the endpoint), which stops the
//! coordinator and the embedded run at start-up instead of failing each run with S3's XML.

use flotilla_tests::Env;
use flotilla_tests::cluster::{Cluster, free_port};
use flotilla_tests::services::{S3, S3Key};

/// A URL source's repository id, as every launcher computes it.
fn url_repo(url: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, url.as_bytes());
    hex::encode(&d.as_ref()[..16])
}

/// URLs the workers' git would refuse, misread or run something for, each with words of the
/// reason the refusal must give.
const REFUSED: [(&str, &str); 12] = [
    ("ftp://host/r.git", "not ftp://"),
    ("HTTPS://host/r.git", "not HTTPS://"),
    ("ext::sh -c touch% /tmp/pwned", "remote helper"),
    ("fd::3,4", "remote helper"),
    ("--upload-pack=touch /tmp/pwned", "starts with -"),
    ("-oProxyCommand=id:r.git", "starts with -"),
    ("ssh://-oProxyCommand=id/r.git", "host"),
    ("ssh://git@-oProxyCommand=id/r.git", "host"),
    ("git@host:--upload-pack=id", "starts with -"),
    ("https:///r.git", "names no host"),
    ("https://host/r\u{1b}[2J.git", "control character"),
    ("https://host%2d-oProxyCommand/r.git", "host"),
];

#[test]
fn a_source_url_the_workers_would_not_fetch_is_refused_at_launch_with_the_fix() {
    use flotilla_proto::v1;
    use flotilla_proto::v1::client_service_client::ClientServiceClient;
    let c = Cluster::start(1, 1);
    let script = flotilla_tests::write_workflow(c.path(), "src", "d", "return 1;");
    let script = script.to_str().unwrap();
    let launch = |url: &str| {
        c.client(&[
            "launch",
            script,
            "--json",
            "--source",
            &format!("git+{url}#main"),
        ])
    };
    // Through the CLI: refused before anything is sent.
    for (url, why) in REFUSED {
        let out = launch(url);
        assert_eq!(out.code, 2, "{url}: {out:?}");
        assert!(
            out.stderr.contains("cannot be fetched") && out.stderr.contains(why),
            "{url}: {}",
            out.stderr
        );
    }
    // Straight to the coordinator, as a client that skips the CLI's checks would.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let raw = |url: &str| {
        let settings = serde_json::json!({
            "backend": "echo",
            "source": { "repo": url_repo(url), "commit": "main", "url": url },
        });
        rt.block_on(async {
            let tls = flotilla_proto::tls::TlsFiles::in_dir(&c.pki(), "client");
            let channel = flotilla_proto::tls::channel(&c.url(), Some(&tls)).unwrap();
            ClientServiceClient::new(channel)
                .launch(v1::LaunchRequest {
                    protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
                    script: "export const meta = { name: 'src', description: 'd' };\nreturn 1;"
                        .into(),
                    settings_json: settings.to_string(),
                    ..Default::default()
                })
                .await
        })
    };
    for (url, why) in REFUSED {
        let e = raw(url).expect_err(url);
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{url}: {e:?}");
        assert!(
            e.message().contains("cannot be fetched") && e.message().contains(why),
            "{url}: {}",
            e.message()
        );
    }
    // A path on the workers' disks: refused unless the operator says the workers fetch them,
    // and the refusal says how.
    for url in ["file:///etc", "/srv/repo.git", "./repo"] {
        let e = raw(url).expect_err(url);
        assert!(
            e.message().contains("workers' own disks")
                && e.message().contains("--allow-file-sources"),
            "{url}: {}",
            e.message()
        );
        let out = launch(url);
        assert_eq!(out.code, 2, "{url}: {out:?}");
        assert!(out.stderr.contains("--allow-file-sources"), "{out:?}");
    }
    // Nothing was started by any of them; a well-formed URL is taken.
    let runs = c.client(&["runs", "--json"]);
    assert_eq!(runs.json(), serde_json::json!([]), "{runs:?}");
    for url in [
        "https://example.invalid/r.git",
        "git@example.invalid:team/r.git",
    ] {
        let out = launch(url);
        assert_eq!(out.code, 0, "{url}: {out:?}");
        assert!(out.json()["run_id"].is_string(), "{url}: {out:?}");
    }
}

/// A store each case gets wrong, with the exit status and words its refusal must have.
struct Wrong {
    what: &'static str,
    store: String,
    env: Vec<(String, String)>,
    code: i32,
    says: Vec<String>,
}

#[test]
fn a_store_set_up_wrong_stops_the_coordinator_and_the_embedded_run_with_the_fix() {
    let (s3, keys) = S3::start_checking();
    let endpoint = s3.endpoint();
    let wrong_secret = S3Key {
        id: keys.allowed.id.clone(),
        secret: format!("{}x", keys.allowed.secret),
    };
    let unknown = S3Key {
        id: "AKIAUNKNOWNKEY000000".into(),
        secret: keys.allowed.secret.clone(),
    };
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    let mut unreachable = s3.env_with(&keys.allowed);
    unreachable[0].1 = nowhere.clone();
    let cases = [
        Wrong {
            what: "a missing bucket",
            store: "s3://no-such-bucket/team".into(),
            env: s3.env_with(&keys.allowed),
            code: 2,
            says: vec![
                format!("bucket no-such-bucket does not exist at the S3 server at {endpoint}"),
                format!("aws s3 mb s3://no-such-bucket --endpoint-url {endpoint}"),
            ],
        },
        Wrong {
            what: "a wrong secret",
            store: "s3://runs/team".into(),
            env: s3.env_with(&wrong_secret),
            code: 2,
            says: vec![
                format!(
                    "refuses the signature made with the secret of access key id {}",
                    keys.allowed.id
                ),
                "check AWS_SECRET_ACCESS_KEY".into(),
            ],
        },
        Wrong {
            what: "an unknown key",
            store: "s3://runs/team".into(),
            env: s3.env_with(&unknown),
            code: 2,
            says: vec![
                "does not know access key id AKIAUNKNOWNKEY000000".into(),
                "check AWS_ACCESS_KEY_ID".into(),
            ],
        },
        Wrong {
            what: "a key without permission",
            store: "s3://runs/team".into(),
            env: s3.env_with(&keys.denied),
            code: 2,
            says: vec![
                format!("access key id {} may not list bucket runs", keys.denied.id),
                "s3:ListBucket".into(),
                "s3://runs/team/*".into(),
            ],
        },
        Wrong {
            what: "nothing at the endpoint",
            store: "s3://runs/team".into(),
            env: unreachable,
            code: 1,
            says: vec![
                format!("nothing answers at {nowhere}"),
                "fix AWS_ENDPOINT_URL".into(),
            ],
        },
    ];
    let env = Env::new();
    let script = env.script("t", "return await agent('hi');");
    let script = script.to_str().unwrap();
    for case in &cases {
        let vars: Vec<(&str, &str)> = case
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let listen = format!("127.0.0.1:{}", free_port());
        let coordinator = env.flotilla_with_env(
            &[
                "coordinator",
                "--insecure",
                "--listen",
                &listen,
                "--store",
                &case.store,
            ],
            &vars,
        );
        let embedded = env.flotilla_with_env(
            &[
                "run",
                script,
                "--backend",
                "echo",
                "--yes",
                "--json",
                "--store",
                &case.store,
            ],
            &vars,
        );
        for (who, out) in [("coordinator", &coordinator), ("flotilla run", &embedded)] {
            assert_eq!(out.code, case.code, "{}, {who}: {out:?}", case.what);
            let err = &out.stderr;
            assert!(
                err.contains(&format!("cannot use store {}", case.store)),
                "{}, {who}: {err}",
                case.what
            );
            for words in &case.says {
                assert!(
                    err.contains(words.as_str()),
                    "{}, {who}: {words:?} in {err}",
                    case.what
                );
            }
            for raw in ["<?xml", "<Error>", "RequestId", "owner record"] {
                assert!(!err.contains(raw), "{}, {who}: {raw} in {err}", case.what);
            }
            assert!(
                !err.contains(&keys.allowed.secret) && !err.contains(&keys.denied.secret),
                "{}, {who}: a secret in {err}",
                case.what
            );
        }
    }
    // The server takes the right credentials (so each refusal above is the wrong part's).
    let vars = s3.env_with(&keys.allowed);
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let out = env.flotilla_with_env(
        &[
            "run",
            script,
            "--backend",
            "echo",
            "--yes",
            "--json",
            "--store",
            "s3://runs/team",
        ],
        &vars,
    );
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["status"], "completed", "{out:?}");
}
