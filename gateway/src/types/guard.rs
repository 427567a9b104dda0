//! What the guard does about an agent loop, and a tenant's guard policy as stored.

use serde::{Deserialize, Serialize};

/// What happens to a session found looping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoopAction {
    /// Answer, and say so: the `x-gateway-loop` header, the ledger's `loop_flag`, a metric.
    Flag,
    /// Refuse with 429 (`loop_detected`, `Retry-After`) and refuse the session until a cooldown
    /// ends; after it, one request goes through (flagged) and a looping one opens the next
    /// cooldown, so a stuck agent gets one step per cooldown.
    Throttle,
    /// Refuse the session with 429 (`loop_detected`) until an admin clears it
    /// (`gatewayctl sessions clear`).
    Block,
}

impl LoopAction {
    /// Lowercase name, as stored, typed and used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Flag => "flag",
            Self::Throttle => "throttle",
            Self::Block => "block",
        }
    }
}

/// A tenant's guard policy; fields left out take the config's defaults (`[guard]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardPolicy {
    /// What to do about a loop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<LoopAction>,
    /// How many times a step (or a 2-3 step cycle, counted in cycles from 2) must occur to be a
    /// loop, at least 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeats: Option<u32>,
    /// The session window across requests: how far back a repeated turn counts, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_secs: Option<u64>,
    /// Cosine similarity of static embeddings above which two texts count as the same step
    /// (a paraphrased re-ask); 1 turns near-duplicates off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub similarity: Option<f64>,
    /// How long a throttled session is refused, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown_secs: Option<u64>,
}

impl GuardPolicy {
    /// Check the fields that are set; the error names the field.
    pub fn check(&self) -> Result<(), (&'static str, &'static str)> {
        if self.repeats.is_some_and(|r| !(2..=100).contains(&r)) {
            return Err(("repeats", "must be between 2 and 100"));
        }
        if self.window_secs.is_some_and(|w| w == 0 || w > 86_400) {
            return Err(("window_secs", "must be between 1 and 86400"));
        }
        if self.similarity.is_some_and(|s| !(0.5..=1.0).contains(&s)) {
            return Err((
                "similarity",
                "must be between 0.5 and 1 (1: exact repeats only)",
            ));
        }
        if self.cooldown_secs.is_some_and(|c| c == 0 || c > 86_400) {
            return Err(("cooldown_secs", "must be between 1 and 86400"));
        }
        Ok(())
    }
}
