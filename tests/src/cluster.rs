//! A fleet on loopback: a coordinator and workers as child processes, with a fresh dev CA.
//!
//! Ports are picked free by binding port 0. Every child writes its own log file under the
//! cluster's directory (`coordinator.log`, `worker-N.log`) and is killed when the cluster is
//! dropped, so a failing test leaves nothing running.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::{Output, binary, run_with_timeout};

/// A free TCP port on 127.0.0.1, never one this process was given before (the kernel may
/// hand the same port out again once its listener is closed, and two servers of one test
/// would then race for it).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Runs a command to completion, panicking on failure.
fn must(cmd: &mut Command) {
    let out = cmd.output().expect("run command");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The fleet.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub bin: PathBuf,
    pub port: u16,
    /// The coordinator's session pages.
    pub http_port: u16,
    coordinator: Option<Child>,
    workers: Vec<Option<Child>>,
    /// etcd endpoint for the coordinator's leases, if any.
    pub etcd: Option<String>,
    /// Store URL and environment of the coordinator (default: a file store in the dir).
    pub store: Option<(String, Vec<(String, String)>)>,
    /// The workers' lease TTL (`--worker-ttl`).
    pub worker_ttl: Duration,
    /// When set, workers reach the coordinator through this proxy (which a test can cut).
    pub proxy: Option<crate::proxy::Proxy>,
    /// A second coordinator of the group (same etcd and store): its port and process.
    pub standby: Option<(u16, Child)>,
    /// The standby's session pages.
    pub standby_http_port: u16,
    /// Extra flags and environment of every worker started from now on.
    pub worker_args: Vec<String>,
    pub worker_env: Vec<(String, String)>,
    /// A command workers start through (`unshare …`, say), with the binary and its flags
    /// after it; empty: none.
    pub worker_wrap: Vec<String>,
    /// Extra flags and environment of the coordinator.
    pub coordinator_args: Vec<String>,
    pub coordinator_env: Vec<(String, String)>,
    /// The host coordinators advertise themselves at (`--advertise https://HOST:PORT`).
    pub advertise_host: Option<String>,
}

impl Cluster {
    /// A CA, a coordinator on a free port with a file store, and `workers` workers with
    /// `slots` slots each.
    pub fn start(workers: usize, slots: u32) -> Cluster {
        Self::start_with(workers, slots, None)
    }

    /// Like [`Cluster::start`], with the coordinator's leases in etcd.
    pub fn start_with(workers: usize, slots: u32, etcd: Option<String>) -> Cluster {
        Self::start_full(workers, slots, etcd, None)
    }

    /// Like [`Cluster::start`], with the workers' lease TTL (`--worker-ttl`): a worker that
    /// stops answering (`-STOP`) keeps what it holds for that long.
    pub fn start_with_ttl(workers: usize, slots: u32, ttl: Duration) -> Cluster {
        let mut c = Self::prepare(workers, None, None);
        c.worker_ttl = ttl;
        c.start_all(workers, slots);
        c
    }

    /// Like [`Cluster::start`], with leases in etcd and/or another store (URL plus the
    /// environment the coordinator needs for it, e.g. `AWS_*`).
    pub fn start_full(
        workers: usize,
        slots: u32,
        etcd: Option<String>,
        store: Option<(String, Vec<(String, String)>)>,
    ) -> Cluster {
        let mut c = Self::prepare(workers, etcd, store);
        c.start_all(workers, slots);
        c
    }

    /// Like [`Cluster::start`], with leases in an etcd that serves TLS and requires client
    /// certificates from the cluster's CA (the coordinator presents its own).
    pub fn start_with_tls_etcd(workers: usize, slots: u32) -> (Cluster, crate::services::Etcd) {
        let mut c = Self::prepare(workers, None, None);
        must(
            Command::new(&c.bin)
                .args([
                    "certs",
                    "issue",
                    "--role",
                    "coordinator",
                    "--name",
                    "etcd",
                    "--host",
                    "127.0.0.1",
                    "--dir",
                ])
                .arg(c.pki()),
        );
        let etcd = crate::services::Etcd::start_tls(&c.pki());
        c.etcd = Some(etcd.endpoint());
        c.start_all(workers, slots);
        (c, etcd)
    }

    /// Like [`Cluster::start`], with the workers' connections going through a [`Proxy`].
    pub fn start_proxied(workers: usize, slots: u32) -> Cluster {
        let mut c = Self::prepare(workers, None, None);
        c.start_coordinator();
        // A proxy that accepts while nothing listens behind it hangs up on the worker, which
        // looks like a refused certificate; put it in front only once the coordinator listens.
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", c.port)).is_err() {
            assert!(Instant::now() < deadline, "the coordinator never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
        c.proxy = Some(crate::proxy::Proxy::start(c.port));
        for i in 0..workers {
            c.start_worker(i, slots);
        }
        c.wait_for_workers(workers);
        c
    }

    fn start_all(&mut self, workers: usize, slots: u32) {
        self.start_coordinator();
        for i in 0..workers {
            self.start_worker(i, slots);
        }
        self.wait_for_workers(workers);
    }

    /// Certificates for a coordinator, a client and `workers` workers; nothing started.
    fn prepare(
        workers: usize,
        etcd: Option<String>,
        store: Option<(String, Vec<(String, String)>)>,
    ) -> Cluster {
        let dir = tempfile::tempdir().expect("temp dir");
        let bin = binary();
        let pki = dir.path().join("pki");
        must(
            Command::new(&bin)
                .args(["certs", "init", "--dir"])
                .arg(&pki),
        );
        must(
            Command::new(&bin)
                .args([
                    "certs",
                    "issue",
                    "--role",
                    "coordinator",
                    "--name",
                    "coordinator",
                    "--host",
                    "127.0.0.1",
                    // The name a Service would give it (`--peer-name`): no address has it.
                    "--host",
                    "flotilla-coordinator",
                    "--dir",
                ])
                .arg(&pki),
        );
        must(
            Command::new(&bin)
                .args([
                    "certs", "issue", "--role", "client", "--name", "client", "--dir",
                ])
                .arg(&pki),
        );
        for i in 0..workers {
            must(
                Command::new(&bin)
                    .args([
                        "certs",
                        "issue",
                        "--role",
                        "worker",
                        "--name",
                        &format!("worker-{i}"),
                        "--dir",
                    ])
                    .arg(&pki),
            );
        }
        Cluster {
            dir,
            bin,
            port: free_port(),
            http_port: free_port(),
            coordinator: None,
            workers: Vec::new(),
            etcd,
            store,
            worker_ttl: Duration::from_secs(3),
            proxy: None,
            standby: None,
            standby_http_port: 0,
            worker_args: Vec::new(),
            worker_env: Vec::new(),
            worker_wrap: Vec::new(),
            coordinator_args: Vec::new(),
            coordinator_env: Vec::new(),
            advertise_host: None,
        }
    }

    /// Like [`Cluster::start`], with the same extra environment for the coordinator and
    /// every worker.
    pub fn start_with_env(workers: usize, slots: u32, env: Vec<(String, String)>) -> Cluster {
        let mut c = Self::prepare(workers, None, None);
        c.coordinator_env = env.clone();
        c.worker_env = env;
        c.start_all(workers, slots);
        c
    }

    /// Like [`Cluster::start`], with extra coordinator flags (`{dir}` in a flag becomes the
    /// cluster's directory).
    pub fn start_coordinator_with(workers: usize, slots: u32, args: &[&str]) -> Cluster {
        let mut c = Self::prepare(workers, None, None);
        let dir = c.path().display().to_string();
        c.coordinator_args = args.iter().map(|a| a.replace("{dir}", &dir)).collect();
        c.start_all(workers, slots);
        c
    }

    /// Like [`Cluster::start`], with extra worker flags and environment.
    pub fn start_workers_with(
        workers: usize,
        slots: u32,
        args: &[&str],
        env: Vec<(String, String)>,
    ) -> Cluster {
        let mut c = Self::prepare(workers, None, None);
        c.worker_args = args.iter().map(|a| (*a).to_owned()).collect();
        c.worker_env = env;
        c.start_all(workers, slots);
        c
    }

    /// Like [`Cluster::start`], with extra coordinator flags and extra worker flags.
    pub fn start_configured(
        workers: usize,
        slots: u32,
        coordinator_args: &[&str],
        worker_args: &[&str],
    ) -> Cluster {
        let mut c = Self::prepare(workers, None, None);
        c.coordinator_args = coordinator_args.iter().map(|a| (*a).to_owned()).collect();
        c.worker_args = worker_args.iter().map(|a| (*a).to_owned()).collect();
        c.start_all(workers, slots);
        c
    }

    /// Like [`Cluster::start_configured`], with an environment for coordinator and workers.
    pub fn start_configured_env(
        workers: usize,
        slots: u32,
        coordinator_args: &[&str],
        worker_args: &[&str],
        env: Vec<(String, String)>,
    ) -> Cluster {
        let mut c = Self::prepare(workers, None, None);
        c.coordinator_args = coordinator_args.iter().map(|a| (*a).to_owned()).collect();
        c.worker_args = worker_args.iter().map(|a| (*a).to_owned()).collect();
        c.coordinator_env = env.clone();
        c.worker_env = env;
        c.start_all(workers, slots);
        c
    }

    /// Two coordinators sharing etcd and a store; workers know both and attach to the one
    /// that leads (the first, once it does).
    pub fn start_group(
        workers: usize,
        slots: u32,
        etcd: String,
        store: (String, Vec<(String, String)>),
    ) -> Cluster {
        Self::start_group_with(workers, slots, etcd, store, &[])
    }

    /// Like [`Cluster::start_group`], with extra worker flags.
    pub fn start_group_with(
        workers: usize,
        slots: u32,
        etcd: String,
        store: (String, Vec<(String, String)>),
        worker_args: &[&str],
    ) -> Cluster {
        Self::start_group_ttl(workers, slots, etcd, store, worker_args, None)
    }

    /// Like [`Cluster::start_group_with`], with the coordinators' `--worker-ttl` (also the TTL
    /// of their own leases).
    pub fn start_group_ttl(
        workers: usize,
        slots: u32,
        etcd: String,
        store: (String, Vec<(String, String)>),
        worker_args: &[&str],
        ttl: Option<Duration>,
    ) -> Cluster {
        let mut c = Self::prepare(workers, Some(etcd), Some(store));
        if let Some(ttl) = ttl {
            c.worker_ttl = ttl;
        }
        c.worker_args = worker_args.iter().map(|a| (*a).to_owned()).collect();
        c.start_group_members(workers, slots);
        c
    }

    /// Like [`Cluster::start_group`], with each coordinator advertising itself to the other
    /// at `https://{host}:{its port}` — a name its certificate does not hold, as a pod's IP —
    /// and with these extra coordinator flags (`--peer-name`).
    pub fn start_group_advertised(
        workers: usize,
        slots: u32,
        etcd: String,
        store: (String, Vec<(String, String)>),
        host: &str,
        coordinator_args: &[&str],
    ) -> Cluster {
        let mut c = Self::prepare(workers, Some(etcd), Some(store));
        c.advertise_host = Some(host.to_owned());
        c.coordinator_args = coordinator_args.iter().map(|a| (*a).to_owned()).collect();
        c.start_group_members(workers, slots);
        c
    }

    /// The leader, then a standby, then the workers.
    fn start_group_members(&mut self, workers: usize, slots: u32) {
        let c = self;
        c.start_coordinator();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !std::fs::read_to_string(c.path().join("coordinator.log"))
            .unwrap_or_default()
            .contains("this coordinator leads")
        {
            assert!(Instant::now() < deadline, "the first coordinator never led");
            std::thread::sleep(Duration::from_millis(100));
        }
        let port = free_port();
        c.standby_http_port = free_port();
        let child = c.spawn_coordinator(port, c.standby_http_port, "standby");
        c.standby = Some((port, child));
        // Clients may go to the standby at once: wait until it listens.
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the standby coordinator never listened"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        for i in 0..workers {
            c.start_worker(i, slots);
        }
        c.wait_for_workers(workers);
    }

    /// The standby coordinator's address.
    pub fn standby_url(&self) -> String {
        let port = self.standby.as_ref().map_or(self.port, |(p, _)| *p);
        format!("https://127.0.0.1:{port}")
    }

    /// A client command against the coordinator at `url`.
    pub fn client_at(&self, url: &str, args: &[&str]) -> Output {
        self.client_at_in(url, self.path(), args)
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn pki(&self) -> PathBuf {
        self.path().join("pki")
    }

    /// Where workers connect: the coordinator, or the proxy in front of it.
    pub fn worker_url(&self) -> String {
        match (&self.proxy, &self.standby) {
            (Some(p), _) => format!("https://127.0.0.1:{}", p.port),
            (None, Some((port, _))) => format!("{},https://127.0.0.1:{port}", self.url()),
            (None, None) => self.url(),
        }
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    pub fn store_url(&self) -> String {
        match &self.store {
            Some((url, _)) => url.clone(),
            None => format!("file://{}", self.path().join("store").display()),
        }
    }

    fn log(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path().join(format!("{name}.log")))
            .expect("log file")
    }

    pub fn start_coordinator(&mut self) {
        let child = self.spawn_coordinator(self.port, self.http_port, "coordinator");
        self.coordinator = Some(child);
    }

    fn spawn_coordinator(&self, port: u16, http_port: u16, log_name: &str) -> Child {
        let log = self.log(log_name);
        let mut cmd = Command::new(&self.bin);
        cmd.args([
            "coordinator",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--http",
            &format!("127.0.0.1:{http_port}"),
            "--store",
            &self.store_url(),
            "--worker-ttl",
            &format!("{}ms", self.worker_ttl.as_millis()),
            "--tls-dir",
        ])
        .arg(self.pki());
        if let Some(etcd) = &self.etcd {
            cmd.args(["--etcd", etcd]);
        }
        if let Some(host) = &self.advertise_host {
            cmd.arg("--advertise").arg(format!("https://{host}:{port}"));
        }
        cmd.args(&self.coordinator_args);
        // A test's own environment may set the log filter too (`FLOTILLA_LOG`).
        cmd.env("FLOTILLA_LOG", "info");
        cmd.envs(
            self.coordinator_env
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
        );
        if let Some((_, env)) = &self.store {
            cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        }
        cmd.env("AWS_EC2_METADATA_DISABLED", "true")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start coordinator")
    }

    /// Worker `i` killed and started again with `args` instead of the cluster's worker
    /// flags (other labels, say); it attaches under the same name.
    pub fn restart_worker_with(&mut self, i: usize, slots: u32, args: &[&str]) {
        if let Some(mut w) = self.workers.get_mut(i).and_then(Option::take) {
            let _ = w.kill();
            let _ = w.wait();
        }
        let kept = std::mem::replace(
            &mut self.worker_args,
            args.iter().map(|a| (*a).to_owned()).collect(),
        );
        self.start_worker(i, slots);
        self.worker_args = kept;
    }

    pub fn start_worker(&mut self, i: usize, slots: u32) {
        let log = self.log(&format!("worker-{i}"));
        let ws = self.path().join(format!("ws-{i}"));
        let mut cmd = match self.worker_wrap.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        let child = cmd
            .args([
                "worker",
                "--coordinator",
                &self.worker_url(),
                "--name",
                &format!("worker-{i}"),
                "--slots",
                &slots.to_string(),
                "--tls-dir",
            ])
            .arg(self.pki())
            .arg("--workspace")
            .arg(ws)
            .args(&self.worker_args)
            .envs(
                self.worker_env
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str())),
            )
            .env("FLOTILLA_LOG", "info")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start worker");
        if self.workers.len() <= i {
            self.workers.resize_with(i + 1, || None);
        }
        self.workers[i] = Some(child);
    }

    /// Takes the coordinator process out of the cluster (to kill or restart it).
    pub fn take_coordinator(&mut self) -> Option<Child> {
        self.coordinator.take()
    }

    /// Sends a signal to the coordinator (`-STOP`, `-CONT`, ...).
    pub fn signal_coordinator(&self, signal: &str) {
        let pid = self
            .coordinator
            .as_ref()
            .expect("coordinator running")
            .id()
            .to_string();
        must(Command::new("kill").args([signal, &pid]));
    }

    /// How the coordinator process ended, if it has.
    pub fn coordinator_exited(&mut self) -> Option<std::process::ExitStatus> {
        self.coordinator
            .as_mut()
            .and_then(|c| c.try_wait().expect("coordinator status"))
    }

    /// The pid of worker `i`.
    pub fn coordinator_pid(&self) -> u32 {
        self.coordinator.as_ref().expect("coordinator running").id()
    }

    pub fn worker_pid(&self, i: usize) -> u32 {
        self.workers[i].as_ref().expect("worker running").id()
    }

    /// Stops worker `i` as an operator would (SIGTERM) and waits for it to exit, at most a
    /// minute; its exit status.
    pub fn stop_worker(&mut self, i: usize) -> std::process::ExitStatus {
        let mut child = self.workers[i].take().expect("worker running");
        must(Command::new("kill").args(["-TERM", &child.id().to_string()]));
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().expect("wait for the worker") {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "worker {i} did not stop within a minute of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends a signal to worker `i` (`-9`, `-STOP`, `-CONT`, ...).
    pub fn signal_worker(&mut self, i: usize, signal: &str) {
        let pid = self.worker_pid(i).to_string();
        must(Command::new("kill").args([signal, &pid]));
        if signal == "-9"
            && let Some(mut c) = self.workers[i].take()
        {
            let _ = c.wait();
        }
    }

    /// A client command against this coordinator (client identity).
    pub fn client(&self, args: &[&str]) -> Output {
        self.client_in(self.path(), args)
    }

    /// A client command as certificate `name` (one [`Cluster::issue_client`] made).
    pub fn client_as(&self, name: &str, args: &[&str]) -> Output {
        self.client_as_at(&self.url(), name, args)
    }

    /// [`Cluster::client_as`] against the coordinator at `url` (a standby, say).
    pub fn client_as_at(&self, url: &str, name: &str, args: &[&str]) -> Output {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .args(["--coordinator", url, "--name", name, "--tls-dir"])
            .arg(self.pki())
            .current_dir(self.path());
        run_with_timeout(cmd, crate::COMMAND_TIMEOUT)
    }

    /// [`Cluster::client_as`] run from `dir` (a repository a launch sends as its source).
    pub fn client_as_in(&self, dir: &Path, name: &str, args: &[&str]) -> Output {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .args(["--coordinator", &self.url(), "--name", name, "--tls-dir"])
            .arg(self.pki())
            .current_dir(dir);
        run_with_timeout(cmd, crate::COMMAND_TIMEOUT)
    }

    /// Waits (a minute at most) until `run`'s status through the coordinator at `url`
    /// satisfies `ok` (a status it cannot give yet is waited out); that status. `what` names
    /// the state in the failure.
    pub fn status_until(
        &self,
        url: &str,
        run: &str,
        what: &str,
        ok: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let out = self.client_at(url, &["status", run, "--json"]);
            let s = if out.code == 0 {
                out.json()
            } else {
                serde_json::Value::Null
            };
            if ok(&s) {
                return s;
            }
            assert!(std::time::Instant::now() < deadline, "{what}: {s}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Issues a client certificate `name` for `namespaces` (`flotilla certs issue
    /// --namespace ...`).
    pub fn issue_client(&self, name: &str, namespaces: &[&str]) {
        let mut cmd = Command::new(&self.bin);
        cmd.args([
            "certs", "issue", "--role", "client", "--name", name, "--dir",
        ])
        .arg(self.pki());
        for ns in namespaces {
            cmd.args(["--namespace", ns]);
        }
        must(&mut cmd);
    }

    /// `flotilla mcp` on the coordinator as the client certificate, in the cluster's directory
    /// (its `HOME`): for an MCP client to serve over its stdio.
    pub fn mcp_command(&self) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.args([
            "mcp",
            "--coordinator",
            &self.url(),
            "--name",
            "client",
            "--tls-dir",
        ])
        .arg(self.pki())
        .current_dir(self.path())
        .env("HOME", self.path())
        .env("AWS_EC2_METADATA_DISABLED", "true");
        cmd
    }

    /// Issues worker `i`'s certificate (`worker-{i}`), for a worker started after a cluster
    /// made with fewer.
    pub fn issue_worker(&self, i: usize) {
        must(
            Command::new(&self.bin)
                .args(["certs", "issue", "--role", "worker", "--name"])
                .arg(format!("worker-{i}"))
                .arg("--dir")
                .arg(self.pki()),
        );
    }

    /// Launches workflow `name` with `body` as certificate `who`; its run id.
    pub fn launch_as(&self, who: &str, name: &str, body: &str, extra: &[&str]) -> String {
        let script = crate::write_workflow(self.path(), name, "cluster test", body);
        let mut args = vec!["launch", script.to_str().expect("utf-8"), "--json"];
        args.extend_from_slice(extra);
        crate::launched_run_id(&self.client_as(who, &args))
    }

    /// A client command run from `dir` (a repository a launch sends as its source).
    pub fn client_in(&self, dir: &Path, args: &[&str]) -> Output {
        self.client_at_in(&self.url(), dir, args)
    }

    /// A client command against the coordinator at `url`, run from `dir`.
    pub fn client_at_in(&self, url: &str, dir: &Path, args: &[&str]) -> Output {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .args(["--coordinator", url, "--name", "client", "--tls-dir"])
            .arg(self.pki())
            .current_dir(dir);
        run_with_timeout(cmd, crate::COMMAND_TIMEOUT)
    }

    /// Waits until `n` workers are attached.
    pub fn wait_for_workers(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = self.client(&["workers", "--json"]);
            if out.code == 0
                && serde_json::from_str::<Value>(&out.stdout)
                    .ok()
                    .and_then(|v| v.as_array().map(Vec::len))
                    == Some(n)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{n} workers never attached; last answer {out:?}; coordinator log:\n{}",
                std::fs::read_to_string(self.path().join("coordinator.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Writes a script and launches it; returns the run id.
    pub fn launch(&self, name: &str, body: &str, extra: &[&str]) -> String {
        self.launch_in(self.path(), name, body, extra)
    }

    /// Launches workflow `name` with `body` from `dir` (a repository it sends as its source);
    /// its run id.
    pub fn launch_in(&self, dir: &Path, name: &str, body: &str, extra: &[&str]) -> String {
        let script = crate::write_workflow(self.path(), name, "cluster test", body);
        let mut args = vec!["launch", script.to_str().expect("utf-8"), "--json"];
        args.extend_from_slice(extra);
        crate::launched_run_id(&self.client_in(dir, &args))
    }

    /// `flotilla wait RUN --json`.
    pub fn wait(&self, run: &str) -> (i32, Value) {
        let out = self.client(&["wait", run, "--json"]);
        let code = out.code;
        (code, out.json())
    }

    /// Every completed-call record of a run in the coordinator's store.
    /// The keys of the objects under `under` (`runs/RUN/leftovers/`) in the cluster's store,
    /// relative to the store's root, sorted.
    pub fn stored_keys(&self, under: &str) -> Vec<String> {
        if let Some((url, env)) = &self.store
            && let Some(rest) = url.strip_prefix("s3://")
        {
            let (host, port) = s3_at(env);
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            let root = if prefix.is_empty() {
                String::new()
            } else {
                format!("{prefix}/")
            };
            return s3_list((&host, port), bucket, &format!("{root}{under}"))
                .into_iter()
                .map(|k| k.strip_prefix(&root).unwrap_or(&k).to_owned())
                .collect();
        }
        let root = self.path().join("store");
        let mut keys: Vec<String> = std::fs::read_dir(root.join(under))
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| format!("{under}{}", e.file_name().to_string_lossy()))
                    .collect()
            })
            .unwrap_or_default();
        keys.sort_unstable();
        keys
    }

    pub fn journal(&self, run: &str) -> Vec<Value> {
        if let Some((url, env)) = &self.store
            && let Some(rest) = url.strip_prefix("s3://")
        {
            return s3_journal(rest, env, run);
        }
        let dir = self.path().join("store/runs").join(run).join("calls");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default();
        files.sort();
        files
            .iter()
            .flat_map(|f| {
                std::fs::read_to_string(f)
                    .unwrap_or_default()
                    .lines()
                    .map(|l| serde_json::from_str(l).expect("journal line is JSON"))
                    .collect::<Vec<Value>>()
            })
            .collect()
    }
}

/// Where the test's S3 server listens, from the store's environment.
fn s3_at(env: &[(String, String)]) -> (String, u16) {
    let endpoint = env
        .iter()
        .find(|(k, _)| k == "AWS_ENDPOINT_URL")
        .map(|(_, v)| v.clone())
        .expect("AWS_ENDPOINT_URL for the S3 store");
    endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
        .expect("endpoint host:port")
}

/// The keys under `dir` in `bucket` of the test's S3 server at `at`, sorted.
fn s3_list(at: (&str, u16), bucket: &str, dir: &str) -> Vec<String> {
    let get = |path: &str| crate::http_request_to(at.0, at.1, "GET", path, &[], None);
    // A listing answers at most 1,000 keys a page; a long run has more segments than that.
    let mut keys: Vec<String> = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut path = format!("/{bucket}?list-type=2&prefix={dir}");
        if let Some(t) = &token {
            path.push_str("&continuation-token=");
            path.push_str(&percent_encode(t));
        }
        let listing = get(&path);
        assert_eq!(listing.status, 200, "{listing:?}");
        keys.extend(
            listing
                .body
                .split("<Key>")
                .skip(1)
                .filter_map(|k| k.split("</Key>").next())
                .map(str::to_owned),
        );
        token = listing
            .body
            .split("<NextContinuationToken>")
            .nth(1)
            .and_then(|t| t.split("</NextContinuationToken>").next())
            .map(str::to_owned);
        if token.is_none() {
            break;
        }
    }
    keys.sort_unstable();
    keys
}

/// The journal of `run` in an S3 store (`bucket/prefix`), read over plain HTTP from the
/// test's S3 server (moto takes unsigned requests).
pub fn s3_journal(bucket_prefix: &str, env: &[(String, String)], run: &str) -> Vec<Value> {
    let (host, port) = s3_at(env);
    let get = |path: &str, headers: &[(&str, &str)]| {
        crate::http_request_to(&host, port, "GET", path, headers, None)
    };
    let (bucket, prefix) = bucket_prefix.split_once('/').unwrap_or((bucket_prefix, ""));
    let dir = if prefix.is_empty() {
        format!("runs/{run}/calls/")
    } else {
        format!("{prefix}/runs/{run}/calls/")
    };
    let mut keys = s3_list((&host, port), bucket, &dir);
    // moto checks that a GET of an object is signed, not how.
    let auth = "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00";
    // A run taken over (failover) has seals: its history is the newest seal's segments and
    // those of its generation or later; a late segment of a replaced generation is not part
    // of it (design.md, "Resume and failover").
    let seals_dir = dir.replace("/calls/", "/seals/");
    let seals = get(&format!("/{bucket}?list-type=2&prefix={seals_dir}"), &[]);
    assert_eq!(seals.status, 200, "{seals:?}");
    let newest_seal = seals
        .body
        .split("<Key>")
        .skip(1)
        .filter_map(|k| k.split("</Key>").next())
        .max()
        .map(str::to_owned);
    if let Some(seal_key) = newest_seal {
        let obj = get(&format!("/{bucket}/{seal_key}"), &[("Authorization", auth)]);
        assert_eq!(obj.status, 200, "{obj:?}");
        let seal: Value = serde_json::from_str(&obj.body).expect("a seal is JSON");
        let generation = seal["generation"].as_u64().expect("seal generation");
        let taken: Vec<String> = seal["segments"]
            .as_array()
            .expect("seal segments")
            .iter()
            .map(|v| v.as_str().expect("segment key").to_owned())
            .collect();
        let strip = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        keys.retain(|k| {
            let rel = k.strip_prefix(&strip).unwrap_or(k);
            let name_generation = rel
                .rsplit('/')
                .next()
                .and_then(|n| n.split('-').next())
                .and_then(|g| g.parse::<u64>().ok());
            taken.iter().any(|t| t == rel) || name_generation.is_some_and(|g| g >= generation)
        });
    }
    keys.iter()
        .flat_map(|k| {
            let obj = get(&format!("/{bucket}/{k}"), &[("Authorization", auth)]);
            assert_eq!(obj.status, 200, "{obj:?}");
            obj.body
                .lines()
                .map(|l| serde_json::from_str(l).expect("journal line is JSON"))
                .collect::<Vec<Value>>()
        })
        .collect()
}

/// `text` with everything but unreserved characters percent-encoded (for a query value).
pub fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in self
            .workers
            .iter_mut()
            .flatten()
            .chain(self.coordinator.iter_mut())
            .chain(self.standby.iter_mut().map(|(_, c)| c))
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
