-- Attempts of redelivered messages that started and have not ended: a
-- row is written (started + 1) before an attempt of a delivery the broker
-- marks as redelivered, and deleted when the attempt ends, whatever its
-- outcome. A count that grows is a message that kills the process (OOM, a
-- fatal error, os.Exit, a liveness probe); past the consumer's bound it is
-- dead-lettered instead of crashing every consumer that receives it. First
-- deliveries write nothing here.
CREATE TABLE IF NOT EXISTS {{.IndexSchema}}`{{.Prefix}}_crash` (
    consumer varbinary(255) NOT NULL,
    event_id binary(16) NOT NULL,
    started  int NOT NULL,
    PRIMARY KEY (consumer, event_id)
);
