//! API keys: generation, hashing and the authenticator every `/v1` request goes through.
//!
//! Keys look like `sk-gw-` followed by 40 base62 characters (~238 bits of entropy), are shown once
//! at creation and stored only as a SHA-256 hash (a slow password hash buys nothing for random
//! keys of this length). Each replica holds a snapshot of live keys behind an `ArcSwap`, reloaded
//! every `store.key_refresh_ms`, so a revocation reaches every replica within one refresh; a key
//! created on another replica is found by a direct store lookup on first use.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rand::distr::{Alphanumeric, SampleString};
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::store::{ApiKey, Store, StoreError};
use crate::tasks::Background;

/// Prefix of every tenant API key.
pub const KEY_PREFIX: &str = "sk-gw-";
const KEY_RANDOM_LEN: usize = 40;
/// Characters of the key kept for display.
const DISPLAY_PREFIX_LEN: usize = KEY_PREFIX.len() + 6;

/// A freshly generated key: the secret (shown once) and what is stored.
#[derive(Debug)]
pub struct GeneratedKey {
    /// The full secret key.
    pub secret: String,
    /// Its hash, as stored.
    pub hash: String,
    /// Its display prefix.
    pub prefix: String,
}

/// Generate a new random key.
pub fn generate() -> GeneratedKey {
    let secret = format!(
        "{KEY_PREFIX}{}",
        Alphanumeric.sample_string(&mut rand::rng(), KEY_RANDOM_LEN)
    );
    GeneratedKey {
        hash: hash(&secret),
        prefix: secret[..DISPLAY_PREFIX_LEN].to_owned(),
        secret,
    }
}

/// SHA-256 of a key, hex-encoded.
pub fn hash(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Resolves bearer keys to their stored record.
pub struct Authenticator {
    store: Arc<dyn Store>,
    snapshot: ArcSwap<HashMap<String, Arc<ApiKey>>>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("keys", &self.snapshot.load().len())
            .finish()
    }
}

impl Authenticator {
    /// Load the first snapshot.
    pub async fn new(store: Arc<dyn Store>) -> Result<Self, StoreError> {
        let auth = Self {
            store,
            snapshot: ArcSwap::from_pointee(HashMap::new()),
        };
        auth.refresh().await?;
        Ok(auth)
    }

    /// Reload the snapshot every `every` until `background` stops (revocation latency).
    pub fn start(self: &Arc<Self>, background: &Background, every: Duration) {
        let auth = Arc::clone(self);
        background.every("keys", every, move || {
            let auth = Arc::clone(&auth);
            async move { auth.refresh().await }
        });
    }

    /// Replace the snapshot with the store's live keys.
    pub async fn refresh(&self) -> Result<(), StoreError> {
        let keys = self.store.active_keys().await?;
        let map = keys
            .into_iter()
            .map(|(hash, key)| (hash, Arc::new(key)))
            .collect();
        self.snapshot.store(Arc::new(map));
        Ok(())
    }

    /// Drop a key from this replica's snapshot at once (the revoking replica need not wait for
    /// the next refresh).
    pub fn forget(&self, key_id: &str) {
        self.snapshot.rcu(|map| {
            let mut map = HashMap::clone(map);
            map.retain(|_, k| k.id != key_id);
            map
        });
    }

    /// Drop every key of a tenant from this replica's snapshot at once.
    pub fn forget_tenant(&self, tenant_id: &str) {
        self.snapshot.rcu(|map| {
            let mut map = HashMap::clone(map);
            map.retain(|_, k| k.tenant_id != tenant_id);
            map
        });
    }

    /// Resolve an `Authorization` header value to a live key, or a 401 saying why not.
    pub async fn authenticate(&self, authorization: Option<&str>) -> Result<Arc<ApiKey>, ApiError> {
        let Some(value) = authorization else {
            return Err(ApiError::Unauthorized(
                "missing API key: send `Authorization: Bearer sk-gw-…`".into(),
            ));
        };
        let secret = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(str::trim)
            .ok_or_else(|| {
                ApiError::Unauthorized("the Authorization header must be `Bearer <key>`".into())
            })?;
        if !secret.starts_with(KEY_PREFIX) {
            return Err(ApiError::Unauthorized(
                "incorrect API key provided: gateway keys start with `sk-gw-`".into(),
            ));
        }
        let hash = hash(secret);
        if let Some(key) = self.snapshot.load().get(&hash) {
            return Ok(Arc::clone(key));
        }
        let found = self
            .store
            .find_active_key(&hash)
            .await
            .map_err(ApiError::internal)?;
        let Some(key) = found else {
            return Err(ApiError::Unauthorized(
                "incorrect API key provided, or the key was revoked".into(),
            ));
        };
        let key = Arc::new(key);
        self.snapshot.rcu(|map| {
            let mut map = HashMap::clone(map);
            map.insert(hash.clone(), Arc::clone(&key));
            map
        });
        Ok(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_are_prefixed_unique_and_hashed() {
        let a = generate();
        let b = generate();
        assert!(a.secret.starts_with(KEY_PREFIX));
        assert_eq!(a.secret.len(), KEY_PREFIX.len() + KEY_RANDOM_LEN);
        assert_ne!(a.secret, b.secret);
        assert_eq!(a.hash, hash(&a.secret));
        assert_eq!(a.hash.len(), 64);
        assert!(a.secret.starts_with(&a.prefix));
        assert!(!a.hash.contains(&a.secret[KEY_PREFIX.len()..]));
    }
}
