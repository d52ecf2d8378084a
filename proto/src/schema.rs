//! JSON Schema rules for structured agent results (W13–W15).
//!
//! - [`preflight`] runs before any agent starts: the schema must be valid JSON Schema, its root
//!   must be an object schema, and it must not contradict itself in a way that can be proved
//!   statically (a `required` key that `additionalProperties: false` rules out, a minimum above
//!   its maximum, an empty `enum`). A call whose schema fails preflight rejects and no agent
//!   starts.
//! - [`Validator`] checks one submission and explains every failure in one line, which is what
//!   a model (or the echo backend) sees before it resubmits.
//!
//! Invariant: a schema that passes [`preflight`] always compiles into a [`Validator`].

use crate::Problem;
use serde_json::Value;

/// Checks a schema before an agent is started. The error names the problem and where it is.
pub fn preflight(schema: &Value) -> Result<(), Problem> {
    let Value::Object(root) = schema else {
        return Err(Problem::invalid(format!(
            "schema must be a JSON Schema object like {{ type: 'object', properties: {{...}} }}, got {}",
            kind_of(schema)
        )));
    };
    if let Err(e) = jsonschema::meta::validate(schema) {
        let at = e.instance_path().to_string();
        let at = if at.is_empty() {
            "the root".to_owned()
        } else {
            at
        };
        return Err(Problem::invalid(format!(
            "schema is not valid JSON Schema: {e} (at {at})"
        )));
    }
    match root.get("type") {
        Some(Value::String(t)) if t == "object" => {}
        Some(other) => {
            return Err(Problem::invalid(format!(
                "schema root must have type 'object' (the agent answers with an object), found type {other}"
            )));
        }
        None => {
            return Err(Problem::invalid(
                "schema root must have type 'object' (the agent answers with an object): add type: 'object'",
            ));
        }
    }
    contradictions(schema, "#")?;
    // W13: the root is { type: 'object', properties }, with required ⊆ properties.
    if let Some(Value::Array(required)) = root.get("required") {
        let props = root.get("properties").and_then(Value::as_object);
        for key in required.iter().filter_map(Value::as_str) {
            if !props.is_some_and(|p| p.contains_key(key)) {
                return Err(Problem::invalid(format!(
                    "schema root requires '{key}' but does not define it in properties; add '{key}' to properties"
                )));
            }
        }
    }
    Validator::new(schema).map(|_| ())
}

/// A compiled schema.
pub struct Validator {
    inner: jsonschema::Validator,
}

impl std::fmt::Debug for Validator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Validator").finish_non_exhaustive()
    }
}

impl Validator {
    /// Compiles a schema (no preflight).
    pub fn new(schema: &Value) -> Result<Self, Problem> {
        jsonschema::validator_for(schema)
            .map(|inner| Validator { inner })
            .map_err(|e| Problem::invalid(format!("schema cannot be compiled: {e}")))
    }

    /// Validates one submission; the error lists up to three failures with their locations.
    pub fn validate(&self, instance: &Value) -> Result<(), Problem> {
        let mut problems = Vec::new();
        let mut total = 0usize;
        for error in self.inner.iter_errors(instance) {
            total += 1;
            if problems.len() < 3 {
                let path = error.instance_path().to_string();
                let path = if path.is_empty() {
                    "/".to_owned()
                } else {
                    path
                };
                problems.push(format!("at {path}: {error}"));
            }
        }
        if total == 0 {
            return Ok(());
        }
        let mut message = problems.join("; ");
        if total > problems.len() {
            message.push_str(&format!(" (and {} more)", total - problems.len()));
        }
        Err(Problem::invalid(message))
    }
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Walks every subschema and reports the first self-contradiction that can be proved.
fn contradictions(schema: &Value, at: &str) -> Result<(), Problem> {
    let Value::Object(map) = schema else {
        return Ok(());
    };
    if map.get("additionalProperties") == Some(&Value::Bool(false))
        && !map.contains_key("patternProperties")
    {
        let props = map.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(required)) = map.get("required") {
            for key in required.iter().filter_map(Value::as_str) {
                if !props.is_some_and(|p| p.contains_key(key)) {
                    return Err(Problem::invalid(format!(
                        "schema contradicts itself at {at}: '{key}' is required but additionalProperties: false rules it out (it is not in properties); add '{key}' to properties or drop it from required"
                    )));
                }
            }
        }
    }
    for (low, high) in [
        ("minimum", "maximum"),
        ("minLength", "maxLength"),
        ("minItems", "maxItems"),
        ("minProperties", "maxProperties"),
        ("minContains", "maxContains"),
    ] {
        if let (Some(lo), Some(hi)) = (
            map.get(low).and_then(Value::as_f64),
            map.get(high).and_then(Value::as_f64),
        ) && lo > hi
        {
            return Err(Problem::invalid(format!(
                "schema contradicts itself at {at}: {low} {lo} is above {high} {hi}, so no value can match"
            )));
        }
    }
    if let Some(Value::Array(members)) = map.get("enum")
        && members.is_empty()
    {
        return Err(Problem::invalid(format!(
            "schema contradicts itself at {at}: enum is empty, so no value can match"
        )));
    }
    if let Some(Value::Object(props)) = map.get("properties") {
        for (name, sub) in props {
            contradictions(sub, &format!("{at}/properties/{name}"))?;
        }
    }
    for key in ["items", "additionalProperties", "not", "contains"] {
        if let Some(sub) = map.get(key) {
            contradictions(sub, &format!("{at}/{key}"))?;
        }
    }
    for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
        if let Some(Value::Array(subs)) = map.get(key) {
            for (i, sub) in subs.iter().enumerate() {
                contradictions(sub, &format!("{at}/{key}/{i}"))?;
            }
        }
    }
    for key in ["$defs", "definitions"] {
        if let Some(Value::Object(defs)) = map.get(key) {
            for (name, sub) in defs {
                contradictions(sub, &format!("{at}/{key}/{name}"))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn accepts_an_object_schema() {
        let s =
            json!({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]});
        preflight(&s).unwrap();
    }

    #[test]
    fn rejects_required_key_ruled_out_by_additional_properties() {
        let s = json!({"type": "object", "properties": {"a": {"type": "string"}},
                        "required": ["a", "b"], "additionalProperties": false});
        let e = preflight(&s).unwrap_err();
        assert!(e.message.contains("'b' is required"), "{e}");
        assert!(e.message.contains("additionalProperties: false"), "{e}");
    }

    #[test]
    fn root_required_keys_must_be_defined_in_properties() {
        let s = json!({"type": "object", "properties": {}, "required": ["b"]});
        let e = preflight(&s).unwrap_err();
        assert!(
            e.message.contains("'b'") && e.message.contains("properties"),
            "{e}"
        );
        // Nested objects may require keys they allow through additionalProperties.
        let s =
            json!({"type": "object", "properties": {"o": {"type": "object", "required": ["x"]}}});
        preflight(&s).unwrap();
    }

    #[test]
    fn rejects_nested_contradictions_with_their_location() {
        let s = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 2}}});
        let e = preflight(&s).unwrap_err();
        assert!(e.message.contains("#/properties/n"), "{e}");
        let s = json!({"type": "object", "properties": {"l": {"type": "array", "items": {"enum": []}}}});
        let e = preflight(&s).unwrap_err();
        assert!(e.message.contains("enum is empty"), "{e}");
    }

    #[test]
    fn rejects_invalid_json_schema() {
        let s = json!({"type": "object", "properties": {"a": {"type": "strnig"}}});
        let e = preflight(&s).unwrap_err();
        assert!(e.message.contains("not valid JSON Schema"), "{e}");
        let e = preflight(&json!("object")).unwrap_err();
        assert!(e.message.contains("got a string"), "{e}");
    }

    #[test]
    fn rejects_non_object_root() {
        let e = preflight(&json!({"type": "array", "items": {}})).unwrap_err();
        assert!(e.message.contains("type 'object'"), "{e}");
        let e = preflight(&json!({"properties": {}})).unwrap_err();
        assert!(e.message.contains("add type: 'object'"), "{e}");
    }

    #[test]
    fn validation_names_the_failing_location() {
        let v = Validator::new(
            &json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
        )
        .unwrap();
        v.validate(&json!({"n": 3})).unwrap();
        let e = v.validate(&json!({"n": "x"})).unwrap_err();
        assert!(e.message.contains("/n"), "{e}");
        let e = v.validate(&json!({})).unwrap_err();
        assert!(e.message.contains("required"), "{e}");
    }
}

/// Property-based fuzzing (`tools/fuzz` runs it long): any JSON as a schema, and schema-shaped
/// objects built from the keywords preflight looks at.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            "[a-z]{0,6}|string|object|array|integer|number|boolean|null".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map(keyword(), inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn keyword() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("type".to_owned()),
            Just("properties".to_owned()),
            Just("required".to_owned()),
            Just("additionalProperties".to_owned()),
            Just("minimum".to_owned()),
            Just("maximum".to_owned()),
            Just("exclusiveMinimum".to_owned()),
            Just("minLength".to_owned()),
            Just("maxLength".to_owned()),
            Just("minItems".to_owned()),
            Just("maxItems".to_owned()),
            Just("enum".to_owned()),
            Just("const".to_owned()),
            Just("items".to_owned()),
            Just("pattern".to_owned()),
            Just("anyOf".to_owned()),
            Just("allOf".to_owned()),
            Just("$ref".to_owned()),
            "[a-z]{1,5}",
        ]
    }

    proptest! {
        /// Preflight answers every input without panicking, and what it lets through compiles
        /// and validates any instance without panicking (the module's invariant).
        #[test]
        fn preflight_never_panics_and_what_it_passes_compiles(schema in json(), instance in json()) {
            if preflight(&schema).is_ok() {
                match Validator::new(&schema) {
                    Ok(v) => {
                        let _ = v.validate(&instance);
                    }
                    Err(e) => prop_assert!(false, "preflight passed {schema} but it does not compile: {e}"),
                }
            }
        }

        /// An object schema with arbitrary keywords under `properties`.
        #[test]
        fn object_schemas_with_any_properties_are_judged(props in prop::collection::btree_map("[a-z]{1,4}", json(), 0..5), required in prop::collection::vec("[a-z]{1,4}", 0..3)) {
            let schema = serde_json::json!({
                "type": "object",
                "properties": props,
                "required": required,
            });
            if preflight(&schema).is_ok() {
                prop_assert!(Validator::new(&schema).is_ok());
            }
        }
    }
}
