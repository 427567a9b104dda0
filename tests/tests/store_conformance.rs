//! One conformance suite for the tenant/key store, run against SQLite and Postgres.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::BTreeMap;

use e2e::{StoreKind, TestStore, BOTH};
use gateway::keys;
use gateway::store::{NewKey, StoreError};

fn new_key(tenant_id: &str) -> (String, NewKey) {
    let g = keys::generate();
    (
        g.secret,
        NewKey {
            tenant_id: tenant_id.into(),
            name: Some("k".into()),
            hash: g.hash,
            prefix: g.prefix,
            tags: BTreeMap::from([("feature".to_owned(), "search".to_owned())]),
        },
    )
}

async fn tenants_are_unique_by_live_name(kind: StoreKind) {
    let ts = TestStore::new(kind).await.unwrap();
    let s = &ts.store;
    let a = s.create_tenant("acme").await.unwrap();
    assert!(
        matches!(s.create_tenant("acme").await, Err(StoreError::Conflict(_))),
        "{kind:?}"
    );
    assert_eq!(s.find_tenant("acme").await.unwrap().unwrap().id, a.id);
    assert_eq!(s.find_tenant(&a.id).await.unwrap().unwrap().name, "acme");
    s.create_tenant("beta").await.unwrap();
    let names: Vec<_> = s
        .list_tenants()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, vec!["acme", "beta"]);
    assert!(s.delete_tenant(&a.id).await.unwrap());
    assert!(
        !s.delete_tenant(&a.id).await.unwrap(),
        "second delete finds nothing"
    );
    assert!(s.find_tenant("acme").await.unwrap().is_none());
    let again = s.create_tenant("acme").await.unwrap();
    assert_ne!(again.id, a.id, "a deleted tenant's name can be reused");
}

async fn keys_are_found_by_hash_until_revoked(kind: StoreKind) {
    let ts = TestStore::new(kind).await.unwrap();
    let s = &ts.store;
    let t = s.create_tenant("acme").await.unwrap();
    let (secret, nk) = new_key(&t.id);
    let hash = nk.hash.clone();
    let key = s.create_key(nk).await.unwrap();
    assert_eq!(key.tenant_name, "acme");
    assert_eq!(key.tags["feature"], "search");
    let found = s
        .find_active_key(&keys::hash(&secret))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found, key);
    let active = s.active_keys().await.unwrap();
    assert_eq!(active.len(), 1);
    assert_eq!(active[0].0, hash);
    assert_eq!(s.list_keys(Some(&t.id)).await.unwrap().len(), 1);
    assert!(s.revoke_key(&key.id).await.unwrap());
    assert!(!s.revoke_key(&key.id).await.unwrap());
    assert!(s.find_active_key(&hash).await.unwrap().is_none());
    assert!(s.active_keys().await.unwrap().is_empty());
    let listed = s.list_keys(None).await.unwrap();
    assert!(listed[0].revoked_at.is_some(), "revoked keys stay listed");
}

async fn deleting_a_tenant_revokes_its_keys(kind: StoreKind) {
    let ts = TestStore::new(kind).await.unwrap();
    let s = &ts.store;
    let t = s.create_tenant("acme").await.unwrap();
    let (_, nk) = new_key(&t.id);
    let hash = nk.hash.clone();
    s.create_key(nk).await.unwrap();
    assert!(s.delete_tenant(&t.id).await.unwrap());
    assert!(s.find_active_key(&hash).await.unwrap().is_none());
    let (_, nk) = new_key(&t.id);
    assert!(matches!(
        s.create_key(nk).await,
        Err(StoreError::NotFound(_))
    ));
}

#[tokio::test]
async fn tenants_are_unique_by_live_name_on_both_stores() {
    for kind in BOTH {
        tenants_are_unique_by_live_name(kind).await;
    }
}

#[tokio::test]
async fn keys_are_found_by_hash_until_revoked_on_both_stores() {
    for kind in BOTH {
        keys_are_found_by_hash_until_revoked(kind).await;
    }
}

#[tokio::test]
async fn deleting_a_tenant_revokes_its_keys_on_both_stores() {
    for kind in BOTH {
        deleting_a_tenant_revokes_its_keys(kind).await;
    }
}

#[tokio::test]
async fn postgres_refuses_to_start_on_an_unmigrated_database() {
    let db = e2e::PgDatabase::create().await.unwrap();
    let err = gateway::store::open(&db.url)
        .await
        .err()
        .expect("must refuse");
    assert!(err.to_string().contains("gateway migrate"), "{err}");
}
