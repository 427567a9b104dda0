-- Budget policies, rate limits and per-tenant fail modes (Postgres).
CREATE TABLE budgets (
    id                  TEXT PRIMARY KEY,
    tenant_id           TEXT NOT NULL REFERENCES tenants (id),
    scope_kind          TEXT NOT NULL,
    scope_value         TEXT NOT NULL,
    window_kind         TEXT NOT NULL,
    limit_tokens        BIGINT,
    limit_micros        BIGINT,
    action              TEXT NOT NULL,
    hard_limit_tokens   BIGINT,
    hard_limit_micros   BIGINT,
    warn_percent        BIGINT,
    updated_at          TIMESTAMPTZ NOT NULL
);
CREATE UNIQUE INDEX budgets_scope ON budgets (tenant_id, scope_kind, scope_value, window_kind);

CREATE TABLE rate_limits (
    tenant_id   TEXT NOT NULL REFERENCES tenants (id),
    -- '' for the whole tenant.
    key_id      TEXT NOT NULL,
    rpm         BIGINT,
    tpm         BIGINT,
    PRIMARY KEY (tenant_id, key_id)
);

CREATE TABLE tenant_budget_settings (
    tenant_id   TEXT PRIMARY KEY REFERENCES tenants (id),
    fail_mode   TEXT NOT NULL
);
