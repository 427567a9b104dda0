//! `gatewayctl keys …`: create, list and revoke API keys.

use std::collections::BTreeMap;

use clap::Subcommand;
use reqwest::Method;
use serde_json::json;

use super::{opt, query, time, Admin, Answer, Reply};
use crate::routes::admin::{CreatedKey, RevokedKey};
use crate::store::ApiKey;

/// `gatewayctl keys …`
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Create a key; the secret is printed once.
    #[command(
        after_help = "Examples:\n  gatewayctl keys create --tenant acme --name web --tag feature=search\n  gatewayctl keys create --tenant acme --tag feature=chat --client-tag user"
    )]
    Create {
        /// Tenant id or name.
        #[arg(long)]
        tenant: String,
        /// Label for the key.
        #[arg(long)]
        name: Option<String>,
        /// Attribution tag `key=value` (repeatable).
        #[arg(long = "tag", value_parser = parse_tag)]
        tags: Vec<(String, String)>,
        /// Only these tag names may be added by its clients (`x-gateway-tags`, the request's
        /// `user`); repeatable. Default: any tag the key does not fix.
        #[arg(long = "client-tag", conflicts_with = "no_client_tags")]
        client_tags: Vec<String>,
        /// Its clients may add no tags at all.
        #[arg(long)]
        no_client_tags: bool,
    },
    /// List keys.
    #[command(after_help = "Example:\n  gatewayctl keys list --tenant acme")]
    List {
        /// Only this tenant's keys (id or name).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Revoke a key (takes effect on every replica within the key refresh interval).
    #[command(after_help = "Example:\n  gatewayctl keys revoke key_0123abcd")]
    Revoke {
        /// Key id (`key_…`).
        id: String,
    },
}

fn parse_tag(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

impl KeyCommand {
    /// Call the admin API and render its answer.
    pub(super) async fn run(self, admin: &Admin) -> anyhow::Result<Reply> {
        Ok(match self {
            Self::Create {
                tenant,
                name,
                tags,
                client_tags,
                no_client_tags,
            } => {
                let tags: BTreeMap<String, String> = tags.into_iter().collect();
                let client_tags =
                    (no_client_tags || !client_tags.is_empty()).then_some(client_tags);
                let body = json!({"tenant": tenant, "name": name, "tags": tags,
                                  "client_tags": client_tags});
                let a: Answer<CreatedKey> = admin.call(Method::POST, "keys", Some(body)).await?;
                let h = format!(
                    "created key {} for tenant {}\n\n    {}\n\nStore it now: it is not shown again.",
                    a.body.meta.id, a.body.meta.tenant_name, a.body.secret
                );
                a.reply(h)
            }
            Self::List { tenant } => {
                let path = query("keys", &[("tenant", tenant.as_deref())]);
                let header = &[
                    "ID",
                    "TENANT",
                    "NAME",
                    "KEY",
                    "TAGS",
                    "CLIENT TAGS",
                    "STATUS",
                    "CREATED",
                ];
                admin.list(&path, header, row).await?
            }
            Self::Revoke { id } => {
                let a: Answer<RevokedKey> = admin
                    .call(Method::DELETE, &format!("keys/{id}"), None)
                    .await?;
                a.reply(format!("revoked key {id}"))
            }
        })
    }
}

fn row(k: &ApiKey) -> Vec<String> {
    let tags: Vec<String> = k.tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let status = if k.revoked_at.is_some() {
        "revoked"
    } else {
        "active"
    };
    vec![
        k.id.clone(),
        k.tenant_name.clone(),
        opt(k.name.as_deref()),
        format!("{}…", k.prefix),
        tags.join(","),
        match &k.client_tags {
            None => "any".into(),
            Some(t) if t.is_empty() => "none".into(),
            Some(t) => t.join(","),
        },
        status.into(),
        time(&k.created_at),
    ]
}
