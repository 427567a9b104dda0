-- Per-tenant guard policy (JSON: action, repeats, window_secs, similarity, cooldown_secs); a tenant
-- without a row gets the config's [guard] defaults.
CREATE TABLE tenant_guard_policies (
    tenant_id   TEXT PRIMARY KEY REFERENCES tenants (id),
    policy      TEXT NOT NULL
);
-- What the guard found, on each ledger row: the steps of the loop it caught (0: none; the rows of
-- the session before the first flagged one are the loop's earlier steps) and, for a request it
-- refused, what answering it would have cost (the session's latest answered request).
ALTER TABLE ledger ADD COLUMN loop_steps INTEGER NOT NULL DEFAULT 0;
ALTER TABLE ledger ADD COLUMN avoided_micros BIGINT NOT NULL DEFAULT 0;
ALTER TABLE ledger_daily ADD COLUMN loop_refused BIGINT NOT NULL DEFAULT 0;
ALTER TABLE ledger_daily ADD COLUMN loop_avoided BIGINT NOT NULL DEFAULT 0;
