//! A model's price and what a request's usage costs at it, in integer micro-dollars.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::Usage;

/// Micro-dollars per million tokens.
pub type MicrosPerMtok = i64;

/// One model's prices from `effective_from` on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Price {
    /// Served model name (as the upstream names it).
    pub model: String,
    /// When this price starts to apply.
    pub effective_from: DateTime<Utc>,
    /// Uncached input (prompt) tokens.
    pub input: MicrosPerMtok,
    /// Output (completion) tokens.
    pub output: MicrosPerMtok,
    /// Input tokens served from the upstream's prefix cache.
    pub cached_input: MicrosPerMtok,
}

/// Convert a USD amount (as configured, e.g. `0.15`) to micro-dollars, refusing negatives,
/// non-finite values and more than micro-dollar precision loss.
pub fn usd_to_micros(usd: f64) -> Option<i64> {
    if !usd.is_finite() || !(0.0..=1e9).contains(&usd) {
        return None;
    }
    Some((usd * 1e6).round() as i64)
}

impl Price {
    /// Cost of `usage` at this price, micro-dollars: (input incl. cached input, output), each
    /// rounded half up once.
    pub fn cost_split(&self, usage: &Usage) -> (i64, i64) {
        let cached = usage.cached_tokens.min(usage.prompt_tokens);
        let uncached = usage.prompt_tokens - cached;
        // Token counts × micro-dollars per 1M tokens: micro-dollars × 1e6.
        let input = i128::from(uncached) * i128::from(self.input)
            + i128::from(cached) * i128::from(self.cached_input);
        let output = i128::from(usage.completion_tokens) * i128::from(self.output);
        let round =
            |scaled: i128| i64::try_from((scaled + 500_000) / 1_000_000).unwrap_or(i64::MAX);
        (round(input), round(output))
    }

    /// Total cost of `usage` at this price, micro-dollars.
    pub fn cost(&self, usage: &Usage) -> i64 {
        let (input, output) = self.cost_split(usage);
        input + output
    }
}

/// Micro-dollars shown as USD with all six decimals: `1.250000`, `-0.000001`; with `{:#}` the
/// dollar sign too: `$1.250000`, `-$0.000001`; with `{:+}` a sign on every amount, for changes:
/// `+1.250000`, `+0.000000`, `-0.000001`. The one USD formatter of headers, errors, the
/// dashboard and `gatewayctl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usd(pub i64);

impl std::fmt::Display for Usd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sign = if self.0 < 0 {
            "-"
        } else if f.sign_plus() {
            "+"
        } else {
            ""
        };
        let dollar = if f.alternate() { "$" } else { "" };
        let m = self.0.unsigned_abs();
        write!(f, "{sign}{dollar}{}.{:06}", m / 1_000_000, m % 1_000_000)
    }
}

#[cfg(test)]
mod tests {
    use super::Usd;

    #[test]
    fn usd_shows_every_micro_dollar_and_the_sign_first() {
        assert_eq!(Usd(1_250_000).to_string(), "1.250000");
        assert_eq!(format!("{:#}", Usd(-1)), "-$0.000001");
        assert_eq!(format!("{:#}", Usd(i64::MIN)), "-$9223372036854.775808");
        assert_eq!(format!("{:+}", Usd(1_250_000)), "+1.250000");
        assert_eq!(format!("{:+}", Usd(0)), "+0.000000");
        assert_eq!(format!("{:+#}", Usd(-1)), "-$0.000001");
    }
}
