// Package analyzer is idemvet's analysis: it reports effects that escape
// the transaction of a watermill-idempotency consumer. The consumer's
// middleware begins a transaction, claims (consumer, event_id), runs the
// handler with that transaction and commits or rolls back both together;
// an effect made any other way happens again on a redelivery, or survives
// a rolled-back attempt.
//
// The names the rules match (packages, types, methods, id generators) are
// tables in tables.go. Each diagnostic names its rule and the fix in one
// line; its Category is the rule's name.
//
// # Handlers
//
// Rules pool-write and http-outside-op apply in handlers. A handler is:
//
//   - the handler argument (the argument whose type is a function taking a
//     *message.Message) of (*middleware.Consumer).AddConsumerHandler or
//     .AddHandler, when it is a function literal, a function or method
//     (value) declared in the analysed package, a variable bound to a
//     function literal, a conversion of one of these
//     (message.HandlerFunc(f)), or a call of a function of the package that
//     returns one (a handler factory);
//   - a function declared in the package, or a function literal, whose type
//     takes a *message.Message first and whose body calls an attempt
//     accessor (middleware.PgxTxFromContext, SQLTxFromContext,
//     QuerierFromContext, sqldb.TxFromContext): it expects to run behind the
//     middleware wherever it is attached, another package included.
//
// In a handler the rules look into the function literals it contains
// (callbacks and goroutines included) and one level into the functions and
// methods declared in the package that it calls with a *message.Message or
// a context.Context argument; not further, and not into other packages.
//
// A handler declared in another package and attached with a consumer door
// (as pkg.F, a method value x.M, or a conversion of one) is reported at the
// handler argument, with its name and the finding's position: each package
// records (as an analysis fact) what the two rules find in its exported
// functions and methods of handler type that it did not check as handlers
// itself, after its own ignore directives. A handler reached through an
// interface or a struct field is not resolved.
//
// # pool-write: a write through a pool instead of the attempt's transaction
//
// In a handler, a call of a method of *pgxpool.Pool, *pgxpool.Conn,
// *pgx.Conn, *sql.DB or *sql.Conn (also when the handle is embedded):
//
//   - Exec, ExecContext, SendBatch, CopyFrom: reported as a write;
//   - Begin, BeginTx, and pgx.BeginFunc or pgx.BeginTxFunc given such a
//     handle: reported as a transaction of its own;
//   - Query, QueryContext, QueryRow, QueryRowContext: reported only when the
//     SQL (the first string argument) is a constant containing a statement
//     whose first keyword is INSERT, UPDATE, DELETE or MERGE, or a WITH
//     statement containing one of them (a data-modifying CTE; UPDATE after
//     FOR or KEY is a row lock). Comments, quoted strings and identifiers
//     are skipped.
//
// A read through the pool is outside the attempt too (it does not see the
// attempt's writes), but it is not reported: reads of reference data are
// often deliberate, and SQL that is not a constant is not classified.
// Not reported either: code of a handler that runs only when the
// accessor's ok result is false (if !ok { … }, the else of if ok, what
// follows an if ok { …; return }), a fallback for handlers that also run
// behind a plain router; pool use outside handlers (migrations, purgers,
// producers); handles behind an interface (a querier that prefers the
// attempt's transaction, an sqlc DBTX); *sql.Stmt, which may be bound to a
// transaction.
//
// # tx-end: the handler ends the attempt's transaction
//
// Anywhere in the package, on a variable assigned the first result of an
// attempt accessor, or on a parameter of a function of the package that is
// passed such a variable (one level):
//
//   - Commit or Rollback, deferred calls included;
//   - Exec or ExecContext of a constant containing a statement COMMIT, END,
//     ABORT, ROLLBACK (ROLLBACK AND CHAIN too, not ROLLBACK TO [SAVEPOINT]
//     name), PREPARE TRANSACTION, or RELEASE [SAVEPOINT] name unless the
//     same top-level declaration creates that savepoint with a constant
//     SAVEPOINT statement.
//
// A savepoint of pgx's nested transaction (sp, _ := tx.Begin(ctx)) is the
// handler's own: sp.Commit releases it and sp.Rollback rolls back to it,
// the attempt's transaction stays open, and neither is reported. A
// transaction the code began itself is not the attempt's and is not
// tracked. The tracking is by variable, not by flow: a variable assigned
// from an accessor stays tracked if it is reassigned later.
//
// # reception-id: an event id minted at reception
//
// Anywhere in the package except its _test.go files (a test produces the
// events it delivers, whatever helper builds them). A fresh id is a call of a generator in
// idGenerators (watermill.NewUUID, NewShortUUID, NewULID; uuid.New,
// NewString, NewRandom, NewV7, …; gofrs/uuid, ulid, ksuid, xid,
// shortuuid), its String(), a Must(…) or conversion of one, or a variable
// of the same top-level declaration assigned one. Name-based UUIDs
// (uuid.NewSHA1, NewMD5, NewHash) derive the id from their input and are
// not fresh. Reported:
//
//   - m.UUID = <fresh id> on a message.Message or *message.Message, unless
//     m is a variable of the same declaration assigned only
//     message.NewMessage(…) or a message.Message literal built from a
//     payload of its own (not another message's Payload), outside an
//     Unmarshal: that is a producer helper building its own message;
//   - message.NewMessage(<fresh id>, p), or a message.Message literal with
//     UUID <fresh id> and Payload p, where p reads another message's
//     Payload (directly or through a variable): a republished copy under a
//     new id;
//   - in an Unmarshal (a function or method whose name starts with
//     Unmarshal and that returns a *message.Message): any message built
//     with a fresh id, and any fresh id assigned to a UUID;
//   - a message built with a fresh id (the call, or a variable bound to it)
//     sent on a channel of *message.Message: a subscriber's delivery loop.
//
// Not reported: the new events that a producer or a handler creates (their
// id is minted once, when they are produced), fresh ids used for anything
// else (metadata, correlation ids).
//
// # http-outside-op: an HTTP call outside an operation key
//
// In a handler, a call of (*http.Client).Do, Get, Post, PostForm or Head,
// or of http.Get, Post, PostForm or Head, unless it is inside a function
// literal passed to (*operation.Runner).Do or .Run (directly, or through a
// variable bound to the literal) or in a function of the package that such
// a literal calls. http.NewRequest sends nothing; the Do that sends it is
// reported. Calls made by client libraries (their net/http calls are in
// their own packages) are not seen.
//
// # Silencing a diagnostic
//
// A comment //idemvet:ignore <reason> at the end of a line silences the
// diagnostics that start or end on that line; alone on a line, it silences
// those that start on the next line. The reason is required: a directive
// without one silences nothing and is reported itself.
package analyzer
