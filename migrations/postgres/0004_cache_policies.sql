-- Per-tenant response-cache policy (JSON: mode, ttl_secs, min_precision, any_temperature, tools);
-- a tenant without a row gets the config's defaults.
CREATE TABLE tenant_cache_policies (
    tenant_id   TEXT PRIMARY KEY REFERENCES tenants (id),
    policy      TEXT NOT NULL
);
