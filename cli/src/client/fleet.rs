//! The client commands on the fleet: `token create` and `workers`.

use std::path::PathBuf;

use clap::Args;
use flotilla_proto::v1::{self};

use crate::client::*;
use crate::{config, fail_kind};

#[derive(Debug, clap::Subcommand)]
pub enum TokenCommand {
    /// Issue a session token to your client certificate and print a sign-in link.
    Create(TokenArgs),
}

#[derive(Debug, Args)]
pub struct TokenArgs {
    /// How long the token lives (at most 30d) [default: 12h].
    #[arg(long)]
    ttl: Option<String>,
    /// Print {token, login_url, subject, expires_unix} as JSON.
    #[arg(long)]
    json: bool,
    /// TOML file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    remote: ClientArgs,
}

impl TokenArgs {
    pub fn json(&self) -> bool {
        self.json
    }
}

impl WorkersArgs {
    pub fn json(&self) -> bool {
        self.json
    }
}

pub async fn token_create(a: TokenArgs) -> i32 {
    let ttl_secs = match a.ttl.as_deref().map(|t| config::parse_duration("--ttl", t)) {
        None => 0,
        Some(Ok(d)) if d.as_secs() > 0 => d.as_secs(),
        Some(Ok(_)) => {
            return fail_kind(
                flotilla_proto::ErrorKind::Invalid,
                "--ttl must be at least 1s; e.g. --ttl 12h",
            );
        }
        Some(Err(e)) => return crate::refuse(e),
    };
    let mut client = match config::load(a.config.as_deref()).and_then(|f| a.remote.client_with(&f))
    {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    match client
        .create_token(v1::CreateTokenRequest { ttl_secs })
        .await
    {
        Ok(r) => {
            let r = r.into_inner();
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"token": r.token, "login_url": r.login_url, "subject": r.subject, "expires_unix": r.expires_unix})
                );
            } else {
                println!("{}", r.login_url);
                eprintln!(
                    "open the link to sign in as {} (or send `Authorization: Bearer <token>`); it expires at {}",
                    r.subject,
                    humantime::format_rfc3339_seconds(
                        std::time::UNIX_EPOCH + std::time::Duration::from_secs(r.expires_unix)
                    )
                );
            }
            0
        }
        Err(s) => rpc_fail(&s),
    }
}

#[derive(Debug, Args)]
pub struct WorkersArgs {
    #[arg(long)]
    json: bool,
    /// TOML file with the same keys as the flags (snake_case).
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    remote: ClientArgs,
}

pub async fn workers(a: WorkersArgs) -> i32 {
    let mut client = match config::load(a.config.as_deref()).and_then(|f| a.remote.client_with(&f))
    {
        Ok(c) => c,
        Err(e) => return crate::refuse(e),
    };
    match client.list_workers(v1::ListWorkersRequest {}).await {
        Ok(r) => {
            let workers = r.into_inner().workers;
            if a.json {
                let v: Vec<serde_json::Value> = workers
                    .iter()
                    .map(|w| serde_json::json!({"name": w.name, "state": if w.attached { "attached" } else { "cut off" }, "slots": w.slots, "busy": w.busy, "backends": w.backends, "models": w.models, "labels": w.labels}))
                    .collect();
                println!("{}", serde_json::Value::Array(v));
            } else if workers.is_empty() {
                eprintln!("no workers attached");
            } else {
                println!(
                    "{:<32} {:<9} {:>5} {:>5}  BACKENDS",
                    "WORKER", "STATE", "SLOTS", "BUSY"
                );
                for w in workers {
                    println!(
                        "{:<32} {:<9} {:>5} {:>5}  {}",
                        w.name,
                        if w.attached { "attached" } else { "cut off" },
                        w.slots,
                        w.busy,
                        w.backends.join(",")
                    );
                }
            }
            0
        }
        Err(s) => rpc_fail(&s),
    }
}
