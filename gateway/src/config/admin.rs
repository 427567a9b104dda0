//! `[admin]`: the admin API's token.

use secrecy::SecretString;
use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

/// Fewest characters an admin token may have: an empty or short token refuses to start.
pub const MIN_ADMIN_TOKEN_LEN: usize = 16;

/// The admin API.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Bearer token for `/admin/v1`, at least [`MIN_ADMIN_TOKEN_LEN`] characters. Without one
    /// (the setting absent) the admin API answers 403; set but empty or short, the gateway
    /// refuses to start.
    #[serde(serialize_with = "serialize_secret_opt")]
    pub token: Option<SecretString>,
}

impl AdminConfig {
    /// A token that is set must be long enough to guess at no better than chance: set but
    /// empty (e.g. `GATEWAY__ADMIN__TOKEN=`) it would otherwise compare equal to a request
    /// that presents no credential at all.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        use secrecy::ExposeSecret;
        let Some(token) = &self.token else {
            return Ok(());
        };
        let token = token.expose_secret();
        if token.trim() != token || token.chars().any(char::is_control) {
            return Err(invalid(
                "admin.token",
                "must not contain spaces at either end or control characters \
                 (GATEWAY__ADMIN__TOKEN)",
            ));
        }
        if token.chars().count() < MIN_ADMIN_TOKEN_LEN {
            return Err(invalid(
                "admin.token",
                format!(
                    "is set but {} characters long; use at least {MIN_ADMIN_TOKEN_LEN} \
                     (e.g. `openssl rand -hex 24`), or leave admin.token and \
                     GATEWAY__ADMIN__TOKEN unset to turn the admin API off",
                    token.chars().count()
                ),
            ));
        }
        Ok(())
    }
}

fn serialize_secret_opt<S: serde::Serializer>(
    v: &Option<SecretString>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use secrecy::ExposeSecret;
    match v {
        Some(secret) => s.serialize_some(secret.expose_secret()),
        None => s.serialize_none(),
    }
}
