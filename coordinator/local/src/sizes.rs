//! How large each field a client sends may be, checked on the server (a hostile client skips
//! the CLI's own checks) and by the CLI before it sends, with the same limits
//! ([`crate::reads`]): a refusal names the field, its size, the limit and what to do.
//!
//! A whole request past its method's limit never gets this far: the coordinator's intake
//! refuses it before it is read.

use flotilla_proto::Problem;
use flotilla_proto::v1;

use crate::reads::{
    ARGS_BYTES, CARRIED_BYTES, CARRIED_ITEMS, SCRIPT_BYTES, SETTINGS_BYTES, TEXT_BYTES,
    human_bytes, measured,
};

/// `what` of `len` bytes, refused past `limit`, with `fix`.
fn within(what: &str, len: usize, limit: usize, fix: &str) -> Result<(), Problem> {
    if len <= limit {
        return Ok(());
    }
    Err(Problem::invalid(format!(
        "{what}: {}, over the limit of {}: {fix}",
        measured(len),
        human_bytes(limit)
    )))
}

/// A short text field (a name, a model, a path): at most [`TEXT_BYTES`].
pub fn text(what: &str, value: &str) -> Result<(), Problem> {
    within(
        what,
        value.len(),
        TEXT_BYTES,
        "names, models and paths are short; send a shorter one",
    )
}

/// The most an answer to a run's question (`ask()`) may hold, as JSON.
pub const ANSWER_BYTES: usize = 1 << 20;

/// An answer to a run's question, as JSON: at most [`ANSWER_BYTES`], and JSON.
pub fn answer(json: &str) -> Result<serde_json::Value, Problem> {
    within(
        "the answer",
        json.len(),
        ANSWER_BYTES,
        "answer with less, or point to where the rest is",
    )?;
    serde_json::from_str(json).map_err(|e| {
        Problem::invalid(format!(
            "the answer is not JSON ({e}): give it as JSON, e.g. --json true, --json '\"text\"' or --json '{{\"approve\": true}}'"
        ))
    })
}

/// A workflow pushed to the coordinator: at most [`SCRIPT_BYTES`], as any script.
pub fn pushed(source: &str) -> Result<(), Problem> {
    within(
        "the workflow",
        source.len(),
        SCRIPT_BYTES,
        "split the workflow, or let it read its data from the run's source",
    )
}

/// Checks every size in a launch: script, args, settings, names, and what it carries.
pub fn check_launch(r: &v1::LaunchRequest) -> Result<(), Problem> {
    within(
        "the script",
        r.script.len(),
        SCRIPT_BYTES,
        "split the workflow, or let it read its data from the run's source",
    )?;
    if let Some(args) = &r.args_json {
        within(
            "args",
            args.len(),
            ARGS_BYTES,
            "pass smaller args (--args-file has the same limit), or put the data in the run's source and pass its path",
        )?;
    }
    within(
        "the run settings",
        r.settings_json.len(),
        SETTINGS_BYTES,
        "the settings come from flags and a config file, which is at most 1 MiB; send fewer",
    )?;
    text("the script's origin", &r.origin)?;
    text("the saved workflow's name", &r.saved_name)?;
    text("the protocol version", &r.protocol_version)?;
    text("the run to resume", &r.resume_from)?;
    let items = r.workflows.len() + r.agent_definitions.len() + r.agent_types.len();
    if items > CARRIED_ITEMS {
        return Err(Problem::invalid(format!(
            "the launch carries {items} workflows and agent types, over the limit of {CARRIED_ITEMS}: keep fewer in the workflow directories and .claude/agents the launch reads"
        )));
    }
    let mut carried = 0usize;
    for w in &r.workflows {
        text("a carried workflow's name", &w.name)?;
        text("a carried workflow's origin", &w.origin)?;
        within(
            &format!("carried workflow {:?}", shown(&w.name)),
            w.source.len(),
            SCRIPT_BYTES,
            "a workflow script is at most 2 MiB, as any script",
        )?;
        carried += w.name.len() + w.origin.len() + w.source.len();
    }
    for d in &r.agent_definitions {
        text("an agent type's name", &d.name)?;
        text("an agent type's model", &d.model)?;
        for t in &d.tools {
            text("an agent type's tool", t)?;
        }
        let tools: usize = d.tools.iter().map(String::len).sum();
        carried += d.name.len() + d.model.len() + d.description.len() + d.prompt.len() + tools;
    }
    for (name, model) in &r.agent_types {
        text("an agent type's name", name)?;
        text("an agent type's model", model)?;
        carried += name.len() + model.len();
    }
    within(
        "what the launch carries (workflows and agent definitions)",
        carried,
        CARRIED_BYTES,
        "keep fewer or smaller workflows in the workflow directories and .claude/agents the launch reads",
    )
}

/// A run id as a client names it: a plain name no longer than 128 characters (ids look like
/// `wf_1a2b3c4d-5e6`). Anything else is refused before it reaches the store, where it could
/// only fail slowly or name some other path.
pub fn check_run_id(run: &str) -> Result<(), Problem> {
    let plain = !run.is_empty()
        && run.len() <= 128
        && run != "."
        && run != ".."
        && run
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if plain {
        return Ok(());
    }
    let shown: String = run.chars().take(40).collect();
    let more = if shown.len() < run.len() { "…" } else { "" };
    Err(Problem::invalid(format!(
        "{shown:?}{more} is not a run id (run ids look like wf_1a2b3c4d-5e6; `flotilla runs` lists them)"
    )))
}

/// At most 40 characters of `name`, for an error.
fn shown(name: &str) -> String {
    name.chars().take(40).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn launch() -> v1::LaunchRequest {
        v1::LaunchRequest {
            protocol_version: flotilla_proto::PROTOCOL_VERSION.into(),
            script: "export const meta = { name: 'x' };\nreturn 1;".into(),
            settings_json: "{}".into(),
            ..Default::default()
        }
    }

    #[test]
    fn each_field_past_its_limit_is_named_with_its_size_and_the_limit() {
        assert!(check_launch(&launch()).is_ok());
        let cases: Vec<(v1::LaunchRequest, &str, &str)> = vec![
            (
                v1::LaunchRequest {
                    args_json: Some("1".repeat(ARGS_BYTES + 1)),
                    ..launch()
                },
                "args: 16777217 bytes (16.0 MiB), over the limit of 16 MiB",
                "--args-file",
            ),
            (
                v1::LaunchRequest {
                    script: " ".repeat(SCRIPT_BYTES + 1),
                    ..launch()
                },
                "the script: 2097153 bytes",
                "over the limit of 2 MiB",
            ),
            (
                v1::LaunchRequest {
                    settings_json: " ".repeat(SETTINGS_BYTES + 1),
                    ..launch()
                },
                "the run settings: 1048577 bytes",
                "over the limit of 1 MiB",
            ),
            (
                v1::LaunchRequest {
                    origin: "o".repeat(TEXT_BYTES + 1),
                    ..launch()
                },
                "the script's origin: 4097 bytes",
                "over the limit of 4 KiB",
            ),
            (
                v1::LaunchRequest {
                    workflows: (0..5)
                        .map(|i| v1::SavedWorkflow {
                            name: format!("w{i}"),
                            source: " ".repeat(SCRIPT_BYTES),
                            origin: String::new(),
                        })
                        .collect(),
                    ..launch()
                },
                "what the launch carries (workflows and agent definitions): 104857",
                "over the limit of 8 MiB",
            ),
            (
                v1::LaunchRequest {
                    agent_types: (0..CARRIED_ITEMS + 1)
                        .map(|i| (format!("t{i}"), String::new()))
                        .collect(),
                    ..launch()
                },
                "carries 1025 workflows and agent types",
                "over the limit of 1024",
            ),
            (
                v1::LaunchRequest {
                    agent_definitions: vec![v1::AgentDefinition {
                        name: "t".into(),
                        prompt: " ".repeat(CARRIED_BYTES + 1),
                        ..Default::default()
                    }],
                    ..launch()
                },
                "what the launch carries",
                "8 MiB",
            ),
        ];
        for (req, says, also) in cases {
            let e = check_launch(&req).unwrap_err();
            assert!(e.message.contains(says) && e.message.contains(also), "{e}");
        }
    }
}
