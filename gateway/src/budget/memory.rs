//! The in-process [`BudgetStore`]: the embedded default, and the local fallback of a fail-open
//! tenant while Redis is unreachable. One mutex makes each reserve and commit atomic; the
//! arithmetic is the same as `reserve.lua` / `commit.lua` (one conformance suite checks both).

use std::collections::HashSet;
use std::sync::Mutex;

use async_trait::async_trait;

use super::{
    emission_us, fits, BudgetError, BudgetStore, CommitRequest, CounterState, LeaseSync, Mode,
    Outcome, RateKind, ReserveRequest,
};
use crate::FastMap;

/// Burst of a GCRA limiter: one minute's worth of units, µs.
const BURST_US: f64 = 60_000_000.0;
/// How often expired counters, limiters and commit markers are swept, ms.
const SWEEP_EVERY_MS: i64 = 60_000;

#[derive(Debug, Default)]
struct Counter {
    state: CounterState,
    /// Live reservations: rid → (tokens, micros, expires at ms).
    reservations: FastMap<String, (u64, i64, i64)>,
    /// Expired reservations not yet committed (a late commit still counts, once).
    expired: HashSet<String>,
    /// Per lease: the running totals of its settlements applied so far.
    settled: FastMap<String, LeaseSync>,
    /// No new lease before this time (a request was refused while leases held room), ms.
    lease_quiet_until_ms: i64,
    expire_at_ms: i64,
    /// Seeded from the ledger (see `ReserveRequest::seeded_only`).
    seeded: bool,
}

/// Whether a reservation id names a replica's lease (as `lua/common.lua` decides).
pub fn is_lease(rid: &str) -> bool {
    rid.starts_with("lease:")
}

impl Counter {
    fn purge(&mut self, now_ms: i64) {
        let state = &mut self.state;
        let expired = &mut self.expired;
        self.reservations.retain(|rid, (tokens, micros, expires)| {
            if *expires > now_ms {
                return true;
            }
            state.reserved_tokens = state.reserved_tokens.saturating_sub(*tokens);
            state.reserved_micros -= *micros;
            if is_lease(rid) {
                state.leased_tokens = state.leased_tokens.saturating_sub(*tokens);
                state.leased_micros -= *micros;
            }
            expired.insert(rid.clone());
            false
        });
    }

    /// Apply a lease settlement's growth over what was applied before; see [`LeaseSync`].
    fn settle_lease(&mut self, rid: &str, sync: &LeaseSync) -> bool {
        let live = self.reservations.contains_key(rid);
        if !live && !self.expired.contains(rid) {
            return false;
        }
        let prev = self.settled.get(rid).copied().unwrap_or_default();
        let now = LeaseSync {
            spent_tokens: prev.spent_tokens.max(sync.spent_tokens),
            spent_micros: prev.spent_micros.max(sync.spent_micros),
            released_tokens: prev.released_tokens.max(sync.released_tokens),
            released_micros: prev.released_micros.max(sync.released_micros),
            close: sync.close,
        };
        let grew = now.spent_tokens > prev.spent_tokens
            || now.spent_micros > prev.spent_micros
            || now.released_tokens > prev.released_tokens
            || now.released_micros > prev.released_micros;
        if !grew && !sync.close {
            return false;
        }
        self.state.spent_tokens += now.spent_tokens - prev.spent_tokens;
        self.state.spent_micros += now.spent_micros - prev.spent_micros;
        if let Some((held_t, held_m, _)) = self.reservations.get_mut(rid) {
            let (give_t, give_m) = if sync.close {
                (*held_t, *held_m)
            } else {
                (
                    (*held_t).min(now.released_tokens - prev.released_tokens),
                    (*held_m).min(now.released_micros - prev.released_micros),
                )
            };
            *held_t -= give_t;
            *held_m -= give_m;
            let st = &mut self.state;
            st.reserved_tokens = st.reserved_tokens.saturating_sub(give_t);
            st.leased_tokens = st.leased_tokens.saturating_sub(give_t);
            st.reserved_micros -= give_m;
            st.leased_micros -= give_m;
        }
        if sync.close {
            self.reservations.remove(rid);
            self.expired.remove(rid);
            self.settled.remove(rid);
        } else {
            self.settled.insert(rid.to_owned(), now);
        }
        true
    }

    fn spend(&mut self, req: &CommitRequest, expire_at_ms: i64) {
        self.expire_at_ms = self.expire_at_ms.max(expire_at_ms);
        self.state.spent_tokens += req.tokens;
        self.state.spent_micros += req.micros;
    }
}

/// The entry at `key` (a counter, a limiter), made with its default (and its key copied) only
/// when it is new: a request's reserve and commit find it there, and `HashMap::entry` would copy
/// the key every time.
fn slot<'a, V: Default>(map: &'a mut FastMap<String, V>, key: &str) -> &'a mut V {
    if !map.contains_key(key) {
        map.insert(key.to_owned(), V::default());
    }
    map.get_mut(key)
        .unwrap_or_else(|| unreachable!("inserted above"))
}

#[derive(Debug, Default)]
struct Inner {
    counters: FastMap<String, Counter>,
    /// GCRA theoretical arrival time (µs since the epoch) and expiry (ms) per limiter.
    rates: FastMap<String, (f64, i64)>,
    /// Unreserved commits applied → forget at (ms).
    done: FastMap<String, i64>,
    last_sweep_ms: i64,
}

impl Inner {
    fn sweep(&mut self, now_ms: i64) {
        if now_ms - self.last_sweep_ms < SWEEP_EVERY_MS {
            return;
        }
        self.last_sweep_ms = now_ms;
        self.counters.retain(|_, c| c.expire_at_ms > now_ms);
        self.rates.retain(|_, (_, expire)| *expire > now_ms);
        self.done.retain(|_, expire| *expire > now_ms);
    }

    fn state(&mut self, key: &str, now_ms: i64) -> CounterState {
        match self.counters.get_mut(key) {
            Some(c) => {
                c.purge(now_ms);
                c.state
            }
            None => CounterState::default(),
        }
    }
}

/// Counters in this process's memory.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that matters
        // more than refusing all budget checks would, so keep going with the data.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn reserve_now(&self, req: &ReserveRequest) -> Outcome {
        let mut inner = self.lock();
        inner.sweep(req.now_ms);
        if req.seeded_only {
            let unseeded = req
                .counters
                .iter()
                .position(|c| !inner.counters.get(&c.key).is_some_and(|c| c.seeded));
            if let Some(index) = unseeded {
                return Outcome::Unseeded { index };
            }
        }
        let states: Vec<CounterState> = req
            .counters
            .iter()
            .map(|c| inner.state(&c.key, req.now_ms))
            .collect();
        let min = req.min_tokens.min(req.max_tokens);
        let mut granted = req.max_tokens;
        if req.lease {
            let quiet = req.counters.iter().position(|c| {
                inner
                    .counters
                    .get(&c.key)
                    .is_some_and(|c| c.lease_quiet_until_ms > req.now_ms)
            });
            if let Some(index) = quiet {
                return Outcome::Rejected {
                    index,
                    counters: states,
                };
            }
        }
        for (index, (spec, state)) in req.counters.iter().zip(&states).enumerate() {
            let allowed = match spec.mode {
                Mode::Count => continue,
                Mode::Enforce => fits(req, state, &spec.limit),
                Mode::Downgrade if !req.downgraded => {
                    if fits(req, state, &spec.limit) != Some(req.max_tokens) {
                        return Outcome::Downgrade { index };
                    }
                    continue;
                }
                Mode::Downgrade => fits(req, state, &spec.hard),
            };
            match allowed {
                Some(m) if m >= min => granted = granted.min(m),
                _ => {
                    let leased = state.leased_tokens > 0 || state.leased_micros > 0;
                    if !req.lease && req.lease_quiet_ms > 0 && leased {
                        if let Some(c) = inner.counters.get_mut(&spec.key) {
                            c.lease_quiet_until_ms = req.now_ms + req.lease_quiet_ms;
                        }
                    }
                    return Outcome::Rejected {
                        index,
                        counters: states,
                    };
                }
            }
        }
        // A request can never take more than one minute's worth of a token limiter.
        for (index, rate) in req.rates.iter().enumerate() {
            if rate.kind == RateKind::Tokens {
                let room = rate.per_minute.saturating_sub(req.prompt_tokens);
                if room < min {
                    return Outcome::RateLimited {
                        index,
                        retry_after_ms: 60_000,
                    };
                }
                granted = granted.min(room);
            }
        }
        let now_us = req.now_ms as f64 * 1000.0;
        let mut new_tats = Vec::with_capacity(req.rates.len());
        for (index, rate) in req.rates.iter().enumerate() {
            let cost = match rate.kind {
                RateKind::Requests => req.units,
                RateKind::Tokens => req.prompt_tokens + granted,
            };
            let tat = inner
                .rates
                .get(&*rate.key)
                .map_or(now_us, |(t, _)| t.max(now_us));
            let new_tat = tat + cost as f64 * emission_us(rate.per_minute);
            if new_tat - now_us > BURST_US {
                return Outcome::RateLimited {
                    index,
                    retry_after_ms: ((new_tat - now_us - BURST_US) / 1000.0).ceil() as i64,
                };
            }
            new_tats.push(new_tat);
        }
        let mut rate_room = Vec::with_capacity(req.rates.len());
        for (rate, tat) in req.rates.iter().zip(new_tats) {
            let expire = (tat / 1000.0).ceil() as i64 + 1000;
            *slot(&mut inner.rates, &rate.key) = (tat, expire);
            rate_room
                .push(((BURST_US - (tat - now_us)) / emission_us(rate.per_minute)).floor() as u64);
        }
        if req.lease {
            inner.done.insert(
                super::marker_key(&req.tenant_id, &req.rid),
                req.now_ms + req.ttl_ms,
            );
        }
        let tokens = req.prompt_tokens + granted;
        let micros = req.micros_for(granted);
        let mut after = Vec::with_capacity(states.len());
        for spec in &req.counters {
            let c = slot(&mut inner.counters, &spec.key);
            c.expire_at_ms = c.expire_at_ms.max(spec.expire_at_ms);
            c.state.reserved_tokens += tokens;
            c.state.reserved_micros += micros;
            if req.lease {
                c.state.leased_tokens += tokens;
                c.state.leased_micros += micros;
            }
            c.reservations
                .insert(req.rid.clone(), (tokens, micros, req.now_ms + req.ttl_ms));
            after.push(c.state);
        }
        Outcome::Admitted {
            max_tokens: granted,
            counters: after,
            rate_room,
        }
    }

    fn commit_now(&self, req: &CommitRequest) -> bool {
        let mut inner = self.lock();
        if req.unreserved {
            if inner.done.get(&req.rid).is_some_and(|&t| t > req.now_ms) {
                return false;
            }
            inner
                .done
                .insert(req.rid.clone(), req.now_ms + req.dedupe_ms);
            for (key, expire_at_ms) in &req.counters {
                slot(&mut inner.counters, key).spend(req, *expire_at_ms);
            }
            return true;
        }
        // Only the first close of a lease that existed finds its marker: its rate limiter units
        // come back once (also for a lease of rate limits alone, which has no counter).
        let lease_refund = req.lease.is_some_and(|l| l.close)
            && inner
                .done
                .remove(&super::marker_key(&req.tenant_id, &req.rid))
                .is_some_and(|until| until > req.now_ms);
        let mut applied = (req.counters.is_empty() && req.lease.is_none()) || lease_refund;
        for (key, expire_at_ms) in &req.counters {
            let Some(c) = inner.counters.get_mut(key) else {
                continue;
            };
            if let Some(sync) = &req.lease {
                applied |= c.settle_lease(&req.rid, sync);
                continue;
            }
            let live = match c.reservations.remove(&req.rid) {
                Some((tokens, micros, _)) => {
                    c.state.reserved_tokens = c.state.reserved_tokens.saturating_sub(tokens);
                    c.state.reserved_micros -= micros;
                    true
                }
                None => false,
            };
            if live || c.expired.remove(&req.rid) {
                c.spend(req, *expire_at_ms);
                applied = true;
            }
        }
        if !applied {
            return false;
        }
        if req.lease.is_some() && !lease_refund {
            return true;
        }
        for (key, per_minute, refund) in &req.refunds {
            if let Some((tat, _)) = inner.rates.get_mut(&**key) {
                *tat = (*tat - *refund as f64 * emission_us(*per_minute)).max(0.0);
            }
        }
        true
    }
}

#[async_trait]
impl BudgetStore for MemoryStore {
    async fn reserve(&self, req: &ReserveRequest) -> Result<Outcome, BudgetError> {
        Ok(self.reserve_now(req))
    }

    async fn commit(&self, req: &CommitRequest) -> Result<bool, BudgetError> {
        Ok(self.commit_now(req))
    }

    async fn peek(
        &self,
        _tenant_id: &str,
        keys: &[String],
        now_ms: i64,
    ) -> Result<Vec<CounterState>, BudgetError> {
        let mut inner = self.lock();
        Ok(keys.iter().map(|k| inner.state(k, now_ms)).collect())
    }

    async fn seed(
        &self,
        _tenant_id: &str,
        key: &str,
        tokens: u64,
        micros: i64,
        expire_at_ms: i64,
    ) -> Result<bool, BudgetError> {
        let mut inner = self.lock();
        let c = slot(&mut inner.counters, key);
        if c.seeded {
            return Ok(false);
        }
        // Commits made before the seed are in the counter; the ledger may hold them too.
        c.state.spent_tokens = c.state.spent_tokens.max(tokens);
        c.state.spent_micros = c.state.spent_micros.max(micros);
        c.expire_at_ms = c.expire_at_ms.max(expire_at_ms);
        c.seeded = true;
        Ok(true)
    }
}
