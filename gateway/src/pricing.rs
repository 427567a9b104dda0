//! Model prices and request costs, in integer micro-dollars.
//!
//! A price is USD per 1M input, output and cached-input tokens for one served model, effective
//! from a point in time; a change applies to requests that start after it, so history is kept.
//! Prices come from the config (seeded into the store at start when they differ from the latest
//! stored price) and from the admin API, and every replica reloads them every
//! `store.key_refresh_ms` like keys. A request's cost is rounded to the nearest micro-dollar once;
//! sums are exact over the rounded values.

use std::collections::BTreeMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use chrono::{DateTime, Utc};

use crate::config::PriceConfig;
use crate::store::{Store, StoreError};
use crate::tasks::Background;
use crate::types::Usage;

pub use crate::types::price::{usd_to_micros, MicrosPerMtok, Price};

/// The configured prices (`[prices.MODEL]`, USD per 1M tokens), effective from `at`. The
/// config has checked every amount converts ([`crate::config::Config::validate`]).
pub fn configured(prices: &BTreeMap<String, PriceConfig>, at: DateTime<Utc>) -> Vec<Price> {
    let micros = |usd: f64| usd_to_micros(usd).unwrap_or(0);
    prices
        .iter()
        .map(|(model, p)| Price {
            model: model.clone(),
            effective_from: at,
            input: micros(p.input),
            output: micros(p.output),
            cached_input: micros(p.cached_input.unwrap_or(p.input)),
        })
        .collect()
}

/// Every price with its history, by model, oldest first.
#[derive(Debug, Clone, Default)]
pub struct PriceBook {
    by_model: crate::FastMap<String, Vec<Price>>,
}

impl PriceBook {
    /// Build from any list of prices.
    pub fn new(prices: impl IntoIterator<Item = Price>) -> Self {
        let mut by_model: crate::FastMap<String, Vec<Price>> = crate::FastMap::default();
        for p in prices {
            by_model.entry(p.model.clone()).or_default().push(p);
        }
        for v in by_model.values_mut() {
            v.sort_by_key(|p| p.effective_from);
        }
        Self { by_model }
    }

    /// The price of `model` in force at `at`.
    pub fn price_at(&self, model: &str, at: DateTime<Utc>) -> Option<&Price> {
        self.by_model
            .get(model)?
            .iter()
            .rev()
            .find(|p| p.effective_from <= at)
    }

    /// The newest price of `model`.
    pub fn latest(&self, model: &str) -> Option<&Price> {
        self.by_model.get(model)?.last()
    }

    /// Cost of `usage` on `model` for a request that started at `at`; 0 for unpriced models.
    pub fn cost(&self, model: &str, usage: &Usage, at: DateTime<Utc>) -> i64 {
        self.price_at(model, at).map_or(0, |p| p.cost(usage))
    }

    /// [`Price::cost_split`] at the price in force at `at`; (0, 0) for unpriced models.
    pub fn cost_split(&self, model: &str, usage: &Usage, at: DateTime<Utc>) -> (i64, i64) {
        self.price_at(model, at)
            .map_or((0, 0), |p| p.cost_split(usage))
    }
}

/// The live price book of a replica.
pub struct Prices {
    store: Arc<dyn Store>,
    book: ArcSwap<PriceBook>,
    /// Serialises [`Prices::refresh`], so a periodic refresh that read the table before an
    /// admin change cannot store its stale book after the admin's fresh one.
    refreshing: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Prices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prices").finish_non_exhaustive()
    }
}

impl Prices {
    /// Seed `configured` prices (each becomes effective now when it differs from the latest
    /// stored price of its model) and load the book.
    pub async fn new(store: Arc<dyn Store>, configured: Vec<Price>) -> Result<Self, StoreError> {
        let current = PriceBook::new(store.list_prices().await?);
        for p in configured {
            let same = current.latest(&p.model).is_some_and(|l| {
                (l.input, l.output, l.cached_input) == (p.input, p.output, p.cached_input)
            });
            if !same {
                match store.insert_price(&p).await {
                    Ok(()) | Err(StoreError::Conflict(_)) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        let prices = Self {
            store,
            book: ArcSwap::from_pointee(PriceBook::default()),
            refreshing: tokio::sync::Mutex::new(()),
        };
        prices.refresh().await?;
        Ok(prices)
    }

    /// Reload the book every `every` until `background` stops.
    pub fn start(self: &Arc<Self>, background: &Background, every: std::time::Duration) {
        let prices = Arc::clone(self);
        background.every("prices", every, move || {
            let prices = Arc::clone(&prices);
            async move { prices.refresh().await }
        });
    }

    /// Reload the book from the store.
    pub async fn refresh(&self) -> Result<(), StoreError> {
        let _serial = self.refreshing.lock().await;
        let book = PriceBook::new(self.store.list_prices().await?);
        self.book.store(Arc::new(book));
        Ok(())
    }

    /// The current book.
    pub fn book(&self) -> Arc<PriceBook> {
        self.book.load_full()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn price(from_day: u32, input: i64) -> Price {
        Price {
            model: "m".into(),
            effective_from: Utc
                .with_ymd_and_hms(2026, 11, from_day, 0, 0, 0)
                .single()
                .unwrap_or_default(),
            input,
            output: 600_000,
            cached_input: input / 2,
        }
    }

    #[test]
    fn cost_counts_cached_tokens_at_their_own_price_and_rounds_once() {
        let p = price(1, 150_000); // $0.15 / 1M in, $0.60 out, $0.075 cached
        let u = Usage {
            prompt_tokens: 1_000_000,
            completion_tokens: 1_000_000,
            cached_tokens: 400_000,
        };
        // 600k × 0.15 + 400k × 0.075 + 1M × 0.60 = 0.09 + 0.03 + 0.60 = $0.72
        assert_eq!(p.cost(&u), 720_000);
        let tiny = Usage {
            prompt_tokens: 3,
            completion_tokens: 0,
            cached_tokens: 0,
        };
        assert_eq!(p.cost(&tiny), 0, "0.45 µ$ rounds down");
        let tiny = Usage {
            prompt_tokens: 4,
            completion_tokens: 0,
            cached_tokens: 0,
        };
        assert_eq!(p.cost(&tiny), 1, "0.6 µ$ rounds up");
    }

    #[test]
    fn the_price_in_force_at_the_request_start_applies() {
        let book = PriceBook::new(vec![price(20, 300_000), price(1, 150_000)]);
        let u = Usage {
            prompt_tokens: 1_000_000,
            completion_tokens: 0,
            cached_tokens: 0,
        };
        let before = Utc
            .with_ymd_and_hms(2026, 11, 19, 23, 59, 59)
            .single()
            .unwrap_or_default();
        let after = Utc
            .with_ymd_and_hms(2026, 11, 20, 0, 0, 0)
            .single()
            .unwrap_or_default();
        assert_eq!(book.cost("m", &u, before), 150_000);
        assert_eq!(book.cost("m", &u, after), 300_000);
        let earlier = Utc
            .with_ymd_and_hms(2026, 10, 1, 0, 0, 0)
            .single()
            .unwrap_or_default();
        assert_eq!(book.cost("m", &u, earlier), 0, "no price yet");
        assert_eq!(book.cost("other", &u, after), 0);
    }

    #[test]
    fn usd_amounts_convert_exactly_and_bad_ones_are_refused() {
        assert_eq!(usd_to_micros(0.15), Some(150_000));
        assert_eq!(usd_to_micros(2.5), Some(2_500_000));
        assert_eq!(usd_to_micros(-1.0), None);
        assert_eq!(usd_to_micros(f64::NAN), None);
    }
}
