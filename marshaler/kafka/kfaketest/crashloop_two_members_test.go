package kfaketest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
)

const (
	marksChildEnv = "CRASHLOOP_MARKS_CHILD" // the member's name
	marksTopic    = "marksrec"
	marksDLQ      = "marksrec.dlq"
)

func init() { memberMain(marksChildEnv, marksChild) }

// marksChild is a member of group "marksrec": the event CRASHLOOP_BEFORE
// fails while the row of table dep says the dependency is down (the chain
// retries it for ever); the event CRASHLOOP_POISON kills the process.
// Every handler call is recorded (autocommit) in table attempt.
func marksChild(name string) error {
	logger := watermill.LoggerAdapter(watermill.NopLogger{})
	if os.Getenv("KFAKE_DEBUG") != "" {
		logger = watermill.NewStdLoggerWithOut(os.Stderr, true, false)
	}
	poison, before := os.Getenv("CRASHLOOP_POISON"), os.Getenv("CRASHLOOP_BEFORE")
	return runCrashMember(crashMemberSpec{
		topic: marksTopic, dlqTopic: marksDLQ, consumers: []string{marksTopic},
		retry:  middleware.RetryConfig{MaxRetries: 100000, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond},
		logger: logger,
		handle: func(_ string, pool *pgxpool.Pool) message.NoPublishHandlerFunc {
			return func(msg *message.Message) error {
				if _, err := pool.Exec(context.Background(), `INSERT INTO attempt (member, event_id) VALUES ($1, $2)`, name, msg.UUID); err != nil {
					return err
				}
				switch msg.UUID {
				case poison:
					fmt.Fprintln(os.Stderr, "marks child", name, ": poisoned event, SIGKILL")
					_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
					select {}
				case before:
					var up bool
					if err := pool.QueryRow(context.Background(), `SELECT up FROM dep`).Scan(&up); err != nil {
						return err
					}
					if !up {
						return errors.New("marks child: the dependency is down")
					}
				}
				tx, _ := middleware.PgxTxFromContext(msg.Context())
				_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
				return err
			}
		},
	})
}

// Two live members of one group on a one-partition topic, while a
// dependency is down: member a holds the record before the poisoned one,
// retrying it (each attempt fails after its claim inserted); member b joins,
// the rebalance moves the partition to b (a is stuck in its handler and
// leaves the group), and b's attempts of that record fail too. The
// dependency comes back: the record is applied once, and the poisoned record
// after it reaches a, then b, or b, then a. Each of them ended an attempt
// of a new event at the record right before it, so neither death is
// counted; only the members restarted afterwards count. transports.md
// (Kafka): dead-lettered at "delivery MaxCrashes+1, MaxCrashes+2 when it
// reached a consumer past its first 64 attempts right after the record
// before it (first, or when its partition came back to that consumer from
// one that died on it)", so at most MaxCrashes+1 members die.
func TestKafkaPoisonAfterARecordTwoLiveMembersFailedOnKillsAtMostMaxCrashesPlusOneMembers(t *testing.T) {
	r := newCrashRig(t, 1, marksTopic, marksDLQ, `CREATE TABLE effect (event_id text NOT NULL);
		CREATE TABLE attempt (member text NOT NULL, event_id text NOT NULL);
		CREATE TABLE dep (up bool NOT NULL); INSERT INTO dep VALUES (false)`)
	ids := r.publish(5)
	before, poison := ids[0], ids[1]

	type child struct {
		name string
		*crashMember
	}
	var children []*child
	start := func(name string) {
		m := r.start(marksChildEnv+"="+name, "CRASHLOOP_POISON="+poison, "CRASHLOOP_BEFORE="+before)
		children = append(children, &child{name: name, crashMember: m})
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("member %s output:\n%s", name, m.out.String())
			}
		})
	}
	const guard = 2 * time.Minute // hang guards, not measurements
	attemptsOf := func(member string) int {
		return r.count(`SELECT count(*) FROM attempt WHERE member = $1 AND event_id = $2`, member, before)
	}

	// a holds the record before the poison, past its first 64 attempts.
	start("a")
	testenv.Eventually(t, guard, "a attempted the record before the poison 70 times", func(o *testenv.Observed) bool {
		return o.Int("attempts", attemptsOf("a")) >= 70
	})
	// b joins: the partition moves to b while a is stuck retrying.
	start("b")
	testenv.Eventually(t, guard, "b attempted the record before the poison 70 times", func(o *testenv.Observed) bool {
		return o.Int("attempts", attemptsOf("b")) >= 70
	})
	_, err := r.pool.Exec(r.ctx, `UPDATE dep SET up = true`)
	require.NoError(t, err)

	var dead []string
	deaths, restarts := 0, 0
	var order []string
	deadline := time.Now().Add(5 * time.Minute)
	for {
		for _, m := range r.deadLetters() {
			dead = append(dead, m.UUID)
		}
		if len(dead) > 0 && r.count(`SELECT count(DISTINCT event_id) FROM effect`)+len(dead) >= len(r.msgs) {
			break
		}
		live := 0
		for _, ch := range children {
			select {
			case <-ch.exited:
				if !strings.HasPrefix(ch.name, "counted:") {
					ch.requireKilled(t)
					deaths++
					order = append(order, ch.name)
					ch.name = "counted:" + ch.name
				}
			default:
				live++
			}
		}
		if deaths > middleware.DefaultMaxCrashes+3 {
			break
		}
		if live == 0 {
			restarts++
			start(fmt.Sprintf("restart%d", restarts))
		}
		if time.Now().After(deadline) {
			t.Fatalf("neither dead-lettered nor finished; %d deaths", deaths)
		}
		time.Sleep(200 * time.Millisecond)
	}
	var poisonAttempts []string
	rows, err := r.pool.Query(r.ctx, `SELECT member FROM attempt WHERE event_id = $1`, poison)
	require.NoError(t, err)
	for rows.Next() {
		var m string
		require.NoError(t, rows.Scan(&m))
		poisonAttempts = append(poisonAttempts, m)
	}
	rows.Close()
	t.Logf("%d deaths (in order %v), the poison attempted by %v, dead letters %d, crash counts %v", deaths, order, poisonAttempts, len(dead), r.crashCounts(poison))
	require.Equal(t, 1, r.count(`SELECT count(*) FROM effect WHERE event_id = $1`, before), "the record before the poison applied once")
	require.Equal(t, []string{poison}, dead, "only the poisoned record is dead-lettered")
	require.LessOrEqual(t, deaths, middleware.DefaultMaxCrashes+1,
		"members killed by the poisoned record before its dead letter (documented worst case: dead letter at delivery MaxCrashes+2)")
}
