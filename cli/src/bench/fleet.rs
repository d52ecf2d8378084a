//! `flotilla bench fanout --distributed`: the fan-out end to end through real processes.
//!
//! In one run it starts a coordinator and W worker processes (this same binary) with a fresh
//! development CA, and measures:
//! - `raw_rpc_per_s`: concurrent no-op unary RPCs (`Ping`) over the same mTLS channel — the
//!   floor any remote call pays;
//! - `memory_calls_per_s`: N echo agents through coordinator and workers, memory leases and
//!   memory storage;
//! - `durable_calls_per_s`: the same with leases in etcd and runs in an S3 server (moto), both
//!   started here on free loopback ports.
//!
//! `overhead_ratio` = raw_rpc_per_s / memory_calls_per_s: how many raw round trips one agent
//! call costs.

use flotilla_proto::Problem;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_proto::tls::{Role, TlsFiles};
use flotilla_proto::v1::client_service_client::ClientServiceClient;
use flotilla_proto::v1::{self};
use serde::Serialize;
use tonic::transport::Channel;

/// The figures `--json` prints.
#[derive(Debug, Serialize)]
pub struct Report {
    pub calls: u64,
    pub workers: u32,
    pub concurrency: u32,
    pub raw_rpc_per_s: f64,
    pub memory_calls_per_s: f64,
    pub durable_calls_per_s: Option<f64>,
    pub overhead_ratio: f64,
    /// CPU time the fleet's processes (coordinator and workers) spent per call of the memory
    /// fan-out, and per raw RPC: figures that noise on the machine moves less than rates.
    pub memory_cpu_us_per_call: f64,
    pub raw_cpu_us_per_rpc: f64,
}

/// CPU time (user and system) the processes `pids` have used so far, from `/proc`.
fn cpu_of(pids: &[u32]) -> Duration {
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|&t| t > 0)
        .unwrap_or(100) as f64;
    let used: u64 = pids
        .iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            // The fields after the command's closing parenthesis: utime and stime are the
            // 12th and 13th of them.
            let rest = stat.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .sum();
    Duration::from_secs_f64(used as f64 / ticks)
}

/// A store URL and the environment a process needs to use it.
pub(crate) type StoreSetup = (String, Vec<(String, String)>);

/// Children killed on drop.
pub(crate) struct Procs(pub(crate) Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(crate) fn free_port() -> Result<u16, Problem> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Problem::internal(format!("no free port: {e}")))
}

pub(crate) fn find(binary: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(binary))
        .find(|p| p.is_file())
}

pub(crate) fn http_ok(port: u16, method: &str, path: &str, expect: &str) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains(expect)
}

pub(crate) fn wait_until(what: &str, mut ready: impl FnMut() -> bool) -> Result<(), Problem> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready() {
        if Instant::now() > deadline {
            return Err(Problem::internal(format!(
                "{what} did not start within 60 s"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Starts `cmd` with its output appended to `log` (a process started again keeps the log of
/// the one before).
pub(crate) fn spawn(cmd: &mut Command, log: &Path) -> Result<Child, Problem> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| Problem::internal(format!("{}: {e}", log.display())))?;
    cmd.stdin(Stdio::null())
        .stdout(
            file.try_clone()
                .map_err(|e| Problem::internal(e.to_string()))?,
        )
        .stderr(file)
        .spawn()
        .map_err(|e| Problem::internal(format!("cannot start {cmd:?}: {e}")))
}

/// One fleet: a coordinator and workers, with optional etcd and S3 settings.
async fn fleet(
    dir: &Path,
    pki: &Path,
    workers: u32,
    slots: u32,
    etcd: Option<String>,
    s3: Option<StoreSetup>,
    procs: &mut Procs,
) -> Result<ClientServiceClient<Channel>, Problem> {
    let exe = std::env::current_exe().map_err(|e| Problem::internal(e.to_string()))?;
    let port = free_port()?;
    let mut coord = Command::new(&exe);
    coord
        .args([
            "coordinator",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--http",
            &format!("127.0.0.1:{}", free_port()?),
            "--tls-dir",
        ])
        .arg(pki);
    match &s3 {
        Some((url, env)) => {
            coord
                .args(["--store", url])
                .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        }
        None => {
            coord.args(["--store", "memory://"]);
        }
    }
    if let Some(e) = &etcd {
        coord.args(["--etcd", e]);
    }
    procs.0.push(spawn(
        &mut coord,
        &dir.join(format!("coordinator-{port}.log")),
    )?);
    for i in 0..workers {
        let mut w = Command::new(&exe);
        w.args([
            "worker",
            "--coordinator",
            &format!("https://127.0.0.1:{port}"),
            "--name",
            &format!("bench-worker-{i}"),
        ])
        .args(["--slots", &slots.to_string(), "--tls-dir"])
        .arg(pki)
        .arg("--workspace")
        .arg(dir.join("ws"));
        procs
            .0
            .push(spawn(&mut w, &dir.join(format!("worker-{port}-{i}.log")))?);
    }
    let files = TlsFiles::in_dir(pki, "bench-client");
    let channel = flotilla_proto::tls::channel(&format!("https://127.0.0.1:{port}"), Some(&files))?;
    let mut client = ClientServiceClient::new(channel)
        .max_decoding_message_size(flotilla_proto::frag::MAX_MESSAGE_BYTES);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = client.list_workers(v1::ListWorkersRequest {}).await
            && r.into_inner().workers.len() == workers as usize
        {
            return Ok(client);
        }
        if Instant::now() > deadline {
            return Err(Problem::internal(format!(
                "the bench fleet did not come up; see the logs in {}",
                dir.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Launches `script` on the echo backend with room for `agents` calls, `concurrency` at once,
/// no stagger; the new run's id.
pub(crate) async fn launch_echo(
    client: &mut ClientServiceClient<Channel>,
    script: &str,
    args: serde_json::Value,
    agents: u64,
    concurrency: u32,
    resume_from: Option<&str>,
) -> Result<String, Problem> {
    launch_echo_from(
        client,
        script,
        args,
        (agents, concurrency),
        resume_from,
        None,
    )
    .await
}

/// [`launch_echo`], its run's source `source` (sent already) when there is one.
pub(crate) async fn launch_echo_from(
    client: &mut ClientServiceClient<Channel>,
    script: &str,
    args: serde_json::Value,
    (agents, concurrency): (u64, u32),
    resume_from: Option<&str>,
    source: Option<&flotilla_proto::settings::SourceRef>,
) -> Result<String, Problem> {
    let settings = flotilla_proto::settings::RunSettings {
        backend: "echo".into(),
        concurrency,
        max_agents: agents,
        stagger_ms: 0,
        source: source.cloned(),
        ..flotilla_proto::settings::RunSettings::default()
    };
    let launched = client
        .launch(v1::LaunchRequest {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            script: script.into(),
            origin: "bench".into(),
            args_json: Some(args.to_string()),
            settings_json: serde_json::to_string(&settings)
                .map_err(|e| Problem::internal(e.to_string()))?,
            resume_from: resume_from.unwrap_or_default().into(),
            workflows: Vec::new(),
            agent_types: Default::default(),
            agent_definitions: Vec::new(),
            saved_name: String::new(),
            inherit: false,
        })
        .await
        .map_err(|e| crate::client::call_problem(&e))?
        .into_inner();
    if launched.status != "running" {
        return Err(Problem::internal(format!(
            "bench launch refused: {}",
            launched.error
        )));
    }
    Ok(launched.run_id)
}

async fn fan_out(
    client: &mut ClientServiceClient<Channel>,
    calls: u64,
    concurrency: u32,
) -> Result<Duration, Problem> {
    let started = Instant::now();
    let run_id = launch_echo(
        client,
        crate::bench::SCRIPT,
        serde_json::json!({ "n": calls }),
        calls,
        concurrency,
        None,
    )
    .await?;
    let report = client
        .wait(v1::RunRef { run_id })
        .await
        .map_err(|e| crate::client::call_problem(&e))?
        .into_inner();
    let took = started.elapsed();
    let r: flotilla_proto::wire::Report =
        serde_json::from_str(&report.report_json).map_err(|e| Problem::internal(e.to_string()))?;
    if r.status != flotilla_proto::wire::RunStatus::Completed
        || r.result != serde_json::json!(calls)
    {
        return Err(Problem::internal(format!(
            "bench run ended {} ({:?})",
            r.status.as_str(),
            r.error
        )));
    }
    Ok(took)
}

async fn raw_rpcs(
    client: &ClientServiceClient<Channel>,
    calls: u64,
    concurrency: u32,
) -> Result<Duration, Problem> {
    let per = calls.div_ceil(u64::from(concurrency.max(1)));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..per {
                c.ping(v1::PingRequest {})
                    .await
                    .map_err(|e| crate::client::call_problem(&e))?;
            }
            Ok::<(), Problem>(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| Problem::internal(e.to_string()))??;
    }
    Ok(started.elapsed())
}

/// Starts an etcd on free loopback ports; returns its client URL and port.
pub(crate) fn start_etcd(dir: &Path, procs: &mut Procs) -> Result<(String, u16), Problem> {
    let etcd = find("etcd").ok_or(Problem::internal(
        "this benchmark needs etcd (apt-get install etcd-server)",
    ))?;
    let (client, peer) = (free_port()?, free_port()?);
    let curl = format!("http://127.0.0.1:{client}");
    let purl = format!("http://127.0.0.1:{peer}");
    let mut e = Command::new(etcd);
    e.args(["--name", "bench", "--data-dir"])
        .arg(dir.join("etcd"))
        .args([
            "--listen-client-urls",
            &curl,
            "--advertise-client-urls",
            &curl,
        ])
        .args([
            "--listen-peer-urls",
            &purl,
            "--initial-advertise-peer-urls",
            &purl,
        ])
        .args([
            "--initial-cluster",
            &format!("bench={purl}"),
            "--log-level",
            "warn",
        ]);
    procs.0.push(spawn(&mut e, &dir.join("etcd.log"))?);
    wait_until("etcd", || {
        http_ok(client, "GET", "/health", "\"health\":\"true\"")
    })?;
    Ok((curl, client))
}

/// Starts etcd and moto for the durable measurement.
fn durable_services(dir: &Path, procs: &mut Procs) -> Result<(String, StoreSetup), Problem> {
    let moto = std::env::var_os("FLOTILLA_MOTO_SERVER")
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from(".venv-svc/bin/moto_server")).filter(|p| p.is_file()))
        .or_else(|| find("moto_server"))
        .ok_or(Problem::internal("--distributed needs moto_server for the durable figure (pip install 'moto[server]'), or pass --no-durable"))?;
    let (curl, _) = start_etcd(dir, procs)?;
    let s3 = free_port()?;
    let mut m = Command::new(moto);
    m.args(["-H", "127.0.0.1", "-p", &s3.to_string()]);
    procs.0.push(spawn(&mut m, &dir.join("moto.log"))?);
    wait_until("moto", || http_ok(s3, "GET", "/", "HTTP/1.1 200"))?;
    if !http_ok(s3, "PUT", "/bench", "HTTP/1.1 200") {
        return Err(Problem::internal("cannot create the bench bucket in moto"));
    }
    let env = vec![
        (
            "AWS_ENDPOINT_URL".to_owned(),
            format!("http://127.0.0.1:{s3}"),
        ),
        ("AWS_ACCESS_KEY_ID".to_owned(), "bench".to_owned()),
        (
            "AWS_SECRET_ACCESS_KEY".to_owned(),
            "benchbenchbench".to_owned(),
        ),
        ("AWS_REGION".to_owned(), "us-east-1".to_owned()),
    ];
    Ok((curl, ("s3://bench/runs".to_owned(), env)))
}

/// A development CA in `pki` with a loopback `coordinator`, a `bench-client` and
/// `bench-worker-0..workers`.
pub(crate) fn bench_pki(pki: &Path, workers: u32) -> Result<(), Problem> {
    crate::certs::init(pki, 1, false)?;
    let loopback = ["127.0.0.1".to_owned()];
    crate::certs::issue(pki, "coordinator", Role::Coordinator, &loopback, 1, false)?;
    crate::certs::issue(pki, "bench-client", Role::Client, &[], 1, false)?;
    for i in 0..workers {
        let name = format!("bench-worker-{i}");
        crate::certs::issue(pki, &name, Role::Worker, &[], 1, false)?;
    }
    Ok(())
}

/// Runs the distributed fan-out benchmark.
pub async fn fanout(
    calls: u64,
    concurrency: u32,
    workers: u32,
    durable: bool,
) -> Result<Report, Problem> {
    if calls == 0 || workers == 0 || concurrency == 0 {
        return Err(Problem::internal(
            "--calls, --workers and --concurrency must be at least 1",
        ));
    }
    let dir = tempfile::tempdir().map_err(|e| Problem::internal(e.to_string()))?;
    let pki = dir.path().join("pki");
    bench_pki(&pki, workers)?;
    let slots = concurrency.div_ceil(workers);
    let mut procs = Procs(Vec::new());

    let mut memory = fleet(dir.path(), &pki, workers, slots, None, None, &mut procs).await?;
    // Warm up connections and code paths, then measure.
    fan_out(&mut memory, calls.min(500), concurrency).await?;
    raw_rpcs(&memory, calls.min(500), concurrency).await?;
    let pids: Vec<u32> = procs.0.iter().map(Child::id).collect();
    let cpu_before = cpu_of(&pids);
    let raw = raw_rpcs(&memory, calls, concurrency).await?;
    let cpu_raw = cpu_of(&pids);
    let mem = fan_out(&mut memory, calls, concurrency).await?;
    let cpu_mem = cpu_of(&pids);

    let durable_time = if durable {
        let (etcd, s3) = durable_services(dir.path(), &mut procs)?;
        let mut d = fleet(
            dir.path(),
            &pki,
            workers,
            slots,
            Some(etcd),
            Some(s3),
            &mut procs,
        )
        .await?;
        fan_out(&mut d, calls.min(500), concurrency).await?;
        Some(fan_out(&mut d, calls, concurrency).await?)
    } else {
        None
    };
    drop(procs);
    let n = calls as f64;
    let raw_rpc_per_s = n / raw.as_secs_f64();
    let memory_calls_per_s = n / mem.as_secs_f64();
    Ok(Report {
        calls,
        workers,
        concurrency,
        raw_rpc_per_s,
        memory_calls_per_s,
        durable_calls_per_s: durable_time.map(|d| n / d.as_secs_f64()),
        overhead_ratio: raw_rpc_per_s / memory_calls_per_s,
        memory_cpu_us_per_call: (cpu_mem - cpu_raw).as_secs_f64() * 1e6 / n,
        raw_cpu_us_per_rpc: (cpu_raw - cpu_before).as_secs_f64() * 1e6 / n,
    })
}
