//! Leases: with the shared (Redis) store, a replica reserves room for many requests in one call
//! and admits them locally, so Redis leaves the per-request path while the hold stays exact.
//!
//! A lease is an ordinary reservation in the shared store (rid `lease:…`, counted as lease-held
//! in every counter it touches) sized for up to `budgets.lease_requests` requests like the one
//! that asked for it, and never more than an eighth of the room left in any limit it touches
//! (so near a limit leases stop and requests are reserved one by one, exactly as without
//! leases). Requests admitted from it hold their `prompt estimate + max_tokens` locally; what
//! they actually spend is settled with the store every quarter of `budgets.lease_ms` as running
//! totals (a late or replayed settlement changes nothing). After `lease_ms`, or when a request
//! does not fit, the lease stops admitting, gives back all it holds except what its requests in
//! flight reserved, and closes once they finish. A gateway that dies loses at most the spend
//! settled in neither of those, and its lease expires like any reservation.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use super::{CommitRequest, CounterState, LeaseSync, Mode, Outcome, RateKind, ReserveRequest};

/// A lease holds at most `1 / ROOM_SHARE` of what is left of any limit it touches.
const ROOM_SHARE: u64 = 8;
/// A lease smaller than this many requests is not worth taking.
const MIN_REQUESTS: u64 = 2;
/// A slot unused for this long is forgotten, ms.
const SLOT_IDLE_MS: i64 = 60_000;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Room left under the limits of one reservation's counters (the least over them; `None`:
/// unlimited), as last seen in a reply of the shared store.
#[derive(Debug, Clone, Default)]
struct Room {
    tokens: Option<u64>,
    micros: Option<i64>,
    /// Each rate limiter's room (units), when an admission showed it.
    rates: Option<Vec<u64>>,
}

impl Room {
    fn of(req: &ReserveRequest, states: &[CounterState], rates: Option<&[u64]>) -> Self {
        let mut room = Self {
            rates: rates.map(<[u64]>::to_vec),
            ..Self::default()
        };
        for (spec, s) in req.counters.iter().zip(states) {
            let limit = match spec.mode {
                Mode::Count => continue,
                Mode::Enforce => spec.limit,
                Mode::Downgrade if req.downgraded => spec.hard,
                Mode::Downgrade => spec.limit,
            };
            let (tokens, micros) = s.remaining(&limit);
            if let Some(left) = tokens {
                room.tokens = Some(room.tokens.map_or(left, |r| r.min(left)));
            }
            if let Some(left) = micros {
                room.micros = Some(room.micros.map_or(left, |r| r.min(left)));
            }
        }
        room
    }
}

/// What one request needs from a lease.
#[derive(Debug, Clone, Copy)]
pub struct Need {
    /// Prompt estimate plus `max_tokens`.
    pub tokens: u64,
    /// Their price.
    pub micros: i64,
}

impl Need {
    /// What `req` reserves when granted its whole `max_tokens`.
    pub fn of(req: &ReserveRequest) -> Self {
        Self {
            tokens: req.prompt_tokens + req.max_tokens,
            micros: req.micros_for(req.max_tokens),
        }
    }
}

#[derive(Debug, Default)]
struct LeaseState {
    closed: bool,
    admitted: u64,
    inflight: u64,
    inflight_tokens: u64,
    inflight_micros: i64,
    spent_tokens: u64,
    spent_micros: i64,
    /// The last settlement handed out.
    sent: Option<LeaseSync>,
}

/// One lease of this replica.
#[derive(Debug)]
pub struct Lease {
    rid: String,
    tenant_id: String,
    counters: Vec<(String, i64)>,
    rates: Vec<(std::sync::Arc<str>, u64, RateKind)>,
    open_until_ms: i64,
    /// Counter states right after the lease was granted (its whole hold counted as reserved).
    base: Vec<CounterState>,
    hold_tokens: u64,
    hold_micros: i64,
    units: u64,
    /// When the shared store forgets the lease (and its requests must have ended), ms.
    expires_ms: i64,
    st: Mutex<LeaseState>,
}

impl Lease {
    /// Admit a request needing `need` if the lease is open and has room; returns the counter
    /// states as this replica now sees them (for the response headers).
    fn take(&self, need: Need, now_ms: i64) -> Option<Vec<CounterState>> {
        let mut st = lock(&self.st);
        if st.closed {
            return None;
        }
        let free_t = self
            .hold_tokens
            .saturating_sub(st.inflight_tokens + st.spent_tokens);
        let free_m = self.hold_micros - st.inflight_micros - st.spent_micros;
        if now_ms >= self.open_until_ms || st.admitted >= self.units {
            st.closed = true;
            return None;
        }
        if free_t < need.tokens || free_m < need.micros {
            // Too big for what is left (a larger request, or the lease is used up): the caller
            // takes a new lease or reserves on its own; smaller requests may still fit here.
            return None;
        }
        st.admitted += 1;
        st.closed = st.admitted >= self.units;
        st.inflight += 1;
        st.inflight_tokens += need.tokens;
        st.inflight_micros += need.micros;
        let (unused_t, unused_m) = (free_t - need.tokens, free_m - need.micros);
        Some(
            self.base
                .iter()
                .map(|s| CounterState {
                    reserved_tokens: s.reserved_tokens.saturating_sub(unused_t),
                    reserved_micros: s.reserved_micros - unused_m,
                    ..*s
                })
                .collect(),
        )
    }

    /// A request admitted from this lease finished having spent `tokens` / `micros`.
    pub fn finish(&self, need: Need, tokens: u64, micros: i64) {
        let mut st = lock(&self.st);
        st.inflight = st.inflight.saturating_sub(1);
        st.inflight_tokens = st.inflight_tokens.saturating_sub(need.tokens);
        st.inflight_micros -= need.micros;
        st.spent_tokens += tokens;
        st.spent_micros += micros;
    }

    fn close(&self) {
        lock(&self.st).closed = true;
    }

    /// The settlement due now, if anything changed since the last one; `true` with it when it
    /// closes the lease.
    fn settlement(&self, now_ms: i64) -> Option<(CommitRequest, bool)> {
        let mut st = lock(&self.st);
        if now_ms >= self.open_until_ms {
            st.closed = true;
        }
        // Past its expiry the store has let the lease go; a request still counted in flight
        // (one whose settlement never came) must not keep it open for ever.
        let close = st.closed && (st.inflight == 0 || now_ms >= self.expires_ms);
        // Spent room leaves the hold; once closed, so does everything not held by a request in
        // flight.
        let (released_tokens, released_micros) = if st.closed {
            (
                st.spent_tokens
                    .max(self.hold_tokens.saturating_sub(st.inflight_tokens)),
                st.spent_micros
                    .max(self.hold_micros - st.inflight_micros)
                    .max(0),
            )
        } else {
            (st.spent_tokens, st.spent_micros.max(0))
        };
        let sync = LeaseSync {
            spent_tokens: st.spent_tokens,
            spent_micros: st.spent_micros.max(0),
            released_tokens,
            released_micros,
            close,
        };
        if st.sent == Some(sync) || (st.sent.is_none() && sync == LeaseSync::default()) {
            return None;
        }
        st.sent = Some(sync);
        let refunds = if close {
            self.rates
                .iter()
                .map(|(key, per_minute, kind)| {
                    let unused = match kind {
                        RateKind::Requests => self.units.saturating_sub(st.admitted),
                        RateKind::Tokens => self.hold_tokens.saturating_sub(st.spent_tokens),
                    };
                    (key.clone(), *per_minute, unused)
                })
                .collect()
        } else {
            Vec::new()
        };
        Some((
            CommitRequest {
                tenant_id: self.tenant_id.clone(),
                rid: self.rid.clone(),
                now_ms,
                dedupe_ms: (self.expires_ms - now_ms).max(1),
                unreserved: false,
                tokens: 0,
                micros: 0,
                counters: self.counters.clone(),
                refunds,
                lease: Some(sync),
            },
            close,
        ))
    }
}

/// The leases of one set of counters and limiters (one tenant's policies and limits as they
/// apply to a kind of request).
#[derive(Debug, Default)]
pub struct Slot {
    /// Held while a lease is being taken, so concurrent requests wait for it instead of each
    /// taking their own.
    pub acquire: tokio::sync::Mutex<()>,
    current: Mutex<Option<Arc<Lease>>>,
    room: Mutex<Option<Room>>,
    used_ms: AtomicI64,
    /// No lease is asked for before this time (the last request for one was refused), ms.
    quiet_until_ms: AtomicI64,
}

impl Slot {
    /// Admit from the current lease, if it has room.
    pub fn take(&self, need: Need, now_ms: i64) -> Option<(Arc<Lease>, Vec<CounterState>)> {
        self.used_ms.store(now_ms, Ordering::Relaxed);
        let current = lock(&self.current).clone()?;
        let states = current.take(need, now_ms)?;
        Some((current, states))
    }

    /// Remember the room a reply of the shared store showed (sizes the next lease).
    pub fn observe(&self, req: &ReserveRequest, outcome: &Outcome) {
        let room = match outcome {
            Outcome::Admitted {
                counters,
                rate_room,
                ..
            } => Room::of(req, counters, Some(rate_room)),
            Outcome::Rejected { counters, .. } => Room::of(req, counters, None),
            Outcome::Downgrade { .. } | Outcome::RateLimited { .. } | Outcome::Unseeded { .. } => {
                self.refused(req.now_ms, 0);
                return;
            }
        };
        *lock(&self.room) = Some(room);
    }

    /// The shared store refused a lease (a limiter or a `downgrade` budget is near its limit):
    /// ask for none for a while; requests reserve one by one meanwhile.
    pub fn refused(&self, now_ms: i64, for_ms: i64) {
        self.quiet_until_ms
            .fetch_max(now_ms + for_ms, Ordering::Relaxed);
        *lock(&self.room) = None;
    }

    /// Stop admitting from the current lease (its unused room goes back at the next settlement).
    pub fn close(&self) {
        if let Some(l) = lock(&self.current).take() {
            l.close();
        }
    }
}

/// Every lease of this replica.
#[derive(Debug)]
pub struct Leases {
    per_lease: u64,
    open_ms: i64,
    slots: Mutex<crate::FastMap<String, Arc<Slot>>>,
    live: Mutex<Vec<Arc<Lease>>>,
}

impl Leases {
    /// Leases of up to `per_lease` requests that admit for `open_ms`.
    pub fn new(per_lease: u64, open_ms: u64) -> Self {
        Self {
            per_lease,
            open_ms: i64::try_from(open_ms).unwrap_or(i64::MAX / 2),
            slots: Mutex::new(crate::FastMap::default()),
            live: Mutex::new(Vec::new()),
        }
    }

    /// How often settlements are due, ms.
    pub fn tick_ms(&self) -> u64 {
        u64::try_from(self.open_ms / 4).unwrap_or(0).max(5)
    }

    /// How long a request refused while leases held room waits before asking again: every
    /// lease then open has closed and given its unused room back, ms.
    pub fn drain_ms(&self) -> i64 {
        self.open_ms + 2 * i64::try_from(self.tick_ms()).unwrap_or(0)
    }

    /// The slot of the counters and limiters `req` touches.
    pub fn slot(&self, req: &ReserveRequest) -> Arc<Slot> {
        use std::fmt::Write as _;
        // The limits are part of the identity: a changed policy starts new leases.
        let mut id = String::with_capacity(128);
        id.push_str(if req.downgraded { "d" } else { "p" });
        for c in &req.counters {
            let _ = write!(
                id,
                "|{}:{:?}:{:?}:{:?}",
                c.key, c.mode, c.limit.tokens, c.limit.micros
            );
        }
        for r in &req.rates {
            let _ = write!(id, "|{}:{}", r.key, r.per_minute);
        }
        Arc::clone(lock(&self.slots).entry(id).or_default())
    }

    /// The lease to ask for, sized from the room last seen in `slot`; `None` when too little
    /// room is left (or none was seen yet) for a lease to be worth it.
    pub fn lease_request(
        &self,
        slot: &Slot,
        req: &ReserveRequest,
        need: Need,
        lease_ttl_ms: i64,
    ) -> Option<ReserveRequest> {
        if req.now_ms < slot.quiet_until_ms.load(Ordering::Relaxed) {
            return None;
        }
        let room = lock(&slot.room).clone()?;
        let mut n = self.per_lease;
        if let Some(t) = room.tokens {
            n = n.min((t / ROOM_SHARE).checked_div(need.tokens).unwrap_or(n));
        }
        if let Some(m) = room.micros {
            let per = u64::try_from(need.micros).unwrap_or(0);
            let share = u64::try_from(m).unwrap_or(0) / ROOM_SHARE;
            n = n.min(share.checked_div(per).unwrap_or(n));
        }
        if !req.rates.is_empty() {
            // Units a limiter would still admit now, as last seen: a lease takes an eighth at
            // most, so it can only make another replica wait when the limit is nearly reached.
            let rooms = room.rates.as_ref()?;
            for (r, left) in req.rates.iter().zip(rooms) {
                let share = left / ROOM_SHARE;
                n = n.min(match r.kind {
                    RateKind::Requests => share,
                    RateKind::Tokens => share.checked_div(need.tokens).unwrap_or(n),
                });
            }
        }
        if n < MIN_REQUESTS {
            return None;
        }
        Some(ReserveRequest {
            rid: format!("lease:{}", uuid::Uuid::new_v4().simple()),
            ttl_ms: self.open_ms + lease_ttl_ms,
            prompt_tokens: need.tokens * n,
            prompt_micros: need.micros * i64::try_from(n).unwrap_or(0),
            output_micros_per_token: 0.0,
            max_tokens: 0,
            min_tokens: 0,
            units: n,
            lease: true,
            lease_quiet_ms: 0,
            seeded_only: false,
            ..req.clone()
        })
    }

    /// Install a lease the store granted as `slot`'s current one.
    pub fn install(&self, slot: &Slot, lease_req: &ReserveRequest, states: Vec<CounterState>) {
        let lease = Arc::new(Lease {
            rid: lease_req.rid.clone(),
            tenant_id: lease_req.tenant_id.clone(),
            counters: lease_req.counter_keys(),
            rates: lease_req
                .rates
                .iter()
                .map(|r| (r.key.clone(), r.per_minute, r.kind))
                .collect(),
            open_until_ms: lease_req.now_ms + self.open_ms,
            base: states,
            hold_tokens: lease_req.prompt_tokens,
            hold_micros: lease_req.prompt_micros,
            units: lease_req.units,
            expires_ms: lease_req.now_ms + lease_req.ttl_ms,
            st: Mutex::new(LeaseState::default()),
        });
        lock(&self.live).push(Arc::clone(&lease));
        if let Some(old) = lock(&slot.current).replace(lease) {
            old.close();
        }
    }

    /// The close of a lease whose grant was never answered (the call failed or timed out; it
    /// may have been made): gives back all it would hold, a no-op if it was never made.
    pub fn orphan_close(lease_req: &ReserveRequest) -> CommitRequest {
        CommitRequest {
            tenant_id: lease_req.tenant_id.clone(),
            rid: lease_req.rid.clone(),
            now_ms: lease_req.now_ms,
            dedupe_ms: lease_req.ttl_ms.max(1),
            unreserved: false,
            tokens: 0,
            micros: 0,
            counters: lease_req.counter_keys(),
            refunds: lease_req
                .rates
                .iter()
                .map(|r| {
                    let units = match r.kind {
                        RateKind::Requests => lease_req.units,
                        RateKind::Tokens => lease_req.prompt_tokens,
                    };
                    (r.key.clone(), r.per_minute, units)
                })
                .collect(),
            lease: Some(LeaseSync {
                close: true,
                ..LeaseSync::default()
            }),
        }
    }

    /// The settlements due now; closed leases leave the live list. With `all`, every lease
    /// stops admitting first (shutdown).
    pub fn settlements(&self, now_ms: i64, all: bool) -> Vec<CommitRequest> {
        let mut out = Vec::new();
        lock(&self.live).retain(|lease| {
            if all {
                lease.close();
            }
            match lease.settlement(now_ms) {
                Some((req, closed)) => {
                    out.push(req);
                    !closed
                }
                None => true,
            }
        });
        lock(&self.slots).retain(|_, slot| {
            let idle = now_ms - slot.used_ms.load(Ordering::Relaxed) > SLOT_IDLE_MS;
            if idle {
                slot.close();
            }
            !idle || Arc::strong_count(slot) > 1
        });
        out
    }

    /// Leases not yet closed.
    pub fn live(&self) -> usize {
        lock(&self.live).len()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use crate::budget::{CounterSpec, Limit};

    fn request(limit: u64) -> ReserveRequest {
        ReserveRequest {
            tenant_id: "t".into(),
            rid: "r1".into(),
            now_ms: 1_000,
            ttl_ms: 10_000,
            prompt_tokens: 10,
            prompt_micros: 10,
            output_micros_per_token: 1.0,
            max_tokens: 90,
            min_tokens: 1,
            downgraded: false,
            units: 1,
            lease: false,
            lease_quiet_ms: 0,
            seeded_only: false,
            counters: vec![CounterSpec {
                key: "gw:{t}:bud:b:0".into(),
                mode: Mode::Enforce,
                limit: Limit {
                    tokens: Some(limit),
                    micros: None,
                },
                hard: Limit::default(),
                expire_at_ms: 99_999,
            }],
            rates: vec![],
        }
    }

    fn admitted(spent: u64) -> Outcome {
        Outcome::Admitted {
            max_tokens: 90,
            counters: vec![CounterState {
                spent_tokens: spent,
                ..Default::default()
            }],
            rate_room: vec![],
        }
    }

    #[test]
    fn leases_hold_at_most_an_eighth_of_the_room_and_stop_near_the_limit() {
        let leases = Leases::new(64, 200);
        let req = request(100_000);
        let need = Need::of(&req);
        let slot = leases.slot(&req);
        assert!(
            leases.lease_request(&slot, &req, need, 5_000).is_none(),
            "no room seen yet"
        );
        slot.observe(&req, &admitted(20_000));
        let l = leases.lease_request(&slot, &req, need, 5_000);
        // 80,000 left: an eighth is 10,000 tokens = 100 requests, capped at 64.
        assert_eq!(l.as_ref().map(|l| l.units), Some(64));
        assert_eq!(l.as_ref().map(|l| l.prompt_tokens), Some(6_400));
        assert!(l
            .as_ref()
            .is_some_and(|l| l.lease && l.rid.starts_with("lease:")));
        slot.observe(&req, &admitted(99_000));
        // 1,000 left: an eighth is 125 tokens, one request: no lease.
        assert!(leases.lease_request(&slot, &req, need, 5_000).is_none());
    }

    #[test]
    fn a_lease_admits_settles_in_running_totals_and_closes_after_its_requests() {
        let leases = Leases::new(4, 200);
        let req = request(100_000);
        let need = Need::of(&req);
        let slot = leases.slot(&req);
        slot.observe(&req, &admitted(0));
        let lr = leases.lease_request(&slot, &req, need, 5_000).unwrap();
        let held = CounterState {
            reserved_tokens: lr.prompt_tokens,
            reserved_micros: lr.prompt_micros,
            leased_tokens: lr.prompt_tokens,
            leased_micros: lr.prompt_micros,
            ..Default::default()
        };
        leases.install(&slot, &lr, vec![held]);
        let (a, states) = slot.take(need, 1_010).unwrap();
        // Seen from here: the lease's unused room is not counted as reserved.
        assert_eq!(states[0].reserved_tokens, 100);
        let (b, _) = slot.take(need, 1_020).unwrap();
        a.finish(need, 60, 60);
        let sync = leases.settlements(1_050, false);
        assert_eq!(sync.len(), 1);
        let s = sync[0].lease.unwrap();
        assert_eq!(
            (s.spent_tokens, s.released_tokens, s.close),
            (60, 60, false)
        );
        assert!(leases.settlements(1_060, false).is_empty(), "nothing new");
        // Past its window the lease gives back all but what the request in flight holds.
        let sync = leases.settlements(1_300, false);
        let s = sync[0].lease.unwrap();
        assert_eq!((s.released_tokens, s.close), (400 - 100, false));
        assert!(slot.take(need, 1_300).is_none());
        b.finish(need, 100, 100);
        let sync = leases.settlements(1_310, false);
        let s = sync[0].lease.unwrap();
        assert_eq!((s.spent_tokens, s.close), (160, true));
        assert_eq!(leases.live(), 0);
    }

    #[test]
    fn a_big_request_leaves_the_lease_to_small_ones_and_a_lost_request_cannot_hold_it_open() {
        let leases = Leases::new(2, 200);
        let req = request(100_000);
        let need = Need::of(&req);
        let slot = leases.slot(&req);
        slot.observe(&req, &admitted(0));
        let lr = leases.lease_request(&slot, &req, need, 5_000).unwrap();
        leases.install(&slot, &lr, vec![CounterState::default()]);
        let big = Need {
            tokens: 10_000,
            micros: 10,
        };
        assert!(slot.take(big, 1_001).is_none());
        let (a, _) = slot.take(need, 1_002).unwrap();
        // The second request uses the last unit: the lease closes without waiting for time.
        let (_b, _) = slot.take(need, 1_003).unwrap();
        assert!(slot.take(need, 1_004).is_none());
        a.finish(need, 50, 50);
        let open: Vec<_> = leases.settlements(1_010, false);
        assert!(
            open.iter().all(|c| !c.lease.unwrap().close),
            "b is in flight"
        );
        // b never reports back; once the store has let the lease go, it closes anyway.
        let late = leases.settlements(1_000 + 200 + 5_000, false);
        assert!(late[0].lease.unwrap().close);
        assert_eq!(leases.live(), 0);
    }

    #[test]
    fn a_changed_limit_is_a_new_slot() {
        let leases = Leases::new(64, 200);
        let a = leases.slot(&request(100_000));
        let b = leases.slot(&request(50_000));
        assert!(!Arc::ptr_eq(&a, &b));
        assert!(Arc::ptr_eq(&a, &leases.slot(&request(100_000))));
    }
}
