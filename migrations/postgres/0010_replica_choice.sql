-- How prefix affinity chose the replica of each request (`affinity`, `rendezvous`,
-- `least-loaded`, `imbalanced`) and how many leading prompt blocks it matched there; NULL when the
-- tier chooses by load alone (`upstream.replica_choice = "least_loaded"`).
ALTER TABLE ledger ADD COLUMN replica_choice TEXT;
ALTER TABLE ledger ADD COLUMN matched_blocks INTEGER;
