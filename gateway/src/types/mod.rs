//! Plain data shared by the configuration, the stores and the request path: tiers and routing
//! targets, budget, cache, guard and routing policies, prices, token usage. A leaf: it imports nothing else from
//! the gateway, so [`crate::config`] and [`crate::store`] can use these types without depending
//! on the components that act on them.

pub mod budget;
pub mod cache;
pub mod guard;
pub mod price;
pub mod routing;
pub mod tier;
pub mod usage;

pub use tier::{ModelTarget, Tier, TokenizerKind};
pub use usage::Usage;
