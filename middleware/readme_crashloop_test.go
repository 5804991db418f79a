package middleware_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// The README says after how many crashes a message that kills the process
// is dead-lettered on RabbitMQ, and at which delivery: the numbers the
// default MaxCrashes gives when deliveries are marked as RabbitMQ marks
// them (the first with redelivered false, every later one true; the crash
// tests of marshaler/amqp run the same on a real broker). Consumer
// processes die by SIGKILL in the handler, one per delivery, until one
// dead-letters the message instead of calling the handler.
func TestREADMEStatesAfterHowManyCrashesRabbitMQDeadLetters(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	schema := schemaOf(t, e.pool)
	event := newEvent(t).UUID
	crashes := 0
	for delivery := 1; ; delivery++ {
		require.LessOrEqual(t, delivery, middleware.DefaultMaxCrashes+3, "never dead-lettered")
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_SCHEMA="+schema, "CHILD_EVENT="+event, "CHILD_MARKED=true",
			fmt.Sprintf("CHILD_REDELIVERED=%t", delivery > 1))
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		require.True(t, errors.As(err, &exit), "delivery %d: %v %s", delivery, err, out)
		if ws := exit.Sys().(syscall.WaitStatus); ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			crashes++
			continue
		}
		// Not killed: the handler was not called, the message was
		// dead-lettered and acked (the handler returned nil).
		require.Contains(t, string(out), "the handler returned: <nil>", "delivery %d", delivery)
		break
	}
	words := []string{"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"}
	ordinals := []string{"zeroth", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"}
	require.Less(t, crashes+1, len(words))

	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	text := strings.Join(strings.Fields(string(readme)), " ") // lines unwrapped
	want := fmt.Sprintf("On RabbitMQ its first delivery is not counted, so with the default it is dead-lettered at its %s delivery, after %s crashes",
		ordinals[crashes+1], words[crashes])
	require.Contains(t, text, want, "README's crash-loop line")
	require.NotRegexp(t, regexp.MustCompile(`dead-lettered after \w+ crashes\.`), text, "a count stated without its transport")
}
