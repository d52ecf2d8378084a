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
    let client = |args: &[&str]| {
        flotilla(
            dir.path(),
            &[
                args,
                &[
                    "--coordinator",
                    &url,
                    "--tls-dir",
                    pki_s,
                    "--name",
                    "client",
                ],
            ]
            .concat(),
        )
    };
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
