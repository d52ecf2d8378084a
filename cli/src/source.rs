//! A fleet run's source, on the client: the user's repository as one snapshot commit, sent to
//! the coordinator's store as git objects it does not hold yet.
//!
//! The snapshot is HEAD plus the uncommitted changes to tracked files and the untracked files
//! that are not ignored: `git add -A` into a temporary index (a copy of the real one, so only
//! changed files are hashed), `write-tree`, and `commit-tree` on top of HEAD. The user's
//! index, refs and working tree are not touched; the commit's dates are HEAD's, so the same
//! tree on the same HEAD is the same commit and a relaunch uploads nothing. A clean tree's
//! snapshot is HEAD itself.
//!
//! The upload asks the store which of the snapshot's recent ancestors it holds and sends one
//! pack (`git pack-objects --revs`) of everything else, in chunks.

use flotilla_proto::Problem;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use flotilla_proto::settings::SourceRef;
use flotilla_proto::v1;
use sha2::{Digest, Sha256};

/// How far back along the first-parent chain the client asks what the store holds.
const ANCESTORS: usize = 256;
/// Bytes per upload chunk.
const CHUNK: usize = 1 << 20;

fn git(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<String, Problem> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .envs(env.iter().copied())
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .map_err(|e| {
            Problem::internal(format!(
                "cannot run git: {e}; install git to send the repository with the run"
            ))
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(Problem::internal(format!(
            "git {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// The repository holding `cwd` as a snapshot commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub root: PathBuf,
    pub repo: String,
    pub commit: String,
    /// HEAD, when the repository has commits.
    pub head: Option<String>,
    /// For display: the root and the branch (or "detached at …").
    pub origin: String,
    /// Submodules sent as plain files (`--submodules`), by path.
    pub submodules: Vec<String>,
    /// Submodules that stay links (not checked out here).
    pub skipped: Vec<String>,
    /// Object directories of those submodules, which the snapshot's objects come from too.
    pub alternates: Vec<PathBuf>,
}

impl Snapshot {
    /// The environment git needs to read the snapshot's objects (its submodules' too).
    fn env(&self) -> Vec<(&'static str, String)> {
        alternates_env(&self.alternates)
    }
}

fn alternates_env(dirs: &[PathBuf]) -> Vec<(&'static str, String)> {
    if dirs.is_empty() {
        return Vec::new();
    }
    let joined = dirs
        .iter()
        .map(|d| d.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(":");
    vec![("GIT_ALTERNATE_OBJECT_DIRECTORIES", joined)]
}

/// What following submodules gathered.
#[derive(Default)]
struct Followed {
    paths: Vec<String>,
    skipped: Vec<String>,
    alternates: Vec<PathBuf>,
}

/// The tree of the working tree at `root` (HEAD, uncommitted and untracked files), through a
/// temporary index; with `follow`, each checked-out submodule's own working tree replaces its
/// link (recursively), and its objects are read through `followed.alternates`.
fn working_tree(
    root: &Path,
    head: Option<&str>,
    follow: bool,
    prefix: &str,
    followed: &mut Followed,
) -> Result<String, Problem> {
    // A temporary index, seeded from the real one so unchanged files are not hashed again.
    let real_index = PathBuf::from(git(
        root,
        &["rev-parse", "--path-format=absolute", "--git-path", "index"],
        &[],
    )?);
    let tmp = tempfile::tempdir()
        .map_err(|e| Problem::invalid(format!("cannot make a temporary index: {e}")))?;
    let index = tmp.path().join("index");
    if real_index.exists() {
        std::fs::copy(&real_index, &index)
            .map_err(|e| Problem::invalid(format!("cannot copy the index: {e}")))?;
    }
    let index_s = index.to_string_lossy().into_owned();
    let env = [("GIT_INDEX_FILE", index_s.as_str())];
    if !real_index.exists()
        && let Some(h) = head
    {
        git(root, &["read-tree", h], &env)?;
    }
    git(root, &["add", "-A", "--", "."], &env)?;
    if follow {
        let staged = git(root, &["ls-files", "-s", "-z"], &env)?;
        let links: Vec<String> = staged
            .split('\0')
            .filter_map(|e| e.strip_prefix("160000 "))
            .filter_map(|e| e.split_once('\t').map(|(_, path)| path.to_owned()))
            .collect();
        for path in links {
            let sub = root.join(&path);
            let top = git(&sub, &["rev-parse", "--show-toplevel"], &[]).ok();
            let checked_out =
                top.is_some_and(|t| Path::new(&t).canonicalize().ok() == sub.canonicalize().ok());
            if !checked_out {
                followed.skipped.push(format!("{prefix}{path}"));
                continue;
            }
            let objects = PathBuf::from(git(
                &sub,
                &[
                    "rev-parse",
                    "--path-format=absolute",
                    "--git-path",
                    "objects",
                ],
                &[],
            )?);
            if objects.to_string_lossy().contains(':') {
                return Err(Problem::invalid(format!(
                    "submodule {prefix}{path}: its objects are at {}, a path with ':' that git cannot be pointed at; launch without --submodules",
                    objects.display()
                )));
            }
            followed.alternates.push(objects);
            let sub_head = git(&sub, &["rev-parse", "--verify", "-q", "HEAD^{commit}"], &[]).ok();
            let tree = working_tree(
                &sub,
                sub_head.as_deref(),
                true,
                &format!("{prefix}{path}/"),
                followed,
            )?;
            let alts = alternates_env(&followed.alternates);
            let mut env2: Vec<(&str, &str)> = env.to_vec();
            env2.extend(alts.iter().map(|(k, v)| (*k, v.as_str())));
            git(
                root,
                &["update-index", "--force-remove", "--", &path],
                &env2,
            )?;
            git(
                root,
                &["read-tree", &format!("--prefix={path}/"), &tree],
                &env2,
            )?;
            followed.paths.push(format!("{prefix}{path}"));
        }
    }
    let alts = alternates_env(&followed.alternates);
    let mut env2: Vec<(&str, &str)> = env.to_vec();
    env2.extend(alts.iter().map(|(k, v)| (*k, v.as_str())));
    git(root, &["write-tree"], &env2)
}

/// The snapshot of the repository holding `cwd`; `None` outside a repository.
pub fn snapshot(cwd: &Path) -> Result<Option<Snapshot>, Problem> {
    snapshot_with(cwd, false)
}

/// [`snapshot`]; with `submodules`, checked-out submodules travel as plain files.
pub fn snapshot_with(cwd: &Path, submodules: bool) -> Result<Option<Snapshot>, Problem> {
    let Ok(root) = git(cwd, &["rev-parse", "--show-toplevel"], &[]) else {
        return Ok(None);
    };
    let root = PathBuf::from(root);
    let head = git(
        &root,
        &["rev-parse", "--verify", "-q", "HEAD^{commit}"],
        &[],
    )
    .ok();
    let branch = git(&root, &["symbolic-ref", "-q", "--short", "HEAD"], &[]).ok();
    let mut followed = Followed::default();
    let tree = working_tree(&root, head.as_deref(), submodules, "", &mut followed)?;
    let alts = alternates_env(&followed.alternates);
    let alts: Vec<(&str, &str)> = alts.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let commit = match &head {
        Some(h) if git(&root, &["rev-parse", &format!("{h}^{{tree}}")], &[])? == tree => h.clone(),
        _ => {
            // HEAD's date (or the epoch), so the same tree on the same HEAD is the same commit.
            let date = match &head {
                Some(h) => git(&root, &["log", "-1", "--format=%ct +0000", h], &[])?,
                None => "0 +0000".to_owned(),
            };
            let date = format!("@{date}");
            let mut ident = vec![
                ("GIT_AUTHOR_NAME", "flotilla"),
                ("GIT_AUTHOR_EMAIL", "flotilla@localhost"),
                ("GIT_COMMITTER_NAME", "flotilla"),
                ("GIT_COMMITTER_EMAIL", "flotilla@localhost"),
                ("GIT_AUTHOR_DATE", date.as_str()),
                ("GIT_COMMITTER_DATE", date.as_str()),
            ];
            ident.extend(alts.iter().copied());
            let mut args = vec![
                "commit-tree",
                tree.as_str(),
                "-m",
                "flotilla: snapshot of the working tree",
            ];
            if let Some(h) = &head {
                args.extend(["-p", h.as_str()]);
            }
            git(&root, &args, &ident)?
        }
    };
    // Every clone of one project shares its root commit, and so its objects in the store.
    let first = match &head {
        Some(h) => git(&root, &["rev-list", "--max-parents=0", h], &[])?
            .lines()
            .min()
            .unwrap_or_default()
            .to_owned(),
        None => commit.clone(),
    };
    let repo = hex::encode(&Sha256::digest(first.as_bytes())[..16]);
    let origin = match (&branch, &head) {
        (_, None) => format!("{} (no commits yet)", root.display()),
        (Some(b), Some(_)) => format!("{} ({b})", root.display()),
        (None, Some(h)) => format!("{} (detached at {})", root.display(), &h[..h.len().min(12)]),
    };
    Ok(Some(Snapshot {
        root,
        repo,
        commit,
        head,
        origin,
        submodules: followed.paths,
        skipped: followed.skipped,
        alternates: followed.alternates,
    }))
}

/// What a user should know about how a snapshot travels (each said once per launch).
pub fn notes(s: &Snapshot) -> Vec<String> {
    notes_at(&s.root, &s.submodules, &s.skipped)
}

/// Submodules are recorded by commit and not sent (or, followed, travel as plain files),
/// Git LFS files travel as their pointers.
fn notes_at(root: &Path, followed: &[String], skipped: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    if !followed.is_empty() {
        out.push(format!(
            "submodules {} travel as plain files (--submodules); `flotilla apply --merge` keeps your submodule links and leaves agents' edits inside them on the run's head branch",
            followed.join(", ")
        ));
    }
    if !skipped.is_empty() {
        out.push(format!(
            "submodules {} are not checked out here, so they are recorded by their commit only",
            skipped.join(", ")
        ));
    }
    if followed.is_empty() && skipped.is_empty() && root.join(".gitmodules").is_file() {
        out.push("submodules are recorded by their commit and not sent: their directories are empty on the workers (pass --submodules to send them)".to_owned());
    }
    let lfs = git(
        root,
        &[
            "ls-files",
            "--",
            ":(glob)**/.gitattributes",
            ".gitattributes",
        ],
        &[],
    )
    .unwrap_or_default()
    .lines()
    .any(|f| std::fs::read_to_string(root.join(f)).is_ok_and(|t| t.contains("filter=lfs")));
    if lfs {
        out.push(
            "Git LFS files travel as their pointers: the workers do not fetch LFS objects"
                .to_owned(),
        );
    }
    out
}

/// What an upload did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Uploaded {
    pub bytes: u64,
    pub objects: u64,
}

/// The first-parent ancestors of `commit` to ask the store about, nearest first.
fn candidates(s: &Snapshot) -> Result<Vec<String>, Problem> {
    let mut out = vec![s.commit.clone()];
    if let Some(h) = &s.head {
        let listed = git(
            &s.root,
            &[
                "rev-list",
                "--first-parent",
                &format!("--max-count={ANCESTORS}"),
                h,
            ],
            &[],
        )?;
        out.extend(listed.lines().map(str::to_owned));
    }
    out.dedup();
    Ok(out)
}

/// Sends what the store lacks of `s` to the sources of `namespace` (empty: the certificate's
/// first, where the launch goes too); refuses a pack larger than `max` bytes before sending
/// any of it.
pub async fn upload(
    client: &mut v1::client_service_client::ClientServiceClient<tonic::transport::Channel>,
    s: &Snapshot,
    max: u64,
    namespace: &str,
) -> Result<Uploaded, Problem> {
    // What the coordinator answered (or that it was not reached), with what was being done.
    let call_failed =
        |doing: &str, e: &tonic::Status| crate::client::call_problem(e).context(doing);
    let asked = candidates(s)?;
    let held = client
        .source_have(v1::SourceHaveRequest {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            repo: s.repo.clone(),
            commits: asked,
            namespace: namespace.to_owned(),
        })
        .await
        .map_err(|e| call_failed("cannot ask the coordinator about the source", &e))?
        .into_inner()
        .held;
    if held.contains(&s.commit) {
        return Ok(Uploaded::default());
    }
    // One pack of everything the store lacks.
    let (tmp, bytes) = build_pack(s, &held)?;
    if bytes > max {
        return Err(Problem::invalid(format!(
            "the repository's objects to send are {} MiB, more than --max-source ({} MiB); raise --max-source, or pass --source none (or --source git+URL#REF for one the workers can fetch)",
            bytes >> 20,
            max >> 20
        )));
    }
    let mut file = std::fs::File::open(tmp.path())
        .map_err(|e| Problem::internal(format!("cannot read the pack: {e}")))?;
    let objects = {
        use std::io::Read;
        let mut header = [0u8; 12];
        file.read_exact(&mut header)
            .map(|()| pack_objects(&header))
            .unwrap_or(0)
    };
    let also: Vec<String> = s.head.iter().filter(|h| **h != s.commit).cloned().collect();
    let (repo, tip, namespace) = (s.repo.clone(), s.commit.clone(), namespace.to_owned());
    let chunks = bytes.div_ceil(CHUNK as u64).max(1);
    // Read lazily, a chunk per message: the pack is never whole in memory.
    let msgs = (0..chunks).map(move |i| {
        use std::io::{Read, Seek, SeekFrom};
        let mut data = Vec::with_capacity(CHUNK);
        let _ = file
            .seek(SeekFrom::Start(i * CHUNK as u64))
            .and_then(|_| (&mut file).take(CHUNK as u64).read_to_end(&mut data));
        let first = i == 0;
        v1::SourceUpload {
            repo: if first { repo.clone() } else { String::new() },
            tip: if first { tip.clone() } else { String::new() },
            also: if first { also.clone() } else { Vec::new() },
            prerequisites: if first { held.clone() } else { Vec::new() },
            total_bytes: bytes,
            data,
            namespace: if first {
                namespace.clone()
            } else {
                String::new()
            },
        }
    });
    client
        .put_source(tokio_stream::iter(msgs))
        .await
        .map_err(|e| call_failed("cannot upload the source", &e))?;
    drop(tmp);
    Ok(Uploaded { bytes, objects })
}

/// One pack of `s.commit` and everything it needs that `held` does not have: a temporary
/// file and its size.
pub fn build_pack(
    s: &Snapshot,
    held: &[String],
) -> Result<(tempfile::NamedTempFile, u64), Problem> {
    let mut revs = format!("{}\n", s.commit);
    for h in held {
        revs.push_str(&format!("^{h}\n"));
    }
    let tmp = tempfile::NamedTempFile::new()
        .map_err(|e| Problem::internal(format!("cannot make a temporary file: {e}")))?;
    let mut child = Command::new("git")
        .arg("-C")
        .arg(&s.root)
        .envs(s.env())
        .args([
            "pack-objects",
            "--revs",
            "--stdout",
            "--delta-base-offset",
            "-q",
        ])
        .stdin(Stdio::piped())
        .stdout(tmp.reopen().map_err(|e| Problem::internal(e.to_string()))?)
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Problem::internal(format!("cannot run git pack-objects: {e}")))?;
    {
        use std::io::Write;
        let mut stdin = child
            .stdin
            .take()
            .ok_or(Problem::internal("git pack-objects has no stdin"))?;
        stdin
            .write_all(revs.as_bytes())
            .map_err(|e| Problem::internal(format!("cannot feed git pack-objects: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Problem::internal(e.to_string()))?;
    if !out.status.success() {
        return Err(Problem::internal(format!(
            "git pack-objects failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let bytes = std::fs::metadata(tmp.path())
        .map_err(|e| Problem::internal(e.to_string()))?
        .len();
    Ok((tmp, bytes))
}

/// The object count in a pack's header (`PACK`, version, count).
fn pack_objects(data: &[u8]) -> u64 {
    match data.get(8..12) {
        Some(b) => u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])),
        None => 0,
    }
}

/// What `--source` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// The repository the launch runs in (none outside one).
    Auto,
    None,
    /// `git+URL#REF`.
    Url {
        url: String,
        rev: String,
    },
}

pub fn parse_choice(s: Option<&str>) -> Result<Choice, Problem> {
    match s {
        None | Some("auto" | "snapshot") => Ok(Choice::Auto),
        Some("none") => Ok(Choice::None),
        Some(other) => {
            let rest = other.strip_prefix("git+").ok_or_else(|| {
                Problem::invalid(format!("--source {other:?}: use auto (the repository you launch from), none, or git+URL#REF"))
            })?;
            let (url, rev) = rest.split_once('#').unwrap_or((rest, "HEAD"));
            if url.is_empty() || rev.is_empty() || rev.starts_with('-') {
                return Err(Problem::invalid(format!(
                    "--source {other:?}: give git+URL#REF, e.g. git+https://host/repo.git#main"
                )));
            }
            // What the workers' git would refuse (or misread) is refused here, at once; the
            // coordinator checks the same, and whether it takes paths on the workers' disks.
            if let Err(e) = SourceRef::fetch_from(url) {
                return Err(Problem::invalid(format!("--source {other:?}: {e}")));
            }
            Ok(Choice::Url {
                url: url.to_owned(),
                rev: rev.to_owned(),
            })
        }
    }
}

/// A URL source as the run records it.
pub fn url_source(url: &str, rev: &str) -> SourceRef {
    SourceRef {
        repo: SourceRef::url_repo(url),
        commit: rev.to_owned(),
        url: Some(url.to_owned()),
        origin: format!("{url}#{rev}"),
        submodules: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn sh(dir: &Path, args: &[&str]) -> String {
        git(
            dir,
            args,
            &[
                ("GIT_AUTHOR_NAME", "t"),
                ("GIT_AUTHOR_EMAIL", "t@t"),
                ("GIT_COMMITTER_NAME", "t"),
                ("GIT_COMMITTER_EMAIL", "t@t"),
            ],
        )
        .unwrap()
    }

    #[test]
    fn the_snapshot_holds_uncommitted_and_untracked_files_and_touches_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        sh(dir, &["init", "-q", "-b", "main"]);
        std::fs::write(dir.join("a.txt"), "one\n").unwrap();
        std::fs::write(dir.join(".gitignore"), "*.log\n").unwrap();
        sh(dir, &["add", "."]);
        sh(dir, &["commit", "-q", "-m", "one"]);
        let head = sh(dir, &["rev-parse", "HEAD"]);
        // Clean: the snapshot is HEAD.
        let s = snapshot(dir).unwrap().unwrap();
        assert_eq!(s.commit, head);
        std::fs::write(dir.join("a.txt"), "two\n").unwrap();
        std::fs::write(dir.join("new.txt"), "new\n").unwrap();
        std::fs::write(dir.join("noise.log"), "x\n").unwrap();
        let status_before = sh(dir, &["status", "--porcelain"]);
        let s = snapshot(dir).unwrap().unwrap();
        assert_ne!(s.commit, head);
        assert_eq!(sh(dir, &["show", &format!("{}:a.txt", s.commit)]), "two");
        assert_eq!(sh(dir, &["show", &format!("{}:new.txt", s.commit)]), "new");
        assert!(git(dir, &["show", &format!("{}:noise.log", s.commit)], &[]).is_err());
        assert_eq!(sh(dir, &["rev-parse", &format!("{}^", s.commit)]), head);
        // Nothing of the user's changed: index, refs, tree.
        assert_eq!(sh(dir, &["status", "--porcelain"]), status_before);
        assert_eq!(sh(dir, &["rev-parse", "HEAD"]), head);
        // The same tree again is the same commit.
        assert_eq!(snapshot(dir).unwrap().unwrap().commit, s.commit);
        assert!(s.origin.ends_with("(main)"), "{}", s.origin);
    }

    #[test]
    fn a_repository_with_no_commits_and_no_repository_at_all() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(snapshot(tmp.path()).unwrap(), None);
        sh(tmp.path(), &["init", "-q"]);
        std::fs::write(tmp.path().join("f"), "x").unwrap();
        let s = snapshot(tmp.path()).unwrap().unwrap();
        assert_eq!(s.head, None);
        assert_eq!(sh(tmp.path(), &["show", &format!("{}:f", s.commit)]), "x");
        assert!(s.origin.contains("no commits yet"));
    }

    #[test]
    fn submodules_and_lfs_are_said() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        sh(dir, &["init", "-q"]);
        assert!(notes_at(dir, &[], &[]).is_empty());
        std::fs::write(
            dir.join(".gitattributes"),
            "*.bin filter=lfs diff=lfs merge=lfs -text\n",
        )
        .unwrap();
        std::fs::write(
            dir.join(".gitmodules"),
            "[submodule \"x\"]\n\tpath = x\n\turl = ../x\n",
        )
        .unwrap();
        sh(dir, &["add", "."]);
        let n = notes_at(dir, &[], &[]);
        assert_eq!(n.len(), 2, "{n:?}");
        assert!(n[0].contains("submodules") && n[1].contains("LFS"));
    }

    #[test]
    fn source_choices_parse_and_say_what_is_wrong() {
        assert_eq!(parse_choice(None).unwrap(), Choice::Auto);
        assert_eq!(parse_choice(Some("none")).unwrap(), Choice::None);
        assert_eq!(
            parse_choice(Some("git+https://h/r.git#v1")).unwrap(),
            Choice::Url {
                url: "https://h/r.git".into(),
                rev: "v1".into()
            }
        );
        assert!(
            parse_choice(Some("elsewhere"))
                .unwrap_err()
                .message
                .contains("git+URL#REF")
        );
        assert!(parse_choice(Some("git+u#--upload-pack=x")).is_err());
        for (bad, says) in [
            ("git+ftp://h/r.git#main", "not ftp://"),
            ("git+ext::sh -c id#main", "remote helper"),
            ("git+fd::3#main", "remote helper"),
            ("git+--upload-pack=touch /tmp/x#main", "starts with -"),
            ("git+ssh://-oProxyCommand=id/r#main", "host"),
            ("git+-oProxyCommand=id:r#main", "starts with -"),
            ("git+https://h/r\u{7}.git#main", "control character"),
        ] {
            let e = parse_choice(Some(bad)).unwrap_err();
            assert!(
                e.message.contains(says) && e.message.contains("cannot be fetched"),
                "{bad}: {e}"
            );
        }
        assert!(parse_choice(Some("git+file:///srv/r.git#main")).is_ok());
    }
}
