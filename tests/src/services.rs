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
    http_with(port, method, path, &[], "")
}

/// One HTTP/1.1 request with extra header lines and a body; the whole answer.
fn http_with(port: u16, method: &str, path: &str, headers: &[&str], body: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    Some(answer)
}

/// An access key of an S3 server that checks requests ([`S3::start_checking`]).
#[derive(Debug, Clone)]
pub struct S3Key {
    pub id: String,
    pub secret: String,
}

/// The keys [`S3::start_checking`] made.
#[derive(Debug, Clone)]
pub struct S3Keys {
    /// May do anything in S3.
    pub allowed: S3Key,
    /// Known to the server, allowed nothing.
    pub denied: S3Key,
}

/// The text of the first `<name>…</name>` of an answer.
fn xml_text(answer: &str, name: &str) -> Option<String> {
    let from = answer.find(&format!("<{name}>"))? + name.len() + 2;
    let len = answer[from..].find(&format!("</{name}>"))?;
    Some(answer[from..from + len].to_owned())
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

    /// Like [`S3::start`], then two IAM users with a key each (one allowed everything in S3,
    /// one nothing), then moto's request authentication turned on: from then on every
    /// request must be signed by a key it knows with that key's secret
    /// (`InvalidAccessKeyId`, `SignatureDoesNotMatch`) and allowed by its user's policy
    /// (`AccessDenied`), as AWS does. Moto does not check the region a request is signed for.
    pub fn start_checking() -> (S3, S3Keys) {
        let s3 = S3::start();
        // Unsigned IAM calls (moto routes by the credential scope and checks nothing yet).
        let iam = |form: &str| {
            let answer = http_with(
                s3.port,
                "POST",
                "/",
                &[
                    "Content-Type: application/x-www-form-urlencoded",
                    "Authorization: AWS4-HMAC-SHA256 Credential=AKIAUNCHECKED/20240101/us-east-1/iam/aws4_request, SignedHeaders=host, Signature=0",
                ],
                &format!("{form}&Version=2010-05-08"),
            )
            .unwrap_or_default();
            assert!(answer.starts_with("HTTP/1.1 200"), "IAM {form}: {answer}");
            answer
        };
        let key_of = |user: &str| {
            iam(&format!("Action=CreateUser&UserName={user}"));
            let made = iam(&format!("Action=CreateAccessKey&UserName={user}"));
            S3Key {
                id: xml_text(&made, "AccessKeyId").expect("a key id"),
                secret: xml_text(&made, "SecretAccessKey").expect("a secret"),
            }
        };
        let allowed = key_of("writer");
        // {"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:*","Resource":"*"}]}
        iam(
            "Action=PutUserPolicy&UserName=writer&PolicyName=all&PolicyDocument=%7B%22Version%22%3A%222012-10-17%22%2C%22Statement%22%3A%5B%7B%22Effect%22%3A%22Allow%22%2C%22Action%22%3A%22s3%3A%2A%22%2C%22Resource%22%3A%22%2A%22%7D%5D%7D",
        );
        let denied = key_of("nobody");
        let on = http_with(
            s3.port,
            "POST",
            "/moto-api/reset-auth",
            &["Content-Type: text/plain"],
            "0",
        )
        .unwrap_or_default();
        assert!(on.starts_with("HTTP/1.1 200"), "turning on auth: {on}");
        (s3, S3Keys { allowed, denied })
    }

    /// [`S3::env`] with `key` instead of the test key.
    pub fn env_with(&self, key: &S3Key) -> Vec<(String, String)> {
        let mut env = self.env();
        for (k, v) in &mut env {
            match k.as_str() {
                "AWS_ACCESS_KEY_ID" => v.clone_from(&key.id),
                "AWS_SECRET_ACCESS_KEY" => v.clone_from(&key.secret),
                _ => {}
            }
        }
        env
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

/// A Prometheus server (Debian `prometheus`) on a free loopback port, scraping loopback
/// targets every second.
pub struct Prometheus {
    _dir: tempfile::TempDir,
    pub port: u16,
    child: Child,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (job name, `/metrics` port on 127.0.0.1) and
    /// waits until it answers.
    pub fn start(targets: &[(&str, u16)]) -> Prometheus {
        Prometheus::start_with_rules(targets, None)
    }

    /// Like [`Prometheus::start`], evaluating the alerting rules `rules` (a rule file's text)
    /// every second.
    pub fn start_with_rules(targets: &[(&str, u16)], rules: Option<&str>) -> Prometheus {
        Prometheus::start_configured(targets, rules, None)
    }

    /// Like [`Prometheus::start`], scraping over https with the CA of `pki` and, when `client`
    /// names one, that identity's certificate and key from it (mutual TLS).
    pub fn start_tls(
        targets: &[(&str, u16)],
        pki: &std::path::Path,
        client: Option<&str>,
    ) -> Prometheus {
        Prometheus::start_configured(targets, None, Some((pki, client)))
    }

    fn start_configured(
        targets: &[(&str, u16)],
        rules: Option<&str>,
        tls: Option<(&std::path::Path, Option<&str>)>,
    ) -> Prometheus {
        let bin = find("prometheus", "apt-get install prometheus");
        let dir = tempfile::tempdir().expect("temp dir");
        let mut config = String::from(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n",
        );
        if let Some(rules) = rules {
            let path = dir.path().join("rules.yaml");
            std::fs::write(&path, rules).expect("write the rules");
            config.push_str(&format!("rule_files:\n  - {}\n", path.display()));
        }
        config.push_str("scrape_configs:\n");
        for (job, port) in targets {
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
            ));
            if let Some((pki, client)) = tls {
                config.push_str(&format!(
                    "    scheme: https\n    tls_config:\n      ca_file: {}\n",
                    pki.join("ca.crt").display()
                ));
                if let Some(name) = client {
                    config.push_str(&format!(
                        "      cert_file: {}\n      key_file: {}\n",
                        pki.join(format!("{name}.crt")).display(),
                        pki.join(format!("{name}.key")).display()
                    ));
                }
            }
        }
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write prometheus.yml");
        let port = free_port();
        let child = Command::new(bin)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("prometheus.log")).expect("log"))
            .spawn()
            .expect("start prometheus");
        let p = Prometheus {
            _dir: dir,
            port,
            child,
        };
        assert!(
            crate::eventually(30, || {
                std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                    && crate::http_get(port, "/-/ready", &[]).status == 200
            }),
            "prometheus never became ready; its log:\n{}",
            p.log()
        );
        p
    }

    /// What Prometheus logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The result vector of an instant query (empty when nothing matches yet).
    pub fn query(&self, promql: &str) -> Vec<serde_json::Value> {
        let path = format!(
            "/api/v1/query?query={}",
            crate::cluster::percent_encode(promql)
        );
        let r = crate::http_get(self.port, &path, &[]);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
        assert_ne!(v["status"], "error", "query {promql}: {}", r.body);
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until `promql` returns something (Prometheus scraped it), and returns it.
    pub fn wait_for(&self, promql: &str) -> Vec<serde_json::Value> {
        let mut last = Vec::new();
        let found = crate::eventually(60, || {
            last = self.query(promql);
            !last.is_empty()
        });
        assert!(
            found,
            "Prometheus has no data for {promql}; its targets: {}\nits log:\n{}",
            crate::http_get(self.port, "/api/v1/targets", &[]).body,
            self.log()
        );
        last
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
