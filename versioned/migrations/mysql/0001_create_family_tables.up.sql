-- The latest-per-family tables (versioned.FamilyStore) for MySQL 8.0.13+ /
-- MariaDB 10.11+. Text that is compared (family kind and id, consumer) is
-- VARBINARY: compared byte by byte, without the case folding and the
-- trailing-space padding of the default collations. order_key is
-- versioned.Position.MarshalBinary (25 or 29 bytes), compared bytewise;
-- event_id is the UUID's 16 bytes; times are UTC. Index names are per table
-- in MySQL: they need no table prefix (and stay within 64 characters).
--
-- {{.Latest}}: the latest message published in each family, advanced by
-- versioned.LatestPublisher in the producer's transaction.
CREATE TABLE IF NOT EXISTS {{.Latest}} (
    family_kind varbinary(255) NOT NULL,
    family_id   varbinary(255) NOT NULL,
    order_key   varbinary(32)  NOT NULL,
    event_id    binary(16)     NOT NULL,
    seq         bigint,
    occurred_at datetime(6),
    updated_at  datetime(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (family_kind, family_id),
    KEY updated_at_idx (updated_at)
);

-- {{.Applied}}: the last message of each family that each consumer let
-- through to its handler, written in the handler's transaction by
-- versioned.LatestFilter. Its row lock also serialises one consumer's
-- concurrent handlers of one family.
CREATE TABLE IF NOT EXISTS {{.Applied}} (
    consumer    varbinary(255) NOT NULL,
    family_kind varbinary(255) NOT NULL,
    family_id   varbinary(255) NOT NULL,
    order_key   varbinary(32)  NOT NULL,
    event_id    binary(16)     NOT NULL,
    updated_at  datetime(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, family_kind, family_id),
    KEY updated_at_idx (updated_at)
);
