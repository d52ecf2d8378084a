//! Pushed workflows across namespaces (issue 28; design.md's "Security": pushed workflows are
//! scoped by namespace), on a real fleet with mTLS. A workflow bob (team-b) pushes is, for
//! alice (team-a), exactly a name nobody pushed: not listed, not shown, not launched by name
//! (through the CLI or a raw `Launch` on a saved-only coordinator), not reached by
//! `workflow(name)` in her runs; her own push of the name is what her runs get. Neither can
//! push to or list the other's namespace, under any spelling of it. An operator sees each
//! namespace's with `--namespace`, and its push to `*` is offered to every namespace after
//! its own. A store from before namespaces (`workflows/NAME.js`) still serves `default`.

use std::path::PathBuf;

use flotilla_proto::v1;
use flotilla_proto::v1::client_service_client::ClientServiceClient;
use flotilla_tests::Output;
use flotilla_tests::cluster::Cluster;
use serde_json::{Value, json};

type Client = ClientServiceClient<tonic::transport::Channel>;

fn client_of(c: &Cluster, who: &str) -> Client {
    let tls = flotilla_proto::tls::TlsFiles::in_dir(&c.pki(), who);
    ClientServiceClient::new(flotilla_proto::tls::channel(&c.url(), Some(&tls)).expect("channel"))
}

fn version() -> String {
    flotilla_proto::PROTOCOL_VERSION.into()
}

/// A workflow file `name` in `who`'s own directory (never where a launch searches by name).
fn script(c: &Cluster, who: &str, name: &str, description: &str, body: &str) -> PathBuf {
    let dir = c.path().join("scripts").join(who);
    std::fs::create_dir_all(&dir).unwrap();
    flotilla_tests::write_workflow(&dir, name, description, body)
}

/// `flotilla workflows push` of `name` (returning `says`) as `who`.
fn push(c: &Cluster, who: &str, name: &str, says: &str, extra: &[&str]) -> Output {
    let file = script(c, who, name, says, &format!("return {};", json!(says)));
    let mut args = vec!["workflows", "push", file.to_str().unwrap()];
    args.extend_from_slice(extra);
    c.client_as(who, &args)
}

/// The coordinator's rows of `workflows list --json` as `who`: (name, description, origin,
/// namespace); or the refusal.
fn listed(
    c: &Cluster,
    who: &str,
    extra: &[&str],
) -> Result<Vec<(String, String, String, String)>, String> {
    let mut args = vec!["workflows", "list", "--json"];
    args.extend_from_slice(extra);
    let out = c.client_as(who, &args);
    if out.code != 0 {
        return Err(out.stderr);
    }
    Ok(out
        .json()
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["origin"] == "server")
        .map(|r| {
            let s = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
            (s("name"), s("description"), s("location"), s("namespace"))
        })
        .collect())
}

fn names(rows: &[(String, String, String, String)]) -> Vec<&str> {
    rows.iter().map(|r| r.0.as_str()).collect()
}

/// `flotilla launch NAME` as `who`.
fn launch(c: &Cluster, who: &str, name: &str, extra: &[&str]) -> Output {
    let mut args = vec!["launch", name, "--json"];
    args.extend_from_slice(extra);
    c.client_as(who, &args)
}

/// What the run `launch` started returned, waited for as `who`.
fn result_of(c: &Cluster, who: &str, launched: &Output) -> Value {
    let run = flotilla_tests::launched_run_id(launched);
    let out = c.client_as(who, &["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    out.json()["result"].clone()
}

/// `got`, an answer about `name`, reads exactly as the same answer about `nonesuch`, a name
/// nobody pushed (`absent`).
fn as_if_absent(got: &str, name: &str, absent: &str) {
    assert!(!absent.is_empty(), "no answer about a missing name");
    assert_eq!(
        got.replace(name, "nonesuch"),
        absent,
        "{name} shows through"
    );
}

/// The script of `outer`: it asks `workflow()` for `audit` and for a name nobody pushed.
const OUTER: &str = "const reach = async (n) => { try { return 'ran: ' + await workflow(n); } catch (e) { return 'refused: ' + e.message; } };
return [await reach('audit'), await reach('nonesuch')];";

/// `outer`'s result: what `workflow('audit')` gave, after checking the other half.
fn reached(r: &Value) -> String {
    let pair = r.as_array().unwrap_or_else(|| panic!("{r}"));
    let absent = pair[1].as_str().unwrap();
    assert!(absent.starts_with("refused: "), "{absent}");
    let got = pair[0].as_str().unwrap().to_owned();
    if got.starts_with("refused: ") {
        as_if_absent(&got, "audit", absent);
    }
    got
}

fn tenants(c: &Cluster) {
    c.issue_client("alice", &["team-a"]);
    c.issue_client("bob", &["team-b"]);
    c.issue_client("ops", &["*"]);
}

#[test]
fn a_workflow_pushed_to_another_namespace_is_never_listed_launched_or_reached() {
    let c = Cluster::start_coordinator_with(
        1,
        2,
        &[
            "--publisher",
            "alice",
            "--publisher",
            "bob",
            "--publisher",
            "ops",
        ],
    );
    tenants(&c);
    let bobs = push(&c, "bob", "audit", "by bob", &[]);
    assert_eq!(bobs.code, 0, "{bobs:?}");
    let outer = script(&c, "alice", "outer", "calls audit", OUTER);
    let out = c.client_as("alice", &["workflows", "push", outer.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{out:?}");

    // Alice: not listed, not shown, not launched, not reached; as if nobody had pushed it.
    assert_eq!(names(&listed(&c, "alice", &[]).unwrap()), ["outer"]);
    let shown = c.client_as("alice", &["workflows", "show", "audit"]);
    let absent = c.client_as("alice", &["workflows", "show", "nonesuch"]);
    assert_ne!(shown.code, 0, "{shown:?}");
    assert!(!shown.stdout.contains("by bob"), "{shown:?}");
    as_if_absent(&shown.stderr, "audit", &absent.stderr);
    for name in ["audit", "/audit"] {
        let out = launch(&c, "alice", name, &[]);
        let absent = launch(&c, "alice", &name.replace("audit", "nonesuch"), &[]);
        assert_ne!(out.code, 0, "{out:?}");
        assert_eq!(out.code, absent.code);
        as_if_absent(&out.stderr, "audit", &absent.stderr);
    }
    let r = result_of(&c, "alice", &launch(&c, "alice", "outer", &[]));
    assert!(reached(&r).starts_with("refused: "), "{r}");
    // Bob's push said where it went, and it is kept there.
    assert!(bobs.stdout.contains("in namespace team-b"), "{bobs:?}");
    let store = c.path().join("store");
    assert!(store.join("namespaces/team-b/workflows/audit.js").is_file());
    assert!(!store.join("workflows/audit.js").exists());

    // Nor can she name team-b's place, however she spells it.
    for ns in ["team-b", "team-b ", " team-b"] {
        let e = listed(&c, "alice", &["--namespace", ns]).unwrap_err();
        assert!(e.contains("team-a only"), "{ns:?}: {e}");
        let out = push(&c, "alice", "audit", "planted", &["--namespace", ns]);
        assert_ne!(out.code, 0, "{out:?}");
        assert!(out.stderr.contains("team-a only"), "{ns:?}: {out:?}");
    }
    for ns in [
        "../team-b",
        "team-a/../team-b",
        "team-b/..",
        "TEAM-B",
        "%74eam-b",
        "namespaces/team-b",
        "..",
    ] {
        let e = listed(&c, "alice", &["--namespace", ns]).unwrap_err();
        assert!(e.contains("is not a namespace name"), "{ns:?}: {e}");
        let out = push(&c, "alice", "audit", "planted", &["--namespace", ns]);
        assert!(
            out.stderr.contains("is not a namespace name"),
            "{ns:?}: {out:?}"
        );
    }
    let out = push(&c, "alice", "audit", "planted", &["--namespace", "*"]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(out.stderr.contains("operator"), "{out:?}");
    // The fleet's place holds nothing of anyone's.
    assert_eq!(listed(&c, "alice", &["--namespace", "*"]).unwrap(), []);
    // Raw calls, as a client past the CLI: the same answers.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut alice = client_of(&c, "alice");
        let reply = alice
            .list_workflows(v1::ListWorkflowsRequest {
                protocol_version: version(),
                namespace: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(reply.namespace, "team-a");
        assert!(reply.workflows.iter().all(|w| !w.source.contains("by bob")));
        let e = alice
            .list_workflows(v1::ListWorkflowsRequest {
                protocol_version: version(),
                namespace: "team-b".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        let e = alice
            .list_workflows(v1::ListWorkflowsRequest {
                protocol_version: version(),
                namespace: "team-b".repeat(10_000),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().len() < 1000, "{}", e.message().len());
    });
    // Bob's is untouched by all of it.
    let r = result_of(&c, "bob", &launch(&c, "bob", "audit", &[]));
    assert_eq!(r, "by bob");

    // Alice's own push of the name is hers alone, and what her runs get.
    let out = push(&c, "alice", "audit", "by alice", &[]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stdout.starts_with("saved audit in namespace team-a"),
        "{out:?}"
    );
    let mine = listed(&c, "alice", &[]).unwrap();
    assert!(
        mine.contains(&(
            "audit".into(),
            "by alice".into(),
            "server:audit".into(),
            "team-a".into()
        )),
        "{mine:?}"
    );
    let r = result_of(&c, "alice", &launch(&c, "alice", "audit", &[]));
    assert_eq!(r, "by alice");
    let r = result_of(&c, "alice", &launch(&c, "alice", "outer", &[]));
    assert_eq!(reached(&r), "ran: by alice");
    let r = result_of(&c, "bob", &launch(&c, "bob", "audit", &[]));
    assert_eq!(r, "by bob");
    assert!(!names(&listed(&c, "bob", &[]).unwrap()).contains(&"outer"));

    // An operator sees each namespace's with --namespace, and launches there what it runs.
    for (ns, says) in [("team-a", "by alice"), ("team-b", "by bob")] {
        let rows = listed(&c, "ops", &["--namespace", ns]).unwrap();
        let audit: Vec<_> = rows.iter().filter(|r| r.0 == "audit").collect();
        assert_eq!(audit.len(), 1, "{rows:?}");
        assert_eq!((audit[0].1.as_str(), audit[0].3.as_str()), (says, ns));
        let r = result_of(&c, "ops", &launch(&c, "ops", "audit", &["--namespace", ns]));
        assert_eq!(r, says);
    }
    // Its own listing (no --namespace) is `default`'s, which holds none of these.
    assert_eq!(listed(&c, "ops", &[]).unwrap(), []);
    // An operator or a coordinator certificate pushes into a namespace it names.
    let out = push(&c, "ops", "tidy", "ops for b", &["--namespace", "team-b"]);
    assert!(out.stdout.contains("in namespace team-b"), "{out:?}");
    let out = push(
        &c,
        "coordinator",
        "sweep",
        "from the coordinator",
        &["--namespace", "team-a"],
    );
    assert!(out.stdout.contains("in namespace team-a"), "{out:?}");
    assert_eq!(names(&listed(&c, "bob", &[]).unwrap()), ["audit", "tidy"]);
    assert_eq!(
        names(&listed(&c, "alice", &[]).unwrap()),
        ["audit", "outer", "sweep"]
    );
    let records = std::fs::read_dir(
        c.path()
            .join("store/namespaces/team-a/workflows/.pushes/sweep"),
    )
    .unwrap()
    .count();
    assert_eq!(records, 1);
}

#[test]
fn on_a_saved_only_coordinator_a_name_resolves_in_the_run_s_namespace_only() {
    let c = Cluster::start_coordinator_with(
        1,
        2,
        &["--saved-only", "--publisher", "alice", "--publisher", "bob"],
    );
    tenants(&c);
    assert_eq!(push(&c, "bob", "audit", "by bob", &[]).code, 0);
    let outer = script(&c, "alice", "outer", "calls audit", OUTER);
    let out = c.client_as("alice", &["workflows", "push", outer.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{out:?}");

    let out = launch(&c, "alice", "audit", &[]);
    let absent = launch(&c, "alice", "nonesuch", &[]);
    assert_ne!(out.code, 0, "{out:?}");
    as_if_absent(&out.stderr, "audit", &absent.stderr);
    let r = result_of(&c, "alice", &launch(&c, "alice", "outer", &[]));
    assert!(reached(&r).starts_with("refused: "), "{r}");

    // A client past the CLI names bob's workflow to the coordinator itself, every way.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let by_name = |name: &str| {
        let name = name.to_owned();
        rt.block_on(async {
            client_of(&c, "alice")
                .launch(v1::LaunchRequest {
                    protocol_version: version(),
                    saved_name: name,
                    ..v1::LaunchRequest::default()
                })
                .await
        })
    };
    let absent = by_name("nonesuch").unwrap_err();
    assert_eq!(absent.code(), tonic::Code::NotFound, "{absent:?}");
    for name in [
        "audit",
        "/audit",
        "../namespaces/team-b/workflows/audit",
        "team-b/audit",
        "..%2fnamespaces%2fteam-b%2fworkflows%2faudit",
        ".pushes/audit",
    ] {
        let e = by_name(name).expect_err(name);
        assert_eq!(e.code(), tonic::Code::NotFound, "{name}: {e:?}");
        let bare = name.trim_start_matches('/');
        as_if_absent(e.message(), bare, absent.message());
    }

    // Her own push of the name is what she runs, by name and through workflow().
    assert_eq!(push(&c, "alice", "audit", "by alice", &[]).code, 0);
    let r = result_of(&c, "alice", &launch(&c, "alice", "audit", &[]));
    assert_eq!(r, "by alice");
    let r = result_of(&c, "alice", &launch(&c, "alice", "outer", &[]));
    assert_eq!(reached(&r), "ran: by alice");
    let reply = by_name("audit").unwrap().into_inner();
    let out = c.client_as("alice", &["wait", &reply.run_id, "--json"]);
    assert_eq!(out.json()["result"], "by alice");
    let r = result_of(&c, "bob", &launch(&c, "bob", "audit", &[]));
    assert_eq!(r, "by bob");
}

#[test]
fn an_operator_s_push_to_every_namespace_comes_after_each_namespace_s_own() {
    let c = Cluster::start_coordinator_with(1, 2, &["--publisher", "alice", "--publisher", "ops"]);
    tenants(&c);
    let out = push(&c, "ops", "shared", "for the fleet", &["--namespace", "*"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("for every namespace"), "{out:?}");
    assert!(c.path().join("store/fleet/workflows/shared.js").is_file());
    for who in ["alice", "bob", "client"] {
        let rows = listed(&c, who, &[]).unwrap();
        assert_eq!(
            rows,
            [(
                "shared".into(),
                "for the fleet".into(),
                "fleet:shared".into(),
                "*".into()
            )],
            "{who}"
        );
        let r = result_of(&c, who, &launch(&c, who, "shared", &[]));
        assert_eq!(r, "for the fleet", "{who}");
    }
    // A namespace's own push of the name comes first, for that namespace only.
    assert_eq!(push(&c, "alice", "shared", "alices own", &[]).code, 0);
    assert_eq!(
        result_of(&c, "alice", &launch(&c, "alice", "shared", &[])),
        "alices own"
    );
    assert_eq!(
        result_of(&c, "bob", &launch(&c, "bob", "shared", &[])),
        "for the fleet"
    );
    let rows = listed(&c, "alice", &[]).unwrap();
    assert_eq!(names(&rows), ["shared"], "{rows:?}");
    assert_eq!(rows[0].1, "alices own");
    // The fleet's own listing is what everyone was offered.
    assert_eq!(
        names(&listed(&c, "bob", &["--namespace", "*"]).unwrap()),
        ["shared"]
    );
}

#[test]
fn a_store_from_before_namespaces_still_serves_its_pushes_to_default_only() {
    let c = Cluster::start_coordinator_with(1, 2, &["--publisher", "client"]);
    tenants(&c);
    // As a coordinator before namespaces left it: the script, and its push record.
    let old = c.path().join("store/workflows");
    std::fs::create_dir_all(old.join(".pushes/legacy")).unwrap();
    std::fs::write(
        old.join("legacy.js"),
        "export const meta = { name: 'legacy', description: 'from before' };\nreturn 'legacy ran';\n",
    )
    .unwrap();
    std::fs::write(
        old.join(".pushes/legacy/000001700000000-0123456789ab.json"),
        r#"{"name":"legacy","by":"client","at":"2024-01-01T00:00:00Z","sha256":"0123456789ab","replaced":null}"#,
    )
    .unwrap();
    // `default` (a certificate naming no namespace) has it; another namespace never had it.
    assert_eq!(names(&listed(&c, "client", &[]).unwrap()), ["legacy"]);
    assert_eq!(
        result_of(&c, "client", &launch(&c, "client", "legacy", &[])),
        "legacy ran"
    );
    assert_eq!(listed(&c, "alice", &[]).unwrap(), []);
    let out = launch(&c, "alice", "legacy", &[]);
    let absent = launch(&c, "alice", "nonesuch", &[]);
    assert_ne!(out.code, 0, "{out:?}");
    as_if_absent(&out.stderr, "legacy", &absent.stderr);
    // An operator finds it by asking for `default`.
    assert_eq!(
        names(&listed(&c, "ops", &["--namespace", "default"]).unwrap()),
        ["legacy"]
    );
    // A push to `default` still goes where it always went, and replaces the old one.
    let out = push(&c, "client", "legacy", "pushed again", &[]);
    assert!(
        out.stdout
            .starts_with("replaced legacy in namespace default"),
        "{out:?}"
    );
    assert!(
        std::fs::read_to_string(old.join("legacy.js"))
            .unwrap()
            .contains("pushed again")
    );
    assert_eq!(
        std::fs::read_dir(old.join(".pushes/legacy"))
            .unwrap()
            .count(),
        2
    );
}
