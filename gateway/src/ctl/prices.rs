//! `gatewayctl prices …`: set and list model prices (USD per 1M tokens, with history).

use clap::Subcommand;
use reqwest::Method;
use serde_json::json;

use super::{time, Admin, Answer, Reply};
use crate::routes::admin::PriceView;
use crate::types::price::Usd;

/// `gatewayctl prices …`
#[derive(Debug, Subcommand)]
pub enum PriceCommand {
    /// Set a model's price from now (or from --from).
    #[command(after_help = "Example:\n  gatewayctl prices set sim-large --input 2.5 --output 10")]
    Set {
        /// Served model name.
        model: String,
        /// USD per 1M uncached input tokens.
        #[arg(long)]
        input: f64,
        /// USD per 1M output tokens.
        #[arg(long)]
        output: f64,
        /// USD per 1M cached input tokens (default: the input price).
        #[arg(long)]
        cached_input: Option<f64>,
        /// Effective time, RFC 3339 (default: now).
        #[arg(long)]
        from: Option<String>,
    },
    /// List prices with their history.
    #[command(after_help = "Example:\n  gatewayctl prices list")]
    List,
}

impl PriceCommand {
    /// Call the admin API and render its answer.
    pub(super) async fn run(self, admin: &Admin) -> anyhow::Result<Reply> {
        Ok(match self {
            Self::Set {
                model,
                input,
                output,
                cached_input,
                from,
            } => {
                let body = json!({"model": model, "input": input, "output": output,
                                  "cached_input": cached_input, "effective_from": from});
                let a: Answer<PriceView> = admin.call(Method::POST, "prices", Some(body)).await?;
                let p = &a.body;
                let h = format!(
                    "price of {} from {}: input {:#}/1M, output {:#}/1M, cached input {:#}/1M",
                    p.model,
                    time(&p.effective_from),
                    Usd(p.input_micros_per_mtok),
                    Usd(p.output_micros_per_mtok),
                    Usd(p.cached_input_micros_per_mtok)
                );
                a.reply(h)
            }
            Self::List => {
                let row = |p: &PriceView| {
                    vec![
                        p.model.clone(),
                        time(&p.effective_from),
                        Usd(p.input_micros_per_mtok).to_string(),
                        Usd(p.output_micros_per_mtok).to_string(),
                        Usd(p.cached_input_micros_per_mtok).to_string(),
                    ]
                };
                let header = &["MODEL", "FROM", "INPUT $/1M", "OUTPUT $/1M", "CACHED $/1M"];
                admin.list("prices", header, row).await?
            }
        })
    }
}
