//! What a client and its coordinator both do on one machine (issue 30, 3): the CLI's client
//! commands use these without the coordinator, and the coordinator uses the same code for
//! the same checks on what a client sends.
//!
//! - [`reads`]: files read with a limit named in the error, and the limits themselves.
//! - [`sizes`]: the size of each field a client sends, checked before it is sent and again
//!   when it arrives.
//! - [`workflows`] and [`bundled`]: workflows found in directories, and those built in.
//! - [`vet`]: checks on git objects that come from outside.

pub mod bundled;
pub mod reads;
pub mod sizes;
pub mod vet;
pub mod workflows;
