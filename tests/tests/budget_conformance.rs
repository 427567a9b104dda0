//! One conformance suite for the budget stores, run against the in-process store and a real
//! Redis: reservation, clamping, rejection, expiry, idempotent commits, downgrade and flag
//! modes, dollar limits, GCRA rate limits and seeding. Time is passed in (`now_ms`), so every
//! case is deterministic.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::sync::Arc;

use e2e::{BudgetKind, BUDGET_STORES};
use gateway::budget::{
    BudgetStore, CommitRequest, CounterSpec, CounterState, LeaseSync, Limit, Mode, Outcome,
    RateKind, RateSpec, ReserveRequest,
};

const DAY: i64 = 86_400_000;

/// "Now" for every case: real time, because Redis expires keys by its own clock.
static NOW_MS: std::sync::LazyLock<i64> =
    std::sync::LazyLock::new(|| chrono::Utc::now().timestamp_millis());

struct Case {
    store: Arc<dyn BudgetStore>,
    tenant: String,
}

impl Case {
    fn new(kind: BudgetKind) -> Self {
        Self {
            store: kind.store(),
            tenant: format!("ten_{}", uuid::Uuid::new_v4().simple()),
        }
    }

    fn counter(
        &self,
        name: &str,
        mode: Mode,
        tokens: Option<u64>,
        micros: Option<i64>,
    ) -> CounterSpec {
        CounterSpec {
            key: format!("gw:{{{}}}:bud:{name}:0", self.tenant),
            mode,
            limit: Limit { tokens, micros },
            hard: Limit::default(),
            expire_at_ms: *NOW_MS + DAY,
        }
    }

    fn request(
        &self,
        rid: &str,
        prompt: u64,
        max_tokens: u64,
        counters: Vec<CounterSpec>,
    ) -> ReserveRequest {
        ReserveRequest {
            tenant_id: self.tenant.clone(),
            rid: rid.into(),
            now_ms: *NOW_MS,
            ttl_ms: 10_000,
            prompt_tokens: prompt,
            prompt_micros: 0,
            output_micros_per_token: 0.0,
            max_tokens,
            min_tokens: 16,
            downgraded: false,
            units: 1,
            lease: false,
            lease_quiet_ms: 0,
            seeded_only: false,
            counters,
            rates: vec![],
        }
    }

    fn commit(&self, rid: &str, req: &ReserveRequest, tokens: u64, micros: i64) -> CommitRequest {
        CommitRequest {
            tenant_id: self.tenant.clone(),
            rid: rid.into(),
            now_ms: req.now_ms,
            dedupe_ms: 60_000,
            unreserved: false,
            tokens,
            micros,
            counters: req.counter_keys(),
            refunds: vec![],
            lease: None,
        }
    }

    /// A lease of `tokens` on `counters`, and a settlement of it.
    fn lease(&self, rid: &str, tokens: u64, counters: Vec<CounterSpec>) -> ReserveRequest {
        let mut r = self.request(rid, tokens, 0, counters);
        r.min_tokens = 0;
        r.lease = true;
        r
    }

    fn settle(&self, lease: &ReserveRequest, sync: LeaseSync) -> CommitRequest {
        let mut c = self.commit(&lease.rid, lease, 0, 0);
        c.lease = Some(sync);
        c
    }

    /// Apply settlements in order; whether each changed anything.
    async fn settles(&self, lease: &ReserveRequest, syncs: &[LeaseSync]) -> Vec<bool> {
        let mut out = Vec::new();
        for s in syncs {
            out.push(self.store.commit(&self.settle(lease, *s)).await.unwrap());
        }
        out
    }

    async fn peek(&self, c: &CounterSpec, now: i64) -> CounterState {
        self.store
            .peek(&self.tenant, std::slice::from_ref(&c.key), now)
            .await
            .unwrap()[0]
    }
}

fn granted(o: &Outcome) -> u64 {
    match o {
        Outcome::Admitted { max_tokens, .. } => *max_tokens,
        other => panic!("expected admission, got {other:?}"),
    }
}

async fn reserve_clamp_commit_release(kind: BudgetKind) {
    let c = Case::new(kind);
    let budget = c.counter("b", Mode::Enforce, Some(1000), None);
    let r1 = c.request("r1", 100, 500, vec![budget.clone()]);
    assert_eq!(
        granted(&c.store.reserve(&r1).await.unwrap()),
        500,
        "{kind:?}"
    );
    let s = c.peek(&budget, *NOW_MS).await;
    assert_eq!((s.reserved_tokens, s.spent_tokens), (600, 0), "{kind:?}");
    // 400 left: a request for 100 + 1000 is clamped to 300 completion tokens.
    let r2 = c.request("r2", 100, 1000, vec![budget.clone()]);
    assert_eq!(
        granted(&c.store.reserve(&r2).await.unwrap()),
        300,
        "{kind:?}"
    );
    // Nothing left: refused, and nothing is reserved for it.
    let r3 = c.request("r3", 10, 100, vec![budget.clone()]);
    assert!(
        matches!(
            c.store.reserve(&r3).await.unwrap(),
            Outcome::Rejected { index: 0, .. }
        ),
        "{kind:?}"
    );
    // Commit r1's actual use (100 prompt + 50 completion): its other 450 tokens come back.
    assert!(c.store.commit(&c.commit("r1", &r1, 150, 0)).await.unwrap());
    let s = c.peek(&budget, *NOW_MS).await;
    assert_eq!((s.spent_tokens, s.reserved_tokens), (150, 400), "{kind:?}");
    // A repeated commit is a no-op.
    assert!(
        !c.store.commit(&c.commit("r1", &r1, 150, 0)).await.unwrap(),
        "{kind:?}"
    );
    assert_eq!(c.peek(&budget, *NOW_MS).await.spent_tokens, 150, "{kind:?}");
    assert_eq!(
        granted(&c.store.reserve(&r3).await.unwrap()),
        100,
        "{kind:?}"
    );
}

async fn concurrent_reservations_never_exceed_the_limit(kind: BudgetKind) {
    let c = Arc::new(Case::new(kind));
    // 50 requests' worth: each needs 10 prompt + 90 completion tokens.
    let budget = c.counter("b", Mode::Enforce, Some(5000), None);
    let tasks: Vec<_> = (0..500)
        .map(|i| {
            let c = Arc::clone(&c);
            let budget = budget.clone();
            tokio::spawn(async move {
                let mut req = c.request(&format!("r{i}"), 10, 90, vec![budget]);
                req.min_tokens = 90; // no clamping: all or nothing
                c.store.reserve(&req).await.unwrap()
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        if let Outcome::Admitted { max_tokens, .. } = t.await.unwrap() {
            assert_eq!(max_tokens, 90);
            admitted += 1;
        }
    }
    assert_eq!(admitted, 50, "{kind:?}");
    assert_eq!(
        c.peek(&budget, *NOW_MS).await.reserved_tokens,
        5000,
        "{kind:?}"
    );
}

async fn reservations_expire(kind: BudgetKind) {
    let c = Case::new(kind);
    let budget = c.counter("b", Mode::Enforce, Some(1000), None);
    let r = c.request("dead", 100, 900, vec![budget.clone()]);
    granted(&c.store.reserve(&r).await.unwrap());
    assert_eq!(
        c.peek(&budget, *NOW_MS + 9_999).await.reserved_tokens,
        1000,
        "{kind:?}"
    );
    assert_eq!(
        c.peek(&budget, *NOW_MS + 10_000).await.reserved_tokens,
        0,
        "{kind:?}"
    );
    // The budget is whole again for a new request at that time.
    let mut again = c.request("next", 100, 900, vec![budget.clone()]);
    again.now_ms = *NOW_MS + 10_001;
    assert_eq!(
        granted(&c.store.reserve(&again).await.unwrap()),
        900,
        "{kind:?}"
    );
    // A late commit of the expired reservation still counts what was spent, once.
    assert!(c.store.commit(&c.commit("dead", &r, 120, 0)).await.unwrap());
    let s = c.peek(&budget, *NOW_MS + 10_001).await;
    assert_eq!((s.spent_tokens, s.reserved_tokens), (120, 1000), "{kind:?}");
    assert!(
        !c.store.commit(&c.commit("dead", &r, 120, 0)).await.unwrap(),
        "{kind:?}"
    );
    assert_eq!(
        c.peek(&budget, *NOW_MS + 10_001).await.spent_tokens,
        120,
        "{kind:?}"
    );
}

async fn unreserved_commits_apply_once(kind: BudgetKind) {
    let c = Case::new(kind);
    let budget = c.counter("b", Mode::Enforce, Some(1000), None);
    let r = c.request("local", 0, 0, vec![budget.clone()]);
    let mut commit = c.commit("local", &r, 300, 7);
    commit.unreserved = true;
    assert!(c.store.commit(&commit).await.unwrap(), "{kind:?}");
    assert!(
        !c.store.commit(&commit).await.unwrap(),
        "{kind:?}: a replay is a no-op"
    );
    let s = c.peek(&budget, *NOW_MS).await;
    assert_eq!(
        (s.spent_tokens, s.spent_micros, s.reserved_tokens),
        (300, 7, 0),
        "{kind:?}"
    );
    // A reserved commit for a request that never reserved here changes nothing.
    let ghost = c.commit("ghost", &r, 50, 0);
    assert!(!c.store.commit(&ghost).await.unwrap(), "{kind:?}");
    assert_eq!(c.peek(&budget, *NOW_MS).await.spent_tokens, 300, "{kind:?}");
}

async fn dollar_limits_clamp_by_price(kind: BudgetKind) {
    let c = Case::new(kind);
    // $0.01 = 10_000 micros; prompt costs 1_000, output 30 micros/token → 300 tokens fit.
    let budget = c.counter("usd", Mode::Enforce, None, Some(10_000));
    let mut r = c.request("r", 100, 1000, vec![budget.clone()]);
    r.prompt_micros = 1_000;
    r.output_micros_per_token = 30.0;
    assert_eq!(
        granted(&c.store.reserve(&r).await.unwrap()),
        300,
        "{kind:?}"
    );
    assert_eq!(
        c.peek(&budget, *NOW_MS).await.reserved_micros,
        10_000,
        "{kind:?}"
    );
    let mut r2 = c.request("r2", 1, 100, vec![budget.clone()]);
    r2.prompt_micros = 1;
    r2.output_micros_per_token = 30.0;
    assert!(
        matches!(
            c.store.reserve(&r2).await.unwrap(),
            Outcome::Rejected { .. }
        ),
        "{kind:?}"
    );
}

async fn downgrade_and_flag_modes(kind: BudgetKind) {
    let c = Case::new(kind);
    let mut soft = c.counter("soft", Mode::Downgrade, Some(1000), None);
    soft.hard = Limit {
        tokens: Some(1500),
        micros: None,
    };
    let flag = c.counter("flag", Mode::Count, Some(10), None);
    let r = c.request("a", 100, 800, vec![soft.clone(), flag.clone()]);
    // Fits under the soft limit; the flag counter never refuses (it is already over 10).
    assert_eq!(
        granted(&c.store.reserve(&r).await.unwrap()),
        800,
        "{kind:?}"
    );
    let r2 = c.request("b", 100, 800, vec![soft.clone(), flag.clone()]);
    assert_eq!(
        c.store.reserve(&r2).await.unwrap(),
        Outcome::Downgrade { index: 0 },
        "{kind:?}"
    );
    let mut r2d = r2.clone();
    r2d.downgraded = true;
    // Downgraded: only the hard cap (1500) applies; 900 reserved, so 1500 - 900 - 100 = 500 fit.
    assert_eq!(
        granted(&c.store.reserve(&r2d).await.unwrap()),
        500,
        "{kind:?}"
    );
    let mut r3 = c.request("c", 100, 800, vec![soft.clone(), flag.clone()]);
    r3.downgraded = true;
    assert!(
        matches!(
            c.store.reserve(&r3).await.unwrap(),
            Outcome::Rejected { index: 0, .. }
        ),
        "{kind:?}"
    );
    assert_eq!(
        c.peek(&flag, *NOW_MS).await.reserved_tokens,
        1500,
        "{kind:?}"
    );
}

async fn rate_limits_are_smooth(kind: BudgetKind) {
    let c = Case::new(kind);
    let rpm = RateSpec {
        key: format!("gw:{{{}}}:rl:tenant:rpm", c.tenant).into(),
        per_minute: 3,
        kind: RateKind::Requests,
    };
    let mut req = c.request("x", 10, 20, vec![]);
    req.rates = vec![rpm.clone()];
    for i in 0..3 {
        req.rid = format!("x{i}");
        granted(&c.store.reserve(&req).await.unwrap());
    }
    req.rid = "x3".into();
    match c.store.reserve(&req).await.unwrap() {
        // One request every 20 s; the burst (3) is used up.
        Outcome::RateLimited {
            index: 0,
            retry_after_ms,
        } => {
            assert!(
                (19_000..=20_000).contains(&retry_after_ms),
                "{kind:?} {retry_after_ms}"
            )
        }
        other => panic!("{kind:?}: {other:?}"),
    }
    req.now_ms = *NOW_MS + 20_000;
    granted(&c.store.reserve(&req).await.unwrap());

    // Tokens per minute: a request is charged prompt + max_tokens and clamped to one minute's
    // worth; the unused part is given back at commit.
    let tpm = RateSpec {
        key: format!("gw:{{{}}}:rl:tenant:tpm", c.tenant).into(),
        per_minute: 1000,
        kind: RateKind::Tokens,
    };
    let mut t = c.request("t1", 100, 5000, vec![]);
    t.rates = vec![tpm.clone()];
    assert_eq!(
        granted(&c.store.reserve(&t).await.unwrap()),
        900,
        "{kind:?}"
    );
    t.rid = "t2".into();
    t.max_tokens = 100;
    assert!(
        matches!(
            c.store.reserve(&t).await.unwrap(),
            Outcome::RateLimited { .. }
        ),
        "{kind:?}"
    );
    let mut commit = c.commit("t1", &t, 150, 0);
    commit.refunds = vec![(tpm.key.clone(), 1000, 850)];
    assert!(c.store.commit(&commit).await.unwrap());
    assert_eq!(
        granted(&c.store.reserve(&t).await.unwrap()),
        100,
        "{kind:?}"
    );
}

async fn seeding_only_fills_missing_counters(kind: BudgetKind) {
    let c = Case::new(kind);
    let budget = c.counter("b", Mode::Enforce, Some(1000), None);
    assert!(c
        .store
        .seed(&c.tenant, &budget.key, 700, 5, *NOW_MS + DAY)
        .await
        .unwrap());
    assert!(
        !c.store
            .seed(&c.tenant, &budget.key, 1, 1, *NOW_MS + DAY)
            .await
            .unwrap(),
        "{kind:?}"
    );
    let s = c.peek(&budget, *NOW_MS).await;
    assert_eq!((s.spent_tokens, s.spent_micros), (700, 5), "{kind:?}");
    let r = c.request("r", 100, 500, vec![budget]);
    assert_eq!(
        granted(&c.store.reserve(&r).await.unwrap()),
        200,
        "{kind:?}"
    );
}

async fn seeded_only_reservations_wait_for_the_ledger_seed(kind: BudgetKind) {
    let c = Case::new(kind);
    let budget = c.counter("b", Mode::Enforce, Some(1000), None);
    let mut r = c.request("r1", 100, 500, vec![budget.clone()]);
    r.seeded_only = true;
    // A counter never seeded (a new window, or one the store lost) admits nothing.
    assert!(
        matches!(
            c.store.reserve(&r).await.unwrap(),
            Outcome::Unseeded { index: 0 }
        ),
        "{kind:?}"
    );
    // Spend committed while it was unseeded (a request reserved before a loss) is kept: the
    // seed takes the larger of that and the ledger's total, never their sum.
    let mut late = c.commit("late", &r, 300, 3);
    late.unreserved = true;
    assert!(c.store.commit(&late).await.unwrap());
    assert!(
        matches!(c.store.reserve(&r).await.unwrap(), Outcome::Unseeded { .. }),
        "{kind:?}: a commit does not seed"
    );
    assert!(c
        .store
        .seed(&c.tenant, &budget.key, 200, 2, *NOW_MS + DAY)
        .await
        .unwrap());
    let s = c.peek(&budget, *NOW_MS).await;
    assert_eq!((s.spent_tokens, s.spent_micros), (300, 3), "{kind:?}");
    assert_eq!(
        granted(&c.store.reserve(&r).await.unwrap()),
        500,
        "{kind:?}"
    );
    let seeded_again = c
        .store
        .seed(&c.tenant, &budget.key, 900, 9, *NOW_MS + DAY)
        .await
        .unwrap();
    assert!(!seeded_again, "{kind:?}: seeded once");
    let mut bigger = c.request("r2", 100, 500, vec![budget.clone()]);
    bigger.seeded_only = true;
    // 300 spent + 600 reserved by r1: 100 left for r2's prompt, nothing for its output.
    assert!(
        matches!(
            c.store.reserve(&bigger).await.unwrap(),
            Outcome::Rejected { .. }
        ),
        "{kind:?}"
    );
}

async fn leases_settle_in_running_totals_once(kind: BudgetKind) {
    let c = Case::new(kind);
    let budget = c.counter("b", Mode::Enforce, Some(10_000), Some(1_000_000));
    let lease = c.lease("lease:a", 4_000, vec![budget.clone()]);
    granted(&c.store.reserve(&lease).await.unwrap());
    let s = c.peek(&budget, *NOW_MS).await;
    assert_eq!(
        (s.reserved_tokens, s.leased_tokens),
        (4_000, 4_000),
        "{kind:?}"
    );
    // A request of its own still sees the lease's hold as taken.
    let r = c.request("r", 100, 9_000, vec![budget.clone()]);
    assert_eq!(
        granted(&c.store.reserve(&r).await.unwrap()),
        5_900,
        "{kind:?}"
    );
    assert!(c.store.commit(&c.commit("r", &r, 6_000, 0)).await.unwrap());
    // Spent 1,000 so far: it moves from the hold to spent.
    let first = LeaseSync {
        spent_tokens: 1_000,
        spent_micros: 10,
        released_tokens: 1_000,
        released_micros: 0,
        close: false,
    };
    assert_eq!(c.settles(&lease, &[first]).await, [true], "{kind:?}");
    assert_eq!(
        lease_view(&c, &budget).await,
        (7_000, 10, 3_000, 3_000),
        "{kind:?}"
    );
    // Replayed, or arriving after a later one: nothing changes.
    assert_eq!(c.settles(&lease, &[first]).await, [false], "{kind:?}");
    let second = LeaseSync {
        spent_tokens: 2_500,
        released_tokens: 3_500,
        ..first
    };
    assert_eq!(
        c.settles(&lease, &[second, first]).await,
        [true, false],
        "{kind:?}"
    );
    let s = c.peek(&budget, *NOW_MS).await;
    assert_eq!(
        (s.spent_tokens, s.reserved_tokens, s.leased_tokens),
        (8_500, 500, 500),
        "{kind:?}"
    );
    // Closing releases what is left, once.
    let close = LeaseSync {
        spent_tokens: 2_800,
        close: true,
        ..second
    };
    assert_eq!(
        c.settles(&lease, &[close, close, second]).await,
        [true, false, false],
        "{kind:?}"
    );
    assert_eq!(lease_view(&c, &budget).await, (8_800, 10, 0, 0), "{kind:?}");
}

/// Spent tokens and micro-dollars, reserved and lease-held tokens of a counter, now.
async fn lease_view(c: &Case, counter: &CounterSpec) -> (u64, i64, u64, u64) {
    let s = c.peek(counter, *NOW_MS).await;
    (
        s.spent_tokens,
        s.spent_micros,
        s.reserved_tokens,
        s.leased_tokens,
    )
}

/// Reserve `req` (under fresh ids) until a rate limiter refuses it; how many were admitted.
async fn admitted_in_a_row(c: &Case, req: &mut ReserveRequest, prefix: &str) -> usize {
    for i in 0..1000 {
        req.rid = format!("{prefix}{i}");
        match c.store.reserve(req).await.unwrap() {
            Outcome::Admitted { .. } => {}
            Outcome::RateLimited { .. } => return i,
            other => panic!("{other:?}"),
        }
    }
    1000
}

async fn expired_leases_release_and_still_count_their_spend(kind: BudgetKind) {
    let c = Case::new(kind);
    let budget = c.counter("b", Mode::Enforce, Some(10_000), None);
    let rpm = RateSpec {
        key: format!("gw:{{{}}}:rl:tenant:rpm", c.tenant).into(),
        per_minute: 60,
        kind: RateKind::Requests,
    };
    let mut lease = c.lease("lease:b", 2_000, vec![budget.clone()]);
    lease.units = 30;
    lease.rates = vec![rpm.clone()];
    granted(&c.store.reserve(&lease).await.unwrap());
    // Thirty requests' worth of a 60-per-minute limiter are taken: only thirty more now.
    let mut one = c.request("one", 0, 0, vec![]);
    one.rates = vec![rpm.clone()];
    one.min_tokens = 0;
    assert_eq!(admitted_in_a_row(&c, &mut one, "r").await, 30, "{kind:?}");
    let s = c.peek(&budget, *NOW_MS + 10_000).await;
    assert_eq!(
        (s.reserved_tokens, s.leased_tokens),
        (0, 0),
        "{kind:?}: expired"
    );
    let sync = LeaseSync {
        spent_tokens: 700,
        released_tokens: 700,
        ..Default::default()
    };
    let mut late = c.settle(&lease, sync);
    late.now_ms = *NOW_MS + 10_000;
    assert!(c.store.commit(&late).await.unwrap(), "{kind:?}");
    // The close gives back the 25 request units the lease did not use.
    let mut close = c.settle(
        &lease,
        LeaseSync {
            close: true,
            ..sync
        },
    );
    close.refunds = vec![(rpm.key.clone(), 60, 25)];
    assert!(c.store.commit(&close).await.unwrap(), "{kind:?}");
    let s = c.peek(&budget, *NOW_MS + 10_000).await;
    assert_eq!((s.spent_tokens, s.reserved_tokens), (700, 0), "{kind:?}");
    assert_eq!(admitted_in_a_row(&c, &mut one, "s").await, 25, "{kind:?}");
}

async fn rate_limit_leases_give_units_back_once(kind: BudgetKind) {
    let c = Case::new(kind);
    let rpm = RateSpec {
        key: format!("gw:{{{}}}:rl:tenant:rpm", c.tenant).into(),
        per_minute: 60,
        kind: RateKind::Requests,
    };
    let mut one = c.request("one", 0, 0, vec![]);
    one.rates = vec![rpm.clone()];
    one.min_tokens = 0;
    match c.store.reserve(&one).await.unwrap() {
        Outcome::Admitted { rate_room, .. } => assert_eq!(rate_room, [59], "{kind:?}"),
        other => panic!("{other:?}"),
    }
    // A lease of rate limits alone (no budget counter) takes 40 units.
    let mut lease = c.lease("lease:r", 0, vec![]);
    lease.units = 40;
    lease.rates = vec![rpm.clone()];
    match c.store.reserve(&lease).await.unwrap() {
        Outcome::Admitted { rate_room, .. } => assert_eq!(rate_room, [19], "{kind:?}"),
        other => panic!("{other:?}"),
    }
    // A close for a lease that was never made (its grant timed out before it ran) is a no-op.
    let mut ghost = c.settle(
        &c.lease("lease:ghost", 0, vec![]),
        LeaseSync {
            close: true,
            ..LeaseSync::default()
        },
    );
    ghost.refunds = vec![(rpm.key.clone(), 60, 40)];
    assert!(!c.store.commit(&ghost).await.unwrap(), "{kind:?}");
    // The real close gives its 39 unused units back, once.
    let mut close = c.settle(
        &lease,
        LeaseSync {
            close: true,
            ..LeaseSync::default()
        },
    );
    close.refunds = vec![(rpm.key.clone(), 60, 39)];
    assert!(c.store.commit(&close).await.unwrap(), "{kind:?}");
    assert!(!c.store.commit(&close).await.unwrap(), "{kind:?}");
    assert_eq!(admitted_in_a_row(&c, &mut one, "q").await, 58, "{kind:?}");
}

async fn a_refusal_while_leases_hold_room_stops_new_leases(kind: BudgetKind) {
    let c = Case::new(kind);
    let budget = c.counter("b", Mode::Enforce, Some(1_000), None);
    let lease = c.lease("lease:q", 600, vec![budget.clone()]);
    granted(&c.store.reserve(&lease).await.unwrap());
    let mut big = c.request("big", 100, 500, vec![budget.clone()]);
    big.min_tokens = 400;
    big.lease_quiet_ms = 500;
    match c.store.reserve(&big).await.unwrap() {
        Outcome::Rejected { counters, .. } => assert_eq!(counters[0].leased_tokens, 600),
        other => panic!("{kind:?}: {other:?}"),
    }
    // While quiet, no lease; a request of its own still fits what is free.
    let second = c.lease("lease:q2", 100, vec![budget.clone()]);
    assert!(
        matches!(
            c.store.reserve(&second).await.unwrap(),
            Outcome::Rejected { .. }
        ),
        "{kind:?}"
    );
    granted(
        &c.store
            .reserve(&c.request("small", 50, 50, vec![budget.clone()]))
            .await
            .unwrap(),
    );
    // The lease closes and gives its room back; the big request then fits.
    assert_eq!(
        c.settles(
            &lease,
            &[LeaseSync {
                close: true,
                ..LeaseSync::default()
            }]
        )
        .await,
        [true],
        "{kind:?}"
    );
    big.rid = "big2".into();
    assert_eq!(
        granted(&c.store.reserve(&big).await.unwrap()),
        500,
        "{kind:?}"
    );
    // After the quiet period leases are granted again.
    let mut later = c.lease("lease:q3", 100, vec![budget.clone()]);
    later.now_ms = *NOW_MS + 501;
    granted(&c.store.reserve(&later).await.unwrap());
}

macro_rules! both {
    ($($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                for kind in BUDGET_STORES {
                    super::$name(kind).await;
                }
            }
        )*
    };
}

mod conformance {
    use super::BUDGET_STORES;
    both!(
        reserve_clamp_commit_release,
        concurrent_reservations_never_exceed_the_limit,
        reservations_expire,
        dollar_limits_clamp_by_price,
        downgrade_and_flag_modes,
        rate_limits_are_smooth,
        seeding_only_fills_missing_counters,
        seeded_only_reservations_wait_for_the_ledger_seed,
        unreserved_commits_apply_once,
        leases_settle_in_running_totals_once,
        expired_leases_release_and_still_count_their_spend,
        rate_limit_leases_give_units_back_once,
        a_refusal_while_leases_hold_room_stops_new_leases,
    );
}
