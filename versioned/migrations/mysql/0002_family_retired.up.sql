-- {{.Retired}}: each consumer's newest poisoned message of each family (see
-- the PostgreSQL migration).
CREATE TABLE IF NOT EXISTS {{.Retired}} (
    consumer    varbinary(255) NOT NULL,
    family_kind varbinary(255) NOT NULL,
    family_id   varbinary(255) NOT NULL,
    order_key   varbinary(32)  NOT NULL,
    event_id    binary(16)     NOT NULL,
    updated_at  datetime(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, family_kind, family_id)
);
