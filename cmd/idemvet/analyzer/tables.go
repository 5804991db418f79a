package analyzer

// The names the rules match, in one place so that they can be adjusted when
// the library's API moves. The analyzer never imports these packages: it
// compares the import paths and names of the objects it sees, so the
// analysed code decides which versions are in use.

// Import paths.
const (
	middlewarePath = "github.com/watermill-idempotency/idempotency/middleware"
	operationPath  = "github.com/watermill-idempotency/idempotency/operation"
	sqldbPath      = "github.com/watermill-idempotency/idempotency/sqldb"
	watermillPath  = "github.com/ThreeDotsLabs/watermill"
	messagePath    = "github.com/ThreeDotsLabs/watermill/message"
	pgxPath        = "github.com/jackc/pgx/v5"
	pgxpoolPath    = "github.com/jackc/pgx/v5/pgxpool"
	httpPath       = "net/http"
)

// consumerType and consumerDoors: the methods of *middleware.Consumer that
// attach a handler behind the consumer's middleware. The handler is the
// argument whose type is a function taking a *message.Message.
const consumerType = "Consumer"

var consumerDoors = set("AddConsumerHandler", "AddHandler")

// runnerType and operationScopes: the methods of *operation.Runner whose
// function arguments run inside an operation key. The first name is the one
// diagnostics recommend.
const runnerType = "Runner"

var operationScopes = []string{"Do", "Run"}

var operationScopeSet = set(operationScopes...)

// attemptTxAccessors return the attempt's transaction as their first result.
var attemptTxAccessors = []funcRef{
	{middlewarePath, "PgxTxFromContext"},
	{middlewarePath, "SQLTxFromContext"},
	{middlewarePath, "QuerierFromContext"},
	{middlewarePath, "TxFromContext"},
	{sqldbPath, "TxFromContext"},
}

// outsideHandle is a database handle that is not the attempt's transaction:
// statements on it run in a session (and a transaction) of their own.
type outsideHandle struct {
	pkg, name string // the named type; methods are matched by receiver
	display   string // how diagnostics name it
	accessor  string // what a handler should use instead
}

var outsideHandles = []outsideHandle{
	{pgxpoolPath, "Pool", "*pgxpool.Pool", "middleware.PgxTxFromContext"},
	{pgxpoolPath, "Conn", "*pgxpool.Conn", "middleware.PgxTxFromContext"},
	{pgxPath, "Conn", "*pgx.Conn", "middleware.PgxTxFromContext"},
	{"database/sql", "DB", "*sql.DB", "middleware.SQLTxFromContext"},
	{"database/sql", "Conn", "*sql.Conn", "middleware.SQLTxFromContext"},
}

// Methods of an outside handle that are reported whatever their SQL: they
// write, or begin a transaction of their own.
var handleWrites = set("Exec", "ExecContext", "SendBatch", "CopyFrom")
var handleBegins = set("Begin", "BeginTx")

// Methods of an outside handle that are reported only when their SQL is a
// constant whose statement writes (writeKeywords).
var handleQueries = set("Query", "QueryContext", "QueryRow", "QueryRowContext")

// beginFuncs take a database handle as their second argument and run a
// transaction of their own on it (pgx.BeginFunc(ctx, db, fn)).
var beginFuncs = []funcRef{
	{pgxPath, "BeginFunc"},
	{pgxPath, "BeginTxFunc"},
}

// writeKeywords: a statement whose first keyword is one of these writes; so
// does a WITH statement containing one (a data-modifying CTE), except
// UPDATE after FOR or KEY (SELECT … FOR [NO KEY] UPDATE).
var writeKeywords = set("INSERT", "UPDATE", "DELETE", "MERGE")

// txEndMethods end a transaction when called on it.
var txEndMethods = set("Commit", "Rollback")

// execMethods run a statement on a transaction; their constant SQL is
// checked for statements that end the transaction (endsTransaction).
var execMethods = set("Exec", "ExecContext")

// newMessageFuncs build a message from (id, payload).
var newMessageFuncs = set("NewMessage")

// idGenerators mint a new identifier at each call (random or time-based).
// Name-based UUIDs (uuid.NewMD5, uuid.NewSHA1, uuid.NewHash) are derived
// from their input, so an id derived from the incoming message is not
// minted: they are not listed.
var idGenerators = map[string]map[string]bool{
	watermillPath: set("NewUUID", "NewShortUUID", "NewULID"),
	"github.com/google/uuid": set("New", "NewString", "NewRandom", "NewRandomFromReader",
		"NewUUID", "NewV6", "NewV7", "NewV7FromReader", "NewDCESecurity", "NewDCEPerson", "NewDCEGroup"),
	"github.com/gofrs/uuid":             set("NewV1", "NewV4", "NewV6", "NewV7"),
	"github.com/gofrs/uuid/v5":          set("NewV1", "NewV4", "NewV6", "NewV7"),
	"github.com/oklog/ulid":             set("Make", "MustNew", "New"),
	"github.com/oklog/ulid/v2":          set("Make", "MustNew", "New"),
	"github.com/segmentio/ksuid":        set("New"),
	"github.com/rs/xid":                 set("New"),
	"github.com/lithammer/shortuuid/v3": set("New"),
	"github.com/lithammer/shortuuid/v4": set("New"),
}

// HTTP calls (rule http-outside-operation): methods of *http.Client, and
// the package functions that use http.DefaultClient. http.NewRequest alone
// sends nothing; the Do that sends it is reported.
var (
	httpClientMethods = set("Do", "Get", "Post", "PostForm", "Head")
	httpFuncs         = set("Get", "Post", "PostForm", "Head")
)

type funcRef struct{ pkg, name string }

func set(names ...string) map[string]bool {
	m := make(map[string]bool, len(names))
	for _, n := range names {
		m[n] = true
	}
	return m
}
