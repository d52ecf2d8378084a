//! A fleet spread over the hosts of a [`NetBed`]: each etcd member, the S3 server (moto),
//! every coordinator and every worker on a host of its own, and a `client` host that the
//! test's commands run from. Coordinators form a group (etcd leases, the S3 store), workers
//! know every coordinator, everything talks mTLS with certificates for the hosts' addresses.
//!
//! Ports are fixed (each host has its own network stack). Logs are `{dir}/{label}.log`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::netbed::NetBed;
use crate::{Output, binary, run_with_timeout};

pub const ETCD_CLIENT_PORT: u16 = 2379;
pub const ETCD_PEER_PORT: u16 = 2380;
pub const S3_PORT: u16 = 5000;
pub const COORDINATOR_PORT: u16 = 7443;
pub const PAGES_PORT: u16 = 7080;
/// The bucket and prefix of the fleet's store.
pub const STORE: &str = "runs/fleet";

/// What to start.
#[derive(Debug, Clone)]
pub struct Plan {
    pub etcd_members: usize,
    pub coordinators: usize,
    pub workers: usize,
    pub slots: u32,
    /// The lease TTL of coordinators and workers.
    pub ttl: Duration,
    /// The network's latency, each way, on every link the fleet uses (worker–coordinator,
    /// coordinator–etcd, coordinator–S3, etcd–etcd); it stays through faults and heals.
    pub latency: Duration,
}

impl Default for Plan {
    fn default() -> Plan {
        Plan {
            etcd_members: 1,
            coordinators: 2,
            workers: 4,
            slots: 8,
            ttl: Duration::from_secs(3),
            latency: Duration::from_millis(5),
        }
    }
}

/// The fleet on its hosts.
pub struct HostFleet {
    pub bed: NetBed,
    pub dir: tempfile::TempDir,
    pub bin: PathBuf,
    pub plan: Plan,
}

fn must(cmd: &mut Command) {
    let out = cmd.output().expect("run command");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Host names.
pub fn etcd_host(i: usize) -> String {
    format!("etcd-{i}")
}
pub fn coordinator_host(i: usize) -> String {
    format!("coord-{i}")
}
pub fn worker_host(i: usize) -> String {
    format!("worker-{i}")
}

impl HostFleet {
    /// Starts everything in `plan`; returns once the first coordinator leads, every
    /// coordinator listens and every worker is attached.
    pub fn start(plan: Plan) -> HostFleet {
        let mut names: Vec<String> = (0..plan.etcd_members).map(etcd_host).collect();
        names.push("s3".into());
        names.extend((0..plan.coordinators).map(coordinator_host));
        names.extend((0..plan.workers).map(worker_host));
        names.push("client".into());
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let bed = NetBed::new(&refs);
        if !plan.latency.is_zero() {
            let etcd: Vec<String> = (0..plan.etcd_members).map(etcd_host).collect();
            for c in (0..plan.coordinators).map(coordinator_host) {
                for w in (0..plan.workers).map(worker_host) {
                    bed.latency(&c, &w, plan.latency);
                }
                for e in etcd.iter().map(String::as_str).chain(["s3"]) {
                    bed.latency(&c, e, plan.latency);
                }
            }
            for (i, a) in etcd.iter().enumerate() {
                for b in &etcd[i + 1..] {
                    bed.latency(a, b, plan.latency);
                }
            }
        }
        let mut f = HostFleet {
            bed,
            dir: tempfile::tempdir().expect("temp dir"),
            bin: binary(),
            plan,
        };
        f.issue_certificates();
        for i in 0..f.plan.etcd_members {
            f.start_etcd(i);
        }
        f.wait_for_etcd();
        f.start_s3();
        f.start_coordinator(0);
        f.wait_for_log("coord-0", "this coordinator leads", Duration::from_secs(60));
        for i in 1..f.plan.coordinators {
            f.start_coordinator(i);
        }
        for i in 0..f.plan.coordinators {
            f.bed.wait_listening(
                "client",
                &coordinator_host(i),
                COORDINATOR_PORT,
                "a coordinator",
            );
        }
        for i in 0..f.plan.workers {
            f.start_worker(i);
        }
        f.wait_for_workers(f.plan.workers, Duration::from_secs(60));
        f
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn pki(&self) -> PathBuf {
        self.path().join("pki")
    }

    fn log(&self, label: &str) -> PathBuf {
        self.path().join(format!("{label}.log"))
    }

    /// The text of process `label`'s log so far.
    pub fn log_text(&self, label: &str) -> String {
        std::fs::read_to_string(self.log(label)).unwrap_or_default()
    }

    fn issue_certificates(&self) {
        let pki = self.pki();
        must(
            Command::new(&self.bin)
                .args(["certs", "init", "--dir"])
                .arg(&pki),
        );
        for i in 0..self.plan.coordinators {
            let host = coordinator_host(i);
            must(
                Command::new(&self.bin)
                    .args(["certs", "issue", "--role", "coordinator", "--name", &host])
                    .args(["--host", self.bed.ip(&host), "--dir"])
                    .arg(&pki),
            );
        }
        for i in 0..self.plan.workers {
            must(
                Command::new(&self.bin)
                    .args(["certs", "issue", "--role", "worker", "--name"])
                    .arg(worker_host(i))
                    .arg("--dir")
                    .arg(&pki),
            );
        }
        must(
            Command::new(&self.bin)
                .args([
                    "certs", "issue", "--role", "client", "--name", "client", "--dir",
                ])
                .arg(&pki),
        );
    }

    /// `http://IP:2379,...` of every etcd member.
    pub fn etcd_endpoints(&self) -> String {
        (0..self.plan.etcd_members)
            .map(|i| format!("http://{}:{ETCD_CLIENT_PORT}", self.bed.ip(&etcd_host(i))))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Starts (or restarts, with its data) etcd member `i`.
    pub fn start_etcd(&mut self, i: usize) {
        let bin = crate::services::find("etcd", "apt-get install -y etcd-server");
        let host = etcd_host(i);
        let ip = self.bed.ip(&host).to_owned();
        let cluster = (0..self.plan.etcd_members)
            .map(|j| {
                format!(
                    "{}=http://{}:{ETCD_PEER_PORT}",
                    etcd_host(j),
                    self.bed.ip(&etcd_host(j))
                )
            })
            .collect::<Vec<_>>()
            .join(",");
        let data = self.path().join(format!("{host}.data"));
        let state = if data.exists() { "existing" } else { "new" };
        let mut cmd = self.bed.command(&host, bin);
        cmd.args(["--name", &host, "--data-dir"]).arg(&data).args([
            "--listen-client-urls",
            &format!("http://{ip}:{ETCD_CLIENT_PORT}"),
            "--advertise-client-urls",
            &format!("http://{ip}:{ETCD_CLIENT_PORT}"),
            "--listen-peer-urls",
            &format!("http://{ip}:{ETCD_PEER_PORT}"),
            "--initial-advertise-peer-urls",
            &format!("http://{ip}:{ETCD_PEER_PORT}"),
            "--initial-cluster",
            &cluster,
            "--initial-cluster-state",
            state,
            "--initial-cluster-token",
            "flotilla-bed",
            "--heartbeat-interval",
            "100",
            "--election-timeout",
            "1000",
            "--log-level",
            "warn",
        ]);
        let log = self.log(&host);
        self.bed.spawn(&host, &host, cmd, &log);
    }

    /// Waits until the etcd cluster takes a write.
    pub fn wait_for_etcd(&self) {
        let bin = crate::services::find("etcdctl", "apt-get install -y etcd-client");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ok = self
                .bed
                .command("client", &bin)
                .args(["--endpoints", &self.etcd_endpoints()])
                .args(["--command-timeout", "2s", "put", "/bed/ready", "1"])
                .output()
                .is_ok_and(|o| o.status.success());
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "etcd never took a write; its log:\n{}",
                self.log_text("etcd-0")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn start_s3(&mut self) {
        let ip = self.bed.ip("s3").to_owned();
        let mut cmd = self.bed.command("s3", crate::services::moto_server());
        cmd.args(["-H", &ip, "-p", &S3_PORT.to_string()]);
        let log = self.log("s3");
        self.bed.spawn("s3", "s3", cmd, &log);
        self.bed
            .wait_listening("client", "s3", S3_PORT, "the S3 server");
        let bucket = STORE.split('/').next().unwrap_or(STORE).to_owned();
        let created = self.bed.within("client", move || {
            crate::http_request_to(&ip, S3_PORT, "PUT", &format!("/{bucket}"), &[], None)
        });
        assert_eq!(created.status, 200, "cannot create the bucket: {created:?}");
    }

    /// The `AWS_*` variables of the fleet's store.
    pub fn s3_env(&self) -> Vec<(String, String)> {
        vec![
            (
                "AWS_ENDPOINT_URL".into(),
                format!("http://{}:{S3_PORT}", self.bed.ip("s3")),
            ),
            ("AWS_ACCESS_KEY_ID".into(), "test".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "testtesttest".into()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
        ]
    }

    /// `https://IP:7443` of coordinator `i`.
    pub fn coordinator_url(&self, i: usize) -> String {
        format!(
            "https://{}:{COORDINATOR_PORT}",
            self.bed.ip(&coordinator_host(i))
        )
    }

    /// Starts (or restarts) coordinator `i`.
    pub fn start_coordinator(&mut self, i: usize) {
        let host = coordinator_host(i);
        let ip = self.bed.ip(&host).to_owned();
        let mut cmd = self.bed.command(&host, &self.bin);
        cmd.args(["coordinator", "--name", &host])
            .args(["--listen", &format!("{ip}:{COORDINATOR_PORT}")])
            .args(["--http", &format!("{ip}:{PAGES_PORT}")])
            .args(["--advertise", &self.coordinator_url(i)])
            .args(["--store", &format!("s3://{STORE}")])
            .args(["--etcd", &self.etcd_endpoints()])
            .args(["--worker-ttl", &format!("{}ms", self.plan.ttl.as_millis())])
            .arg("--tls-dir")
            .arg(self.pki())
            .args(["--cache-dir"])
            .arg(self.path().join(format!("{host}.cache")))
            .envs(self.s3_env())
            .env("FLOTILLA_LOG", "info")
            .env("AWS_EC2_METADATA_DISABLED", "true");
        let log = self.log(&host);
        self.bed.spawn(&host, &host, cmd, &log);
    }

    /// Starts (or restarts) worker `i`.
    pub fn start_worker(&mut self, i: usize) {
        let host = worker_host(i);
        let urls = (0..self.plan.coordinators)
            .map(|c| self.coordinator_url(c))
            .collect::<Vec<_>>()
            .join(",");
        let mut cmd = self.bed.command(&host, &self.bin);
        cmd.args(["worker", "--coordinator", &urls, "--name", &host])
            .args(["--slots", &self.plan.slots.to_string()])
            .arg("--tls-dir")
            .arg(self.pki())
            .arg("--workspace")
            .arg(self.path().join(format!("ws-{i}")))
            .env("FLOTILLA_LOG", "info")
            .env("AWS_EC2_METADATA_DISABLED", "true");
        let log = self.log(&host);
        self.bed.spawn(&host, &host, cmd, &log);
    }

    /// A client command from the client host against coordinator `i`.
    pub fn client_at(&self, i: usize, args: &[&str]) -> Output {
        let mut cmd = self.bed.command("client", &self.bin);
        cmd.args(args)
            .args(["--coordinator", &self.coordinator_url(i)])
            .args(["--name", "client", "--tls-dir"])
            .arg(self.pki())
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .current_dir(self.path());
        run_with_timeout(cmd, crate::COMMAND_TIMEOUT)
    }

    /// The last `lines` lines of every coordinator's and worker's log.
    pub fn log_tails(&self, lines: usize) -> String {
        let labels = (0..self.plan.coordinators)
            .map(coordinator_host)
            .chain((0..self.plan.workers).map(worker_host));
        let mut out = String::new();
        for label in labels {
            let text = self.log_text(&label);
            let all: Vec<&str> = text.lines().collect();
            let tail = &all[all.len().saturating_sub(lines)..];
            out.push_str(&format!(
                "--- {label} (last {} lines)\n{}\n",
                tail.len(),
                tail.join("\n")
            ));
        }
        out
    }

    /// Waits until `needle` is in process `label`'s log.
    pub fn wait_for_log(&self, label: &str, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log_text(label).contains(needle) {
            assert!(
                Instant::now() < deadline,
                "{label} never logged {needle:?}; its log:\n{}",
                self.log_text(label)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Which coordinator leads now, asked of etcd (`None`: nobody).
    pub fn leader(&self) -> Option<usize> {
        let bin = crate::services::find("etcdctl", "apt-get install -y etcd-client");
        let out = self
            .bed
            .command("client", bin)
            .args(["--endpoints", &self.etcd_endpoints()])
            .args([
                "--command-timeout",
                "2s",
                "get",
                "/flotilla/leader",
                "--print-value-only",
            ])
            .output()
            .ok()?;
        let url = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (0..self.plan.coordinators).find(|i| self.coordinator_url(*i) == url)
    }

    /// Waits until `n` workers are attached to the coordinator that leads (asked of etcd, so a
    /// frozen former leader is never asked).
    pub fn wait_for_workers(&self, n: usize, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let attached = self.leader().is_some_and(|i| {
                let out = self.client_at(i, &["workers", "--json"]);
                out.code == 0
                    && serde_json::from_str::<Value>(&out.stdout)
                        .ok()
                        .and_then(|v| v.as_array().map(Vec::len))
                        == Some(n)
            });
            if attached {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{n} workers never attached (leader: {:?});\n{}",
                self.leader(),
                self.log_tails(30)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Writes a script and launches it through coordinator `at`; its run id.
    pub fn launch(&self, at: usize, name: &str, body: &str, extra: &[&str]) -> String {
        let script = crate::write_workflow(self.path(), name, "fleet on hosts", body);
        let mut args = vec!["launch", script.to_str().expect("utf-8"), "--json"];
        args.extend_from_slice(extra);
        crate::launched_run_id(&self.client_at(at, &args))
    }

    /// The run's status as coordinator `at` reports it (`Value::Null` when it cannot answer).
    pub fn status(&self, at: usize, run: &str) -> Value {
        let out = self.client_at(at, &["status", run, "--json"]);
        if out.code == 0 {
            out.json()
        } else {
            Value::Null
        }
    }

    /// `flotilla wait RUN --json` through coordinator `at`.
    pub fn wait(&self, at: usize, run: &str) -> (i32, Value) {
        let out = self.client_at(at, &["wait", run, "--json"]);
        let code = out.code;
        (code, out.json())
    }

    /// Every completed-call record of a run in the store, read from the client host.
    pub fn journal(&self, run: &str) -> Vec<Value> {
        let env = self.s3_env();
        let run = run.to_owned();
        self.bed.within("client", move || {
            crate::cluster::s3_journal(STORE, &env, &run)
        })
    }

    /// The invariants of a run that has ended: it completed (exit 0), every call's result is
    /// in the journal exactly once, and the script saw `calls` results.
    pub fn assert_completed_once_each(&self, at: usize, run: &str, calls: usize) -> Value {
        let (code, report) = self.wait(at, run);
        assert_eq!(code, 0, "the run did not complete: {report}");
        let journal = self.journal(run);
        let mut seen = std::collections::HashMap::<u64, usize>::new();
        for rec in &journal {
            *seen
                .entry(rec["index"].as_u64().expect("journal index"))
                .or_default() += 1;
        }
        let missing: Vec<u64> = (0..calls as u64)
            .filter(|i| !seen.contains_key(i))
            .take(20)
            .collect();
        assert!(
            missing.is_empty() && seen.len() == calls,
            "{} of {calls} calls journaled; missing (first 20): {missing:?}",
            seen.len()
        );
        let twice: Vec<(&u64, &usize)> = seen.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            twice.is_empty(),
            "results accepted more than once: {twice:?}"
        );
        report
    }
}
