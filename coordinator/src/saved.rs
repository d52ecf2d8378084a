//! Workflows saved on the coordinator (`flotilla workflows push`): one object per workflow at
//! `workflows/{name}.js` in the coordinator's object storage, so every coordinator sharing the
//! store offers the same ones and `flotilla launch NAME` works from any machine.

use bytes::Bytes;
use object_store::path::Path;

use crate::script::source;
use crate::store::Store;
use crate::workflows::FoundWorkflow;

const PREFIX: &str = "workflows";

/// Whether `name` can name a saved workflow: letters, digits, `-`, `_` and `.`, not starting
/// with a dot, at most 100 characters (so it can never leave its directory).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 100
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn key(name: &str) -> Path {
    Path::from(format!("{PREFIX}/{name}.js"))
}

/// The origin shown for a saved workflow.
pub fn origin(name: &str) -> String {
    format!("server:{name}")
}

/// Checks and stores a workflow; its name comes from its literal meta. Returns the name and
/// whether one of that name was replaced.
pub async fn push(store: &Store, text: &str) -> Result<(String, bool), String> {
    let meta = source::read_meta(text).map_err(|e| {
        format!("the workflow's meta is not a literal with name and description (W02): {e}")
    })?;
    source::prepare(text).map_err(|e| format!("the workflow does not load: {e}"))?;
    if !valid_name(&meta.name) {
        return Err(format!(
            "meta.name {:?} cannot name a saved workflow: use letters, digits, '-', '_' and '.'",
            meta.name
        ));
    }
    let k = key(&meta.name);
    let replaced = store
        .get(&k)
        .await
        .map_err(|e| format!("cannot read the store: {e}"))?
        .is_some();
    store
        .put_overwrite(&k, Bytes::from(text.to_owned()))
        .await
        .map_err(|e| format!("cannot write the store: {e}"))?;
    Ok((meta.name, replaced))
}

/// The saved workflow called `name`, if there is one.
pub async fn get(store: &Store, name: &str) -> Result<Option<FoundWorkflow>, String> {
    if !valid_name(name) {
        return Ok(None);
    }
    let found = store
        .get(&key(name))
        .await
        .map_err(|e| format!("cannot read the store: {e}"))?;
    Ok(found.map(|b| FoundWorkflow {
        name: name.to_owned(),
        source: String::from_utf8_lossy(&b).into_owned(),
        origin: origin(name),
    }))
}

/// Every saved workflow, by name.
pub async fn list(store: &Store) -> Result<Vec<FoundWorkflow>, String> {
    let keys = store
        .list_objects(&Path::from(PREFIX))
        .await
        .map_err(|e| format!("cannot list the store: {e}"))?;
    let mut out = Vec::new();
    for k in keys {
        let Some(name) = k.filename().and_then(|f| f.strip_suffix(".js")) else {
            continue;
        };
        if let Some(w) = get(store, name).await? {
            out.push(w);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pushed_workflows_are_listed_and_replaced_by_name() {
        let store = crate::store::open("memory://").unwrap();
        let text = "export const meta = { name: 'triage', description: 'd' };\nreturn 1;";
        assert_eq!(push(&store, text).await.unwrap(), ("triage".into(), false));
        assert_eq!(push(&store, text).await.unwrap(), ("triage".into(), true));
        let all = list(&store).await.unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].origin, "server:triage");
        assert!(get(&store, "../triage").await.unwrap().is_none());
        let e = push(&store, "export const meta = { name: x, description: 'd' };")
            .await
            .unwrap_err();
        assert!(e.contains("literal"), "{e}");
        let e = push(
            &store,
            "export const meta = { name: '../up', description: 'd' };",
        )
        .await
        .unwrap_err();
        assert!(e.contains("cannot name"), "{e}");
    }
}
