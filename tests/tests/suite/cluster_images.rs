//! The image (issue 17): `deploy/images/build` makes a scratch image of the binary, and real
//! containers of it — a coordinator and workers, as an operator runs them — serve a run
//! launched from the host; a killed worker container is replaced and the next run completes.
//! (Module name `cluster_*`: one at a time with the other fleet tests.)

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use flotilla_tests::cluster::free_port;
use flotilla_tests::{Output, binary, http_get, run_with_timeout};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn podman(args: &[&str]) -> Output {
    let mut cmd = Command::new("podman");
    cmd.args(args).env(
        "CONTAINERS_CONF",
        repo().join("deploy/images/containers.conf"),
    );
    run_with_timeout(cmd, Duration::from_secs(300))
}

/// Containers and the image of one test, removed when it ends.
struct Pod {
    tag: String,
    names: Vec<String>,
}

impl Drop for Pod {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = podman(&["rm", "-f", "-t", "0", n]);
        }
        let _ = podman(&["rmi", "-f", &self.tag]);
    }
}

impl Pod {
    fn run(&mut self, name: &str, pki: &Path, args: &[&str]) {
        let mount = format!("{}:/etc/flotilla/pki:ro", pki.display());
        let out = podman(
            &[
                &[
                    "run",
                    "-d",
                    "--name",
                    name,
                    "--network",
                    "host",
                    "-v",
                    &mount,
                    &self.tag,
                ][..],
                args,
            ]
            .concat(),
        );
        assert_eq!(out.code, 0, "podman run {name}: {out:?}");
        self.names.push(name.to_owned());
    }
}

/// `deploy/images/build WHAT` of this build's binary, tagged `tag`: removed, with the
/// containers the test adds, when the guard goes.
fn built(what: &str, tag: &str) -> Pod {
    let mut build = Command::new(repo().join("deploy/images/build"));
    build.args([what, "--binary", binary().to_str().unwrap(), "--tag", tag]);
    let out = run_with_timeout(build, Duration::from_secs(900));
    assert_eq!(out.code, 0, "{out:?}");
    Pod {
        tag: tag.to_owned(),
        names: Vec::new(),
    }
}

/// `flotilla certs ensure` in `pki`: a coordinator (for `hosts`), a worker and a client.
fn ensure_pki(dir: &Path, pki: &Path, hosts: &[&str]) {
    let mut args = vec!["certs", "ensure", "--dir", pki.to_str().unwrap()];
    for h in hosts {
        args.extend(["--host", h]);
    }
    args.extend([
        "--cert",
        "coordinator:coordinator",
        "--cert",
        "worker:worker",
        "--cert",
        "client:client",
    ]);
    let out = flotilla(dir, &args);
    assert_eq!(out.code, 0, "{out:?}");
}

/// A client command from `dir` against the coordinator at `url`, as `client` of `pki`.
fn as_client(dir: &Path, url: &str, pki: &Path, args: &[&str]) -> Output {
    let pki = pki.to_str().unwrap();
    flotilla(
        dir,
        &[
            args,
            &["--coordinator", url, "--tls-dir", pki, "--name", "client"],
        ]
        .concat(),
    )
}

fn flotilla(dir: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(binary());
    cmd.args(args)
        .current_dir(dir)
        .env("AWS_EC2_METADATA_DISABLED", "true");
    run_with_timeout(cmd, Duration::from_secs(60))
}

#[test]
fn the_image_runs_a_coordinator_and_workers_and_a_replaced_worker_keeps_the_fleet_going() {
    let dir = tempfile::tempdir().unwrap();
    let tag = format!("localhost/flotilla:test-{}", std::process::id());
    let mut build = Command::new(repo().join("deploy/images/build"));
    build.args(["--binary", binary().to_str().unwrap(), "--tag", &tag]);
    let out = run_with_timeout(build, Duration::from_secs(300));
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.stdout.trim(), tag);
    let mut pod = Pod {
        tag: tag.clone(),
        names: Vec::new(),
    };
    let v = podman(&["run", "--rm", &tag, "--version"]);
    assert!(v.stdout.starts_with("flotilla "), "{v:?}");

    // A PKI the containers' user can read (a test's own: keys world-readable here only).
    let pki = dir.path().join("pki");
    let pki_s = pki.to_str().unwrap();
    for args in [
        vec!["certs", "init", "--dir", pki_s],
        vec![
            "certs",
            "issue",
            "--dir",
            pki_s,
            "--name",
            "coordinator",
            "--role",
            "coordinator",
            "--host",
            "127.0.0.1",
        ],
        vec![
            "certs", "issue", "--dir", pki_s, "--name", "worker", "--role", "worker",
        ],
        vec![
            "certs", "issue", "--dir", pki_s, "--name", "client", "--role", "client",
        ],
    ] {
        let out = flotilla(dir.path(), &args);
        assert_eq!(out.code, 0, "{out:?}");
    }
    for key in ["coordinator.key", "worker.key"] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(pki.join(key), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let (port, http) = (free_port(), free_port());
    let unique = std::process::id();
    let coordinator = format!("flotilla-test-coordinator-{unique}");
    pod.run(
        &coordinator,
        &pki,
        &[
            "coordinator",
            &format!("--listen=127.0.0.1:{port}"),
            &format!("--http=127.0.0.1:{http}"),
            "--store=file:///var/lib/flotilla/store",
            "--tls-dir=/etc/flotilla/pki",
        ],
    );
    let url = format!("https://127.0.0.1:{port}");
    let worker = |pod: &mut Pod, name: &str| {
        pod.run(
            name,
            &pki,
            &[
                "worker",
                &format!("--coordinator={url}"),
                &format!("--name=worker/{name}"),
                "--cert=/etc/flotilla/pki/worker.crt",
                "--key=/etc/flotilla/pki/worker.key",
                "--ca=/etc/flotilla/pki/ca.crt",
                "--workspace=/var/lib/flotilla/workspace",
                "--sandbox=off",
                "--slots=4",
            ],
        );
    };
    let w1 = format!("flotilla-test-worker-a-{unique}");
    let w2 = format!("flotilla-test-worker-b-{unique}");
    worker(&mut pod, &w1);
    worker(&mut pod, &w2);
    let client = |args: &[&str]| as_client(dir.path(), &url, Path::new(pki_s), args);
    let attached = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = client(&["workers", "--json"]);
            if out.code == 0 && out.json().as_array().is_some_and(|a| a.len() == n) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{n} workers never attached: {out:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    attached(2);
    let probe = http_get(http, "/healthz", &[]);
    assert_eq!(probe.status, 200, "{}", probe.body);

    let script = flotilla_tests::write_workflow(
        dir.path(),
        "in-containers",
        "runs in containers",
        "return (await parallel(Array.from({ length: 8 }, (_, i) => () => agent('c' + i + ' [[sleep:100]]')))).length;",
    );
    let run = |label: &str| {
        let out = client(&[
            "launch",
            script.to_str().unwrap(),
            "--json",
            "--backend",
            "echo",
            "--stagger",
            "0",
        ]);
        assert_eq!(out.code, 0, "{label}: {out:?}");
        let id = out.json()["run_id"].as_str().unwrap().to_owned();
        let out = client(&["wait", &id, "--json"]);
        assert_eq!(out.code, 0, "{label}: {out:?}");
        let report = out.json();
        assert_eq!(report["status"], "completed", "{label}: {report}");
        assert_eq!(report["result"], 8, "{label}: {report}");
    };
    run("first run");

    // A worker container killed outright is replaced, and the fleet goes on.
    let out = podman(&["kill", &w1]);
    assert_eq!(out.code, 0, "{out:?}");
    attached(1);
    let w3 = format!("flotilla-test-worker-c-{unique}");
    worker(&mut pod, &w3);
    attached(2);
    run("after the replacement");
}

/// A loopback port free now whose neighbour ten thousand up is free too (SeaweedFS serves
/// gRPC there), from a range below the ephemeral one.
fn weed_port(taken: &mut Vec<u16>) -> u16 {
    let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    let start = 20000 + (std::process::id() % 5000) as u16;
    let p = (start..30000)
        .find(|p| !taken.contains(p) && free(*p) && free(*p + 10000))
        .expect("a free port pair");
    taken.push(p);
    p
}

/// A compose project's teardown: `deploy/compose/down`, then the images the test built. When
/// the test fails, the end of each of the project's containers' logs is printed first (down
/// removes the containers, and their logs with them).
struct Down {
    project: String,
    env: Vec<(String, String)>,
    images: Vec<String>,
}

impl Drop for Down {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let label = format!("label=io.podman.compose.project={}", self.project);
            let names = podman(&["ps", "-a", "--format", "{{.Names}}", "--filter", &label]);
            for name in names.stdout.split_whitespace() {
                let logs = podman(&["logs", "--tail", "200", name]);
                eprintln!(
                    "--- the end of {name}'s log:\n{}{}",
                    logs.stdout, logs.stderr
                );
            }
        }
        let mut down = Command::new(repo().join("deploy/compose/down"));
        down.envs(self.env.iter().cloned());
        let _ = run_with_timeout(down, Duration::from_secs(300));
        for image in &self.images {
            let _ = podman(&["rmi", "-f", image]);
        }
    }
}

fn compose_up(env: &[(String, String)], limit: Duration) -> Output {
    let mut up = Command::new(repo().join("deploy/compose/up"));
    up.envs(env.iter().cloned());
    run_with_timeout(up, limit)
}

#[test]
fn the_compose_stack_says_why_s3_failed_comes_up_beside_taken_ports_and_outlives_a_worker_crash() {
    let home = tempfile::tempdir().unwrap();
    let project = format!("flotillatest{}", std::process::id());
    let mut taken = Vec::new();
    let mut env: Vec<(String, String)> = vec![
        ("FLOTILLA_HOME".into(), home.path().display().to_string()),
        ("FLOTILLA_PROJECT".into(), project.clone()),
        (
            "FLOTILLA_IMAGE".into(),
            format!("localhost/flotilla:compose-{}", std::process::id()),
        ),
        (
            "FLOTILLA_WORKER_IMAGE".into(),
            format!("localhost/flotilla-worker:compose-{}", std::process::id()),
        ),
    ];
    for var in [
        "FLOTILLA_PORT_A",
        "FLOTILLA_PORT_B",
        "FLOTILLA_HTTP_A",
        "FLOTILLA_HTTP_B",
        "FLOTILLA_ETCD_PORT",
        "FLOTILLA_ETCD_PEER_PORT",
        "FLOTILLA_S3_PORT",
        "FLOTILLA_S3_MASTER_PORT",
        "FLOTILLA_S3_VOLUME_PORT",
        "FLOTILLA_S3_FILER_PORT",
    ] {
        env.push((var.into(), weed_port(&mut taken).to_string()));
    }
    let get = |k: &str| env.iter().find(|(n, _)| n == k).unwrap().1.clone();
    // The images of this build (the script would build release ones when they are missing).
    let images = vec![get("FLOTILLA_IMAGE"), get("FLOTILLA_WORKER_IMAGE")];
    let guard = Down {
        project: project.clone(),
        env: env.clone(),
        images: images.clone(),
    };
    for (what, image) in ["flotilla", "worker"].iter().zip(&images) {
        let mut build = Command::new(repo().join("deploy/images/build"));
        build.args([what, "--binary", binary().to_str().unwrap(), "--tag", image]);
        let out = run_with_timeout(build, Duration::from_secs(900));
        assert_eq!(out.code, 0, "{out:?}");
    }

    // An S3 server that cannot start (another process holds its master's port): `up` says
    // which service did not come up, shows the end of its log (why) and the command for all
    // of it, with the project named (another project's logs are not these). A service that
    // keeps exiting is said as soon as it is seen, not after `up`'s whole wait (a minute).
    {
        let failing_home = tempfile::tempdir().unwrap();
        let failing_project = format!("{project}s3");
        let mut failing = env.clone();
        for (k, v) in &mut failing {
            match k.as_str() {
                "FLOTILLA_HOME" => *v = failing_home.path().display().to_string(),
                "FLOTILLA_PROJECT" => *v = failing_project.clone(),
                _ => {}
            }
        }
        let master = get("FLOTILLA_S3_MASTER_PORT");
        let holder = std::net::TcpListener::bind(format!("127.0.0.1:{master}")).unwrap();
        let failing_guard = Down {
            project: failing_project.clone(),
            env: failing.clone(),
            images: Vec::new(),
        };
        let out = compose_up(&failing, Duration::from_secs(60));
        assert_ne!(out.code, 0, "{out:?}");
        assert!(
            out.stderr.contains("the S3 server did not come up"),
            "{out:?}"
        );
        assert!(
            out.stderr
                .contains(&format!("127.0.0.1:{master}: bind: address already in use")),
            "the log's end says why: {out:?}"
        );
        assert!(
            out.stderr.contains(&format!(" -p {failing_project} -f ")),
            "{out:?}"
        );
        assert!(out.stderr.contains("compose.yaml logs s3"), "{out:?}");
        drop(failing_guard);
        drop(holder);
    }

    // SeaweedFS's listeners on fixed ports by default (its Iceberg catalog on 8181, its Lance
    // server on 9101) are off: the stack comes up while another process holds them (this
    // test, or whatever holds them now).
    let _held: Vec<_> = [8181, 9101]
        .into_iter()
        .filter_map(|p| std::net::TcpListener::bind(("127.0.0.1", p)).ok())
        .collect();
    let out = compose_up(&env, Duration::from_secs(600));
    assert_eq!(out.code, 0, "{out:?}");
    let pki = out.stdout.trim().to_owned();
    assert!(out.stderr.contains("flotilla launch"), "{}", out.stderr);
    // Either coordinator serves clients (a standby forwards to the leader).
    let coordinators = format!("https://127.0.0.1:{}", get("FLOTILLA_PORT_B"));
    let client = |args: &[&str]| as_client(home.path(), &coordinators, Path::new(&pki), args);
    let attached = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let out = client(&["workers", "--json"]);
            let now = out
                .json()
                .as_array()
                .map_or(0, |a| a.iter().filter(|w| w["state"] == "attached").count());
            if out.code == 0 && now == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{n} workers never attached: {out:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    };
    attached(3);
    // The workers run sandboxed: each made a bubblewrap sandbox before it attached.
    for i in 1..=3 {
        let logs = podman(&["logs", &format!("{project}_worker-{i}_1")]);
        assert_eq!(logs.code, 0, "{logs:?}");
        assert!(
            !logs.stderr.contains("without a sandbox")
                && !logs.stdout.contains("without a sandbox"),
            "{logs:?}"
        );
    }
    let script = flotilla_tests::write_workflow(
        home.path(),
        "compose-run",
        "on the compose stack",
        "return (await parallel(Array.from({ length: 24 }, (_, i) => () => agent('c' + i + ' [[sleep:500]]')))).length;",
    );
    let out = client(&[
        "launch",
        script.to_str().unwrap(),
        "--json",
        "--backend",
        "echo",
        "--stagger",
        "0",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();

    // A worker crashes (its process killed outright): its container is started again, and
    // the run completes with every call.
    let worker = format!("{project}_worker-1_1");
    let pid = podman(&["inspect", "-f", "{{.State.Pid}}", &worker]);
    assert_eq!(pid.code, 0, "{pid:?}");
    let killed = Command::new("kill")
        .args(["-9", pid.stdout.trim()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = podman(&[
            "inspect",
            "-f",
            "{{.RestartCount}} {{.State.Status}}",
            &worker,
        ]);
        let text = r.stdout.trim().to_owned();
        if text.ends_with("running") && !text.starts_with("0 ") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker was not started again: {text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = client(&["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    let report = out.json();
    assert_eq!(report["status"], "completed", "{report}");
    assert_eq!(report["result"], 24, "{report}");
    attached(3);

    // Down: nothing of the project is left.
    drop(guard);
    let left = podman(&[
        "ps",
        "-aq",
        "--filter",
        &format!("label=io.podman.compose.project={project}"),
    ]);
    assert!(left.stdout.trim().is_empty(), "left running: {left:?}");
}

/// The manifests of `deploy/kubernetes` as `podman kube play` can run them here: the
/// Deployments and the ConfigMap (it ignores Services and budgets), on the host's loopback
/// (no pod network may be used), a file store and one coordinator (no etcd), the secrets as
/// host paths (podman 4.3 crashes on secret volumes), the workers unsandboxed (the image
/// has no bubblewrap), no container ports (nothing to map on the host network), the pod IP
/// given (podman has none), the coordinator's operator listener on a free loopback port and
/// the workers' off (both replicas share the host network).
/// Everything else — args, env, probes, security contexts, volumes — is
/// as written.
fn for_kube_play(
    image: &str,
    pki: &Path,
    (port, http, metrics): (u16, u16, u16),
    suffix: &str,
) -> String {
    let dir = repo().join("deploy/kubernetes");
    let mut docs = Vec::new();
    for file in ["settings.yaml", "coordinator.yaml", "worker.yaml"] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        for doc in text.split("\n---\n") {
            if doc.contains("kind: Deployment") || doc.contains("kind: ConfigMap") {
                docs.push(doc.to_owned());
            }
        }
    }
    let pki = pki.display().to_string();
    let mut out = docs.join("\n---\n");
    for (from, to) in [
        ("image: flotilla\n", format!("image: {image}\n")),
        // The plain image for the workers too (they run unsandboxed here).
        ("image: flotilla-worker\n", format!("image: {image}\n")),
        ("            procMount: Unmasked\n", String::new()),
        // Names of this test's own (pods are named after their Deployment).
        (
            "\n  name: flotilla-coordinator\n",
            format!("\n  name: flotilla-coordinator-{suffix}\n"),
        ),
        (
            "\n  name: flotilla-worker\n",
            format!("\n  name: flotilla-worker-{suffix}\n"),
        ),
        (
            "s3://flotilla/runs",
            "file:///var/lib/flotilla/store".to_owned(),
        ),
        (
            "  FLOTILLA_ETCD: \"https://etcd.flotilla.svc:2379\"\n",
            String::new(),
        ),
        ("replicas: 2", "replicas: 1".to_owned()),
        ("replicas: 3", "replicas: 2".to_owned()),
        (
            "--listen=0.0.0.0:7443",
            format!("--listen=127.0.0.1:{port}"),
        ),
        ("--http=0.0.0.0:7080", format!("--http=127.0.0.1:{http}")),
        (
            "--metrics-listen=0.0.0.0:9464",
            format!("--metrics-listen=127.0.0.1:{metrics}"),
        ),
        (
            "            - --metrics-listen=$(POD_IP):9465\n",
            String::new(),
        ),
        ("port: http\n", format!("port: {http}\n")),
        // podman does not know the pod's IP; on the host network it is loopback.
        (
            "            - name: POD_IP\n              valueFrom:\n                fieldRef:\n                  fieldPath: status.podIP\n",
            "            - name: POD_IP\n              value: \"127.0.0.1\"\n".to_owned(),
        ),
        // On the host network there is nothing to map (podman refuses port mappings there).
        (
            "          ports:\n            - name: grpc\n              containerPort: 7443\n            - name: http\n              containerPort: 7080\n            - name: metrics\n              containerPort: 9464\n",
            String::new(),
        ),
        (
            "          ports:\n            - name: metrics\n              containerPort: 9465\n",
            String::new(),
        ),
        (
            "--coordinator=https://flotilla-coordinator:7443",
            format!("--coordinator=https://127.0.0.1:{port}"),
        ),
        (
            "            - --slots=8\n",
            "            - --slots=4\n            - --sandbox=off\n".to_owned(),
        ),
        (
            "      automountServiceAccountToken: false\n",
            "      automountServiceAccountToken: false\n      hostNetwork: true\n".to_owned(),
        ),
        (
            "          secret:\n            secretName: flotilla-pki\n            defaultMode: 0400\n",
            format!("          hostPath:\n            path: {pki}\n"),
        ),
        (
            "          secret:\n            secretName: flotilla-worker-pki\n            defaultMode: 0400\n",
            format!("          hostPath:\n            path: {pki}\n"),
        ),
    ] {
        assert!(
            out.contains(from),
            "the manifests changed: {from:?} is not in them"
        );
        out = out.replace(from, &to);
    }
    out
}

#[test]
fn the_kubernetes_deployments_come_up_as_real_pods_and_serve_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let image = format!("localhost/flotilla:kube-{}", std::process::id());
    let mut build = Command::new(repo().join("deploy/images/build"));
    build.args(["--binary", binary().to_str().unwrap(), "--tag", &image]);
    assert_eq!(run_with_timeout(build, Duration::from_secs(300)).code, 0);
    let pki = dir.path().join("pki");
    ensure_pki(dir.path(), &pki, &["127.0.0.1", "flotilla-coordinator"]);
    for key in ["coordinator.key", "worker.key"] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(pki.join(key), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let (port, http, metrics) = (free_port(), free_port(), free_port());
    let played = dir.path().join("played.yaml");
    std::fs::write(
        &played,
        for_kube_play(
            &image,
            &pki,
            (port, http, metrics),
            &std::process::id().to_string(),
        ),
    )
    .unwrap();
    struct Down(PathBuf, String);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = podman(&["kube", "down", self.0.to_str().unwrap()]);
            let _ = podman(&["rmi", "-f", &self.1]);
        }
    }
    let _down = Down(played.clone(), image.clone());
    let out = podman(&["kube", "play", played.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{out:?}");

    let url = format!("https://127.0.0.1:{port}");
    let client = |args: &[&str]| as_client(dir.path(), &url, &pki, args);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let ready = http_get(http, "/healthz", &[]).status == 200;
        let out = client(&["workers", "--json"]);
        let n = out.json_or_null().as_array().map_or(0, Vec::len);
        if ready && n == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pods never served (ready {ready}, {n} workers): {out:?} {:?}",
            podman(&["ps", "-a"])
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let script = flotilla_tests::write_workflow(
        dir.path(),
        "in-pods",
        "runs in pods",
        "return (await parallel(Array.from({ length: 6 }, (_, i) => () => agent('p' + i)))).length;",
    );
    let out = client(&[
        "launch",
        script.to_str().unwrap(),
        "--json",
        "--backend",
        "echo",
        "--stagger",
        "0",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let out = client(&["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["result"], 6);
    // The operator listener the manifests annotate for scraping: no token, both workers.
    let scraped = http_get(metrics, "/metrics", &[]);
    assert_eq!(scraped.status, 200, "{scraped:?}");
    assert!(
        scraped
            .body
            .contains("flotilla_workers{state=\"attached\"} 2\n"),
        "{}",
        scraped.body
    );
}

#[test]
fn the_worker_image_runs_the_pinned_claude_cli_in_its_sandbox_against_the_model_api() {
    let dir = tempfile::tempdir().unwrap();
    let image = format!("localhost/flotilla-worker:test-{}", std::process::id());
    let mut pod = built("worker", &image);
    let pki = dir.path().join("pki");
    ensure_pki(dir.path(), &pki, &["127.0.0.1"]);
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            pki.join("worker.key"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
    }
    // The coordinator on the host; the worker in its container, on the host's loopback.
    let port = free_port();
    let mut coordinator = Command::new(binary())
        .args(["coordinator", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--http", &format!("127.0.0.1:{}", free_port())])
        .arg("--store")
        .arg(format!("file://{}", dir.path().join("store").display()))
        .arg("--tls-dir")
        .arg(&pki)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _coordinator = Kill(&mut coordinator);
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    let name = format!("flotilla-test-claude-worker-{}", std::process::id());
    let mut args: Vec<String> = vec![
        "run".into(),
        "-d".into(),
        "--name".into(),
        name.clone(),
        "--network".into(),
        "host".into(),
        // bubblewrap in a container: user namespaces (seccomp) and its own /proc (unmasked),
        // what the Kubernetes manifest asks for too.
        "--security-opt".into(),
        "seccomp=unconfined".into(),
        "--security-opt".into(),
        "unmask=ALL".into(),
        "-v".into(),
        format!("{}:/etc/flotilla/pki:ro", pki.display()),
    ];
    for (k, v) in fake.env() {
        args.push("-e".into());
        args.push(format!("{k}={v}"));
    }
    args.extend(
        [
            image.as_str(),
            "worker",
            &format!("--coordinator=https://127.0.0.1:{port}"),
            "--cert=/etc/flotilla/pki/worker.crt",
            "--key=/etc/flotilla/pki/worker.key",
            "--ca=/etc/flotilla/pki/ca.crt",
            "--workspace=/var/lib/flotilla/workspace",
            "--backend=claude-code",
            "--slots=2",
        ]
        .map(str::to_owned),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = podman(&args);
    assert_eq!(out.code, 0, "{out:?}");
    pod.names.push(name.clone());
    let url = format!("https://127.0.0.1:{port}");
    let client = |args: &[&str]| as_client(dir.path(), &url, &pki, args);
    let deadline = Instant::now() + Duration::from_secs(60);
    while client(&["workers", "--json"])
        .json_or_null()
        .as_array()
        .map_or(0, Vec::len)
        != 1
    {
        assert!(
            Instant::now() < deadline,
            "the worker never attached: {:?}",
            podman(&["logs", &name])
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let logs = podman(&["logs", &name]);
    assert!(
        !logs.stderr.contains("without a sandbox") && !logs.stdout.contains("without a sandbox"),
        "{logs:?}"
    );
    let script = flotilla_tests::write_workflow(
        dir.path(),
        "claude-in-a-container",
        "the claude CLI in the worker image",
        "return await agent('look [[bash:echo from the container sandbox]]', { tools: ['Bash'] });",
    );
    let out = client(&[
        "launch",
        script.to_str().unwrap(),
        "--json",
        "--backend",
        "claude-code",
        "--stagger",
        "0",
        "--source",
        "none",
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    let run = out.json()["run_id"].as_str().unwrap().to_owned();
    let out = client(&["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?} {:?}", podman(&["logs", &name]));
    let report = out.json();
    assert_eq!(
        report["result"], "tool said: from the container sandbox",
        "{report}"
    );
    assert!(!fake.requests().is_empty());
}

/// `systemctl show -p PROP --value UNIT` in container `name` (`None` until its systemd
/// answers).
fn try_unit_property(name: &str, unit: &str, prop: &str) -> Option<String> {
    let out = podman(&[
        "exec",
        name,
        "systemctl",
        "show",
        "-p",
        prop,
        "--value",
        unit,
    ]);
    (out.code == 0).then(|| out.stdout.trim().to_owned())
}

fn unit_property(name: &str, unit: &str, prop: &str) -> String {
    try_unit_property(name, unit, prop).unwrap_or_else(|| panic!("systemctl show {unit}"))
}

/// The units of `deploy/systemd`, as written, under a real systemd (PID 1 of a container
/// of `deploy/images/build systemd`): both start as dynamic users with their certificates
/// handed over as credentials, the worker's agents run in bubblewrap sandboxes that cannot
/// read its key, a worker killed outright is started again by the restart policy and the
/// next run completes, and `systemctl stop` ends the coordinator cleanly.
#[test]
fn the_systemd_units_run_under_systemd_sandboxed_restarted_and_stopped_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let tag = format!("localhost/flotilla-systemd:test-{}", std::process::id());
    let mut pod = built("systemd", &tag);
    // /etc/flotilla as the units' header says: settings and the certificates (keys stay
    // root's, mode 0600: systemd hands them to the services).
    let etc = dir.path().join("etc");
    let pki = etc.join("pki");
    ensure_pki(dir.path(), &pki, &["127.0.0.1"]);
    let (port, http) = (free_port(), free_port());
    std::fs::write(
        etc.join("coordinator.toml"),
        format!(
            "listen = \"127.0.0.1:{port}\"\nhttp = \"127.0.0.1:{http}\"\n\
             store = \"file:///var/lib/flotilla-coordinator/store\"\n"
        ),
    )
    .unwrap();
    std::fs::write(
        etc.join("worker.toml"),
        format!(
            "coordinator = \"https://127.0.0.1:{port}\"\nbackends = [\"echo\", \"exec\"]\n\
             exec_cmd = \"sh\"\nslots = 4\n"
        ),
    )
    .unwrap();
    let name = format!("flotilla-test-systemd-{}", std::process::id());
    let volume = format!("{}:/etc/flotilla:ro", etc.display());
    let out = podman(&[
        "run",
        "-d",
        "--name",
        &name,
        "--network",
        "host",
        "--systemd=always",
        "--cap-add",
        "SYS_ADMIN",
        // The worker's agents in bubblewrap: user namespaces and a /proc of their own.
        "--security-opt",
        "seccomp=unconfined",
        "--security-opt",
        "unmask=ALL",
        // systemd moves each service's credentials into place from a private mount
        // namespace: /run must propagate mounts, as it does on a host systemd booted.
        "--tmpfs",
        "/run:rw,rshared,mode=755",
        "-v",
        &volume,
        &tag,
    ]);
    assert_eq!(out.code, 0, "{out:?}");
    pod.names.push(name.clone());
    let journal = || {
        podman(&[
            "exec",
            &name,
            "journalctl",
            "--no-pager",
            "-u",
            "flotilla-coordinator",
            "-u",
            "flotilla-worker",
        ])
    };
    let url = format!("https://127.0.0.1:{port}");
    let client = |args: &[&str]| as_client(dir.path(), &url, &pki, args);
    let attached = |restarts_at_least: u64| {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let restarts: u64 = try_unit_property(&name, "flotilla-worker", "NRestarts")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            let workers = client(&["workers", "--json"]).json_or_null();
            let up = workers
                .as_array()
                .is_some_and(|a| a.iter().any(|w| w["state"] == "attached"));
            if up && restarts >= restarts_at_least {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the worker unit never attached: {workers}\n{:?}",
                journal()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    };
    attached(0);
    // Both run as the dynamic users systemd made for them, never as root.
    for unit in ["flotilla-coordinator", "flotilla-worker"] {
        let pid = unit_property(&name, unit, "MainPID");
        let uid = podman(&["exec", &name, "stat", "-c", "%u", &format!("/proc/{pid}")]);
        assert_eq!(uid.code, 0, "{uid:?}");
        assert_ne!(uid.stdout.trim(), "0", "{unit} runs as root");
    }
    let logs = journal();
    assert!(!logs.stdout.contains("without a sandbox"), "{logs:?}");

    // Exec agents (`sh`) in the worker's sandbox: their own host name, and neither the
    // credential systemd gave the worker nor the key on disk is theirs to read.
    let probe = "printf 'host=%s\\n' \"$(cat /proc/sys/kernel/hostname)\"; \
                 for k in /run/credentials/flotilla-worker.service/worker.key /etc/flotilla/pki/worker.key; do \
                 if cat \"$k\" >/dev/null 2>&1; then echo \"READ $k\"; else echo \"hidden $k\"; fi; done";
    let script = flotilla_tests::write_workflow(
        dir.path(),
        "under-systemd",
        "agents of the worker unit",
        &format!(
            "return await parallel([1, 2, 3].map(() => () => agent({})));",
            serde_json::Value::String(probe.into())
        ),
    );
    let out = client(&[
        "launch",
        script.to_str().unwrap(),
        "--json",
        "--backend",
        "exec",
        "--stagger",
        "0",
    ]);
    let run = flotilla_tests::launched_run_id(&out);
    let out = client(&["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}\n{:?}", journal());
    let report = out.json();
    assert_eq!(report["status"], "completed", "{report}");
    let results = report["result"]
        .as_array()
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(results.len(), 3, "{report}");
    for r in results {
        let text = r.as_str().unwrap_or_else(|| panic!("{report}"));
        assert!(text.contains("host=sandbox"), "{text}");
        assert!(!text.contains("READ"), "an agent read a key: {text}");
        assert_eq!(text.matches("hidden ").count(), 2, "{text}");
    }

    // The worker's process killed outright: systemd starts it again, and it serves the next run.
    let pid = unit_property(&name, "flotilla-worker", "MainPID");
    let out = podman(&["exec", &name, "sh", "-c", &format!("kill -KILL {pid}")]);
    assert_eq!(out.code, 0, "{out:?}");
    attached(1);
    let script = flotilla_tests::write_workflow(
        dir.path(),
        "after-restart",
        "after the worker unit restarted",
        "return (await parallel(Array.from({ length: 8 }, (_, i) => () => agent('r' + i)))).length;",
    );
    let out = client(&[
        "launch",
        script.to_str().unwrap(),
        "--json",
        "--backend",
        "echo",
        "--stagger",
        "0",
    ]);
    let run = flotilla_tests::launched_run_id(&out);
    let out = client(&["wait", &run, "--json"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(out.json()["result"], 8, "{}", out.stdout);

    // systemctl stop: the coordinator ends on SIGTERM, cleanly (no failure, no kill).
    let out = podman(&["exec", &name, "systemctl", "stop", "flotilla-coordinator"]);
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        unit_property(&name, "flotilla-coordinator", "Result"),
        "success",
        "{:?}",
        journal()
    );
    assert_eq!(
        unit_property(&name, "flotilla-coordinator", "ExecMainStatus"),
        "0"
    );
}
