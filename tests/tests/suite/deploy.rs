//! Deploy artifacts (issue 17): the systemd units are valid, hardened, and start the real
//! binary with flags it takes; the Kubernetes manifests validate against the schemas of the
//! Kubernetes versions users run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use flotilla_tests::run_with_timeout;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The unit with its binary path pointing at the built binary (`verify` wants it to exist).
fn unit_for_test(name: &str, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(repo().join("deploy/systemd").join(name)).unwrap();
    let text = text.replace(
        "/usr/local/bin/flotilla",
        flotilla_tests::binary().to_str().unwrap(),
    );
    let out = dir.join(name);
    std::fs::write(&out, text).unwrap();
    out
}

/// The overall exposure `systemd-analyze security --offline` gives a unit (0 best, 10 worst).
fn exposure(unit: &Path) -> f64 {
    let mut cmd = Command::new("systemd-analyze");
    cmd.args(["security", "--offline=yes", "--no-pager"])
        .arg(unit);
    let out = run_with_timeout(cmd, Duration::from_secs(60));
    let line = out
        .stdout
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| panic!("no exposure level: {out:?}"));
    line.split(':')
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"))
}

#[test]
fn the_systemd_units_verify_clean_are_hardened_and_their_flags_are_the_binary_s() {
    let dir = tempfile::tempdir().unwrap();
    for (name, most) in [
        ("flotilla-coordinator.service", 2.0),
        ("flotilla-worker.service", 5.0),
    ] {
        let unit = unit_for_test(name, dir.path());
        let mut cmd = Command::new("systemd-analyze");
        cmd.arg("verify").arg(&unit);
        let out = run_with_timeout(cmd, Duration::from_secs(60));
        assert_eq!(out.code, 0, "{out:?}");
        assert!(
            out.stdout.trim().is_empty() && out.stderr.trim().is_empty(),
            "{name} does not verify clean: {out:?}"
        );
        let level = exposure(&unit);
        assert!(level <= most, "{name}: exposure {level} (at most {most})");
        // Every file ExecStart reads from the credentials directory is a credential the unit
        // loads by that name (a directory would be loaded as `ID_FILE` credentials, flat).
        let original = std::fs::read_to_string(repo().join("deploy/systemd").join(name)).unwrap();
        let loaded: Vec<&str> = original
            .lines()
            .filter_map(|l| l.strip_prefix("LoadCredential="))
            .map(|c| c.split(':').next().unwrap())
            .collect();
        let exec_line = original
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .unwrap();
        let mut wanted: Vec<String> = exec_line
            .split_whitespace()
            .filter_map(|w| w.strip_prefix("${CREDENTIALS_DIRECTORY}/"))
            .map(str::to_owned)
            .collect();
        let words: Vec<&str> = exec_line.split_whitespace().collect();
        if let Some(i) = words.iter().position(|w| *w == "--tls-dir")
            && words.get(i + 1) == Some(&"${CREDENTIALS_DIRECTORY}")
        {
            let who = words
                .iter()
                .position(|w| *w == "--name")
                .and_then(|j| words.get(j + 1))
                .expect("--tls-dir with --name");
            wanted.extend([
                "ca.crt".to_owned(),
                format!("{who}.crt"),
                format!("{who}.key"),
            ]);
        }
        assert!(!wanted.is_empty(), "{name} reads no credentials");
        for w in &wanted {
            assert!(
                loaded.contains(&w.as_str()),
                "{name} reads credential {w} but loads {loaded:?}"
            );
        }
        // ExecStart with the credentials directory and the host name filled in: the binary
        // takes every flag (it stops at the missing config file, not at a flag).
        let text = std::fs::read_to_string(&unit).unwrap();
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .unwrap()
            .replace("${CREDENTIALS_DIRECTORY}", dir.path().to_str().unwrap())
            .replace("%H", "host");
        let mut words = exec.split_whitespace();
        let mut cmd = Command::new(words.next().unwrap());
        cmd.args(words);
        let out = run_with_timeout(cmd, Duration::from_secs(30));
        assert_ne!(out.code, 0);
        assert!(
            !out.stderr.contains("unexpected argument") && !out.stderr.contains("Usage:"),
            "{name}: the binary refuses the unit's flags: {}",
            out.stderr
        );
        assert!(out.stderr.contains("/etc/flotilla/"), "{}", out.stderr);
    }
}

fn validator() -> PathBuf {
    let v = repo().join(".venv-svc/bin/kubernetes-validate");
    assert!(
        v.exists(),
        "kubernetes-validate is missing: tools/test --setup installs it into .venv-svc"
    );
    v
}

/// Every manifest of `deploy/kubernetes` (not the kustomizations), recursively.
fn manifests() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![repo().join("deploy/kubernetes")];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "yaml")
                && p.file_name().is_some_and(|n| n != "kustomization.yaml")
            {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn the_kubernetes_manifests_validate_strictly_for_the_versions_users_run() {
    let files = manifests();
    assert!(files.len() >= 4, "{files:?}");
    for version in ["1.28.0", "1.29.0", "1.30.0", "1.31.0"] {
        let mut cmd = Command::new(validator());
        cmd.args(["--strict", "--quiet", "-k", version])
            .args(&files);
        let out = run_with_timeout(cmd, Duration::from_secs(120));
        assert_eq!(out.code, 0, "Kubernetes {version}: {out:?}");
    }
    // Every resource a kustomization lists is there.
    for k in [
        "deploy/kubernetes/kustomization.yaml",
        "deploy/kubernetes/hpa/kustomization.yaml",
    ] {
        let path = repo().join(k);
        let text = std::fs::read_to_string(&path).unwrap();
        let listed: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with("resources:"))
            .skip(1)
            .take_while(|l| l.starts_with("  - "))
            .map(|l| l.trim_start_matches("  - ").trim())
            .collect();
        assert!(!listed.is_empty(), "{k}");
        for r in listed {
            assert!(path.parent().unwrap().join(r).exists(), "{k} lists {r}");
        }
    }
    // The validator can fail: a misspelt field is refused.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    let text = std::fs::read_to_string(repo().join("deploy/kubernetes/worker.yaml")).unwrap();
    std::fs::write(&bad, text.replacen("replicas: 3", "replica: 3", 1)).unwrap();
    let mut cmd = Command::new(validator());
    cmd.args(["--strict", "--quiet"]).arg(&bad);
    assert_ne!(run_with_timeout(cmd, Duration::from_secs(120)).code, 0);
}

#[test]
fn the_manifests_run_the_binary_with_flags_it_takes() {
    // Each container's args, with the downward API's values filled in, parse: the binary
    // stops at what is missing here (its certificates), not at a flag.
    for (file, role) in [
        ("coordinator.yaml", "coordinator"),
        ("worker.yaml", "worker"),
    ] {
        let text = std::fs::read_to_string(repo().join("deploy/kubernetes").join(file)).unwrap();
        let args: Vec<String> = text
            .lines()
            .skip_while(|l| l.trim() != "args:")
            .skip(1)
            .take_while(|l| l.trim_start().starts_with("- "))
            .map(|l| {
                l.trim_start()
                    .trim_start_matches("- ")
                    .replace("$(POD_IP)", "10.0.0.7")
                    .replace("$(POD_NAME)", "flotilla-worker-abc")
            })
            .collect();
        assert_eq!(args[0], role, "{file}: {args:?}");
        // What Prometheus is told to scrape is the operator listener, which needs no token.
        if let Some(port) = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("prometheus.io/port: "))
        {
            let port = port.trim_matches('"');
            assert!(
                args.iter()
                    .any(|a| a.starts_with("--metrics-listen=") && a.ends_with(&format!(":{port}"))),
                "{file}: prometheus.io/port {port} is not the --metrics-listen port: {args:?}"
            );
        }
        let mut cmd = Command::new(flotilla_tests::binary());
        cmd.args(&args).env("FLOTILLA_STORE", "memory://");
        let out = run_with_timeout(cmd, Duration::from_secs(30));
        assert_ne!(out.code, 0);
        assert!(
            !out.stderr.contains("unexpected argument") && !out.stderr.contains("Usage:"),
            "{file}: {}",
            out.stderr
        );
        assert!(
            out.stderr.contains("/etc/flotilla/pki"),
            "{file}: {}",
            out.stderr
        );
    }
}

/// `promtool` passes the shipped alerting rules and their unit test, and every alert has a
/// case there in which it fires.
#[test]
fn the_alerting_rules_pass_promtool_and_each_fires_in_its_unit_test() {
    let dir = repo().join("deploy/prometheus");
    for args in [
        ["check", "rules", "flotilla-alerts.yaml"],
        ["test", "rules", "flotilla-alerts.test.yaml"],
    ] {
        let mut cmd = Command::new("promtool");
        cmd.args(args).current_dir(&dir);
        let out = run_with_timeout(cmd, Duration::from_secs(60));
        assert_eq!(out.code, 0, "promtool {args:?}: {out:?}");
    }
    let rules = std::fs::read_to_string(dir.join("flotilla-alerts.yaml")).unwrap();
    let tests = std::fs::read_to_string(dir.join("flotilla-alerts.test.yaml")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 10, "{alerts:?}");
    for alert in alerts {
        // A case that expects it to fire: its name, then an expected alert before the next case.
        let fires = tests
            .split("alertname: ")
            .skip(1)
            .any(|case| case.starts_with(&format!("{alert}\n")) && case.contains("exp_labels:"));
        assert!(fires, "{alert} has no unit test in which it fires");
    }
}

#[test]
fn certs_ensure_makes_what_is_missing_and_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    let ensure = |extra: &[&str]| {
        let mut cmd = Command::new(flotilla_tests::binary());
        cmd.args(["certs", "ensure", "--dir"])
            .arg(&pki)
            .args([
                "--cert",
                "coordinator:coordinator",
                "--cert",
                "worker:worker",
                "--host",
                "127.0.0.1",
            ])
            .args(extra);
        run_with_timeout(cmd, Duration::from_secs(30))
    };
    let first = ensure(&[]);
    assert_eq!(first.code, 0, "{first:?}");
    assert!(
        first.stdout.contains("made ca, coordinator, worker"),
        "{first:?}"
    );
    let key = std::fs::read(pki.join("coordinator.key")).unwrap();
    let again = ensure(&[]);
    assert_eq!(again.code, 0, "{again:?}");
    assert!(
        again.stdout.contains("every certificate already"),
        "{again:?}"
    );
    assert_eq!(std::fs::read(pki.join("coordinator.key")).unwrap(), key);
    let more = ensure(&["--cert", "client:client"]);
    assert!(more.stdout.contains("made client"), "{more:?}");
    let bad = ensure(&["--cert", "nobody"]);
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(bad.stderr.contains("NAME:ROLE"), "{bad:?}");
}
