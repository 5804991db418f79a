-- Attempts running inside watermill-sql's subscriber transaction
-- (ConsumerConfig.JoinSQLSubscriber): each writes a row here after its
-- claim and deletes it when it ends. The row's deferred foreign key points
-- at no row, so a COMMIT made while it is there fails (23503,
-- idempotency_attempt_running) and rolls the whole transaction back:
-- watermill-sql commits its batch when a message outlives the
-- subscriber's AckDeadline or the subscriber closes, and a handler may run
-- COMMIT; none of them may commit a running attempt's claim with part of
-- its effects. No row is ever committed.
CREATE TABLE IF NOT EXISTS {{.IndexSchema}}"{{.Prefix}}_running" (
    attempt bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    running bigint NOT NULL CONSTRAINT idempotency_attempt_running
        REFERENCES {{.IndexSchema}}"{{.Prefix}}_running" (attempt) DEFERRABLE INITIALLY DEFERRED
);
