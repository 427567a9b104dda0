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
            client_tags: None,
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
    let (secret, mut nk) = new_key(&t.id);
    nk.client_tags = Some(vec!["team".into(), "user".into()]);
    let hash = nk.hash.clone();
    let key = s.create_key(nk).await.unwrap();
    assert_eq!(key.tenant_name, "acme");
    assert_eq!(key.tags["feature"], "search");
    assert_eq!(key.client_tags, Some(vec!["team".into(), "user".into()]));
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
    let (_, open) = new_key(&t.id);
    let open = s.create_key(open).await.unwrap();
    assert_eq!(
        s.list_keys(Some(&t.id)).await.unwrap()[0].client_tags,
        None,
        "{kind:?}: no setting reads back as none"
    );
    assert!(s.revoke_key(&open.id).await.unwrap());
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

async fn budget_policies_rate_limits_and_fail_modes(kind: StoreKind) {
    use gateway::budget::{Action, FailMode, Limit, RateLimit, Scope, Window};
    use gateway::store::NewBudget;
    let ts = TestStore::new(kind).await.unwrap();
    let s = &ts.store;
    let t = s.create_tenant("acme").await.unwrap();
    let other = s.create_tenant("beta").await.unwrap();
    let new = NewBudget {
        tenant_id: t.id.clone(),
        scope: Scope::Tag {
            name: "feature".into(),
            value: "search".into(),
        },
        window: Window::Week,
        limit: Limit {
            tokens: Some(1_000_000),
            micros: Some(25_000_000),
        },
        action: Action::Downgrade,
        hard_limit: Limit {
            tokens: Some(2_000_000),
            micros: None,
        },
        warn_percent: Some(80),
    };
    let a = s.upsert_budget(&new).await.unwrap();
    assert!(a.id.starts_with("bud_"), "{kind:?}");
    assert_eq!(
        (a.scope.clone(), a.window, a.action),
        (new.scope.clone(), Window::Week, Action::Downgrade)
    );
    assert_eq!(
        (a.limit, a.hard_limit, a.warn_percent),
        (new.limit, new.hard_limit, Some(80))
    );
    // Same tenant, scope and window: replaced in place, id kept (its counters carry over).
    let mut changed = new.clone();
    changed.limit.tokens = Some(5);
    changed.action = Action::Reject;
    changed.hard_limit = Limit::default();
    let b = s.upsert_budget(&changed).await.unwrap();
    assert_eq!(b.id, a.id, "{kind:?}");
    assert_eq!(
        (b.limit.tokens, b.action, b.hard_limit),
        (Some(5), Action::Reject, Limit::default())
    );
    let mut daily = new.clone();
    daily.window = Window::Day;
    daily.scope = Scope::Tenant;
    s.upsert_budget(&daily).await.unwrap();
    let mut theirs = daily.clone();
    theirs.tenant_id = other.id.clone();
    s.upsert_budget(&theirs).await.unwrap();
    assert_eq!(
        s.list_budgets(Some(&t.id)).await.unwrap().len(),
        2,
        "{kind:?}"
    );
    assert_eq!(s.list_budgets(None).await.unwrap().len(), 3, "{kind:?}");
    assert!(s.delete_budget(&a.id).await.unwrap());
    assert!(!s.delete_budget(&a.id).await.unwrap(), "{kind:?}");
    assert_eq!(s.list_budgets(Some(&t.id)).await.unwrap().len(), 1);
    let mut nobody = new.clone();
    nobody.tenant_id = "ten_missing".into();
    assert!(
        matches!(s.upsert_budget(&nobody).await, Err(StoreError::NotFound(_))),
        "{kind:?}"
    );

    let tenant_limit = RateLimit {
        tenant_id: t.id.clone(),
        key_id: None,
        rpm: Some(60),
        tpm: None,
    };
    let key_limit = RateLimit {
        tenant_id: t.id.clone(),
        key_id: Some("key_1".into()),
        rpm: None,
        tpm: Some(10_000),
    };
    s.set_rate_limit(&tenant_limit).await.unwrap();
    s.set_rate_limit(&key_limit).await.unwrap();
    let mut updated = tenant_limit.clone();
    updated.rpm = Some(120);
    s.set_rate_limit(&updated).await.unwrap();
    let limits = s.list_rate_limits(Some(&t.id)).await.unwrap();
    assert_eq!(limits.len(), 2, "{kind:?}");
    assert!(
        limits.contains(&updated) && limits.contains(&key_limit),
        "{kind:?}: {limits:?}"
    );
    assert!(s.delete_rate_limit(&t.id, None).await.unwrap());
    assert!(!s.delete_rate_limit(&t.id, None).await.unwrap());
    assert_eq!(s.list_rate_limits(None).await.unwrap(), vec![key_limit]);

    s.set_fail_mode(&t.id, FailMode::Open).await.unwrap();
    s.set_fail_mode(&other.id, FailMode::Closed).await.unwrap();
    s.set_fail_mode(&t.id, FailMode::Closed).await.unwrap();
    let modes: BTreeMap<String, FailMode> =
        s.list_fail_modes().await.unwrap().into_iter().collect();
    let expected = BTreeMap::from([
        (t.id.clone(), FailMode::Closed),
        (other.id.clone(), FailMode::Closed),
    ]);
    assert_eq!(modes, expected, "{kind:?}");
}

#[tokio::test]
async fn budget_policies_rate_limits_and_fail_modes_on_both_stores() {
    for kind in BOTH {
        budget_policies_rate_limits_and_fail_modes(kind).await;
    }
}
