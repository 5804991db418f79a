package amqp_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// The child of TestBystanderOfCrashingMessageIsNeverDeadLetteredAsCrashLoop:
// one process, two consumers (two handlers on one router, as a service with
// two subscriptions has), each with its own queue. The "killer" consumer's
// handler SIGKILLs the process on the poisoned event, once the "bystander"
// consumer's handler is running an innocent event; the bystander's handler
// never crashes by itself: it only runs while the process is killed.
func init() {
	if os.Getenv("IDEM_BYSTANDER_CHILD") == "" {
		return
	}
	if err := bystanderChild(); err != nil {
		fmt.Fprintln(os.Stderr, "bystander child:", err)
		os.Exit(2)
	}
	os.Exit(3)
}

func bystanderChild() error {
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	pcfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return err
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv("IDEM_BYSTANDER_SCHEMA")
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	poison := os.Getenv("IDEM_BYSTANDER_POISON")
	bystanderIn := make(chan struct{})
	var once sync.Once
	for _, name := range []string{"killer", "bystander"} {
		queue := os.Getenv("IDEM_BYSTANDER_QUEUE") + "." + name
		cfg := crashLoopConfig(queue, false)
		sub, err := wamqp.NewSubscriber(cfg, logger)
		if err != nil {
			return err
		}
		dl := idamqp.DeadLetterConfig{Subscriber: cfg, Topic: queue + ".dlq"}
		pubCfg, err := idamqp.DeclareDeadLetter(dl)
		if err != nil {
			return err
		}
		pub, err := idamqp.NewConfirmedPublisher(pubCfg, logger)
		if err != nil {
			return err
		}
		c, err := middleware.NewConsumer(middleware.ConsumerConfig{
			Consumer: name, DB: idempotency.Pgx(pool),
			Poison: middleware.PoisonConfig{Publisher: pub, Topic: dl.PoisonTopic()},
		}, logger)
		if err != nil {
			return err
		}
		name := name
		if _, err := c.AddConsumerHandler(router, name, queue, sub, func(msg *message.Message) error {
			if name == "killer" && msg.UUID == poison {
				select { // the bystander's attempt is running (bounded: a hang guard)
				case <-bystanderIn:
				case <-time.After(3 * time.Second):
				}
				fmt.Fprintln(os.Stderr, "bystander child: poisoned event, SIGKILL")
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {}
			}
			if name == "bystander" {
				once.Do(func() { close(bystanderIn) })
				// A slow but healthy handler: it is running when the
				// killer kills the process.
				time.Sleep(2 * time.Second)
			}
			tx, _ := middleware.PgxTxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), `INSERT INTO effect (consumer, event_id) VALUES ($1, $2)`, name, msg.UUID)
			return err
		}); err != nil {
			return err
		}
	}
	return router.Run(context.Background())
}

// A message that never kills the process, handled by another consumer of
// the same process while a crashing message kills it, must not be
// dead-lettered as a crash loop: guarantees.md promises that a message
// that kills the process is dead-lettered "and the messages behind it are
// applied". Its attempts start and never end only because the other
// message killed the process, and they are counted in <table>_crash like
// the killer's: after MaxCrashes such deaths it is dead-lettered with
// reason crash_loop at the same delivery as the killer.
func TestBystanderOfCrashingMessageIsNeverDeadLetteredAsCrashLoop(t *testing.T) {
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	_, err := pool.Exec(ctx, `CREATE TABLE effect (consumer text NOT NULL, event_id text NOT NULL)`)
	require.NoError(t, err)

	base := testenv.UniqueName("bystander")
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	queues := []string{base + ".killer", base + ".bystander"}
	t.Cleanup(func() {
		for _, q := range queues {
			_, _ = ch.QueueDelete(q, false, false, false)
			_, _ = ch.QueueDelete(q+".dlq", false, false, false)
		}
	})
	for _, q := range queues {
		_, err = ch.QueueDeclare(q, true, false, false, false, nil)
		require.NoError(t, err)
		_, err = ch.QueueDeclare(q+".dlq", true, false, false, false, nil)
		require.NoError(t, err)
	}
	poison, err := marshaler.NewMessage("order.placed", map[string]int{"n": 1})
	require.NoError(t, err)
	innocent, err := marshaler.NewMessage("order.placed", map[string]int{"n": 2})
	require.NoError(t, err)
	publishConfirmed(t, queues[0], []*message.Message{poison})
	publishConfirmed(t, queues[1], []*message.Message{innocent})

	deadLetters := func(q string) []string {
		var out []string
		for {
			d, ok, err := ch.Get(q+".dlq", true)
			require.NoError(t, err)
			if !ok {
				return out
			}
			m, err := idamqp.Marshaler{}.Unmarshal(d)
			require.NoError(t, err)
			out = append(out, m.UUID+" ("+m.Metadata.Get("reason_poisoned")+")")
		}
	}
	var deadKiller, deadBystander []string
	crashes := 0
	for done := false; !done; {
		require.LessOrEqual(t, crashes, 8, "the poisoned event was never dead-lettered")
		var out strings.Builder
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "IDEM_BYSTANDER_CHILD=1", "IDEM_BYSTANDER_SCHEMA="+schema,
			"IDEM_BYSTANDER_POISON="+poison.UUID, "IDEM_BYSTANDER_QUEUE="+base)
		cmd.Stdout, cmd.Stderr = &out, &out
		require.NoError(t, cmd.Start())
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		deadline := time.Now().Add(2 * time.Minute) // a hang guard
		for {
			select {
			case <-exited:
				ws := cmd.ProcessState.Sys().(syscall.WaitStatus)
				require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "child ended with %s:\n%s", cmd.ProcessState, out.String())
				crashes++
			case <-time.After(200 * time.Millisecond):
				deadKiller = append(deadKiller, deadLetters(queues[0])...)
				deadBystander = append(deadBystander, deadLetters(queues[1])...)
				var applied int
				require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect WHERE consumer = 'bystander'`).Scan(&applied))
				if len(deadKiller) > 0 && (applied > 0 || len(deadBystander) > 0) {
					_ = cmd.Process.Kill()
					<-exited
					done = true
				} else if time.Now().After(deadline) {
					_ = cmd.Process.Kill()
					<-exited
					t.Fatalf("child %d neither crashed nor finished:\n%s", crashes+1, out.String())
				} else {
					continue
				}
			}
			break
		}
	}
	t.Logf("killer dead-lettered after %d crashes: %v", crashes, deadKiller)
	require.Empty(t, deadBystander, "the bystander, which never killed the process, was dead-lettered")
	var applied int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect WHERE consumer = 'bystander' AND event_id = $1`, innocent.UUID).Scan(&applied))
	require.Equal(t, 1, applied, "the bystander's event is applied once")
}
