//! Real services for tests: etcd (Debian `etcd-server`) on free loopback ports in a temp dir.
//!
//! A missing binary is a test failure with the install command, never a skip. Each service is
//! killed when dropped.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cluster::free_port;

fn find(binary: &str, install: &str) -> PathBuf {
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
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub fn start() -> Etcd {
        let mut e = Etcd {
            dir: tempfile::tempdir().expect("temp dir"),
            client_port: free_port(),
            peer_port: free_port(),
            child: None,
        };
        e.spawn();
        e
    }

    fn spawn(&mut self) {
        let bin = find("etcd", "apt-get install -y etcd-server");
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .expect("etcd log");
        let child = Command::new(bin)
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
        format!("http://127.0.0.1:{}", self.client_port)
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
