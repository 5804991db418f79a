-- The relay lock is a lease, not a row lock held by a transaction: a relay
-- publishes with no transaction open. owner is the holding relay's token;
-- beat_us (from now on) the lease's expiry (the database clock, µs), after
-- which another relay may take it over.
ALTER TABLE {{.Lock}} ADD COLUMN owner varchar(64) NOT NULL DEFAULT '';
