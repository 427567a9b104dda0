//! The SQL both stores share. Statements use `$N` placeholders, which SQLite and Postgres both
//! accept, and types both drivers map (TEXT, timestamps via chrono). [`sql_store!`] stamps the one
//! [`Store`](super::Store) implementation onto a store type with a `pool` field, so the two
//! backends cannot drift apart.

pub(super) const INSERT_TENANT: &str =
    "INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3)";
pub(super) const LIST_TENANTS: &str =
    "SELECT id, name, created_at FROM tenants WHERE deleted_at IS NULL ORDER BY name";
pub(super) const FIND_TENANT: &str = "SELECT id, name, created_at FROM tenants \
     WHERE deleted_at IS NULL AND (id = $1 OR name = $1)";
pub(super) const DELETE_TENANT: &str =
    "UPDATE tenants SET deleted_at = $2 WHERE id = $1 AND deleted_at IS NULL";
pub(super) const REVOKE_TENANT_KEYS: &str =
    "UPDATE api_keys SET revoked_at = $2 WHERE tenant_id = $1 AND revoked_at IS NULL";
pub(super) const INSERT_KEY: &str = "INSERT INTO api_keys \
     (id, tenant_id, name, key_hash, key_prefix, tags, created_at, client_tags) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";
macro_rules! select_keys {
    ($suffix:literal) => {
        concat!(
            "SELECT k.id, k.tenant_id, t.name AS tenant_name, k.name, k.key_prefix, k.tags, ",
            "k.created_at, k.revoked_at, k.key_hash, k.client_tags ",
            "FROM api_keys k JOIN tenants t ON t.id = k.tenant_id ",
            $suffix
        )
    };
}
pub(super) const LIST_KEYS: &str = select_keys!("ORDER BY k.created_at DESC");
pub(super) const LIST_TENANT_KEYS: &str =
    select_keys!("WHERE k.tenant_id = $1 ORDER BY k.created_at DESC");
pub(super) const ACTIVE_KEYS: &str =
    select_keys!("WHERE k.revoked_at IS NULL AND t.deleted_at IS NULL");
pub(super) const FIND_ACTIVE_KEY: &str =
    select_keys!("WHERE k.key_hash = $1 AND k.revoked_at IS NULL AND t.deleted_at IS NULL");
pub(super) const REVOKE_KEY: &str =
    "UPDATE api_keys SET revoked_at = $2 WHERE id = $1 AND revoked_at IS NULL";

pub(super) const INSERT_PRICE: &str = "INSERT INTO prices \
     (model, effective_from, input_micros_per_mtok, output_micros_per_mtok, \
     cached_input_micros_per_mtok) VALUES ($1, $2, $3, $4, $5)";
pub(super) const LIST_PRICES: &str = "SELECT model, effective_from, input_micros_per_mtok, \
     output_micros_per_mtok, cached_input_micros_per_mtok FROM prices \
     ORDER BY model, effective_from";

pub(super) const UPSERT_BUDGET: &str = "INSERT INTO budgets \
     (id, tenant_id, scope_kind, scope_value, window_kind, limit_tokens, limit_micros, action, \
     hard_limit_tokens, hard_limit_micros, warn_percent, updated_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) \
     ON CONFLICT (tenant_id, scope_kind, scope_value, window_kind) DO UPDATE SET \
     limit_tokens = excluded.limit_tokens, limit_micros = excluded.limit_micros, \
     action = excluded.action, hard_limit_tokens = excluded.hard_limit_tokens, \
     hard_limit_micros = excluded.hard_limit_micros, warn_percent = excluded.warn_percent, \
     updated_at = excluded.updated_at \
     RETURNING id";
macro_rules! select_budgets {
    ($suffix:literal) => {
        concat!(
            "SELECT id, tenant_id, scope_kind, scope_value, window_kind, limit_tokens, ",
            "limit_micros, action, hard_limit_tokens, hard_limit_micros, warn_percent, ",
            "updated_at FROM budgets ",
            $suffix
        )
    };
}
pub(super) const LIST_BUDGETS: &str = select_budgets!("ORDER BY tenant_id, id");
pub(super) const LIST_TENANT_BUDGETS: &str =
    select_budgets!("WHERE tenant_id = $1 ORDER BY tenant_id, id");
pub(super) const FIND_BUDGET: &str = select_budgets!("WHERE id = $1");
pub(super) const DELETE_BUDGET: &str = "DELETE FROM budgets WHERE id = $1";
pub(super) const SET_RATE_LIMIT: &str = "INSERT INTO rate_limits (tenant_id, key_id, rpm, tpm) \
     VALUES ($1, $2, $3, $4) ON CONFLICT (tenant_id, key_id) DO UPDATE SET \
     rpm = excluded.rpm, tpm = excluded.tpm";
pub(super) const LIST_RATE_LIMITS: &str =
    "SELECT tenant_id, key_id, rpm, tpm FROM rate_limits ORDER BY tenant_id, key_id";
pub(super) const LIST_TENANT_RATE_LIMITS: &str = "SELECT tenant_id, key_id, rpm, tpm \
     FROM rate_limits WHERE tenant_id = $1 ORDER BY tenant_id, key_id";
pub(super) const DELETE_RATE_LIMIT: &str =
    "DELETE FROM rate_limits WHERE tenant_id = $1 AND key_id = $2";
pub(super) const SET_FAIL_MODE: &str = "INSERT INTO tenant_budget_settings (tenant_id, fail_mode) \
     VALUES ($1, $2) ON CONFLICT (tenant_id) DO UPDATE SET fail_mode = excluded.fail_mode";
pub(super) const LIST_FAIL_MODES: &str = "SELECT tenant_id, fail_mode FROM tenant_budget_settings";
/// `(set, list, delete)` for the table of one kind of tenant policy.
macro_rules! policy_sql {
    ($table:literal) => {
        (
            concat!(
                "INSERT INTO ",
                $table,
                " (tenant_id, policy) VALUES ($1, $2) ",
                "ON CONFLICT (tenant_id) DO UPDATE SET policy = excluded.policy"
            ),
            concat!(
                "SELECT tenant_id, policy FROM ",
                $table,
                " ORDER BY tenant_id"
            ),
            concat!("DELETE FROM ", $table, " WHERE tenant_id = $1"),
        )
    };
}

/// The statements of `kind`'s table.
pub(super) fn policy_sql(kind: super::PolicyKind) -> (&'static str, &'static str, &'static str) {
    match kind {
        super::PolicyKind::Cache => policy_sql!("tenant_cache_policies"),
        super::PolicyKind::Guard => policy_sql!("tenant_guard_policies"),
        super::PolicyKind::Routing => policy_sql!("tenant_routing_policies"),
    }
}

macro_rules! sql_store {
    ($store:ident, $row:ty) => {
        mod store_impl {
            use std::collections::BTreeMap;

            use async_trait::async_trait;
            use sqlx::Row;

            use super::super::sql::*;
            use super::super::{
                new_id, now, ApiKey, NewBudget, NewKey, PolicyKind, Store, StoreError, Tenant,
            };
            use crate::types::budget::{
                Action, BudgetPolicy, FailMode, Limit, RateLimit, Scope, Window,
            };
            use crate::types::price::Price;

            fn tenant(row: &$row) -> Result<Tenant, StoreError> {
                Ok(Tenant {
                    id: row.try_get("id")?,
                    name: row.try_get("name")?,
                    created_at: row.try_get("created_at")?,
                })
            }

            fn key(row: &$row) -> Result<ApiKey, StoreError> {
                let tags: String = row.try_get("tags")?;
                let tags: BTreeMap<String, String> = serde_json::from_str(&tags)
                    .map_err(|e| StoreError::Corrupt(format!("api_keys.tags: {e}")))?;
                let client_tags: Option<String> = row.try_get("client_tags")?;
                let client_tags = client_tags
                    .map(|c| serde_json::from_str(&c))
                    .transpose()
                    .map_err(|e| StoreError::Corrupt(format!("api_keys.client_tags: {e}")))?;
                Ok(ApiKey {
                    id: row.try_get("id")?,
                    tenant_id: row.try_get("tenant_id")?,
                    tenant_name: row.try_get("tenant_name")?,
                    name: row.try_get("name")?,
                    prefix: row.try_get("key_prefix")?,
                    tags,
                    client_tags,
                    created_at: row.try_get("created_at")?,
                    revoked_at: row.try_get("revoked_at")?,
                })
            }

            fn opt_u64(row: &$row, col: &str) -> Result<Option<u64>, StoreError> {
                let v: Option<i64> = row.try_get(col)?;
                Ok(v.map(|n| u64::try_from(n).unwrap_or(0)))
            }

            fn budget(row: &$row) -> Result<BudgetPolicy, StoreError> {
                let corrupt = |c: &str| StoreError::Corrupt(format!("budgets.{c}"));
                let kind: String = row.try_get("scope_kind")?;
                let value: String = row.try_get("scope_value")?;
                let window: String = row.try_get("window_kind")?;
                let action: String = row.try_get("action")?;
                let warn: Option<i64> = row.try_get("warn_percent")?;
                Ok(BudgetPolicy {
                    id: row.try_get("id")?,
                    tenant_id: row.try_get("tenant_id")?,
                    scope: Scope::from_columns(&kind, &value).ok_or_else(|| corrupt("scope"))?,
                    window: Window::parse(&window).ok_or_else(|| corrupt("window_kind"))?,
                    limit: Limit {
                        tokens: opt_u64(row, "limit_tokens")?,
                        micros: row.try_get("limit_micros")?,
                    },
                    action: Action::parse(&action).ok_or_else(|| corrupt("action"))?,
                    hard_limit: Limit {
                        tokens: opt_u64(row, "hard_limit_tokens")?,
                        micros: row.try_get("hard_limit_micros")?,
                    },
                    warn_percent: warn.map(|w| u8::try_from(w).unwrap_or(100)),
                    updated_at: row.try_get("updated_at")?,
                })
            }

            fn rate_limit(row: &$row) -> Result<RateLimit, StoreError> {
                let key: String = row.try_get("key_id")?;
                Ok(RateLimit {
                    tenant_id: row.try_get("tenant_id")?,
                    key_id: (!key.is_empty()).then_some(key),
                    rpm: opt_u64(row, "rpm")?,
                    tpm: opt_u64(row, "tpm")?,
                })
            }

            fn to_i64(v: Option<u64>) -> Option<i64> {
                v.map(|n| i64::try_from(n).unwrap_or(i64::MAX))
            }

            fn unique_violation(e: sqlx::Error, message: String) -> StoreError {
                match &e {
                    sqlx::Error::Database(db) if db.is_unique_violation() => {
                        StoreError::Conflict(message)
                    }
                    _ => StoreError::Database(e),
                }
            }

            #[async_trait]
            impl Store for super::$store {
                async fn ping(&self) -> Result<(), StoreError> {
                    sqlx::query("SELECT 1").execute(&self.pool).await?;
                    Ok(())
                }

                async fn create_tenant(&self, name: &str) -> Result<Tenant, StoreError> {
                    let t = Tenant {
                        id: new_id("ten"),
                        name: name.to_owned(),
                        created_at: now(),
                    };
                    sqlx::query(INSERT_TENANT)
                        .bind(&t.id)
                        .bind(&t.name)
                        .bind(t.created_at)
                        .execute(&self.pool)
                        .await
                        .map_err(|e| {
                            unique_violation(e, format!("tenant {name:?} already exists"))
                        })?;
                    Ok(t)
                }

                async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
                    let rows = sqlx::query(LIST_TENANTS).fetch_all(&self.pool).await?;
                    rows.iter().map(tenant).collect()
                }

                async fn find_tenant(
                    &self,
                    id_or_name: &str,
                ) -> Result<Option<Tenant>, StoreError> {
                    let row = sqlx::query(FIND_TENANT)
                        .bind(id_or_name)
                        .fetch_optional(&self.pool)
                        .await?;
                    row.as_ref().map(tenant).transpose()
                }

                async fn delete_tenant(&self, id: &str) -> Result<bool, StoreError> {
                    let now = now();
                    let mut tx = self.pool.begin().await?;
                    let deleted = sqlx::query(DELETE_TENANT)
                        .bind(id)
                        .bind(now)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected();
                    sqlx::query(REVOKE_TENANT_KEYS)
                        .bind(id)
                        .bind(now)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(deleted > 0)
                }

                async fn create_key(&self, new: NewKey) -> Result<ApiKey, StoreError> {
                    let tenant = self
                        .find_tenant(&new.tenant_id)
                        .await?
                        .filter(|t| t.id == new.tenant_id)
                        .ok_or_else(|| {
                            StoreError::NotFound(format!("no tenant with id {:?}", new.tenant_id))
                        })?;
                    let tags = serde_json::to_string(&new.tags)
                        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
                    let client_tags = new
                        .client_tags
                        .as_ref()
                        .map(serde_json::to_string)
                        .transpose()
                        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
                    let key = ApiKey {
                        id: new_id("key"),
                        tenant_id: tenant.id,
                        tenant_name: tenant.name,
                        name: new.name,
                        prefix: new.prefix,
                        tags: new.tags,
                        client_tags: new.client_tags,
                        created_at: now(),
                        revoked_at: None,
                    };
                    sqlx::query(INSERT_KEY)
                        .bind(&key.id)
                        .bind(&key.tenant_id)
                        .bind(&key.name)
                        .bind(&new.hash)
                        .bind(&key.prefix)
                        .bind(tags)
                        .bind(key.created_at)
                        .bind(client_tags)
                        .execute(&self.pool)
                        .await
                        .map_err(|e| unique_violation(e, "key hash collision".to_owned()))?;
                    Ok(key)
                }

                async fn list_keys(
                    &self,
                    tenant_id: Option<&str>,
                ) -> Result<Vec<ApiKey>, StoreError> {
                    let rows = match tenant_id {
                        Some(t) => {
                            sqlx::query(LIST_TENANT_KEYS)
                                .bind(t)
                                .fetch_all(&self.pool)
                                .await?
                        }
                        None => sqlx::query(LIST_KEYS).fetch_all(&self.pool).await?,
                    };
                    rows.iter().map(key).collect()
                }

                async fn revoke_key(&self, id: &str) -> Result<bool, StoreError> {
                    let n = sqlx::query(REVOKE_KEY)
                        .bind(id)
                        .bind(now())
                        .execute(&self.pool)
                        .await?
                        .rows_affected();
                    Ok(n > 0)
                }

                async fn active_keys(&self) -> Result<Vec<(String, ApiKey)>, StoreError> {
                    let rows = sqlx::query(ACTIVE_KEYS).fetch_all(&self.pool).await?;
                    rows.iter()
                        .map(|r| Ok((r.try_get("key_hash")?, key(r)?)))
                        .collect()
                }

                async fn insert_price(&self, price: &Price) -> Result<(), StoreError> {
                    use chrono::SubsecRound;
                    sqlx::query(INSERT_PRICE)
                        .bind(&price.model)
                        .bind(price.effective_from.trunc_subsecs(6))
                        .bind(price.input)
                        .bind(price.output)
                        .bind(price.cached_input)
                        .execute(&self.pool)
                        .await
                        .map_err(|e| {
                            unique_violation(
                                e,
                                format!(
                                    "{} already has a price from {}",
                                    price.model, price.effective_from
                                ),
                            )
                        })?;
                    Ok(())
                }

                async fn list_prices(&self) -> Result<Vec<Price>, StoreError> {
                    let rows = sqlx::query(LIST_PRICES).fetch_all(&self.pool).await?;
                    rows.iter()
                        .map(|r| {
                            Ok(Price {
                                model: r.try_get("model")?,
                                effective_from: r.try_get("effective_from")?,
                                input: r.try_get("input_micros_per_mtok")?,
                                output: r.try_get("output_micros_per_mtok")?,
                                cached_input: r.try_get("cached_input_micros_per_mtok")?,
                            })
                        })
                        .collect()
                }

                async fn find_active_key(&self, hash: &str) -> Result<Option<ApiKey>, StoreError> {
                    let row = sqlx::query(FIND_ACTIVE_KEY)
                        .bind(hash)
                        .fetch_optional(&self.pool)
                        .await?;
                    row.as_ref().map(key).transpose()
                }

                async fn upsert_budget(&self, b: &NewBudget) -> Result<BudgetPolicy, StoreError> {
                    let tenant = self
                        .find_tenant(&b.tenant_id)
                        .await?
                        .filter(|t| t.id == b.tenant_id)
                        .ok_or_else(|| {
                            StoreError::NotFound(format!("no tenant with id {:?}", b.tenant_id))
                        })?;
                    let (kind, value) = b.scope.to_columns();
                    let id: String = sqlx::query_scalar(UPSERT_BUDGET)
                        .bind(new_id("bud"))
                        .bind(&tenant.id)
                        .bind(kind)
                        .bind(value)
                        .bind(b.window.as_str())
                        .bind(to_i64(b.limit.tokens))
                        .bind(b.limit.micros)
                        .bind(b.action.as_str())
                        .bind(to_i64(b.hard_limit.tokens))
                        .bind(b.hard_limit.micros)
                        .bind(b.warn_percent.map(i64::from))
                        .bind(now())
                        .fetch_one(&self.pool)
                        .await?;
                    let row = sqlx::query(FIND_BUDGET)
                        .bind(&id)
                        .fetch_one(&self.pool)
                        .await?;
                    budget(&row)
                }

                async fn list_budgets(
                    &self,
                    tenant_id: Option<&str>,
                ) -> Result<Vec<BudgetPolicy>, StoreError> {
                    let rows = match tenant_id {
                        Some(t) => {
                            sqlx::query(LIST_TENANT_BUDGETS)
                                .bind(t)
                                .fetch_all(&self.pool)
                                .await?
                        }
                        None => sqlx::query(LIST_BUDGETS).fetch_all(&self.pool).await?,
                    };
                    rows.iter().map(budget).collect()
                }

                async fn delete_budget(&self, id: &str) -> Result<bool, StoreError> {
                    let n = sqlx::query(DELETE_BUDGET)
                        .bind(id)
                        .execute(&self.pool)
                        .await?
                        .rows_affected();
                    Ok(n > 0)
                }

                async fn set_rate_limit(&self, l: &RateLimit) -> Result<(), StoreError> {
                    sqlx::query(SET_RATE_LIMIT)
                        .bind(&l.tenant_id)
                        .bind(l.key_id.as_deref().unwrap_or(""))
                        .bind(to_i64(l.rpm))
                        .bind(to_i64(l.tpm))
                        .execute(&self.pool)
                        .await?;
                    Ok(())
                }

                async fn list_rate_limits(
                    &self,
                    tenant_id: Option<&str>,
                ) -> Result<Vec<RateLimit>, StoreError> {
                    let rows = match tenant_id {
                        Some(t) => {
                            sqlx::query(LIST_TENANT_RATE_LIMITS)
                                .bind(t)
                                .fetch_all(&self.pool)
                                .await?
                        }
                        None => sqlx::query(LIST_RATE_LIMITS).fetch_all(&self.pool).await?,
                    };
                    rows.iter().map(rate_limit).collect()
                }

                async fn delete_rate_limit(
                    &self,
                    tenant_id: &str,
                    key_id: Option<&str>,
                ) -> Result<bool, StoreError> {
                    let n = sqlx::query(DELETE_RATE_LIMIT)
                        .bind(tenant_id)
                        .bind(key_id.unwrap_or(""))
                        .execute(&self.pool)
                        .await?
                        .rows_affected();
                    Ok(n > 0)
                }

                async fn set_fail_mode(
                    &self,
                    tenant_id: &str,
                    mode: FailMode,
                ) -> Result<(), StoreError> {
                    sqlx::query(SET_FAIL_MODE)
                        .bind(tenant_id)
                        .bind(mode.as_str())
                        .execute(&self.pool)
                        .await?;
                    Ok(())
                }

                async fn list_fail_modes(&self) -> Result<Vec<(String, FailMode)>, StoreError> {
                    let rows = sqlx::query(LIST_FAIL_MODES).fetch_all(&self.pool).await?;
                    rows.iter()
                        .map(|r| {
                            let mode: String = r.try_get("fail_mode")?;
                            Ok((
                                r.try_get("tenant_id")?,
                                FailMode::parse(&mode).ok_or_else(|| {
                                    StoreError::Corrupt("tenant_budget_settings.fail_mode".into())
                                })?,
                            ))
                        })
                        .collect()
                }

                async fn set_policy(
                    &self,
                    kind: PolicyKind,
                    tenant_id: &str,
                    json: &str,
                ) -> Result<(), StoreError> {
                    sqlx::query(policy_sql(kind).0)
                        .bind(tenant_id)
                        .bind(json)
                        .execute(&self.pool)
                        .await?;
                    Ok(())
                }

                async fn list_policies(
                    &self,
                    kind: PolicyKind,
                ) -> Result<Vec<(String, String)>, StoreError> {
                    let rows = sqlx::query(policy_sql(kind).1)
                        .fetch_all(&self.pool)
                        .await?;
                    rows.iter()
                        .map(|r| Ok((r.try_get("tenant_id")?, r.try_get("policy")?)))
                        .collect()
                }

                async fn delete_policy(
                    &self,
                    kind: PolicyKind,
                    tenant_id: &str,
                ) -> Result<bool, StoreError> {
                    let n = sqlx::query(policy_sql(kind).2)
                        .bind(tenant_id)
                        .execute(&self.pool)
                        .await?
                        .rows_affected();
                    Ok(n > 0)
                }
            }
        }
    };
}

pub(super) use sql_store;
