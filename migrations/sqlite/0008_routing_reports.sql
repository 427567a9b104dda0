-- What a request routed by the tier router (`model: "auto"`) and answered would have cost on the
-- large tier, at the prices in force when it ran (its own cost when the large tier served it);
-- NULL for every other request. The reports' router savings are this minus what it cost.
ALTER TABLE ledger ADD COLUMN all_large_micros INTEGER;
ALTER TABLE ledger_daily ADD COLUMN routed_requests INTEGER NOT NULL DEFAULT 0;
ALTER TABLE ledger_daily ADD COLUMN routed_large INTEGER NOT NULL DEFAULT 0;
ALTER TABLE ledger_daily ADD COLUMN routed_cost INTEGER NOT NULL DEFAULT 0;
ALTER TABLE ledger_daily ADD COLUMN routed_all_large INTEGER NOT NULL DEFAULT 0;
