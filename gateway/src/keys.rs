//! API keys: generation, hashing and the authenticator every `/v1` request goes through.
//!
//! Keys look like `sk-gw-` followed by 40 base62 characters (~238 bits of entropy), are shown once
//! at creation and stored only as a SHA-256 hash (a slow password hash buys nothing for random
//! keys of this length). Each replica holds a snapshot of live keys behind an `ArcSwap`, reloaded
//! every `store.key_refresh_ms`, so a revocation reaches every replica within one refresh; a key
//! created on another replica is found by a direct store lookup on first use.
//!
//! That lookup is the only store work an unauthenticated client can cause, so it is bounded: a
//! key the store said is unknown is remembered until the next refresh (a negative cache, capped),
//! at most [`LOOKUP_CONCURRENCY`] lookups run at once (more wait up to [`LOOKUP_TIMEOUT`] for
//! one to finish, then get 503), each waits at most [`LOOKUP_TIMEOUT`] for the store, and after
//! a failed lookup none is tried for
//! [`LOOKUP_BACKOFF`]: during a database outage unknown keys get a quick 503 (Retry-After) and
//! the keys in the snapshot keep working.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use rand::distr::{Alphanumeric, SampleString};
use sha2::{Digest, Sha256};

use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::store::{ApiKey, Store, StoreError};
use crate::tasks::Background;
use crate::FastMap;

/// Store lookups of keys missing from the snapshot that may run at once.
pub const LOOKUP_CONCURRENCY: usize = 4;
/// Longest wait for one lookup.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);
/// After a failed lookup, how long misses are answered 503 without trying the store.
pub const LOOKUP_BACKOFF: Duration = Duration::from_secs(1);
/// Most unknown key hashes remembered between two refreshes.
pub const NEGATIVE_CAPACITY: usize = 10_000;

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
    hash_into(secret, &mut [0; 64]).to_owned()
}

/// [`hash`] written into `buf` (no allocation: every authenticated request makes one).
fn hash_into<'b>(secret: &str, buf: &'b mut [u8; 64]) -> &'b str {
    // The buffer is exactly twice the digest: encoding cannot fail, and hex digits are ASCII.
    let _ = hex::encode_to_slice(Sha256::digest(secret.as_bytes()), buf);
    std::str::from_utf8(buf).unwrap_or_default()
}

/// `bytes` as lowercase hex digits. Written into a buffer at once: `hex::encode` builds the
/// string a `char` at a time through an iterator, which was 0.7% of the request path's CPU
/// (perf) for the key's and the fingerprint's digests.
pub fn lower_hex(bytes: &[u8]) -> String {
    let mut out = vec![0u8; 2 * bytes.len()];
    // The buffer is exactly twice the input: encoding cannot fail.
    let _ = hex::encode_to_slice(bytes, &mut out);
    String::from_utf8(out).unwrap_or_default()
}

/// Resolves bearer keys to their stored record.
pub struct Authenticator {
    store: Arc<dyn Store>,
    snapshot: ArcSwap<FastMap<String, Arc<ApiKey>>>,
    /// Hashes the store said are unknown, since the last refresh.
    unknown: Mutex<HashSet<String>>,
    lookups: Semaphore,
    /// Until when misses skip the store (it just failed).
    backoff_until: Mutex<Option<Instant>>,
    /// `gateway_key_lookups_total` by outcome, and the series of deleted tenants to drop.
    metrics: Metrics,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("keys", &self.snapshot.load().len())
            .finish()
    }
}

impl Authenticator {
    /// Load the first snapshot; lookups of keys missing from it are counted in `metrics`
    /// (`gateway_key_lookups_total`), and a tenant found deleted at a refresh has its series
    /// dropped from them.
    pub async fn new(store: Arc<dyn Store>, metrics: Metrics) -> Result<Self, StoreError> {
        let auth = Self {
            store,
            snapshot: ArcSwap::from_pointee(FastMap::default()),
            unknown: Mutex::new(HashSet::new()),
            lookups: Semaphore::new(LOOKUP_CONCURRENCY),
            backoff_until: Mutex::new(None),
            metrics,
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
        let map: FastMap<String, Arc<ApiKey>> = keys
            .into_iter()
            .map(|(hash, key)| (hash, Arc::new(key)))
            .collect();
        let live: HashSet<&str> = map.values().map(|k| k.tenant_id.as_str()).collect();
        let gone: HashMap<String, String> = self
            .snapshot
            .load()
            .values()
            .filter(|k| !live.contains(k.tenant_id.as_str()))
            .map(|k| (k.tenant_id.clone(), k.tenant_name.clone()))
            .collect();
        self.snapshot.store(Arc::new(map));
        // A tenant whose last key went: if it was deleted (on any replica), its series go too.
        for (id, name) in gone {
            if self.store.find_tenant(&id).await?.is_none() {
                self.metrics.forget_tenant(&name);
            }
        }
        // A key created since is in the new snapshot; the rest may be asked about again.
        self.unknown
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        Ok(())
    }

    /// Add a key just created through this replica to its snapshot, so its first requests need
    /// no store lookup.
    pub fn remember(&self, hash: &str, key: ApiKey) {
        self.insert(hash, Arc::new(key));
        self.lock_unknown().remove(hash);
    }

    /// Put `key` into the snapshot under `hash`.
    fn insert(&self, hash: &str, key: Arc<ApiKey>) {
        self.snapshot.rcu(|map| {
            let mut map = FastMap::clone(map);
            map.insert(hash.to_owned(), Arc::clone(&key));
            map
        });
    }

    /// Drop a key from this replica's snapshot at once (the revoking replica need not wait for
    /// the next refresh).
    pub fn forget(&self, key_id: &str) {
        self.snapshot.rcu(|map| {
            let mut map = FastMap::clone(map);
            map.retain(|_, k| k.id != key_id);
            map
        });
    }

    /// Drop every key of a tenant from this replica's snapshot at once.
    pub fn forget_tenant(&self, tenant_id: &str) {
        self.snapshot.rcu(|map| {
            let mut map = FastMap::clone(map);
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
        let mut digits = [0u8; 64];
        let hash = hash_into(secret, &mut digits);
        if let Some(key) = self.snapshot.load().get(hash) {
            return Ok(Arc::clone(key));
        }
        let hash = hash.to_owned();
        let key = self.look_up(hash.clone()).await?;
        self.insert(&hash, Arc::clone(&key));
        Ok(key)
    }

    /// The bounded store lookup of a key missing from the snapshot.
    async fn look_up(&self, hash: String) -> Result<Arc<ApiKey>, ApiError> {
        let unknown =
            || ApiError::Unauthorized("incorrect API key provided, or the key was revoked".into());
        let unverifiable = |why: &str| ApiError::Unavailable {
            message: format!("this API key cannot be verified right now ({why}); retry shortly"),
            retry_after: 1,
        };
        let count = |outcome: &str| self.metrics.key_lookups.with_label_values(&[outcome]).inc();
        // Known without a lookup: from the snapshot (a lookup this one waited behind found the
        // same new key), the negative cache, or the store's recent failure.
        let settled = |count: &dyn Fn(&str)| -> Option<Result<Arc<ApiKey>, ApiError>> {
            if let Some(key) = self.snapshot.load().get(&hash) {
                return Some(Ok(Arc::clone(key)));
            }
            if self.lock_unknown().contains(&hash) {
                count("cached_unknown");
                return Some(Err(unknown()));
            }
            if self.backing_off() {
                count("skipped");
                return Some(Err(unverifiable("the key store is unreachable")));
            }
            None
        };
        if let Some(answer) = settled(&count) {
            return answer;
        }
        let Ok(Ok(_permit)) = tokio::time::timeout(LOOKUP_TIMEOUT, self.lookups.acquire()).await
        else {
            count("busy");
            return Err(unverifiable("too many unknown keys at once"));
        };
        if let Some(answer) = settled(&count) {
            return answer;
        }
        match tokio::time::timeout(LOOKUP_TIMEOUT, self.store.find_active_key(&hash)).await {
            Ok(Ok(Some(key))) => {
                count("found");
                Ok(Arc::new(key))
            }
            Ok(Ok(None)) => {
                count("unknown");
                let mut set = self.lock_unknown();
                if set.len() < NEGATIVE_CAPACITY {
                    set.insert(hash);
                }
                Err(unknown())
            }
            failed => {
                count("error");
                if let Ok(Err(e)) = &failed {
                    tracing::warn!(error = %e, "key lookup failed");
                }
                *self.backoff_until.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(Instant::now() + LOOKUP_BACKOFF);
                Err(unverifiable("the key store is unreachable"))
            }
        }
    }

    fn backing_off(&self) -> bool {
        self.backoff_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|until| Instant::now() < until)
    }

    fn lock_unknown(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.unknown.lock().unwrap_or_else(|e| e.into_inner())
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

    #[test]
    fn lower_hex_writes_two_lowercase_digits_per_byte() {
        assert_eq!(lower_hex(&[]), "");
        assert_eq!(lower_hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
        // A key stored by an earlier build (hashed with `hex::encode`) still matches.
        let digest = Sha256::digest(b"gw-test-key");
        assert_eq!(lower_hex(&digest), hex::encode(digest));
        assert_eq!(hash("gw-test-key"), hex::encode(digest));
        assert_eq!(hash_into("gw-test-key", &mut [0; 64]), hash("gw-test-key"));
    }
}
