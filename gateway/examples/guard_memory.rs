//! Memory the in-process guard store holds per session: fill a `MemoryGuard` with N sessions of
//! a full window (8 turns) and report the resident-set growth per session. Turns carry no
//! sketch, as with the default exact signals; with `sketches`, each has one (near-duplicates on).
//!
//! ```sh
//! cargo run --release -p gateway --example guard_memory [-- 100000 [sketches]]
//! ```

use std::time::Duration;

use gateway::guard::memory::MemoryGuard;
use gateway::guard::near::{Sketch, SKETCH_DIM};
use gateway::guard::store::{GuardStore, Limits, SessionKey, Turn};

/// Resident set size of this process, bytes (Linux).
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100_000);
    let sketches = std::env::args().nth(2).as_deref() == Some("sketches");
    let turns = 8;
    let store = MemoryGuard::new(n, Duration::from_secs(3600));
    let limits = Limits {
        turns,
        ttl_ms: 3_600_000,
    };
    let before = rss();
    for i in 0..n {
        // Session ids as an agent framework mints them (a uuid's length).
        let key = SessionKey::new(
            "ten_0123456789abcdef0123456789abcdef",
            &format!("run-{i:032x}"),
        );
        for t in 0..turns as u64 {
            let mut sketch = [0i8; SKETCH_DIM];
            sketch[(t as usize) % SKETCH_DIM] = 127;
            let turn = Turn {
                at_ms: 1_764_547_200_000 + t as i64,
                step: i ^ t,
                request: i.wrapping_mul(31) ^ t,
                text: true,
                answered: false,
                sketch: sketches.then(|| Box::new(Sketch(sketch))),
            };
            let _ = store.record(&key, &turn, limits).await;
        }
    }
    let after = rss();
    let per = (after.saturating_sub(before)) as f64 / n as f64;
    println!(
        "{n} sessions x {turns} turns ({}): RSS +{:.1} MiB, {:.0} bytes per session",
        if sketches {
            "with sketches"
        } else {
            "exact signals, no sketch"
        },
        (after.saturating_sub(before)) as f64 / (1 << 20) as f64,
        per
    );
}
