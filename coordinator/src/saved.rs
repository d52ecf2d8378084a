//! Workflows saved on the coordinator (`flotilla workflows push`): one object per workflow in
//! the coordinator's object storage, so every coordinator sharing the store offers the same
//! ones and `flotilla launch NAME` works from any machine.
//!
//! **Pushed workflows belong to a namespace.** A push goes to the namespace its caller acts in
//! (as a launch's: the one it names if its certificate does, else the certificate's first),
//! and a run resolves names against its own namespace's pushed workflows only: another
//! namespace's are never listed, launched or reached by `workflow(name)`, and asking for one
//! reads exactly as asking for a name nobody pushed. An operator (`*`) may also push to the
//! fleet ([`FLEET`]): those are offered to every namespace after its own, so among pushed
//! workflows a name resolves to the run's namespace's, else the fleet's (the bundled ones
//! come after both). `default`'s
//! workflows stay at `workflows/{name}.js`, where stores kept every push before namespaces
//! (see `store::keys::workflows_of`).
//!
//! Pushing changes what a namespace's `launch NAME` runs, so it is a permission of its own
//! (the server decides who holds it), a push never takes a bundled workflow's name unless the
//! operator allows it, and every push leaves a record (who, when, the script's hash, what it
//! replaced) at `{workflows}/.pushes/{name}/`, written before the script itself.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::namespace;
use crate::script::text;
use crate::store::{Store, keys};
use crate::workflows::FoundWorkflow;

/// Where an operator's pushes for every namespace go (`--namespace '*'`): offered to each
/// namespace after its own.
pub const FLEET: &str = namespace::ALL;

/// Whether `ns` names a place pushed workflows are kept: a namespace (empty: `default`), or
/// the fleet's.
fn valid_place(ns: &str) -> bool {
    ns == FLEET || namespace::valid_name(namespace::effective(ns))
}

pub use flotilla_proto::names::{pushed_to_fleet, valid_workflow_name as valid_name};

/// The origin shown for a workflow pushed to `ns`: `server:NAME`, or `fleet:NAME` for one
/// pushed to the whole fleet.
pub fn origin(ns: &str, name: &str) -> String {
    if ns == FLEET {
        format!("fleet:{name}")
    } else {
        format!("server:{name}")
    }
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
        "{0:?} is not a namespace name: 1 to 63 lower-case letters, digits, - _ and . (or * for every namespace)"
    )]
    BadNamespace(String),
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
            SavedError::Meta(_)
            | SavedError::Load(_)
            | SavedError::BadName(_)
            | SavedError::BadNamespace(_) => ErrorKind::Invalid,
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

/// Checks and stores a workflow pushed by `by` to namespace `ns` (or [`FLEET`]); its name
/// comes from its literal meta. Whether `by` may push there is the caller's to check.
pub async fn push(
    store: &Store,
    ns: &str,
    text: &str,
    by: &str,
    rules: PushRules,
) -> Result<PushRecord, SavedError> {
    if !valid_place(ns) {
        return Err(SavedError::BadNamespace(ns.to_owned()));
    }
    let meta = text::read_meta(text).map_err(|e| SavedError::Meta(e.to_string()))?;
    text::prepare(text).map_err(|e| SavedError::Load(e.to_string()))?;
    if !valid_name(&meta.name) {
        return Err(SavedError::BadName(meta.name));
    }
    if !rules.shadow_bundled && crate::bundled::find(&meta.name).is_some() {
        return Err(SavedError::Bundled(meta.name));
    }
    let k = keys::saved_workflow(ns, &meta.name);
    let replaced = store
        .get(&k)
        .await
        .map_err(store_err("read the store"))?
        .map(|old| hex::encode(Sha256::digest(&old)));
    let now = flotilla_proto::clock::now();
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
            &keys::workflow_push(ns, &meta.name, at_ms, &record.sha256),
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

/// Every recorded push of `name` to `ns`, oldest first.
pub async fn pushes(store: &Store, ns: &str, name: &str) -> Result<Vec<PushRecord>, SavedError> {
    if !valid_name(name) || !valid_place(ns) {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for k in store
        .list_objects(&keys::workflow_pushes(ns, name))
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

/// The workflow called `name` pushed to `ns` itself (the fleet's not included), if any.
pub async fn get(store: &Store, ns: &str, name: &str) -> Result<Option<FoundWorkflow>, SavedError> {
    if !valid_name(name) || !valid_place(ns) {
        return Ok(None);
    }
    let found = store
        .get(&keys::saved_workflow(ns, name))
        .await
        .map_err(store_err("read the store"))?;
    Ok(found.map(|b| FoundWorkflow {
        name: name.to_owned(),
        source: String::from_utf8_lossy(&b).into_owned(),
        origin: origin(ns, name),
    }))
}

/// Every workflow pushed to `ns` itself (the fleet's not included), by name.
pub async fn list(store: &Store, ns: &str) -> Result<Vec<FoundWorkflow>, SavedError> {
    if !valid_place(ns) {
        return Ok(Vec::new());
    }
    let keys = store
        .list_objects(&keys::saved_workflows(ns))
        .await
        .map_err(store_err("list the store"))?;
    let mut out = Vec::new();
    for k in keys {
        let Some(name) = k.filename().and_then(|f| f.strip_suffix(".js")) else {
            continue;
        };
        if let Some(w) = get(store, ns, name).await? {
            out.push(w);
        }
    }
    Ok(out)
}

/// What a run in namespace `ns` reaches by name: `name` as pushed to `ns`, else as pushed to
/// the fleet. (Bundled workflows come after; that is the caller's.)
pub async fn find(
    store: &Store,
    ns: &str,
    name: &str,
) -> Result<Option<FoundWorkflow>, SavedError> {
    if let Some(w) = get(store, ns, name).await? {
        return Ok(Some(w));
    }
    if ns == FLEET {
        return Ok(None);
    }
    get(store, FLEET, name).await
}

/// Every pushed workflow a run in namespace `ns` reaches by name ([`find`] of each): `ns`'s,
/// then the fleet's whose names `ns` has not pushed.
pub async fn offered(store: &Store, ns: &str) -> Result<Vec<FoundWorkflow>, SavedError> {
    let mut out = list(store, ns).await?;
    if ns != FLEET {
        for w in list(store, FLEET).await? {
            if !out.iter().any(|o| o.name == w.name) {
                out.push(w);
            }
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
        let first = push(&store, "default", text, "alice", PushRules::default())
            .await
            .unwrap();
        assert_eq!(
            (first.name.as_str(), first.replaced.as_ref()),
            ("triage", None)
        );
        let v2 = "export const meta = { name: 'triage', description: 'd' };\nreturn 2;";
        let second = push(&store, "default", v2, "bob", PushRules::default())
            .await
            .unwrap();
        assert_eq!(second.replaced, Some(first.sha256.clone()));
        let all = list(&store, "default").await.unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].origin, "server:triage");
        assert_eq!(all[0].source, v2);
        let records = pushes(&store, "default", "triage").await.unwrap();
        let who: Vec<&str> = records.iter().map(|r| r.by.as_str()).collect();
        assert_eq!(who, ["alice", "bob"]);
        assert!(get(&store, "default", "../triage").await.unwrap().is_none());
        let e = push(
            &store,
            "default",
            "export const meta = { name: x, description: 'd' };",
            "alice",
            PushRules::default(),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("literal"), "{e}");
        let e = push(
            &store,
            "default",
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
        let e = push(&store, "default", text, "mallory", PushRules::default())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("bundled workflow"), "{e}");
        assert_eq!(e.kind(), flotilla_proto::ErrorKind::Conflict);
        assert!(list(&store, "default").await.unwrap().is_empty());
        assert!(
            pushes(&store, "default", "deep-research")
                .await
                .unwrap()
                .is_empty()
        );
        let allowed = PushRules {
            shadow_bundled: true,
        };
        push(&store, "default", text, "operator", allowed)
            .await
            .unwrap();
        assert_eq!(list(&store, "default").await.unwrap().len(), 1);
    }

    /// A script named `name` that returns `says`.
    fn script(name: &str, says: &str) -> String {
        format!("export const meta = {{ name: '{name}', description: 'd' }};\nreturn '{says}';")
    }

    #[tokio::test]
    async fn a_namespace_finds_its_own_pushes_then_the_fleet_s_and_never_another_namespace_s() {
        let store = crate::store::open("memory://").unwrap();
        let rules = PushRules::default();
        push(&store, "team-b", &script("audit", "b"), "bob", rules)
            .await
            .unwrap();
        push(&store, FLEET, &script("shared", "fleet"), "ops", rules)
            .await
            .unwrap();
        // Team A reaches the fleet's, never team B's, under any spelling of the name.
        for name in [
            "audit",
            "../team-b/workflows/audit",
            "team-b/audit",
            ".pushes",
        ] {
            assert!(
                find(&store, "team-a", name).await.unwrap().is_none(),
                "{name}"
            );
        }
        let seen: Vec<String> = offered(&store, "team-a")
            .await
            .unwrap()
            .into_iter()
            .map(|w| w.origin)
            .collect();
        assert_eq!(seen, ["fleet:shared"]);
        // Its own push of either name is what it runs; team B's and the fleet's stay.
        push(&store, "team-a", &script("audit", "a"), "alice", rules)
            .await
            .unwrap();
        push(&store, "team-a", &script("shared", "a"), "alice", rules)
            .await
            .unwrap();
        let source = |w: Option<FoundWorkflow>| w.unwrap().source;
        assert!(source(find(&store, "team-a", "audit").await.unwrap()).contains("'a'"));
        assert!(source(find(&store, "team-a", "shared").await.unwrap()).contains("'a'"));
        assert!(source(find(&store, "team-b", "audit").await.unwrap()).contains("'b'"));
        assert!(source(find(&store, "team-b", "shared").await.unwrap()).contains("fleet"));
        assert_eq!(offered(&store, "team-a").await.unwrap().len(), 2);
        assert_eq!(pushes(&store, "team-a", "audit").await.unwrap().len(), 1);
        assert_eq!(
            pushes(&store, "team-b", "audit").await.unwrap()[0].by,
            "bob"
        );
        // `default` is where pushes were before namespaces, and sees none of these.
        let seen: Vec<String> = offered(&store, "default")
            .await
            .unwrap()
            .into_iter()
            .map(|w| w.origin)
            .collect();
        assert_eq!(seen, ["fleet:shared"]);
        // Nothing is kept outside a namespace's own place.
        for ns in [
            "..",
            "team-a/../team-b",
            "Team-A",
            "team-a/x",
            "%2e%2e",
            "**",
        ] {
            let e = push(&store, ns, &script("x", "x"), "eve", rules)
                .await
                .unwrap_err();
            assert_eq!(e.kind(), flotilla_proto::ErrorKind::Invalid, "{ns}: {e}");
            assert!(list(&store, ns).await.unwrap().is_empty(), "{ns}");
        }
    }

    /// Pieces a hostile caller builds workflow names and namespaces from.
    fn piece() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        prop_oneof![
            Just("team-b".to_owned()),
            Just("team-a".to_owned()),
            Just("audit".to_owned()),
            Just("/".to_owned()),
            Just("..".to_owned()),
            Just(".".to_owned()),
            Just("*".to_owned()),
            Just("%2e".to_owned()),
            Just("%2f".to_owned()),
            Just("\\".to_owned()),
            Just("workflows".to_owned()),
            Just("namespaces".to_owned()),
            Just(".pushes".to_owned()),
            Just(".js".to_owned()),
            Just(" ".to_owned()),
            Just("\0".to_owned()),
            "[a-z0-9]{1,3}",
            any::<char>().prop_map(String::from),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Whatever name team A asks for, it never gets team B's workflow; whatever namespace
        /// a push names, it is refused as invalid or writes only under that namespace's place.
        #[test]
        fn no_name_or_namespace_reaches_past_its_own_namespace(
            name in proptest::collection::vec(piece(), 0..6),
            ns in proptest::collection::vec(piece(), 0..4),
        ) {
            let (name, ns) = (name.concat(), ns.concat());
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let store = crate::store::open("memory://").unwrap();
                let rules = PushRules::default();
                push(&store, "team-b", &script("audit", "team b"), "bob", rules)
                    .await
                    .unwrap();
                let before = store.list_all(&object_store::path::Path::from("")).await.unwrap();
                if let Some(w) = find(&store, "team-a", &name).await.unwrap() {
                    assert!(!w.source.contains("team b"), "{name:?} reached team b's");
                }
                match push(&store, &ns, &script("x", "eve"), "eve", rules).await {
                    Err(e) => assert_eq!(e.kind(), flotilla_proto::ErrorKind::Invalid, "{ns:?}: {e}"),
                    Ok(_) => {
                        assert!(valid_place(&ns), "{ns:?}");
                        let own = format!("{}/", keys::workflows_of(&ns));
                        for o in store.list_all(&object_store::path::Path::from("")).await.unwrap() {
                            let key = o.location.as_ref();
                            assert!(
                                key.starts_with(&own) || before.iter().any(|b| b == &o),
                                "a push to {ns:?} wrote {key}"
                            );
                        }
                    }
                }
                let bobs = find(&store, "team-b", "audit").await.unwrap().unwrap();
                assert!(bobs.source.contains("team b"));
            });
        }
    }
}
