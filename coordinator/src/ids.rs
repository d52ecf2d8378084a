//! Ids and names: what a run id, a source id, a namespace name and a webhook URL look like.
//!
//! A leaf: it imports nothing of the coordinator, so settings, storage and the faces can all
//! check a name without reaching up into the modules that own those things.

use flotilla_proto::Problem;

/// A new run id: `wf_` + 8 hex + `-` + 3 hex, like Claude Code's (W45).
pub fn new_run_id() -> String {
    let mut b = [0u8; 6];
    if getrandom::fill(&mut b).is_err() {
        // Fall back to the clock and pid; ids only need to be unique, not secret.
        let t = flotilla_proto::clock::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mixed = t ^ (u128::from(std::process::id()) << 64);
        b.copy_from_slice(&mixed.to_le_bytes()[..6]);
    }
    let h = hex::encode(b);
    format!("wf_{}-{}", &h[..8], &h[8..11])
}

/// Whether a name can name a repository or a commit (hex and a few separators).
pub fn valid_source_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

/// The namespace of runs whose caller names none.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Whether `name` can name a namespace: 1 to 63 lower-case letters, digits, `-`, `_` and `.`,
/// starting with a letter or digit.
pub fn valid_namespace(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.'))
}

/// The namespace of a run whose settings name `ns` (runs from before namespaces name none).
pub fn effective_namespace(ns: &str) -> &str {
    if ns.is_empty() { DEFAULT_NAMESPACE } else { ns }
}

/// The longest URL a run may name.
pub const MAX_NOTIFY_URL: usize = 2048;

/// Whether `url` can be a webhook: http or https, with a host, at most [`MAX_NOTIFY_URL`] long.
pub fn check_notify_url(url: &str) -> Result<(), Problem> {
    if url.len() > MAX_NOTIFY_URL {
        return Err(Problem::invalid(format!(
            "the --notify URL is {} characters; at most {MAX_NOTIFY_URL}",
            url.len()
        )));
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| {
        Problem::invalid(format!(
            "--notify {url:?} is not a URL ({e}); e.g. https://hooks.example/flotilla"
        ))
    })?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(Problem::invalid(format!(
            "--notify {url:?} must be an http:// or https:// URL with a host"
        )));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(Problem::invalid(
            "--notify must not carry credentials in its URL (it is stored with the run); the signature authenticates the coordinator",
        ));
    }
    Ok(())
}
