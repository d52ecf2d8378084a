//! Workflows saved on the coordinator (`flotilla workflows push`): one object per workflow at
//! `workflows/{name}.js` in the coordinator's object storage, so every coordinator sharing the
//! store offers the same ones and `flotilla launch NAME` works from any machine.
//!
//! Pushing changes what everyone's `launch NAME` runs, so it is a permission of its own (the
//! server decides who holds it), a push never takes a bundled workflow's name unless the
//! operator allows it, and every push leaves a record (who, when, the script's hash, what it
//! replaced) at `workflows/.pushes/{name}/`, written before the script itself.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::script::source;
use crate::store::{Store, keys};
use crate::workflows::FoundWorkflow;

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

/// The origin shown for a saved workflow.
pub fn origin(name: &str) -> String {
    format!("server:{name}")
}

/// One push, as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushRecord {
    pub name: String,
    /// Who pushed: the certificate name of the client (or `insecure` without TLS).
    pub by: String,
    /// RFC 3339, UTC.
    pub at: String,
    pub sha256: String,
    /// The hash of the script it replaced, if any.
    pub replaced: Option<String>,
}

/// How a push may go.
#[derive(Debug, Clone, Copy, Default)]
pub struct PushRules {
    /// A push may take the name of a bundled workflow (off unless the operator says so).
    pub shadow_bundled: bool,
}

/// Why a push or a read of saved workflows failed.
#[derive(Debug, thiserror::Error)]
pub enum SavedError {
    #[error("the workflow's meta is not a literal with name and description (W02): {0}")]
    Meta(String),
    #[error("the workflow does not load: {0}")]
    Load(String),
    #[error("meta.name {0:?} cannot name a saved workflow: use letters, digits, '-', '_' and '.'")]
    BadName(String),
    #[error(
        "{0:?} is the name of a bundled workflow: pushing it would change what everyone's `launch {0}` runs; give yours another meta.name (or start the coordinator with --allow-shadow-bundled)"
    )]
    Bundled(String),
    #[error("cannot {doing}: {source}")]
    Store {
        doing: &'static str,
        #[source]
        source: crate::store::Error,
    },
    #[error("cannot encode the record: {0}")]
    Encode(String),
}

impl SavedError {
    pub fn kind(&self) -> flotilla_proto::ErrorKind {
        use flotilla_proto::ErrorKind;
        match self {
            SavedError::Meta(_) | SavedError::Load(_) | SavedError::BadName(_) => {
                ErrorKind::Invalid
            }
            SavedError::Bundled(_) => ErrorKind::Conflict,
            SavedError::Store { source, .. } => source.kind(),
            SavedError::Encode(_) => ErrorKind::Internal,
        }
    }
}

/// A store error while doing `doing`.
fn store_err(doing: &'static str) -> impl Fn(crate::store::Error) -> SavedError {
    move |source| SavedError::Store { doing, source }
}

/// Checks and stores a workflow pushed by `by`; its name comes from its literal meta.
pub async fn push(
    store: &Store,
    text: &str,
    by: &str,
    rules: PushRules,
) -> Result<PushRecord, SavedError> {
    let meta = source::read_meta(text).map_err(|e| SavedError::Meta(e.to_string()))?;
    source::prepare(text).map_err(|e| SavedError::Load(e.to_string()))?;
    if !valid_name(&meta.name) {
        return Err(SavedError::BadName(meta.name));
    }
    if !rules.shadow_bundled && crate::bundled::find(&meta.name).is_some() {
        return Err(SavedError::Bundled(meta.name));
    }
    let k = keys::saved_workflow(&meta.name);
    let replaced = store
        .get(&k)
        .await
        .map_err(store_err("read the store"))?
        .map(|old| hex::encode(Sha256::digest(&old)));
    let now = std::time::SystemTime::now();
    let at_ms = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let record = PushRecord {
        name: meta.name.clone(),
        by: by.to_owned(),
        at: humantime::format_rfc3339_millis(now).to_string(),
        sha256: hex::encode(Sha256::digest(text.as_bytes())),
        replaced,
    };
    let body = serde_json::to_vec(&record).map_err(|e| SavedError::Encode(e.to_string()))?;
    store
        .put_create(
            &keys::workflow_push(&meta.name, at_ms, &record.sha256),
            Bytes::from(body),
        )
        .await
        .map_err(store_err("record the push"))?;
    store
        .put_overwrite(&k, Bytes::from(text.to_owned()))
        .await
        .map_err(store_err("write the store"))?;
    Ok(record)
}

/// Every recorded push of `name`, oldest first.
pub async fn pushes(store: &Store, name: &str) -> Result<Vec<PushRecord>, SavedError> {
    if !valid_name(name) {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for k in store
        .list_objects(&keys::workflow_pushes(name))
        .await
        .map_err(store_err("list the store"))?
    {
        if let Some(body) = store.get(&k).await.map_err(store_err("read the store"))?
            && let Ok(r) = serde_json::from_slice(&body)
        {
            out.push(r);
        }
    }
    Ok(out)
}

/// The saved workflow called `name`, if there is one.
pub async fn get(store: &Store, name: &str) -> Result<Option<FoundWorkflow>, SavedError> {
    if !valid_name(name) {
        return Ok(None);
    }
    let found = store
        .get(&keys::saved_workflow(name))
        .await
        .map_err(store_err("read the store"))?;
    Ok(found.map(|b| FoundWorkflow {
        name: name.to_owned(),
        source: String::from_utf8_lossy(&b).into_owned(),
        origin: origin(name),
    }))
}

/// Every saved workflow, by name.
pub async fn list(store: &Store) -> Result<Vec<FoundWorkflow>, SavedError> {
    let keys = store
        .list_objects(&keys::saved_workflows())
        .await
        .map_err(store_err("list the store"))?;
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
    async fn pushed_workflows_are_listed_replaced_by_name_and_recorded() {
        let store = crate::store::open("memory://").unwrap();
        let text = "export const meta = { name: 'triage', description: 'd' };\nreturn 1;";
        let first = push(&store, text, "alice", PushRules::default())
            .await
            .unwrap();
        assert_eq!(
            (first.name.as_str(), first.replaced.as_ref()),
            ("triage", None)
        );
        let v2 = "export const meta = { name: 'triage', description: 'd' };\nreturn 2;";
        let second = push(&store, v2, "bob", PushRules::default()).await.unwrap();
        assert_eq!(second.replaced, Some(first.sha256.clone()));
        let all = list(&store).await.unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].origin, "server:triage");
        assert_eq!(all[0].source, v2);
        let records = pushes(&store, "triage").await.unwrap();
        let who: Vec<&str> = records.iter().map(|r| r.by.as_str()).collect();
        assert_eq!(who, ["alice", "bob"]);
        assert!(get(&store, "../triage").await.unwrap().is_none());
        let e = push(
            &store,
            "export const meta = { name: x, description: 'd' };",
            "alice",
            PushRules::default(),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("literal"), "{e}");
        let e = push(
            &store,
            "export const meta = { name: '../up', description: 'd' };",
            "alice",
            PushRules::default(),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("cannot name"), "{e}");
        assert_eq!(e.kind(), flotilla_proto::ErrorKind::Invalid);
    }

    #[tokio::test]
    async fn a_bundled_name_is_not_taken_unless_the_operator_allows_it() {
        let store = crate::store::open("memory://").unwrap();
        let text = "export const meta = { name: 'deep-research', description: 'mine' };\nreturn 1;";
        let e = push(&store, text, "mallory", PushRules::default())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("bundled workflow"), "{e}");
        assert_eq!(e.kind(), flotilla_proto::ErrorKind::Conflict);
        assert!(list(&store).await.unwrap().is_empty());
        assert!(pushes(&store, "deep-research").await.unwrap().is_empty());
        let allowed = PushRules {
            shadow_bundled: true,
        };
        push(&store, text, "operator", allowed).await.unwrap();
        assert_eq!(list(&store).await.unwrap().len(), 1);
    }
}
