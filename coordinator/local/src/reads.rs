//! Reads from the outside world, each with a limit named in its error.
//!
//! Scripts, `args`, config files and agent definitions come from paths a user (or a script,
//! through `workflow({ scriptPath })`) names; any of them can be `/dev/zero`, a FIFO nobody
//! writes, or a gigabyte log. [`read_file`] refuses devices outright (W10) and stops reading
//! one byte past the limit, so no read can exhaust the host.

use flotilla_proto::Problem;
use std::io::Read;
use std::path::Path;

/// A script, in bytes (W01 limits it to 524,288 characters; UTF-8 is at most 4 bytes each,
/// and the character count is checked again when it is prepared).
pub const SCRIPT_BYTES: usize = 4 * flotilla_script::text::MAX_SCRIPT_CHARS;
/// `args` given as a file.
pub const ARGS_BYTES: usize = 16 << 20;
/// A config file or an agent definition (`.claude/agents/*.md`).
pub const SMALL_FILE_BYTES: usize = 1 << 20;
/// A launch's run settings as JSON: what a config file of [`SMALL_FILE_BYTES`] and flags make.
pub const SETTINGS_BYTES: usize = SMALL_FILE_BYTES;
/// What a launch carries besides its script, args and settings, all together: the saved
/// workflows and agent types the launching client can see, with their definitions.
pub const CARRIED_BYTES: usize = 8 << 20;
/// How many workflows and agent types one launch carries.
pub const CARRIED_ITEMS: usize = 1024;
/// A name, model, path or other short text in a request.
pub const TEXT_BYTES: usize = 4096;
/// A whole launch request: each part at its limit, and a mebibyte for the rest.
pub const LAUNCH_BYTES: usize =
    SCRIPT_BYTES + ARGS_BYTES + SETTINGS_BYTES + CARRIED_BYTES + (1 << 20);
/// Any other request a client sends: a source chunk (1 MiB) with its commit lists, a pushed
/// workflow ([`SCRIPT_BYTES`]), a run filter.
pub const REQUEST_BYTES: usize = 4 << 20;

/// A size people read: `512 KiB`, `16 MiB`.
pub fn human_bytes(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} bytes")
    }
}

/// A measured size people read, exact and rounded: `17825792 bytes (17.0 MiB)`.
pub fn measured(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{n} bytes ({:.1} MiB)", n as f64 / f64::from(1u32 << 20))
    } else if n >= 1 << 10 {
        format!("{n} bytes ({:.1} KiB)", n as f64 / 1024.0)
    } else {
        format!("{n} bytes")
    }
}

/// Reads `path` as UTF-8 text of at most `limit` bytes; `what` names it in errors ("script",
/// "--args-file"). Character and block devices are refused; a FIFO is read up to the limit.
pub fn read_file(path: &Path, limit: usize, what: &str) -> Result<String, Problem> {
    use std::os::unix::fs::FileTypeExt;
    let shown = path.display();
    let meta = std::fs::metadata(path)
        .map_err(|e| Problem::invalid(format!("cannot read {what} {shown}: {e}")))?;
    let ft = meta.file_type();
    if ft.is_char_device() || ft.is_block_device() {
        return Err(Problem::invalid(format!(
            "{what} {shown} is a device, not a file; pass the path of a file"
        )));
    }
    if ft.is_dir() {
        return Err(Problem::invalid(format!(
            "{what} {shown} is a directory, not a file"
        )));
    }
    if meta.len() > limit as u64 {
        return Err(Problem::invalid(too_big(what, &shown, limit)));
    }
    let file = std::fs::File::open(path)
        .map_err(|e| Problem::invalid(format!("cannot read {what} {shown}: {e}")))?;
    let mut bytes = Vec::new();
    file.take(limit as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Problem::invalid(format!("cannot read {what} {shown}: {e}")))?;
    if bytes.len() > limit {
        return Err(Problem::invalid(too_big(what, &shown, limit)));
    }
    String::from_utf8(bytes)
        .map_err(|e| Problem::invalid(format!("{what} {shown} is not UTF-8 text: {e}")))
}

fn too_big(what: &str, shown: &std::path::Display<'_>, limit: usize) -> String {
    format!(
        "{what} {shown} is larger than the limit of {}; pass a smaller file",
        human_bytes(limit)
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn devices_big_files_and_directories_are_refused_with_the_limit() {
        let e = read_file(Path::new("/dev/zero"), 1024, "script").unwrap_err();
        assert!(e.message.contains("is a device"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.json");
        std::fs::write(&big, vec![b'1'; 2048]).unwrap();
        let e = read_file(&big, 1024, "--args-file").unwrap_err();
        assert!(e.message.contains("larger than the limit of 1 KiB"), "{e}");
        assert_eq!(read_file(&big, 4096, "x").unwrap().len(), 2048);
        let e = read_file(dir.path(), 1024, "script").unwrap_err();
        assert!(e.message.contains("directory"), "{e}");
    }
}
