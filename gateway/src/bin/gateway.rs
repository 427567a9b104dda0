//! `gateway`: the server, its migrations, the backend simulator and the demo.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
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
    /// Train the cache-hit verifier on labelled pairs with k-fold cross-validation; prints the
    /// held-out precision/recall and writes the model with its held-out curve.
    TrainVerifier {
        /// The pairs file (JSON lines `{"a", "b", "duplicate"}`).
        #[arg(long)]
        pairs: PathBuf,
        /// Model directory (needs static.bin: `gateway embed distill`).
        #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
        model: PathBuf,
        /// Output file (default: verifier.json in the model directory).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Folds.
        #[arg(long, default_value_t = 5)]
        folds: usize,
        /// Only the first N pairs.
        #[arg(long)]
        limit: Option<usize>,
        /// Also write every pair's features and label as JSON lines (for analysis).
        #[arg(long)]
        dump_features: Option<PathBuf>,
        /// Train on features written by `--dump-features` instead of computing them (seconds
        /// instead of minutes; `--pairs` then only names the source).
        #[arg(long)]
        from_features: Option<PathBuf>,
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
    },
    /// Run the gateway on its embedded default in front of simulated model servers.
    Demo {
        /// Port on 127.0.0.1.
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Store URL.
        #[arg(long, default_value = "sqlite://gateway-demo.db")]
        store: String,
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
            println!("migrated {}", gateway::app::redact_url(&url));
            Ok(())
        }
        Command::Embed {
            command:
                EmbedCommand::Distill {
                    model,
                    out,
                    if_stale,
                },
        } => {
            use embedder::bert::BertEmbedder;
            use embedder::static_embed::StaticEmbedder;
            let out = out.unwrap_or_else(|| model.join("static.bin"));
            if if_stale && StaticEmbedder::is_current(&out) {
                println!("{} is up to date", out.display());
                return Ok(());
            }
            anyhow::ensure!(
                BertEmbedder::present(&model),
                "no model in {}: run scripts/fetch-model.sh",
                model.display()
            );
            let bert = BertEmbedder::load(&model)?;
            let started = std::time::Instant::now();
            let mut last = 0;
            let table = StaticEmbedder::distill(&bert, |done, total| {
                if done * 10 / total != last {
                    last = done * 10 / total;
                    eprintln!("distilling: {done}/{total} tokens");
                }
            })?;
            table.save(&out)?;
            println!(
                "wrote {} ({} dimensions) in {:.1} s",
                out.display(),
                table.dim(),
                started.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Command::Embed {
            command:
                EmbedCommand::Eval {
                    pairs,
                    model,
                    threshold,
                    limit,
                    steps,
                },
        } => embed_eval(&pairs, &model, threshold, limit, steps),
        Command::Embed {
            command:
                EmbedCommand::TrainVerifier {
                    pairs,
                    model,
                    out,
                    folds,
                    limit,
                    dump_features,
                    from_features,
                },
        } => train_verifier(
            &pairs,
            &model,
            out,
            folds,
            limit,
            dump_features,
            from_features,
        ),
        Command::Simulate {
            profile,
            port,
            model,
            no_usage,
            error_rate,
            spike_rate,
            spike_ms,
        } => {
            let mut p = SimProfile::by_name(&profile).with_context(|| {
                format!("unknown --profile {profile:?}: use small, large or zero")
            })?;
            if let Some(m) = model {
                p.model = m;
            }
            let options = SimOptions {
                profile: p,
                report_usage: !no_usage,
                error_rate,
                spike_rate,
                spike_ms,
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
        Command::Demo { port, store } => {
            gateway::demo::run(gateway::demo::DemoOptions {
                listen: SocketAddr::from(([127, 0, 0, 1], port)),
                store_url: store,
            })
            .await
        }
    }
}

/// Read a pairs file (JSON lines `{"a", "b", "duplicate"}`), up to `limit` pairs.
fn read_pairs(
    pairs: &std::path::Path,
    limit: Option<usize>,
) -> anyhow::Result<Vec<embedder::eval::Pair>> {
    let text =
        std::fs::read_to_string(pairs).with_context(|| format!("reading {}", pairs.display()))?;
    let mut data = Vec::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let pair: embedder::eval::Pair = serde_json::from_str(line).with_context(|| {
            format!(
                "{} line {}: expected {{\"a\", \"b\", \"duplicate\"}}",
                pairs.display(),
                i + 1
            )
        })?;
        data.push(pair);
        if limit.is_some_and(|n| data.len() >= n) {
            break;
        }
    }
    anyhow::ensure!(!data.is_empty(), "no pairs in {}", pairs.display());
    Ok(data)
}

/// Sentence cosine and contextual token alignment of each pair (batches of 32 pairs).
fn transformer_signals(
    bert: &embedder::bert::BertEmbedder,
    data: &[embedder::eval::Pair],
) -> anyhow::Result<Vec<embedder::verifier::TransformerSignals>> {
    use embedder::verifier::{alignment, TransformerSignals};
    let mut out = Vec::with_capacity(data.len());
    for (n, chunk) in data.chunks(32).enumerate() {
        let texts: Vec<&str> = chunk
            .iter()
            .flat_map(|p| [p.a.as_str(), p.b.as_str()])
            .collect();
        let v = bert.embed_with_tokens(&texts)?;
        for ab in v.chunks(2) {
            let (align_min, align_mean) = alignment(&ab[0].1, &ab[1].1);
            out.push(TransformerSignals {
                cosine: embedder::bert::cosine(&ab[0].0, &ab[1].0),
                align_min,
                align_mean,
            });
        }
        if (n + 1) % 50 == 0 {
            eprintln!("embedded {} of {} pairs", out.len(), data.len());
        }
    }
    Ok(out)
}

fn load_bert(model: &std::path::Path) -> anyhow::Result<embedder::bert::BertEmbedder> {
    anyhow::ensure!(
        embedder::bert::BertEmbedder::present(model),
        "no model in {}: run scripts/fetch-model.sh",
        model.display()
    );
    Ok(embedder::bert::BertEmbedder::load(model)?)
}

fn train_verifier(
    pairs: &std::path::Path,
    model: &std::path::Path,
    out: Option<PathBuf>,
    folds: usize,
    limit: Option<usize>,
    dump_features: Option<PathBuf>,
    from_features: Option<PathBuf>,
) -> anyhow::Result<()> {
    use embedder::eval::{at, threshold_for_precision};
    use embedder::verifier::{cross_validate, CurvePoint, Params, Verifier};
    let (x, y, source) = match from_features {
        Some(path) => {
            let (x, y) = read_features(&path)?;
            (
                x,
                y,
                format!("{} (features of {})", path.display(), pairs.display()),
            )
        }
        None => {
            let (x, y) = pair_features(pairs, model, limit)?;
            (x, y, pairs.display().to_string())
        }
    };
    if let Some(path) = dump_features {
        let mut lines = String::new();
        for (f, l) in x.iter().zip(&y) {
            lines.push_str(&serde_json::json!({"features": f, "duplicate": l}).to_string());
            lines.push('\n');
        }
        std::fs::write(&path, lines).with_context(|| format!("writing {}", path.display()))?;
    }
    // The first feature is the transformer cosine: the baseline column.
    let cosines: Vec<f32> = x.iter().map(|f| f[0]).collect();
    let params = Params::default();
    let held = cross_validate(&x, &y, folds, params);
    println!(
        "{} pairs, {} duplicates, {folds}-fold cross-validation (held-out scores)",
        x.len(),
        y.iter().filter(|&&l| l).count()
    );
    println!("  target precision  cosine alone: recall  verifier: recall (threshold)");
    for target in [0.80, 0.85, 0.90, 0.95] {
        let plain = threshold_for_precision(&cosines, &y, target).map_or(0.0, |p| p.recall);
        let v = threshold_for_precision(&held, &y, target);
        println!(
            "  {target:16.2}  {plain:20.3}  {}",
            v.map_or("not reached".to_owned(), |p| format!(
                "{:.3} ({:.3})",
                p.recall, p.threshold
            ))
        );
    }
    let mut curve: Vec<CurvePoint> = (1..100)
        .map(|i| at(&held, &y, i as f32 / 100.0).into())
        .collect();
    curve.retain(|p| p.recall > 0.0);
    let mut verifier = Verifier::fit(&x, &y, params);
    verifier.curve = curve;
    verifier.trained_on = format!("{source} ({} pairs, {folds}-fold)", x.len());
    let out = out.unwrap_or_else(|| model.join("verifier.json"));
    std::fs::write(&out, serde_json::to_vec_pretty(&verifier)?)
        .with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

/// Every pair's verifier features and label (the transformer over every text: minutes).
fn pair_features(
    pairs: &std::path::Path,
    model: &std::path::Path,
    limit: Option<usize>,
) -> anyhow::Result<(Vec<Vec<f32>>, Vec<bool>)> {
    use embedder::static_embed::StaticEmbedder;
    use embedder::verifier::features;
    let data = read_pairs(pairs, limit)?;
    let bert = load_bert(model)?;
    let table_path = model.join("static.bin");
    anyhow::ensure!(
        table_path.is_file(),
        "no {}: run `gateway embed distill` first",
        table_path.display()
    );
    let table = StaticEmbedder::load(&table_path, &model.join("tokenizer.json"))?;
    let signals = transformer_signals(&bert, &data)?;
    let x = data
        .iter()
        .zip(&signals)
        .map(|(p, &s)| features(&p.a, &p.b, s, &table))
        .collect();
    Ok((x, data.iter().map(|p| p.duplicate).collect()))
}

/// Features written by `train-verifier --dump-features` (JSON lines `{"features", "duplicate"}`).
fn read_features(path: &std::path::Path) -> anyhow::Result<(Vec<Vec<f32>>, Vec<bool>)> {
    #[derive(serde::Deserialize)]
    struct Row {
        features: Vec<f32>,
        duplicate: bool,
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let row: Row = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a feature row", path.display(), n + 1))?;
        anyhow::ensure!(
            row.features.len() == embedder::verifier::FEATURES.len(),
            "{}:{}: {} features, this build computes {}",
            path.display(),
            n + 1,
            row.features.len(),
            embedder::verifier::FEATURES.len()
        );
        x.push(row.features);
        y.push(row.duplicate);
    }
    anyhow::ensure!(!x.is_empty(), "no rows in {}", path.display());
    Ok((x, y))
}

fn embed_eval(
    pairs: &std::path::Path,
    model: &std::path::Path,
    threshold: f32,
    limit: Option<usize>,
    steps: usize,
) -> anyhow::Result<()> {
    use embedder::bert::cosine;
    use embedder::eval::{at, curve, threshold_for_precision};
    use embedder::static_embed::StaticEmbedder;
    let data = read_pairs(pairs, limit)?;
    let labels: Vec<bool> = data.iter().map(|p| p.duplicate).collect();
    let bert = load_bert(model)?;
    let transformer: Vec<f32> = transformer_signals(&bert, &data)?
        .iter()
        .map(|s| s.cosine)
        .collect();
    let mut paths = vec![("transformer", transformer)];
    let table = model.join("static.bin");
    if table.is_file() {
        let s = StaticEmbedder::load(&table, &model.join("tokenizer.json"))?;
        let mut scores = Vec::with_capacity(data.len());
        for p in &data {
            scores.push(cosine(&s.embed(&p.a)?, &s.embed(&p.b)?));
        }
        paths.push(("static", scores));
    } else {
        println!(
            "(no {}: run `gateway embed distill` to evaluate the static path)",
            table.display()
        );
    }
    let duplicates = labels.iter().filter(|&&l| l).count();
    println!("{} pairs, {duplicates} duplicates", data.len());
    for (name, scores) in &paths {
        let p = at(scores, &labels, threshold);
        println!(
            "\n{name}: at threshold {threshold:.3}: precision {:.3}, recall {:.3}, hit rate {:.3}",
            p.precision, p.recall, p.hit_rate
        );
        for target in [0.90, 0.95] {
            match threshold_for_precision(scores, &labels, target) {
                Some(b) => println!(
                    "  precision >= {target:.2}: threshold {:.4}, recall {:.3}, hit rate {:.3}",
                    b.threshold, b.recall, b.hit_rate
                ),
                None => println!("  precision >= {target:.2}: not reached at any threshold"),
            }
        }
        println!("  threshold  precision  recall  hit rate");
        for p in curve(scores, &labels, steps) {
            println!(
                "  {:9.4}  {:9.3}  {:6.3}  {:8.3}",
                p.threshold, p.precision, p.recall, p.hit_rate
            );
        }
    }
    Ok(())
}
