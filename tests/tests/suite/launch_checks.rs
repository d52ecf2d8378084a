//! What a launch can know is wrong is said at launch, with the fix (issue 28, case 18): an
//! object store set up wrong (a missing bucket, refused credentials, nothing at the
//! endpoint) stops the coordinator and the embedded run at start-up instead of failing each
//! run with S3's XML.

use flotilla_tests::Env;
use flotilla_tests::cluster::free_port;
use flotilla_tests::services::{S3, S3Key};

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
