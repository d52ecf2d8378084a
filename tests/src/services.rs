//! Real services for tests: etcd (Debian `etcd-server`) on free loopback ports in a temp dir.
//!
//! A missing binary is a test failure with the install command, never a skip. Each service is
//! killed when dropped.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cluster::free_port;

pub(crate) fn find(binary: &str, install: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join(binary);
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!("{binary} is not installed; install it with `{install}` (.ci/run does)");
}

/// A single-member etcd cluster.
pub struct Etcd {
    dir: tempfile::TempDir,
    pub client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    /// Serving TLS with client-certificate auth: the directory with `ca.crt`, `etcd.crt`,
    /// `etcd.key` (a `flotilla certs` CA and a certificate for 127.0.0.1).
    tls: Option<PathBuf>,
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub fn start() -> Etcd {
        let mut e = Etcd {
            dir: tempfile::tempdir().expect("temp dir"),
            client_port: free_port(),
            peer_port: free_port(),
            child: None,
            tls: None,
        };
        e.spawn();
        e
    }

    /// Starts etcd serving clients over TLS, requiring client certificates from the CA in
    /// `pki` (`ca.crt`), with its own certificate `pki/etcd.crt` and key `pki/etcd.key`.
    pub fn start_tls(pki: &std::path::Path) -> Etcd {
        let mut e = Etcd {
            dir: tempfile::tempdir().expect("temp dir"),
            client_port: free_port(),
            peer_port: free_port(),
            child: None,
            tls: Some(pki.to_owned()),
        };
        e.spawn();
        e
    }

    fn spawn(&mut self) {
        let bin = find("etcd", "apt-get install -y etcd-server");
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .expect("etcd log");
        let mut cmd = Command::new(bin);
        if let Some(pki) = &self.tls {
            cmd.arg("--cert-file")
                .arg(pki.join("etcd.crt"))
                .arg("--key-file")
                .arg(pki.join("etcd.key"))
                .arg("--trusted-ca-file")
                .arg(pki.join("ca.crt"))
                .arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", "t", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args([
                "--initial-cluster",
                &format!("t={peer}"),
                "--log-level",
                "warn",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        self.wait_healthy();
    }

    fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.healthy() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy; its log:\n{}",
                std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn healthy(&self) -> bool {
        if self.tls.is_some() {
            return self
                .etcdctl(&["endpoint", "health"])
                .is_some_and(|o| o.status.success());
        }
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.client_port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let req = format!(
            "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
            self.client_port
        );
        if s.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains("\"health\":\"true\"")
    }

    /// The client URL.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Runs `etcdctl` against this etcd (with its TLS files when it serves TLS).
    pub fn etcdctl(&self, args: &[&str]) -> Option<std::process::Output> {
        let bin = find("etcdctl", "apt-get install -y etcd-client");
        let mut cmd = Command::new(bin);
        cmd.env("ETCDCTL_API", "3").args([
            "--endpoints",
            &self.endpoint(),
            "--command-timeout",
            "3s",
        ]);
        if let Some(pki) = &self.tls {
            cmd.arg("--cacert")
                .arg(pki.join("ca.crt"))
                .arg("--cert")
                .arg(pki.join("etcd.crt"))
                .arg("--key")
                .arg(pki.join("etcd.key"));
        }
        cmd.args(args).stdin(Stdio::null()).output().ok()
    }

    /// Kills etcd (its data stays).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An S3-compatible server (moto) on a free loopback port, with one bucket.
pub struct S3 {
    pub port: u16,
    pub bucket: String,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

pub(crate) fn moto_server() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOTILLA_MOTO_SERVER") {
        return PathBuf::from(p);
    }
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(".venv-svc/bin/moto_server");
    if venv.is_file() {
        return venv;
    }
    find(
        "moto_server",
        "python3 -m venv .venv-svc && .venv-svc/bin/pip install 'moto[server]==5.2.5'",
    )
}

fn http(port: u16, method: &str, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    Some(body)
}

impl S3 {
    /// Starts moto and creates the bucket `runs`.
    pub fn start() -> S3 {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("moto.log")).expect("moto log");
        let child = Command::new(moto_server())
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start moto_server");
        let s3 = S3 {
            port,
            bucket: "runs".into(),
            child: Some(child),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while http(port, "GET", "/").is_none_or(|b| !b.starts_with("HTTP/1.1 200")) {
            assert!(Instant::now() < deadline, "moto did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        let created = http(port, "PUT", "/runs").unwrap_or_default();
        assert!(
            created.starts_with("HTTP/1.1 200"),
            "cannot create the bucket: {created}"
        );
        s3
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The `AWS_*` variables a client of this server needs.
    /// Freezes (`true`, SIGSTOP) or thaws (SIGCONT) the server: an outage that keeps its data
    /// (moto keeps objects in memory, so a restart would lose them).
    pub fn freeze(&self, frozen: bool) {
        if let Some(c) = &self.child {
            let sig = if frozen { "-STOP" } else { "-CONT" };
            let ok = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "cannot signal the S3 server");
        }
    }

    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ENDPOINT_URL".into(), self.endpoint()),
            ("AWS_ACCESS_KEY_ID".into(), "test".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "testtesttest".into()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
        ]
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
