//! The workflows shipped inside the binary (`coordinator/workflows/*.js`). They are listed
//! next to the user's own and resolve by name after every saved one, so a project or personal
//! workflow of the same name replaces a bundled one. Each is a readable script to copy and edit.

/// `(file stem, source)` of every bundled workflow.
pub const BUNDLED: [(&str, &str); 5] = [
    (
        "deep-research",
        include_str!("../../workflows/deep-research.js"),
    ),
    (
        "code-review",
        include_str!("../../workflows/code-review.js"),
    ),
    ("reflect", include_str!("../../workflows/reflect.js")),
    ("ingest", include_str!("../../workflows/ingest.js")),
    ("lint", include_str!("../../workflows/lint.js")),
];

/// The origin shown for a bundled workflow.
pub fn origin(name: &str) -> String {
    format!("bundled:{name}")
}

/// Whether bundled workflows are hidden (`FLOTILLA_DISABLE_BUNDLED_WORKFLOWS=1`, or Claude
/// Code's `CLAUDE_CODE_DISABLE_BUNDLED_SKILLS=1`, W67).
pub fn hidden() -> bool {
    [
        "FLOTILLA_DISABLE_BUNDLED_WORKFLOWS",
        "CLAUDE_CODE_DISABLE_BUNDLED_SKILLS",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|s| s == "1" || s.eq_ignore_ascii_case("true")))
}

/// A workflow found for a reference (here, below [`crate::workflows`], which finds saved ones
/// too, so that this list of bundled ones imports nothing above it).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FoundWorkflow {
    pub name: String,
    pub source: String,
    pub origin: String,
}

impl From<flotilla_proto::v1::SavedWorkflow> for FoundWorkflow {
    fn from(w: flotilla_proto::v1::SavedWorkflow) -> Self {
        FoundWorkflow {
            name: w.name,
            source: w.source,
            origin: w.origin,
        }
    }
}

/// The bundled workflow called `name`, unless bundled workflows are hidden.
pub fn find(name: &str) -> Option<FoundWorkflow> {
    if hidden() {
        return None;
    }
    BUNDLED
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(n, source)| FoundWorkflow {
            name: (*n).to_owned(),
            source: (*source).to_owned(),
            origin: origin(n),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_script::text;

    #[test]
    fn every_bundled_workflow_has_a_literal_meta_named_like_its_file() {
        for (name, text) in BUNDLED {
            let meta = text::read_meta(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(meta.name, name);
            assert!(!meta.description.is_empty(), "{name}");
            assert!(meta.when_to_use.is_some(), "{name} says what args it takes");
            assert!(!meta.phases.is_empty(), "{name}");
        }
    }
}
