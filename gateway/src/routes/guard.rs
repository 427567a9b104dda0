//! Admin routes of the guard: a tenant's guard policy, and its sessions (list, show, clear:
//! what `gatewayctl guard` and `gatewayctl sessions` call).

use axum::extract::{Path, State};
use axum::Json;
use chrono::{DateTime, TimeZone, Utc};
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::guard::store::{GuardError, SessionInfo};
use crate::guard::GuardPolicy;
use crate::routes::{tenant, List, Query};
use crate::state::AppState;

/// Body of the `/admin/v1/tenants/{tenant}/guard-policy` endpoints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GuardPolicyView {
    /// The tenant's id.
    pub tenant: String,
    /// Its own policy; `None`: the config's defaults.
    pub policy: Option<GuardPolicy>,
    /// The policy in force (its own over the defaults).
    pub effective: GuardPolicy,
}

fn policy_view(state: &AppState, tenant_id: &str, own: Option<GuardPolicy>) -> GuardPolicyView {
    GuardPolicyView {
        tenant: tenant_id.to_owned(),
        policy: own,
        effective: state.guard.policy(tenant_id),
    }
}

impl crate::routes::policy::AdminPolicy for GuardPolicy {
    type View = GuardPolicyView;
    const NAME: &'static str = "guard";

    /// Fields left out take the config's defaults.
    fn check(&self) -> Result<(), ApiError> {
        GuardPolicy::check(self)
            .map_err(|(field, message)| ApiError::invalid(field, format!("`{field}` {message}")))
    }

    fn reload(
        state: &AppState,
    ) -> impl std::future::Future<Output = Result<(), crate::store::StoreError>> + Send {
        let guard = std::sync::Arc::clone(&state.guard);
        async move { guard.refresh().await }
    }

    fn view(state: &AppState, tenant_id: &str, own: Option<Self>) -> GuardPolicyView {
        policy_view(state, tenant_id, own)
    }
}

/// The latest loop found in a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoopView {
    /// What repeated.
    pub what: String,
    /// How many times.
    pub repeats: u32,
    /// Steps in the repeating unit.
    pub period: u32,
    /// When it was found.
    pub at: DateTime<Utc>,
}

/// A session, as the admin API answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionView {
    /// The tenant's id.
    pub tenant: String,
    /// The session id.
    pub session: String,
    /// `ok`, `flagged` (a loop was found and answered), `throttled` (in a cooldown) or
    /// `blocked` (until cleared).
    pub status: String,
    /// First request.
    pub first_seen: DateTime<Utc>,
    /// Latest request.
    pub last_seen: DateTime<Utc>,
    /// Requests seen.
    pub requests: u64,
    /// Requests answered while flagged as a loop.
    pub flagged: u64,
    /// Requests refused.
    pub refused: u64,
    /// What its answered requests cost, micro-dollars.
    pub cost_micros: i64,
    /// What refusing its requests saved (estimated), micro-dollars.
    pub avoided_micros: i64,
    /// Refused until then (throttled).
    pub cooldown_until: Option<DateTime<Utc>>,
    /// Blocked since then.
    pub blocked_at: Option<DateTime<Utc>>,
    /// The latest loop found.
    pub last_loop: Option<LoopView>,
    /// Turns in its window.
    pub turns: usize,
}

fn at(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms).single().unwrap_or_default()
}

fn view(info: SessionInfo, now: DateTime<Utc>) -> SessionView {
    let s = info.state;
    let cooldown_until =
        (s.cooldown_until_ms > now.timestamp_millis()).then(|| at(s.cooldown_until_ms));
    let blocked_at = (s.blocked_at_ms > 0).then(|| at(s.blocked_at_ms));
    let status = if blocked_at.is_some() {
        "blocked"
    } else if cooldown_until.is_some() {
        "throttled"
    } else if s.last_loop.is_some() {
        "flagged"
    } else {
        "ok"
    };
    SessionView {
        tenant: info.tenant_id,
        session: info.session,
        status: status.to_owned(),
        first_seen: at(s.first_seen_ms),
        last_seen: at(s.last_seen_ms),
        requests: s.requests,
        flagged: s.flagged,
        refused: s.refused,
        cost_micros: s.cost_micros,
        avoided_micros: s.avoided_micros,
        cooldown_until,
        blocked_at,
        last_loop: s.last_loop.map(|l| LoopView {
            what: l.what,
            repeats: l.repeats,
            period: l.period,
            at: at(l.at_ms),
        }),
        turns: info.turns,
    }
}

impl From<GuardError> for ApiError {
    fn from(e: GuardError) -> Self {
        ApiError::Unavailable {
            message: format!("the guard's session store is unavailable: {e}"),
            retry_after: 1,
        }
    }
}

/// Query of `GET …/sessions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionsQuery {
    /// Most sessions answered (default 100, at most 1000).
    limit: Option<usize>,
    /// Only sessions with this status (`flagged`, `throttled`, `blocked`, `ok`).
    status: Option<String>,
}

/// `GET /admin/v1/tenants/{tenant}/sessions[?limit=N&status=blocked]`: most recently seen
/// first (this replica's sessions, or every replica's with the Redis store).
pub async fn list_sessions(
    State(state): State<AppState>,
    Path(id_or_name): Path<String>,
    Query(q): Query<SessionsQuery>,
) -> Result<Json<List<SessionView>>, ApiError> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            "`limit` must be between 1 and 1000",
        ));
    }
    if let Some(s) = &q.status {
        if !["ok", "flagged", "throttled", "blocked"].contains(&s.as_str()) {
            return Err(ApiError::invalid(
                "status",
                "`status` must be ok, flagged, throttled or blocked",
            ));
        }
    }
    let t = tenant(&state, &id_or_name).await?;
    let now = Utc::now();
    // A status filter reads the whole bounded listing, then filters.
    let read = if q.status.is_some() { 1000 } else { limit };
    let mut data: Vec<SessionView> = state
        .guard
        .sessions(&t.id, read)
        .await?
        .into_iter()
        .map(|i| view(i, now))
        .filter(|v| q.status.as_ref().is_none_or(|s| *s == v.status))
        .collect();
    data.truncate(limit);
    Ok(Json(List::new(data)))
}

/// `GET /admin/v1/tenants/{tenant}/sessions/{session}`
pub async fn get_session(
    State(state): State<AppState>,
    Path((id_or_name, session)): Path<(String, String)>,
) -> Result<Json<SessionView>, ApiError> {
    let t = tenant(&state, &id_or_name).await?;
    let info = state.guard.session(&t.id, &session).await?.ok_or_else(|| {
        ApiError::NotFound(format!("no session {session:?} of tenant {:?}", t.name))
    })?;
    Ok(Json(view(info, Utc::now())))
}

/// `DELETE /admin/v1/tenants/{tenant}/sessions/{session}`: forget the session's window,
/// cooldown and block, so its next request starts afresh.
pub async fn clear_session(
    State(state): State<AppState>,
    Path((id_or_name, session)): Path<(String, String)>,
) -> Result<Json<ClearedSession>, ApiError> {
    let t = tenant(&state, &id_or_name).await?;
    if !state.guard.clear(&t.id, &session).await? {
        return Err(ApiError::NotFound(format!(
            "no session {session:?} of tenant {:?}",
            t.name
        )));
    }
    Ok(Json(ClearedSession {
        tenant: t.id,
        session,
        cleared: true,
    }))
}

/// Answer of a cleared session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClearedSession {
    /// The tenant's id.
    pub tenant: String,
    /// The session.
    pub session: String,
    /// Always true.
    pub cleared: bool,
}
