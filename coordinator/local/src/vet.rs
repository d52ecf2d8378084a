//! Checks on git objects that come from outside: an agent's change (through its worker's
//! outcome) before it enters a run's head, and a run's commits before `flotilla apply` brings
//! them into the user's repository.
//!
//! Two layers, both needed: git's own fsck while a pack is indexed ([`CHANGE_FSCK`] for an
//! agent's pack: every warning an error, links checked; [`SOURCE_FSCK`] for a user's own
//! history: the name checks as errors, old identity and date quirks let through), and
//! [`new_trees`], which reads every tree a commit adds over its base and refuses a name that
//! git would take as a path out of the tree or into `.git` on some system ([`refused_name`]):
//! fsck lets a backslash through, and `git checkout` on Windows reads one as a separator.
//!
//! This is a leaf: it knows git and paths, nothing of runs or stores.

use flotilla_proto::Problem;
use std::ffi::OsStr;
use std::path::Path;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

/// `git index-pack` flag for a pack an agent's worker made: git's fsck with warnings as
/// errors (`.git`, `..`, `.`, empty and full-path names among them) and every link checked.
pub const CHANGE_FSCK: &str = "--strict";

/// `git index-pack` flag for a pack of a user's own history: fsck's name checks as errors,
/// and malformed identities and dates (which old histories carry, and which harm nobody)
/// let through.
pub const SOURCE_FSCK: &str = "--fsck-objects=hasDot=error,hasDotdot=error,hasDotgit=error,emptyName=error,fullPathname=error,badDate=warn,badDateOverflow=warn,badEmail=warn,badName=warn,badTimezone=warn,missingEmail=warn,missingNameBeforeEmail=warn,missingSpaceBeforeDate=warn,missingSpaceBeforeEmail=warn,zeroPaddedDate=warn";

/// Code points HFS+ ignores in names (so `.g\u{200c}it` is `.git` there).
fn hfs_ignored(c: char) -> bool {
    matches!(c, '\u{200c}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{206a}'..='\u{206f}' | '\u{feff}')
}

/// Why a tree entry named `name` may not enter a run's head or a user's repository; `None`
/// when it may.
pub fn refused_name(name: &[u8]) -> Option<&'static str> {
    if name.is_empty() {
        return Some("an empty name");
    }
    if name == b"." || name == b".." {
        return Some("a `.` or `..` name");
    }
    if name.contains(&b'/') {
        return Some("a name with a slash");
    }
    if name.contains(&b'\\') {
        return Some("a name with a backslash");
    }
    let text = String::from_utf8_lossy(name).to_lowercase();
    // NTFS drops trailing dots and spaces, takes `git~1` as the short name of `.git`, and
    // `.git::$INDEX_ALLOCATION` (an alternate stream) as the directory itself.
    let ntfs = text.trim_end_matches([' ', '.']);
    let ntfs = ntfs.split(':').next().unwrap_or(ntfs);
    let hfs: String = text.chars().filter(|c| !hfs_ignored(*c)).collect();
    if ntfs == ".git" || ntfs == "git~1" || hfs == ".git" {
        return Some("a name git reads as `.git`");
    }
    None
}

/// What is wrong with one raw tree object, if anything: the first refused entry.
fn check_tree(body: &[u8], oid_len: usize) -> Option<String> {
    let mut rest = body;
    while !rest.is_empty() {
        let Some(space) = rest.iter().position(|b| *b == b' ') else {
            return Some("a tree git cannot read".into());
        };
        let after = &rest[space + 1..];
        let Some(nul) = after.iter().position(|b| *b == 0) else {
            return Some("a tree git cannot read".into());
        };
        let name = &after[..nul];
        if let Some(why) = refused_name(name) {
            return Some(format!(
                "{why} ({:?})",
                String::from_utf8_lossy(name)
                    .chars()
                    .take(80)
                    .collect::<String>()
            ));
        }
        let Some(next) = after.get(nul + 1 + oid_len..) else {
            return Some("a tree git cannot read".into());
        };
        rest = next;
    }
    None
}

/// Every tree that `commit` has and `base` (commits, none for all) has not, in the repository
/// at `dir` (with `env`, say a quarantine's object directories), entry by entry: `Some(why)`
/// names the first refused entry and its tree. `Err`: git could not be asked.
pub async fn new_trees(
    dir: &Path,
    env: &[(&str, &OsStr)],
    commit: &str,
    base: &[&str],
) -> Result<Option<String>, Problem> {
    let listed = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args([
            "rev-list",
            "--objects",
            "--no-object-names",
            "--filter=object:type=tree",
            commit,
            "--not",
        ])
        .args(base)
        .envs(env.iter().copied())
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .await
        .map_err(|e| Problem::internal(format!("cannot run git: {e}")))?;
    if !listed.status.success() {
        return Err(Problem::internal(format!(
            "git rev-list {commit}: {}",
            String::from_utf8_lossy(&listed.stderr).trim()
        )));
    }
    check_trees(dir, env, listed.stdout, commit.len() / 2).await
}

/// `git index-pack` flag for a pack checked on its own (its base is not at hand): git's fsck
/// with every warning an error, links not followed.
const PACK_FSCK: &str = "--fsck-objects=emptyName=error,fullPathname=error,hasDot=error,hasDotdot=error,hasDotgit=error,nulInCommit=error,nulInHeader=error,zeroPaddedFilemode=error";

/// Why the objects of `pack` (an agent's, whose base is not at hand) may not be kept, if they
/// may not: git's fsck of each object, then every tree in it entry by entry. Indexed into a
/// scratch repository of its own, which goes with it. `Err`: git could not be asked.
pub async fn pack_alone(pack: &[u8]) -> Result<Option<String>, Problem> {
    let tmp = tempfile::tempdir()
        .map_err(|e| Problem::internal(format!("cannot make a scratch repository: {e}")))?;
    let dir = tmp.path();
    let git = |args: &[&str]| {
        let mut cmd = Command::new("git");
        cmd.arg("-C").arg(dir).args(args);
        cmd
    };
    let made = git(&["init", "--bare", "-q"])
        .output()
        .await
        .map_err(|e| Problem::internal(format!("cannot run git: {e}")))?;
    if !made.status.success() {
        return Err(Problem::internal(
            String::from_utf8_lossy(&made.stderr).trim().to_owned(),
        ));
    }
    let file = dir.join("incoming.pack");
    std::fs::write(&file, pack).map_err(|e| Problem::internal(e.to_string()))?;
    let indexed = git(&["index-pack", PACK_FSCK, "--stdin"])
        .stdin(std::fs::File::open(&file).map_err(|e| Problem::internal(e.to_string()))?)
        .output()
        .await
        .map_err(|e| Problem::internal(format!("cannot run git: {e}")))?;
    if !indexed.status.success() {
        return Ok(Some(format!(
            "git's fsck refused its objects: {}",
            first_error(&indexed.stderr)
        )));
    }
    let listed = git(&[
        "cat-file",
        "--batch-all-objects",
        "--batch-check=%(objecttype) %(objectname)",
    ])
    .output()
    .await
    .map_err(|e| Problem::internal(format!("cannot run git: {e}")))?;
    let mut trees = Vec::new();
    let mut oid_len = 20;
    for line in String::from_utf8_lossy(&listed.stdout).lines() {
        if let Some(oid) = line.strip_prefix("tree ") {
            oid_len = oid.len() / 2;
            trees.extend_from_slice(oid.as_bytes());
            trees.push(b'\n');
        }
    }
    Ok(check_trees(dir, &[], trees, oid_len)
        .await?
        .map(|why| format!("it adds {why}")))
}

/// The line of git's complaint worth showing (its first `error:` line, else its first).
pub fn first_error(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    text.lines()
        .find(|l| l.starts_with("error:"))
        .or_else(|| text.lines().next())
        .unwrap_or("")
        .trim()
        .chars()
        .take(300)
        .collect()
}

/// Reads the objects `ids` names (one per line) with `git cat-file --batch`, one at a time,
/// and checks each tree among them.
async fn check_trees(
    dir: &Path,
    env: &[(&str, &OsStr)],
    ids: Vec<u8>,
    oid_len: usize,
) -> Result<Option<String>, Problem> {
    let mut cat = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["cat-file", "--batch"])
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Problem::internal(format!("cannot run git: {e}")))?;
    let (Some(mut stdin), Some(stdout)) = (cat.stdin.take(), cat.stdout.take()) else {
        return Err(Problem::internal("git cat-file has no pipes"));
    };
    let writer = tokio::spawn(async move {
        let _ = stdin.write_all(&ids).await;
    });
    let mut out = tokio::io::BufReader::new(stdout);
    let mut found = None;
    loop {
        let mut header = String::new();
        if out
            .read_line(&mut header)
            .await
            .map_err(|e| Problem::internal(e.to_string()))?
            == 0
        {
            break;
        }
        let mut parts = header.split_whitespace();
        let (Some(oid), Some(kind), Some(size)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(Problem::internal(format!(
                "git cat-file answered {header:?}"
            )));
        };
        let size: usize = size
            .parse()
            .map_err(|_| Problem::internal(format!("git cat-file answered {header:?}")))?;
        let mut body = vec![0u8; size + 1];
        out.read_exact(&mut body)
            .await
            .map_err(|e| Problem::internal(e.to_string()))?;
        body.pop();
        if kind == "tree"
            && let Some(why) = check_tree(&body, oid_len)
        {
            found = Some(format!("tree {} holds {why}", &oid[..oid.len().min(12)]));
            break;
        }
    }
    writer.abort();
    let _ = cat.kill().await;
    Ok(found)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn names_that_leave_the_tree_or_reach_git_s_own_directory_are_refused() {
        for bad in [
            &b""[..],
            b".",
            b"..",
            b"a/b",
            b"/etc",
            b"a\\b",
            b"..\\..\\x",
            b".git",
            b".GIT",
            b".Git",
            b".git.",
            b".git  ",
            b".git. . ",
            b"git~1",
            b"GIT~1",
            b".git::$INDEX_ALLOCATION",
            ".g\u{200c}it".as_bytes(),
            "\u{feff}.git".as_bytes(),
        ] {
            assert!(
                refused_name(bad).is_some(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        for fine in [
            &b"a.txt"[..],
            b".gitignore",
            b".github",
            b"git",
            b"...",
            b".git~1",
            b"x.git",
            "héllo".as_bytes(),
        ] {
            assert_eq!(
                refused_name(fine),
                None,
                "{:?}",
                String::from_utf8_lossy(fine)
            );
        }
    }

    fn git(dir: &Path, args: &[&str], input: &[u8]) -> String {
        use std::io::Write;
        let mut child = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(["-c", "user.name=t", "-c", "user.email=t@t"])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "git {args:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// A pack checked on its own: git's fsck refuses `.git` and `..`, the name check a
    /// backslash, garbage is refused, and a plain commit's objects pass.
    #[tokio::test]
    async fn a_pack_alone_is_checked_object_by_object() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        git(dir, &["init", "-q"], b"");
        let blob = git(dir, &["hash-object", "-w", "--stdin"], b"x\n");
        for (name, why) in [
            (".git", "fsck"),
            ("..", "fsck"),
            ("GIT~1", "fsck"),
            ("a\\b", "backslash"),
            ("fine.txt", ""),
        ] {
            let tree = git(
                dir,
                &["mktree"],
                format!("100644 blob {blob}\t{name}\n").as_bytes(),
            );
            let commit = git(dir, &["commit-tree", &tree, "-m", name], b"");
            let pack = git_pack(dir, &commit);
            let got = pack_alone(&pack).await.unwrap();
            if why.is_empty() {
                assert_eq!(got, None, "{name}");
            } else {
                let got = got.unwrap_or_default();
                assert!(got.contains(why), "{name}: {got}");
            }
        }
        let got = pack_alone(b"PACK and then nothing git can read")
            .await
            .unwrap();
        assert!(got.unwrap_or_default().contains("fsck"));
    }

    fn git_pack(dir: &Path, commit: &str) -> Vec<u8> {
        use std::io::Write;
        let mut child = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(["pack-objects", "--revs", "--stdout", "-q"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(format!("{commit}\n").as_bytes())
            .unwrap();
        child.wait_with_output().unwrap().stdout
    }

    #[test]
    fn a_raw_tree_is_read_entry_by_entry() {
        let oid = [7u8; 20];
        let mut tree = Vec::new();
        let mut first = 0;
        for name in ["a.txt", "b\\c"] {
            tree.extend_from_slice(format!("100644 {name}\0").as_bytes());
            tree.extend_from_slice(&oid);
            first = if first == 0 { tree.len() } else { first };
        }
        let why = check_tree(&tree, 20).unwrap();
        assert!(why.contains("backslash") && why.contains("b\\\\c"), "{why}");
        assert_eq!(check_tree(&tree[..first], 20), None);
        assert!(check_tree(&tree[..10], 20).unwrap().contains("cannot read"));
    }
}
