//! What a storage error means to the person who must fix it.
//!
//! An S3 server answers a refusal with an XML document (`<Error><Code>NoSuchBucket</Code>…`),
//! and `object_store` puts that document, request ids and all, into its error text. Nobody
//! should have to read it: [`code`] names the refusal ([`S3Code`]), [`brief`] renders any
//! storage error with the document cut down to its code and message, and [`s3`] turns the
//! errors a misconfigured S3 store gives (a missing bucket, a key the server does not know,
//! a wrong secret, no permission, another region, nothing listening at the endpoint) into a
//! sentence naming the bucket, the endpoint and the setting to change. [`super::Store::check`]
//! uses it at start-up, so a coordinator or an embedded run refuses to start with it instead
//! of failing each run.

use flotilla_proto::ErrorKind;

/// Where an S3 store is, as its errors name it (never its secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Place {
    pub bucket: String,
    /// The key prefix inside the bucket (`""` for none).
    pub prefix: String,
    /// `AWS_ENDPOINT_URL` (or its variants); `None` for AWS itself.
    pub endpoint: Option<String>,
    pub region: String,
    /// `AWS_ACCESS_KEY_ID`, when the credentials are static keys.
    pub key_id: Option<String>,
}

impl S3Place {
    /// The server, as a person names it.
    fn server(&self) -> String {
        match &self.endpoint {
            Some(e) => format!("the S3 server at {e}"),
            None => format!("AWS S3 in {}", self.region),
        }
    }

    fn key(&self) -> String {
        match &self.key_id {
            Some(k) => format!("access key id {k}"),
            None => "these credentials".to_owned(),
        }
    }
}

/// The refusals of an S3 server that retrying cannot fix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum S3Code {
    NoSuchBucket,
    /// `InvalidAccessKeyId`: the server does not know the key id.
    UnknownKey,
    /// `SignatureDoesNotMatch`: the secret is not the key's.
    WrongSecret,
    /// `AccessDenied`: the key may not do this.
    Denied,
    /// `ExpiredToken`, `InvalidToken`: a session token that is stale or not the key's.
    BadToken,
    /// `AuthorizationHeaderMalformed`, `PermanentRedirect`, or a redirect without a
    /// location: the bucket is in another region than the one requests are signed for.
    OtherRegion,
}

/// The S3 refusal behind `e`, if it is one of [`S3Code`].
pub fn code(e: &object_store::Error) -> Option<S3Code> {
    let text = e.to_string();
    let named = xml_field(&text, "Code");
    let code = match named.as_deref() {
        Some("NoSuchBucket") => S3Code::NoSuchBucket,
        Some("InvalidAccessKeyId") => S3Code::UnknownKey,
        Some("SignatureDoesNotMatch") => S3Code::WrongSecret,
        Some("AccessDenied" | "AllAccessDisabled") => S3Code::Denied,
        Some("ExpiredToken" | "InvalidToken" | "TokenRefreshRequired") => S3Code::BadToken,
        Some(
            "AuthorizationHeaderMalformed"
            | "PermanentRedirect"
            | "IllegalLocationConstraintException",
        ) => S3Code::OtherRegion,
        // object_store's words for a 301 without `Location` (S3's answer to a bucket asked
        // for in another region).
        _ if text.contains("incorrectly configured region") => S3Code::OtherRegion,
        _ if text.contains("specified bucket does not exist") => S3Code::NoSuchBucket,
        _ => return None,
    };
    Some(code)
}

/// `e` as text, with an S3 error document cut down to its code and message (no request ids,
/// no XML).
pub fn brief(e: &dyn std::error::Error) -> String {
    let text = e.to_string();
    let Some(start) = text.find("<?xml").or_else(|| text.find("<Error>")) else {
        return text;
    };
    let doc = &text[start..];
    let end = doc
        .find("</Error>")
        .map_or(doc.len(), |i| i + "</Error>".len());
    let said = match (xml_field(doc, "Code"), xml_field(doc, "Message")) {
        (Some(c), Some(m)) => format!("{c}: {m}"),
        (Some(c), None) => c,
        (None, Some(m)) => m,
        (None, None) => "an error document without a code".to_owned(),
    };
    format!("{}{said}{}", &text[..start], &doc[end..])
}

/// The text of the first `<name>…</name>` in `text`.
fn xml_field(text: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let from = text.find(&open)? + open.len();
    let len = text[from..].find(&format!("</{name}>"))?;
    Some(text[from..from + len].trim().to_owned())
}

/// How a request to the server failed before it answered, if it did.
fn unanswered(e: &object_store::Error) -> Option<(object_store::client::HttpErrorKind, String)> {
    use object_store::client::{HttpError, HttpErrorKind};
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let mut kind = None;
    let mut deepest = String::new();
    while let Some(err) = source {
        if let Some(h) = err.downcast_ref::<HttpError>() {
            kind = Some(h.kind());
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            deepest = io.to_string();
        }
        source = err.source();
    }
    match kind? {
        k @ (HttpErrorKind::Connect | HttpErrorKind::Timeout) => Some((k, deepest)),
        _ => None,
    }
}

/// A storage error explained: what is wrong, what to do, and its kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explained {
    pub problem: String,
    pub fix: String,
    pub kind: ErrorKind,
}

/// What `e`, from the S3 store at `place`, means and how to fix it; `None` for errors that
/// are not about how the store is set up.
pub fn s3(place: &S3Place, e: &object_store::Error) -> Option<Explained> {
    let server = place.server();
    let bucket = &place.bucket;
    let endpoint_flag = place
        .endpoint
        .as_ref()
        .map(|e| format!(" --endpoint-url {e}"))
        .unwrap_or_default();
    let invalid = |problem: String, fix: String| Explained {
        problem,
        fix,
        kind: ErrorKind::Invalid,
    };
    if let Some(code) = code(e) {
        return Some(match code {
            S3Code::NoSuchBucket => invalid(
                format!("bucket {bucket} does not exist at {server}"),
                format!(
                    "create it (aws s3 mb s3://{bucket}{endpoint_flag}), or name an existing bucket in --store s3://BUCKET/prefix"
                ),
            ),
            S3Code::UnknownKey => invalid(
                format!("{server} does not know {}", place.key()),
                match &place.endpoint {
                    Some(ep) => format!(
                        "check AWS_ACCESS_KEY_ID, and that AWS_ENDPOINT_URL ({ep}) is the server that key belongs to"
                    ),
                    None => "check AWS_ACCESS_KEY_ID (or unset AWS_ENDPOINT_URL if the key is another server's)".to_owned(),
                },
            ),
            S3Code::WrongSecret => invalid(
                format!(
                    "{server} refuses the signature made with the secret of {}: the secret is not that key's",
                    place.key()
                ),
                "check AWS_SECRET_ACCESS_KEY: it must be the secret of AWS_ACCESS_KEY_ID".to_owned(),
            ),
            S3Code::Denied => invalid(
                format!("{} may not list bucket {bucket} at {server}", place.key()),
                format!(
                    "grant it s3:ListBucket on the bucket and s3:GetObject, s3:PutObject and s3:DeleteObject on s3://{bucket}/{}*, or use credentials that have them",
                    if place.prefix.is_empty() {
                        String::new()
                    } else {
                        format!("{}/", place.prefix)
                    }
                ),
            ),
            S3Code::BadToken => invalid(
                format!("{server} refuses the session token (AWS_SESSION_TOKEN) of {}", place.key()),
                "refresh the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN together)".to_owned(),
            ),
            S3Code::OtherRegion => invalid(
                format!("bucket {bucket} is not in region {}", place.region),
                "set AWS_REGION to the bucket's region".to_owned(),
            ),
        });
    }
    let (kind, detail) = unanswered(e)?;
    let detail = if detail.is_empty() {
        String::new()
    } else {
        format!(" ({detail})")
    };
    let reach = match &place.endpoint {
        Some(_) => "start the S3 server there, or fix AWS_ENDPOINT_URL".to_owned(),
        None => "check this machine's network and proxy settings and AWS_REGION, or set AWS_ENDPOINT_URL for an S3-compatible server".to_owned(),
    };
    let problem = match kind {
        object_store::client::HttpErrorKind::Timeout => {
            format!("{server} did not answer in time{detail}")
        }
        _ => match &place.endpoint {
            Some(ep) => format!("nothing answers at {ep}{detail}"),
            None => format!("cannot reach {server}{detail}"),
        },
    };
    Some(Explained {
        problem,
        fix: reach,
        kind: ErrorKind::Unavailable,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error as object_store makes it from an S3 answer (the same words, no network).
    fn answered(status: &str, code: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: format!(
                "Error performing list request: Error performing GET http://h/runs in 4ms - Server returned non-2xx status code: {status}: <?xml version=\"1.0\" encoding=\"utf-8\"?>\n<Error><Code>{code}</Code><Message>what the server says</Message><RequestId>abc</RequestId><HostId>xyz</HostId></Error>"
            )
            .into(),
        }
    }

    fn place() -> S3Place {
        S3Place {
            bucket: "runs".into(),
            prefix: "team".into(),
            endpoint: None,
            region: "us-east-1".into(),
            key_id: Some("AKIAEXAMPLE".into()),
        }
    }

    #[test]
    fn a_refusal_is_named_by_its_code_and_shown_without_its_xml() {
        let e = answered("404 Not Found", "NoSuchBucket");
        assert_eq!(code(&e), Some(S3Code::NoSuchBucket));
        let shown = brief(&e);
        assert!(
            shown.ends_with("NoSuchBucket: what the server says"),
            "{shown}"
        );
        assert!(
            !shown.contains('<') && !shown.contains("RequestId"),
            "{shown}"
        );
        assert_eq!(code(&answered("500", "InternalError")), None);
        let plain = object_store::Error::NotFound {
            path: "runs/x".into(),
            source: "gone".into(),
        };
        assert_eq!(brief(&plain), plain.to_string());
    }

    /// A bucket in another region: what AWS answers (moto does not check regions, so this is
    /// the only test of it).
    #[test]
    fn a_bucket_in_another_region_says_to_set_the_region() {
        for e in [
            answered("400 Bad Request", "AuthorizationHeaderMalformed"),
            answered("301 Moved Permanently", "PermanentRedirect"),
            object_store::Error::Generic {
                store: "S3",
                source: "Received redirect without LOCATION, this normally indicates an incorrectly configured region".into(),
            },
        ] {
            let x = s3(&place(), &e).expect("explained");
            assert_eq!(x.problem, "bucket runs is not in region us-east-1");
            assert!(x.fix.contains("AWS_REGION"), "{x:?}");
        }
        let denied = s3(&place(), &answered("403 Forbidden", "AccessDenied")).unwrap();
        assert!(denied.fix.contains("s3://runs/team/*"), "{denied:?}");
        let token = s3(&place(), &answered("400 Bad Request", "ExpiredToken")).unwrap();
        assert!(token.fix.contains("AWS_SESSION_TOKEN"), "{token:?}");
    }
}
