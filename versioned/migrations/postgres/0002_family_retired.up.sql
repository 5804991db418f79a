-- {{.Retired}}: for each consumer and family, the newest message that was
-- poisoned there (never to be applied), written by
-- LatestFilter.RetireOnPoison outside the failed transaction. A latest record
-- that names a retired message no longer makes older messages obsolete for
-- that consumer, so the family is not frozen behind a message that will
-- never be applied. order_key as in {{.Applied}}.
CREATE TABLE IF NOT EXISTS {{.Retired}} (
    consumer    text        NOT NULL,
    family_kind text        NOT NULL,
    family_id   text        NOT NULL,
    order_key   bytea       NOT NULL,
    event_id    uuid        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, family_kind, family_id)
);
