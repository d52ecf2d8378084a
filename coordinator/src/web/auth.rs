//! Who may see the pages: signed page tokens (HMAC, with an expiry), the login link that
//! turns one into a cookie, and the guard every route goes through.

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::Deserialize;

use super::render::*;
use super::state::{Access, Web};

/// Name of the cookie that carries a session token.
pub const COOKIE: &str = "flotilla_session";

use crate::tokens::now_secs;
pub use crate::tokens::{Claims, MAX_TOKEN_TTL};

/// Name of the cookie that carries a `--serve` page's key.
pub const KEY_COOKIE: &str = "flotilla_key";

/// A random key for a `--serve` page (128 bits, URL-safe).
pub fn new_page_key() -> String {
    let mut b = [0u8; 16];
    if getrandom::fill(&mut b).is_err() {
        // Without entropy the page would be guessable: fail closed to a key nobody has.
        return "unavailable".into();
    }
    URL_SAFE_NO_PAD.encode(b)
}

pub(super) fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// The `Host` check and the page key, before any route (the fleet's tokens are checked by
/// each route).
pub(super) async fn guard(
    State(web): State<Web>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (port, key) = match &web.access {
        Access::Tokens(_) => return next.run(req).await,
        Access::Loopback { port } => (*port, None),
        Access::Keyed { port, key } => (*port, Some(key.clone())),
    };
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let ours = ["127.0.0.1", "localhost", "[::1]"]
        .iter()
        .any(|h| host == format!("{h}:{port}"));
    if !ours {
        let why = format!(
            "this page answers only at http://127.0.0.1:{port} (the request was for host {host:?}): a page on loopback is not served to other names, so a web site cannot reach it"
        );
        return (StatusCode::FORBIDDEN, why).into_response();
    }
    let Some(key) = key else {
        return next.run(req).await;
    };
    let from_query = req.uri().query().and_then(|q| {
        q.split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == "key")
            .map(|(_, v)| v.to_owned())
    });
    let from_cookie = cookie(req.headers(), KEY_COOKIE);
    let from_bearer = token_of(req.headers());
    let given = [&from_query, &from_cookie, &from_bearer];
    if !given
        .iter()
        .any(|k| k.as_deref().is_some_and(|k| same(k, &key)))
    {
        return (
            StatusCode::UNAUTHORIZED,
            "this page needs its key: open the URL `flotilla run --serve` printed (it ends in ?key=…)",
        )
            .into_response();
    }
    let mut resp = next.run(req).await;
    if from_query.is_some() && from_cookie.is_none() {
        let cookie = format!("{KEY_COOKIE}={key}; Path=/; HttpOnly; SameSite=Strict");
        if let Ok(v) = header::HeaderValue::from_str(&cookie) {
            resp.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    resp
}

pub(super) fn token_of(headers: &HeaderMap) -> Option<String> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        && let Some(t) = v.strip_prefix("Bearer ")
    {
        return Some(t.trim().to_owned());
    }
    cookie(headers, COOKIE)
}

/// The value of cookie `name`.
pub(super) fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

/// Why a request is refused; `Ok` when it may go on.
/// The namespaces the request's token shows (all without tokens), or why it has none.
pub(super) fn check(
    web: &Web,
    headers: &HeaderMap,
) -> Result<crate::namespace::Scope, &'static str> {
    let Some(key) = web.access.tokens() else {
        return Ok(crate::namespace::Scope::All);
    };
    let token = token_of(headers).ok_or(
        "sign in first: run `flotilla token create` (with your client certificate) and open the link it prints",
    )?;
    key.verify(&token).map(|c| c.scope())
}

/// Who a request comes from, for the run's log: the name its session token was issued to, or
/// the page itself where no sign-in is asked (loopback).
pub(super) fn who_signed_in(web: &Web, headers: &HeaderMap) -> String {
    web.access
        .tokens()
        .and_then(|key| key.verify(&token_of(headers)?).ok())
        .map_or_else(
            || "the session page".to_owned(),
            |c| format!("{} (session page)", c.sub),
        )
}

pub(super) fn refuse(why: &str, json: bool) -> Response {
    let body = if json {
        serde_json::json!({ "error": why })
            .to_string()
            .into_response()
    } else {
        Html(page("Sign in", &format!("<p class=err>{}</p>", esc(why)))).into_response()
    };
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer realm=\"flotilla\"")],
        body,
    )
        .into_response()
}

/// Whether `next` (as decoded from the query) is a path on this site, safe as a `Location`:
/// one `/` and then printable ASCII without `\`. A browser reads `//host`, `/\host` and
/// (dropping tabs and newlines) `/\t/host` as another site; anything but a plain path is
/// refused, unicode included, rather than reasoned about.
pub(super) fn same_origin_path(next: &str) -> bool {
    let mut bytes = next.bytes();
    bytes.next() == Some(b'/')
        && !matches!(next.as_bytes().get(1), Some(b'/' | b'\\'))
        && bytes.all(|b| b.is_ascii_graphic() && b != b'\\')
}

/// Where sign-in goes on to: `next` if it is a path on this site, else `/runs`.
pub(super) fn next_location(next: Option<String>) -> String {
    next.filter(|n| same_origin_path(n))
        .unwrap_or_else(|| "/runs".to_owned())
}

#[derive(Deserialize)]
pub(super) struct LoginQuery {
    pub(super) token: String,
    pub(super) next: Option<String>,
}

pub(super) async fn login(State(web): State<Web>, Query(q): Query<LoginQuery>) -> Response {
    let Some(key) = web.access.tokens() else {
        return Redirect::to("/runs").into_response();
    };
    let claims = match key.verify(&q.token) {
        Ok(c) => c,
        Err(why) => return refuse(why, false),
    };
    let next = next_location(q.next);
    let max_age = claims.exp.saturating_sub(now_secs());
    let cookie = format!(
        "{COOKIE}={}; Path=/; HttpOnly; SameSite=Lax; Max-Age={max_age}",
        q.token.trim()
    );
    (
        StatusCode::SEE_OTHER,
        [(header::SET_COOKIE, cookie), (header::LOCATION, next)],
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    const BASE: &str = "https://fleet.example:7080/login";

    /// Where a browser at [`BASE`] goes when told `Location: loc`, if it can go anywhere.
    fn followed(loc: &str) -> Option<reqwest::Url> {
        reqwest::Url::parse(BASE).unwrap().join(loc).ok()
    }

    /// `next` as the login handler gets it from a raw query value (percent- and plus-decoded,
    /// as the query extractor does).
    fn decoded(raw: &str) -> String {
        let url = reqwest::Url::parse(&format!("http://x/login?next={raw}")).unwrap();
        url.query_pairs()
            .find(|(k, _)| k == "next")
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default()
    }

    #[test]
    fn the_named_off_site_nexts_go_to_runs_and_paths_stay() {
        for raw in [
            "/%5Cevil.com",
            "/%09/evil.com",
            "//evil.com",
            "/%2F/evil.com/",
            "%2F%2Fevil.com",
            "/%0A/evil.com",
            "/%0D%0A/evil.com",
            "/%20/evil.com",
            "/%E3%80%80/evil.com",
            "/%EF%BC%8F/evil.com",
            "https://evil.com",
            "http:evil.com",
            "javascript:alert(1)",
            "%5C%5Cevil.com",
            "/\\evil.com",
        ] {
            assert_eq!(next_location(Some(decoded(raw))), "/runs", "{raw}");
        }
        for path in [
            "/runs/wf_1a2b3c4d-5e6",
            "/runs?all=1",
            "/",
            "/runs/x/agents/0#t",
        ] {
            assert_eq!(next_location(Some(path.into())), path);
        }
        assert_eq!(next_location(None), "/runs");
    }

    /// Pieces a hostile `next` is made of: slashes either way, encodings of them, whitespace
    /// and control characters browsers drop, schemes, hosts, and look-alike slashes.
    fn piece() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("/".to_owned()),
            Just("\\".to_owned()),
            Just("%2F".to_owned()),
            Just("%2f".to_owned()),
            Just("%5C".to_owned()),
            Just("%5c".to_owned()),
            Just("%252F".to_owned()),
            Just("%09".to_owned()),
            Just("%0A".to_owned()),
            Just("%0D".to_owned()),
            Just("%00".to_owned()),
            Just("%20".to_owned()),
            Just("+".to_owned()),
            Just("\t".to_owned()),
            Just("\n".to_owned()),
            Just(" ".to_owned()),
            Just("http:".to_owned()),
            Just("https://".to_owned()),
            Just("javascript:".to_owned()),
            Just("evil.com".to_owned()),
            Just("@".to_owned()),
            Just(".".to_owned()),
            Just("..".to_owned()),
            Just("?".to_owned()),
            Just("#".to_owned()),
            Just("runs".to_owned()),
            Just("\u{ff0f}".to_owned()),
            Just("\u{ff3c}".to_owned()),
            Just("\u{2215}".to_owned()),
            Just("\u{3000}".to_owned()),
            Just("\u{feff}".to_owned()),
            Just("%E3%80%80".to_owned()),
            "[a-z0-9]{1,4}",
            any::<char>().prop_map(String::from),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// Whatever `next` a link carries, the redirect after sign-in stays on this site, as
        /// a browser resolves it, and is a valid header value.
        #[test]
        fn sign_in_never_redirects_off_site(pieces in prop::collection::vec(piece(), 0..8)) {
            let raw: String = pieces.concat();
            for next in [raw.clone(), decoded(&raw)] {
                let loc = next_location(Some(next.clone()));
                prop_assert!(header::HeaderValue::from_str(&loc).is_ok(), "{loc:?}");
                let went = followed(&loc).unwrap();
                let home = reqwest::Url::parse(BASE).unwrap();
                prop_assert_eq!(went.origin(), home.origin(), "next {:?} -> {:?}", next, loc);
                prop_assert!(loc == next || loc == "/runs");
            }
        }
    }
}
