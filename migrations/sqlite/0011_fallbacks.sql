-- Requests the other tier answered because the chosen one could not (route_reason
-- 'unhealthy'), and their cost, in the daily rollup: the weekly report's fallback line.
ALTER TABLE ledger_daily ADD COLUMN fallback_requests INTEGER NOT NULL DEFAULT 0;
ALTER TABLE ledger_daily ADD COLUMN fallback_cost INTEGER NOT NULL DEFAULT 0;
