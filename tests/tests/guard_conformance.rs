//! One conformance suite for the guard's session stores: the in-process [`MemoryGuard`], Redis
//! and Redis Cluster ([`RedisGuard`]) must answer every call alike — the window, retries, the
//! decisions written back, settlement, listing, clearing and a block's expiry.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::sync::Arc;
use std::time::Duration;

use e2e::BudgetKind;
use gateway::guard::memory::MemoryGuard;
use gateway::guard::near::{Sketch, SKETCH_DIM};
use gateway::guard::redis::RedisGuard;
use gateway::guard::store::{GuardStore, Known, Limits, LoopNote, Mark, SessionKey, Turn};

/// A store of `kind` keeping at most `max` sessions in memory, blocks lasting `block_ttl`.
fn store(kind: BudgetKind, max: u64, block_ttl: Duration) -> Arc<dyn GuardStore> {
    match kind {
        BudgetKind::Memory => {
            Arc::new(MemoryGuard::new(max, Duration::from_secs(3600)).with_block_ttl(block_ttl))
        }
        _ => Arc::new(
            RedisGuard::new(kind.redis_urls(), Duration::from_secs(2))
                .unwrap()
                .with_block_ttl(block_ttl),
        ),
    }
}

/// A tenant id no other test (or earlier run against the same Redis) uses.
fn fresh_tenant() -> String {
    format!("ten_conf_{}", uuid::Uuid::new_v4().simple())
}

const LIMITS: Limits = Limits {
    turns: 4,
    ttl_ms: 3_600_000,
};

fn turn(at_ms: i64, step: u64, request: u64) -> Turn {
    Turn {
        at_ms,
        step,
        request,
        text: false,
        answered: false,
        sketch: None,
    }
}

#[tokio::test]
async fn the_window_keeps_the_latest_turns_and_a_retry_of_an_unanswered_request_is_not_a_turn() {
    for kind in e2e::BUDGET_STORES {
        let s = store(kind, 100, Duration::from_secs(60));
        let key = SessionKey::new(&fresh_tenant(), "run-1");
        let first = s.record(&key, &turn(1_000, 11, 101), LIMITS).await.unwrap();
        assert!(
            first.window.is_empty() && !first.retry,
            "{kind:?}: {first:?}"
        );
        assert_eq!(first.state.requests, 0, "{kind:?}: the session as it was");

        // The same request again, unanswered: a client retry, not added.
        let again = s.record(&key, &turn(1_100, 11, 101), LIMITS).await.unwrap();
        assert!(again.retry, "{kind:?}");
        assert_eq!(again.window.len(), 1, "{kind:?}");
        // Answered, then sent again: a new turn (the agent repeated itself).
        s.settle(&key, 101, true, 250).await.unwrap();
        let repeat = s.record(&key, &turn(1_200, 11, 101), LIMITS).await.unwrap();
        assert!(!repeat.retry, "{kind:?}");
        assert!(
            repeat.window[0].answered,
            "{kind:?}: settle marked it answered"
        );
        assert_eq!(repeat.state.last_cost_micros, 250, "{kind:?}");

        for n in 0..5 {
            s.record(
                &key,
                &turn(2_000 + n, 20 + n as u64, 200 + n as u64),
                LIMITS,
            )
            .await
            .unwrap();
        }
        // A step unlike every earlier one ends no loop: no window comes back.
        let new = s.record(&key, &turn(2_900, 98, 998), LIMITS).await.unwrap();
        assert!(new.window.is_empty(), "{kind:?}: {new:?}");
        let seen = s.record(&key, &turn(3_000, 23, 999), LIMITS).await.unwrap();
        let steps: Vec<u64> = seen.window.iter().map(|t| t.step).collect();
        assert_eq!(
            steps,
            vec![22, 23, 24, 98],
            "{kind:?}: the latest {} turns",
            LIMITS.turns
        );
        assert_eq!(
            (
                seen.state.first_seen_ms,
                seen.state.last_seen_ms,
                seen.state.requests
            ),
            (1_000, 2_900, 9),
            "{kind:?}: retries count as requests"
        );
    }
}

#[tokio::test]
async fn a_turn_round_trips_with_its_flags_and_sketch() {
    let mut sketch = [0i8; SKETCH_DIM];
    for (i, x) in sketch.iter_mut().enumerate() {
        *x = i8::try_from(i % 255).unwrap_or(0) - 64;
    }
    for kind in e2e::BUDGET_STORES {
        let s = store(kind, 100, Duration::from_secs(60));
        let key = SessionKey::new(&fresh_tenant(), "run-sketch");
        let t = Turn {
            at_ms: 5_000,
            step: u64::MAX - 7,
            request: 0x0123_4567_89ab_cdef,
            text: true,
            answered: false,
            sketch: Some(Box::new(Sketch(sketch))),
        };
        s.record(&key, &t, LIMITS).await.unwrap();
        // The same step again (a new request), so the window comes back.
        let seen = s
            .record(&key, &turn(5_001, u64::MAX - 7, 2), LIMITS)
            .await
            .unwrap();
        assert_eq!(seen.window, vec![t], "{kind:?}");
    }
}

#[tokio::test]
async fn decisions_written_back_add_up_and_listing_is_most_recent_first() {
    for kind in e2e::BUDGET_STORES {
        let s = store(kind, 100, Duration::from_secs(60));
        let tenant = fresh_tenant();
        let key = SessionKey::new(&tenant, "run-a");
        // Marking or settling a session never seen is a no-op, not an error.
        s.mark(
            &key,
            &Mark {
                flagged: true,
                ..Mark::default()
            },
        )
        .await
        .unwrap();
        s.settle(&key, 1, true, 10).await.unwrap();
        assert!(s.get(&key).await.unwrap().is_none(), "{kind:?}");

        s.record(&key, &turn(1_000, 1, 1), LIMITS).await.unwrap();
        let note = LoopNote {
            what: "tool call `run_tests`".into(),
            repeats: 3,
            period: 1,
            at_ms: 1_000,
        };
        s.mark(
            &key,
            &Mark {
                flagged: true,
                found: Some(note.clone()),
                ..Mark::default()
            },
        )
        .await
        .unwrap();
        s.settle(&key, 1, true, 300).await.unwrap();
        for avoided in [300, 300] {
            s.mark(
                &key,
                &Mark {
                    refused: Some(avoided),
                    cooldown_until_ms: Some(61_000),
                    ..Mark::default()
                },
            )
            .await
            .unwrap();
        }
        s.settle(&key, 2, false, 0).await.unwrap();
        let info = s.get(&key).await.unwrap().unwrap();
        let st = &info.state;
        assert_eq!(
            (st.flagged, st.refused, st.avoided_micros, st.cost_micros),
            (1, 2, 600, 300),
            "{kind:?}: {st:?}"
        );
        assert_eq!(
            (st.cooldown_until_ms, st.blocked_at_ms, st.last_cost_micros),
            (61_000, 0, 300),
            "{kind:?}"
        );
        assert_eq!(st.last_loop.as_ref(), Some(&note), "{kind:?}");
        assert_eq!(info.turns, 1, "{kind:?}");

        for (n, at) in [("run-b", 3_000), ("run-c", 2_000)] {
            s.record(&SessionKey::new(&tenant, n), &turn(at, 1, 1), LIMITS)
                .await
                .unwrap();
        }
        let listed: Vec<String> = s
            .list(&tenant, 2)
            .await
            .unwrap()
            .into_iter()
            .map(|i| i.session)
            .collect();
        assert_eq!(listed, vec!["run-b", "run-c"], "{kind:?}");
        assert!(
            s.list(&fresh_tenant(), 10).await.unwrap().is_empty(),
            "{kind:?}: per tenant"
        );

        assert!(s.clear(&key).await.unwrap(), "{kind:?}");
        assert!(!s.clear(&key).await.unwrap(), "{kind:?}: cleared already");
        assert!(s.get(&key).await.unwrap().is_none(), "{kind:?}");
        let fresh = s.record(&key, &turn(4_000, 1, 1), LIMITS).await.unwrap();
        assert_eq!(fresh.state.refused, 0, "{kind:?}: cleared means forgotten");
    }
}

#[tokio::test]
async fn a_block_lasts_its_ttl_and_busy_sessions_do_not_push_it_out() {
    let ttl = Duration::from_millis(1200);
    for kind in e2e::BUDGET_STORES {
        let s = store(kind, 10, ttl);
        let tenant = fresh_tenant();
        let now = chrono::Utc::now().timestamp_millis();
        let blocked = SessionKey::new(&tenant, "run-blocked");
        s.record(&blocked, &turn(now, 1, 1), LIMITS).await.unwrap();
        let block = Mark {
            refused: Some(10),
            blocked_at_ms: Some(now),
            ..Mark::default()
        };
        s.mark(&blocked, &block).await.unwrap();
        // More sessions than the in-memory store keeps: the blocked one is kept apart.
        for n in 0..30u64 {
            let other = SessionKey::new(&tenant, &format!("busy-{n}"));
            s.record(&other, &turn(now + 1, n, n), LIMITS)
                .await
                .unwrap();
        }
        let seen = s
            .record(&blocked, &turn(now + 100, 2, 2), LIMITS)
            .await
            .unwrap();
        assert_eq!(seen.state.blocked_at_ms, now, "{kind:?}: still blocked");
        // A second block mark (another refused request) keeps the first block's time.
        s.mark(
            &blocked,
            &Mark {
                refused: Some(10),
                blocked_at_ms: Some(now + 100),
                ..Mark::default()
            },
        )
        .await
        .unwrap();
        let info = s.get(&blocked).await.unwrap().unwrap();
        assert_eq!(
            (info.state.blocked_at_ms, info.state.refused),
            (now, 2),
            "{kind:?}"
        );
        let listed = s.list(&tenant, 5).await.unwrap();
        assert!(
            listed.len() <= 5 && listed.iter().any(|i| i.session == "run-blocked"),
            "{kind:?}: {listed:?}"
        );
        tokio::time::sleep(ttl + Duration::from_millis(400)).await;
        assert!(
            s.get(&blocked).await.unwrap().is_none(),
            "{kind:?}: the block and its session expired"
        );
        let seen = s
            .record(&blocked, &turn(now + 200, 3, 3), LIMITS)
            .await
            .unwrap();
        assert_eq!(
            (seen.state.blocked_at_ms, seen.window.len()),
            (0, 0),
            "{kind:?}: the session starts afresh"
        );
    }
}

#[tokio::test]
async fn idempotency_keys_and_retry_counts_are_kept_alike() {
    for kind in e2e::BUDGET_STORES {
        let s = store(kind, 100, Duration::from_secs(60));
        let tenant = fresh_tenant();
        let now = chrono::Utc::now().timestamp_millis();
        let ttl = 400;
        assert!(!s
            .idempotency_seen(&tenant, "key_a", "req-1", now, ttl)
            .await
            .unwrap());
        assert!(
            s.idempotency_seen(&tenant, "key_a", "req-1", now + 10, ttl)
                .await
                .unwrap(),
            "{kind:?}: the same key again"
        );
        assert!(!s
            .idempotency_seen(&tenant, "key_b", "req-1", now, ttl)
            .await
            .unwrap());
        assert!(!s
            .idempotency_seen(&fresh_tenant(), "key_a", "req-1", now, ttl)
            .await
            .unwrap());
        tokio::time::sleep(Duration::from_millis(500)).await;
        let later = chrono::Utc::now().timestamp_millis();
        assert!(
            !s.idempotency_seen(&tenant, "key_a", "req-1", later, ttl)
                .await
                .unwrap(),
            "{kind:?}: forgotten after its ttl"
        );

        // Buckets 100..=109 are one window; 110 drops bucket 100.
        let counts = |tenant: String, retry: bool, slot: u64| {
            let s = &s;
            async move {
                let known = if retry { Known::Retry } else { not_failed(now) };
                let c = s.retry_counts(&tenant, known, slot, 60_000).await.unwrap();
                (c.requests, c.retries)
            }
        };
        let mut last = (0, 0);
        for (slot, retry) in [(100, false), (100, true), (105, true), (109, false)] {
            last = counts(tenant.clone(), retry, slot).await;
        }
        assert_eq!(last, (4, 2), "{kind:?}");
        assert_eq!(
            counts(tenant.clone(), false, 110).await,
            (3, 1),
            "{kind:?}: bucket 100 left the window"
        );
        assert_eq!(
            counts(tenant.clone(), true, 130).await,
            (1, 1),
            "{kind:?}: a new window"
        );
        assert_eq!(
            counts(fresh_tenant(), false, 130).await,
            (1, 0),
            "{kind:?}: per tenant"
        );
    }
}

/// A request that is no retry by the client's word, checked against error answers to "fp-x".
fn not_failed(now_ms: i64) -> Known<'static> {
    Known::IfFailed {
        key_id: "key_a",
        fingerprint: "fp-x",
        now_ms,
        ttl_ms: 400,
    }
}

#[tokio::test]
async fn a_repeat_of_a_request_that_got_an_error_answer_is_counted_as_a_retry_for_a_while() {
    for kind in e2e::BUDGET_STORES {
        let s = store(kind, 100, Duration::from_secs(60));
        let tenant = fresh_tenant();
        let now = chrono::Utc::now().timestamp_millis();
        let ask = |key_id: &'static str, fingerprint: &'static str| Known::IfFailed {
            key_id,
            fingerprint,
            now_ms: chrono::Utc::now().timestamp_millis(),
            ttl_ms: 400,
        };
        let first = s
            .retry_counts(&tenant, ask("key_a", "fp-1"), 1, 60_000)
            .await
            .unwrap();
        assert!(!first.after_error, "{kind:?}: nothing failed yet");
        s.mark_failed(&tenant, "key_a", "fp-1", now, 400)
            .await
            .unwrap();
        let again = s
            .retry_counts(&tenant, ask("key_a", "fp-1"), 1, 60_000)
            .await
            .unwrap();
        assert!(
            again.after_error,
            "{kind:?}: the same request after its error"
        );
        assert_eq!((again.requests, again.retries), (2, 1), "{kind:?}");
        for (key, fp) in [("key_b", "fp-1"), ("key_a", "fp-2")] {
            let other = s
                .retry_counts(&tenant, ask(key, fp), 1, 60_000)
                .await
                .unwrap();
            assert!(!other.after_error, "{kind:?}: {key} {fp}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let later = s
            .retry_counts(&tenant, ask("key_a", "fp-1"), 1, 60_000)
            .await
            .unwrap();
        assert!(!later.after_error, "{kind:?}: forgotten after its ttl");
    }
}

#[tokio::test]
async fn a_turn_and_its_retry_count_in_one_call_answer_as_the_two_calls_do() {
    for kind in e2e::BUDGET_STORES {
        let s = store(kind, 100, Duration::from_secs(60));
        let (apart, together) = (fresh_tenant(), fresh_tenant());
        let now = chrono::Utc::now().timestamp_millis();
        for tenant in [&apart, &together] {
            s.mark_failed(tenant, "key_a", "fp-failed", now, 60_000)
                .await
                .unwrap();
        }
        // (at, step, request, the client said it retries, fingerprint, bucket): a new turn, a
        // retry of it unanswered, the SDK's retry, a repeat of a request that got an error
        // answer, the same step again (its window comes back), a bucket past the window.
        let plan = [
            (1_000, 11, 101, false, "fp-1", 100),
            (1_100, 11, 101, false, "fp-1", 100),
            (1_200, 12, 102, true, "fp-2", 101),
            (1_300, 13, 103, false, "fp-failed", 104),
            (1_400, 11, 104, false, "fp-4", 109),
            (1_500, 14, 105, false, "fp-5", 112),
        ];
        for (at, step, request, retry, fingerprint, slot) in plan {
            let t = turn(at, step, request);
            let known = if retry {
                Known::Retry
            } else {
                Known::IfFailed {
                    key_id: "key_a",
                    fingerprint,
                    now_ms: now,
                    ttl_ms: 60_000,
                }
            };
            let seen = s
                .record(&SessionKey::new(&apart, "run"), &t, LIMITS)
                .await
                .unwrap();
            let counts = s.retry_counts(&apart, known, slot, 60_000).await.unwrap();
            let both = s
                .record_and_count(
                    &SessionKey::new(&together, "run"),
                    &t,
                    LIMITS,
                    known,
                    slot,
                    60_000,
                )
                .await
                .unwrap();
            assert_eq!(both, (seen, counts), "{kind:?}: turn {request}");
        }
        let (_, last) = s
            .record_and_count(
                &SessionKey::new(&together, "run"),
                &turn(1_600, 11, 106),
                LIMITS,
                Known::Retry,
                112,
                60_000,
            )
            .await
            .unwrap();
        assert_eq!(
            (last.requests, last.retries),
            (4, 2),
            "{kind:?}: buckets 103..=112 hold the last four requests, two of them retries"
        );
    }
}

/// On Redis a session's keys get their expiry pushed only once a tenth of the ttl has passed
/// since the last push (two calls saved on most requests): a session still lives at least its
/// ttl after its latest request, and is gone by 1.1 ttl. (The in-process store forgets a
/// session by its own clock; its ttl is the store's, tested with it.)
#[tokio::test]
async fn a_session_on_redis_lives_its_ttl_after_its_latest_request_and_no_longer() {
    const TTL: Limits = Limits {
        turns: 4,
        ttl_ms: 2_000,
    };
    for kind in [e2e::BudgetKind::Redis, e2e::BudgetKind::RedisCluster] {
        let s = store(kind, 100, Duration::from_secs(60));
        let key = SessionKey::new(&fresh_tenant(), "short");
        let start = std::time::Instant::now();
        let now = || chrono::Utc::now().timestamp_millis();
        s.record(&key, &turn(now(), 1, 1), TTL).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Within a tenth of the ttl: the expiry is not pushed by this request.
        let latest = start.elapsed();
        s.record(&key, &turn(now(), 2, 2), TTL).await.unwrap();
        tokio::time::sleep((latest + Duration::from_millis(1_900)).saturating_sub(start.elapsed()))
            .await;
        let info = s.get(&key).await.unwrap();
        assert_eq!(
            info.map(|i| (i.state.requests, i.turns)),
            Some((2, 2)),
            "{kind:?}: 1.9 s after its latest request"
        );
        tokio::time::sleep((latest + Duration::from_millis(2_400)).saturating_sub(start.elapsed()))
            .await;
        assert_eq!(
            s.get(&key).await.unwrap(),
            None,
            "{kind:?}: gone by 1.1 ttl"
        );
    }
}

/// On Redis a settle is queued: it reaches Redis with the tenant's next turn from the same
/// gateway (in that turn's call, applied before the turn is recorded) or, with no turn coming,
/// on its own moments later. Either way another gateway reading Redis sees it: at once after
/// the next turn, and within a fraction of a second without one.
#[tokio::test]
async fn a_settle_on_redis_rides_on_the_tenants_next_turn_or_goes_on_its_own_moments_later() {
    for kind in [e2e::BudgetKind::Redis, e2e::BudgetKind::RedisCluster] {
        let this = store(kind, 100, Duration::from_secs(60));
        let other = store(kind, 100, Duration::from_secs(60));
        let tenant = fresh_tenant();
        let (a, b) = (
            SessionKey::new(&tenant, "agent-a"),
            SessionKey::new(&tenant, "agent-b"),
        );
        this.record(&a, &turn(1_000, 1, 71), LIMITS).await.unwrap();
        this.record(&a, &turn(1_001, 2, 72), LIMITS).await.unwrap();

        // A settle, then the tenant's next turn (another session) at once: the settle went
        // with it, so the other gateway reads its cost without waiting. (The turn settled is
        // not the newest: its cost counts, and the newest stays unanswered.)
        this.settle(&a, 71, true, 40).await.unwrap();
        this.record_and_count(&b, &turn(1_002, 9, 90), LIMITS, Known::Retry, 1, 60_000)
            .await
            .unwrap();
        let seen = other.get(&a).await.unwrap().unwrap();
        assert_eq!(
            (seen.state.cost_micros, seen.state.last_cost_micros),
            (40, 40),
            "{kind:?}: the settle rode on the next turn"
        );
        let window = other
            .record(&a, &turn(1_003, 2, 73), LIMITS)
            .await
            .unwrap()
            .window;
        assert_eq!(
            window.iter().map(|t| t.request).collect::<Vec<_>>(),
            vec![71, 72],
            "{kind:?}"
        );
        assert!(
            !window[1].answered,
            "{kind:?}: settling an older turn leaves the newest unanswered"
        );

        // A settle with no turn after it: on its own, soon.
        this.settle(&a, 73, true, 5).await.unwrap();
        let start = std::time::Instant::now();
        loop {
            let state = other.get(&a).await.unwrap().unwrap().state;
            if state.cost_micros == 45 {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "{kind:?}: the settle never arrived: {state:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The identical request again, now answered: a new step, not a retry.
        let again = other.record(&a, &turn(1_004, 2, 73), LIMITS).await.unwrap();
        assert!(!again.retry, "{kind:?}");

        // A settle and, at once, the identical request of the same session through the same
        // gateway: the settle goes along with the turn (nothing else ran in between on this
        // test's thread) and is applied first, so the repeat is a step, not a retry.
        this.record(&a, &turn(1_005, 5, 80), LIMITS).await.unwrap();
        this.settle(&a, 80, true, 1).await.unwrap();
        let (repeat, _) = this
            .record_and_count(&a, &turn(1_006, 5, 80), LIMITS, Known::Retry, 1, 60_000)
            .await
            .unwrap();
        assert!(
            !repeat.retry && repeat.window.last().is_some_and(|t| t.answered),
            "{kind:?}: {repeat:?}"
        );
    }
}

/// An error answer's mark counts for its own ttl even when the retry budget's window is
/// shorter (the budget's state in Redis is kept while a mark may be live), and once the marks
/// have ended a new one counts again.
#[tokio::test]
async fn an_error_mark_outlives_a_short_retry_window_and_a_mark_after_the_last_one_ended_counts() {
    for kind in e2e::BUDGET_STORES {
        let s = store(kind, 100, Duration::from_secs(60));
        let tenant = fresh_tenant();
        let now = || chrono::Utc::now().timestamp_millis();
        let ask = |fingerprint: &'static str| Known::IfFailed {
            key_id: "key_a",
            fingerprint,
            now_ms: now(),
            ttl_ms: 1_500,
        };
        // A window of 100 ms: the budget's own state lasts 110 ms after a request.
        s.retry_counts(&tenant, ask("fp-0"), 1, 100).await.unwrap();
        s.mark_failed(&tenant, "key_a", "fp-1", now(), 1_500)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        let during = s.retry_counts(&tenant, ask("fp-1"), 2, 100).await.unwrap();
        assert!(during.after_error, "{kind:?}: the mark outlives the window");
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        let after = s.retry_counts(&tenant, ask("fp-1"), 3, 100).await.unwrap();
        assert!(!after.after_error, "{kind:?}: the mark ended");
        s.mark_failed(&tenant, "key_a", "fp-2", now(), 1_500)
            .await
            .unwrap();
        let again = s.retry_counts(&tenant, ask("fp-2"), 3, 100).await.unwrap();
        assert!(
            again.after_error,
            "{kind:?}: a new mark after the last one ended"
        );
    }
}

/// Session `old` of `tenant` written straight into Redis as a version before the state kept
/// what a turn is judged by wrote it: its hash's `fields` and values, and its window's `turns`.
async fn old_session(kind: BudgetKind, tenant: &str, fields: &[&str], turns: &[&Turn]) {
    let conn =
        gateway::redis_conn::RedisConn::new(kind.redis_urls(), Duration::from_secs(2)).unwrap();
    let mut c = conn.get().await.unwrap();
    let _: i64 = redis::cmd("HSET")
        .arg(format!("{{g:{tenant}}}:s:old"))
        .arg(fields)
        .query_async(&mut c)
        .await
        .unwrap();
    let mut push = redis::cmd("RPUSH");
    push.arg(format!("{{g:{tenant}}}:w:old"));
    for t in turns {
        push.arg(t.encode());
    }
    let _: i64 = push.query_async(&mut c).await.unwrap();
}

/// A session that an earlier version wrote to Redis (its state without the fields that now
/// judge a turn: the window's steps, the newest request and whether it was answered) is judged
/// from its window the first time, exactly as before, and from its state after that.
#[tokio::test]
async fn a_session_written_by_an_earlier_version_is_judged_from_its_window() {
    for kind in [e2e::BudgetKind::Redis, e2e::BudgetKind::RedisCluster] {
        let s = store(kind, 100, Duration::from_secs(60));
        let tenant = fresh_tenant();
        let key = SessionKey::new(&tenant, "old");
        let (t1, t2) = (turn(1_000, 5, 51), turn(1_001, 6, 61));
        old_session(
            kind,
            &tenant,
            &["f", "1000", "l", "1001", "n", "2"],
            &[&t1, &t2],
        )
        .await;

        // The newest request again, unanswered: a retry; its step is in the window, which
        // comes back.
        let again = s.record(&key, &turn(1_002, 6, 61), LIMITS).await.unwrap();
        assert!(again.retry, "{kind:?}: {again:?}");
        assert_eq!(again.window, vec![t1.clone(), t2.clone()], "{kind:?}");
        assert_eq!(again.state.requests, 2, "{kind:?}");
        // Answered, then sent again: a step (now judged from the state's fields).
        s.settle(&key, 61, true, 7).await.unwrap();
        let step = s.record(&key, &turn(1_003, 6, 61), LIMITS).await.unwrap();
        assert!(!step.retry, "{kind:?}");
        assert!(step.window[1].answered, "{kind:?}: {step:?}");
        // And that one, unanswered, repeated: a retry again; a new step sends no window back.
        assert!(
            s.record(&key, &turn(1_004, 6, 61), LIMITS)
                .await
                .unwrap()
                .retry
        );
        let new = s.record(&key, &turn(1_005, 9, 91), LIMITS).await.unwrap();
        assert!(!new.retry && new.window.is_empty(), "{kind:?}: {new:?}");
        let info = s.get(&key).await.unwrap().unwrap();
        assert_eq!((info.state.requests, info.turns), (6, 4), "{kind:?}");
    }
}

/// On Redis the window's list is trimmed once per few pushes, not at every push (each
/// `redis.call` costs microseconds inside a script): it holds at most 8 turns beyond those
/// kept, while every read — the window a turn gets back, the turns a listing counts — takes the
/// newest `turns`. A cost total past 2^31 micros adds up exactly (the scripts write numbers as
/// integers).
#[tokio::test]
async fn a_window_on_redis_reads_its_newest_turns_while_its_list_is_trimmed_now_and_then() {
    for kind in [e2e::BudgetKind::Redis, e2e::BudgetKind::RedisCluster] {
        let s = store(kind, 100, Duration::from_secs(60));
        let tenant = fresh_tenant();
        let key = SessionKey::new(&tenant, "long");
        let conn =
            gateway::redis_conn::RedisConn::new(kind.redis_urls(), Duration::from_secs(2)).unwrap();
        let mut c = conn.get().await.unwrap();
        let list = format!("{{g:{tenant}}}:w:long");
        let mut longest = 0;
        for n in 0..40_u64 {
            // Every turn the same step (its request differs): the window always comes back.
            let seen = s
                .record(&key, &turn(1_000 + n as i64, 7, 500 + n), LIMITS)
                .await
                .unwrap();
            let expect: Vec<u64> = (n.saturating_sub(4)..n).map(|r| 500 + r).collect();
            let got: Vec<u64> = seen.window.iter().map(|t| t.request).collect();
            assert_eq!(got, expect, "{kind:?}: turn {n}");
            s.settle(&key, 500 + n, true, 3_000_000_000).await.unwrap();
            let len: usize = redis::cmd("LLEN")
                .arg(&list)
                .query_async(&mut c)
                .await
                .unwrap();
            longest = longest.max(len);
        }
        assert!(
            (5..=12).contains(&longest),
            "{kind:?}: the list held {longest} turns"
        );
        let info = s.get(&key).await.unwrap().unwrap();
        assert_eq!(info.turns, 4, "{kind:?}");
        assert_eq!(info.state.requests, 40, "{kind:?}");
        assert_eq!(info.state.cost_micros, 120_000_000_000, "{kind:?}");
        assert_eq!(info.state.last_cost_micros, 3_000_000_000, "{kind:?}");
        // The newest was answered: its identical request is a step, and the window says so.
        let again = s.record(&key, &turn(2_000, 7, 539), LIMITS).await.unwrap();
        assert!(!again.retry, "{kind:?}");
        assert!(again.window.last().is_some_and(|t| t.answered), "{kind:?}");
    }
}

/// A settle that reaches a session an earlier version wrote (no `rq` in its state yet) is
/// applied in its window, as that version did, and the next turn reads it from there.
#[tokio::test]
async fn a_settle_of_a_session_written_by_an_earlier_version_marks_its_window() {
    for kind in [e2e::BudgetKind::Redis, e2e::BudgetKind::RedisCluster] {
        let s = store(kind, 100, Duration::from_secs(60));
        let tenant = fresh_tenant();
        let key = SessionKey::new(&tenant, "old");
        let state = ["f", "1000", "l", "1001", "n", "2", "c", "10"];
        old_session(
            kind,
            &tenant,
            &state,
            &[&turn(1_000, 5, 51), &turn(1_001, 6, 61)],
        )
        .await;
        s.settle(&key, 61, true, 7).await.unwrap();
        // Reading the session sends the tenant's queued settles first.
        let info = s.get(&key).await.unwrap().unwrap();
        assert_eq!(
            (
                info.state.cost_micros,
                info.state.last_cost_micros,
                info.turns
            ),
            (17, 7, 2),
            "{kind:?}"
        );
        // The newest turn was answered: the identical request is a step, not a retry.
        let step = s.record(&key, &turn(1_002, 6, 61), LIMITS).await.unwrap();
        assert!(!step.retry, "{kind:?}: {step:?}");
        assert!(step.window[1].answered, "{kind:?}: {step:?}");
    }
}
