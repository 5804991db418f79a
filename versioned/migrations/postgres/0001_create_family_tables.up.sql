-- The latest-per-family tables (versioned.FamilyStore).
--
-- {{.Latest}}: the latest message published in each family, advanced by
-- versioned.LatestPublisher in the producer's transaction. order_key is
-- versioned.Position.MarshalBinary: comparing two keys bytewise (bytea
-- comparison) compares the positions, to the nanosecond. event_id, seq and
-- occurred_at (microseconds) are there for people reading the table.
CREATE TABLE IF NOT EXISTS {{.Latest}} (
    family_kind text        NOT NULL,
    family_id   text        NOT NULL,
    order_key   bytea       NOT NULL,
    event_id    uuid        NOT NULL,
    seq         bigint,
    occurred_at timestamptz,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (family_kind, family_id)
);

CREATE INDEX IF NOT EXISTS {{.LatestName}}_updated_at_idx ON {{.Latest}} (updated_at);

-- {{.Applied}}: the last message of each family that each consumer let
-- through to its handler, written in the handler's transaction by
-- versioned.LatestFilter. Its row lock also serialises one consumer's
-- concurrent handlers of one family.
CREATE TABLE IF NOT EXISTS {{.Applied}} (
    consumer    text        NOT NULL,
    family_kind text        NOT NULL,
    family_id   text        NOT NULL,
    order_key   bytea       NOT NULL,
    event_id    uuid        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, family_kind, family_id)
);

CREATE INDEX IF NOT EXISTS {{.AppliedName}}_updated_at_idx ON {{.Applied}} (updated_at);
