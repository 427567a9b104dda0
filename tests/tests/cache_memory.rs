//! The exact cache's bound (`cache.max_bytes`) counts what its answers hold in memory: the map
//! of real answers is filled and the heap it holds, counted by a counting allocator, is set
//! against what the cache says it weighs. An answer of a few hundred bytes holds about twice
//! its length (the map's node, the entry's allocations), which a count of the body alone would
//! leave out: a 256 MB bound would then hold ~450 MB.

// A counting global allocator is an `unsafe impl` (each call handed to `System` unchanged).
#![allow(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gateway::cache::{exact_layer, Entry};
use gateway::openai::Usage;

struct Counting;

/// Bytes allocated and not yet freed, by every thread.
static LIVE: AtomicI64 = AtomicI64::new(0);

fn grew(by: usize) {
    LIVE.fetch_add(i64::try_from(by).unwrap_or(i64::MAX), Ordering::Relaxed);
}

fn shrank(by: usize) {
    LIVE.fetch_sub(i64::try_from(by).unwrap_or(i64::MAX), Ordering::Relaxed);
}

// SAFETY: every call is passed to `System` unchanged; counting touches only an atomic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        shrank(layout.size());
        grew(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrank(layout.size());
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn the_exact_cache_counts_what_its_answers_hold_in_memory() {
    for body_len in [120, 600, 4_000] {
        let cache = exact_layer(1 << 40);
        cache.run_pending_tasks();
        let body = vec![b'x'; body_len];
        let before = LIVE.load(Ordering::Relaxed);
        let n: u64 = 20_000;
        for i in 0..n {
            let entry = Entry {
                body: bytes::Bytes::copy_from_slice(&body),
                served_model: "sim-small".to_owned(),
                tier: "small".to_owned(),
                usage: Usage::default(),
                ttl: Duration::from_secs(3600),
            };
            cache.insert(
                u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                Arc::new(entry),
            );
        }
        cache.run_pending_tasks();
        let held = LIVE.load(Ordering::Relaxed) - before;
        assert_eq!(cache.entry_count(), n, "nothing evicted");
        let counted = i64::try_from(cache.weighted_size()).unwrap();
        let ratio = counted as f64 / held as f64;
        println!(
            "body {body_len}: held {:.0} B per answer, counted {:.0} ({ratio:.3})",
            held as f64 / n as f64,
            counted as f64 / n as f64
        );
        // Counted at least what is held, with room for the allocator's rounding (this count is
        // of the bytes asked for; the gateway's allocator rounds them up by ~8%), and not so
        // much more that the bound wastes the memory it allows.
        assert!(
            (1.0..1.2).contains(&ratio),
            "body {body_len}: counted/held {ratio:.3}"
        );
        drop(cache);
    }
}
