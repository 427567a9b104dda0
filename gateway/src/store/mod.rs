//! Tenants and API keys behind one trait, [`Store`], with two implementations sharing one set of
//! SQL statements: [`sqlite::SqliteStore`] (embedded default: a file, created and migrated at
//! start) and [`postgres::PostgresStore`] (migrated by `gateway migrate`). The same conformance
//! tests run against both.

mod migrations;
pub mod postgres;
mod sql;
pub mod sqlite;

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::types::budget::{Action, BudgetPolicy, FailMode, Limit, RateLimit, Scope, Window};
use crate::types::cache::CachePolicy;
use crate::types::guard::GuardPolicy;
use crate::types::price::Price;
use crate::types::routing::RoutingPolicy;

pub use migrations::{postgres_migrator, sqlite_migrator};

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A uniqueness rule was violated (e.g. a live tenant with the same name exists).
    #[error("{0}")]
    Conflict(String),
    /// The referenced row does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The database failed or is unreachable.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Applying migrations failed.
    #[error("migration error: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A stored value could not be decoded.
    #[error("corrupt stored value: {0}")]
    Corrupt(String),
}

/// A tenant: the unit budgets and costs are attributed to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    /// Stable id (`ten_…`).
    pub id: String,
    /// Unique human name among live tenants.
    pub name: String,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

/// An API key's stored metadata (never the key itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKey {
    /// Stable id (`key_…`).
    pub id: String,
    /// Owning tenant id.
    pub tenant_id: String,
    /// Owning tenant name.
    pub tenant_name: String,
    /// Optional label.
    pub name: Option<String>,
    /// First characters of the key, for recognising it in lists.
    pub prefix: String,
    /// Attribution tags (e.g. `feature=search`), copied into every usage event.
    pub tags: BTreeMap<String, String>,
    /// The tags its clients may add with `x-gateway-tags` (and the request's `user`); `None`:
    /// any tag the key does not fix itself. A key's own tags always win.
    #[serde(default)]
    pub client_tags: Option<Vec<String>>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Revocation time, if revoked.
    pub revoked_at: Option<DateTime<Utc>>,
}

impl ApiKey {
    /// Whether a client of this key may set tag `name` (see [`ApiKey::client_tags`]).
    pub fn allows_client_tag(&self, name: &str) -> bool {
        self.client_tags
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|a| a == name))
    }
}

/// What is needed to insert a key.
#[derive(Debug, Clone)]
pub struct NewKey {
    /// Owning tenant id.
    pub tenant_id: String,
    /// Optional label.
    pub name: Option<String>,
    /// SHA-256 of the secret, hex.
    pub hash: String,
    /// Display prefix of the secret.
    pub prefix: String,
    /// Attribution tags.
    pub tags: BTreeMap<String, String>,
    /// See [`ApiKey::client_tags`].
    pub client_tags: Option<Vec<String>>,
}

/// Tenants and keys. Every method is one short transaction; callers never hold a connection.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Check the database answers (for `/readyz`).
    async fn ping(&self) -> Result<(), StoreError>;
    /// Create a tenant; [`StoreError::Conflict`] when a live tenant has that name.
    async fn create_tenant(&self, name: &str) -> Result<Tenant, StoreError>;
    /// Live tenants, by name.
    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError>;
    /// A live tenant by id or name.
    async fn find_tenant(&self, id_or_name: &str) -> Result<Option<Tenant>, StoreError>;
    /// Delete a tenant and revoke all its keys; `false` when there was no such live tenant.
    async fn delete_tenant(&self, id: &str) -> Result<bool, StoreError>;
    /// Insert a key for a live tenant.
    async fn create_key(&self, key: NewKey) -> Result<ApiKey, StoreError>;
    /// Keys (live and revoked), optionally of one tenant, newest first.
    async fn list_keys(&self, tenant_id: Option<&str>) -> Result<Vec<ApiKey>, StoreError>;
    /// Revoke a key; `false` when there was no such live key.
    async fn revoke_key(&self, id: &str) -> Result<bool, StoreError>;
    /// Every live key with its hash (the authenticator's snapshot).
    async fn active_keys(&self) -> Result<Vec<(String, ApiKey)>, StoreError>;
    /// One live key by hash.
    async fn find_active_key(&self, hash: &str) -> Result<Option<ApiKey>, StoreError>;
    /// Add a price; [`StoreError::Conflict`] when the model already has one from that instant.
    async fn insert_price(&self, price: &Price) -> Result<(), StoreError>;
    /// Every price, with history.
    async fn list_prices(&self) -> Result<Vec<Price>, StoreError>;
    /// Create or replace the policy of a (tenant, scope, window); the id of an existing one is
    /// kept, so its counters (spend so far) carry over.
    async fn upsert_budget(&self, policy: &NewBudget) -> Result<BudgetPolicy, StoreError>;
    /// Policies, optionally of one tenant.
    async fn list_budgets(&self, tenant_id: Option<&str>) -> Result<Vec<BudgetPolicy>, StoreError>;
    /// Delete a policy; `false` when there was none.
    async fn delete_budget(&self, id: &str) -> Result<bool, StoreError>;
    /// Create or replace a rate limit of a tenant (or one of its keys).
    async fn set_rate_limit(&self, limit: &RateLimit) -> Result<(), StoreError>;
    /// Rate limits, optionally of one tenant.
    async fn list_rate_limits(&self, tenant_id: Option<&str>)
        -> Result<Vec<RateLimit>, StoreError>;
    /// Delete a rate limit; `false` when there was none.
    async fn delete_rate_limit(
        &self,
        tenant_id: &str,
        key_id: Option<&str>,
    ) -> Result<bool, StoreError>;
    /// Set a tenant's fail mode for when the budget store is unreachable.
    async fn set_fail_mode(&self, tenant_id: &str, mode: FailMode) -> Result<(), StoreError>;
    /// Every tenant's explicit fail mode.
    async fn list_fail_modes(&self) -> Result<Vec<(String, FailMode)>, StoreError>;
    /// Set a tenant's policy of `kind` (JSON), replacing any previous one.
    async fn set_policy(
        &self,
        kind: PolicyKind,
        tenant_id: &str,
        json: &str,
    ) -> Result<(), StoreError>;
    /// Every tenant's own policy of `kind`, as (tenant id, JSON).
    async fn list_policies(&self, kind: PolicyKind) -> Result<Vec<(String, String)>, StoreError>;
    /// Drop a tenant's policy of `kind` (back to the config's defaults); `false`: it had none.
    async fn delete_policy(&self, kind: PolicyKind, tenant_id: &str) -> Result<bool, StoreError>;
}

/// The kinds of per-tenant policy stored as JSON, one table each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// The response cache ([`CachePolicy`]).
    Cache,
    /// The guard ([`GuardPolicy`]).
    Guard,
    /// The tier router ([`RoutingPolicy`]).
    Routing,
}

/// A per-tenant policy stored as JSON.
pub trait TenantPolicy: Serialize + serde::de::DeserializeOwned {
    /// Its table.
    const KIND: PolicyKind;
}

impl TenantPolicy for CachePolicy {
    const KIND: PolicyKind = PolicyKind::Cache;
}

impl TenantPolicy for GuardPolicy {
    const KIND: PolicyKind = PolicyKind::Guard;
}

impl TenantPolicy for RoutingPolicy {
    const KIND: PolicyKind = PolicyKind::Routing;
}

/// Set `tenant_id`'s policy of type `P`.
pub async fn set_policy<P: TenantPolicy>(
    store: &dyn Store,
    tenant_id: &str,
    policy: &P,
) -> Result<(), StoreError> {
    let json = serde_json::to_string(policy).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    store.set_policy(P::KIND, tenant_id, &json).await
}

/// Every tenant's own policy of type `P`.
pub async fn list_policies<P: TenantPolicy>(
    store: &dyn Store,
) -> Result<Vec<(String, P)>, StoreError> {
    store
        .list_policies(P::KIND)
        .await?
        .into_iter()
        .map(|(tenant, json)| {
            let p = serde_json::from_str(&json).map_err(|e| {
                StoreError::Corrupt(format!("{:?} policy of {tenant}: {e}", P::KIND))
            })?;
            Ok((tenant, p))
        })
        .collect()
}

/// Every tenant's own policy of type `P`, as last loaded from the store: what the request path
/// reads (no database round trip), reloaded by [`TenantPolicies::refresh`] on the components'
/// refresh loops and after an admin change.
pub struct TenantPolicies<P> {
    store: Arc<dyn Store>,
    loaded: arc_swap::ArcSwap<crate::FastMap<String, P>>,
}

impl<P: TenantPolicy + Clone> TenantPolicies<P> {
    /// Nothing loaded yet: call [`TenantPolicies::refresh`].
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            loaded: arc_swap::ArcSwap::from_pointee(Default::default()),
        }
    }

    /// Reload every tenant's policy from the store.
    pub async fn refresh(&self) -> Result<(), StoreError> {
        let all = list_policies::<P>(self.store.as_ref()).await?;
        self.loaded.store(Arc::new(all.into_iter().collect()));
        Ok(())
    }

    /// `tenant_id`'s own policy, if it has one.
    pub fn get(&self, tenant_id: &str) -> Option<P> {
        self.loaded.load().get(tenant_id).cloned()
    }

    /// Whether any tenant's policy satisfies `f`.
    pub fn any(&self, f: impl Fn(&P) -> bool) -> bool {
        self.loaded.load().values().any(f)
    }
}

/// `tenant_id`'s own policy of type `P`, if it has one.
pub async fn policy_of<P: TenantPolicy>(
    store: &dyn Store,
    tenant_id: &str,
) -> Result<Option<P>, StoreError> {
    Ok(list_policies::<P>(store)
        .await?
        .into_iter()
        .find(|(id, _)| id == tenant_id)
        .map(|(_, p)| p))
}

/// What is needed to create or replace a budget policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewBudget {
    /// Owning tenant id.
    pub tenant_id: String,
    /// What it applies to.
    pub scope: Scope,
    /// The calendar window.
    pub window: Window,
    /// The limit.
    pub limit: Limit,
    /// What happens at the limit.
    pub action: Action,
    /// For `downgrade`: the hard cap.
    #[serde(default)]
    pub hard_limit: Limit,
    /// Warning threshold, percent.
    #[serde(default)]
    pub warn_percent: Option<u8>,
}

/// Open the store named by `url` (`sqlite://…` or `postgres://…`). SQLite is created and
/// migrated here; Postgres must have been migrated with `gateway migrate` (checked here).
pub async fn open(url: &str) -> Result<Arc<dyn Store>, StoreError> {
    if url.starts_with("sqlite:") {
        Ok(Arc::new(sqlite::SqliteStore::open(url).await?))
    } else {
        Ok(Arc::new(postgres::PostgresStore::connect(url).await?))
    }
}

/// The current time at the precision both databases keep (microseconds), so a value read back
/// equals the value written.
fn now() -> DateTime<Utc> {
    use chrono::SubsecRound;
    Utc::now().trunc_subsecs(6)
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}
