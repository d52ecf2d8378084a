//! Session tokens for the pages and the client API's `token create`: signed claims (HMAC-SHA256)
//! with an expiry and the namespaces they show.
//!
//! Below both faces: the gRPC face issues tokens and the pages check them, and neither imports
//! the other for it.

use std::time::{Duration, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};

/// Longest a session token may live.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Signs and checks session tokens (HMAC-SHA256).
#[derive(Clone)]
pub struct TokenKey(ring::hmac::Key);

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

/// What a token says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// Who it was issued to (the CN of the certificate that asked for it).
    pub sub: String,
    /// Expiry, seconds since the Unix epoch.
    pub exp: u64,
    /// The namespaces it shows (`namespace::Scope::encode`: `*` or names); a token from
    /// before namespaces carries none and shows `default` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns: Option<String>,
}

impl Claims {
    /// The namespaces the token shows.
    pub fn scope(&self) -> crate::namespace::Scope {
        crate::namespace::Scope::from_organisation(self.ns.as_deref())
    }
}

pub(crate) fn now_secs() -> u64 {
    flotilla_proto::clock::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl TokenKey {
    /// A key derived from secret bytes (the coordinator's private key file).
    pub fn derive(secret: &[u8]) -> TokenKey {
        let seed = ring::digest::digest(
            &ring::digest::SHA256,
            &[b"flotilla session token v1\0".as_slice(), secret].concat(),
        );
        TokenKey(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, seed.as_ref()))
    }

    /// A token for `sub` that shows every namespace, valid for `ttl` (at most
    /// [`MAX_TOKEN_TTL`]).
    pub fn issue(&self, sub: &str, ttl: Duration) -> String {
        self.issue_for(sub, &crate::namespace::Scope::All, ttl)
    }

    /// A token for `sub` that shows the namespaces of `scope`.
    pub fn issue_for(&self, sub: &str, scope: &crate::namespace::Scope, ttl: Duration) -> String {
        let claims = Claims {
            sub: sub.to_owned(),
            exp: now_secs() + ttl.min(MAX_TOKEN_TTL).as_secs(),
            ns: Some(scope.encode()),
        };
        let body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).unwrap_or_default());
        let tag = ring::hmac::sign(&self.0, body.as_bytes());
        format!("v1.{body}.{}", URL_SAFE_NO_PAD.encode(tag.as_ref()))
    }

    /// The claims of a valid, unexpired token.
    pub fn verify(&self, token: &str) -> Result<Claims, &'static str> {
        let mut parts = token.trim().split('.');
        let (Some("v1"), Some(body), Some(tag), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err("not a flotilla session token");
        };
        let tag = URL_SAFE_NO_PAD
            .decode(tag)
            .map_err(|_| "not a flotilla session token")?;
        ring::hmac::verify(&self.0, body.as_bytes(), &tag)
            .map_err(|_| "the token was not issued by this fleet's coordinator")?;
        let claims: Claims = URL_SAFE_NO_PAD
            .decode(body)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or("not a flotilla session token")?;
        if claims.exp <= now_secs() {
            return Err("the token has expired; create a new one with `flotilla token create`");
        }
        Ok(claims)
    }
}
