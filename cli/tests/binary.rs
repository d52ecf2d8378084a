//! Smoke tests of the binary itself. (Their presence also makes cargo build the `flotilla`
//! binary for the workspace test run, which the `flotilla-tests` suite drives.)

use std::process::Command;

#[test]
fn help_lists_the_commands_and_version_prints() {
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("--help")
        .output()
        .expect("run flotilla --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for cmd in ["run", "runs", "show", "bench"] {
        assert!(help.contains(cmd), "--help lacks {cmd}: {help}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("--version")
        .output()
        .expect("run flotilla --version");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("flotilla "));
}

#[test]
fn an_unknown_command_is_a_usage_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("fly")
        .output()
        .expect("run flotilla fly");
    assert_eq!(out.status.code(), Some(2));
}
