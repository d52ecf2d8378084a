//! The model API as sandboxed agents reach it (issue 13): a reverse proxy the worker runs
//! outside the sandboxes, on a unix socket that each sandbox sees (and a relay inside turns
//! into `127.0.0.1:PORT`, see [`relay`]).
//!
//! The API key stays with the worker. An agent is given a token of its attempt as its key;
//! the gateway takes requests that carry a live token, puts the worker's key in its place and
//! forwards them to the worker's API (`ANTHROPIC_BASE_URL`, else Anthropic's), streaming the
//! answer back. A token stops working when its attempt ends; a request without a live one is
//! refused with 401 and a message saying so.

use flotilla_proto::Problem;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};

/// Where sandboxed agents' API requests go, and the worker's key for them.
#[derive(Debug)]
pub struct Gateway {
    socket: PathBuf,
    upstream: String,
    key: Option<(HeaderName, HeaderValue)>,
    tokens: Mutex<HashSet<String>>,
    client: reqwest::Client,
}

/// A token of one attempt: valid until dropped.
#[derive(Debug)]
pub struct Token {
    gateway: Arc<Gateway>,
    pub value: String,
}

impl Drop for Token {
    fn drop(&mut self) {
        lock(&self.gateway.tokens).remove(&self.value);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The largest request body an agent may send (a prompt with its context).
const MAX_REQUEST: usize = 64 << 20;

impl Gateway {
    /// Serves on a socket in `dir` (made private to the worker's user), with the key and
    /// API address of the worker's environment.
    pub async fn start(dir: &Path) -> Result<Arc<Gateway>, Problem> {
        let upstream = std::env::var("ANTHROPIC_BASE_URL")
            .ok()
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| "https://api.anthropic.com".into());
        let key = match (
            std::env::var("ANTHROPIC_API_KEY")
                .ok()
                .filter(|k| !k.is_empty()),
            std::env::var("ANTHROPIC_AUTH_TOKEN")
                .ok()
                .filter(|k| !k.is_empty()),
        ) {
            (Some(k), _) => Some((HeaderName::from_static("x-api-key"), k)),
            (None, Some(t)) => Some((
                HeaderName::from_static("authorization"),
                format!("Bearer {t}"),
            )),
            (None, None) => None,
        };
        let key = match key {
            Some((h, v)) => Some((
                h,
                HeaderValue::from_str(&v).map_err(|_| {
                    Problem::unavailable("the worker's API key is not a valid header value")
                })?,
            )),
            None => None,
        };
        Self::start_with(dir, upstream, key).await
    }

    /// [`Gateway::start`] with an explicit API address and key header.
    pub async fn start_with(
        dir: &Path,
        upstream: String,
        key: Option<(HeaderName, HeaderValue)>,
    ) -> Result<Arc<Gateway>, Problem> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir)
            .map_err(|e| Problem::unavailable(format!("cannot make {}: {e}", dir.display())))?;
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        let socket = dir.join("api.sock");
        let _ = std::fs::remove_file(&socket);
        let listener = tokio::net::UnixListener::bind(&socket).map_err(|e| {
            Problem::unavailable(format!("cannot listen on {}: {e}", socket.display()))
        })?;
        // No redirects: one to another host would take the key with it.
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| Problem::unavailable(format!("cannot make an HTTP client: {e}")))?;
        let g = Arc::new(Gateway {
            socket,
            upstream: upstream.trim_end_matches('/').to_owned(),
            key,
            tokens: Mutex::default(),
            client,
        });
        let serving = g.clone();
        let app = axum::Router::new().fallback(move |req: Request<Body>| {
            let g = serving.clone();
            async move { g.forward(req).await }
        });
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "the sandbox API gateway stopped");
            }
        });
        Ok(g)
    }

    /// The socket sandboxes reach the gateway on.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// A new token, valid until it is dropped.
    pub fn token(self: &Arc<Gateway>) -> Token {
        let mut bytes = [0u8; 24];
        let _ = getrandom::fill(&mut bytes);
        let value: String = std::iter::once("flotilla-attempt-".to_owned())
            .chain(bytes.iter().map(|b| format!("{b:02x}")))
            .collect();
        lock(&self.tokens).insert(value.clone());
        Token {
            gateway: self.clone(),
            value,
        }
    }

    fn presented(&self, headers: &HeaderMap) -> Option<String> {
        let from_key = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let from_bearer = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::to_owned);
        let tokens = lock(&self.tokens);
        [from_key, from_bearer]
            .into_iter()
            .flatten()
            .find(|t| tokens.contains(t))
    }

    async fn forward(&self, req: Request<Body>) -> Response<Body> {
        let refuse = |status: StatusCode, message: String| {
            let body = serde_json::json!({
                "type": "error",
                "error": {"type": "authentication_error", "message": message},
            });
            Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .unwrap_or_default()
        };
        if self.presented(req.headers()).is_none() {
            return refuse(
                StatusCode::UNAUTHORIZED,
                "flotilla: this request carries no live attempt token (a token stops working when its attempt ends)".into(),
            );
        }
        // What an agent needs of the API, and no more of what the key can do (files,
        // batches, admin): the path as it is sent upstream, checked whole.
        let Some(path) = model_call(req.method(), req.uri()) else {
            let shown: String = req.uri().to_string().chars().take(200).collect();
            return refuse(
                StatusCode::FORBIDDEN,
                format!(
                    "flotilla: {} {shown} is not open to agents (only POST /v1/messages, /v1/messages/count_tokens, GET /v1/models and GET /v1/models/MODEL)",
                    req.method()
                ),
            );
        };
        let (parts, body) = req.into_parts();
        let body = match axum::body::to_bytes(body, MAX_REQUEST).await {
            Ok(b) => b,
            Err(e) => {
                return refuse(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "flotilla: cannot read the request ({e}); at most {} MiB",
                        MAX_REQUEST >> 20
                    ),
                );
            }
        };
        let mut out = self
            .client
            .request(parts.method.clone(), format!("{}{path}", self.upstream))
            .body(body);
        for (name, value) in &parts.headers {
            let skip = matches!(
                name.as_str(),
                "x-api-key"
                    | "authorization"
                    | "host"
                    | "content-length"
                    | "connection"
                    | "transfer-encoding"
            );
            if !skip {
                out = out.header(name, value);
            }
        }
        if let Some((name, value)) = &self.key {
            out = out.header(name, value);
        }
        let mut resp = match out.send().await {
            Ok(r) => r,
            Err(e) => {
                return refuse(
                    StatusCode::BAD_GATEWAY,
                    format!("flotilla: the worker cannot reach the model API: {e}"),
                );
            }
        };
        let mut builder = Response::builder().status(resp.status());
        for (name, value) in resp.headers() {
            if !matches!(
                name.as_str(),
                "content-length" | "connection" | "transfer-encoding"
            ) {
                builder = builder.header(name, value);
            }
        }
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(16);
        tokio::spawn(async move {
            loop {
                match resp.chunk().await {
                    Ok(Some(chunk)) => {
                        if tx.send(Ok(chunk)).await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => return,
                    Err(e) => {
                        let _ = tx.send(Err(std::io::Error::other(e))).await;
                        return;
                    }
                }
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        builder.body(Body::from_stream(stream)).unwrap_or_default()
    }
}

/// The path and query to send upstream when `method uri` is a request an agent may make of
/// the model API, else `None`. The path must be one of the allowed ones exactly as written:
/// no dot segments, percent-encodings, doubled slashes or backslashes that the upstream
/// client (or the provider) would read as another path; a model id is one plain segment.
/// The query goes as it came (the CLI sends `?beta=true`), but cannot carry a path.
pub fn model_call(method: &axum::http::Method, uri: &axum::http::Uri) -> Option<String> {
    use axum::http::Method;
    let path = uri.path();
    let model_id = |id: &str| {
        !id.is_empty()
            && id.len() <= 256
            && !id.starts_with('.')
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '@'))
    };
    let allowed = match *method {
        Method::POST => path == "/v1/messages" || path == "/v1/messages/count_tokens",
        Method::GET => {
            path == "/v1/models" || path.strip_prefix("/v1/models/").is_some_and(model_id)
        }
        _ => false,
    };
    // An absolute-form target (the CLI's, through the sandbox's proxy) names the gateway's
    // own address; only its path and query go on, to the worker's API.
    if !allowed {
        return None;
    }
    match uri.query() {
        None => Some(path.to_owned()),
        Some(q)
            if q.len() <= 2048
                && q.bytes().all(|b| {
                    b.is_ascii_alphanumeric()
                        || matches!(b, b'=' | b'&' | b'-' | b'_' | b'.' | b',')
                }) =>
        {
            Some(format!("{path}?{q}"))
        }
        Some(_) => None,
    }
}

/// Inside a sandbox: for each `(listen, socket)` of `relays`, listens on `listen` (the
/// sandbox's own loopback) and relays every connection to the unix socket, while
/// `program args` runs; exits with the program's status.
pub async fn relay(relays: &[(String, PathBuf)], program: &str, args: &[String]) -> i32 {
    for (listen, to) in relays {
        let listener = match tokio::net::TcpListener::bind(listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("flotilla sandbox relay: cannot listen on {listen}: {e}");
                return 125;
            }
        };
        let to = to.clone();
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                let to = to.clone();
                tokio::spawn(async move {
                    if let Ok(mut unix) = tokio::net::UnixStream::connect(&to).await {
                        let _ = tokio::io::copy_bidirectional(&mut tcp, &mut unix).await;
                    }
                });
            }
        });
    }
    let mut child = match tokio::process::Command::new(program).args(args).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("flotilla sandbox relay: cannot start {program}: {e}");
            return 127;
        }
    };
    match child.wait().await {
        Ok(s) => {
            use std::os::unix::process::ExitStatusExt;
            s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9))
        }
        Err(_) => 1,
    }
}

/// The rest of the network as sandboxed agents reach it: an HTTP proxy on a unix socket in
/// `dir` that opens only hosts of `allow` (`HOST` for any port, `HOST:PORT`; `CONNECT` for
/// TLS and anything tunnelled, absolute-form requests for plain HTTP). A refusal is an
/// HTTP 403 whose body names the host and the flag, so the agent's tool output says why.
/// A request for `api` (the model API's address inside a sandbox) goes to the gateway's
/// socket `gateway`.
pub async fn start_proxy(
    dir: &Path,
    allow: Vec<String>,
    api: (&str, PathBuf),
) -> Result<PathBuf, Problem> {
    start_proxy_with(dir, allow, api, Lookup::system()).await
}

/// Where a name leads, resolved once per request: what the proxy checks is what it connects
/// to. A test gives a resolver of its own (one that answers differently the second time, as
/// a rebinding name server would).
type Resolve = dyn Fn(
        String,
        u16,
    )
        -> std::pin::Pin<Box<dyn std::future::Future<Output = Vec<std::net::SocketAddr>> + Send>>
    + Send
    + Sync;

/// How the proxy finds a host's addresses, and which addresses are the worker itself or its
/// link.
#[derive(Clone)]
struct Lookup {
    resolve: Arc<Resolve>,
    inward: fn(std::net::IpAddr) -> bool,
}

impl Lookup {
    /// The system's resolver, and [`inward`].
    fn system() -> Lookup {
        Lookup {
            resolve: Arc::new(|host, port| {
                Box::pin(async move {
                    tokio::net::lookup_host((host.as_str(), port))
                        .await
                        .map(Iterator::collect)
                        .unwrap_or_default()
                })
            }),
            inward,
        }
    }
}

/// [`start_proxy`] with `lookup`.
async fn start_proxy_with(
    dir: &Path,
    allow: Vec<String>,
    (api, gateway): (&str, PathBuf),
    lookup: Lookup,
) -> Result<PathBuf, Problem> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Problem::unavailable(format!("cannot make {}: {e}", dir.display())))?;
    let socket = dir.join("net.sock");
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket)
        .map_err(|e| Problem::unavailable(format!("cannot listen on {}: {e}", socket.display())))?;
    let allow = Arc::new(allow);
    let api = Arc::new((api.to_owned(), gateway));
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let allow = allow.clone();
            let api = api.clone();
            let lookup = lookup.clone();
            tokio::spawn(async move {
                if let Err(e) = proxy_one(conn, &allow, &api, &lookup).await {
                    tracing::debug!(error = %e, "sandbox proxy connection ended");
                }
            });
        }
    });
    Ok(socket)
}

/// Whether `host:port` is in `allow`.
fn allowed(allow: &[String], host: &str, port: u16) -> bool {
    allow.iter().any(|a| {
        let a = a.trim();
        match a.rsplit_once(':') {
            Some((h, p)) if p.parse::<u16>().is_ok() => {
                h.eq_ignore_ascii_case(host) && p.parse::<u16>() == Ok(port)
            }
            _ => a.eq_ignore_ascii_case(host),
        }
    })
}

/// A connection the proxy opened: TCP, or the gateway's socket.
trait Upstream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Upstream for T {}

/// The proxy's own answer: `status` with `why` as its plain-text body, and the connection
/// closed.
async fn answer(conn: &mut tokio::net::UnixStream, status: &str, why: &str) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let text = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{why}\n",
        why.len() + 1
    );
    conn.write_all(text.as_bytes()).await
}

async fn proxy_one(
    mut conn: tokio::net::UnixStream,
    allow: &[String],
    (api, gateway): &(String, PathBuf),
    lookup: &Lookup,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The request head, at most 64 KiB, within 30 s.
    let mut head = Vec::new();
    let read_head = async {
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if head.len() > 64 << 10 || conn.read(&mut byte).await? == 0 {
                return Ok::<bool, std::io::Error>(false);
            }
            head.push(byte[0]);
        }
        Ok(true)
    };
    match tokio::time::timeout(std::time::Duration::from_secs(30), read_head).await {
        Ok(Ok(true)) => {}
        _ => return Ok(()),
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or_default();
    let mut parts = first.split(' ');
    let (method, target, version) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or("HTTP/1.1"),
    );
    let (authority, rest, tunnel) = if method.eq_ignore_ascii_case("CONNECT") {
        (target.to_owned(), String::new(), true)
    } else if let Some(after) = target.strip_prefix("http://") {
        let (auth, path) = after.split_at(after.find('/').unwrap_or(after.len()));
        let path = if path.is_empty() { "/" } else { path };
        (auth.to_owned(), path.to_owned(), false)
    } else {
        return answer(
            &mut conn,
            "400 Bad Request",
            "flotilla: this proxy takes CONNECT host:port and http:// requests",
        )
        .await;
    };
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if p.parse::<u16>().is_ok() => (h.to_owned(), p.parse().unwrap_or(80)),
        _ => (authority.clone(), if tunnel { 443 } else { 80 }),
    };
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let to_api = ["127.0.0.1", "localhost"]
        .iter()
        .any(|h| format!("{h}:{port}") == *api && host.eq_ignore_ascii_case(h));
    // The addresses this request may go to, resolved once: the connection goes to one of
    // them, never to what a second lookup of the name says (DNS rebinding). A name allowed
    // by name must not lead to the worker itself or its link (the coordinator, etcd or a
    // metadata service there): only an address allowed as such does.
    let permitted = to_api || allowed(allow, &host, port);
    let addrs: Vec<std::net::SocketAddr> = if to_api || !permitted {
        Vec::new()
    } else if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        vec![std::net::SocketAddr::new(ip, port)]
    } else {
        (lookup.resolve)(host.clone(), port).await
    };
    let inward =
        host.parse::<std::net::IpAddr>().is_err() && addrs.iter().any(|a| (lookup.inward)(a.ip()));
    if !permitted || inward {
        tracing::info!(host = %host, port, "the sandbox proxy refused a host that is not allowed");
        let why = format!(
            "flotilla: {host}:{port} is not reachable from this sandbox; the worker allows only the model API and its --allow-net hosts"
        );
        return answer(&mut conn, "403 Forbidden", &why).await;
    }
    if !to_api && addrs.is_empty() {
        let why = format!("flotilla: cannot resolve {host}");
        return answer(&mut conn, "502 Bad Gateway", &why).await;
    }
    let opened: std::io::Result<Box<dyn Upstream>> = if to_api {
        tokio::net::UnixStream::connect(gateway)
            .await
            .map(|s| Box::new(s) as Box<dyn Upstream>)
    } else {
        tokio::net::TcpStream::connect(&addrs[..])
            .await
            .map(|s| Box::new(s) as Box<dyn Upstream>)
    };
    let mut upstream = match opened {
        Ok(u) => u,
        Err(e) => {
            let why = format!("flotilla: cannot reach {host}:{port}: {e}");
            return answer(&mut conn, "502 Bad Gateway", &why).await;
        }
    };
    if tunnel {
        conn.write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            .await?;
    } else {
        // The request again, in origin form, and its headers but the proxy's own.
        let mut out = format!("{method} {rest} {version}\r\n");
        for l in lines.filter(|l| !l.is_empty()) {
            let name = l.split(':').next().unwrap_or_default().to_ascii_lowercase();
            if !name.starts_with("proxy-") {
                out.push_str(l);
                out.push_str("\r\n");
            }
        }
        out.push_str("\r\n");
        upstream.write_all(out.as_bytes()).await?;
    }
    tokio::io::copy_bidirectional(&mut conn, &mut upstream).await?;
    Ok(())
}

/// Loopback, link-local or unspecified: the machine itself or its link.
pub(crate) fn inward(ip: std::net::IpAddr) -> bool {
    use std::net::IpAddr;
    match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_link_local() || v4.is_unspecified(),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return inward(IpAddr::V4(v4));
            }
            v6.is_loopback() || v6.is_unspecified() || (v6.segments()[0] & 0xffc0) == 0xfe80
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use axum::http::{Method, Uri};
    use proptest::prelude::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn call(method: Method, target: &str) -> Option<String> {
        model_call(&method, &target.parse::<Uri>().ok()?)
    }

    #[test]
    fn only_the_model_calls_pass_exactly_as_written() {
        assert_eq!(
            call(Method::POST, "/v1/messages?beta=true").as_deref(),
            Some("/v1/messages?beta=true")
        );
        assert!(call(Method::POST, "/v1/messages/count_tokens").is_some());
        // The authority of an absolute-form target is not where it goes.
        assert_eq!(
            call(Method::POST, "http://127.0.0.1:47119/v1/messages?beta=true").as_deref(),
            Some("/v1/messages?beta=true")
        );
        assert!(call(Method::GET, "/v1/models").is_some());
        assert!(call(Method::GET, "/v1/models/claude-sonnet-4-5@20250929").is_some());
        for (m, t) in [
            (Method::GET, "/v1/models/../files"),
            (Method::GET, "/v1/models/%2e%2e/files"),
            (Method::GET, "/v1/models/%2E%2E/organizations/me"),
            (Method::GET, "/v1/models/../organizations/me"),
            (Method::GET, "/v1/models/x/../../files"),
            (Method::GET, "/v1/models/.."),
            (Method::GET, "/v1/models/."),
            (Method::GET, "/v1/models//files"),
            (Method::GET, "/v1/models/a%2f..%2ffiles"),
            (Method::GET, "/v1/models/a\\..\\files"),
            (Method::GET, "/v1/files"),
            (Method::GET, "/v1/messages"),
            (Method::POST, "/v1/messages/"),
            (Method::POST, "/v1//messages"),
            (Method::POST, "/v1/messages/batches"),
            (Method::POST, "/v1/./messages"),
            (Method::DELETE, "/v1/models/x"),
            (Method::GET, "http://evil.example/v1/files"),
            (Method::POST, "/v1/messages?x=/../files"),
            (Method::POST, "/v1/messages?x=%2e%2e"),
        ] {
            assert_eq!(call(m.clone(), t), None, "{m} {t}");
        }
    }

    proptest! {
        /// Whatever an agent sends, what goes upstream is one of the allowed paths, with no
        /// way for the upstream's own normalising to make it another.
        #[test]
        fn what_passes_is_always_an_allowed_path(
            segs in proptest::collection::vec(
                prop_oneof![
                    Just("..".to_owned()), Just(".".to_owned()), Just("%2e%2e".to_owned()),
                    Just("%2E".to_owned()), Just("".to_owned()), Just("files".to_owned()),
                    Just("models".to_owned()), Just("messages".to_owned()), Just("v1".to_owned()),
                    Just("%2f".to_owned()), Just("\\\\".to_owned()), Just("count_tokens".to_owned()),
                    "[a-z0-9.%-]{1,8}",
                ],
                1..6,
            ),
            query in proptest::option::of("[ -~]{0,12}"),
            post in any::<bool>(),
        ) {
            let mut target = format!("/{}", segs.join("/"));
            if let Some(q) = query {
                target = format!("{target}?{q}");
            }
            let method = if post { Method::POST } else { Method::GET };
            if let Some(sent) = call(method, &target) {
                let path = sent.split('?').next().unwrap();
                let ok = path == "/v1/messages"
                    || path == "/v1/messages/count_tokens"
                    || path == "/v1/models"
                    || path.strip_prefix("/v1/models/").is_some_and(|id| {
                        !id.contains('/') && !id.contains('%') && !id.starts_with('.')
                    });
                prop_assert!(ok, "{target} went upstream as {sent}");
                prop_assert!(!sent.contains(".."), "{sent}");
                prop_assert!(!sent.contains('%'), "{sent}");
            }
        }
    }

    /// A name allowed by name that a rebinding name server points at the worker itself on
    /// its second lookup: the proxy connects where its one lookup led, never to the second
    /// answer. ("Outside" here is 127.0.0.2, which this test's check counts as not inward.)
    #[tokio::test]
    async fn the_proxy_connects_to_the_address_it_checked() {
        // One port on both addresses (a few tries: it may be taken on 127.0.0.1).
        let mut pair = None;
        for _ in 0..50 {
            let outside = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
            let port = outside.local_addr().unwrap().port();
            if let Ok(inside) = tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
                pair = Some((outside, inside, port));
                break;
            }
        }
        let (outside, inside, port) = pair.expect("a port free on both loopback addresses");
        let lookups = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = lookups.clone();
        let lookup = Lookup {
            resolve: Arc::new(move |_, port| {
                let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let ip = if n == 0 {
                    [127, 0, 0, 2]
                } else {
                    [127, 0, 0, 1]
                };
                Box::pin(async move { vec![std::net::SocketAddr::from((ip, port))] })
            }),
            inward: |ip| ip == std::net::IpAddr::from([127, 0, 0, 1]),
        };
        let dir = tempfile::tempdir().unwrap();
        let socket = start_proxy_with(
            dir.path(),
            vec!["rebind.test".into()],
            ("127.0.0.1:47119", dir.path().join("none.sock")),
            lookup,
        )
        .await
        .unwrap();
        let answer = tokio::spawn(send(
            socket.clone(),
            format!("CONNECT rebind.test:{port} HTTP/1.1\r\nhost: rebind.test\r\n\r\n"),
        ));
        let accepted = tokio::select! {
            a = outside.accept() => a.map(|_| "outside"),
            a = inside.accept() => a.map(|_| "inside"),
        }
        .unwrap();
        assert_eq!(accepted, "outside");
        assert_eq!(lookups.load(std::sync::atomic::Ordering::SeqCst), 1);
        drop(answer);
    }

    /// An upstream that records each request line it gets and answers 200.
    async fn recording_upstream() -> (String, Arc<Mutex<Vec<String>>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = listener.accept().await {
                let log = log.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 8192];
                    let n = c.read(&mut buf).await.unwrap_or(0);
                    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                    log.lock()
                        .unwrap()
                        .push(text.lines().next().unwrap_or("").to_owned());
                    let _ = c
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                        )
                        .await;
                });
            }
        });
        (url, seen)
    }

    async fn send(socket: impl AsRef<Path>, head: impl AsRef<str>) -> String {
        let (socket, head) = (socket.as_ref(), head.as_ref());
        let mut c = tokio::net::UnixStream::connect(socket).await.unwrap();
        c.write_all(head.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let _ =
            tokio::time::timeout(std::time::Duration::from_secs(10), c.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn the_gateway_forwards_only_what_it_checked_with_the_worker_s_key() {
        flotilla_proto::tls::install_crypto_provider();
        let (upstream, seen) = recording_upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let g = Gateway::start_with(
            dir.path(),
            upstream,
            Some((
                HeaderName::from_static("x-api-key"),
                HeaderValue::from_static("sk-worker"),
            )),
        )
        .await
        .unwrap();
        let token = g.token();
        for path in [
            "/v1/models/../files",
            "/v1/models/%2e%2e/files",
            "/v1/models/../organizations/me",
            "/v1/models/%2E%2E/%2E%2E/v1/files",
            "//v1/models/../files",
        ] {
            let answer = send(
                g.socket(),
                &format!(
                    "GET {path} HTTP/1.1\r\nhost: x\r\nx-api-key: {}\r\nconnection: close\r\n\r\n",
                    token.value
                ),
            )
            .await;
            assert!(answer.starts_with("HTTP/1.1 403"), "{path}: {answer}");
        }
        let answer = send(
            g.socket(),
            &format!(
                "GET /v1/models/claude-x HTTP/1.1\r\nhost: x\r\nx-api-key: {}\r\nconnection: close\r\n\r\n",
                token.value
            ),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let lines = seen.lock().unwrap().clone();
        assert_eq!(lines, vec!["GET /v1/models/claude-x HTTP/1.1".to_owned()]);
    }
}
