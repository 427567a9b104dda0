//! Model tiers, what a client-facing model name routes to, and the token counters a tier can
//! name.

use serde::{Deserialize, Serialize};

/// A tier of interchangeable replicas serving one model size. Requests fall back between the
/// two.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// The cheap, fast tier.
    Small,
    /// The capable, expensive tier.
    Large,
}

impl Tier {
    /// Both tiers, small first.
    pub const ALL: [Tier; 2] = [Tier::Small, Tier::Large];

    /// Lowercase name, as configured, stored in the ledger and shown in headers.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Small => "small",
            Self::Large => "large",
        }
    }

    /// Parse a configured or stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// The tier a request falls back to.
    pub fn other(self) -> Self {
        match self {
            Self::Small => Self::Large,
            Self::Large => Self::Small,
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a client-facing model name asks for: one tier, or `auto` (the gateway picks the tier;
/// a routing request, not a tier).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelTarget {
    /// The small tier.
    Small,
    /// The large tier.
    Large,
    /// Routed by the gateway.
    Auto,
}

impl ModelTarget {
    /// The tier named, or `None` for `auto`.
    pub fn tier(self) -> Option<Tier> {
        match self {
            Self::Small => Some(Tier::Small),
            Self::Large => Some(Tier::Large),
            Self::Auto => None,
        }
    }
}

impl From<Tier> for ModelTarget {
    fn from(t: Tier) -> Self {
        match t {
            Tier::Small => Self::Small,
            Tier::Large => Self::Large,
        }
    }
}

/// The BPE a tier's tokens are counted with when the upstream reports no usage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TokenizerKind {
    /// OpenAI's `cl100k_base` (GPT-4, GPT-3.5), the default.
    #[default]
    #[serde(rename = "cl100k_base")]
    Cl100kBase,
    /// OpenAI's `o200k_base` (GPT-4o).
    #[serde(rename = "o200k_base")]
    O200kBase,
}

impl TokenizerKind {
    /// The configured name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cl100kBase => "cl100k_base",
            Self::O200kBase => "o200k_base",
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn tiers_and_targets_read_their_lowercase_names() {
        for t in Tier::ALL {
            assert_eq!(Tier::parse(t.as_str()), Some(t));
            assert_eq!(t.other().other(), t);
            assert_eq!(ModelTarget::from(t).tier(), Some(t));
        }
        assert_eq!(Tier::parse("auto"), None, "auto is not a tier");
        let auto: ModelTarget = serde_json::from_str("\"auto\"").unwrap();
        assert_eq!(auto.tier(), None);
        let o200k: TokenizerKind = serde_json::from_str("\"o200k_base\"").unwrap();
        assert_eq!(o200k.as_str(), "o200k_base");
        assert!(serde_json::from_str::<TokenizerKind>("\"llama\"").is_err());
    }
}
