-- Per-tenant routing policy for `model: "auto"` (JSON: policy or large_share); a tenant without a
-- row gets the config's [routing] default.
CREATE TABLE tenant_routing_policies (
    tenant_id   TEXT PRIMARY KEY REFERENCES tenants (id),
    policy      TEXT NOT NULL
);
-- Why the request went to its tier: explicit (the client named a tier's model), classifier,
-- budget, rule (tools or images), fallback (no classifier); NULL before this migration and for
-- requests refused before the route step.
ALTER TABLE ledger ADD COLUMN route_reason TEXT;
