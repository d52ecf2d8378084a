//! Admission: whether one `agent()` call runs, is served from the run it resumes, or is
//! rejected — decided from the call, the run's settings and what it has spent, with no actor
//! involved.
//!
//! The checks, in order: the money budget, the agent cap (W40), the size a call may have on
//! the worker stream, the options (W13–W20), the agent type, the model (W18), the schema
//! (W15), the token budget (W35). An admitted call gets its call key (its content and how
//! often that content came before) and, when the resume source holds that key under the run's
//! replay rule, the record that serves it.

use std::collections::HashMap;

use serde_json::Value;

use crate::reject::RejectCode;
use crate::settings::{ReplayMode, RunSettings};
use crate::spec::{CallSpec, call_key};
use crate::store::records::CallRecord;
use crate::workflows::AgentType;

use super::resume::ResumeSource;

/// One `agent()` call as the script made it.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: String,
    pub opts_json: String,
    pub group: String,
}

/// What the run has used so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct Spent {
    /// Calls admitted before this one (its index if it is admitted).
    pub calls: u64,
    pub cost_usd: f64,
    /// Output tokens, shared with nested workflows and the script's `budget.spent()`.
    pub output_tokens: u64,
    /// Past the money budget the run is held, not refused (on a coordinator, where the
    /// budget can be raised): its new agents are admitted and wait.
    pub money_holds: bool,
}

/// How admission ended.
#[derive(Debug)]
pub enum Admission {
    /// Runs: goes to the dispatcher.
    Dispatch(Admitted),
    /// Served from the run this one resumes.
    Cached(Admitted, Box<CallRecord>),
    Rejected(RejectCode, String),
}

/// An admitted call.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub spec: CallSpec,
    pub key: String,
    pub group: String,
    /// The custom agent type's definition, for the worker.
    pub agent_def: Option<String>,
    /// The model it asked for, when the allowed models do not include it and it runs on
    /// `spec.model` instead (W18).
    pub substituted: Option<String>,
}

impl Admitted {
    /// The task a worker runs for it.
    pub fn task(&self, settings: &RunSettings) -> flotilla_proto::v1::TaskSpec {
        let spec = &self.spec;
        let source = settings.source.as_ref();
        flotilla_proto::v1::TaskSpec {
            prompt: spec.prompt.clone(),
            backend: spec.backend.clone(),
            model: spec.model.clone(),
            effort: spec.effort.clone(),
            agent_type: spec.agent_type.clone(),
            schema_json: spec.schema.as_ref().map(Value::to_string),
            isolation: spec.isolation.clone(),
            cwd: spec.cwd.clone(),
            tools: spec.tools.clone(),
            timeout_ms: spec.timeout_ms,
            label: spec.label.clone(),
            group: self.group.clone(),
            schema_attempts: settings.schema_attempts,
            options_json: Value::Object(spec.options.clone()).to_string(),
            // The namespace's pinned labels win over the call's own.
            placement_labels: spec
                .placement
                .iter()
                .chain(&settings.pinned_labels)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            agent_def_json: self.agent_def.clone().unwrap_or_default(),
            source_repo: source.map(|s| s.repo.clone()).unwrap_or_default(),
            source_commit: source.map(|s| s.commit.clone()).unwrap_or_default(),
            source_url: source.and_then(|s| s.url.clone()).unwrap_or_default(),
            source_partial: String::new(),
            namespace: crate::namespace::effective(&settings.namespace).to_owned(),
            session: None,
        }
    }

    /// Calls of one prefix group share a prompt prefix (W60). Worktree agents never share
    /// one: each has its own directory.
    pub fn prefix_group(&self, index: u64) -> u64 {
        if self.spec.isolation == "worktree" {
            index.wrapping_add(1) << 32 ^ self.spec.prefix_group()
        } else {
            self.spec.prefix_group()
        }
    }
}

/// The token budget's message, wherever it stops a call.
pub fn token_budget_exceeded(spent: u64, total: u64) -> String {
    format!(
        "token budget exceeded ({spent} / {total} output tokens); in-flight agents will complete and their results are kept"
    )
}

/// What admission remembers from one call of a run to the next.
#[derive(Debug)]
pub struct Admitter {
    /// How often each call content came so far (the call key counts occurrences).
    occurrences: HashMap<String, u32>,
    /// Prefix replay: every call so far was served, so the next may be too.
    prefix_intact: bool,
    /// Schema preflight results, by schema text.
    schema_checks: HashMap<String, Result<(), flotilla_proto::Problem>>,
}

impl Default for Admitter {
    fn default() -> Self {
        Admitter {
            occurrences: HashMap::new(),
            prefix_intact: true,
            schema_checks: HashMap::new(),
        }
    }
}

/// W18's allowlist: a model the run's allowed models do not include is replaced by the run's
/// model when that is allowed, else by the first allowed one; the model asked for, if so.
fn substitute(model: &mut String, settings: &RunSettings) -> Option<String> {
    let allowed = &settings.allowed_models;
    if allowed.is_empty()
        || model.is_empty()
        || allowed
            .iter()
            .any(|a| crate::settings::model_allowed(a, model))
    {
        return None;
    }
    let run_model = &settings.model;
    let to = if !run_model.is_empty()
        && allowed
            .iter()
            .any(|a| crate::settings::model_allowed(a, run_model))
    {
        run_model.clone()
    } else {
        allowed[0].clone()
    };
    Some(std::mem::replace(model, to))
}

impl Admitter {
    /// Decides one call. `types` lists the agent types, asked only when the call names one.
    pub fn admit(
        &mut self,
        req: Request,
        settings: &RunSettings,
        spent: Spent,
        types: &mut dyn FnMut() -> Vec<AgentType>,
        resume: Option<&ResumeSource>,
    ) -> Admission {
        let (mut spec, agent_def) =
            match self.check(req.prompt, &req.opts_json, settings, spent, types) {
                Ok(ok) => ok,
                Err((code, message)) => return Admission::Rejected(code, message),
            };
        let substituted = substitute(&mut spec.model, settings);
        let content = spec.content_hash();
        let occ = self.occurrences.entry(content.clone()).or_insert(0);
        let key = call_key(&content, *occ);
        *occ += 1;
        let cached = resume.and_then(|src| self.served(src, &key, settings.replay));
        let admitted = Admitted {
            spec,
            key,
            group: req.group,
            agent_def,
            substituted,
        };
        match cached {
            Some(record) => Admission::Cached(admitted, Box::new(record)),
            None => Admission::Dispatch(admitted),
        }
    }

    /// The record that serves the call with `key`, under the replay rule.
    ///
    /// Prefix replay (W51) serves calls in the order this run starts them, until the first one
    /// the source run has no completed result for (changed, failed, or still running then):
    /// that call and every call this run starts after it run again. A call is matched by its
    /// content and occurrence, not by its place in the source run's start order: that order
    /// depends on which calls finished first (W86), so a pipeline run with concurrency would
    /// otherwise miss at its first reordered call although nothing changed.
    fn served(&mut self, src: &ResumeSource, key: &str, replay: ReplayMode) -> Option<CallRecord> {
        match replay {
            ReplayMode::Content => src.by_key(key).cloned(),
            ReplayMode::Prefix => {
                let hit = self
                    .prefix_intact
                    .then(|| src.by_key(key))
                    .flatten()
                    .cloned();
                self.prefix_intact = hit.is_some();
                hit
            }
        }
    }

    fn check(
        &mut self,
        prompt: String,
        opts_json: &str,
        settings: &RunSettings,
        spent: Spent,
        types: &mut dyn FnMut() -> Vec<AgentType>,
    ) -> Result<(CallSpec, Option<String>), (RejectCode, String)> {
        if let Some(limit) = settings.budget_usd
            && spent.cost_usd >= limit
            && !spent.money_holds
        {
            return Err((
                RejectCode::BudgetExceeded,
                format!(
                    "money budget exceeded (${:.4} / ${limit}); no new agent starts",
                    spent.cost_usd
                ),
            ));
        }
        let max = settings.max_agents;
        if spent.calls >= max {
            return Err((
                RejectCode::AgentCap,
                format!(
                    "agent cap reached: this run already started {max} agents (the limit per run, set with --max-agents); \
                     a loop over budget.remaining() never ends without a budget — cap the iterations or set --budget"
                ),
            ));
        }
        // Checked before anything is recorded: one call must fit the worker stream.
        flotilla_proto::frag::check_call_size(prompt.len() + opts_json.len())
            .map_err(|e| (RejectCode::TooLarge, e.message))?;
        let mut spec = CallSpec::parse(prompt, opts_json, &settings.backend, "")
            .map_err(|e| (RejectCode::InvalidOption, e.to_string()))?;
        let (type_model, agent_def) = if spec.agent_type.is_empty() {
            (None, None)
        } else {
            let known = types();
            let t = known
                .iter()
                .find(|t| t.name == spec.agent_type)
                .ok_or_else(|| {
                    let list = known
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ");
                    (
                        RejectCode::UnknownAgentType,
                        format!(
                            "unknown agentType {:?}: the available agent types are {list} (custom agents live in .claude/agents/*.md)",
                            spec.agent_type
                        ),
                    )
                })?;
            (t.model.clone(), t.definition_json())
        };
        // Model resolution (W18): the call's model, then the agent type's, then the run's;
        // a forced run model wins over all of them.
        if settings.force_model && !settings.model.is_empty() {
            spec.model = settings.model.clone();
        } else if spec.model.is_empty() {
            spec.model = type_model.unwrap_or_else(|| settings.model.clone());
        }
        if let Some(schema) = &spec.schema {
            self.schema_checks
                .entry(schema.to_string())
                .or_insert_with(|| flotilla_proto::schema::preflight(schema))
                .clone()
                .map_err(|e| {
                    (
                        RejectCode::SchemaInvalid,
                        format!("agent() schema rejected before start: {e}"),
                    )
                })?;
        }
        if let Some(total) = settings.budget_tokens
            && spent.output_tokens >= total
        {
            return Err((
                RejectCode::BudgetExceeded,
                token_budget_exceeded(spent.output_tokens, total),
            ));
        }
        Ok((spec, agent_def))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::records::{RawJson, UsageRecord};

    fn settings() -> RunSettings {
        RunSettings {
            backend: "echo".into(),
            ..RunSettings::default()
        }
    }

    fn req(prompt: &str, opts: &str) -> Request {
        Request {
            prompt: prompt.into(),
            opts_json: opts.into(),
            group: String::new(),
        }
    }

    fn none() -> Vec<AgentType> {
        Vec::new()
    }

    fn admit(a: &mut Admitter, s: &RunSettings, spent: Spent, r: Request) -> Admission {
        a.admit(r, s, spent, &mut none, None)
    }

    fn rejected(a: Admission) -> (RejectCode, String) {
        match a {
            Admission::Rejected(code, m) => (code, m),
            other => panic!("expected a rejection, got {other:?}"),
        }
    }

    fn dispatched(a: Admission) -> Admitted {
        match a {
            Admission::Dispatch(a) => a,
            other => panic!("expected a dispatch, got {other:?}"),
        }
    }

    fn record(index: u64, key: &str) -> CallRecord {
        CallRecord {
            index,
            key: key.into(),
            label: String::new(),
            group: String::new(),
            result: Some(RawJson::string(&format!("served {index}"))),
            payload: None,
            usage: UsageRecord::default(),
            attempts: 1,
            cached_from: None,
            worker: None,
            change: None,
        }
    }

    #[test]
    fn the_same_prompt_twice_gets_two_keys_and_a_different_one_its_own() {
        let (mut a, s) = (Admitter::default(), settings());
        let k1 = dispatched(admit(&mut a, &s, Spent::default(), req("p", "{}"))).key;
        let k2 = dispatched(admit(&mut a, &s, Spent::default(), req("p", "{}"))).key;
        let k3 = dispatched(admit(&mut a, &s, Spent::default(), req("q", "{}"))).key;
        assert_ne!(k1, k2);
        assert_ne!(k1, k3);
        let again = dispatched(admit(
            &mut Admitter::default(),
            &s,
            Spent::default(),
            req("p", "{}"),
        ));
        assert_eq!(
            again.key, k1,
            "a key depends on the content and its occurrence only"
        );
    }

    #[test]
    fn each_limit_rejects_with_its_own_code_and_says_which() {
        let mut s = settings();
        s.max_agents = 2;
        s.budget_tokens = Some(100);
        s.budget_usd = Some(1.0);
        let mut a = Admitter::default();
        let at = |calls, cost_usd, output_tokens| Spent {
            calls,
            cost_usd,
            output_tokens,
            money_holds: false,
        };
        let (code, m) = rejected(admit(&mut a, &s, at(2, 0.0, 0), req("p", "{}")));
        assert_eq!(code, RejectCode::AgentCap);
        assert!(m.contains("--max-agents"), "{m}");
        let (code, m) = rejected(admit(&mut a, &s, at(0, 0.0, 100), req("p", "{}")));
        assert_eq!(code, RejectCode::BudgetExceeded);
        assert!(m.contains("100 / 100 output tokens"), "{m}");
        let (code, m) = rejected(admit(&mut a, &s, at(0, 1.5, 0), req("p", "{}")));
        assert_eq!(code, RejectCode::BudgetExceeded);
        assert!(m.contains("money budget"), "{m}");
        dispatched(admit(&mut a, &s, at(1, 0.5, 99), req("p", "{}")));
        // Where the run is held at its money budget, its new agents wait instead.
        let held = Spent {
            money_holds: true,
            ..at(1, 1.5, 0)
        };
        dispatched(admit(&mut a, &s, held, req("p", "{}")));
    }

    #[test]
    fn bad_options_a_bad_schema_and_an_unknown_type_are_rejected_before_anything_runs() {
        let (mut a, s) = (Admitter::default(), settings());
        let (code, _) = rejected(admit(
            &mut a,
            &s,
            Spent::default(),
            req("p", r#"{"model": 7}"#),
        ));
        assert_eq!(code, RejectCode::InvalidOption);
        let (code, m) = rejected(admit(
            &mut a,
            &s,
            Spent::default(),
            req("p", r#"{"schema": {"type": "nonsense"}}"#),
        ));
        assert_eq!(code, RejectCode::SchemaInvalid, "{m}");
        let (code, m) = rejected(admit(
            &mut a,
            &s,
            Spent::default(),
            req("p", r#"{"agentType": "ghost"}"#),
        ));
        assert_eq!(code, RejectCode::UnknownAgentType);
        assert!(m.contains("\"ghost\""), "{m}");
        let (code, _) = rejected(admit(
            &mut a,
            &s,
            Spent::default(),
            req(
                &"x".repeat(flotilla_proto::frag::MAX_MESSAGE_BYTES / 2 + 1),
                "{}",
            ),
        ));
        assert_eq!(code, RejectCode::TooLarge);
    }

    #[test]
    fn the_model_comes_from_the_call_then_the_type_then_the_run_unless_forced() {
        let mut s = settings();
        s.model = "run-model".into();
        let mut types = || {
            vec![AgentType {
                name: "reviewer".into(),
                model: Some("type-model".into()),
                description: None,
                prompt: None,
                tools: Vec::new(),
            }]
        };
        let mut a = Admitter::default();
        let mut model = |a: &mut Admitter, s: &RunSettings, opts: &str| match a.admit(
            req("p", opts),
            s,
            Spent::default(),
            &mut types,
            None,
        ) {
            Admission::Dispatch(d) => d.spec.model,
            other => panic!("{other:?}"),
        };
        assert_eq!(model(&mut a, &s, "{}"), "run-model");
        assert_eq!(
            model(&mut a, &s, r#"{"agentType": "reviewer"}"#),
            "type-model"
        );
        assert_eq!(
            model(&mut a, &s, r#"{"agentType": "reviewer", "model": "mine"}"#),
            "mine"
        );
        s.force_model = true;
        assert_eq!(model(&mut a, &s, r#"{"model": "mine"}"#), "run-model");
    }

    #[test]
    fn prefix_replay_serves_calls_until_the_first_that_differs_and_none_after() {
        let mut s = settings();
        s.replay = ReplayMode::Prefix;
        let mut probe = Admitter::default();
        let keys: Vec<String> = ["a", "b", "c"]
            .iter()
            .map(|p| dispatched(admit(&mut probe, &s, Spent::default(), req(p, "{}"))).key)
            .collect();
        let src = ResumeSource::from_records(
            "old",
            keys.iter()
                .enumerate()
                .map(|(i, k)| record(i as u64, k))
                .collect(),
        );
        let mut a = Admitter::default();
        let go = |a: &mut Admitter, i: u64, p: &str| {
            a.admit(
                req(p, "{}"),
                &s,
                Spent {
                    calls: i,
                    ..Spent::default()
                },
                &mut none,
                Some(&src),
            )
        };
        assert!(matches!(go(&mut a, 0, "a"), Admission::Cached(..)));
        assert!(matches!(go(&mut a, 1, "changed"), Admission::Dispatch(_)));
        assert!(
            matches!(go(&mut a, 2, "c"), Admission::Dispatch(_)),
            "after the first difference nothing is served"
        );
        // Unchanged calls started in another order than the source run's (a pipeline whose
        // stages finished in another order) are all served.
        let mut a = Admitter::default();
        for (i, p) in ["c", "a", "b"].iter().enumerate() {
            assert!(
                matches!(go(&mut a, i as u64, p), Admission::Cached(..)),
                "{p} was not served"
            );
        }
    }

    #[test]
    fn content_replay_serves_any_call_whose_key_is_in_the_source() {
        let mut s = settings();
        s.replay = ReplayMode::Content;
        let mut probe = Admitter::default();
        let kb = dispatched(admit(&mut probe, &s, Spent::default(), req("b", "{}"))).key;
        let src = ResumeSource::from_records("old", vec![record(0, &kb)]);
        let mut a = Admitter::default();
        let first = a.admit(
            req("new", "{}"),
            &s,
            Spent::default(),
            &mut none,
            Some(&src),
        );
        assert!(matches!(first, Admission::Dispatch(_)));
        let served = a.admit(req("b", "{}"), &s, Spent::default(), &mut none, Some(&src));
        match served {
            Admission::Cached(ad, r) => {
                assert_eq!(ad.key, kb);
                assert_eq!(r.result, Some(RawJson::string("served 0")));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_worktree_call_never_shares_a_prefix_group() {
        let (mut a, s) = (Admitter::default(), settings());
        let plain = dispatched(admit(&mut a, &s, Spent::default(), req("p", "{}")));
        assert_eq!(plain.prefix_group(0), plain.prefix_group(1));
        let wt = dispatched(admit(
            &mut a,
            &s,
            Spent::default(),
            req("p", r#"{"isolation": "worktree"}"#),
        ));
        assert_ne!(wt.prefix_group(0), wt.prefix_group(1));
        assert_eq!(wt.task(&s).isolation, "worktree");
    }
}
