-- Model prices with history, and the cost ledger, partitioned by ISO week.
CREATE TABLE prices (
    model                         TEXT NOT NULL,
    effective_from                TIMESTAMPTZ NOT NULL,
    input_micros_per_mtok         BIGINT NOT NULL,
    output_micros_per_mtok        BIGINT NOT NULL,
    cached_input_micros_per_mtok  BIGINT NOT NULL,
    PRIMARY KEY (model, effective_from)
);

-- One row per request. Partitions (one per week, Monday 00:00 UTC) are created by the ledger
-- writer before it writes into a week; the default partition catches anything else.
CREATE TABLE ledger (
    request_id          TEXT NOT NULL,
    started_at          TIMESTAMPTZ NOT NULL,
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
    prompt_tokens       BIGINT NOT NULL,
    completion_tokens   BIGINT NOT NULL,
    cached_tokens       BIGINT NOT NULL,
    usage_source        TEXT NOT NULL,
    cost_micros         BIGINT NOT NULL,
    output_cost_micros  BIGINT NOT NULL,
    saved_micros        BIGINT NOT NULL,
    cache_status        TEXT NOT NULL,
    status              INTEGER NOT NULL,
    error_kind          TEXT,
    stream              BOOLEAN NOT NULL,
    client_disconnected BOOLEAN NOT NULL,
    latency_ms          DOUBLE PRECISION NOT NULL,
    ttft_ms             DOUBLE PRECISION,
    retries             INTEGER NOT NULL,
    loop_flag           BOOLEAN NOT NULL,
    retry_storm_flag    BOOLEAN NOT NULL,
    fingerprint         TEXT NOT NULL,
    -- The partition key must be part of the key; a request id has exactly one start time, so
    -- replaying a row is still a no-op (ON CONFLICT DO NOTHING).
    PRIMARY KEY (started_at, request_id)
) PARTITION BY RANGE (started_at);
CREATE TABLE ledger_default PARTITION OF ledger DEFAULT;
-- Time ranges use the primary key (started_at first) and partition pruning; per-tenant and
-- per-dimension reports read ledger_daily, so no further index is paid for on every insert.

-- Daily rollup of the ledger for the reports: one row per (UTC day, tenant, model, tier, feature),
-- maintained by the ledger writer from the rows it actually inserted (a replayed row adds nothing).
-- Columns mirror the report's aggregate definitions (gateway/src/ledger/report.rs).
CREATE TABLE ledger_daily (
    day                      DATE NOT NULL,
    tenant_name              TEXT NOT NULL,
    model                    TEXT NOT NULL,
    tier                     TEXT NOT NULL,
    feature                  TEXT NOT NULL,
    requests                 BIGINT NOT NULL,
    cost                     BIGINT NOT NULL,
    prompt_tokens            BIGINT NOT NULL,
    completion_tokens        BIGINT NOT NULL,
    cached_tokens            BIGINT NOT NULL,
    saved                    BIGINT NOT NULL,
    cache_hits               BIGINT NOT NULL,
    waste_loops              BIGINT NOT NULL,
    waste_retries            BIGINT NOT NULL,
    waste_errors             BIGINT NOT NULL,
    useful_requests          BIGINT NOT NULL,
    billed_requests          BIGINT NOT NULL,
    billed_cost              BIGINT NOT NULL,
    billed_output_cost       BIGINT NOT NULL,
    billed_prompt_tokens     BIGINT NOT NULL,
    billed_completion_tokens BIGINT NOT NULL,
    PRIMARY KEY (day, tenant_name, model, tier, feature)
);
