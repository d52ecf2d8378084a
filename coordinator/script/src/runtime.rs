//! The JS thread: one QuickJS runtime and context per run, driven by a plain loop.
//!
//! The script body is wrapped in an async function and called. From then on the thread
//! alternates between running QuickJS jobs and blocking on [`HostReply`]s: every `agent()` or
//! `workflow()` call becomes a [`ScriptOp`] for the run engine plus a pending promise here,
//! settled when the engine replies. The thread never touches the network, storage or the
//! clock (except for its own CPU-time accounting).
//!
//! Limits: a memory limit (QuickJS allocator), a CPU-time limit per slice (a slice is the code
//! run between two waits for the host, measured as thread CPU time through the interrupt
//! handler), a stack limit. A promise that can never settle (nothing in flight, no jobs) ends
//! the run instead of hanging it.
//!
//! Invariant: the run ends with exactly one [`ScriptOp::Finished`].

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use rquickjs::context::EvalOptions;
use rquickjs::function::Rest;
use rquickjs::{
    CatchResultExt, CaughtError, Context, Ctx, Function, Object, Promise, Runtime, Value,
};
use tokio::sync::mpsc;

const PRELUDE: &str = include_str!("prelude.js");
/// File name scripts are compiled under; errors and stacks refer to it.
pub const SCRIPT_FILE: &str = "script.js";

/// Resource limits of one run's script.
#[derive(Debug, Clone, Copy)]
pub struct ScriptLimits {
    /// Heap limit of the QuickJS runtime.
    pub memory_bytes: usize,
    /// CPU time the script may use between two waits for the host.
    pub cpu: Duration,
    /// Stack limit of the QuickJS interpreter.
    pub stack_bytes: usize,
}

impl Default for ScriptLimits {
    fn default() -> Self {
        ScriptLimits {
            memory_bytes: 512 << 20,
            cpu: Duration::from_secs(10),
            stack_bytes: 4 << 20,
        }
    }
}

/// What the JS thread needs to run a script.
#[derive(Debug, Clone)]
pub struct ScriptInput {
    /// The prepared body (`text::prepare`), `export` already blanked out.
    pub body: String,
    /// `args` as JSON, or `None` for `undefined`.
    pub args_json: Option<String>,
    /// `budget.total` in output tokens.
    pub budget_total: Option<u64>,
    pub limits: ScriptLimits,
}

/// State shared between the JS thread and the run engine.
#[derive(Debug, Default)]
pub struct ScriptShared {
    /// Output tokens spent by the run so far (`budget.spent()`).
    pub spent: AtomicU64,
    /// Set to interrupt running JS (stop).
    pub stop: AtomicBool,
    /// The script waits for the host (every op it sent is sent; it runs nothing until a
    /// reply comes).
    pub waiting: AtomicBool,
}

/// A request from the script to the run engine.
#[derive(Debug)]
pub enum ScriptOp {
    /// `agent(prompt, opts)`: `opts_json` is the options object as JSON.
    Agent {
        id: u64,
        prompt: String,
        opts_json: String,
        group: String,
        /// Name of the child workflow making the call, or empty for the top-level script.
        child: String,
    },
    Phase(String),
    Log(String),
    /// A failure line from `parallel()` / `pipeline()`.
    Failure(String),
    /// `ask(question, opts)` (an extension): a person's answer, awaited durably. `opts_json`
    /// is `{ schema, timeout, label }` as JSON, already checked for shape by the prelude.
    Ask {
        id: u64,
        question: String,
        opts_json: String,
    },
    /// `workflow(ref)`: `reference` is a JSON string (a name) or `{ "scriptPath": ... }`.
    ResolveWorkflow {
        id: u64,
        reference: String,
    },
    /// The script ended.
    Finished(ScriptEnd),
}

/// The engine's answer to a pending promise, or a stop.
#[derive(Debug)]
pub enum HostReply {
    /// Settles an `agent()` promise: resolved with the JSON value, or rejected.
    Agent {
        id: u64,
        result: Result<String, HostError>,
    },
    /// Settles a `workflow()` resolution: the child's name and prepared body.
    Workflow {
        id: u64,
        result: Result<(String, String), HostError>,
    },
    /// Ends the script now (run stopped); pending promises are never settled (W24).
    Stop,
}

/// A rejection: a JS `Error` with `message` and a machine-readable `code`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostError {
    pub message: String,
    pub code: crate::reject::RejectCode,
}

impl HostError {
    pub fn new(code: crate::reject::RejectCode, message: impl Into<String>) -> Self {
        HostError {
            message: message.into(),
            code,
        }
    }
}

/// How a script ended.
#[derive(Debug, Clone, PartialEq)]
pub enum ScriptEnd {
    /// It returned; the value as JSON (`None`: `undefined`).
    Returned(Option<String>),
    Failed(ScriptFailure),
}

/// Why a script failed.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptFailure {
    pub kind: FailureKind,
    pub message: String,
    /// Line of the script the failure points at, when known.
    pub line: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The body could not be compiled.
    Syntax,
    /// An uncaught exception (including a rejected `agent()` that was awaited).
    Thrown,
    CpuLimit,
    MemoryLimit,
    /// Awaiting something that can never settle.
    Deadlock,
    /// The return value cannot be turned into JSON.
    ResultNotJson,
    /// The run was stopped from outside.
    Stopped,
    /// The runtime itself failed (a bug).
    Internal,
}

impl std::fmt::Display for ScriptFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Checks that a prepared body compiles, without running anything.
pub fn check_syntax(body: &str) -> Result<(), ScriptFailure> {
    let internal = |e: rquickjs::Error| ScriptFailure {
        kind: FailureKind::Internal,
        message: format!("cannot start the script engine: {e}"),
        line: None,
    };
    let rt = Runtime::new().map_err(internal)?;
    rt.set_memory_limit(64 << 20);
    let ctx = Context::full(&rt).map_err(internal)?;
    ctx.with(|ctx| {
        let compiled: rquickjs::Result<Value> = ctx.eval_with_options(wrap(body), eval_opts());
        match compiled.catch(&ctx) {
            Ok(_) => Ok(()),
            Err(e) => {
                let mut f = failure_from(&ctx, FailureKind::Syntax, e, None);
                // W01: newer builds name the line; and TypeScript gets a hint of its own.
                if let Some(text) = f
                    .line
                    .and_then(|l| body.lines().nth((l as usize).saturating_sub(1)))
                {
                    let shown: String = text.trim().chars().take(160).collect();
                    f.message.push_str(&format!(" — `{shown}`"));
                    if looks_like_typescript(text) {
                        f.message.push_str(
                            "; type annotations are not JavaScript: workflow scripts are plain JavaScript (W01), so remove the types (`: string`, `interface`, `as T`)",
                        );
                    }
                }
                Err(f)
            }
        }
    })
}

/// Whether a line that failed to parse looks like TypeScript: a typed binding or parameter,
/// a return type, `interface`/`type` declarations, an `as` cast, a non-null `!.`.
fn looks_like_typescript(line: &str) -> bool {
    let t = line.trim_start();
    if t.starts_with("interface ") || t.starts_with("type ") && t.contains('=') {
        return true;
    }
    let words: Vec<&str> = t
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$'))
        .filter(|w| !w.is_empty())
        .collect();
    let typed = |after: &str| {
        // `name: Type` where Type is a known or capitalized type name.
        let ty = after.trim_start();
        [
            "string", "number", "boolean", "any", "unknown", "void", "never", "object", "Record",
            "Array", "Promise",
        ]
        .iter()
        .any(|k| ty.starts_with(k))
            || ty.chars().next().is_some_and(char::is_uppercase)
    };
    let bytes: Vec<(usize, char)> = t.char_indices().collect();
    for (i, c) in &bytes {
        if *c == ':' {
            let before = t[..*i].trim_end();
            let after = &t[*i + 1..];
            // `const x: T`, `(a: T`, `, b: T`, `): T {`
            if (before.ends_with(')')
                || before.split_whitespace().count() >= 2
                || before.ends_with(|ch: char| ch.is_alphanumeric()))
                && typed(after)
                && (words
                    .first()
                    .is_some_and(|w| ["const", "let", "var", "function", "async"].contains(w))
                    || before.ends_with(')')
                    || before.contains('('))
            {
                return true;
            }
        }
    }
    t.contains(" as ")
        && words
            .windows(2)
            .any(|w| w[0] == "as" && (typed(w[1]) || w[1] == "const"))
}

/// What the body is wrapped in; it shares line 1 with the body so line numbers stay those of
/// the file.
const WRAP_PREFIX: &str = "(async function () {";

fn wrap(body: &str) -> String {
    format!("{WRAP_PREFIX}{body}\n}})")
}

fn eval_opts() -> EvalOptions {
    let mut opts = EvalOptions::default();
    opts.global = true;
    opts.strict = false;
    opts.filename = Some(SCRIPT_FILE.to_owned());
    opts
}

/// Runs a script on a new thread. Ops go to `ops`; replies come back through the returned
/// sender. The thread ends after sending [`ScriptOp::Finished`].
pub fn spawn(
    input: ScriptInput,
    ops: mpsc::UnboundedSender<ScriptOp>,
    shared: Arc<ScriptShared>,
) -> std::io::Result<(std_mpsc::Sender<HostReply>, std::thread::JoinHandle<()>)> {
    let (reply_tx, reply_rx) = std_mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("flotilla-js".into())
        .stack_size(input.limits.stack_bytes + (8 << 20))
        .spawn(move || {
            let end = run(&input, &ops, &reply_rx, &shared);
            let _ = ops.send(ScriptOp::Finished(end));
        })?;
    Ok((reply_tx, handle))
}

/// Why the interrupt handler stopped JS.
const TRIP_NONE: u8 = 0;
const TRIP_CPU: u8 = 1;
const TRIP_STOP: u8 = 2;

struct Meter {
    slice_start_ns: AtomicU64,
    limit_ns: u64,
    tripped: AtomicU8,
}

impl Meter {
    fn start_slice(&self) {
        self.slice_start_ns
            .store(thread_cpu_ns(), Ordering::Relaxed);
    }
}

fn thread_cpu_ns() -> u64 {
    use nix::time::{ClockId, clock_gettime};
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

struct Pending<'js> {
    resolve: Function<'js>,
    reject: Function<'js>,
}

struct Host<'js> {
    next_id: u64,
    pending: HashMap<u64, Pending<'js>>,
    error_factory: Option<Function<'js>>,
}

fn run(
    input: &ScriptInput,
    ops: &mpsc::UnboundedSender<ScriptOp>,
    replies: &std_mpsc::Receiver<HostReply>,
    shared: &Arc<ScriptShared>,
) -> ScriptEnd {
    let internal = |e: rquickjs::Error| {
        ScriptEnd::Failed(ScriptFailure {
            kind: FailureKind::Internal,
            message: format!("cannot start the script engine: {e}"),
            line: None,
        })
    };
    let rt = match Runtime::new() {
        Ok(rt) => rt,
        Err(e) => return internal(e),
    };
    rt.set_memory_limit(input.limits.memory_bytes);
    rt.set_max_stack_size(input.limits.stack_bytes);
    let meter = Arc::new(Meter {
        slice_start_ns: AtomicU64::new(thread_cpu_ns()),
        limit_ns: input.limits.cpu.as_nanos() as u64,
        tripped: AtomicU8::new(TRIP_NONE),
    });
    {
        let meter = meter.clone();
        let shared = shared.clone();
        rt.set_interrupt_handler(Some(Box::new(move || {
            if shared.stop.load(Ordering::Relaxed) {
                meter.tripped.store(TRIP_STOP, Ordering::Relaxed);
                return true;
            }
            let used = thread_cpu_ns().saturating_sub(meter.slice_start_ns.load(Ordering::Relaxed));
            if used > meter.limit_ns {
                meter.tripped.store(TRIP_CPU, Ordering::Relaxed);
                return true;
            }
            false
        })));
    }
    let ctx = match Context::full(&rt) {
        Ok(ctx) => ctx,
        Err(e) => return internal(e),
    };
    let end = ctx.with(|ctx| {
        let host = Rc::new(RefCell::new(Host {
            next_id: 0,
            pending: HashMap::new(),
            error_factory: None,
        }));
        let end = drive(&ctx, input, ops, replies, shared, &meter, &host);
        // Drop every JS value we hold before the context goes away.
        let mut h = host.borrow_mut();
        h.pending.clear();
        h.error_factory = None;
        end
    });
    drop(ctx);
    rt.run_gc();
    end
}

fn drive<'js>(
    ctx: &Ctx<'js>,
    input: &ScriptInput,
    ops: &mpsc::UnboundedSender<ScriptOp>,
    replies: &std_mpsc::Receiver<HostReply>,
    shared: &Arc<ScriptShared>,
    meter: &Meter,
    host: &Rc<RefCell<Host<'js>>>,
) -> ScriptEnd {
    let limits = input.limits;
    let fail = |kind, message: String, line| {
        ScriptEnd::Failed(ScriptFailure {
            kind,
            message,
            line,
        })
    };
    if let Err(e) = install_host(ctx, input, ops, shared, host) {
        return fail(
            FailureKind::Internal,
            format!("cannot install the workflow globals: {e}"),
            None,
        );
    }
    meter.start_slice();
    let prelude: rquickjs::Result<Value> = ctx.eval_with_options(PRELUDE, {
        let mut o = eval_opts();
        o.filename = Some("prelude.js".into());
        o
    });
    if let Err(e) = prelude.catch(ctx) {
        // A stop that came while the prelude ran interrupted it: the run was stopped.
        if let Some(end) = tripped(meter, limits) {
            return end;
        }
        return fail(
            FailureKind::Internal,
            format!("the workflow prelude failed: {e}"),
            None,
        );
    }

    meter.start_slice();
    let main: rquickjs::Result<Function> = ctx.eval_with_options(wrap(&input.body), eval_opts());
    let main = match main.catch(ctx) {
        Ok(f) => f,
        Err(_) if let Some(end) = tripped(meter, limits) => return end,
        Err(e) => return ScriptEnd::Failed(failure_from(ctx, FailureKind::Syntax, e, Some(meter))),
    };
    let called: rquickjs::Result<Promise> = main.call(());
    let promise = match called.catch(ctx) {
        Ok(p) => p,
        Err(e) => return ScriptEnd::Failed(classify(ctx, e, meter, limits, &input.body)),
    };
    if let Some(end) = tripped(meter, limits) {
        return end;
    }

    loop {
        // Run every job that is ready: promise continuations of the script.
        while ctx.execute_pending_job() {
            if let Some(end) = tripped(meter, limits) {
                return end;
            }
        }
        if let Some(end) = tripped(meter, limits) {
            return end;
        }
        if let Some(end) = settled(ctx, &promise, meter, limits, &input.body) {
            return end;
        }
        if host.borrow().pending.is_empty() {
            return fail(
                FailureKind::Deadlock,
                "the script is waiting on a promise that can never settle: no agent() or workflow() call is in flight (a promise that is never resolved?)".into(),
                None,
            );
        }
        // Wait for the host, then apply everything that has arrived. Meanwhile the script
        // runs nothing: the run may set it aside (`waiting`) and replay it later.
        shared.waiting.store(true, Ordering::Release);
        let got = replies.recv();
        shared.waiting.store(false, Ordering::Release);
        let Ok(first) = got else {
            return fail(
                FailureKind::Stopped,
                "the run engine went away".into(),
                None,
            );
        };
        meter.start_slice();
        let mut next = Some(first);
        while let Some(reply) = next {
            if matches!(reply, HostReply::Stop) {
                return fail(FailureKind::Stopped, "the run was stopped".into(), None);
            }
            if let Err(e) = settle(ctx, host, reply) {
                return fail(
                    FailureKind::Internal,
                    format!("cannot settle a promise: {e}"),
                    None,
                );
            }
            next = replies.try_recv().ok();
        }
    }
}

/// How the script ended once its main promise settled (`None` while it is pending): the
/// JSON of what it returned, or why it failed.
fn settled<'js>(
    ctx: &Ctx<'js>,
    promise: &Promise<'js>,
    meter: &Meter,
    limits: ScriptLimits,
    body: &str,
) -> Option<ScriptEnd> {
    let fail = |kind, message: String| {
        ScriptEnd::Failed(ScriptFailure {
            kind,
            message,
            line: None,
        })
    };
    match promise.state() {
        rquickjs::promise::PromiseState::Resolved => {
            let value: rquickjs::Result<Value> =
                promise.result().unwrap_or(Err(rquickjs::Error::Unknown));
            Some(match value.catch(ctx) {
                Ok(v) => match ctx.json_stringify(v).catch(ctx) {
                    Ok(s) => ScriptEnd::Returned(s.and_then(|s| s.to_string().ok())),
                    Err(e) => fail(
                        FailureKind::ResultNotJson,
                        format!(
                            "the script's return value cannot be turned into JSON ({}); return plain data",
                            caught_message(&e)
                        ),
                    ),
                },
                Err(e) => ScriptEnd::Failed(classify(ctx, e, meter, limits, body)),
            })
        }
        rquickjs::promise::PromiseState::Rejected => {
            let value: rquickjs::Result<Value> =
                promise.result().unwrap_or(Err(rquickjs::Error::Unknown));
            Some(match value.catch(ctx) {
                Ok(_) => fail(
                    FailureKind::Internal,
                    "the script's promise rejected without a reason".into(),
                ),
                Err(e) => ScriptEnd::Failed(classify(ctx, e, meter, limits, body)),
            })
        }
        rquickjs::promise::PromiseState::Pending => None,
    }
}

fn tripped(meter: &Meter, limits: ScriptLimits) -> Option<ScriptEnd> {
    match meter.tripped.load(Ordering::Relaxed) {
        TRIP_CPU => Some(ScriptEnd::Failed(cpu_failure(limits))),
        TRIP_STOP => Some(ScriptEnd::Failed(ScriptFailure {
            kind: FailureKind::Stopped,
            message: "the run was stopped".into(),
            line: None,
        })),
        _ => None,
    }
}

fn cpu_failure(limits: ScriptLimits) -> ScriptFailure {
    ScriptFailure {
        kind: FailureKind::CpuLimit,
        message: format!(
            "the script ran for more than {} of CPU time without waiting for an agent (a runaway loop?); \
             the limit between awaits is set with --script-cpu",
            human(limits.cpu)
        ),
        line: None,
    }
}

fn human(d: Duration) -> String {
    if d.as_millis() < 1000 {
        format!("{}ms", d.as_millis())
    } else if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

fn settle<'js>(
    ctx: &Ctx<'js>,
    host: &Rc<RefCell<Host<'js>>>,
    reply: HostReply,
) -> rquickjs::Result<()> {
    let (id, outcome): (u64, Result<Value<'js>, HostError>) = match reply {
        HostReply::Agent { id, result } => {
            let v = match result {
                Ok(json) => Ok(ctx.json_parse(json)?),
                Err(e) => Err(e),
            };
            (id, v)
        }
        HostReply::Workflow { id, result } => {
            let v = match result {
                Ok((name, body)) => {
                    let o = Object::new(ctx.clone())?;
                    o.set("name", name)?;
                    o.set("body", body)?;
                    Ok(o.into_value())
                }
                Err(e) => Err(e),
            };
            (id, v)
        }
        HostReply::Stop => return Ok(()),
    };
    let Some(p) = host.borrow_mut().pending.remove(&id) else {
        return Ok(());
    };
    match outcome {
        Ok(v) => p.resolve.call::<_, ()>((v,)),
        Err(e) => {
            let err = make_error(ctx, host, &e)?;
            p.reject.call::<_, ()>((err,))
        }
    }
}

fn make_error<'js>(
    ctx: &Ctx<'js>,
    host: &Rc<RefCell<Host<'js>>>,
    e: &HostError,
) -> rquickjs::Result<Value<'js>> {
    let factory = host.borrow().error_factory.clone();
    match factory {
        Some(f) => f.call((e.message.as_str(), e.code.as_str())),
        None => Ok(rquickjs::String::from_str(ctx.clone(), &e.message)?.into_value()),
    }
}

fn new_pending<'js>(
    ctx: &Ctx<'js>,
    host: &Rc<RefCell<Host<'js>>>,
) -> rquickjs::Result<(u64, Promise<'js>)> {
    let (promise, resolve, reject) = ctx.promise()?;
    let mut h = host.borrow_mut();
    h.next_id += 1;
    let id = h.next_id;
    h.pending.insert(id, Pending { resolve, reject });
    Ok((id, promise))
}

/// The host functions that return a promise the run settles: `agent`, `ask`,
/// `resolveWorkflow`.
fn install_calls<'js>(
    ctx: &Ctx<'js>,
    h: &Object<'js>,
    ops: &mpsc::UnboundedSender<ScriptOp>,
    host: &Rc<RefCell<Host<'js>>>,
) -> rquickjs::Result<()> {
    let (hs, tx) = (host.clone(), ops.clone());
    h.set(
        "agent",
        Function::new(
            ctx.clone(),
            move |ctx: Ctx<'js>,
                  prompt: String,
                  opts_json: String,
                  group: String,
                  child: String|
                  -> rquickjs::Result<Promise<'js>> {
                let (id, promise) = new_pending(&ctx, &hs)?;
                if tx
                    .send(ScriptOp::Agent {
                        id,
                        prompt,
                        opts_json,
                        group,
                        child,
                    })
                    .is_err()
                {
                    hs.borrow_mut().pending.remove(&id);
                }
                Ok(promise)
            },
        )?,
    )?;

    let (hs, tx) = (host.clone(), ops.clone());
    h.set(
        "resolveWorkflow",
        Function::new(
            ctx.clone(),
            move |ctx: Ctx<'js>, reference: String| -> rquickjs::Result<Promise<'js>> {
                let (id, promise) = new_pending(&ctx, &hs)?;
                if tx
                    .send(ScriptOp::ResolveWorkflow { id, reference })
                    .is_err()
                {
                    hs.borrow_mut().pending.remove(&id);
                }
                Ok(promise)
            },
        )?,
    )?;

    let (hs, tx) = (host.clone(), ops.clone());
    h.set(
        "ask",
        Function::new(
            ctx.clone(),
            move |ctx: Ctx<'js>,
                  question: String,
                  opts_json: String|
                  -> rquickjs::Result<Promise<'js>> {
                let (id, promise) = new_pending(&ctx, &hs)?;
                if tx
                    .send(ScriptOp::Ask {
                        id,
                        question,
                        opts_json,
                    })
                    .is_err()
                {
                    hs.borrow_mut().pending.remove(&id);
                }
                Ok(promise)
            },
        )?,
    )?;
    Ok(())
}

fn install_host<'js>(
    ctx: &Ctx<'js>,
    input: &ScriptInput,
    ops: &mpsc::UnboundedSender<ScriptOp>,
    shared: &Arc<ScriptShared>,
    host: &Rc<RefCell<Host<'js>>>,
) -> rquickjs::Result<()> {
    let h = Object::new(ctx.clone())?;
    let codes = Object::new(ctx.clone())?;
    for c in crate::reject::RejectCode::ALL {
        codes.set(c.as_str(), c.as_str())?;
    }
    h.set("codes", codes)?;

    let hs = host.clone();
    h.set(
        "setErrorFactory",
        Function::new(ctx.clone(), move |f: Function<'js>| {
            hs.borrow_mut().error_factory = Some(f);
        })?,
    )?;

    install_calls(ctx, &h, ops, host)?;

    let tx = ops.clone();
    h.set(
        "phase",
        Function::new(ctx.clone(), move |title: String| {
            let _ = tx.send(ScriptOp::Phase(title));
        })?,
    )?;
    let tx = ops.clone();
    h.set(
        "log",
        Function::new(ctx.clone(), move |line: String| {
            let _ = tx.send(ScriptOp::Log(line));
        })?,
    )?;
    let tx = ops.clone();
    h.set(
        "failure",
        Function::new(ctx.clone(), move |line: String| {
            let _ = tx.send(ScriptOp::Failure(line));
        })?,
    )?;

    let total = input.budget_total;
    h.set(
        "budgetTotal",
        Function::new(ctx.clone(), move |_rest: Rest<Value<'js>>| {
            total.map(|t| t as f64)
        })?,
    )?;
    let sh = shared.clone();
    h.set(
        "spent",
        Function::new(ctx.clone(), move || sh.spent.load(Ordering::Relaxed) as f64)?,
    )?;
    let args = input.args_json.clone();
    h.set(
        "argsJson",
        Function::new(ctx.clone(), move || args.clone())?,
    )?;

    ctx.globals().set("__host", h)?;
    Ok(())
}

fn caught_message(e: &CaughtError<'_>) -> String {
    match e {
        CaughtError::Exception(ex) => ex.message().unwrap_or_else(|| "unknown error".into()),
        CaughtError::Value(v) => format!("{v:?}"),
        CaughtError::Error(e) => e.to_string(),
    }
}

/// Turns an uncaught JS error into a failure, recognizing the limits that were hit.
fn classify<'js>(
    ctx: &Ctx<'js>,
    e: CaughtError<'js>,
    meter: &Meter,
    limits: ScriptLimits,
    body: &str,
) -> ScriptFailure {
    if let Some(ScriptEnd::Failed(f)) = tripped(meter, limits) {
        return f;
    }
    let oom = match &e {
        CaughtError::Value(v) => v.is_null() || v.is_undefined(),
        CaughtError::Exception(ex) => ex.message().is_some_and(|m| m.contains("out of memory")),
        CaughtError::Error(rquickjs::Error::Allocation) => true,
        CaughtError::Error(_) => false,
    };
    if oom {
        return ScriptFailure {
            kind: FailureKind::MemoryLimit,
            message: format!(
                "the script ran out of memory: it used more than the limit of {} MiB (set with --script-memory)",
                limits.memory_bytes >> 20
            ),
            line: None,
        };
    }
    if let CaughtError::Exception(ex) = &e
        && ex.message().is_some_and(|m| m.contains("stack overflow"))
    {
        return ScriptFailure {
            kind: FailureKind::Thrown,
            message: "the script overflowed its stack (unbounded recursion?)".into(),
            line: line_of(ex.stack().as_deref()),
        };
    }
    let stack = match &e {
        CaughtError::Exception(ex) => ex.stack(),
        _ => None,
    };
    let mut f = failure_from(ctx, FailureKind::Thrown, e, Some(meter));
    if let Some(at) = position_of(stack.as_deref()) {
        f.message = name_the_culprit(&f.message, body, at);
    }
    f
}

/// The first `script.js:LINE:COLUMN` of a QuickJS stack trace.
fn position_of(stack: Option<&str>) -> Option<(u32, u32)> {
    let stack = stack?;
    let needle = format!("{SCRIPT_FILE}:");
    let mut rest = stack;
    while let Some(pos) = rest.find(&needle) {
        let after = &rest[pos + needle.len()..];
        let mut parts = after.splitn(3, |c: char| !c.is_ascii_digit());
        if let (Some(line), Some(col)) = (parts.next(), parts.next())
            && let (Ok(line), Ok(col)) = (line.parse(), col.parse())
        {
            return Some((line, col));
        }
        rest = after;
    }
    None
}

/// What QuickJS leaves out of two TypeErrors a script author meets most, named from the
/// script's own text at the error's position, the way Node names them:
/// `not a function` becomes `budget.remainingCost is not a function`, and a property read
/// of `undefined` or `null` says which expression was (`o.deep is undefined`). Anything the
/// text does not show plainly is left as it was.
fn name_the_culprit(message: &str, body: &str, (line, col): (u32, u32)) -> String {
    let Some(text) = body.lines().nth(line.saturating_sub(1) as usize) else {
        return message.to_owned();
    };
    // Line 1 shares its start with the wrapper (`wrap`); QuickJS counts that line's columns
    // one lower than the others' (measured).
    let col = if line == 1 {
        col.saturating_sub(WRAP_PREFIX.len() as u32 - 1)
    } else {
        col
    };
    let chars: Vec<char> = text.chars().collect();
    let at = (col as usize).saturating_sub(1);
    if at >= chars.len() {
        return message.to_owned();
    }
    let ident = |c: char| c.is_alphanumeric() || c == '_' || c == '$';
    let chain = |c: char| ident(c) || c == '.' || c == '?';
    let take = |from: usize, to: usize| -> String {
        chars[from..to]
            .iter()
            .collect::<String>()
            .trim_matches(|c| c == '.' || c == '?')
            .to_owned()
    };
    if message.ends_with("TypeError: not a function") {
        // The position is the callee's last name: the chain before it, the name after it,
        // and a call right behind.
        let mut start = at;
        while start > 0 && chain(chars[start - 1]) {
            start -= 1;
        }
        let mut end = at;
        while end < chars.len() && ident(chars[end]) {
            end += 1;
        }
        let called = chars[end..].iter().find(|c| !c.is_whitespace());
        let callee = take(start, end);
        if !callee.is_empty() && matches!(called, Some('(' | '`')) {
            return message.replace("not a function", &format!("{callee} is not a function"));
        }
    } else if let Some(what) = ["of undefined", "of null"].into_iter().find(|w| {
        message.ends_with(&format!(
            "TypeError: cannot read property '{}' {w}",
            property_of(message)
        ))
    }) {
        // The position is the start of the expression read from.
        let mut end = at;
        while end < chars.len() && chain(chars[end]) {
            end += 1;
        }
        let read = take(at, end);
        let prop = property_of(message);
        // `a.b.c.d` read `c` of `a.b`: the object is the chain up to the property's name.
        let parts: Vec<&str> = read.split('.').map(|p| p.trim_matches('?')).collect();
        let object = parts
            .iter()
            .skip(1)
            .position(|p| *p == prop)
            .map(|k| parts[..=k].join("."));
        if let Some(object) = object.filter(|o| !o.is_empty()) {
            let was = what.trim_start_matches("of ");
            return format!("{message} ({object} is {was})");
        }
    }
    message.to_owned()
}

/// The property named in QuickJS's `cannot read property 'NAME' of …`.
fn property_of(message: &str) -> &str {
    message
        .split_once("cannot read property '")
        .and_then(|(_, rest)| rest.split_once('\''))
        .map_or("", |(p, _)| p)
}

fn failure_from<'js>(
    _ctx: &Ctx<'js>,
    kind: FailureKind,
    e: CaughtError<'js>,
    _meter: Option<&Meter>,
) -> ScriptFailure {
    match e {
        CaughtError::Exception(ex) => {
            let name = ex
                .as_object()
                .get::<_, Option<String>>("name")
                .ok()
                .flatten()
                .unwrap_or_else(|| "Error".into());
            let message = ex.message().unwrap_or_default();
            let line = line_of(ex.stack().as_deref()).or_else(|| {
                ex.as_object()
                    .get::<_, Option<u32>>("lineNumber")
                    .ok()
                    .flatten()
            });
            let what = if message.is_empty() {
                name.clone()
            } else {
                format!("{name}: {message}")
            };
            let text = match (kind, line) {
                (FailureKind::Syntax, Some(l)) => format!("syntax error at line {l}: {what}"),
                (FailureKind::Syntax, None) => format!("syntax error: {what}"),
                (_, Some(l)) => format!("the script threw at line {l}: {what}"),
                (_, None) => format!("the script threw: {what}"),
            };
            ScriptFailure {
                kind,
                message: text,
                line,
            }
        }
        CaughtError::Value(v) => {
            let shown = v
                .as_string()
                .and_then(|s| s.to_string().ok())
                .map(|s| format!("{s:?}"))
                .or_else(|| v.as_number().map(|n| n.to_string()))
                .unwrap_or_else(|| v.type_name().to_owned());
            ScriptFailure {
                kind,
                message: format!("the script threw a non-Error value: {shown}"),
                line: None,
            }
        }
        CaughtError::Error(e) => ScriptFailure {
            kind: FailureKind::Internal,
            message: format!("script engine error: {e}"),
            line: None,
        },
    }
}

/// Finds the first `script.js:LINE` in a QuickJS stack trace.
fn line_of(stack: Option<&str>) -> Option<u32> {
    let stack = stack?;
    let needle = format!("{SCRIPT_FILE}:");
    let mut rest = stack;
    while let Some(pos) = rest.find(&needle) {
        let after = &rest[pos + needle.len()..];
        let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
        if let Ok(n) = digits.parse() {
            return Some(n);
        }
        rest = after;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a body, answering every `agent()` with its prompt (or a rejection for prompts
    /// starting with `reject:`), and returns how the script ended plus the ops it sent.
    fn run_script(body: &str, limits: ScriptLimits) -> (ScriptEnd, Vec<String>) {
        let (ops_tx, mut ops_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(ScriptShared::default());
        let input = ScriptInput {
            body: body.to_owned(),
            args_json: Some("{\"n\":3}".into()),
            budget_total: Some(100),
            limits,
        };
        let (reply, thread) = spawn(input, ops_tx, shared).unwrap();
        let mut seen = Vec::new();
        loop {
            match ops_rx.blocking_recv().expect("ops until Finished") {
                ScriptOp::Agent { id, prompt, .. } => {
                    seen.push(format!("agent:{prompt}"));
                    let result = match prompt.strip_prefix("reject:") {
                        Some(m) => Err(HostError::new(crate::reject::RejectCode::InvalidAgent, m)),
                        None => Ok(serde_json::to_string(&prompt).unwrap()),
                    };
                    reply.send(HostReply::Agent { id, result }).unwrap();
                }
                ScriptOp::Ask {
                    id,
                    question,
                    opts_json,
                } => {
                    seen.push(format!("ask:{question}:{opts_json}"));
                    let answer = serde_json::json!({ "answered": question });
                    let result = Ok(answer.to_string());
                    reply.send(HostReply::Agent { id, result }).unwrap();
                }
                ScriptOp::Log(l) => seen.push(format!("log:{l}")),
                ScriptOp::Phase(p) => seen.push(format!("phase:{p}")),
                ScriptOp::Failure(f) => seen.push(format!("failure:{f}")),
                ScriptOp::ResolveWorkflow { id, .. } => {
                    reply
                        .send(HostReply::Workflow {
                            id,
                            result: Err(HostError::new(
                                crate::reject::RejectCode::WorkflowNotFound,
                                "none",
                            )),
                        })
                        .unwrap();
                }
                ScriptOp::Finished(end) => {
                    thread.join().unwrap();
                    return (end, seen);
                }
            }
        }
    }

    #[test]
    fn typescript_gets_a_hint_and_the_line_is_shown() {
        for ts in [
            "const x: number = 1;",
            "function f(a: string): string { return a; }",
            "interface Foo { a: string }",
            "return f('x') as string;",
            "let items: Array<string> = [];",
        ] {
            let e = check_syntax(&format!("\n{ts}\nreturn 1;")).unwrap_err();
            assert!(
                e.message.contains("type annotations are not JavaScript"),
                "{ts}: {}",
                e.message
            );
            assert!(e.message.contains(ts.trim()), "{}", e.message);
        }
        let e = check_syntax("\nconst x = {;\n").unwrap_err();
        assert!(!e.message.contains("type annotations"), "{}", e.message);
        assert!(!looks_like_typescript("const o = { a: 1, b: 'x' };"));
        assert!(!looks_like_typescript("x ? a : B"));
    }

    /// Every global of the script realm: ECMAScript built-ins and the workflow globals. A new
    /// one (a QuickJS upgrade adding a host object) must be looked at for clocks, entropy and
    /// I/O before it is added here.
    const ALLOWED_GLOBALS: &[&str] = &[
        "AggregateError",
        "Array",
        "ArrayBuffer",
        "AsyncDisposableStack",
        "Atomics",
        "BigInt",
        "BigInt64Array",
        "BigUint64Array",
        "Boolean",
        "DOMException",
        "DataView",
        "Date",
        "DisposableStack",
        "Error",
        "EvalError",
        "FinalizationRegistry",
        "Float16Array",
        "Float32Array",
        "Float64Array",
        "Function",
        "Infinity",
        "Int16Array",
        "Int32Array",
        "Int8Array",
        "InternalError",
        "Iterator",
        "JSON",
        "Map",
        "Math",
        "NaN",
        "Number",
        "Object",
        "Promise",
        "Proxy",
        "RangeError",
        "ReferenceError",
        "Reflect",
        "RegExp",
        "Set",
        "SharedArrayBuffer",
        "String",
        "SuppressedError",
        "Symbol",
        "SyntaxError",
        "TypeError",
        "URIError",
        "Uint16Array",
        "Uint32Array",
        "Uint8Array",
        "Uint8ClampedArray",
        "WeakMap",
        "WeakRef",
        "WeakSet",
        "agent",
        "args",
        "atob",
        "btoa",
        "budget",
        "decodeURI",
        "decodeURIComponent",
        "encodeURI",
        "encodeURIComponent",
        "escape",
        "eval",
        "globalThis",
        "isFinite",
        "isNaN",
        "log",
        "parallel",
        "parseFloat",
        "parseInt",
        "performance",
        "phase",
        "pipeline",
        "queueMicrotask",
        "undefined",
        "unescape",
        "workflow",
        "ask",
    ];

    #[test]
    fn the_realm_has_only_allowed_globals_and_no_clock_or_entropy() {
        let (end, _) = run_script(
            "return Object.getOwnPropertyNames(globalThis).sort();",
            ScriptLimits::default(),
        );
        let ScriptEnd::Returned(Some(json)) = end else {
            panic!("{end:?}")
        };
        let names: Vec<String> = serde_json::from_str(&json).unwrap();
        let extra: Vec<&String> = names
            .iter()
            .filter(|n| !ALLOWED_GLOBALS.contains(&n.as_str()))
            .collect();
        assert!(extra.is_empty(), "globals nobody checked: {extra:?}");
        for probe in [
            "performance.now()",
            "performance.timeOrigin",
            "Date.now()",
            "new Date()",
            "Date()",
            "Math.random()",
            "Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 10)",
        ] {
            let (end, _) = run_script(
                &format!("try {{ {probe}; return 'ran'; }} catch (e) {{ return e.code; }}"),
                ScriptLimits::default(),
            );
            assert_eq!(
                end,
                ScriptEnd::Returned(Some("\"NONDETERMINISTIC\"".into())),
                "{probe}"
            );
        }
    }

    #[test]
    fn agent_calls_resolve_through_host_replies_in_order() {
        let (end, seen) = run_script(
            "phase('A'); const r = await parallel([() => agent('x'), () => agent('reject:no'), () => agent('y')]);\nlog('n=' + args.n);\nreturn r;",
            ScriptLimits::default(),
        );
        assert_eq!(end, ScriptEnd::Returned(Some("[\"x\",null,\"y\"]".into())));
        assert_eq!(
            seen,
            vec![
                "phase:A",
                "agent:x",
                "agent:reject:no",
                "agent:y",
                "failure:parallel[1] failed: no",
                "log:n=3"
            ]
        );
    }

    #[test]
    fn a_runaway_loop_hits_the_cpu_limit_and_the_thread_ends() {
        let limits = ScriptLimits {
            cpu: Duration::from_millis(200),
            ..ScriptLimits::default()
        };
        let (end, _) = run_script("await agent('a');\nfor (;;) {}", limits);
        match end {
            ScriptEnd::Failed(f) => assert_eq!(f.kind, FailureKind::CpuLimit, "{f}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_type_error_names_what_was_called_or_read_from_the_script_text() {
        let message = |body: &str| match run_script(body, ScriptLimits::default()).0 {
            ScriptEnd::Failed(f) => f.message,
            other => panic!("{other:?}"),
        };
        let m = message("const x = 1;\nreturn  budget.remainingCost();");
        assert!(
            m.contains("line 2")
                && m.ends_with("TypeError: budget.remainingCost is not a function"),
            "{m}"
        );
        let m = message("const o = { a: {} };\n  o.a.f(1);");
        assert!(m.ends_with("o.a.f is not a function"), "{m}");
        // On line 1 too, whose start the wrapper shares.
        let m = message("return budget.spentCost();");
        assert!(m.ends_with("budget.spentCost is not a function"), "{m}");
        let m = message("const o = {};\nreturn o.deep.name;");
        assert!(
            m.ends_with("cannot read property 'name' of undefined (o.deep is undefined)"),
            "{m}"
        );
        let m = message("const o = { a: null };\nreturn o.a.b.c;");
        assert!(
            m.ends_with("cannot read property 'b' of null (o.a is null)"),
            "{m}"
        );
        // What the text does not show plainly is left as QuickJS says it.
        let m = message("const f = [3];\nreturn f[0]();");
        assert!(m.ends_with("TypeError: not a function"), "{m}");
    }

    #[test]
    fn uncaught_errors_carry_their_line_and_results_must_be_json() {
        let (end, _) = run_script("\n\nnull.x;", ScriptLimits::default());
        match end {
            ScriptEnd::Failed(f) => {
                assert_eq!(f.kind, FailureKind::Thrown);
                assert_eq!(f.line, Some(3), "{f}");
                assert!(f.message.contains("TypeError"), "{f}");
            }
            other => panic!("{other:?}"),
        }
        let (end, _) = run_script("return 10n;", ScriptLimits::default());
        assert!(
            matches!(
                end,
                ScriptEnd::Failed(ScriptFailure {
                    kind: FailureKind::ResultNotJson,
                    ..
                })
            ),
            "{end:?}"
        );
        let (end, _) = run_script("return undefined;", ScriptLimits::default());
        assert_eq!(end, ScriptEnd::Returned(None));
    }

    #[test]
    fn syntax_is_checked_without_running_anything() {
        assert!(check_syntax("return 1;").is_ok());
        assert!(
            check_syntax("while (true) {}").is_ok(),
            "compiling does not run the body"
        );
        let e = check_syntax("\nlet = ;").unwrap_err();
        assert_eq!(e.kind, FailureKind::Syntax);
        assert!(e.message.starts_with("syntax error at line 2"), "{e}");
    }

    #[test]
    fn budget_and_determinism_guard_are_installed() {
        let (end, _) = run_script(
            "let why = ''; try { Math.random(); } catch (e) { why = e.code; }\nreturn [budget.total, budget.remaining(), why, new Date(5).getTime()];",
            ScriptLimits::default(),
        );
        assert_eq!(
            end,
            ScriptEnd::Returned(Some("[100,100,\"NONDETERMINISTIC\",5]".into()))
        );
    }

    #[test]
    fn ask_sends_its_question_with_checked_options_and_refuses_bad_ones() {
        let body = r#"
const a = await ask('Ship it?', { schema: { type: 'boolean' }, timeout: '2h', label: 'ship' });
const codes = [];
for (const bad of [() => ask(''), () => ask('q', []), () => ask('q', { timeout: -1 }),
                   () => ask('q', { timeout: '3 weeks' }), () => ask('q', { schema: 5 }),
                   () => ask('q', { label: 7 }), () => ask('x'.repeat(20000))]) {
  try { await bad(); codes.push('none'); } catch (e) { codes.push(e.code); }
}
const b = await ask('plain', { timeout: 1500 });
return [a, codes, b];"#;
        let (end, seen) = run_script(body, ScriptLimits::default());
        let ScriptEnd::Returned(Some(json)) = end else {
            panic!("{end:?}")
        };
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v[0], serde_json::json!({ "answered": "Ship it?" }));
        assert_eq!(
            v[1],
            serde_json::json!([
                "INVALID_PROMPT",
                "INVALID_OPTION",
                "INVALID_OPTION",
                "INVALID_OPTION",
                "INVALID_OPTION",
                "INVALID_OPTION",
                "TOO_LARGE"
            ])
        );
        assert_eq!(
            seen,
            vec![
                r#"ask:Ship it?:{"schema":{"type":"boolean"},"timeoutMs":7200000,"label":"ship"}"#
                    .to_owned(),
                r#"ask:plain:{"timeoutMs":1500}"#.to_owned(),
            ]
        );
    }
}
