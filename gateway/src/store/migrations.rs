//! Migrations embedded in the binary from `migrations/{sqlite,postgres}` and applied with sqlx's
//! migrator (version table, checksums, locking). Files are append-only.

use std::borrow::Cow;

use futures_util::future::BoxFuture;
use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};

/// `(version, description, sql)` of each migration, in order.
type Embedded = &'static [(i64, &'static str, &'static str)];

const SQLITE: Embedded = &[
    (
        1,
        "tenants and keys",
        include_str!("../../../migrations/sqlite/0001_tenants_and_keys.sql"),
    ),
    (
        2,
        "prices and ledger",
        include_str!("../../../migrations/sqlite/0002_prices_and_ledger.sql"),
    ),
    (
        3,
        "budgets",
        include_str!("../../../migrations/sqlite/0003_budgets.sql"),
    ),
    (
        4,
        "cache policies",
        include_str!("../../../migrations/sqlite/0004_cache_policies.sql"),
    ),
    (
        5,
        "key client tags",
        include_str!("../../../migrations/sqlite/0005_key_client_tags.sql"),
    ),
    (
        6,
        "guard policies and ledger",
        include_str!("../../../migrations/sqlite/0006_guard.sql"),
    ),
    (
        7,
        "routing policies and route reason",
        include_str!("../../../migrations/sqlite/0007_routing.sql"),
    ),
    (
        8,
        "routing in the reports",
        include_str!("../../../migrations/sqlite/0008_routing_reports.sql"),
    ),
    (
        9,
        "synthetic demo rows in the rollup",
        include_str!("../../../migrations/sqlite/0009_synthetic_rows.sql"),
    ),
    (
        10,
        "replica choice in the ledger",
        include_str!("../../../migrations/sqlite/0010_replica_choice.sql"),
    ),
    (
        11,
        "fallbacks in the rollup",
        include_str!("../../../migrations/sqlite/0011_fallbacks.sql"),
    ),
];

const POSTGRES: Embedded = &[
    (
        1,
        "tenants and keys",
        include_str!("../../../migrations/postgres/0001_tenants_and_keys.sql"),
    ),
    (
        2,
        "prices and ledger",
        include_str!("../../../migrations/postgres/0002_prices_and_ledger.sql"),
    ),
    (
        3,
        "budgets",
        include_str!("../../../migrations/postgres/0003_budgets.sql"),
    ),
    (
        4,
        "cache policies",
        include_str!("../../../migrations/postgres/0004_cache_policies.sql"),
    ),
    (
        5,
        "key client tags",
        include_str!("../../../migrations/postgres/0005_key_client_tags.sql"),
    ),
    (
        6,
        "guard policies and ledger",
        include_str!("../../../migrations/postgres/0006_guard.sql"),
    ),
    (
        7,
        "routing policies and route reason",
        include_str!("../../../migrations/postgres/0007_routing.sql"),
    ),
    (
        8,
        "routing in the reports",
        include_str!("../../../migrations/postgres/0008_routing_reports.sql"),
    ),
    (
        9,
        "synthetic demo rows in the rollup",
        include_str!("../../../migrations/postgres/0009_synthetic_rows.sql"),
    ),
    (
        10,
        "replica choice in the ledger",
        include_str!("../../../migrations/postgres/0010_replica_choice.sql"),
    ),
    (
        11,
        "fallbacks in the rollup",
        include_str!("../../../migrations/postgres/0011_fallbacks.sql"),
    ),
];

#[derive(Debug)]
struct Source(Embedded);

impl MigrationSource<'static> for Source {
    fn resolve(self) -> BoxFuture<'static, Result<Vec<Migration>, BoxDynError>> {
        let migrations = self
            .0
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    Cow::Borrowed(sql),
                    false,
                )
            })
            .collect();
        Box::pin(async move { Ok(migrations) })
    }
}

/// The migrator for the embedded SQLite store.
pub async fn sqlite_migrator() -> Result<Migrator, sqlx::migrate::MigrateError> {
    Migrator::new(Source(SQLITE)).await
}

/// The migrator for Postgres (`gateway migrate`).
pub async fn postgres_migrator() -> Result<Migrator, sqlx::migrate::MigrateError> {
    Migrator::new(Source(POSTGRES)).await
}
