//! The embedded default store: one SQLite file, created and migrated at start.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

use super::StoreError;

/// Tenants and keys in a SQLite file.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// Open (creating if needed) and migrate the database at `url` (`sqlite://path`).
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(5))
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        super::sqlite_migrator().await?.run(&pool).await?;
        Ok(Self { pool })
    }
}

super::sql::sql_store!(SqliteStore, sqlx::sqlite::SqliteRow);
