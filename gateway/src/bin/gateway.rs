//! `gateway`: the server, its migrations, the backend simulator and the demo.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use embedder::verifier::TrainOptions;
use gateway::config::Config;
use gateway::simulator::{SimOptions, SimProfile};

// The proxy path allocates small, short-lived buffers per request; mimalloc's thread-local
// free lists beat glibc malloc there (glibc was ~15% of CPU under load in a perf profile).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Subcommand)]
enum EmbedCommand {
    /// Distill the static embedding table from the transformer (every vocabulary token through
    /// the model once; a minute or two on a CPU).
    Distill {
        /// Model directory (from scripts/fetch-model.sh).
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        model: PathBuf,
        /// Output file (default: static.bin in the model directory).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Do nothing when the output already holds a table of this build's version.
        #[arg(long)]
        if_stale: bool,
    },
    /// Precision, recall and hit rate of the similarity threshold on labelled pairs
    /// (JSON lines `{"a", "b", "duplicate"}`), for the transformer and the static path.
    Eval {
        /// The pairs file.
        #[arg(long)]
        pairs: PathBuf,
        /// Model directory (static.bin in it is used when present).
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        model: PathBuf,
        /// The setting to evaluate: a cosine at or above it is a cache hit.
        #[arg(long, default_value_t = 0.95)]
        threshold: f32,
        /// Only the first N pairs.
        #[arg(long)]
        limit: Option<usize>,
        /// Points on the printed curve.
        #[arg(long, default_value_t = 20)]
        steps: usize,
    },
    /// Judge one pair as the semantic cache would: the cosine of the two questions, the
    /// verifier's probability that they ask the same thing, and which precision settings
    /// (`gatewayctl cache set --min-precision`) would answer one with the other's answer.
    Verify {
        /// The first question.
        a: String,
        /// The second question.
        b: String,
        /// Model directory (needs static.bin: `gateway embed distill`).
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        model: PathBuf,
        /// A verifier artefact (default: the shipped one).
        #[arg(long)]
        verifier: Option<PathBuf>,
    },
    /// Train the cache-hit verifier on labelled pairs with k-fold cross-validation; prints the
    /// held-out precision/recall and writes the model with its held-out curve.
    TrainVerifier {
        /// A pairs file (JSON lines `{"a", "b", "duplicate"}`, optionally `"source"`; the file's
        /// name otherwise). Repeat it to train on several: figures are reported per source, and
        /// each source is also held out whole (fitted on the others).
        #[arg(long, required = true)]
        pairs: Vec<PathBuf>,
        /// Pairs to score with the shipped model only, per source (never trained on).
        #[arg(long)]
        test_pairs: Vec<PathBuf>,
        /// Model directory (needs static.bin: `gateway embed distill`).
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        model: PathBuf,
        /// Output file (default: verifier.json in the model directory).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Folds.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(2..=50))]
        folds: u16,
        /// Only the first N pairs of each file.
        #[arg(long)]
        limit: Option<usize>,
        /// Keep the embedded texts in this directory (one file per pairs file) and reuse them
        /// when they match (the transformer pass takes minutes; training alone, a few).
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Seed of the fold assignment (to see how much the held-out figures move with it).
        #[arg(long, default_value_t = TrainOptions::default().seed)]
        seed: u64,
        /// Trees alone, without the linear models over vector components stacked under them
        /// (for ablations: QQP's recall falls by half).
        #[arg(long)]
        no_linear: bool,
        /// Read the shipped curve off each source held out (fitted on the others) rather than
        /// off the grouped folds: stricter thresholds, meant to hold on kinds of text absent
        /// from training.
        #[arg(long)]
        calibrate_held_out: bool,
        /// Leave a tree feature out (by column name; repeat it): for ablations.
        #[arg(long)]
        without: Vec<String>,
        /// Depth of each boosted tree.
        #[arg(long, default_value_t = TrainOptions::default().trees.depth)]
        tree_depth: usize,
        /// Least pairs in a tree leaf.
        #[arg(long, default_value_t = TrainOptions::default().trees.min_leaf)]
        min_leaf: usize,
    },
}

/// LLM gateway and cost-control proxy.
#[derive(Debug, Parser)]
#[command(name = "gateway", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum RouterCommand {
    /// Train the small/large tier classifier on labelled prompts (JSON lines `{"prompt",
    /// "small_correct", "large_correct", "source"}`), cross-validated with folds grouped by
    /// `source`; prints RouteLLM's figures held out and writes the artefact.
    ///
    /// Example: gateway router train --data ../shared/data/routing-dev.jsonl --out router.json
    Train {
        /// The labelled prompts.
        #[arg(long)]
        data: PathBuf,
        /// Output file.
        #[arg(long, default_value = "tier-router.json")]
        out: PathBuf,
        /// Folds (subjects are spread over them).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(2..=50))]
        folds: u16,
        /// Inverse L2 regularisation of the regressions.
        #[arg(long, default_value_t = embedder::tier::TierTrainOptions::default().c)]
        c: f64,
        /// Seed of the fold assignment.
        #[arg(long, default_value_t = embedder::tier::TierTrainOptions::default().seed)]
        seed: u64,
        /// Also read the prompt's embedding: `static` (the static table of
        /// `--embedding-model`, microseconds per prompt). Default: text features only.
        #[arg(long, value_parser = ["static"])]
        embedding: Option<String>,
        /// The embedding's weight against the unit-length TF-IDF vector.
        #[arg(long, default_value_t = 1.0)]
        embedding_weight: f32,
        /// Model directory for `--embedding` (from scripts/fetch-model.sh).
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        embedding_model: PathBuf,
    },
    /// Evaluate a tier classifier on labelled prompts: PGR at 20/50/80% large calls, APGR and
    /// CPT(50%)/CPT(80%), beside a random router and prompt length.
    ///
    /// Example: gateway router eval --data held-out.jsonl
    Eval {
        /// The labelled prompts.
        #[arg(long)]
        data: PathBuf,
        /// A classifier artefact (default: the shipped one).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Model directory, for a classifier that reads the static embedding.
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        embedding_model: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API.
    Serve {
        /// TOML configuration file.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Override `server.listen`.
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Apply the Postgres migrations (SQLite is migrated at start).
    Migrate {
        /// TOML configuration file (its `store.url`).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Database URL; overrides the config's `store.url`.
        #[arg(long, env = "DATABASE_URL")]
        database_url: Option<String>,
    },
    /// Tier router tools (the small/large classifier behind `model: "auto"`).
    Router {
        /// Router command.
        #[command(subcommand)]
        command: RouterCommand,
    },
    /// Embedding model tools.
    Embed {
        /// Embed command.
        #[command(subcommand)]
        command: EmbedCommand,
    },
    /// Run a SIMULATED OpenAI-compatible model server (for demos, tests and benchmarks).
    Simulate {
        /// Timing profile: small, large or zero (no latency).
        #[arg(long, default_value = "small")]
        profile: String,
        /// Port on 127.0.0.1 (0 = any free port).
        #[arg(long, default_value_t = 9001)]
        port: u16,
        /// Model name to serve (default: sim-<profile>).
        #[arg(long)]
        model: Option<String>,
        /// Never report usage (like some servers), to exercise token counting.
        #[arg(long)]
        no_usage: bool,
        /// Probability of answering 500.
        #[arg(long, default_value_t = 0.0)]
        error_rate: f64,
        /// Probability of a latency spike.
        #[arg(long, default_value_t = 0.0)]
        spike_rate: f64,
        /// Latency spike size in ms.
        #[arg(long, default_value_t = 500)]
        spike_ms: u64,
        /// A fault window, from the simulator's start: `AFTER+FOR=WHAT` with WHAT a status
        /// (`5s+10s=503`), `slow:DURATION` (`20s+15s=slow:30s`) or `hang` (`40s+5s=hang`).
        /// Repeatable.
        #[arg(long = "fault", value_parser = clap::value_parser!(gateway::simulator::FaultWindow))]
        faults: Vec<gateway::simulator::FaultWindow>,
        /// Shorthand for one status window: fail from this long after the start (`5s`)...
        #[arg(long, value_parser = gateway::simulator::parse_duration, requires = "fail_for")]
        fail_after: Option<std::time::Duration>,
        /// ...for this long (`10s`)...
        #[arg(long, value_parser = gateway::simulator::parse_duration, requires = "fail_after")]
        fail_for: Option<std::time::Duration>,
        /// ...answering this status.
        #[arg(long, default_value_t = 503)]
        fail_status: u16,
        /// Sequences in the batch at once (default: the profile's); more requests wait.
        #[arg(long)]
        max_running: Option<usize>,
        /// Prefill and decode slow down by this factor at a full batch (default: the
        /// profile's).
        #[arg(long)]
        batch_slowdown: Option<f64>,
        /// Blocks the prefix (KV) cache holds (default: the profile's).
        #[arg(long)]
        cache_blocks: Option<usize>,
    },
    /// Run the gateway on its embedded default in front of simulated model servers.
    Demo {
        /// Port on 127.0.0.1.
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Store URL.
        #[arg(long, default_value = "sqlite://gateway-demo.db")]
        store: String,
        /// Do not seed the labelled synthetic fortnight of ledger history (seeded once per
        /// database otherwise, so the dashboard has a cost change to explain).
        #[arg(long)]
        no_history: bool,
        /// Send a small background mix of requests (three features, cache repeats, an agent
        /// loop now and then, SDK retries), about one a second, so the numbers move.
        #[arg(long)]
        traffic: bool,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    gateway::telemetry::init();
    gateway::telemetry::install_crypto_provider();
    match Cli::parse().command {
        Command::Serve { config, listen } => {
            let mut config = Config::load(config.as_deref())?;
            if let Some(listen) = listen {
                config.server.listen = listen;
            }
            gateway::run(config).await
        }
        Command::Migrate {
            config,
            database_url,
        } => {
            let url = match database_url {
                Some(u) => u,
                None => Config::load(config.as_deref())?.store.url,
            };
            if url.starts_with("sqlite:") {
                gateway::store::sqlite::SqliteStore::open(&url).await?;
            } else {
                gateway::store::postgres::PostgresStore::migrate(&url)
                    .await
                    .context("migrating postgres")?;
            }
            println!("migrated {}", gateway::state::redact_url(&url));
            Ok(())
        }
        Command::Router {
            command:
                RouterCommand::Train {
                    data,
                    out,
                    folds,
                    c,
                    seed,
                    embedding,
                    embedding_weight,
                    embedding_model,
                },
        } => gateway::routing::tools::train_router(
            &data,
            &out,
            embedder::tier::TierTrainOptions {
                folds: usize::from(folds),
                c,
                seed,
            },
            &gateway::routing::tools::EmbeddingArgs {
                source: embedding,
                weight: embedding_weight,
                model_dir: embedding_model,
            },
        ),
        Command::Router {
            command:
                RouterCommand::Eval {
                    data,
                    model,
                    embedding_model,
                },
        } => gateway::routing::tools::eval_router(&data, model, &embedding_model),
        Command::Embed {
            command:
                EmbedCommand::Distill {
                    model,
                    out,
                    if_stale,
                },
        } => gateway::cache::tools::distill(&model, out, if_stale),
        Command::Embed {
            command:
                EmbedCommand::Eval {
                    pairs,
                    model,
                    threshold,
                    limit,
                    steps,
                },
        } => gateway::cache::tools::eval(&pairs, &model, threshold, limit, steps),
        Command::Embed {
            command:
                EmbedCommand::Verify {
                    a,
                    b,
                    model,
                    verifier,
                },
        } => gateway::cache::tools::verify(&a, &b, &model, verifier.as_deref()),
        Command::Embed {
            command:
                EmbedCommand::TrainVerifier {
                    pairs,
                    test_pairs,
                    model,
                    out,
                    folds,
                    limit,
                    cache,
                    seed,
                    no_linear,
                    calibrate_held_out,
                    without,
                    tree_depth,
                    min_leaf,
                },
        } => gateway::cache::tools::train_verifier(
            &gateway::cache::tools::PairFiles {
                train: pairs,
                test: test_pairs,
                limit,
                cache,
            },
            &model,
            out,
            TrainOptions {
                folds: usize::from(folds),
                seed,
                linear: !no_linear,
                calibration: if calibrate_held_out {
                    embedder::verifier::Calibration::SourcesHeldOut
                } else {
                    embedder::verifier::Calibration::Grouped
                },
                without,
                trees: embedder::learn::trees::Params {
                    depth: tree_depth,
                    min_leaf,
                    ..TrainOptions::default().trees
                },
                ..TrainOptions::default()
            },
        ),
        Command::Simulate {
            profile,
            port,
            model,
            no_usage,
            error_rate,
            spike_rate,
            spike_ms,
            mut faults,
            fail_after,
            fail_for,
            fail_status,
            max_running,
            batch_slowdown,
            cache_blocks,
        } => {
            if let (Some(after), Some(length)) = (fail_after, fail_for) {
                anyhow::ensure!(
                    (400..=599).contains(&fail_status),
                    "--fail-status {fail_status}: give an error status (400-599)"
                );
                faults.push(gateway::simulator::FaultWindow {
                    after,
                    length,
                    fault: gateway::simulator::ScheduledFault::Status(fail_status),
                });
            }
            let mut p = SimProfile::by_name(&profile).with_context(|| {
                format!("unknown --profile {profile:?}: use small, large or zero")
            })?;
            if let Some(m) = model {
                p.model = m;
            }
            if let Some(n) = max_running {
                p.max_running = n.max(1);
            }
            if let Some(s) = batch_slowdown {
                p.batch_slowdown = s.max(0.0);
            }
            if let Some(b) = cache_blocks {
                p.cache_blocks = b;
            }
            let options = SimOptions {
                profile: p,
                report_usage: !no_usage,
                error_rate,
                spike_rate,
                spike_ms,
                schedule: faults,
            };
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .with_context(|| format!("binding 127.0.0.1:{port}"))?;
            println!(
                "SIMULATED model server ({profile}) on http://{}/v1",
                listener.local_addr()?
            );
            gateway::simulator::serve(listener, gateway::simulator::Simulator::new(options))
                .await?;
            Ok(())
        }
        Command::Demo {
            port,
            store,
            no_history,
            traffic,
        } => {
            gateway::demo::run(gateway::demo::DemoOptions {
                listen: SocketAddr::from(([127, 0, 0, 1], port)),
                store_url: store,
                history: !no_history,
                traffic,
            })
            .await
        }
    }
}
