//! Generates the Rust code for `proto/flotilla.proto`.
//!
//! `protoc` comes from the `PROTOC` environment variable when it is set, otherwise from the
//! vendored binary of `protoc-bin-vendored`, so a fresh machine can build without installing
//! anything.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path().map_err(|e| {
            format!("no vendored protoc for this platform ({e}); install protoc and set PROTOC")
        })?;
        // SAFETY of intent: build scripts are single-threaded; tonic-prost-build reads PROTOC.
        unsafe_set_env("PROTOC", protoc);
    }
    println!("cargo:rerun-if-changed=proto/flotilla.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/flotilla.proto"], &["proto"])?;
    Ok(())
}

#[allow(unsafe_code)]
fn unsafe_set_env(key: &str, value: std::path::PathBuf) {
    // `set_var` is unsafe since edition 2024 because other threads may read the environment;
    // a build script has no other threads at this point.
    unsafe { std::env::set_var(key, value) };
}
