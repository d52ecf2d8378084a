//! Every object key Flotilla writes, in one place (design.md, "Storage layout").
//!
//! ```text
//! runs/{run}/run.json                      manifest
//! runs/{run}/script.js
//! runs/{run}/calls/{gen}-{seq}.jsonl       completed calls, one create-only segment per batch
//! runs/{run}/seals/{gen}.json              the segments an adopter took as the run's history
//! runs/{run}/events/{gen}-{seq}.jsonl      run events, batched
//! runs/{run}/transcripts/{gen}-{seq}.jsonl   transcript events of many attempts, batched
//! runs/{run}/result.json                   the final report
//! runs/{run}/owner/{seq}.json              who drives the run (create-only; see `owner`)
//! runs/{run}/notify.json                   how its end webhook was delivered
//! payloads/{sha256}                        large results, stored once by content hash
//! {workflows}/{name}.js                    workflows pushed to a namespace (or the fleet)
//! {workflows}/.pushes/{name}/{at}-{sha}.json   who pushed each, when, what it replaced
//! index/runs/{countdown}-{run}.json         the run index (see `index`): newest first
//! notify/outbox/{run}.json                 a webhook not yet delivered (see `notify`)
//! namespaces/{ns}/usage/{day}.json         what a namespace used on a UTC day (see `namespace`)
//! {sources}/{repo}/packs/{sha256}.pack     git objects of a namespace's run sources, stored once
//! {sources}/{repo}/commits/{commit}.json   which pack holds a commit, and what it needs
//! ```
//!
//! `{sources}` is a namespace's own ([`sources_of`]): `namespaces/{ns}/sources` for every
//! namespace but `default`, whose sources stay at `sources` (where every store kept them
//! before namespaces had sources of their own). `{workflows}` is alike ([`workflows_of`]):
//! `namespaces/{ns}/workflows`, `default`'s at `workflows`, and the fleet's (an operator's
//! push for every namespace) at `fleet/workflows`.
//!
//! Segment names carry the writer's generation, zero-padded so that listing order is
//! write order and a later generation sorts after an earlier one.

use object_store::path::Path;

pub fn runs() -> Path {
    Path::from("runs")
}

pub fn run_dir(run: &str) -> Path {
    Path::from(format!("runs/{run}"))
}

pub fn manifest(run: &str) -> Path {
    Path::from(format!("runs/{run}/run.json"))
}

pub fn script(run: &str) -> Path {
    Path::from(format!("runs/{run}/script.js"))
}

/// Saved workflows and agent types the launching client carried (fleet runs only).
pub fn carried(run: &str) -> Path {
    Path::from(format!("runs/{run}/workflows.json"))
}

pub fn calls_dir(run: &str) -> Path {
    Path::from(format!("runs/{run}/calls"))
}

pub fn calls_segment(run: &str, generation: u64, seq: u64) -> Path {
    Path::from(format!("runs/{run}/calls/{generation:06}-{seq:08}.jsonl"))
}

pub fn seals_dir(run: &str) -> Path {
    Path::from(format!("runs/{run}/seals"))
}

/// The seal written by the coordinator that took the run over as generation `generation`
/// (see `journal::seal`).
pub fn seal(run: &str, generation: u64) -> Path {
    Path::from(format!("runs/{run}/seals/{generation:06}.json"))
}

pub fn events_dir(run: &str) -> Path {
    Path::from(format!("runs/{run}/events"))
}

pub fn events_segment(run: &str, generation: u64, seq: u64) -> Path {
    Path::from(format!("runs/{run}/events/{generation:06}-{seq:08}.jsonl"))
}

pub fn transcripts_dir(run: &str) -> Path {
    Path::from(format!("runs/{run}/transcripts"))
}

pub fn transcript_segment(run: &str, generation: u64, seq: u64) -> Path {
    Path::from(format!(
        "runs/{run}/transcripts/{generation:06}-{seq:08}.jsonl"
    ))
}

pub fn result(run: &str) -> Path {
    Path::from(format!("runs/{run}/result.json"))
}

/// The money budget a run was given after its launch (`flotilla budget RUN --usd N`): what a
/// coordinator that adopts the run holds it to instead of its manifest's.
pub fn budget(run: &str) -> Path {
    Path::from(format!("runs/{run}/budget.json"))
}

/// A question the run's script asked with `ask()` (`id`: `q_` and 12 hex digits).
pub fn question(run: &str, id: &str) -> Path {
    Path::from(format!("runs/{run}/questions/{id}.json"))
}

pub fn questions_dir(run: &str) -> Path {
    Path::from(format!("runs/{run}/questions"))
}

pub fn answers_dir(run: &str) -> Path {
    Path::from(format!("runs/{run}/answers"))
}

/// The answer question `id` of the run got: written once, the first answer wins.
pub fn answer(run: &str, id: &str) -> Path {
    Path::from(format!("runs/{run}/answers/{id}.json"))
}

/// What an interrupted attempt of one of the run's calls left its next attempt (`id`: 24 hex
/// digits of the call key's sha256); deleted when the call ends.
pub fn leftovers(run: &str, id: &str) -> Path {
    Path::from(format!("runs/{run}/leftovers/{id}.pb"))
}

pub fn leftovers_dir(run: &str) -> Path {
    Path::from(format!("runs/{run}/leftovers"))
}

/// How the run's end webhook was delivered (`--notify`).
pub fn notify(run: &str) -> Path {
    Path::from(format!("runs/{run}/notify.json"))
}

/// Webhooks not yet delivered (or given up), one per run: sent again after a restart.
pub fn notify_outboxes() -> Path {
    Path::from("notify/outbox")
}

pub fn notify_outbox(run: &str) -> Path {
    Path::from(format!("notify/outbox/{run}.json"))
}

/// A webhook of a run's life before its end (`run.paused`), under its delivery id.
pub fn notify_outbox_delivery(delivery: &str) -> Path {
    Path::from(format!("notify/outbox/{delivery}.json"))
}

/// What namespace `ns` used on UTC day `day` (`YYYY-MM-DD`).
pub fn namespace_usage(ns: &str, day: &str) -> Path {
    Path::from(format!("namespaces/{ns}/usage/{day}.json"))
}

pub fn payload(sha256_hex: &str) -> Path {
    Path::from(format!("payloads/{sha256_hex}"))
}

pub fn owner_dir(run: &str) -> Path {
    Path::from(format!("runs/{run}/owner"))
}

/// The `seq`th owner record of a run (see `owner`), zero-padded so listing order is order.
pub fn owner(run: &str, seq: u64) -> Path {
    Path::from(format!("runs/{run}/owner/{seq:06}.json"))
}

/// The heartbeat of the holder of owner record `seq`.
pub fn owner_beat(run: &str, seq: u64) -> Path {
    Path::from(format!("runs/{run}/owner/{seq:06}.beat"))
}

/// The namespace whose sources stay at the top-level `sources/`.
const DEFAULT_NAMESPACE: &str = "default";

/// The directory of namespace `ns`'s run sources (empty: `default`).
pub fn sources_of(ns: &str) -> String {
    if ns.is_empty() || ns == DEFAULT_NAMESPACE {
        "sources".to_owned()
    } else {
        format!("namespaces/{ns}/sources")
    }
}

/// Every namespace's directory but `default`'s sources.
pub fn namespaces() -> Path {
    Path::from("namespaces")
}

/// A pack of git objects of namespace `ns`'s source repository `repo`, by the SHA-256 of its
/// bytes.
pub fn source_pack(ns: &str, repo: &str, sha256_hex: &str) -> Path {
    Path::from(format!("{}/{repo}/packs/{sha256_hex}.pack", sources_of(ns)))
}

/// Where a commit of namespace `ns`'s source repository `repo` is: its pack and what that
/// pack needs.
pub fn source_commit(ns: &str, repo: &str, commit: &str) -> Path {
    Path::from(format!("{}/{repo}/commits/{commit}.json", sources_of(ns)))
}

/// A pack being received, before its hash is known.
pub fn source_incoming(ns: &str, repo: &str, id: &str) -> Path {
    Path::from(format!("{}/{repo}/incoming/{id}", sources_of(ns)))
}

/// A source object's key read back: its namespace, repository and the rest of its key
/// (`commits/{commit}.json`, `packs/{sha}.pack`, `incoming/{id}`); `None` for any other key.
pub fn parse_source(key: &str) -> Option<(&str, &str, &str)> {
    let (ns, rest) = match key.strip_prefix("sources/") {
        Some(rest) => (DEFAULT_NAMESPACE, rest),
        None => {
            let rest = key.strip_prefix("namespaces/")?;
            let (ns, rest) = rest.split_once('/')?;
            (ns, rest.strip_prefix("sources/")?)
        }
    };
    let (repo, rest) = rest.split_once('/')?;
    (!repo.is_empty() && !rest.is_empty()).then_some((ns, repo, rest))
}

/// The run index's directory.
pub fn index_runs() -> Path {
    Path::from("index/runs")
}

/// A run's index entry: `countdown` is its creation time in milliseconds, counted down from
/// a far date, so that key order is newest first.
pub fn index_entry(countdown: u64, run: &str) -> Path {
    Path::from(format!("index/runs/{countdown:013}-{run}.json"))
}

/// The directory of the workflows pushed to namespace `ns` (empty: `default`), or, for `*`,
/// of the fleet's (pushed by an operator for every namespace; see `saved`). `default`'s stay
/// at `workflows` (where every store kept them before pushes had namespaces), the fleet's are
/// at `fleet/workflows`, every other namespace's at `namespaces/{ns}/workflows`. Callers pass
/// a checked namespace name (`namespace::valid_name`) or `*`.
pub fn workflows_of(ns: &str) -> String {
    match ns {
        "" | DEFAULT_NAMESPACE => "workflows".to_owned(),
        FLEET => "fleet/workflows".to_owned(),
        ns => format!("namespaces/{ns}/workflows"),
    }
}

/// In [`workflows_of`]: the fleet's workflows, which every namespace sees.
const FLEET: &str = "*";

pub fn saved_workflows(ns: &str) -> Path {
    Path::from(workflows_of(ns))
}

pub fn saved_workflow(ns: &str, name: &str) -> Path {
    Path::from(format!("{}/{name}.js", workflows_of(ns)))
}

/// The record of one push of a saved workflow (names never start with a dot, so this
/// directory cannot collide with one).
pub fn workflow_push(ns: &str, name: &str, at_ms: u128, sha256_hex: &str) -> Path {
    let short = &sha256_hex[..sha256_hex.len().min(12)];
    Path::from(format!(
        "{}/.pushes/{name}/{at_ms:015}-{short}.json",
        workflows_of(ns)
    ))
}

pub fn workflow_pushes(ns: &str, name: &str) -> Path {
    Path::from(format!("{}/.pushes/{name}", workflows_of(ns)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_sort_in_write_order() {
        let a = calls_segment("wf_1", 1, 9);
        let b = calls_segment("wf_1", 1, 10);
        let c = calls_segment("wf_1", 2, 0);
        assert!(a.as_ref() < b.as_ref() && b.as_ref() < c.as_ref());
        assert_eq!(manifest("wf_1").as_ref(), "runs/wf_1/run.json");
        assert_eq!(
            transcript_segment("wf_1", 1, 2).as_ref(),
            "runs/wf_1/transcripts/000001-00000002.jsonl"
        );
    }

    #[test]
    fn each_namespace_has_its_own_sources_and_default_keeps_the_old_place() {
        assert_eq!(
            source_commit("default", "r1", "c1").as_ref(),
            "sources/r1/commits/c1.json"
        );
        assert_eq!(
            source_commit("", "r1", "c1").as_ref(),
            "sources/r1/commits/c1.json"
        );
        assert_eq!(
            source_pack("team-a", "r1", "ab").as_ref(),
            "namespaces/team-a/sources/r1/packs/ab.pack"
        );
        for (ns, key) in [
            ("default", source_commit("default", "r1", "c1")),
            ("team-a", source_commit("team-a", "r1", "c1")),
            ("team-b", source_incoming("team-b", "r1", "x")),
        ] {
            let (got_ns, repo, _) = parse_source(key.as_ref()).unwrap();
            assert_eq!((got_ns, repo), (ns, "r1"), "{key}");
        }
        assert_eq!(
            parse_source("namespaces/team-a/usage/2024-01-01.json"),
            None
        );
        assert_eq!(parse_source("runs/wf_1/run.json"), None);
    }

    #[test]
    fn each_namespace_has_its_own_pushed_workflows_and_default_keeps_the_old_place() {
        assert_eq!(
            saved_workflow("default", "audit").as_ref(),
            "workflows/audit.js"
        );
        assert_eq!(saved_workflow("", "audit").as_ref(), "workflows/audit.js");
        assert_eq!(
            saved_workflow("team-a", "audit").as_ref(),
            "namespaces/team-a/workflows/audit.js"
        );
        assert_eq!(
            saved_workflow("*", "audit").as_ref(),
            "fleet/workflows/audit.js"
        );
        assert_eq!(
            workflow_pushes("team-b", "audit").as_ref(),
            "namespaces/team-b/workflows/.pushes/audit"
        );
        assert!(
            workflow_push("default", "audit", 7, "abcdef0123456789")
                .as_ref()
                .starts_with("workflows/.pushes/audit/000000000000007-abcdef012345")
        );
        // A namespace's workflows are not a source object of it.
        assert_eq!(
            parse_source(saved_workflow("team-a", "audit").as_ref()),
            None
        );
    }
}
