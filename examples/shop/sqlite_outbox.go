package shop

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
)

// SQLiteSchema is a watermill-sql v4 schema adapter for SQLite, so the
// examples' outboxes (watermill-sql publisher + Watermill's forwarder) run on
// SQLite in the embedded demo; watermill-sql ships PostgreSQL and MySQL
// adapters only. It is an example, kept small:
//
//   - the table is "watermill_<topic>" with an AUTOINCREMENT "offset";
//   - the relay reads rows after its acked offset, in offset order.
//
// Why an offset is enough on SQLite (PostgreSQL needs transaction ids): with
// the DSN's _txlock=immediate every transaction takes the database's single
// write lock at BEGIN and keeps it until COMMIT, so rows get their offsets in
// commit order and a reader never sees a later offset before an earlier one
// committed. Without BEGIN IMMEDIATE (or with several processes writing
// through other settings) that argument does not hold.
type SQLiteSchema struct {
	// SubscribeBatchSize is the rows one read takes. Defaults to 100.
	SubscribeBatchSize int
}

var _ wsql.SchemaAdapter = SQLiteSchema{}

// MessagesTable is the quoted table of topic: "watermill_<topic>".
func (s SQLiteSchema) MessagesTable(topic string) string {
	return `"watermill_` + topic + `"`
}

// SchemaInitializingQueries implements wsql.SchemaAdapter: the messages table.
func (s SQLiteSchema) SchemaInitializingQueries(p wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	return []wsql.Query{{Query: `CREATE TABLE IF NOT EXISTS ` + s.MessagesTable(p.Topic) + ` (
    "offset"   INTEGER PRIMARY KEY AUTOINCREMENT,
    uuid       TEXT NOT NULL,
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    payload    BLOB,
    metadata   TEXT
)`}}, nil
}

// InsertQuery implements wsql.SchemaAdapter.
func (s SQLiteSchema) InsertQuery(p wsql.InsertQueryParams) (wsql.Query, error) {
	args := make([]any, 0, 3*len(p.Msgs))
	for _, m := range p.Msgs {
		md, err := json.Marshal(m.Metadata)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("metadata of %s: %w", m.UUID, err)
		}
		args = append(args, m.UUID, []byte(m.Payload), string(md))
	}
	q := `INSERT INTO ` + s.MessagesTable(p.Topic) + ` (uuid, payload, metadata) VALUES ` +
		strings.TrimSuffix(strings.Repeat(`(?,?,?),`, len(p.Msgs)), ",")
	return wsql.Query{Query: q, Args: args}, nil
}

// SelectQuery implements wsql.SchemaAdapter.
func (s SQLiteSchema) SelectQuery(p wsql.SelectQueryParams) (wsql.Query, error) {
	next, err := p.OffsetsAdapter.NextOffsetQuery(wsql.NextOffsetQueryParams{Topic: p.Topic, ConsumerGroup: p.ConsumerGroup})
	if err != nil {
		return wsql.Query{}, err
	}
	batch := s.SubscribeBatchSize
	if batch <= 0 {
		batch = 100
	}
	q := `SELECT "offset", uuid, payload, metadata FROM ` + s.MessagesTable(p.Topic) +
		` WHERE "offset" > (` + next.Query + `) ORDER BY "offset" LIMIT ` + fmt.Sprint(batch)
	return wsql.Query{Query: q, Args: next.Args}, nil
}

// UnmarshalMessage implements wsql.SchemaAdapter.
func (s SQLiteSchema) UnmarshalMessage(p wsql.UnmarshalMessageParams) (wsql.Row, error) {
	var r wsql.Row
	var uuid string
	var md sql.NullString
	if err := p.Row.Scan(&r.Offset, &uuid, &r.Payload, &md); err != nil {
		return wsql.Row{}, fmt.Errorf("could not scan message row: %w", err)
	}
	r.UUID = []byte(uuid)
	msg := message.NewMessage(uuid, r.Payload)
	if md.Valid {
		r.Metadata = []byte(md.String)
		if err := json.Unmarshal(r.Metadata, &msg.Metadata); err != nil {
			return wsql.Row{}, fmt.Errorf("could not unmarshal metadata as JSON: %w", err)
		}
	}
	r.Msg = msg
	return r, nil
}

// SubscribeIsolationLevel is the driver's default: SQLite transactions are
// serializable, and modernc.org/sqlite accepts no other level.
func (s SQLiteSchema) SubscribeIsolationLevel() sql.IsolationLevel { return sql.LevelDefault }

// SQLiteOffsetsAdapter stores a relay's acked offset per consumer group in
// "watermill_offsets_<topic>". See SQLiteSchema for why that is enough.
type SQLiteOffsetsAdapter struct{}

var _ wsql.OffsetsAdapter = SQLiteOffsetsAdapter{}

// MessagesOffsetsTable is the quoted offsets table of topic.
func (a SQLiteOffsetsAdapter) MessagesOffsetsTable(topic string) string {
	return `"watermill_offsets_` + topic + `"`
}

// SchemaInitializingQueries implements wsql.OffsetsAdapter.
func (a SQLiteOffsetsAdapter) SchemaInitializingQueries(p wsql.OffsetsSchemaInitializingQueriesParams) ([]wsql.Query, error) {
	return []wsql.Query{{Query: `CREATE TABLE IF NOT EXISTS ` + a.MessagesOffsetsTable(p.Topic) + ` (
    consumer_group  TEXT    NOT NULL PRIMARY KEY,
    offset_acked    INTEGER,
    offset_consumed INTEGER NOT NULL
)`}}, nil
}

// AckMessageQuery implements wsql.OffsetsAdapter.
func (a SQLiteOffsetsAdapter) AckMessageQuery(p wsql.AckMessageQueryParams) (wsql.Query, error) {
	return wsql.Query{
		Query: `INSERT INTO ` + a.MessagesOffsetsTable(p.Topic) + ` (consumer_group, offset_acked, offset_consumed) VALUES (?, ?, ?)
ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = excluded.offset_acked, offset_consumed = excluded.offset_consumed`,
		Args: []any{p.ConsumerGroup, p.LastRow.Offset, p.LastRow.Offset},
	}, nil
}

// ConsumedMessageQuery is empty: the write lock of the read transaction
// already keeps two relays of one group apart.
func (a SQLiteOffsetsAdapter) ConsumedMessageQuery(wsql.ConsumedMessageQueryParams) (wsql.Query, error) {
	return wsql.Query{}, nil
}

// NextOffsetQuery implements wsql.OffsetsAdapter.
func (a SQLiteOffsetsAdapter) NextOffsetQuery(p wsql.NextOffsetQueryParams) (wsql.Query, error) {
	return wsql.Query{
		Query: `SELECT COALESCE((SELECT offset_acked FROM ` + a.MessagesOffsetsTable(p.Topic) + ` WHERE consumer_group = ?), 0)`,
		Args:  []any{p.ConsumerGroup},
	}, nil
}

// BeforeSubscribingQueries implements wsql.OffsetsAdapter.
func (a SQLiteOffsetsAdapter) BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams) ([]wsql.Query, error) {
	return nil, nil
}
