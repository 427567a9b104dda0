//! Token counts of one request.

/// Token usage as reported by an upstream (or counted by the gateway).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt (input) tokens.
    pub prompt_tokens: u64,
    /// Completion (output) tokens.
    pub completion_tokens: u64,
    /// Prompt tokens served from the upstream's prefix cache.
    pub cached_tokens: u64,
}
