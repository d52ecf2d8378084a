//! The server roles of the `flotilla` binary: `flotilla coordinator`, `flotilla worker` and
//! `flotilla ui` (the pages over a store, on loopback).
//! The first two take their settings in layers — the config file, then the environment, then flags — into
//! one settings type that is checked before anything starts.

pub mod coordinator;
pub mod ui;
pub mod worker;

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "worker".into())
}

pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// What the roles' tests parse their settings from.
#[cfg(test)]
pub(crate) mod testing {
    use clap::Parser;

    #[derive(Parser)]
    struct Cli<T: clap::Args> {
        #[command(flatten)]
        role: T,
    }

    /// A role's flags as clap reads them (the environment of this process included).
    pub fn args<T: clap::Args>(flags: &[&str]) -> T {
        Cli::<T>::try_parse_from(std::iter::once("flotilla").chain(flags.iter().copied()))
            .expect("flags parse")
            .role
    }

    /// A config file's settings.
    pub fn file(toml: &str) -> crate::config::ConfigFile {
        toml::from_str(toml).expect("a config file")
    }
}
