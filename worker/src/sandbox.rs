//! Agents' processes run in a sandbox (issue 13): bubblewrap on Linux.
//!
//! An agent's process gets new user, PID, IPC, UTS and network namespaces (only a loopback
//! of its own), the system read-only (`/usr` and the few files of `/etc` programs need), a
//! private `/tmp` with its `HOME` in it, and read-write only its attempt's checkout. Nothing
//! of the worker is there: not its `--tls-dir`, config file, environment, workspace root or
//! other attempts. Inside, the agent is uid 1000 with no capabilities and cannot make user
//! namespaces of its own, so it cannot undo a read-only mount. It dies with the attempt: the
//! sandbox's PID 1 goes when bubblewrap does, and the kernel ends the whole namespace.
//!
//! A source checkout's git directory lives in the worker's cache: the repository is bound
//! read-only, the checkout's own git directory (`worktrees/NAME`) read-write, and objects an
//! agent's commits make go to `worktrees/NAME/objects` (the worker folds them into its cache
//! through `git index-pack`, which checks every one). The worker's own git on a checkout
//! names the common directory itself, so nothing the agent writes there redirects it.

use flotilla_proto::Problem;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::process::Command;

/// Whether and how agents' processes are confined.
#[derive(Debug, Clone, Default)]
pub enum Sandbox {
    /// As the worker's own user, with everything it can reach.
    #[default]
    Off,
    Bwrap(Arc<Bwrap>),
}

/// A working bubblewrap.
#[derive(Debug)]
pub struct Bwrap {
    bin: PathBuf,
    /// Files the sandbox shows as `/etc/passwd`, `/etc/group` and the agent's git config,
    /// and the gateway's socket: a directory of the worker's own (mode 0700), outside its
    /// workspace, removed with the sandbox.
    etc: PathBuf,
    state: Arc<tempfile::TempDir>,
    /// The network as agents reach it (see [`crate::gateway`]).
    api: Option<Net>,
    /// The seccomp filter every sandboxed process runs under ([`crate::seccomp`]), a file in
    /// the worker's own directory.
    seccomp: Option<PathBuf>,
}

/// The model API gateway and the proxy outside, and the flotilla binary that relays them
/// inside.
#[derive(Debug)]
struct Net {
    gateway: Arc<crate::gateway::Gateway>,
    proxy: PathBuf,
    relay: PathBuf,
}

/// Where the model API is, inside a sandbox.
pub const API_URL: &str = "http://127.0.0.1:47119";
const API_LISTEN: &str = "127.0.0.1:47119";
const RELAY_AT: &str = "/run/flotilla/flotilla";
const SOCKET_AT: &str = "/run/flotilla/api.sock";
/// The proxy to `--allow-net` hosts, inside a sandbox.
pub const PROXY_URL: &str = "http://127.0.0.1:3128";
const PROXY_LISTEN: &str = "127.0.0.1:3128";
const PROXY_AT: &str = "/run/flotilla/net.sock";

/// What one attempt's sandbox shows besides the system: paths in the order they are
/// mounted (a later one over an earlier one), the environment, and where the process starts;
/// `api`: the model API at [`API_URL`].
#[derive(Debug, Clone, Default)]
pub struct Jail {
    pub mounts: Vec<Mount>,
    pub env: Vec<(String, String)>,
    pub workdir: PathBuf,
    pub api: bool,
    /// Size of the private `/tmp`, in bytes (0: the kernel's default).
    pub tmp_size: u64,
    /// A command that starts first, outside, and runs the rest (the attempt's limits).
    pub prefix: Vec<OsString>,
    /// A copy-on-write checkout: the command that mounts it and runs the rest (after
    /// `prefix`, before the sandbox), and its mount point (see [`crate::layers`]).
    pub view: Option<(Vec<OsString>, PathBuf)>,
}

impl Jail {
    /// The command prefix: the attempt's limits, then the view's mount.
    fn full_prefix(&self) -> Vec<OsString> {
        let mut p = self.prefix.clone();
        if let Some((view, _)) = &self.view {
            p.extend(view.iter().cloned());
        }
        p
    }
}

/// One path a sandbox shows, at its own path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mount {
    Ro(PathBuf),
    Rw(PathBuf),
    /// Read-only if it is there.
    RoIfThere(PathBuf),
    /// An empty directory over it.
    Hide(PathBuf),
}

/// Where the agent's home is, inside.
pub const HOME: &str = "/tmp/home";
const PATH: &str = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";
/// Read-only files and directories of `/etc` a program may need, when the machine has them.
const ETC: &[&str] = &[
    "/etc/alternatives",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/pki",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/mime.types",
];

impl Sandbox {
    /// Bubblewrap, checked by making a sandbox (`bwrap` on `PATH`, or `FLOTILLA_BWRAP`).
    /// `Err` says why there is none and what to do.
    pub async fn bubblewrap() -> Result<Sandbox, Problem> {
        let bin = std::env::var_os("FLOTILLA_BWRAP").map_or_else(
            || find_on_path("bwrap").unwrap_or_else(|| PathBuf::from("bwrap")),
            PathBuf::from,
        );
        sweep_states(&std::env::temp_dir());
        let state = tempfile::Builder::new()
            .prefix(&format!("{STATE_PREFIX}{}-", std::process::id()))
            .tempdir()
            .map_err(|e| {
                Problem::unavailable(format!("cannot make the sandbox's directory: {e}"))
            })?;
        let etc = state.path().to_owned();
        for (name, body) in [
            ("passwd", "agent:x:1000:1000:agent:/tmp/home:/bin/sh\n"),
            ("group", "agent:x:1000:\n"),
            (
                "gitconfig",
                "[user]\n\tname = flotilla agent\n\temail = agent@flotilla.invalid\n[safe]\n\tdirectory = *\n",
            ),
        ] {
            std::fs::write(etc.join(name), body).map_err(|e| {
                Problem::unavailable(format!("cannot write {}: {e}", etc.join(name).display()))
            })?;
        }
        let seccomp = match crate::seccomp::program() {
            Some(bpf) => {
                let path = etc.join("seccomp.bpf");
                std::fs::write(&path, bpf).map_err(|e| {
                    Problem::unavailable(format!("cannot write {}: {e}", path.display()))
                })?;
                Some(path)
            }
            None => None,
        };
        let b = Bwrap {
            bin,
            etc,
            state: Arc::new(state),
            api: None,
            seccomp,
        };
        let mut probe = b.command(
            "true".as_ref(),
            &[],
            &Jail {
                workdir: PathBuf::from("/"),
                ..Jail::default()
            },
        );
        let out = probe
            .output()
            .await
            .map_err(|e| Problem::unavailable(format!("cannot run {}: {e}", b.bin.display())))?;
        if !out.status.success() {
            return Err(Problem::unavailable(format!(
                "{} cannot make a sandbox here: {}",
                b.bin.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(Sandbox::Bwrap(Arc::new(b)))
    }

    /// This sandbox with the network agents may have: the model API through a gateway
    /// that holds the worker's key, and the hosts of `allow` through a proxy (everything
    /// else refused with the reason), both outside and relayed inside by `relay`, the
    /// flotilla binary.
    pub async fn with_network(
        self,
        relay: PathBuf,
        allow: Vec<String>,
    ) -> Result<Sandbox, Problem> {
        let Sandbox::Bwrap(b) = self else {
            return Ok(self);
        };
        let dir = b.etc.join("api");
        let gateway = crate::gateway::Gateway::start(&dir).await?;
        let proxy =
            crate::gateway::start_proxy(&dir, allow, (API_LISTEN, gateway.socket().to_owned()))
                .await?;
        Ok(Sandbox::Bwrap(Arc::new(Bwrap {
            bin: b.bin.clone(),
            etc: b.etc.clone(),
            state: b.state.clone(),
            api: Some(Net {
                gateway,
                proxy,
                relay,
            }),
            seccomp: b.seccomp.clone(),
        })))
    }

    /// What an agent can reach, for the worker's start.
    pub fn describe(&self) -> String {
        match self {
            Sandbox::Off => OFF_WARNING.to_owned(),
            Sandbox::Bwrap(b) => {
                let api = b.api.as_ref().map_or_else(String::new, |n| {
                    format!("; model API gateway on {}", n.gateway.socket().display())
                });
                let seccomp = if b.seccomp.is_some() {
                    ", under a seccomp filter"
                } else {
                    ", with no seccomp filter (none for this architecture)"
                };
                format!(
                    "agents run in a bubblewrap sandbox ({}{seccomp}): their checkout read-write, the system read-only, no network but the model API{api}",
                    b.bin.display()
                )
            }
        }
    }

    /// Removes what the sandbox keeps outside (its identity files, filter and the gateway's
    /// sockets), at the worker's end: a static holds it for the worker's own git, so it is
    /// never dropped.
    pub fn cleanup(&self) {
        if let Sandbox::Bwrap(b) = self {
            let _ = std::fs::remove_dir_all(b.state.path());
        }
    }

    /// Whether a process this sandbox started, which ended with exit `code` and whose
    /// standard error ended with `last`, failed before its program ran: bubblewrap could not
    /// make the sandbox (its own message, `bwrap: …`, and status 1), or the relay inside
    /// could not start it (125, 127). That is the worker's failure, not the agent's:
    /// [`FailureKind::Setup`](flotilla_proto::v1::FailureKind::Setup), which the call
    /// goes again for. (An agent printing such a line itself only spends its own attempts.)
    pub fn setup_failure(&self, code: Option<i32>, last: &str) -> Option<crate::failure::Error> {
        let last = last.trim();
        let view =
            matches!(code, Some(125 | 127)) && last.starts_with(crate::layers::MOUNT_FAILED_PREFIX);
        if !self.is_on() && !view {
            return None;
        }
        let bwrap = code == Some(1) && last.starts_with("bwrap: ");
        let relay = matches!(code, Some(125 | 127)) && last.starts_with("flotilla sandbox relay: ");
        (bwrap || relay || view).then(|| {
            let (what, check) = if view {
                ("mount the agent's checkout", "how it makes workspaces")
            } else {
                ("make the agent's sandbox", "how agents run")
            };
            crate::failure::Error::new(
                flotilla_proto::v1::FailureKind::Setup,
                format!(
                    "the worker could not {what} ({last}); the agent never ran, and the call goes again; its log at start says {check}"
                ),
            )
        })
    }

    pub fn is_on(&self) -> bool {
        matches!(self, Sandbox::Bwrap(_))
    }

    /// A key for one attempt's agent, valid until dropped, when agents reach the model API
    /// through the gateway.
    pub fn api_token(&self) -> Option<crate::gateway::Token> {
        match self {
            Sandbox::Bwrap(b) => b.api.as_ref().map(|n| n.gateway.token()),
            Sandbox::Off => None,
        }
    }

    /// `program args` as the attempt's process: in the sandbox when there is one (with only
    /// `jail.env` and a minimal environment), else as is (the worker's environment and
    /// `jail.env`), starting in `jail.workdir`.
    pub fn command(&self, program: &std::ffi::OsStr, args: &[OsString], jail: &Jail) -> Command {
        match self {
            Sandbox::Off => {
                let mut c = prefixed(&jail.full_prefix(), program);
                // A view's mount point is all there is of it before it is mounted: the
                // mount starts the program in its working directory.
                let start = jail.view.as_ref().map_or(&jail.workdir, |(_, at)| at);
                c.args(args)
                    .envs(jail.env.iter().map(|(k, v)| (k, v)))
                    .current_dir(start);
                c
            }
            Sandbox::Bwrap(b) => {
                let mut c = b.command(program, args, jail);
                // bubblewrap itself starts anywhere; the agent in `jail.workdir`.
                c.current_dir("/");
                c
            }
        }
    }
}

impl Bwrap {
    /// Namespaces, the system read-only, `/proc`, `/dev`, a private `/tmp` (of `tmp_size`
    /// bytes, when not 0) and the agent's identity files.
    fn base(&self, a: &mut Vec<OsString>, tmp_size: u64) {
        if self.seccomp.is_some() {
            // The filter is on fd 3 (see [`Bwrap::launch`]).
            a.extend(["--seccomp".into(), "3".into()]);
        }
        let mut push = |xs: &[&str]| a.extend(xs.iter().map(OsString::from));
        push(&[
            "--die-with-parent",
            "--new-session",
            "--unshare-user",
            "--uid",
            "1000",
            "--gid",
            "1000",
            "--disable-userns",
            "--cap-drop",
            "ALL",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-net",
            "--unshare-cgroup-try",
            "--hostname",
            "sandbox",
            "--ro-bind",
            "/usr",
            "/usr",
        ]);
        for top in ["/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin"] {
            let p = Path::new(top);
            match std::fs::read_link(p) {
                Ok(target) => {
                    a.extend(["--symlink".into(), target.into_os_string(), top.into()]);
                }
                Err(_) if p.is_dir() => {
                    a.extend(["--ro-bind".into(), top.into(), top.into()]);
                }
                Err(_) => {}
            }
        }
        for e in ETC {
            a.extend(["--ro-bind-try".into(), (*e).into(), (*e).into()]);
        }
        for (file, at) in [
            ("passwd", "/etc/passwd"),
            ("group", "/etc/group"),
            ("gitconfig", "/etc/gitconfig-agent"),
        ] {
            a.extend([
                "--ro-bind".into(),
                self.etc.join(file).into_os_string(),
                at.into(),
            ]);
        }
        a.extend(
            ["--proc", "/proc", "--dev", "/dev"]
                .iter()
                .map(OsString::from),
        );
        // /dev/shm is memory too: as big as /tmp at most.
        let size = if tmp_size > 0 { tmp_size } else { 64 << 20 };
        a.extend([
            "--size".into(),
            size.to_string().into(),
            "--tmpfs".into(),
            "/dev/shm".into(),
        ]);
        if tmp_size > 0 {
            a.extend(["--size".into(), tmp_size.to_string().into()]);
        }
        a.extend(
            ["--tmpfs", "/tmp", "--dir", HOME]
                .iter()
                .map(OsString::from),
        );
    }

    fn mounts(a: &mut Vec<OsString>, mounts: &[Mount]) {
        for m in mounts {
            let (flag, p) = match m {
                Mount::Ro(p) => ("--ro-bind", p),
                Mount::Rw(p) => ("--bind", p),
                Mount::RoIfThere(p) => ("--ro-bind-try", p),
                Mount::Hide(p) => {
                    a.extend(["--tmpfs".into(), p.clone().into_os_string()]);
                    continue;
                }
            };
            a.extend([flag.into(), p.clone().into_os_string(), p.clone().into()]);
        }
    }

    /// The rest read-only: nothing but the mounts above (and `/tmp`) takes writes.
    fn seal(a: &mut Vec<OsString>) {
        a.extend(
            ["--remount-ro", "/dev", "--remount-ro", "/"]
                .iter()
                .map(OsString::from),
        );
    }

    fn command(&self, program: &std::ffi::OsStr, args: &[OsString], jail: &Jail) -> Command {
        let mut a: Vec<OsString> = Vec::new();
        a.push("--clearenv".into());
        for (k, v) in [
            ("PATH", PATH),
            ("HOME", HOME),
            ("USER", "agent"),
            ("LOGNAME", "agent"),
            ("TMPDIR", "/tmp"),
            ("LANG", "C.UTF-8"),
            ("GIT_CONFIG_GLOBAL", "/etc/gitconfig-agent"),
        ] {
            a.extend(["--setenv".into(), k.into(), v.into()]);
        }
        self.base(&mut a, jail.tmp_size);
        Self::mounts(&mut a, &jail.mounts);
        for (k, v) in &jail.env {
            a.extend(["--setenv".into(), k.into(), v.into()]);
        }
        a.extend(["--chdir".into(), jail.workdir.clone().into_os_string()]);
        match &self.api {
            Some(net) => {
                for (k, v) in [
                    ("HTTP_PROXY", PROXY_URL),
                    ("HTTPS_PROXY", PROXY_URL),
                    ("http_proxy", PROXY_URL),
                    ("https_proxy", PROXY_URL),
                ] {
                    a.extend(["--setenv".into(), k.into(), v.into()]);
                }
                a.extend([
                    "--ro-bind".into(),
                    net.relay.clone().into_os_string(),
                    RELAY_AT.into(),
                    "--bind".into(),
                    net.proxy.clone().into_os_string(),
                    PROXY_AT.into(),
                ]);
                if jail.api {
                    a.extend([
                        "--bind".into(),
                        net.gateway.socket().to_owned().into_os_string(),
                        SOCKET_AT.into(),
                    ]);
                }
                Self::seal(&mut a);
                a.extend([
                    "--".into(),
                    RELAY_AT.into(),
                    "sandbox-relay".into(),
                    "--relay".into(),
                    format!("{PROXY_LISTEN}={PROXY_AT}").into(),
                ]);
                if jail.api {
                    a.extend(["--relay".into(), format!("{API_LISTEN}={SOCKET_AT}").into()]);
                }
                a.push("--".into());
            }
            None => {
                Self::seal(&mut a);
                a.push("--".into());
            }
        }
        a.push(program.to_owned());
        a.extend(args.iter().cloned());
        let mut c = self.launch(&jail.full_prefix());
        c.args(a).env_clear();
        c
    }

    /// bubblewrap, run by `prefix` (the attempt's limits), with its seccomp filter open on
    /// fd 3: a shell opens it there and `exec`s the rest, which keeps it open through the
    /// prefix for bubblewrap to read (every fd the worker holds is close-on-exec).
    fn launch(&self, prefix: &[OsString]) -> Command {
        match &self.seccomp {
            Some(filter) => {
                let mut c = Command::new("/bin/sh");
                c.arg("-c")
                    .arg("exec \"$@\" 3<\"$0\"")
                    .arg(filter)
                    .args(prefix)
                    .arg(&self.bin);
                c
            }
            None => prefixed(prefix, self.bin.as_os_str()),
        }
    }
}

/// The sandbox the worker's own git runs in on checkouts (set once, when agents are
/// sandboxed): what an agent left there is never read by a git outside one.
static GIT_JAIL: std::sync::OnceLock<(Sandbox, crate::limits::Attempt)> =
    std::sync::OnceLock::new();

/// Runs the worker's git on checkouts in `s`, under `limits`, from now on (when `s` is a
/// sandbox).
pub fn jail_git(s: &Sandbox, limits: &crate::limits::Limits) {
    if s.is_on() && GIT_JAIL.get().is_none() {
        let _ = GIT_JAIL.set((s.clone(), limits.worker_git()));
    }
}

/// `git` for the worker on a checkout: in a sandbox that shows `mounts` (read-write the
/// common directory but its config, hooks and info; the checkout), with no network and none
/// of the worker's environment but what the caller sets, when agents are sandboxed; else
/// plain. `view`: the command that mounts a copy-on-write checkout and runs the rest (empty
/// for a checkout on disk). The command's arguments follow `git`.
pub fn worker_git(mounts: &[Mount], view: &[OsString]) -> Command {
    let Some((Sandbox::Bwrap(b), limits)) = GIT_JAIL.get() else {
        return match view.split_first() {
            Some((mount, rest)) => {
                let mut c = Command::new(mount);
                c.args(rest).arg("git");
                c
            }
            None => Command::new("git"),
        };
    };
    let mut a: Vec<OsString> = Vec::new();
    b.base(&mut a, 64 << 20);
    Bwrap::mounts(&mut a, mounts);
    Bwrap::seal(&mut a);
    a.extend(["--".into(), "git".into()]);
    let mut prefix = limits.prefix();
    prefix.extend(view.iter().cloned());
    let mut c = b.launch(&prefix);
    c.args(a)
        .env_clear()
        .env("PATH", PATH)
        .env("HOME", HOME)
        .env("LANG", "C.UTF-8")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null");
    c
}

/// How a sandbox's state directory is named: this, the worker's pid, `-`, a random part.
const STATE_PREFIX: &str = "flotilla-sandbox-";

/// Removes the state directories under `tmp` that workers which are gone left (killed
/// outright, they could not remove their own), judged by the pid in the name and the owner.
fn sweep_states(tmp: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    let me = nix::unistd::Uid::effective().as_raw();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(STATE_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let ours = std::fs::symlink_metadata(e.path()).is_ok_and(|m| m.is_dir() && m.uid() == me);
        if ours && !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// `program` run by `prefix` when there is one.
fn prefixed(prefix: &[OsString], program: &std::ffi::OsStr) -> Command {
    match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(program);
            c
        }
        None => Command::new(program),
    }
}

pub use crate::limits::find_on_path;

/// What `--sandbox off` leaves an agent, said on every start.
pub const OFF_WARNING: &str = "agents run without a sandbox (--sandbox off): as this worker's user, they can read its --tls-dir key and certificate, its config file and environment (API keys), every attempt's checkout under --workspace, and reach every address this machine can";

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// What `python3 -c CODE` prints in a real sandbox (bubblewrap is a test dependency of
    /// this crate: the suite installs it).
    async fn in_sandbox(code: &str) -> String {
        let sandbox = Sandbox::bubblewrap()
            .await
            .expect("bubblewrap makes a sandbox here (tools/test installs it)");
        let dir = tempfile::tempdir().unwrap();
        let jail = Jail {
            workdir: dir.path().to_owned(),
            mounts: vec![Mount::Rw(dir.path().to_owned())],
            ..Jail::default()
        };
        let out = sandbox
            .command("python3".as_ref(), &["-c".into(), code.into()], &jail)
            .output()
            .await
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    #[test]
    fn a_gone_worker_s_sandbox_state_is_swept_and_a_live_one_s_stays() {
        let tmp = tempfile::tempdir().unwrap();
        // No process has pid 4194304 (above the kernel's largest).
        let gone = tmp.path().join(format!("{STATE_PREFIX}4194304-abc123"));
        let live = tmp
            .path()
            .join(format!("{STATE_PREFIX}{}-def456", std::process::id()));
        let other = tmp.path().join("flotilla-sandbox-xyz");
        for d in [&gone, &live, &other] {
            std::fs::create_dir_all(d.join("api")).unwrap();
        }
        sweep_states(tmp.path());
        assert!(!gone.exists());
        assert!(live.exists());
        assert!(other.exists(), "a name without a pid is not judged");
    }

    #[tokio::test]
    async fn a_sandbox_that_cannot_be_made_is_the_worker_s_failure_and_an_agent_s_exit_is_not() {
        let sandbox = Sandbox::bubblewrap().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let run = |mounts: Vec<Mount>, code: &str| {
            let jail = Jail {
                workdir: dir.path().to_owned(),
                mounts,
                ..Jail::default()
            };
            sandbox
                .command("sh".as_ref(), &["-c".into(), code.into()], &jail)
                .output()
        };
        let last = |o: &std::process::Output| {
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or_default()
                .to_owned()
        };
        // A path to show that is not there: bubblewrap fails before the program runs.
        let broken = run(vec![Mount::Ro(dir.path().join("not-there"))], "echo ran")
            .await
            .unwrap();
        assert!(broken.stdout.is_empty());
        let e = sandbox
            .setup_failure(broken.status.code(), &last(&broken))
            .expect("bubblewrap's own failure is told apart");
        assert_eq!(e.kind, flotilla_proto::v1::FailureKind::Setup);
        assert!(e.message.contains("bwrap: "), "{}", e.message);
        // The agent's own failure is the agent's.
        let own = run(
            vec![Mount::Rw(dir.path().to_owned())],
            "echo 'it went wrong' >&2; exit 1",
        )
        .await
        .unwrap();
        assert_eq!(own.status.code(), Some(1));
        assert!(
            sandbox
                .setup_failure(own.status.code(), &last(&own))
                .is_none()
        );
        assert!(Sandbox::Off.setup_failure(Some(1), "bwrap: x").is_none());
    }

    #[tokio::test]
    async fn a_worker_s_end_removes_its_sandbox_state() {
        let sandbox = Sandbox::bubblewrap().await.unwrap();
        let Sandbox::Bwrap(b) = &sandbox else {
            panic!("a sandbox")
        };
        let state = b.state.path().to_owned();
        assert!(state.join("seccomp.bpf").exists());
        // A copy stays in the worker's git jail for its whole life, as it does in a worker.
        let held = sandbox.clone();
        sandbox.cleanup();
        assert!(!state.exists());
        drop(held);
    }

    #[tokio::test]
    async fn agents_run_under_the_seccomp_filter() {
        // Each call's result and errno, made as an agent would make it.
        let code = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, nr, *args):
    r = libc.syscall(nr, *args)
    if r == 0 and name.startswith("clone"):
        os._exit(0)
    print(name, r, ctypes.get_errno(), flush=True)
call("mount", 165, b"none", b"/tmp", b"tmpfs", 0, 0)
call("unshare", 272, 0x10000000)
call("keyctl", 250, 0, 0, 0, 0)
call("bpf", 321, 0, 0, 0)
call("perf_event_open", 298, 0, 0, -1, -1, 0)
call("userfaultfd", 323, 0)
call("ptrace", 101, 16, 999999, 0, 0)
call("clock_settime", 227, 0, 0)
call("io_uring_setup", 425, 1, 0)
call("x32_mount", 0x40000000 | 165, 0, 0, 0, 0, 0)
call("clone_newuser", 56, 0x10000000 | 17, 0, 0, 0, 0)
call("getpid", 39)

"#;
        let out = in_sandbox(code).await;
        let eperm = nix::libc::EPERM.to_string();
        for name in [
            "mount",
            "unshare",
            "keyctl",
            "bpf",
            "perf_event_open",
            "userfaultfd",
            "ptrace",
            "clock_settime",
            "io_uring_setup",
            "x32_mount",
            "clone_newuser",
        ] {
            let line = out
                .lines()
                .find(|l| l.split(' ').next() == Some(name))
                .unwrap_or_else(|| panic!("no {name} in {out}"));
            let parts: Vec<&str> = line.split(' ').collect();
            assert_eq!(parts[1], "-1", "{name} must fail: {out}");
            assert_eq!(parts[2], eperm, "{name} must fail with EPERM: {out}");
        }
        let getpid = out.lines().find(|l| l.starts_with("getpid ")).unwrap();
        assert_ne!(getpid.split(' ').nth(1), Some("-1"), "{out}");
        // Ordinary work goes on: processes, threads, files.
        let busy = in_sandbox(
            "import subprocess, threading; t = threading.Thread(target=lambda: None); t.start(); t.join(); \
             open('f.txt', 'w').write('x'); print(subprocess.run(['sh', '-c', 'cat f.txt'], capture_output=True).stdout.decode())",
        )
        .await;
        assert_eq!(busy.trim(), "x");
    }
}
