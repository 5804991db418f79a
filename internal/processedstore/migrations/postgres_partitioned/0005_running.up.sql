-- Attempts running inside watermill-sql's subscriber transaction (see the
-- plain layout's 0009_running).
CREATE TABLE IF NOT EXISTS {{.Schema}}{{.Q}}{{.Prefix}}_running{{.Q}} (
    attempt bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    running bigint NOT NULL CONSTRAINT idempotency_attempt_running
        REFERENCES {{.Schema}}{{.Q}}{{.Prefix}}_running{{.Q}} (attempt) DEFERRABLE INITIALLY DEFERRED
);
