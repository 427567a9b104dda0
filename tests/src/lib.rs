//! End-to-end test harness: a real gateway on `127.0.0.1:0` in front of simulated or mocked
//! upstreams, with a tenant and a key, a capture of its usage events, and one helper per endpoint.
//!
//! Postgres tests talk to the server at `TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`); each test gets its own database, dropped at the
//! end.

#![allow(
    clippy::expect_used,
    reason = "a test harness: failing loudly is the point"
)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gateway::config::{Config, ModelTarget, ReplicaConfig, Tier, TierConfig};
use gateway::simulator::{self, SimOptions, SimProfile, Simulator};
use gateway::store::{self, postgres::PostgresStore, NewKey, Store};
use gateway::usage::{ChannelSink, UsageEvent};
use gateway::{AppState, Deps};
use serde_json::Value;
use sqlx::Connection;
use tokio::sync::{mpsc, oneshot};

pub mod grafana;

/// The admin token every test gateway uses.
pub const ADMIN_TOKEN: &str = "test-admin-token";

/// Which store a test gateway runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// A SQLite file in a temporary directory.
    Sqlite,
    /// A fresh Postgres database.
    Postgres,
}

/// Both stores, for tests that must pass on each.
pub const BOTH: [StoreKind; 2] = [StoreKind::Sqlite, StoreKind::Postgres];

fn postgres_server_url() -> String {
    std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A throwaway Postgres database; dropped (with its connections) when this is dropped.
#[derive(Debug)]
pub struct PgDatabase {
    /// Connection URL of the database.
    pub url: String,
    name: String,
}

impl PgDatabase {
    /// Create an empty database with a unique name.
    pub async fn create() -> anyhow::Result<Self> {
        let server = postgres_server_url();
        let name = format!("gw_test_{}", uuid::Uuid::new_v4().simple());
        let mut conn = sqlx::PgConnection::connect(&server).await?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await?;
        let base = server.rsplit_once('/').map_or(server.as_str(), |(b, _)| b);
        Ok(Self {
            url: format!("{base}/{name}"),
            name,
        })
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        let server = postgres_server_url();
        let name = self.name.clone();
        // Drop runs outside any runtime guarantee: use a private one on a plain thread.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(mut conn) = sqlx::PgConnection::connect(&server).await {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut conn)
                        .await;
                }
            });
        })
        .join();
    }
}

/// A store of the given kind, migrated, with whatever keeps it alive.
#[derive(Clone)]
pub struct TestStore {
    /// The store.
    pub store: Arc<dyn Store>,
    /// The URL the store was opened with.
    pub url: String,
    _dir: Option<Arc<tempfile::TempDir>>,
    _pg: Option<Arc<PgDatabase>>,
}

impl TestStore {
    /// Open a fresh, migrated store.
    pub async fn new(kind: StoreKind) -> anyhow::Result<Self> {
        match kind {
            StoreKind::Sqlite => {
                let dir = tempfile::tempdir()?;
                let url = format!("sqlite://{}", dir.path().join("gateway.db").display());
                Ok(Self {
                    store: store::open(&url).await?,
                    url,
                    _dir: Some(Arc::new(dir)),
                    _pg: None,
                })
            }
            StoreKind::Postgres => {
                let db = PgDatabase::create().await?;
                PostgresStore::migrate(&db.url).await?;
                Ok(Self {
                    store: store::open(&db.url).await?,
                    url: db.url.clone(),
                    _dir: None,
                    _pg: Some(Arc::new(db)),
                })
            }
        }
    }

    /// A store on a database someone else owns (already migrated).
    pub async fn at(url: &str) -> anyhow::Result<Self> {
        Ok(Self {
            store: store::open(url).await?,
            url: url.to_owned(),
            _dir: None,
            _pg: None,
        })
    }

    /// Another handle on the same database (a second gateway replica).
    pub async fn reopen(&self) -> anyhow::Result<Self> {
        Ok(Self {
            store: store::open(&self.url).await?,
            url: self.url.clone(),
            _dir: self._dir.clone(),
            _pg: self._pg.clone(),
        })
    }
}

/// The repository's embedding model (`scripts/fetch-model.sh`; the static table beside it is
/// distilled by `scripts/test.sh`).
pub fn model_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/all-MiniLM-L6-v2")
}

/// One replica entry for a config.
pub fn replica(name: &str, base_url: &str, model: &str) -> ReplicaConfig {
    ReplicaConfig {
        name: name.into(),
        url: base_url.into(),
        model: model.into(),
        api_key_env: None,
        max_concurrency: 64,
        metrics_url: None,
    }
}

/// A config with the given small and large replicas, models `fast`, `smart` and `auto`, the test
/// admin token, and short health cooldowns.
pub fn config(small: Vec<ReplicaConfig>, large: Vec<ReplicaConfig>) -> Config {
    let mut c = Config::default();
    c.server.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.admin.token = Some(ADMIN_TOKEN.to_owned().into());
    c.store.key_refresh_ms = 200;
    c.upstream.first_byte_timeout_ms = 5_000;
    c.upstream.idle_timeout_ms = 5_000;
    c.tiers.insert(
        Tier::Small,
        TierConfig {
            tokenizer: None,
            replicas: small,
        },
    );
    c.tiers.insert(
        Tier::Large,
        TierConfig {
            tokenizer: None,
            replicas: large,
        },
    );
    c.models = BTreeMap::from([
        ("fast".to_owned(), ModelTarget::Small),
        ("smart".to_owned(), ModelTarget::Large),
        ("auto".to_owned(), ModelTarget::Auto),
    ]);
    c
}

/// A running simulator.
pub struct Sim {
    /// Its `/v1` base URL.
    pub url: String,
    /// Its root URL (for `/sim/*`).
    pub root: String,
    /// Its state.
    pub sim: Arc<Simulator>,
}

impl Sim {
    /// Start a simulator with `options`.
    pub async fn start(options: SimOptions) -> Self {
        let (addr, sim) = simulator::spawn(options, 0).await.expect("simulator binds");
        Self {
            url: format!("http://{addr}/v1"),
            root: format!("http://{addr}"),
            sim,
        }
    }

    /// Start a zero-latency simulator serving `model`.
    pub async fn zero(model: &str) -> Self {
        let mut p = SimProfile::zero();
        p.model = model.into();
        Self::start(SimOptions::new(p)).await
    }

    /// Inject faults through the control endpoint.
    pub async fn faults(&self, body: Value) {
        reqwest::Client::new()
            .post(format!("{}/sim/faults", self.root))
            .json(&body)
            .send()
            .await
            .expect("faults set");
    }

    /// The last request body the simulator received.
    pub async fn last_request(&self) -> Value {
        let v: Value = reqwest::Client::new()
            .get(format!("{}/sim/stats", self.root))
            .send()
            .await
            .expect("stats")
            .json()
            .await
            .expect("stats json");
        v["last_request"].clone()
    }
}

/// A running gateway with one tenant and key.
pub struct TestApp {
    /// `http://127.0.0.1:port`
    pub base: String,
    /// The gateway's state (store, metrics, upstreams).
    pub state: AppState,
    /// A live key of tenant `acme`.
    pub api_key: String,
    /// That key's id.
    pub key_id: String,
    /// The tenant's id.
    pub tenant_id: String,
    /// Settlement events, in order.
    pub events: mpsc::UnboundedReceiver<UsageEvent>,
    /// A plain HTTP client.
    pub http: reqwest::Client,
    /// The store (keeps temporary databases alive).
    pub store: TestStore,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl TestApp {
    /// Start a gateway with `config` on a fresh store of `kind`, and create tenant `acme` with a
    /// key tagged `feature=tests`.
    pub async fn spawn(config: Config, kind: StoreKind) -> Self {
        let store = TestStore::new(kind).await.expect("store opens");
        Self::spawn_on(config, store, true).await
    }

    /// Start a gateway on an existing store; with `seed`, create the tenant and key.
    pub async fn spawn_on(config: Config, store: TestStore, seed: bool) -> Self {
        Self::start(config, store, seed, true).await
    }

    /// Start a gateway that writes its real cost ledger (no event capture).
    pub async fn spawn_with_ledger(config: Config, store: TestStore) -> Self {
        Self::start(config, store, true, false).await
    }

    async fn start(config: Config, store: TestStore, seed: bool, capture: bool) -> Self {
        Self::spawn_custom(config, store, seed, capture, Deps::default()).await
    }

    /// Start a gateway with extra dependencies (a budget store, a clock); `capture` sends
    /// usage events to [`TestApp::events`] instead of the ledger.
    pub async fn spawn_custom(
        mut config: Config,
        store: TestStore,
        seed: bool,
        capture: bool,
        extra: Deps,
    ) -> Self {
        // The ledger (when on) opens the store's database by URL.
        config.store.url = store.url.clone();
        gateway::telemetry::install_crypto_provider();
        let (api_key, key_id, tenant_id) = if seed {
            let tenant = store.store.create_tenant("acme").await.expect("tenant");
            let generated = gateway::keys::generate();
            let key = store
                .store
                .create_key(NewKey {
                    tenant_id: tenant.id.clone(),
                    name: Some("test".into()),
                    hash: generated.hash,
                    prefix: generated.prefix,
                    tags: BTreeMap::from([("feature".to_owned(), "tests".to_owned())]),
                    client_tags: None,
                })
                .await
                .expect("key");
            (generated.secret, key.id, tenant.id)
        } else {
            Default::default()
        };
        let (tx, events) = mpsc::unbounded_channel();
        let deps = Deps {
            store: Some(Arc::clone(&store.store)),
            sink: capture.then(|| Arc::new(ChannelSink(tx)) as gateway::usage::SharedSink),
            ..extra
        };
        let state = AppState::build(config, deps).await.expect("gateway state");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (shutdown, rx) = oneshot::channel::<()>();
        let server = tokio::spawn(gateway::serve(listener, state.clone(), async move {
            let _ = rx.await;
        }));
        Self {
            base: format!("http://{addr}"),
            state,
            api_key,
            key_id,
            tenant_id,
            events,
            http: reqwest::Client::new(),
            store,
            shutdown: Some(shutdown),
            server: Some(server),
        }
    }

    /// An `async-openai` client pointed at this gateway with `key`.
    pub fn openai(&self, key: &str) -> async_openai::Client<async_openai::config::OpenAIConfig> {
        async_openai::Client::with_config(
            async_openai::config::OpenAIConfig::new()
                .with_api_base(format!("{}/v1", self.base))
                .with_api_key(key),
        )
    }

    /// POST a JSON body to `path` with this app's key.
    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.api_key)
            .json(body)
            .send()
            .await
            .expect("request sent")
    }

    /// Wait (up to 5 minutes: the static table is distilled on first use when scripts/test.sh
    /// did not) until the semantic layer has loaded its model, table and verifier.
    pub async fn semantic_ready(&self) {
        eventually(
            "the semantic layer loads",
            Duration::from_secs(300),
            || async { self.state.cache.semantic_ready().then_some(()) },
        )
        .await;
    }

    /// The `/metrics` exposition text.
    pub async fn metrics(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .expect("metrics request")
            .text()
            .await
            .expect("metrics text")
    }

    /// POST `body`, text as it is (a client's own spelling of JSON, or none), as a chat
    /// completion with this app's key.
    pub async fn chat_text(&self, body: &str) -> reqwest::Response {
        self.http
            .post(format!("{}/v1/chat/completions", self.base))
            .bearer_auth(&self.api_key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .expect("request sent")
    }

    /// POST a chat completion.
    pub async fn chat(&self, body: Value) -> reqwest::Response {
        self.post("/v1/chat/completions", &body).await
    }

    /// `POST /v1/chat/completions` with another API key (a second key, or another replica's).
    pub async fn chat_as(&self, key: &str, body: &Value) -> reqwest::Response {
        self.http
            .post(format!("{}/v1/chat/completions", self.base))
            .bearer_auth(key)
            .json(body)
            .send()
            .await
            .expect("request sent")
    }

    /// Call the admin API.
    pub async fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> reqwest::Response {
        let mut req = self
            .http
            .request(method, format!("{}/admin/v1/{path}", self.base))
            .bearer_auth(ADMIN_TOKEN);
        if let Some(b) = body {
            req = req.json(&b);
        }
        req.send().await.expect("admin request sent")
    }

    /// `GET /admin/v1/{path}`, its JSON body.
    pub async fn admin_json(&self, path: &str) -> Value {
        self.admin(reqwest::Method::GET, path, None)
            .await
            .json()
            .await
            .expect("admin answer is JSON")
    }

    /// Wait (up to 5 s) until every budget of `tenant` has nothing reserved; its usage rows.
    pub async fn wait_reserved_zero(&self, tenant: &str) -> Vec<Value> {
        eventually(
            "every reservation is released",
            Duration::from_secs(5),
            || async {
                let v = self.admin_json(&format!("usage?tenant={tenant}")).await;
                let rows = v["data"].as_array().cloned().unwrap_or_default();
                rows.iter()
                    .all(|r| r["state"]["reserved_tokens"] == 0)
                    .then_some(rows)
            },
        )
        .await
    }

    /// Run the real `gatewayctl` against this gateway: (success, stdout + stderr).
    pub async fn ctl(&self, args: &[&str]) -> (bool, String) {
        // Async process I/O: the gateway under test runs on this same runtime.
        let out = tokio::process::Command::new(binary("gatewayctl"))
            .args(args)
            .env("GATEWAY_URL", &self.base)
            .env("GATEWAY_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .await
            .expect("gatewayctl runs");
        (out.status.success(), output_text(&out))
    }

    /// The next settlement event (fails the test after 10 s).
    pub async fn next_event(&mut self) -> UsageEvent {
        tokio::time::timeout(Duration::from_secs(10), self.events.recv())
            .await
            .expect("a usage event within 10 s")
            .expect("event channel open")
    }

    /// Stop serving, wait for in-flight settlement and flush the ledger.
    pub async fn stop(mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(server) = self.server.take() {
            server.await.expect("server task").expect("server result");
        }
    }
}

/// Poll `condition` (every 20 ms) until it gives `Some(value)`, and return the value; fail the
/// test naming `what` when `timeout` passes first. The one way tests wait for something that
/// happens in the background (a refresh, a flush, a process starting) instead of sleeping.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut condition: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = condition().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {timeout:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait (up to 20 s) until the gateway process `child` answers `GET {base}/healthz`; fail at
/// once if it exits.
pub async fn until_healthy(base: &str, child: &mut tokio::process::Child) {
    eventually(
        "the gateway answers /healthz",
        Duration::from_secs(20),
        || {
            let exited = child.try_wait().ok().flatten();
            assert!(exited.is_none(), "the gateway exited: {exited:?}");
            let url = format!("{base}/healthz");
            async move { reqwest::get(url).await.ok().map(|_| ()) }
        },
    )
    .await;
}

/// [`config`] with both tiers on one simulator (`s` small, `l` large, both serving its
/// `sim-small`), optionally priced at `prices` = (input, output) USD per 1M tokens.
pub fn config_on(sim: &Sim, prices: Option<(f64, f64)>) -> Config {
    let mut c = config(
        vec![replica("s", &sim.url, "sim-small")],
        vec![replica("l", &sim.url, "sim-small")],
    );
    if let Some((input, output)) = prices {
        price(&mut c, "sim-small", input, output);
    }
    c
}

/// Price `model` at `input` and `output` USD per 1M tokens in `c`.
pub fn price(c: &mut Config, model: &str, input: f64, output: f64) {
    c.prices.insert(
        model.into(),
        gateway::config::PriceConfig {
            input,
            output,
            cached_input: None,
        },
    );
}

/// A chat request whose history shows an agent stuck in a loop: the same action answered by the
/// same failure three times in a row (the guard flags it on this first request).
pub fn looping_chat() -> Value {
    let mut looping = chat_body("fast", "fix it");
    let step = serde_json::json!([
        {"role": "assistant", "content": "Running the tests."},
        {"role": "user", "content": "FAILED test_x"}
    ]);
    for _ in 0..3 {
        looping["messages"]
            .as_array_mut()
            .expect("chat_body has messages")
            .extend(step.as_array().into_iter().flatten().cloned());
    }
    looping
}

/// A user message body for `model`.
pub fn chat_body(model: &str, text: &str) -> Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}]})
}

/// Path to a workspace binary built next to the test executable (`cargo build --bins` first).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target profile directory");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not built: run `cargo build --workspace --bins` first (scripts/test.sh does)",
        path.display()
    );
    path
}

/// A free loopback port (bound, noted, released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A `gateway serve` config: listening on `port`, the store at `store_url`, the ledger spooling
/// under `dir`, models `fast` (small tier, one replica at `small`) and `smart` (large, at
/// `large`), then `extra` (whole sections; set fields of the sections above through
/// [`serve_binary`]'s environment, e.g. `GATEWAY__LEDGER__FLUSH_MS`).
pub fn serve_toml(
    port: u16,
    store_url: &str,
    dir: &std::path::Path,
    (small, large): (&str, &str),
    extra: &str,
) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
[store]
url = "{store_url}"
[ledger]
spool_dir = "{spool}"
[models]
fast = "small"
smart = "large"
[[tiers.small.replicas]]
name = "s1"
url = "{small}"
model = "sim-small"
[[tiers.large.replicas]]
name = "l1"
url = "{large}"
model = "sim-large"
{extra}
"#,
        spool = dir.join("spool").display(),
    )
}

/// [`serve_toml`] with the cache off and both tiers on a port nothing answers (for tests of
/// start-up and of the admin surface, which need no model server).
pub fn offline_toml(port: u16, store_url: &str, dir: &std::path::Path) -> String {
    let dead = "http://127.0.0.1:9/v1";
    serve_toml(
        port,
        store_url,
        dir,
        (dead, dead),
        "[cache]\nmode = \"off\"",
    )
}

/// Start the real `gateway serve --config FILE` with `toml` written to `dir/gateway.toml`,
/// with `env` set (a `None` value removes the variable); its output goes to `dir/gateway.log`
/// (a pipe nobody reads would stall a chatty process), killed on drop.
pub fn serve_binary(
    dir: &std::path::Path,
    toml: &str,
    env: &[(&str, Option<&str>)],
) -> tokio::process::Child {
    let path = dir.join("gateway.toml");
    std::fs::write(&path, toml).expect("write the gateway config");
    let log = std::fs::File::create(dir.join("gateway.log")).expect("create the gateway log");
    let mut cmd = tokio::process::Command::new(binary("gateway"));
    cmd.args(["serve", "--config"])
        .arg(&path)
        .stdout(log.try_clone().expect("log file"))
        .stderr(log)
        .kill_on_drop(true);
    for (name, value) in env {
        match value {
            Some(v) => cmd.env(name, v),
            None => cmd.env_remove(name),
        };
    }
    cmd.spawn().expect("start gateway serve")
}

/// A private Postgres server (Debian's binaries) in a temporary directory on a free port, that a
/// test can stop and start again (database outages). Stopped when dropped.
pub struct PrivatePostgres {
    /// `postgres://postgres@127.0.0.1:PORT/postgres`
    pub url: String,
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
}

impl PrivatePostgres {
    fn run(&self, tool: &str, args: &[&str]) -> anyhow::Result<()> {
        let exe = self.bin.join(tool);
        let is_root = std::process::Command::new("id").arg("-u").output()?.stdout == b"0\n";
        let mut cmd = if is_root {
            // initdb and postgres refuse to run as root.
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            std::process::Command::new(&exe)
        };
        let out = cmd.args(args).output()?;
        anyhow::ensure!(
            out.status.success(),
            "{tool} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// initdb and start a server.
    pub fn start() -> anyhow::Result<Self> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|p| p.join("initdb").exists())
            .max()
            .ok_or_else(|| anyhow::anyhow!("no Postgres binaries under /usr/lib/postgresql"))?;
        let dir = tempfile::tempdir()?;
        let _ = std::process::Command::new("chown")
            .args(["-R", "postgres"])
            .arg(dir.path())
            .status();
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let pg = Self {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            dir,
            bin,
            port,
        };
        let data = pg.data();
        pg.run(
            "initdb",
            &["-D", &data, "-A", "trust", "-U", "postgres", "--no-sync"],
        )?;
        pg.resume()?;
        Ok(pg)
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    /// [`PrivatePostgres::start`], then apply the gateway's migrations.
    pub async fn start_migrated() -> anyhow::Result<Self> {
        let pg = Self::start()?;
        gateway::store::postgres::PostgresStore::migrate(&pg.url).await?;
        Ok(pg)
    }

    /// Start the (stopped) server again.
    pub fn resume(&self) -> anyhow::Result<()> {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("pg.log").display().to_string();
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-o", &opts, "-l", &log, "-w", "start"],
        )
    }

    /// Stop the server at once (connections are cut).
    pub fn stop(&self) -> anyhow::Result<()> {
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        )
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// What a synthetic ledger row bills: `prompt` and `completion` tokens of `tenant` on `model` at
/// `at`, costed at `in_price`/`out_price` micro-dollars per token.
#[derive(Debug, Clone, Copy)]
pub struct Billed<'a> {
    /// Tenant name (its id and key id derive from it).
    pub tenant: &'a str,
    /// Requested and served model; a name ending in `large` is on the large tier.
    pub model: &'a str,
    /// When the request started.
    pub at: chrono::DateTime<chrono::Utc>,
    /// Prompt tokens.
    pub prompt: u64,
    /// Completion tokens.
    pub completion: u64,
    /// Micro-dollars per prompt token.
    pub in_price: i64,
    /// Micro-dollars per completion token.
    pub out_price: i64,
}

/// A synthetic ledger row: a billed (cache miss) small- or large-tier chat request, tagged
/// `feature=<tenant>-app`. Tests edit the fields they care about (see [`into_cache_hit`]).
pub fn ledger_event(request_id: String, billed: Billed<'_>) -> gateway::usage::UsageEvent {
    let Billed {
        tenant,
        model,
        at,
        prompt,
        completion,
        in_price,
        out_price,
    } = billed;
    use gateway::usage::{CacheStatus, UsageSource};
    let output = completion as i64 * out_price;
    gateway::usage::UsageEvent {
        request_id: request_id.into(),
        started_at: at,
        tenant_id: format!("ten_{tenant}"),
        tenant_name: tenant.into(),
        key_id: format!("key_{tenant}"),
        tags: BTreeMap::from([("feature".to_owned(), format!("{tenant}-app"))]),
        endpoint: "chat".into(),
        requested_model: model.into(),
        served_model: Some(model.into()),
        tier: Some(
            if model.ends_with("large") {
                "large"
            } else {
                "small"
            }
            .into(),
        ),
        replica: Some("r1".into()),
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: 0,
        usage_source: UsageSource::Upstream,
        status: 200,
        error_kind: None,
        stream: false,
        client_disconnected: false,
        latency_ms: 100.0,
        ttft_ms: Some(20.0),
        retries: 0,
        cache_status: CacheStatus::Miss,
        cost_micros: prompt as i64 * in_price + output,
        output_cost_micros: output,
        saved_micros: 0,
        loop_flag: false,
        retry_storm_flag: false,
        loop_steps: 0,
        avoided_micros: 0,
        route_reason: None,
        routed: false,
        all_large_micros: None,
        replica_choice: None,
        matched_blocks: None,
        fingerprint: format!("fp-{tenant}-{}", at.timestamp_micros()),
    }
}

/// Turn a billed row into an exact-cache hit: it cost nothing and saved what it would have cost.
pub fn into_cache_hit(mut e: gateway::usage::UsageEvent) -> gateway::usage::UsageEvent {
    e.cache_status = gateway::usage::CacheStatus::HitExact;
    e.saved_micros = e.cost_micros;
    e.cost_micros = 0;
    e.output_cost_micros = 0;
    e
}

/// A finished process's stdout followed by its stderr, for assertions and failure messages.
pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The shared Redis the tests use (`TEST_REDIS_URL`, default the local server).
pub fn redis_url() -> String {
    std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Delete every key of `tenant_id` from the shared Redis (all of a tenant's budget keys carry
/// its hash tag), as a Redis restart without persistence would; returns how many went.
pub async fn redis_lose_tenant(tenant_id: &str) -> usize {
    let client = redis::Client::open(redis_url()).expect("redis url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis connection");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("gw:{{{tenant_id}}}:*"))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(&keys)
            .query_async(&mut conn)
            .await
            .expect("DEL");
    }
    keys.len()
}

/// Where budget counters live in a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetKind {
    /// The in-process store.
    Memory,
    /// The shared Redis.
    Redis,
    /// The three-master Redis Cluster (`scripts/services.sh` starts it).
    RedisCluster,
}

/// Every budget store, for conformance loops: in-process, one Redis, a Redis Cluster.
pub const BUDGET_STORES: [BudgetKind; 3] = [
    BudgetKind::Memory,
    BudgetKind::Redis,
    BudgetKind::RedisCluster,
];

/// The seed nodes of the test Redis Cluster (`TEST_REDIS_CLUSTER_URLS`, comma-separated; default
/// the three masters `scripts/services.sh` starts on 127.0.0.1:7101-7103).
pub fn redis_cluster_urls() -> Vec<String> {
    std::env::var("TEST_REDIS_CLUSTER_URLS")
        .unwrap_or_else(|_| {
            "redis://127.0.0.1:7101,redis://127.0.0.1:7102,redis://127.0.0.1:7103".into()
        })
        .split(',')
        .map(|u| u.trim().to_owned())
        .collect()
}

impl BudgetKind {
    /// A fresh store of this kind (Redis keys are namespaced by the caller's tenant ids).
    pub fn store(self) -> Arc<dyn gateway::budget::BudgetStore> {
        match self {
            Self::Memory => Arc::new(gateway::budget::memory::MemoryStore::new()),
            Self::Redis | Self::RedisCluster => Arc::new(
                gateway::budget::redis::RedisStore::new(
                    self.redis_urls(),
                    std::time::Duration::from_secs(2),
                )
                .expect("redis url"),
            ),
        }
    }

    /// The Redis URLs of this kind (none for the in-process store).
    pub fn redis_urls(self) -> Vec<String> {
        match self {
            Self::Memory => Vec::new(),
            Self::Redis => vec![redis_url()],
            Self::RedisCluster => redis_cluster_urls(),
        }
    }

    /// `budgets` config selecting this store (Redis: the shared one).
    pub fn config(self) -> gateway::config::BudgetConfig {
        let mut b = gateway::config::BudgetConfig::default();
        if self != Self::Memory {
            b.store = gateway::config::BudgetStoreKind::Redis;
            b.redis_urls = self.redis_urls();
        }
        b
    }
}

/// A private `redis-server` (append-only file, fsync always) on a free port, that a test can
/// kill and start again. Stopped when dropped.
pub struct PrivateRedis {
    /// `redis://127.0.0.1:PORT`
    pub url: String,
    port: u16,
    dir: tempfile::TempDir,
    child: std::sync::Mutex<Option<std::process::Child>>,
}

impl PrivateRedis {
    /// Start a server.
    pub fn start() -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let r = Self {
            url: format!("redis://127.0.0.1:{port}"),
            port,
            dir: tempfile::tempdir()?,
            child: std::sync::Mutex::new(None),
        };
        r.resume()?;
        Ok(r)
    }

    /// Start the (stopped) server again and wait until it answers.
    pub fn resume(&self) -> anyhow::Result<()> {
        let child = std::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            // Every write is on disk before it is acknowledged, so a killed server comes back
            // with its counters (as a production Redis with AOF would).
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(std::process::Stdio::null())
            .spawn()?;
        *self.child.lock().map_err(|_| anyhow::anyhow!("poisoned"))? = Some(child);
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        anyhow::bail!("redis-server did not start on port {}", self.port)
    }

    /// Freeze the server (SIGSTOP): connections stay open and nothing is answered, as when
    /// Redis hangs; [`PrivateRedis::unpause`] lets it go on with what queued meanwhile.
    pub fn pause(&self) -> anyhow::Result<()> {
        self.signal("-STOP")
    }

    /// Let a paused server run again (SIGCONT).
    pub fn unpause(&self) -> anyhow::Result<()> {
        self.signal("-CONT")
    }

    fn signal(&self, sig: &str) -> anyhow::Result<()> {
        let guard = self.child.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let pid = guard
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("not running"))?
            .id();
        let ok = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()?
            .success();
        anyhow::ensure!(ok, "kill {sig} {pid} failed");
        Ok(())
    }

    /// Kill the server (connections are cut; acknowledged writes survive).
    pub fn stop(&self) -> anyhow::Result<()> {
        if let Some(mut c) = self
            .child
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .take()
        {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// The agent-session fixtures (`tests/fixtures/agent-sessions/{looping,progressing}`), sorted
/// by name: (name, fixture JSON).
pub fn agent_sessions(kind: &str) -> Vec<(String, Value)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/agent-sessions")
        .join(kind);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("fixture directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("?")
                .to_owned();
            let json =
                serde_json::from_slice(&std::fs::read(&p).expect("fixture")).expect("fixture JSON");
            (name, json)
        })
        .collect()
}

/// The requests an agent-session fixture sends: its explicit `requests`, or its transcript cut
/// before each assistant message (the agent resends its growing history).
pub fn session_requests(fixture: &Value) -> Vec<Vec<Value>> {
    if let Some(r) = fixture.get("requests").and_then(Value::as_array) {
        return r.iter().filter_map(|m| m.as_array().cloned()).collect();
    }
    let messages = fixture
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.get("role").and_then(Value::as_str) == Some("assistant"))
        .map(|(i, _)| messages[..i].to_vec())
        .collect()
}
