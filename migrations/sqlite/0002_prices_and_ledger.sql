-- Model prices with history, and the cost ledger (embedded default store).
CREATE TABLE prices (
    model                         TEXT NOT NULL,
    effective_from                TEXT NOT NULL,
    input_micros_per_mtok         INTEGER NOT NULL,
    output_micros_per_mtok        INTEGER NOT NULL,
    cached_input_micros_per_mtok  INTEGER NOT NULL,
    PRIMARY KEY (model, effective_from)
);

CREATE TABLE ledger (
    request_id          TEXT PRIMARY KEY,
    started_at          TEXT NOT NULL,
    tenant_id           TEXT NOT NULL,
    tenant_name         TEXT NOT NULL,
    key_id              TEXT NOT NULL,
    feature             TEXT,
    end_user            TEXT,
    session             TEXT,
    tags                TEXT NOT NULL,
    endpoint            TEXT NOT NULL,
    requested_model     TEXT NOT NULL,
    served_model        TEXT,
    tier                TEXT,
    replica             TEXT,
    prompt_tokens       INTEGER NOT NULL,
    completion_tokens   INTEGER NOT NULL,
    cached_tokens       INTEGER NOT NULL,
    usage_source        TEXT NOT NULL,
    cost_micros         INTEGER NOT NULL,
    output_cost_micros  INTEGER NOT NULL,
    saved_micros        INTEGER NOT NULL,
    cache_status        TEXT NOT NULL,
    status              INTEGER NOT NULL,
    error_kind          TEXT,
    stream              INTEGER NOT NULL,
    client_disconnected INTEGER NOT NULL,
    latency_ms          REAL NOT NULL,
    ttft_ms             REAL,
    retries             INTEGER NOT NULL,
    loop_flag           INTEGER NOT NULL,
    retry_storm_flag    INTEGER NOT NULL,
    fingerprint         TEXT NOT NULL
);
CREATE INDEX ledger_time ON ledger (started_at);

-- Daily rollup of the ledger for the reports: one row per (UTC day, tenant, model, tier, feature),
-- maintained by the ledger writer from the rows it actually inserted (a replayed row adds nothing).
-- Columns mirror the report's aggregate definitions (gateway/src/ledger/report.rs).
CREATE TABLE ledger_daily (
    day                      TEXT NOT NULL,
    tenant_name              TEXT NOT NULL,
    model                    TEXT NOT NULL,
    tier                     TEXT NOT NULL,
    feature                  TEXT NOT NULL,
    requests                 INTEGER NOT NULL,
    cost                     INTEGER NOT NULL,
    prompt_tokens            INTEGER NOT NULL,
    completion_tokens        INTEGER NOT NULL,
    cached_tokens            INTEGER NOT NULL,
    saved                    INTEGER NOT NULL,
    cache_hits               INTEGER NOT NULL,
    waste_loops              INTEGER NOT NULL,
    waste_retries            INTEGER NOT NULL,
    waste_errors             INTEGER NOT NULL,
    useful_requests          INTEGER NOT NULL,
    billed_requests          INTEGER NOT NULL,
    billed_cost              INTEGER NOT NULL,
    billed_output_cost       INTEGER NOT NULL,
    billed_prompt_tokens     INTEGER NOT NULL,
    billed_completion_tokens INTEGER NOT NULL,
    PRIMARY KEY (day, tenant_name, model, tier, feature)
);
