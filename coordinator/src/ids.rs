//! Ids and names: a new run id here; what a source id, a namespace name and a webhook URL
//! look like is the wire contract's ([`flotilla_proto::names`]), re-exported.
//!
//! A leaf: it imports nothing of the coordinator, so settings, storage and the faces can all
//! check a name without reaching up into the modules that own those things.

pub use flotilla_proto::names::*;

/// A new run id: `wf_` + 8 hex + `-` + 3 hex, like Claude Code's (W45).
pub fn new_run_id() -> String {
    let mut b = [0u8; 6];
    if getrandom::fill(&mut b).is_err() {
        // Fall back to the clock and pid; ids only need to be unique, not secret.
        let t = flotilla_proto::clock::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mixed = t ^ (u128::from(std::process::id()) << 64);
        b.copy_from_slice(&mixed.to_le_bytes()[..6]);
    }
    let h = hex::encode(b);
    format!("wf_{}-{}", &h[..8], &h[8..11])
}
