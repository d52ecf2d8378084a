//! Names a request carries and what each may look like: source ids, namespaces, webhook
//! URLs. Both ends check them with these (a client before it sends, a server on receipt).

use crate::Problem;

/// Whether a name can name a repository or a commit (hex and a few separators).
pub fn valid_source_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

/// What an operator names for every namespace at once (`--namespace '*'`): a certificate
/// good in all of them, a workflow pushed to the whole fleet.
pub const ALL_NAMESPACES: &str = "*";

/// Whether `name` can name a saved workflow: letters, digits, `-`, `_` and `.`, not starting
/// with a dot, at most 100 characters (so it can never leave its directory).
pub fn valid_workflow_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 100
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Whether a saved workflow's origin (`server:NAME`, `fleet:NAME`) is that of one pushed to
/// the whole fleet.
pub fn pushed_to_fleet(origin: &str) -> bool {
    origin.starts_with("fleet:")
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
    let parsed = url::Url::parse(url).map_err(|e| {
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
