//! `flotilla dev`: a real fleet on this machine in one command — a development CA, a
//! coordinator, N workers as processes of their own, a file store and leases in memory (or in
//! an etcd it starts, `--etcd`) — for trying the fleet and for developing against it.
//!
//! Everything lives in one directory (`--dir`, default `~/.local/share/flotilla/dev`): the CA
//! and certificates (`pki/`, made once and reused), the store, the workers' workspaces and
//! every process's log (`logs/`). Runs stored there survive a restart of the fleet. When it is
//! up it prints the coordinator's address, the session pages with a sign-in link and the
//! exact `launch` line; Ctrl-C (or SIGTERM) stops every process it started, and waits for
//! them. Its children also end when it is killed outright (they ask the kernel for a signal
//! when their parent dies), and a leftover one of an earlier `dev` in the same directory (an
//! etcd) is stopped when the next one starts. A `dev` whose directory holds a running fleet
//! (`dev.lock`, locked while it lives) is refused, naming that fleet's pid: it never touches
//! it.

use flotilla_proto::Problem;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use flotilla_proto::tls::Role;
use flotilla_proto::v1;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use crate::client::{ClientArgs, TlsArgs};

#[derive(Debug, Args)]
pub struct DevArgs {
    /// Workers to start, each a process of its own.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Attempts each worker runs at once.
    #[arg(long, default_value_t = 4)]
    slots: u32,
    /// Where the fleet keeps its CA, store, workspaces and logs [default:
    /// ~/.local/share/flotilla/dev].
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// The coordinator's port on 127.0.0.1 [default: 7443, or a free one when it is taken].
    #[arg(long)]
    port: Option<u16>,
    /// The session pages' port on 127.0.0.1 [default: 8080, or a free one when it is taken].
    #[arg(long)]
    http_port: Option<u16>,
    /// Keep the leases in an etcd this command starts (with TLS; the `etcd` binary must be on
    /// PATH, e.g. Debian's etcd-server) instead of in the coordinator's memory.
    #[arg(long)]
    etcd: bool,
    /// Backends the workers offer [default: echo, with claude-code when the claude CLI is on
    /// PATH, anthropic when ANTHROPIC_API_KEY is set, exec with --exec-cmd].
    #[arg(long = "backend", value_delimiter = ',')]
    backends: Vec<String>,
    /// Command of the workers' exec backend.
    #[arg(long)]
    exec_cmd: Option<String>,
    /// The workers' agent sandbox (`off`: agents unconfined, when bubblewrap is missing).
    #[arg(long, value_name = "on|off")]
    sandbox: Option<String>,
    /// When the fleet is up, print it as one JSON object on stdout (for scripts).
    #[arg(long)]
    json: bool,
}

impl DevArgs {
    pub fn json(&self) -> bool {
        self.json
    }
}

/// The variable that tells a child of `dev` its parent's pid: it asks the kernel to be sent
/// SIGTERM when that parent dies ([`exit_with_parent`]).
pub const PARENT_VAR: &str = "FLOTILLA_DEV_PARENT";

/// In a child of `flotilla dev`: end with the parent, even when the parent is SIGKILLed.
pub fn exit_with_parent() {
    let Some(parent) = std::env::var(PARENT_VAR)
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM);
    // The parent may have died before the request was made.
    if nix::unistd::getppid().as_raw() != parent {
        std::process::exit(1);
    }
}

/// A process the fleet started.
struct Proc {
    name: String,
    child: Child,
    /// How to start it again (workers only).
    restart: Option<Command>,
}

/// The fleet's processes; dropping it stops them all.
struct Procs {
    list: Vec<Proc>,
    pids_file: PathBuf,
}

impl Procs {
    fn spawn(&mut self, name: &str, mut cmd: Command, logs: &Path) -> Result<(), Problem> {
        let log = std::fs::File::create(logs.join(format!("{name}.log"))).map_err(|e| {
            Problem::internal(format!("cannot write {}/{name}.log: {e}", logs.display()))
        })?;
        let err = log.try_clone().map_err(|e| {
            Problem::internal(format!("cannot write {}/{name}.log: {e}", logs.display()))
        })?;
        cmd.stdin(Stdio::null()).stdout(log).stderr(err);
        let child = cmd
            .spawn()
            .map_err(|e| Problem::internal(format!("cannot start {name}: {e}")))?;
        self.list.push(Proc {
            name: name.to_owned(),
            child,
            restart: None,
        });
        self.record();
        Ok(())
    }

    /// Writes the pids, so a later `dev` in this directory can stop what a killed one left.
    fn record(&self) {
        let text: String = self
            .list
            .iter()
            .map(|p| format!("{} {}\n", p.child.id(), p.name))
            .collect();
        let _ = std::fs::write(&self.pids_file, text);
    }

    /// The first process that has ended, with its status.
    fn ended(&mut self) -> Option<(usize, std::process::ExitStatus)> {
        self.list
            .iter_mut()
            .enumerate()
            .find_map(|(i, p)| p.child.try_wait().ok().flatten().map(|s| (i, s)))
    }

    fn stop_all(&mut self) {
        for p in &self.list {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p.child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for p in &mut self.list {
            loop {
                match p.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() > deadline => {
                        let _ = p.child.kill();
                        let _ = p.child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        self.list.clear();
        let _ = std::fs::remove_file(&self.pids_file);
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// Takes `dir` for this fleet: an exclusive lock on `dir/dev.lock` (the kernel lets it go when
/// this process ends, SIGKILL included; children do not inherit it), with this process's pid
/// written in it. A fleet already running there is never touched: refused, naming its pid and
/// how to stop it.
fn hold_dir(dir: &Path) -> Result<Flock<std::fs::File>, Problem> {
    use std::io::{Read, Seek, Write};
    let path = dir.join("dev.lock");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Problem::internal(format!("cannot open {}: {e}", path.display())))?;
    let mut file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(held) => held,
        Err((mut file, Errno::EWOULDBLOCK)) => {
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            let pid = text.split_whitespace().next().unwrap_or("unknown");
            return Err(Problem::new(
                flotilla_proto::ErrorKind::Conflict,
                format!(
                    "a fleet of `flotilla dev` already runs in {} (pid {pid}); stop it first (Ctrl-C where it runs, or `kill {pid}`: it stops every process it started), or give this one another --dir",
                    dir.display()
                ),
            ));
        }
        Err((_, e)) => {
            return Err(Problem::internal(format!(
                "cannot lock {}: {e}",
                path.display()
            )));
        }
    };
    let written = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()));
    written.map_err(|e| Problem::internal(format!("cannot write {}: {e}", path.display())))?;
    Ok(file)
}

/// Stops what an earlier `dev` in `dir` left running (it was killed before it could): each
/// recorded pid whose command line still names `dir`.
fn stop_leftovers(pids_file: &Path, dir: &Path) {
    let Ok(text) = std::fs::read_to_string(pids_file) else {
        return;
    };
    let needle = dir.display().to_string();
    for line in text.lines() {
        let Some(pid) = line
            .split_whitespace()
            .next()
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&needle) {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    let _ = std::fs::remove_file(pids_file);
}

/// `preferred` on 127.0.0.1 if it is free, else a free port.
fn pick_port(preferred: u16) -> Result<u16, Problem> {
    if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", preferred)) {
        return Ok(l
            .local_addr()
            .map_err(|e| Problem::unavailable(e.to_string()))?
            .port());
    }
    let l = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| Problem::unavailable(format!("cannot find a free port on 127.0.0.1: {e}")))?;
    Ok(l.local_addr()
        .map_err(|e| Problem::unavailable(e.to_string()))?
        .port())
}

/// The CA and the certificates the fleet uses, made once.
fn certificates(pki: &Path, workers: usize, etcd: bool) -> Result<(), Problem> {
    if !pki.join("ca.crt").exists() {
        crate::certs::init(pki, 3650, false)?;
    }
    let hosts = ["127.0.0.1".to_owned(), "localhost".to_owned()];
    let mut wanted = vec![
        ("coordinator".to_owned(), Role::Coordinator),
        ("client".to_owned(), Role::Client),
    ];
    if etcd {
        wanted.push(("etcd".to_owned(), Role::Coordinator));
    }
    wanted.extend((0..workers).map(|i| (format!("worker-{i}"), Role::Worker)));
    for (name, role) in wanted {
        if !pki.join(format!("{name}.crt")).exists() {
            crate::certs::issue(pki, &name, role, &hosts, 825, true)?;
        }
    }
    Ok(())
}

/// The backends the workers offer when `--backend` does not say.
fn default_backends(exec_cmd: bool) -> Vec<String> {
    let mut out = vec!["echo".to_owned()];
    if std::env::var_os("FLOTILLA_CLAUDE_BIN").is_some() || crate::config::on_path("claude") {
        out.push("claude-code".into());
    }
    if std::env::var_os("ANTHROPIC_API_KEY").is_some_and(|k| !k.is_empty()) {
        out.push("anthropic".into());
    }
    if exec_cmd {
        out.push("exec".into());
    }
    out
}

/// Why the fleet cannot start, when one of its processes has ended: its name, status and
/// the end of its log.
fn died_starting(procs: &mut Procs, logs: &Path) -> Option<Problem> {
    let (i, status) = procs.ended()?;
    let name = &procs.list[i].name;
    Some(Problem::unavailable(format!(
        "{name} ended ({status}) while starting; its log ({}/{name}.log) ends:\n{}",
        logs.display(),
        tail(&logs.join(format!("{name}.log")))
    )))
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

pub async fn dev(a: DevArgs) -> i32 {
    match up(a).await {
        Ok(code) => code,
        Err(e) => crate::refuse(e),
    }
}

async fn up(a: DevArgs) -> Result<i32, Problem> {
    if a.workers == 0 {
        return Err(Problem::invalid("--workers must be at least 1"));
    }
    let (dir, logs) = fleet_dir(&a)?;
    // One fleet per directory: held until this process ends, however it ends.
    let _held = hold_dir(&dir)?;
    let pids_file = dir.join("dev.pids");
    stop_leftovers(&pids_file, &dir);
    let pki = dir.join("pki");
    certificates(&pki, a.workers, a.etcd)?;
    let me = std::env::current_exe()
        .map_err(|e| Problem::internal(format!("cannot find this program: {e}")))?;
    let port = pick_port(a.port.unwrap_or(7443))?;
    let http_port = pick_port(a.http_port.unwrap_or(8080))?;
    let store = format!("file://{}", dir.join("store").display());
    let parent = std::process::id().to_string();
    let mut procs = Procs {
        list: Vec::new(),
        pids_file,
    };

    let etcd = if a.etcd {
        Some(start_etcd(&mut procs, &dir, &pki, &logs).await?)
    } else {
        None
    };

    let url = format!("https://127.0.0.1:{port}");
    let mut cmd = Command::new(&me);
    cmd.arg("coordinator")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--http", &format!("127.0.0.1:{http_port}")])
        .args(["--store", &store])
        .arg("--tls-dir")
        .arg(&pki)
        .env(PARENT_VAR, &parent)
        .env_remove("FLOTILLA_CONFIG");
    if let Some(e) = &etcd {
        cmd.args(["--etcd", e]);
    }
    procs.spawn("coordinator", cmd, &logs)?;
    let remote = ClientArgs {
        coordinator: Some(url.clone()),
        tls: TlsArgs {
            tls_dir: Some(pki.clone()),
            name: Some("client".into()),
            ..Default::default()
        },
    };
    let mut client = remote.client()?;
    let token = signed_in(&mut client, &mut procs, &logs).await?;
    // Later client commands reach this fleet with no flags: it is the current context.
    let dev_context = crate::client::context::Context {
        coordinator: url.clone(),
        tls_dir: Some(pki.clone()),
        name: Some("client".into()),
        insecure: false,
    };
    if let Err(e) = crate::client::context::add("dev", dev_context, true) {
        eprintln!("warning: the dev context was not saved: {}", e.message);
    }

    let backends = if a.backends.is_empty() {
        default_backends(a.exec_cmd.is_some())
    } else {
        a.backends.clone()
    };
    for i in 0..a.workers {
        let name = format!("worker-{i}");
        let worker = || {
            let mut cmd = Command::new(&me);
            cmd.arg("worker")
                .args(["--coordinator", &url, "--name", &name])
                .arg("--tls-dir")
                .arg(&pki)
                .arg("--workspace")
                .arg(dir.join(format!("ws-{i}")))
                .args(["--slots", &a.slots.to_string()])
                .args(["--backend", &backends.join(",")])
                .env(PARENT_VAR, &parent)
                .env_remove("FLOTILLA_CONFIG");
            if let Some(c) = &a.exec_cmd {
                cmd.args(["--exec-cmd", c]);
            }
            if let Some(s) = &a.sandbox {
                cmd.args(["--sandbox", s]);
            }
            cmd
        };
        procs.spawn(&name, worker(), &logs)?;
        if let Some(p) = procs.list.last_mut() {
            p.restart = Some(worker());
        }
    }
    wait_for_workers(&mut client, &mut procs, a.workers, &logs).await?;
    say_up(&Up {
        a: &a,
        pages: format!("http://127.0.0.1:{http_port}/runs"),
        login: format!("{}&next=/runs", token.login_url),
        url,
        pki,
        store,
        etcd,
        backends,
        logs: logs.clone(),
        pids: procs.list.iter().map(|p| p.child.id()).collect(),
    });
    supervise(&mut procs, &logs).await
}

/// The fleet's directory (`--dir`, else the user's local data directory) and its logs'.
fn fleet_dir(a: &DevArgs) -> Result<(PathBuf, PathBuf), Problem> {
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => dirs::data_local_dir()
            .ok_or_else(|| Problem::invalid("no local data directory here; pass --dir DIR"))?
            .join("flotilla")
            .join("dev"),
    };
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs)
        .map_err(|e| Problem::internal(format!("cannot create {}: {e}", logs.display())))?;
    let dir = dir
        .canonicalize()
        .map_err(|e| Problem::internal(format!("cannot read {}: {e}", dir.display())))?;
    let logs = dir.join("logs");
    Ok((dir, logs))
}

/// Waits (at most a minute) for the coordinator to answer an authenticated call: a sign-in
/// token for the pages.
async fn signed_in(
    client: &mut flotilla_proto::v1::client_service_client::ClientServiceClient<
        tonic::transport::Channel,
    >,
    procs: &mut Procs,
    logs: &Path,
) -> Result<v1::CreateTokenReply, Problem> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(why) = died_starting(procs, logs) {
            return Err(why);
        }
        match client
            .create_token(v1::CreateTokenRequest { ttl_secs: 0 })
            .await
        {
            Ok(r) => return Ok(r.into_inner()),
            Err(s) if Instant::now() > deadline => {
                return Err(Problem::unavailable(format!(
                    "the coordinator did not answer within a minute ({}); its log is {}/coordinator.log",
                    s.message(),
                    logs.display()
                )));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// What `dev` brought up.
struct Up<'a> {
    a: &'a DevArgs,
    url: String,
    pages: String,
    login: String,
    pki: PathBuf,
    store: String,
    etcd: Option<String>,
    backends: Vec<String>,
    logs: PathBuf,
    pids: Vec<u32>,
}

/// Says what is up and how to use it (one JSON object with `--json`).
fn say_up(up: &Up) {
    let (a, url, pki) = (up.a, &up.url, &up.pki);
    if a.json {
        let launch = [
            "flotilla".to_owned(),
            "launch".to_owned(),
            "SCRIPT.js".to_owned(),
            "--coordinator".to_owned(),
            url.clone(),
            "--tls-dir".to_owned(),
            pki.display().to_string(),
        ];
        println!(
            "{}",
            serde_json::json!({
                "coordinator": url,
                "pages": up.pages,
                "login_url": up.login,
                "tls_dir": pki,
                "store": up.store,
                "etcd": up.etcd,
                "workers": a.workers,
                "backends": up.backends,
                "logs": up.logs,
                "launch": launch,
                "pids": up.pids,
            })
        );
    } else {
        let leases = up.etcd.as_ref().map_or("leases in memory".to_owned(), |e| {
            format!("leases in etcd at {e}")
        });
        println!(
            "a fleet is up: a coordinator and {} workers of {} slots each (backends {}), {leases}",
            a.workers,
            a.slots,
            up.backends.join(", ")
        );
        println!("  coordinator  {url}");
        println!("  pages        {}", up.pages);
        println!("  sign in      {}", up.login);
        println!("  store        {}", up.store);
        println!("  logs         {}", up.logs.display());
        println!();
        println!("launch a run on it:");
        println!();
        println!(
            "  flotilla launch SCRIPT.js --coordinator {url} --tls-dir {}",
            pki.display()
        );
        println!();
        println!(
            "It is the current context (`dev`), so client commands need neither flag: `flotilla launch SCRIPT.js`, `flotilla status RUN`, `flotilla workers` (`flotilla context` lists contexts)."
        );
        println!("Ctrl-C stops it all.");
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

/// Starts etcd with TLS on two free ports; its client URL.
async fn start_etcd(
    procs: &mut Procs,
    dir: &Path,
    pki: &Path,
    logs: &Path,
) -> Result<String, Problem> {
    if !crate::config::on_path("etcd") {
        return Err(Problem::unavailable(
            "--etcd needs the etcd binary on PATH (Debian: apt-get install etcd-server); without --etcd the leases stay in the coordinator's memory",
        ));
    }
    let (client, peer) = (pick_port(0)?, pick_port(0)?);
    let client_url = format!("https://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let mut cmd = Command::new("etcd");
    cmd.args(["--name", "dev", "--data-dir"])
        .arg(dir.join("etcd"))
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("dev={peer_url}")])
        .arg("--cert-file")
        .arg(pki.join("etcd.crt"))
        .arg("--key-file")
        .arg(pki.join("etcd.key"))
        .arg("--trusted-ca-file")
        .arg(pki.join("ca.crt"))
        .args(["--client-cert-auth", "--log-level", "warn"]);
    procs.spawn("etcd", cmd, logs)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(("127.0.0.1", client))
        .await
        .is_err()
    {
        if procs.ended().is_some() || Instant::now() > deadline {
            return Err(Problem::unavailable(format!(
                "etcd did not start; its log ({}/etcd.log) ends:\n{}",
                logs.display(),
                tail(&logs.join("etcd.log"))
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(client_url)
}

async fn wait_for_workers(
    client: &mut flotilla_proto::v1::client_service_client::ClientServiceClient<
        tonic::transport::Channel,
    >,
    procs: &mut Procs,
    n: usize,
    logs: &Path,
) -> Result<(), Problem> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(why) = died_starting(procs, logs) {
            return Err(why);
        }
        if let Ok(r) = client.list_workers(v1::ListWorkersRequest {}).await
            && r.into_inner().workers.len() >= n
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Problem::unavailable(format!(
                "the workers did not attach within a minute; their logs are in {}",
                logs.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Until Ctrl-C or SIGTERM: a worker that ends is started again (after a second); the fleet
/// stops when its coordinator or its etcd ends.
async fn supervise(procs: &mut Procs, logs: &Path) -> Result<i32, Problem> {
    let stop = crate::serve::shutdown_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => {
                eprintln!("stopping the fleet");
                procs.stop_all();
                return Ok(0);
            }
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
        let Some((i, status)) = procs.ended() else {
            continue;
        };
        let name = procs.list[i].name.clone();
        let Some(mut again) = procs.list[i].restart.take() else {
            procs.stop_all();
            return Err(Problem::internal(format!(
                "{name} ended ({status}), so the fleet stopped; its log ({}/{name}.log) ends:\n{}",
                logs.display(),
                tail(&logs.join(format!("{name}.log")))
            )));
        };
        eprintln!("{name} ended ({status}); starting it again");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let log = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(logs.join(format!("{name}.log")))
            .map_err(|e| Problem::internal(format!("cannot write {name}'s log: {e}")))?;
        let err = log
            .try_clone()
            .map_err(|e| Problem::internal(e.to_string()))?;
        again.stdin(Stdio::null()).stdout(log).stderr(err);
        let child = again
            .spawn()
            .map_err(|e| Problem::internal(format!("cannot start {name} again: {e}")))?;
        // The same command for the next time: rebuilt from the process's own arguments.
        let mut next = Command::new(again.get_program());
        next.args(again.get_args());
        for (k, v) in again.get_envs() {
            match v {
                Some(v) => next.env(k, v),
                None => next.env_remove(k),
            };
        }
        procs.list[i] = Proc {
            name,
            child,
            restart: Some(next),
        };
        procs.record();
    }
}
