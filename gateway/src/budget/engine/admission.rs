//! Admission: a request's reservation in every budget and rate limit that applies, from a
//! lease, the shared store or the local fail-open share, and the typed decision.

use super::*;

/// How the shared store admitted (or did not admit) a request.
enum Shared {
    /// From a lease of this replica.
    Leased(Admission),
    /// By a reservation of its own (or not: see the outcome), and whether it was downgraded.
    Reserved(ReserveRequest, Outcome, bool),
}

/// What a store granted a request, for [`Budgets::admitted`].
struct Grant<'a> {
    /// Output tokens for all choices together.
    output_tokens: u64,
    /// The counters after the reservation, index-aligned with the plan's policies.
    counters: &'a [CounterState],
    /// Served by the small tier because of a `downgrade` budget.
    downgraded: bool,
    /// Reserved in the local fail-open store.
    local: bool,
}

impl Budgets {
    /// The reservation for `input` under `plan`; `share` scales every limit (the local fail-open
    /// store's share), and only the shared store's counters must be seeded from the ledger
    /// (the local one counts this replica's fail-open spend from zero).
    fn request(
        &self,
        plan: &Plan,
        input: &AdmitInput,
        now: DateTime<Utc>,
        downgraded: bool,
        share: Option<f64>,
    ) -> ReserveRequest {
        let seeded_only = share.is_none();
        let share = share.unwrap_or(1.0);
        let price = if downgraded && !input.primary_is_small {
            input.small_price
        } else {
            input.price
        };
        let choices = input.choices.max(1);
        let max_tokens = if input.generates {
            input.max_tokens.unwrap_or(self.config.default_max_tokens) * choices
        } else {
            0
        };
        let counters = plan
            .policies
            .iter()
            .map(|p| {
                let start = p.window.start(now);
                CounterSpec {
                    key: counter_key(&p.tenant_id, &p.id, start),
                    mode: match p.action {
                        Action::Reject => Mode::Enforce,
                        Action::Downgrade => Mode::Downgrade,
                        Action::Flag => Mode::Count,
                    },
                    limit: p.limit.scaled(share),
                    hard: p.hard_limit.scaled(share),
                    expire_at_ms: ms(p.window.end(start)) + COUNTER_GRACE_MS,
                }
            })
            .collect();
        let rates = plan
            .rates
            .iter()
            .map(|(r, _)| RateSpec {
                per_minute: ((r.per_minute as f64 * share) as u64).max(1),
                ..r.clone()
            })
            .collect();
        let prompt_micros = i64::try_from(
            (u128::from(input.prompt_tokens) * u128::try_from(price.input.max(0)).unwrap_or(0))
                .div_ceil(1_000_000),
        )
        .unwrap_or(i64::MAX / 4);
        ReserveRequest {
            tenant_id: plan.tenant_id.clone(),
            rid: input.rid.clone(),
            now_ms: ms(now),
            ttl_ms: self.ttl_ms,
            prompt_tokens: input.prompt_tokens,
            prompt_micros,
            output_micros_per_token: price.output.max(0) as f64 / 1e6,
            max_tokens,
            min_tokens: self.config.min_tokens * choices,
            downgraded: downgraded || input.primary_is_small,
            units: 1,
            lease: false,
            lease_quiet_ms: self.leases.as_ref().map_or(0, |l| 2 * l.drain_ms()),
            counters,
            rates,
            seeded_only,
        }
    }

    async fn reserve_in(
        &self,
        store: &dyn BudgetStore,
        plan: &Plan,
        req: &ReserveRequest,
    ) -> Result<Outcome, BudgetError> {
        let out = self.reserve_once(store, req).await?;
        let Outcome::Unseeded { index } = out else {
            return Ok(out);
        };
        // The counter is new to this window, or the store lost it: seed it from the ledger
        // before admitting anything against it, then ask again.
        self.reseed(store, plan, index, req.now_ms).await?;
        match self.reserve_once(store, req).await? {
            Outcome::Unseeded { .. } => Err(BudgetError::Protocol(
                "a counter stayed unseeded after seeding it".into(),
            )),
            out => Ok(out),
        }
    }

    async fn reserve_once(
        &self,
        store: &dyn BudgetStore,
        req: &ReserveRequest,
    ) -> Result<Outcome, BudgetError> {
        let started = Instant::now();
        let out = store.reserve(req).await;
        self.metrics
            .budget_store_seconds
            .with_label_values(&["reserve"])
            .observe(started.elapsed().as_secs_f64());
        if let Err(BudgetError::Timeout | BudgetError::Redis(_)) = &out {
            if req.seeded_only && !req.lease {
                // The script may have run with its answer lost (a hung Redis that then
                // recovers): release the reservation once the store is back instead of holding
                // it for the whole TTL. A no-op when it was never made.
                self.enqueue(Self::orphan_release(req));
            }
        }
        out
    }

    /// The commit that releases `req`'s reservation, if it exists, and spends nothing.
    fn orphan_release(req: &ReserveRequest) -> CommitRequest {
        CommitRequest {
            tenant_id: req.tenant_id.clone(),
            rid: req.rid.clone(),
            now_ms: req.now_ms,
            dedupe_ms: req.ttl_ms.max(1),
            unreserved: false,
            tokens: 0,
            micros: 0,
            counters: req.counter_keys(),
            refunds: Vec::new(),
            lease: None,
        }
    }

    /// Check and reserve; on `downgrade`, once more at the small tier.
    async fn reserve_with(
        &self,
        store: &dyn BudgetStore,
        plan: &Plan,
        input: &AdmitInput,
        now: DateTime<Utc>,
        share: Option<f64>,
    ) -> Result<(ReserveRequest, Outcome, bool), BudgetError> {
        let req = self.request(plan, input, now, false, share);
        let outcome = self.reserve_in(store, plan, &req).await?;
        if let Outcome::Downgrade { .. } = outcome {
            let req = self.request(plan, input, now, true, share);
            let outcome = self.reserve_in(store, plan, &req).await?;
            return Ok((req, outcome, true));
        }
        Ok((req, outcome, false))
    }

    /// Admit through the shared store: from a lease when one has room (or can be taken),
    /// otherwise by a reservation of its own.
    async fn shared_admit(
        &self,
        plan: &Plan,
        input: &AdmitInput,
        now: DateTime<Utc>,
    ) -> Result<Shared, BudgetError> {
        let Some(leases) = &self.leases else {
            let (req, outcome, downgraded) = self
                .reserve_with(&*self.store, plan, input, now, None)
                .await?;
            return Ok(Shared::Reserved(req, outcome, downgraded));
        };
        let now_ms = ms(now);
        let req = self.request(plan, input, now, false, None);
        let need = Need::of(&req);
        let slot = leases.slot(&req);
        if let Some(taken) = slot.take(need, now_ms) {
            return Ok(Shared::Leased(self.leased(plan, input, &req, taken, now)));
        }
        {
            // One lease at a time per slot: the others wait for it, then take from it.
            let _one = slot.acquire.lock().await;
            if let Some(taken) = slot.take(need, now_ms) {
                return Ok(Shared::Leased(self.leased(plan, input, &req, taken, now)));
            }
            if !self.store_available(ms(self.clock.now())) {
                // It failed while this request waited: do not queue up behind it.
                return Err(BudgetError::Unavailable);
            }
            if let Some(lease_req) = leases.lease_request(&slot, &req, need, self.ttl_ms) {
                let outcome = match self.reserve_in(&*self.store, plan, &lease_req).await {
                    Ok(o) => o,
                    Err(e) => {
                        // The lease may have been made with its answer lost: close it once
                        // the store is back (a no-op if it was never made).
                        slot.refused(now_ms, leases.drain_ms());
                        self.enqueue(Leases::orphan_close(&lease_req));
                        return Err(e);
                    }
                };
                slot.observe(&lease_req, &outcome);
                if let Outcome::Admitted { counters, .. } = outcome {
                    self.metrics.budget_leases.inc();
                    leases.install(&slot, &lease_req, counters);
                    if let Some(taken) = slot.take(need, now_ms) {
                        return Ok(Shared::Leased(self.leased(plan, input, &req, taken, now)));
                    }
                } else {
                    slot.refused(now_ms, leases.drain_ms());
                }
            }
        }
        let (req, outcome, downgraded) = self
            .reserve_with(&*self.store, plan, input, now, None)
            .await?;
        if !downgraded {
            slot.observe(&req, &outcome);
        }
        let held_by_leases = match &outcome {
            Outcome::Rejected { index, counters } => counters
                .get(*index)
                .is_some_and(|c| c.leased_tokens > 0 || c.leased_micros > 0),
            _ => false,
        };
        if held_by_leases {
            // Part of what is left is held by leases (this replica's or others'). The refusal
            // made that counter take no new lease for a while (`lease_quiet_ms`), so the open
            // ones close and give back what they do not use: ask once more after that.
            slot.close();
            let wait = u64::try_from(leases.drain_ms()).unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(wait)).await;
            let (req, outcome, downgraded) = self
                .reserve_with(&*self.store, plan, input, self.clock.now(), None)
                .await?;
            if !downgraded {
                slot.observe(&req, &outcome);
            }
            return Ok(Shared::Reserved(req, outcome, downgraded));
        }
        Ok(Shared::Reserved(req, outcome, downgraded))
    }

    /// The admission of a request taken from a lease.
    fn leased(
        &self,
        plan: &Plan,
        input: &AdmitInput,
        req: &ReserveRequest,
        (lease, counters): (Arc<Lease>, Vec<CounterState>),
        now: DateTime<Utc>,
    ) -> Admission {
        let grant = Grant {
            output_tokens: req.max_tokens,
            counters: &counters,
            downgraded: false,
            local: false,
        };
        let mut admission = self.admitted(plan, input, req, grant, now);
        if let Some(r) = admission.reservation.as_mut() {
            r.lease = Some((lease, Need::of(req)));
        }
        admission
    }

    /// Admit a request under `plan`, or say why not.
    pub async fn admit(&self, plan: &Plan, input: AdmitInput) -> Result<Admission, Refusal> {
        let now = self.clock.now();
        let now_ms = ms(now);
        let shared = if !self.shared || self.store_available(now_ms) {
            match self.shared_admit(plan, &input, now).await {
                Ok(Shared::Leased(admission)) => return Ok(admission),
                Ok(Shared::Reserved(req, outcome, downgraded)) => Some((req, outcome, downgraded)),
                Err(BudgetError::Unavailable) => {
                    self.metrics
                        .budget_store_errors
                        .with_label_values(&[plan.fail_mode.as_str()])
                        .inc();
                    None
                }
                Err(e) => {
                    self.store_failed(plan, &e, now_ms);
                    None
                }
            }
        } else {
            self.metrics
                .budget_store_errors
                .with_label_values(&[plan.fail_mode.as_str()])
                .inc();
            None
        };
        let (req, outcome, downgraded, local) = match shared {
            Some((req, outcome, downgraded)) => (req, outcome, downgraded, false),
            None if plan.fail_mode == FailMode::Closed => {
                self.decision(plan, "store_unavailable");
                return Err(Refusal::StoreUnavailable);
            }
            None => {
                let share = self.config.fail_open_share;
                // The local store never fails.
                let (req, outcome, downgraded) = self
                    .reserve_with(&self.local, plan, &input, now, Some(share))
                    .await
                    .map_err(Refusal::Internal)?;
                (req, outcome, downgraded, true)
            }
        };
        match outcome {
            Outcome::Admitted {
                max_tokens,
                counters,
                ..
            } => {
                let grant = Grant {
                    output_tokens: max_tokens,
                    counters: &counters,
                    downgraded,
                    local,
                };
                Ok(self.admitted(plan, &input, &req, grant, now))
            }
            Outcome::Rejected { index, counters } => {
                self.decision(plan, "rejected");
                Err(self.exhausted(plan, &req, index, &counters, now))
            }
            Outcome::Downgrade { index } => {
                // Only possible if the policy changed between the two calls; treat as exhausted.
                self.decision(plan, "rejected");
                Err(self.exhausted(plan, &req, index, &[], now))
            }
            Outcome::Unseeded { .. } => {
                // reserve_in seeds and asks again; a second `Unseeded` is an error there.
                self.decision(plan, "store_unavailable");
                Err(Refusal::StoreUnavailable)
            }
            Outcome::RateLimited {
                index,
                retry_after_ms,
            } => {
                self.decision(plan, "rate_limited");
                let (spec, rule) = &plan.rates[index];
                Err(Refusal::RateLimited {
                    kind: spec.kind,
                    per_minute: spec.per_minute,
                    key_id: rule.key_id.clone(),
                    retry_after_ms,
                })
            }
        }
    }

    fn admitted(
        &self,
        plan: &Plan,
        input: &AdmitInput,
        req: &ReserveRequest,
        grant: Grant<'_>,
        now: DateTime<Utc>,
    ) -> Admission {
        let Grant {
            output_tokens: reserved_output,
            counters,
            downgraded,
            local,
        } = grant;
        let requested = input.max_tokens.unwrap_or(self.config.default_max_tokens);
        // The store grants output tokens for all choices together.
        let granted = reserved_output / input.choices.max(1);
        let clamped = input.generates && granted < requested;
        let mut outcome = if clamped { "clamped" } else { "admitted" };
        if downgraded {
            outcome = "downgraded";
        }
        // The tightest budget: the least fraction left after this reservation.
        let mut tightest: Option<(f64, usize, Option<u64>, Option<i64>)> = None;
        let mut flagged = Vec::new();
        let mut warnings = Vec::new();
        for (i, (p, state)) in plan.policies.iter().zip(counters).enumerate() {
            if p.action == Action::Downgrade {
                // A downgraded request means the soft limit is reached: full pressure.
                let used = if downgraded {
                    1.0
                } else {
                    1.0 - left_share(state, &p.limit)
                };
                if let Some(spec) = req.counters.get(i) {
                    self.saw_pressure(spec, used);
                }
            }
            let limit = if downgraded && p.action == Action::Downgrade {
                if p.hard_limit.is_unlimited() {
                    continue;
                }
                p.hard_limit
            } else {
                p.limit
            };
            let (rem_t, rem_m) = state.remaining(&limit);
            let frac = left_share(state, &limit);
            if p.action == Action::Flag && frac <= 0.0 {
                flagged.push(p.id.clone());
            }
            if let Some(w) = p.warn_percent {
                if (1.0 - frac) * 100.0 >= f64::from(w) {
                    warnings.push(Warning {
                        policy_id: p.id.clone(),
                        used_percent: (1.0 - frac) * 100.0,
                    });
                }
            }
            if tightest.is_none_or(|(f, ..)| frac < f) {
                tightest = Some((frac, i, rem_t, rem_m));
            }
        }
        if !flagged.is_empty() {
            outcome = "flagged";
            tracing::warn!(tenant = %plan.tenant_id, policies = ?flagged, "budget exceeded (flag only)");
        }
        let tightest = tightest.map(|(_, i, remaining_tokens, remaining_micros)| {
            let p = &plan.policies[i];
            Tightest {
                policy_id: p.id.clone(),
                scope: p.scope.clone(),
                window: p.window,
                remaining_tokens,
                remaining_micros,
                resets_at: p.window.end(p.window.start(now)),
            }
        });
        self.decision(plan, outcome);
        // The limiters as reserved on (already scaled to the local share when failing open).
        let token_rates = req
            .rates
            .iter()
            .filter(|r| r.kind == RateKind::Tokens)
            .map(|r| (r.key.clone(), r.per_minute))
            .collect();
        Admission {
            max_tokens: (input.generates && plan.bounds_output()).then_some(granted),
            clamped_to: clamped.then_some(granted),
            downgraded,
            warnings,
            flagged,
            tightest,
            fail_open: local,
            reservation: Some(Reservation {
                tenant_id: plan.tenant_id.clone(),
                rid: req.rid.clone(),
                counters: req.counter_keys(),
                token_rates,
                reserved_tokens: req.prompt_tokens + reserved_output,
                local,
                lease: None,
            }),
        }
    }

    fn exhausted(
        &self,
        plan: &Plan,
        req: &ReserveRequest,
        index: usize,
        counters: &[CounterState],
        now: DateTime<Utc>,
    ) -> Refusal {
        let p = &plan.policies[index];
        let state = counters.get(index).copied().unwrap_or_default();
        let limit = if req.downgraded && p.action == Action::Downgrade {
            p.hard_limit
        } else {
            p.limit
        };
        Refusal::Exhausted(Exhausted {
            policy_id: p.id.clone(),
            scope: p.scope.clone(),
            window: p.window,
            limit,
            used_tokens: state.spent_tokens + state.reserved_tokens,
            used_micros: state.spent_micros + state.reserved_micros,
            prompt_tokens: req.prompt_tokens,
            min_tokens: req.min_tokens.min(req.max_tokens),
            resets_at: p.window.end(p.window.start(now)),
            now,
        })
    }
}

/// The share of `limit` a counter in `state` has left (0..=1): the lesser of its tokens' and its
/// dollars' shares, 1 for a limit on neither.
fn left_share(state: &CounterState, limit: &Limit) -> f64 {
    let (rem_t, rem_m) = state.remaining(limit);
    let frac_t = limit
        .tokens
        .map(|l| rem_t.unwrap_or(0) as f64 / l.max(1) as f64);
    let frac_m = limit
        .micros
        .map(|l| rem_m.unwrap_or(0) as f64 / l.max(1) as f64);
    frac_t.unwrap_or(1.0).min(frac_m.unwrap_or(1.0))
}
