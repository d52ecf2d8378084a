//! The script runtime: reading workflow scripts and running them on QuickJS.
//!
//! - [`lex`] and [`source`] read a script statically: the literal `meta` block (without running
//!   anything), module loading and obvious non-deterministic calls (W02–W07).
//! - [`runtime`] runs the body on its own thread, one QuickJS runtime per run, with memory and
//!   CPU-time limits. The host side supplies `agent()` and friends as [`runtime::ScriptOp`]s.
//! - `prelude.js` is the JavaScript half of the globals: `parallel`, `pipeline`, `phase`,
//!   `log`, `budget`, `args`, `workflow` and the determinism guard.
//!
//! **Architecture invariant:** the script runtime has no I/O. It cannot read files, open
//! sockets or see the clock; everything it learns comes through host replies, which is what
//! makes a resumed run repeat the same `agent()` calls.

pub mod lex;
pub mod reject;
pub mod runtime;
pub mod text;

pub use runtime::{
    FailureKind, HostError, HostReply, ScriptEnd, ScriptFailure, ScriptInput, ScriptLimits,
    ScriptOp, ScriptShared,
};

/// A prepared body ready for the runtime: a leading hashbang line is blanked too, since the
/// body is wrapped in a function where `#!` is not allowed.
pub fn runnable_body(prepared: &text::Prepared) -> String {
    let body = &prepared.body;
    if body.starts_with("#!") {
        let end = body.find('\n').unwrap_or(body.len());
        let mut out = " ".repeat(end);
        out.push_str(&body[end..]);
        out
    } else {
        body.clone()
    }
}
