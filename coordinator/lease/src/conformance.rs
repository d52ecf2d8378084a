//! The contract of `LeaseStore`, as one suite every implementation runs.
//!
//! Time passes through `tokio::time::sleep`, so the memory store runs it on a paused clock and
//! a real store (etcd) runs it in real time. TTLs are long enough for etcd's minimum.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use super::{BatchOp, Error, LeaseStore, WatchEvent};

const TTL: Duration = Duration::from_secs(3);

/// Runs every check against one store. Keys are namespaced per call so the suite can run
/// against a shared server.
pub async fn run_all(store: &dyn LeaseStore) {
    let ns = format!("/conformance/{}", std::process::id());
    keys_live_while_the_lease_is_kept_alive(store, &ns).await;
    expiry_deletes_every_key_and_is_watched(store, &ns).await;
    revoke_deletes_at_once(store, &ns).await;
    revisions_never_decrease(store, &ns).await;
    campaign_has_one_holder(store, &ns).await;
    writes_under_a_dead_lease_are_refused(store, &ns).await;
    a_batch_applies_in_order_under_one_revision(store, &ns).await;
    a_batch_with_a_dead_lease_writes_nothing(store, &ns).await;
    a_batch_that_names_a_key_twice_ends_as_its_last_write(store, &ns).await;
}

async fn keys_live_while_the_lease_is_kept_alive(store: &dyn LeaseStore, ns: &str) {
    let lease = store.grant(TTL).await.unwrap();
    let key = format!("{ns}/alive/a");
    store.put(&key, b"1".to_vec(), Some(lease)).await.unwrap();
    for _ in 0..4 {
        tokio::time::sleep(TTL / 2).await;
        store.keep_alive(lease).await.unwrap();
    }
    let kv = store
        .get(&key)
        .await
        .unwrap()
        .expect("kept-alive key is still there");
    assert_eq!(kv.value, b"1");
    assert_eq!(kv.lease, Some(lease));
    store.revoke(lease).await.unwrap();
}

async fn expiry_deletes_every_key_and_is_watched(store: &dyn LeaseStore, ns: &str) {
    let prefix = format!("{ns}/expiry/");
    let mut watch = store.watch(&prefix).await.unwrap();
    let lease = store.grant(TTL).await.unwrap();
    for k in ["a", "b"] {
        store
            .put(&format!("{prefix}{k}"), k.as_bytes().to_vec(), Some(lease))
            .await
            .unwrap();
    }
    // Not before the TTL.
    tokio::time::sleep(TTL / 2).await;
    assert_eq!(store.list(&prefix).await.unwrap().len(), 2);
    // Well after it (etcd may take a second longer than the TTL).
    tokio::time::sleep(TTL * 2).await;
    assert!(store.list(&prefix).await.unwrap().is_empty());
    let mut deleted = Vec::new();
    while deleted.len() < 2 {
        match tokio::time::timeout(Duration::from_secs(10), watch.recv()).await {
            Ok(Some(WatchEvent::Delete { key, .. })) => deleted.push(key),
            Ok(Some(WatchEvent::Put(_))) => {}
            other => panic!("watch ended before both deletions: {other:?}"),
        }
    }
    deleted.sort();
    assert_eq!(deleted, vec![format!("{prefix}a"), format!("{prefix}b")]);
    assert_eq!(store.keep_alive(lease).await, Err(Error::LeaseGone(lease)));
}

async fn revoke_deletes_at_once(store: &dyn LeaseStore, ns: &str) {
    let lease = store.grant(TTL).await.unwrap();
    let key = format!("{ns}/revoke/a");
    store.put(&key, b"x".to_vec(), Some(lease)).await.unwrap();
    store.revoke(lease).await.unwrap();
    assert!(store.get(&key).await.unwrap().is_none());
}

async fn revisions_never_decrease(store: &dyn LeaseStore, ns: &str) {
    let key = format!("{ns}/rev/a");
    let mut last = 0;
    for i in 0..5u8 {
        let rev = store.put(&key, vec![i], None).await.unwrap();
        assert!(rev > last, "revision {rev} after {last}");
        last = rev;
    }
    let other = store
        .put(&format!("{ns}/rev/b"), vec![], None)
        .await
        .unwrap();
    assert!(other > last);
    assert_eq!(store.get(&key).await.unwrap().unwrap().mod_revision, last);
    assert!(store.delete(&key).await.unwrap());
    assert!(!store.delete(&key).await.unwrap());
    store.delete(&format!("{ns}/rev/b")).await.unwrap();
}

async fn campaign_has_one_holder(store: &dyn LeaseStore, ns: &str) {
    let key = format!("{ns}/owner");
    let a = store.grant(TTL).await.unwrap();
    let b = store.grant(TTL).await.unwrap();
    assert!(
        store
            .campaign(&key, b"a".to_vec(), a)
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        store
            .campaign(&key, b"b".to_vec(), b)
            .await
            .unwrap()
            .is_none()
    );
    store.revoke(a).await.unwrap();
    assert!(
        store
            .campaign(&key, b"b".to_vec(), b)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(store.get(&key).await.unwrap().unwrap().value, b"b");
    store.revoke(b).await.unwrap();
}

async fn writes_under_a_dead_lease_are_refused(store: &dyn LeaseStore, ns: &str) {
    let lease = store.grant(TTL).await.unwrap();
    store.revoke(lease).await.unwrap();
    let res = store
        .put(&format!("{ns}/dead/a"), vec![], Some(lease))
        .await;
    assert_eq!(res, Err(Error::LeaseGone(lease)));
}

async fn a_batch_applies_in_order_under_one_revision(store: &dyn LeaseStore, ns: &str) {
    let prefix = format!("{ns}/batch/");
    let lease = store.grant(TTL).await.unwrap();
    let before = store
        .put(&format!("{prefix}old"), vec![], None)
        .await
        .unwrap();
    let put = |k: &str, v: &[u8]| BatchOp::Put {
        key: format!("{prefix}{k}"),
        value: v.to_vec(),
        lease: Some(lease),
    };
    let rev = store
        .write_batch(vec![
            put("a", b"1"),
            put("b", b"2"),
            BatchOp::Delete {
                key: format!("{prefix}old"),
            },
            BatchOp::Delete {
                key: format!("{prefix}never-there"),
            },
        ])
        .await
        .unwrap();
    assert!(rev > before, "batch revision {rev} after {before}");
    let keys = store.list(&prefix).await.unwrap();
    let names: Vec<_> = keys
        .iter()
        .map(|kv| kv.key.trim_start_matches(&prefix).to_owned())
        .collect();
    assert_eq!(names, ["a", "b"]);
    for kv in &keys {
        assert!(kv.mod_revision > before && kv.mod_revision <= rev, "{kv:?}");
        assert_eq!(kv.lease, Some(lease));
    }
    let later = store
        .put(&format!("{prefix}c"), vec![], None)
        .await
        .unwrap();
    assert!(later > rev);
    // The batch's keys go with their lease.
    store.revoke(lease).await.unwrap();
    let left: Vec<_> = store
        .list(&prefix)
        .await
        .unwrap()
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(left, [format!("{prefix}c")]);
    store.delete(&format!("{prefix}c")).await.unwrap();
}

async fn a_batch_with_a_dead_lease_writes_nothing(store: &dyn LeaseStore, ns: &str) {
    let prefix = format!("{ns}/batch-dead/");
    let live = store.grant(TTL).await.unwrap();
    let dead = store.grant(TTL).await.unwrap();
    store.revoke(dead).await.unwrap();
    let res = store
        .write_batch(vec![
            BatchOp::Put {
                key: format!("{prefix}a"),
                value: vec![],
                lease: Some(live),
            },
            BatchOp::Put {
                key: format!("{prefix}b"),
                value: vec![],
                lease: Some(dead),
            },
        ])
        .await;
    assert!(matches!(res, Err(Error::LeaseGone(_))), "{res:?}");
    assert!(store.list(&prefix).await.unwrap().is_empty());
    store.revoke(live).await.unwrap();
}

/// A stall restart deletes a call's attempt key and puts the next attempt's in one batch
/// (etcd refuses a transaction naming a key twice unless the store coalesces it).
async fn a_batch_that_names_a_key_twice_ends_as_its_last_write(store: &dyn LeaseStore, ns: &str) {
    let prefix = format!("{ns}/batch-twice/");
    let lease = store.grant(TTL).await.unwrap();
    let key = |k: &str| format!("{prefix}{k}");
    let put = |k: &str, v: &[u8]| BatchOp::Put {
        key: key(k),
        value: v.to_vec(),
        lease: Some(lease),
    };
    let delete = |k: &str| BatchOp::Delete { key: key(k) };
    store
        .put(&key("restarted"), b"attempt 1".to_vec(), Some(lease))
        .await
        .unwrap();
    store
        .put(&key("ended"), b"attempt 1".to_vec(), Some(lease))
        .await
        .unwrap();
    let rev = store
        .write_batch(vec![
            delete("restarted"),
            put("restarted", b"attempt 2"),
            put("twice", b"first"),
            put("twice", b"second"),
            put("ended", b"attempt 2"),
            delete("ended"),
            delete("never-there"),
            put("never-there", b"x"),
            delete("never-there"),
        ])
        .await
        .unwrap();
    let left: Vec<(String, Vec<u8>)> = store
        .list(&prefix)
        .await
        .unwrap()
        .into_iter()
        .map(|kv| {
            assert!(
                kv.mod_revision <= rev,
                "{kv:?} after the batch's revision {rev}"
            );
            (kv.key.trim_start_matches(&prefix).to_owned(), kv.value)
        })
        .collect();
    assert_eq!(
        left,
        [
            ("restarted".to_owned(), b"attempt 2".to_vec()),
            ("twice".to_owned(), b"second".to_vec()),
        ]
    );
    store.revoke(lease).await.unwrap();
}
