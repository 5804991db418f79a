-- The operations table: one row per operation key (an external effect such as
-- a payment), created "started" and committed before the external call, so a
-- crash after the call leaves evidence. Rows are never deleted on error; they
-- only move to succeeded, failed or uncertain, and only their owner moves them.
--   key          the operation key, "kind:entity[:intent…]"
--   fingerprint  SHA-256 hex of the canonical JSON of the request's parameters
--   state        started | succeeded | failed | uncertain
--   reference    the provider's reference (charge id, message id), if known
--   result       opaque bytes recorded with success (a provider response)
--   error        text of the last rejection, timeout or transient error
--   attempts     attempts that took the key (called or reconciled)
--   owner        token of the attempt that owns the row; NULL on a started
--                row means no call can be in flight (the last one certainly
--                had no effect), so the next attempt may call
CREATE TABLE IF NOT EXISTS {{.Table}} (
    key         text        NOT NULL PRIMARY KEY,
    kind        text        NOT NULL,
    fingerprint text        NOT NULL,
    state       text        NOT NULL,
    reference   text,
    result      bytea,
    error       text,
    attempts    integer     NOT NULL DEFAULT 0,
    owner       uuid,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    CONSTRAINT {{.Prefix}}_state_check
        CHECK (state IN ('started', 'succeeded', 'failed', 'uncertain'))
);

-- Open operations (to list what needs reconciliation), oldest first.
CREATE INDEX IF NOT EXISTS {{.Prefix}}_open_idx ON {{.Table}} (updated_at)
    WHERE state IN ('started', 'uncertain');
