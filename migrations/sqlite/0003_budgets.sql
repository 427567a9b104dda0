-- Budget policies, rate limits and per-tenant fail modes (embedded default store).
CREATE TABLE budgets (
    id                  TEXT PRIMARY KEY,
    tenant_id           TEXT NOT NULL REFERENCES tenants (id),
    scope_kind          TEXT NOT NULL,
    scope_value         TEXT NOT NULL,
    window_kind         TEXT NOT NULL,
    limit_tokens        INTEGER,
    limit_micros        INTEGER,
    action              TEXT NOT NULL,
    hard_limit_tokens   INTEGER,
    hard_limit_micros   INTEGER,
    warn_percent        INTEGER,
    updated_at          TEXT NOT NULL
);
CREATE UNIQUE INDEX budgets_scope ON budgets (tenant_id, scope_kind, scope_value, window_kind);

CREATE TABLE rate_limits (
    tenant_id   TEXT NOT NULL REFERENCES tenants (id),
    -- '' for the whole tenant.
    key_id      TEXT NOT NULL,
    rpm         INTEGER,
    tpm         INTEGER,
    PRIMARY KEY (tenant_id, key_id)
);

CREATE TABLE tenant_budget_settings (
    tenant_id   TEXT PRIMARY KEY REFERENCES tenants (id),
    fail_mode   TEXT NOT NULL
);
