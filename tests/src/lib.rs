//! `flotilla-tests`: the harness that drives the built `flotilla` binary.
//!
//! Each [`Env`] owns temporary directories (store, workspace, scripts) and runs the binary as
//! a child process with a timeout, so a hang fails the test instead of stalling the suite.
//! Services (etcd, S3) join this harness with the fleet; they are started on free ports in
//! temp dirs and a missing one is a failure, never a skip.
//!
//! The binary is `$FLOTILLA_BIN`, or `target/<profile>/flotilla` next to the test executable
//! (cargo builds it for the `flotilla` package's own integration tests).

pub mod cluster;
pub mod fake_anthropic;
pub mod hook;
pub mod hostfleet;
pub mod latency;
pub mod netbed;
pub mod otlp;
pub mod proxy;
pub mod services;
pub mod webdriver;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Longest time one command may take before the test fails.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// Finds the `flotilla` binary.
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOTILLA_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/flotilla
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable lives in target/<profile>/deps");
    let bin = profile_dir.join("flotilla");
    assert!(
        bin.exists(),
        "the flotilla binary is missing at {}: build it with `cargo build -p flotilla` (cargo nextest run --workspace builds it) or set FLOTILLA_BIN",
        bin.display()
    );
    bin
}

/// What a command did.
#[derive(Debug)]
pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// The stdout parsed as one JSON value.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not one JSON value ({e}); code {}\nstdout:\n{}\nstderr:\n{}",
                self.code, self.stdout, self.stderr
            )
        })
    }

    /// The stdout as JSON, or `null` when it is not (a command that failed, for a poll).
    pub fn json_or_null(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or(Value::Null)
    }
}

/// A test environment: its own store, workspace and script directory.
pub struct Env {
    pub dir: tempfile::TempDir,
    pub bin: PathBuf,
}

impl Default for Env {
    fn default() -> Self {
        Self::new()
    }
}

impl Env {
    pub fn new() -> Env {
        Env {
            dir: tempfile::tempdir().expect("temp dir"),
            bin: binary(),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn store_url(&self) -> String {
        format!("file://{}", self.path().join("store").display())
    }

    pub fn workspace(&self) -> PathBuf {
        self.path().join("workspace")
    }

    /// Writes a file under the environment and returns its path.
    pub fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path().join(name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).expect("create parent dir");
        }
        std::fs::write(&p, text).expect("write file");
        p
    }

    /// Writes a script whose `meta` is `{ name, description }` followed by `body`.
    pub fn script(&self, name: &str, body: &str) -> PathBuf {
        self.file(
            &format!("{name}.js"),
            &format!(
                "export const meta = {{ name: '{name}', description: 'test workflow {name}' }};\n{body}\n"
            ),
        )
    }

    /// Runs `flotilla` with `args` in the environment's directory, with its store.
    pub fn flotilla(&self, args: &[&str]) -> Output {
        self.flotilla_with_env(args, &[])
    }

    /// Like [`Env::flotilla`], with extra environment variables.
    pub fn flotilla_with_env(&self, args: &[&str], vars: &[(&str, &str)]) -> Output {
        run_with_timeout(self.command(args, vars), COMMAND_TIMEOUT)
    }

    /// The `flotilla` command [`Env::flotilla_with_env`] runs, to start in the background
    /// (its output goes where the caller says; the caller kills it).
    pub fn command(&self, args: &[&str], vars: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .current_dir(self.path())
            .env("FLOTILLA_STORE", self.store_url())
            .env("FLOTILLA_WORKSPACE", self.workspace())
            .env("HOME", self.path())
            .env_remove("XDG_CONFIG_HOME")
            .env_remove("CLAUDE_CONFIG_DIR")
            .env_remove("CLAUDE_CODE_SUBAGENT_MODEL")
            .env_remove("CLAUDE_CODE_SUBAGENT_MODEL_FORCE")
            .env_remove("FLOTILLA_CONFIG")
            // No test may reach the cloud metadata address (or any address off loopback).
            .env("AWS_EC2_METADATA_DISABLED", "true");
        // The caller's variables win over the defaults above.
        cmd.envs(vars.iter().copied());
        cmd
    }

    /// `flotilla run SCRIPT --json` plus `extra`, returning exit code and report.
    pub fn run(&self, script: &Path, extra: &[&str]) -> (i32, Value) {
        let script = script.to_str().expect("utf-8 path");
        let mut args = vec!["run", script, "--json"];
        args.extend_from_slice(extra);
        let out = self.flotilla(&args);
        let report = out.json();
        (out.code, report)
    }

    /// Runs a body (with a generated meta) with the test settings of spec/echo-backend.md
    /// (stagger off) plus `extra`.
    pub fn run_body(&self, body: &str, extra: &[&str]) -> (i32, Value) {
        let script = self.script("t", body);
        let mut args = vec!["--stagger", "0"];
        args.extend_from_slice(extra);
        self.run(&script, &args)
    }
}

/// Runs git in `dir`, failing the test if it fails; its stdout.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .expect("run git");
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Where a worker whose workspace root is `ws` keeps call `call` of run `run`
/// (`{ws}/{run}/sXX/{call}`, `XX` the call's number modulo 256 in hex).
pub fn call_dir(ws: &Path, run: &str, call: u64) -> PathBuf {
    ws.join(run)
        .join(format!("s{:02x}", call % 256))
        .join(call.to_string())
}

/// A clone of the repository `from` at `to`, with a committer identity (where a test applies
/// a run's changes).
pub fn fresh_clone(from: &Path, to: &Path) {
    let cloned = Command::new("git")
        .args(["clone", "-q"])
        .arg(from)
        .arg(to)
        .output()
        .expect("run git clone");
    assert!(cloned.status.success(), "{cloned:?}");
    git(to, &["config", "user.name", "t"]);
    git(to, &["config", "user.email", "t@t"]);
}

/// Commits everything in `dir` (tracked and untracked, not ignored) as `message`.
pub fn commit_all(dir: &Path, message: &str) {
    git(dir, &["add", "."]);
    git(
        dir,
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "-m",
            message,
        ],
    );
}

/// Makes `dir` a git repository with one commit (a `README`) on branch `main`.
pub fn git_repo(dir: &Path) {
    std::fs::create_dir_all(dir).expect("create repository dir");
    std::fs::write(dir.join("README"), "main checkout\n").expect("write README");
    for args in [
        &["init", "-q", "-b", "main"][..],
        &["add", "."],
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "-m",
            "one",
        ],
    ] {
        let out = Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .output()
            .expect("run git");
        assert!(out.status.success(), "git {args:?}: {out:?}");
    }
}

/// Runs a command, failing the test if it takes longer than `limit`.
pub fn run_with_timeout(mut cmd: Command, limit: Duration) -> Output {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start flotilla");
    let mut stdout = child.stdout.take().expect("stdout pipe");
    let mut stderr = child.stderr.take().expect("stderr pipe");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for flotilla") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = err_reader.join().unwrap_or_default();
            panic!("flotilla did not finish within {limit:?}; stderr:\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Output {
        code: status.code().unwrap_or(-1),
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    }
}

/// The report's agent entries.
pub fn agents(report: &Value) -> &Vec<Value> {
    report["agents"]
        .as_array()
        .expect("report.agents is an array")
}

/// A usage counter of the report.
pub fn usage(report: &Value, name: &str) -> u64 {
    report["usage"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("report.usage.{name} missing in {report}"))
}

/// The agent entry with this label.
pub fn agent<'a>(report: &'a Value, label: &str) -> &'a Value {
    agents(report)
        .iter()
        .find(|a| a["label"] == label)
        .unwrap_or_else(|| panic!("no agent labelled {label:?} in {report}"))
}

/// The report's failure lines.
pub fn failures(report: &Value) -> Vec<String> {
    report["failures"]
        .as_array()
        .expect("report.failures is an array")
        .iter()
        .map(|f| f.as_str().expect("a failure line is a string").to_owned())
        .collect()
}

/// Largest number of agents whose `[start_ms, end_ms)` windows overlap.
pub fn max_overlap(report: &Value) -> usize {
    let mut edges = Vec::new();
    for a in agents(report) {
        let start = a["start_ms"].as_u64().expect("start_ms");
        let end = a["end_ms"].as_u64().expect("end_ms");
        edges.push((start, 1i32));
        edges.push((end, -1i32));
    }
    // Ends sort before starts at the same instant: a slot freed and taken at once is not overlap.
    edges.sort_by_key(|&(t, d)| (t, d));
    let (mut cur, mut max) = (0i32, 0i32);
    for (_, d) in edges {
        cur += d;
        max = max.max(cur);
    }
    usize::try_from(max).unwrap_or(0)
}

/// A plain HTTP/1.1 response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    /// Header lines as sent (`name: value`), names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Polls `what` every 50 ms for at most `secs` seconds; whether it came true.
pub fn eventually(secs: u64, mut what: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if what() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    what()
}

/// `GET path` on 127.0.0.1:`port` with extra header lines; no redirects followed.
pub fn http_get(port: u16, path: &str, headers: &[(&str, &str)]) -> HttpResponse {
    http_request(port, "GET", path, headers, None)
}

/// Writes workflow `name` (with `body` after its meta) as `dir/{name}.js`.
pub fn write_workflow(dir: &Path, name: &str, description: &str, body: &str) -> PathBuf {
    let script = dir.join(format!("{name}.js"));
    std::fs::write(
        &script,
        format!(
            "export const meta = {{ name: '{name}', description: '{description}' }};\n{body}\n"
        ),
    )
    .expect("write script");
    script
}

/// The run id a `launch --json` printed, which must have succeeded.
pub fn launched_run_id(out: &Output) -> String {
    assert_eq!(out.code, 0, "launch failed: {out:?}");
    out.json()["run_id"].as_str().expect("run_id").to_owned()
}

/// Any request on 127.0.0.1:`port`, with an optional body; no redirects followed.
pub fn http_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> HttpResponse {
    http_request_to("127.0.0.1", port, method, path, headers, body)
}

/// Any request on `host`:`port` (an address of a test server: loopback, or a host of a
/// [`netbed::NetBed`] from a thread inside it).
pub fn http_request_to(
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> HttpResponse {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect((host, port)).expect("connect to the test server");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    req.push_str("\r\n");
    if let Some(b) = body {
        req.push_str(b);
    }
    s.write_all(req.as_bytes()).expect("send request");
    // Read to the end of the body: its Content-Length when given (some servers keep the
    // connection open despite `Connection: close`), else until the server closes.
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = s.read(&mut buf).expect("read response");
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            if length.is_some_and(|len| raw.len() >= end + 4 + len) {
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    // Bodies here are small; a chunked one is de-chunked crudely (sizes dropped).
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || after.len() < n {
                break;
            }
            out.push_str(&after[..n]);
            rest = after[n..].trim_start_matches("\r\n");
        }
        out
    } else {
        body.to_owned()
    };
    HttpResponse {
        status,
        headers,
        body,
    }
}

/// A TCP connection to 127.0.0.1:`port` from the loopback address `from` (all of 127/8 is
/// loopback on Linux, so one machine plays several peers: an attacker at 127.0.0.2 and a
/// prober at 127.0.0.1, say).
pub fn connect_from(from: std::net::Ipv4Addr, port: u16) -> std::net::TcpStream {
    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrIn};
    let fd = socket::socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("a socket");
    socket::bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrIn::from(std::net::SocketAddrV4::new(from, 0)),
    )
    .expect("bind the client's address");
    socket::connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrIn::from(std::net::SocketAddrV4::new(
            std::net::Ipv4Addr::LOCALHOST,
            port,
        )),
    )
    .expect("connect");
    std::net::TcpStream::from(fd)
}
