//! The shared store: Postgres, migrated by `gateway migrate`.

use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};

use super::StoreError;

/// Tenants and keys in Postgres.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    /// Connect and check that the schema is migrated to this binary's version.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(5))
            .connect(url)
            .await?;
        let migrator = super::postgres_migrator().await?;
        let latest = migrator.iter().map(|m| m.version).max().unwrap_or(0);
        let applied: Option<i64> =
            sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
                .fetch_one(&pool)
                .await
                .unwrap_or(None);
        if applied.unwrap_or(0) < latest {
            return Err(StoreError::Corrupt(format!(
                "postgres schema is at version {} but this gateway needs {latest}: run `gateway migrate`",
                applied.unwrap_or(0)
            )));
        }
        Ok(Self { pool })
    }

    /// Apply the embedded Postgres migrations to the database at `url`.
    pub async fn migrate(url: &str) -> Result<(), StoreError> {
        let pool = PgPoolOptions::new().max_connections(1).connect(url).await?;
        super::postgres_migrator().await?.run(&pool).await?;
        pool.close().await;
        Ok(())
    }
}

super::sql::sql_store!(PostgresStore, sqlx::postgres::PgRow);
