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
pub mod proxy;
pub mod services;

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
            .env_remove("FLOTILLA_CONFIG");
        // The caller's variables win over the defaults above.
        cmd.envs(vars.iter().copied());
        run_with_timeout(cmd, COMMAND_TIMEOUT)
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
