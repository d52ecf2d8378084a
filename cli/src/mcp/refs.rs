//! What a `Workflow` call may name, before anything is looked up: a `scriptPath` is text a
//! path can be, and a `name` is a plain workflow name (never a path, never a flag). Where a
//! path may then lead is [`DirResolver::confine_script`]'s rule (the project and the workflow
//! directories), the same `workflow({ scriptPath })` follows in a run.
//!
//! [`DirResolver::confine_script`]: flotilla_local::workflows::DirResolver::confine_script

use flotilla_proto::Problem;

/// The longest path a `scriptPath` may be (Linux's `PATH_MAX`).
const PATH_BYTES: usize = 4096;
/// The longest workflow name.
const NAME_CHARS: usize = 200;

/// The start of what a caller sent, for an error (long text is cut, and `{:?}` escapes the
/// rest).
fn shown(text: &str) -> String {
    let cut: String = text.chars().take(80).collect();
    if cut.len() < text.len() {
        format!("{cut:?}… ({} bytes)", text.len())
    } else {
        format!("{cut:?}")
    }
}

/// Refuses a `scriptPath` no file can have: empty, over [`PATH_BYTES`], or holding a control
/// character (NUL included).
pub(super) fn path_text(p: &str) -> Result<(), Problem> {
    if p.is_empty() || p.len() > PATH_BYTES || p.chars().any(char::is_control) {
        return Err(Problem::invalid(format!(
            "scriptPath {} is not a path: give a .js file of 1 to {PATH_BYTES} bytes without control characters, in the project or a workflow directory",
            shown(p)
        )));
    }
    Ok(())
}

/// A `name` as the saved workflows are looked up by: `/name` (Claude Code's form) or `name`,
/// at most [`NAME_CHARS`] characters, with no `/`, `\`, `..` or control character, not
/// starting with `.` or `-`; plugin workflows are `plugin:name`.
pub(super) fn workflow_name(n: &str) -> Result<String, Problem> {
    let name = n.strip_prefix('/').unwrap_or(n);
    let plain = !name.is_empty()
        && name.chars().count() <= NAME_CHARS
        && !name.starts_with(['.', '-'])
        && !name.contains("..")
        && !name
            .chars()
            .any(|c| c.is_control() || c == '/' || c == '\\');
    if !plain {
        return Err(Problem::invalid(format!(
            "name {} is not a workflow name: a saved workflow's name (WorkflowList shows them) of at most {NAME_CHARS} characters, without / \\ .. or control characters; a script file is given as scriptPath",
            shown(n)
        )));
    }
    Ok(name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_are_plain_and_paths_are_text_a_path_can_be() {
        assert_eq!(workflow_name("/review").unwrap(), "review");
        assert_eq!(
            workflow_name("my-plugin:triage").unwrap(),
            "my-plugin:triage"
        );
        for bad in [
            "",
            "/",
            "../x",
            "a/b",
            "/etc/passwd",
            ".env",
            "-h",
            "a\\b",
            "x\0",
            "x..y",
        ] {
            assert!(workflow_name(bad).is_err(), "{bad:?}");
        }
        assert!(path_text("flows/a.js").is_ok());
        for bad in ["", "a\0b", "a\nb"] {
            assert!(path_text(bad).is_err(), "{bad:?}");
        }
        let e = path_text(&"a".repeat(5000)).unwrap_err();
        assert!(
            e.message.contains("(5000 bytes)") && e.message.len() < 400,
            "{e}"
        );
    }

    proptest! {
        /// Whatever a caller sends, an accepted name cannot reach a file (it has no
        /// separator, no `..`, no leading dot) nor pass for a flag.
        #[test]
        fn an_accepted_name_is_never_a_path_or_a_flag(n in "\\PC{0,40}|[./\\\\a-z:-]{0,12}") {
            if let Ok(name) = workflow_name(&n) {
                prop_assert!(!name.contains('/') && !name.contains('\\') && !name.contains(".."));
                prop_assert!(!name.starts_with('.') && !name.starts_with('-'));
            }
        }
    }
}
