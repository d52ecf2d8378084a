//! A fake Anthropic Messages API on loopback, faithful enough for the real Claude Code CLI
//! (`spec/agent-backends.md` §2): `POST /v1/messages` as SSE (`stream: true`) or JSON, the
//! exact event order, `role: "system"` messages and unknown fields accepted, a `request-id`
//! header, and every request logged for assertions.
//!
//! What it answers is scripted by markers in the last user text:
//! - `[[bash:CMD]]`: a Bash `tool_use` running CMD; after the tool result, the text
//!   `tool said: OUTPUT`;
//! - `[[tool:NAME:JSON]]`: a `tool_use` of tool NAME (an MCP tool, say) with JSON as its
//!   input; after the tool result, `tool said: OUTPUT` too;
//! - with a `StructuredOutput` tool: a call to it with `[[json:{...}]]`, or with a value made
//!   up from the schema (strings `"fake"`, numbers `1`, booleans `true`);
//! - `[[status:N]]`: an HTTP error N (`overloaded_error` for 529, `rate_limit_error` for 429);
//! - `[[fail-first:N:CODE]]`: the first N requests of that prompt fail with CODE, later ones
//!   are answered;
//! - `[[stall-first:N]]`: the first N requests of that prompt get `message_start` (the first
//!   chunk, for chat completions) and then nothing, on a connection held open;
//! - `[[turns:N]]`: an agent of N turns: while the conversation holds fewer than N tool
//!   results, a Bash `tool_use` running `echo turn K`; then the text `done after N turns`;
//! - `[[stall-at:K]]`: the first request whose conversation holds K tool results stalls as
//!   `stall-first` does (an agent interrupted after K turns);
//! - otherwise the text `fake reply to: PROMPT`.
//!
//! Prompt caching is simulated (§2.5): the prefix tools → system → messages is hashed at every
//! block; a `cache_control` block writes its prefix; a request reads the longest prefix written
//! before that ends at one of its breakpoints or up to 20 blocks before one (the API's
//! lookback), and writes the rest up to its last breakpoint. A prefix becomes readable only
//! once the response that wrote it begins (after a 150 ms think), so requests that start
//! together all miss, as with the real API.
//!
//! It also answers OpenAI-style `POST /v1/chat/completions` (streamed chunks with
//! `stream_options.include_usage`, or one JSON object), scripted by the same markers: with a
//! `json_schema` response format the content is the `[[json:...]]` text or a made-up value;
//! `[[stall-at:K]]` counts the model's answers in the conversation instead of tool results.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

/// One request the fake saw.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Value,
    /// Messages API: the prompt-cache tokens this request read (simulated caching).
    pub cache_read: u64,
}

/// The running fake.
pub struct FakeAnthropic {
    pub port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    cache: Arc<Cache>,
}

impl FakeAnthropic {
    pub fn start() -> FakeAnthropic {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the fake API");
        let port = listener.local_addr().expect("address").port();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let ids = Arc::new(AtomicU64::new(1));
        let cache: Arc<Cache> = Arc::default();
        {
            let (seen, stop, cache) = (seen.clone(), stop.clone(), cache.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    let (seen, ids, cache) = (seen.clone(), ids.clone(), cache.clone());
                    std::thread::spawn(move || serve(conn, &seen, &ids, &cache));
                }
            });
        }
        FakeAnthropic {
            port,
            seen,
            stop,
            cache,
        }
    }

    /// Answers every prompt (Messages API) that contains `needle` as if its text were
    /// `script`, so a test can script agents whose prompts a workflow writes: e.g.
    /// `when("Try to refute", "[[status:400]]")`. Rules are tried in the order given.
    pub fn when(&self, needle: &str, script: &str) {
        self.cache
            .rules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((needle.to_owned(), script.to_owned()));
    }

    /// From now on, a Messages request that would make more than `n` in flight at once is
    /// refused with 429 `rate_limit_error` and `retry-after: 1` (0: no limit).
    pub fn limit_concurrency(&self, n: u64) {
        self.cache.limits.max_concurrent.store(n, Ordering::SeqCst);
    }

    /// For `d` from now, every Messages request is refused with 529 `overloaded_error` and
    /// `retry-after: 1`.
    pub fn overload_for(&self, d: std::time::Duration) {
        *self
            .cache
            .limits
            .overloaded_until
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now() + d);
    }

    /// What the limits refused and served so far.
    pub fn limit_counts(&self) -> LimitCounts {
        let l = &self.cache.limits;
        LimitCounts {
            refused_429: l.refused_429.load(Ordering::SeqCst),
            refused_529: l.refused_529.load(Ordering::SeqCst),
            served: l.served.load(Ordering::SeqCst),
            peak: l.peak.load(Ordering::SeqCst),
        }
    }

    /// `http://127.0.0.1:PORT`, for `ANTHROPIC_BASE_URL`.
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Seen> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// `flotilla run --json --backend BACKEND` of a script with `body`, in `env`, pointed at
    /// this fake, with `extra` flags and `vars` added to the environment; exit code and report.
    pub fn run(
        &self,
        env: &crate::Env,
        backend: &str,
        body: &str,
        extra: &[&str],
        vars: &[(&str, &str)],
    ) -> (i32, Value) {
        let script = env.script(backend, body);
        let own = self.env();
        let mut all: Vec<(&str, &str)> =
            own.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        all.extend_from_slice(vars);
        let mut args = vec![
            "run",
            script.to_str().expect("utf-8 path"),
            "--json",
            "--backend",
            backend,
        ];
        args.extend_from_slice(extra);
        let out = env.flotilla_with_env(&args, &all);
        (out.code, out.json())
    }

    /// The environment a client needs to use this fake (both APIs).
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("ANTHROPIC_BASE_URL".into(), self.base_url()),
            ("ANTHROPIC_API_KEY".into(), "sk-ant-fake".into()),
            ("OPENAI_BASE_URL".into(), format!("{}/v1", self.base_url())),
            ("OPENAI_API_KEY".into(), "sk-openai-fake".into()),
        ]
    }
}

impl Drop for FakeAnthropic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Prefixes in the cache, and how often each `[[fail-first:N:CODE]]` prompt has been seen.
#[derive(Default)]
struct Cache {
    prefixes: Mutex<std::collections::HashSet<u64>>,
    seen_prompts: Mutex<std::collections::HashMap<String, u32>>,
    /// `(substring, script)`: a prompt containing the substring is answered as if it were
    /// the script (see [`FakeAnthropic::when`]).
    rules: Mutex<Vec<(String, String)>>,
    limits: Limits,
}

/// The provider's limits (Messages API): how many requests it takes at once, and a window of
/// overload; what it refused and served.
#[derive(Default)]
struct Limits {
    /// Requests at once beyond which it answers 429 with `retry-after: 1` (0: no limit).
    max_concurrent: AtomicU64,
    in_flight: AtomicU64,
    /// Until when every request gets 529 `overloaded_error` with `retry-after: 1`.
    overloaded_until: Mutex<Option<std::time::Instant>>,
    refused_429: AtomicU64,
    refused_529: AtomicU64,
    served: AtomicU64,
    peak: AtomicU64,
}

/// What the fake's limits did (see [`FakeAnthropic::limit_concurrency`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LimitCounts {
    pub refused_429: u64,
    pub refused_529: u64,
    /// Requests answered (an answer begun) within the limits.
    pub served: u64,
    /// The most requests in flight at once that it took.
    pub peak: u64,
}

impl Limits {
    /// Takes a request in (`None`), or the status it is refused with.
    fn admit(&self) -> Option<u16> {
        let overloaded = self
            .overloaded_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|t| std::time::Instant::now() < t);
        if overloaded {
            self.refused_529.fetch_add(1, Ordering::SeqCst);
            return Some(529);
        }
        let max = self.max_concurrent.load(Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        if max > 0 && now > max {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            self.refused_429.fetch_add(1, Ordering::SeqCst);
            return Some(429);
        }
        self.served.fetch_add(1, Ordering::SeqCst);
        self.peak.fetch_max(now, Ordering::SeqCst);
        None
    }

    fn done(&self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Cache {
    /// Counts one more request under `key` and returns how many there have been.
    fn count(&self, key: &str) -> u32 {
        let mut seen = self.seen_prompts.lock().unwrap_or_else(|e| e.into_inner());
        let n = seen.entry(key.to_owned()).or_insert(0);
        *n += 1;
        *n
    }

    /// The text the markers are read from: the first rule's script that matches, else the
    /// prompt itself.
    fn scripted(&self, prompt: String) -> String {
        self.rules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(needle, _)| prompt.contains(needle.as_str()))
            .map_or(prompt, |(_, script)| script.clone())
    }
}

fn serve(conn: TcpStream, seen: &Mutex<Vec<Seen>>, ids: &AtomicU64, cache: &Cache) {
    let Ok(read_half) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut conn = conn;
    // Keep-alive: several requests may come on one connection.
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = request_line.split_whitespace();
        let method = parts.next().unwrap_or("").to_owned();
        let path = parts.next().unwrap_or("").to_owned();
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
            }
        }
        let header = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        let body = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            read_chunked(&mut reader)
        } else {
            let len: usize = header("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let mut buf = vec![0u8; len];
            if reader.read_exact(&mut buf).is_err() {
                return;
            }
            buf
        };
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let index = {
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            seen.push(Seen {
                method: method.clone(),
                path: path.clone(),
                headers: headers.clone(),
                body: body.clone(),
                cache_read: 0,
            });
            seen.len() - 1
        };
        let id = ids.fetch_add(1, Ordering::SeqCst);
        let refusal = (method == "POST" && path.starts_with("/v1/messages"))
            .then(|| cache.limits.admit())
            .flatten();
        let ok = if let Some(code) = refusal {
            answer_with(&mut conn, &body, "", id, Some(code), (0, 0, 0))
        } else if method == "POST" && path.starts_with("/v1/messages") {
            let (ok, read) = answer(&mut conn, &body, id, cache);
            cache.limits.done();
            if let Some(s) = seen
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_mut(index)
            {
                s.cache_read = read;
            }
            ok
        } else if method == "POST" && path.starts_with("/v1/chat/completions") {
            answer_chat(&mut conn, &body, id, cache)
        } else {
            // HEAD / and anything else: an empty 200.
            conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .is_ok()
        };
        if !ok {
            return;
        }
    }
}

fn read_chunked(reader: &mut impl BufRead) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let mut size = String::new();
        if reader.read_line(&mut size).unwrap_or(0) == 0 {
            return out;
        }
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            let mut end = String::new();
            let _ = reader.read_line(&mut end);
            return out;
        }
        let mut buf = vec![0u8; n + 2];
        if reader.read_exact(&mut buf).is_err() {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

/// The text of the last user turn (its last text block), and the last tool result in it.
fn last_user(body: &Value) -> (String, Option<String>) {
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let Some(last) = messages
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
    else {
        return (String::new(), None);
    };
    match last.get("content") {
        Some(Value::String(s)) => (s.clone(), None),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            let mut tool = None;
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        text = b
                            .get("text")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned();
                    }
                    Some("tool_result") => {
                        tool = Some(match b.get("content") {
                            Some(Value::String(s)) => s.clone(),
                            Some(Value::Array(parts)) => parts
                                .iter()
                                .filter_map(|p| p.get("text").and_then(Value::as_str))
                                .collect::<Vec<_>>()
                                .join(""),
                            _ => String::new(),
                        });
                    }
                    _ => {}
                }
            }
            (text, tool)
        }
        _ => (String::new(), None),
    }
}

/// How many tool results the conversation holds (the turns an agent has taken).
pub fn tool_results(body: &Value) -> usize {
    body.get("messages")
        .and_then(Value::as_array)
        .map_or(0, |ms| {
            ms.iter()
                .filter_map(|m| m.get("content").and_then(Value::as_array))
                .flatten()
                .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
                .count()
        })
}

/// The first user prompt of the conversation (markers live there).
/// The name of the last tool the assistant called in this conversation.
fn last_tool(body: &Value) -> Option<String> {
    let messages = body.get("messages").and_then(Value::as_array)?;
    messages
        .iter()
        .rev()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
        .flat_map(|m| {
            m.get("content")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .rev()
        })
        .find(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
        .and_then(|b| b.get("name").and_then(Value::as_str).map(str::to_owned))
}

fn first_prompt(body: &Value) -> String {
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for m in &messages {
        if m.get("role").and_then(Value::as_str) != Some("user") {
            continue;
        }
        match m.get("content") {
            Some(Value::String(s)) => return s.clone(),
            Some(Value::Array(blocks)) => {
                if let Some(t) = blocks
                    .iter()
                    .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
                    .filter_map(|b| b.get("text").and_then(Value::as_str))
                    .rfind(|t| !t.starts_with("<system-reminder>"))
                {
                    return t.to_owned();
                }
            }
            _ => {}
        }
    }
    String::new()
}

/// The text of marker `[[name:TEXT]]`: up to the `]]` that closes it, brackets inside TEXT
/// (JSON arrays, shell tests) balanced, so several markers can share one prompt.
fn marker<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let open = format!("[[{name}:");
    let start = text.find(&open)? + open.len();
    let rest = &text[start..];
    let bytes = rest.as_bytes();
    let mut depth = 0usize;
    for (i, b) in bytes.iter().enumerate() {
        match b {
            b'[' => depth += 1,
            b']' if depth == 0 && bytes.get(i + 1) == Some(&b']') => return Some(&rest[..i]),
            b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

fn fill(schema: &Value) -> Value {
    if let Some(v) = schema.get("const") {
        return v.clone();
    }
    if let Some(first) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.first())
    {
        return first.clone();
    }
    let kind = schema.get("type").and_then(Value::as_str).or_else(|| {
        if schema.get("properties").is_some() {
            Some("object")
        } else if schema.get("items").is_some() {
            Some("array")
        } else {
            None
        }
    });
    match kind {
        Some("object") => {
            let mut out = serde_json::Map::new();
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                for (k, v) in props {
                    out.insert(k.clone(), fill(v));
                }
            }
            Value::Object(out)
        }
        // One item (or minItems), so a made-up answer has something in it.
        Some("array") => {
            let n = schema.get("minItems").and_then(Value::as_u64).unwrap_or(1);
            let item = schema.get("items").cloned().unwrap_or(Value::Null);
            Value::Array((0..n).map(|_| fill(&item)).collect())
        }
        Some("number") | Some("integer") => json!(1),
        Some("boolean") => json!(true),
        Some("null") => Value::Null,
        _ => json!("fake"),
    }
}

/// How many block boundaries before a breakpoint the cache looks back for a prefix it holds,
/// as the Messages API does (about 20).
const LOOKBACK: usize = 20;

/// A request's prefixes: (hash of the prefix through the block, tokens through it, whether the
/// block is a cache breakpoint), one per block in order, and its tokens in all; tokens are
/// counted as characters / 4.
type Prefixes = (Vec<(u64, u64, bool)>, u64);

/// The cache tokens a request with `prefixes` reads: the longest prefix the cache holds that
/// ends at one of its breakpoints or at most [`LOOKBACK`] blocks before one.
fn cached(prefixes: &[(u64, u64, bool)], known: &std::collections::HashSet<u64>) -> u64 {
    let mut read = 0;
    for (i, _) in prefixes.iter().enumerate().filter(|(_, p)| p.2) {
        let from = i.saturating_sub(LOOKBACK);
        if let Some((_, t, _)) = prefixes[from..=i]
            .iter()
            .rev()
            .find(|p| known.contains(&p.0))
        {
            read = read.max(*t);
        }
    }
    read
}

/// Every block boundary of a request and its tokens in all ([`Prefixes`]).
fn breakpoints(body: &Value) -> Prefixes {
    use std::hash::{Hash, Hasher};
    let mut blocks: Vec<Value> = Vec::new();
    for t in body
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        blocks.push(t.clone());
    }
    match body.get("system") {
        Some(Value::Array(s)) => blocks.extend(s.iter().cloned()),
        Some(Value::String(s)) => blocks.push(json!({"type": "text", "text": s})),
        _ => {}
    }
    for m in body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        match m.get("content") {
            Some(Value::Array(c)) => blocks.extend(c.iter().cloned()),
            Some(other) => blocks.push(other.clone()),
            None => {}
        }
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let mut chars = 0u64;
    let mut out = Vec::new();
    for b in blocks {
        let marked = b.get("cache_control").is_some();
        let mut plain = b.clone();
        if let Some(o) = plain.as_object_mut() {
            o.remove("cache_control");
        }
        let text = plain.to_string();
        text.hash(&mut hasher);
        chars += text.len() as u64;
        out.push((hasher.finish(), chars / 4, marked));
    }
    (out, chars / 4)
}

/// Writes the response to one `/v1/messages` request; whether the connection goes on, and
/// the cache tokens it read.
fn answer(conn: &mut TcpStream, body: &Value, id: u64, cache: &Cache) -> (bool, u64) {
    let (points, total) = breakpoints(body);
    // `[[fail-first:N:CODE]]`: the first N requests of this prompt fail with CODE.
    let prompt = cache.scripted(first_prompt(body));
    let forced = marker(&prompt, "fail-first").and_then(|spec| {
        let (n, code) = spec.split_once(':')?;
        let (n, code) = (n.parse::<u32>().ok()?, code.parse::<u16>().ok()?);
        (cache.count(&prompt) <= n).then_some(code)
    });
    // `[[stall-first:N]]`: the first N requests of this prompt stall after `message_start`.
    let stall = marker(&prompt, "stall-first")
        .and_then(|n| n.parse::<u32>().ok())
        .is_some_and(|n| cache.count(&format!("stall:{prompt}")) <= n);
    let at = tool_results(body);
    let stall_at = marker(&prompt, "stall-at")
        .and_then(|k| k.parse::<usize>().ok())
        .is_some_and(|k| k == at && cache.count(&format!("stall-at:{prompt}:{k}")) == 1);
    if stall || stall_at {
        // Its response began: what it cached is there for the next request, as on the API.
        cache
            .prefixes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(points.iter().filter(|p| p.2).map(|(h, _, _)| *h));
        return (stall_stream(conn, body, id), 0);
    }
    let status = forced.or_else(|| marker(&prompt, "status").and_then(|c| c.parse::<u16>().ok()));
    // What the cache reads and writes: up to the last breakpoint.
    let last = points.iter().rev().find(|p| p.2).map_or(0, |(_, t, _)| *t);
    let (read, written) = {
        let known = cache.prefixes.lock().unwrap_or_else(|e| e.into_inner());
        let read = cached(&points, &known);
        (read, last.saturating_sub(read))
    };
    // The model thinks; only then does the response (and its cache entry) begin.
    std::thread::sleep(std::time::Duration::from_millis(150));
    if status.is_none() {
        cache
            .prefixes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(points.iter().filter(|p| p.2).map(|(h, _, _)| *h));
    }
    let ok = answer_with(
        conn,
        body,
        &prompt,
        id,
        status,
        (total.saturating_sub(last), read, written),
    );
    (ok, read)
}

/// Holds a connection open, reading and dropping what comes, until the client closes it (or
/// two minutes pass).
fn hold_open(conn: &mut TcpStream) -> bool {
    let _ = conn.set_read_timeout(Some(std::time::Duration::from_millis(500)));
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut buf = [0u8; 1024];
    while std::time::Instant::now() < until {
        match conn.read(&mut buf) {
            Ok(0) => return false,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return false,
        }
    }
    false
}

/// Starts a streamed answer and then sends nothing more, holding the connection until the
/// client goes away (or two minutes pass).
fn stall_stream(conn: &mut TcpStream, body: &Value, id: u64) -> bool {
    let model = body.get("model").cloned().unwrap_or(json!("fake"));
    let start = json!({"type": "message_start", "message": {"id": format!("msg_fake_{id}"),
        "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 1, "output_tokens": 1}}});
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nrequest-id: req_fake_{id}\r\ncontent-length: 100000\r\n\r\nevent: message_start\ndata: {start}\n\n"
    );
    if conn.write_all(head.as_bytes()).is_err() {
        return false;
    }
    hold_open(conn)
}

fn answer_with(
    conn: &mut TcpStream,
    body: &Value,
    prompt: &str,
    id: u64,
    status: Option<u16>,
    (uncached, cache_read, cache_write): (u64, u64, u64),
) -> bool {
    if let Some(code) = status {
        let kind = match code {
            429 => "rate_limit_error",
            529 => "overloaded_error",
            401 => "authentication_error",
            400 => "invalid_request_error",
            _ => "api_error",
        };
        let err =
            json!({"type": "error", "error": {"type": kind, "message": format!("fake {kind}")}})
                .to_string();
        let resp = format!(
            "HTTP/1.1 {code} Error\r\ncontent-type: application/json\r\nrequest-id: req_fake_{id}\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n{err}",
            err.len()
        );
        return conn.write_all(resp.as_bytes()).is_ok();
    }
    let (_, tool_output) = last_user(body);
    let tools: Vec<Value> = body
        .get("tools")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let structured = tools
        .iter()
        .find(|t| t.get("name").and_then(Value::as_str) == Some("StructuredOutput"));
    // The blocks of the reply and why it stops.
    let after_structured = last_tool(body).as_deref() == Some("StructuredOutput");
    let turns = marker(prompt, "turns").and_then(|n| n.parse::<usize>().ok());
    let (blocks, stop) = if let Some(n) = turns.filter(|_| structured.is_none()) {
        let k = tool_results(body);
        if k < n {
            (
                vec![
                    json!({"type": "tool_use", "id": format!("toolu_fake_{id}"), "name": "Bash",
                    "input": {"command": format!("echo turn {}", k + 1), "description": "one more turn"}}),
                ],
                "tool_use",
            )
        } else {
            (
                vec![json!({"type": "text", "text": format!("done after {n} turns")})],
                "end_turn",
            )
        }
    } else if let (Some(_), Some(tool), false) = (&tool_output, structured, after_structured) {
        // A tool ran and a structured result is still due: submit it now.
        let value = marker(prompt, "json")
            .and_then(|j| serde_json::from_str(j).ok())
            .unwrap_or_else(|| fill(tool.get("input_schema").unwrap_or(&Value::Null)));
        (
            vec![
                json!({"type": "tool_use", "id": format!("toolu_fake_{id}"), "name": "StructuredOutput", "input": value}),
            ],
            "tool_use",
        )
    } else if let Some(out) = tool_output {
        (
            vec![json!({"type": "text", "text": format!("tool said: {}", out.trim())})],
            "end_turn",
        )
    } else if let Some((name, input)) = marker(prompt, "tool").and_then(|t| t.split_once(':')) {
        let input: Value = serde_json::from_str(input).unwrap_or_else(
            |e| json!({ "fake_error": format!("[[tool:{name}:...]] is not JSON: {e}") }),
        );
        (
            vec![
                json!({"type": "tool_use", "id": format!("toolu_fake_{id}"), "name": name, "input": input}),
            ],
            "tool_use",
        )
    } else if let Some(cmd) = marker(prompt, "bash") {
        (
            vec![
                json!({"type": "tool_use", "id": format!("toolu_fake_{id}"), "name": "Bash",
                "input": {"command": cmd, "description": "run a command"}}),
            ],
            "tool_use",
        )
    } else if let Some(tool) = structured {
        let value = marker(prompt, "json")
            .and_then(|j| serde_json::from_str(j).ok())
            .unwrap_or_else(|| fill(tool.get("input_schema").unwrap_or(&Value::Null)));
        (
            vec![
                json!({"type": "tool_use", "id": format!("toolu_fake_{id}"), "name": "StructuredOutput", "input": value}),
            ],
            "tool_use",
        )
    } else {
        let short: String = prompt.chars().take(200).collect();
        (
            vec![json!({"type": "text", "text": format!("fake reply to: {short}")})],
            "end_turn",
        )
    };
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("claude-fake")
        .to_owned();
    let output_tokens = 7u64;
    let usage = json!({"input_tokens": uncached, "cache_creation_input_tokens": cache_write,
        "cache_read_input_tokens": cache_read, "output_tokens": output_tokens,
        "cache_creation": {"ephemeral_5m_input_tokens": cache_write, "ephemeral_1h_input_tokens": 0}});
    let msg_id = format!("msg_fake_{id}");
    if body.get("stream").and_then(Value::as_bool) != Some(true) {
        let msg = json!({"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": stop, "stop_sequence": null, "usage": usage})
        .to_string();
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nrequest-id: req_fake_{id}\r\ncontent-length: {}\r\n\r\n{msg}",
            msg.len()
        );
        return conn.write_all(resp.as_bytes()).is_ok();
    }
    let mut start_usage = usage.clone();
    start_usage["output_tokens"] = json!(1);
    let mut events = vec![
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": msg_id, "type": "message",
            "role": "assistant", "model": model, "content": [], "stop_reason": null,
            "stop_sequence": null, "usage": start_usage}}),
        ),
        ("ping", json!({"type": "ping"})),
    ];
    for (i, b) in blocks.iter().enumerate() {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => {
                events.push((
                    "content_block_start",
                    json!({"type": "content_block_start", "index": i,
                    "content_block": {"type": "text", "text": ""}}),
                ));
                events.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": i,
                    "delta": {"type": "text_delta", "text": b["text"]}}),
                ));
            }
            _ => {
                events.push(("content_block_start", json!({"type": "content_block_start", "index": i,
                    "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}})));
                events.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": i,
                    "delta": {"type": "input_json_delta", "partial_json": b["input"].to_string()}}),
                ));
            }
        }
        events.push((
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        ));
    }
    events.push(("message_delta", json!({"type": "message_delta",
        "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": output_tokens}})));
    events.push(("message_stop", json!({"type": "message_stop"})));
    let mut sse = String::new();
    for (name, data) in events {
        sse.push_str(&format!("event: {name}\ndata: {data}\n\n"));
    }
    let resp = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nrequest-id: req_fake_{id}\r\ncontent-length: {}\r\n\r\n{sse}",
        sse.len()
    );
    conn.write_all(resp.as_bytes()).is_ok()
}

/// Writes the response to one `/v1/chat/completions` request.
fn answer_chat(conn: &mut TcpStream, body: &Value, id: u64, cache: &Cache) -> bool {
    let prompt = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| {
            m.iter()
                .find(|x| x.get("role").and_then(Value::as_str) == Some("user"))
                .and_then(|x| x.get("content"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_default();
    // `[[stall-first:N]]`: the first N requests of this prompt get the stream's first chunk and
    // then nothing, on a connection held open.
    let stall = marker(&prompt, "stall-first")
        .and_then(|n| n.parse::<u32>().ok())
        .is_some_and(|n| cache.count(&format!("chat-stall:{prompt}")) <= n);
    // `[[stall-at:K]]`: the first request whose conversation holds K answers of the model
    // stalls so (an agent interrupted after K turns).
    let said = body
        .get("messages")
        .and_then(Value::as_array)
        .map_or(0, |m| {
            m.iter()
                .filter(|x| x.get("role").and_then(Value::as_str) == Some("assistant"))
                .count()
        });
    let stall_at = marker(&prompt, "stall-at")
        .and_then(|k| k.parse::<usize>().ok())
        .is_some_and(|k| k == said && cache.count(&format!("chat-stall-at:{prompt}:{k}")) == 1);
    if stall || stall_at {
        let first = json!({"id": format!("chatcmpl-fake-{id}"), "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]});
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100000\r\n\r\ndata: {first}\n\n"
        );
        return conn.write_all(head.as_bytes()).is_ok() && hold_open(conn);
    }
    if let Some(code) = marker(&prompt, "status").and_then(|c| c.parse::<u16>().ok()) {
        let err =
            json!({"error": {"message": format!("fake error {code}"), "type": "server_error"}})
                .to_string();
        let resp = format!(
            "HTTP/1.1 {code} Error\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n{err}",
            err.len()
        );
        return conn.write_all(resp.as_bytes()).is_ok();
    }
    let schema = body.pointer("/response_format/json_schema/schema");
    let content = match (marker(&prompt, "json"), schema) {
        (Some(j), _) => j.to_owned(),
        (None, Some(s)) => fill(s).to_string(),
        (None, None) => format!(
            "fake reply to: {}",
            prompt.chars().take(200).collect::<String>()
        ),
    };
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("gpt-fake")
        .to_owned();
    let prompt_tokens = (body.to_string().len() / 4) as u64;
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5, "prompt_tokens_details": {"cached_tokens": 0}});
    let cid = format!("chatcmpl-fake-{id}");
    if body.get("stream").and_then(Value::as_bool) != Some(true) {
        let msg = json!({"id": cid, "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": usage}).to_string();
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{msg}",
            msg.len()
        );
        return conn.write_all(resp.as_bytes()).is_ok();
    }
    let chunk = |delta: Value, finish: Value| {
        json!({"id": cid, "object": "chat.completion.chunk",
        "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut sse = String::new();
    for c in [
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(json!({"content": content}), Value::Null),
        chunk(json!({}), json!("stop")),
    ] {
        sse.push_str(&format!("data: {c}\n\n"));
    }
    if body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true)
    {
        let u = json!({"id": cid, "object": "chat.completion.chunk", "model": model, "choices": [], "usage": usage});
        sse.push_str(&format!("data: {u}\n\n"));
    }
    sse.push_str("data: [DONE]\n\n");
    let resp = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{sse}",
        sse.len()
    );
    conn.write_all(resp.as_bytes()).is_ok()
}
