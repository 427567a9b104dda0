//! Load signals from the model servers themselves: a replica with `metrics_url` set (vLLM's or
//! SGLang's Prometheus endpoint) is scraped every `upstream.scrape_interval_ms`, and its running
//! and waiting requests and KV-cache use feed the load side of prefix-affinity choice (the
//! server's counts include other gateways' traffic, which this gateway's in-flight count cannot
//! see). Off for replicas without `metrics_url` (hosted providers have none).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::tasks::Background;

/// What a server's metrics said.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ServerLoad {
    /// Requests in its batch.
    pub running: Option<f64>,
    /// Requests waiting for a batch slot.
    pub waiting: Option<f64>,
    /// KV-cache use in [0, 1].
    pub kv_usage: Option<f64>,
}

const RUNNING: [&str; 2] = ["vllm:num_requests_running", "sglang:num_running_reqs"];
const WAITING: [&str; 2] = ["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
const KV: [&str; 3] = [
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "sglang:token_usage",
];

/// Read the load gauges out of a Prometheus text exposition: counts summed over label sets
/// (one per model served), KV-cache use the highest. Unknown lines are ignored.
pub fn parse(text: &str) -> ServerLoad {
    let mut out = ServerLoad::default();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        if !value.is_finite() {
            continue;
        }
        let name = series.split('{').next().unwrap_or(series).trim();
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + value);
        if RUNNING.contains(&name) {
            add(&mut out.running);
        } else if WAITING.contains(&name) {
            add(&mut out.waiting);
        } else if KV.contains(&name) {
            out.kv_usage = Some(out.kv_usage.map_or(value, |k| k.max(value)));
        }
    }
    out
}

/// The latest scrape of one replica (lock-free: read on every affinity choice).
#[derive(Debug)]
pub struct Observed {
    /// Running + waiting requests; `u32::MAX`: unknown.
    load: AtomicU32,
    /// KV-cache use in thousandths; `u32::MAX`: unknown.
    kv_milli: AtomicU32,
    /// When it was scraped, ms since the Unix epoch (0: never).
    at_ms: AtomicU64,
}

impl Default for Observed {
    fn default() -> Self {
        Self {
            load: AtomicU32::new(u32::MAX),
            kv_milli: AtomicU32::new(u32::MAX),
            at_ms: AtomicU64::new(0),
        }
    }
}

fn now_ms() -> u64 {
    u64::try_from(chrono::Utc::now().timestamp_millis()).unwrap_or(0)
}

impl Observed {
    fn store(&self, l: ServerLoad) {
        let load = match (l.running, l.waiting) {
            (None, None) => u32::MAX,
            (r, w) => (r.unwrap_or(0.0) + w.unwrap_or(0.0))
                .round()
                .clamp(0.0, 1e9) as u32,
        };
        let kv = l
            .kv_usage
            .map_or(u32::MAX, |k| (k.clamp(0.0, 1.0) * 1000.0).round() as u32);
        self.load.store(load, Ordering::Relaxed);
        self.kv_milli.store(kv, Ordering::Relaxed);
        self.at_ms.store(now_ms(), Ordering::Release);
    }

    /// (running + waiting, KV-cache use) from a scrape younger than `max_age`.
    pub fn fresh(&self, max_age: Duration) -> (Option<u32>, Option<f64>) {
        let at = self.at_ms.load(Ordering::Acquire);
        let age = now_ms().saturating_sub(at);
        if at == 0 || u128::from(age) > max_age.as_millis() {
            return (None, None);
        }
        let load = self.load.load(Ordering::Relaxed);
        let kv = self.kv_milli.load(Ordering::Relaxed);
        (
            (load != u32::MAX).then_some(load),
            (kv != u32::MAX).then(|| f64::from(kv) / 1000.0),
        )
    }
}

/// Scrape `url` into `into` every `every` until `background` stops; a failed scrape leaves the
/// last one to age out (then the gateway's own counts are used).
pub fn start(background: &Background, url: String, into: Arc<Observed>, every: Duration) {
    let http = reqwest::Client::builder()
        .timeout(every.max(Duration::from_millis(100)))
        .build()
        .unwrap_or_default();
    background.every("replica metrics", every, move || {
        let (http, url, into) = (http.clone(), url.clone(), Arc::clone(&into));
        async move {
            let text = http
                .get(&url)
                .send()
                .await
                .and_then(reqwest::Response::error_for_status)
                .map_err(|e| format!("scraping {url}: {e}"))?
                .text()
                .await
                .map_err(|e| format!("scraping {url}: {e}"))?;
            into.store(parse(&text));
            Ok::<(), String>(())
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_sglang_gauges_are_read_and_the_rest_ignored() {
        let vllm = "# HELP vllm:num_requests_running x\n\
                    vllm:num_requests_running{model_name=\"a\"} 3\n\
                    vllm:num_requests_running{model_name=\"b\"} 1\n\
                    vllm:num_requests_waiting{model_name=\"a\"} 7.0\n\
                    vllm:gpu_cache_usage_perc{model_name=\"a\"} 0.25\n\
                    vllm:gpu_cache_usage_perc{model_name=\"b\"} 0.5\n\
                    vllm:prompt_tokens_total{model_name=\"a\"} 12345\n\
                    garbage line\n";
        assert_eq!(
            parse(vllm),
            ServerLoad {
                running: Some(4.0),
                waiting: Some(7.0),
                kv_usage: Some(0.5)
            }
        );
        let sglang = "sglang:num_running_reqs{model_name=\"m\"} 2\nsglang:num_queue_reqs{model_name=\"m\"} 0\nsglang:token_usage{model_name=\"m\"} 0.9\n";
        assert_eq!(
            parse(sglang),
            ServerLoad {
                running: Some(2.0),
                waiting: Some(0.0),
                kv_usage: Some(0.9)
            }
        );
        assert_eq!(parse("up 1\n"), ServerLoad::default());
    }

    #[test]
    fn a_scrape_counts_only_while_fresh() {
        let o = Observed::default();
        assert_eq!(o.fresh(Duration::from_secs(3)), (None, None));
        o.store(ServerLoad {
            running: Some(2.0),
            waiting: Some(5.0),
            kv_usage: Some(0.3),
        });
        assert_eq!(o.fresh(Duration::from_secs(3)), (Some(7), Some(0.3)));
        o.at_ms.store(now_ms() - 10_000, Ordering::Release);
        assert_eq!(o.fresh(Duration::from_secs(3)), (None, None));
    }
}
