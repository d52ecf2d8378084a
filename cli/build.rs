//! Records the git commit the binary is built from (`FLOTILLA_COMMIT`, empty outside a git
//! checkout) for `--version` and the `flotilla_build_info` metrics. Only this leaf crate reads
//! it, so a new commit rebuilds the binary alone.

use std::path::Path;
use std::process::Command;

fn main() {
    let git = Path::new("../.git");
    // HEAD names the branch; the branch's ref (loose or packed) names the commit.
    for watched in ["HEAD", "packed-refs", "refs/heads"] {
        let p = git.join(watched);
        if p.exists() {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    println!("cargo:rustc-env=FLOTILLA_COMMIT={commit}");
}
