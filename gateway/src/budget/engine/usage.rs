//! Usage views: what each budget of a tenant has spent, reserved and left (`gatewayctl usage`).

use serde::{Deserialize, Serialize};

use super::*;

/// One row of `gatewayctl usage`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UsageRow {
    /// The policy.
    pub policy: BudgetPolicy,
    /// Start of the current window.
    pub window_start: DateTime<Utc>,
    /// When it resets.
    pub resets_at: DateTime<Utc>,
    /// Committed and reserved totals.
    pub state: CounterState,
    /// Tokens left (when limited).
    pub remaining_tokens: Option<u64>,
    /// Micro-dollars left (when limited).
    pub remaining_micros: Option<i64>,
}

impl Budgets {
    /// Spent, reserved and remaining per policy of a tenant, in the current windows.
    pub async fn usage(&self, tenant_id: &str) -> Result<Vec<UsageRow>, BudgetError> {
        let now = self.clock.now();
        let policies = self
            .rules
            .list_budgets(Some(tenant_id))
            .await
            .map_err(|e| BudgetError::Protocol(format!("reading policies: {e}")))?;
        let keys: Vec<String> = policies
            .iter()
            .map(|p| counter_key(&p.tenant_id, &p.id, p.window.start(now)))
            .collect();
        let states = self.store.peek(tenant_id, &keys, ms(now)).await?;
        Ok(policies
            .into_iter()
            .zip(states)
            .map(|(policy, state)| {
                let window_start = policy.window.start(now);
                let (remaining_tokens, remaining_micros) = state.remaining(&policy.limit);
                UsageRow {
                    window_start,
                    resets_at: policy.window.end(window_start),
                    remaining_tokens,
                    remaining_micros,
                    state,
                    policy,
                }
            })
            .collect())
    }
}
