-- Attempts of redelivered messages that started and have not ended (see the
-- plain layout's 0006_crashes).
CREATE TABLE IF NOT EXISTS {{.Schema}}{{.Q}}{{.Prefix}}_crash{{.Q}} (
    consumer text NOT NULL,
    event_id uuid NOT NULL,
    started  int  NOT NULL,
    PRIMARY KEY (consumer, event_id)
);
