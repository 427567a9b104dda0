-- Rows of the labelled synthetic history that `gateway demo` seeds (usage_source 'synthetic'),
-- counted in the daily rollup so every report can say how much of what it shows is demo data.
ALTER TABLE ledger_daily ADD COLUMN synthetic_requests BIGINT NOT NULL DEFAULT 0;
