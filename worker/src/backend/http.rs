//! What the HTTP model backends (`anthropic`, `openai`) share: the client, and how a non-200
//! answer becomes a classified failure.

use std::time::Duration;

use flotilla_proto::v1::FailureKind;
use serde_json::Value;

use crate::failure::Error;

/// An HTTP client for a model API.
pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
        .unwrap_or_default()
}

/// The failure a non-200 answer means: 429 and 529 are throttles (the call waits
/// `retry-after`, else the coordinator's backoff, and its account admits fewer), 408/409/5xx
/// retry, anything else is terminal; `key_var` names the credential to check on 401/403.
pub(crate) async fn failure(provider: &str, resp: reqwest::Response, key_var: &str) -> Error {
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs);
    // An error body is for a message: its first 64 KiB are plenty.
    let mut resp = resp;
    let mut raw = Vec::new();
    while raw.len() < 64 << 10 {
        match resp.chunk().await {
            Ok(Some(c)) => raw.extend_from_slice(&c),
            _ => break,
        }
    }
    raw.truncate(64 << 10);
    let body = String::from_utf8_lossy(&raw).into_owned();
    let message = serde_json::from_str::<Value>(&body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_else(|| body.chars().take(300).collect());
    let message = format!("{provider}: HTTP {status}: {message}");
    match status {
        429 | 529 => Error::throttled(retry_after, message),
        401 | 403 => Error::new(
            FailureKind::Terminal,
            format!("{message} (check {key_var} on the worker)"),
        ),
        408 | 409 | 500..=599 => Error::new(FailureKind::Retryable, message),
        _ => Error::new(FailureKind::Terminal, message),
    }
}

/// A streamed event still being read may not grow past [`super::lines::JSON_LINE_BYTES`].
pub(crate) fn check_event_size(provider: &str, buffered: usize) -> Result<(), Error> {
    if buffered <= super::lines::JSON_LINE_BYTES {
        return Ok(());
    }
    Err(Error::new(
        FailureKind::Terminal,
        format!(
            "{provider}: the API sent an event larger than {} MiB without ending it; gave up on this response",
            super::lines::JSON_LINE_BYTES >> 20
        ),
    ))
}
