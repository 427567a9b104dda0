//! One lazily connected Redis (a single node, or a cluster when several seed URLs are given),
//! one each for the budget store, the guard and the response cache. The connection is made on
//! first use, so a gateway starts while Redis is down; every call made through it is bounded by
//! `timeout` where it is made ([`RedisConn::timeout`]).

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};
use tokio::sync::OnceCell;

/// A connection to one node or to a cluster; cheap to clone (both multiplex).
#[derive(Clone)]
pub enum Conn {
    /// A single node (reconnects on its own).
    Single(ConnectionManager),
    /// A Redis Cluster (routes each key to its slot's node).
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// Redis at `urls`, connected on first use.
pub struct RedisConn {
    urls: Vec<String>,
    timeout: Duration,
    /// Set by the first call that connects (a failed attempt leaves it unset for the next).
    conn: OnceCell<Conn>,
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConn")
            .field("nodes", &self.urls.len())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisConn {
    /// Check the URLs (one: a single node; several: cluster seed nodes); connects later.
    pub fn new(urls: Vec<String>, timeout: Duration) -> Result<Self, RedisError> {
        for url in &urls {
            redis::Client::open(url.as_str())?;
        }
        Ok(Self {
            urls,
            timeout,
            conn: OnceCell::new(),
        })
    }

    /// The bound on every call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The connection, made on first use (then a clone, without a lock: every call on the
    /// request path comes here).
    pub async fn get(&self) -> Result<Conn, RedisError> {
        self.conn.get_or_try_init(|| self.connect()).await.cloned()
    }

    async fn connect(&self) -> Result<Conn, RedisError> {
        Ok(if self.urls.len() == 1 {
            let client = redis::Client::open(self.urls[0].as_str())?;
            // No response timeout of the crate's own: every call through this connection is
            // already bounded by `timeout` where it is made (the budget store's, the guard's
            // and the cache's calls each run under `tokio::time::timeout`), and the crate's,
            // one more timer per command, only doubled it. A timer armed while the lane runs
            // also wakes its driver (docs/benchmarks.md, "Thirty-fifth sitting"). A command
            // that times out does not make the manager reconnect either way (a timeout is not
            // a dropped connection to it).
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(self.timeout))
                .set_response_timeout(None)
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            Conn::Single(ConnectionManager::new_with_config(client, config).await?)
        } else {
            let client = redis::cluster::ClusterClient::builder(self.urls.clone())
                .connection_timeout(self.timeout)
                .response_timeout(self.timeout)
                .build()?;
            Conn::Cluster(client.get_async_connection().await?)
        })
    }
}
