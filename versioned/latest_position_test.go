package versioned_test

import (
	"bytes"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/versioned"
)

func TestPositionOrder(t *testing.T) {
	t.Parallel()
	idLo, idHi := uuid.MustParse(lfE1), uuid.MustParse(lfE2)
	at := time.Date(2024, 7, 1, 10, 0, 2, 0, time.UTC)
	paris := time.FixedZone("CEST", 2*3600)
	cases := []struct {
		name       string
		older, new versioned.Position
	}{
		{"time", versioned.TimePosition(at, idHi), versioned.TimePosition(at.Add(time.Nanosecond), idLo)},
		{"same instant, other offset: event id decides", versioned.TimePosition(at, idLo), versioned.TimePosition(at.In(paris), idHi)},
		{"before 1970", versioned.TimePosition(time.Date(1969, 12, 31, 23, 59, 59, 999999999, time.UTC), idHi), versioned.TimePosition(time.Unix(0, 0), idLo)},
		{"year 0000", versioned.TimePosition(time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC), idHi), versioned.TimePosition(time.Time{}, idLo)},
		{"seq", versioned.SeqPosition(9, idHi), versioned.SeqPosition(10, idLo)},
		{"same seq: event id decides", versioned.SeqPosition(10, idLo), versioned.SeqPosition(10, idHi)},
		{"numbered beats unnumbered", versioned.TimePosition(time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC), idHi), versioned.SeqPosition(0, idLo)},
		{"large seq", versioned.SeqPosition(1<<62, idHi), versioned.SeqPosition(1<<63-1, idLo)},
	}
	for _, c := range cases {
		require.Equal(t, -1, c.older.Compare(c.new), c.name)
		require.Equal(t, 1, c.new.Compare(c.older), c.name)
		require.True(t, c.new.After(c.older), c.name)
		require.False(t, c.older.After(c.new), c.name)
		require.Zero(t, c.new.Compare(c.new), c.name)
		a, _ := c.older.MarshalBinary()
		b, _ := c.new.MarshalBinary()
		require.Equal(t, -1, bytes.Compare(a, b), c.name)
	}
}

// The encoding preserves the order (bytes.Compare = Compare, which is the
// reference order computed field by field here) and round-trips.
func TestPositionEncodingProperty(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(42, 43))
	random := func() versioned.Position {
		var id uuid.UUID
		for i := range id {
			id[i] = byte(r.IntN(3)) // few values: many ties
		}
		if r.IntN(3) == 0 {
			return versioned.SeqPosition(r.Int64N(4), id)
		}
		sec := r.Int64N(5) - 2 // around 1970, both signs
		if r.IntN(2) == 0 {
			sec = r.Int64N(1<<37) - 1<<36 // years far either side
		}
		return versioned.TimePosition(time.Unix(sec, r.Int64N(3)*333333333).In(time.FixedZone("", (r.IntN(5)-2)*3600)), id)
	}
	reference := func(a, b versioned.Position) int {
		switch {
		case a.HasSeq != b.HasSeq:
			if a.HasSeq {
				return 1
			}
			return -1
		case a.HasSeq && a.Seq != b.Seq:
			if a.Seq < b.Seq {
				return -1
			}
			return 1
		case !a.HasSeq && !a.At.Equal(b.At):
			if a.At.Before(b.At) {
				return -1
			}
			return 1
		}
		return bytes.Compare(a.EventID[:], b.EventID[:])
	}
	for i := 0; i < 5000; i++ {
		a, b := random(), random()
		require.Equal(t, reference(a, b), a.Compare(b), "%s vs %s", a, b)
		ka, _ := a.MarshalBinary()
		var back versioned.Position
		require.NoError(t, back.UnmarshalBinary(ka))
		require.Zero(t, back.Compare(a))
		require.True(t, back.At.Equal(a.At))
	}
	var p versioned.Position
	require.Error(t, p.UnmarshalBinary(nil))
	require.Error(t, p.UnmarshalBinary([]byte{2, 0}))
	bad := make([]byte, 29)
	bad[9], bad[10] = 0xff, 0xff // nanoseconds ≥ 1e9
	require.Error(t, p.UnmarshalBinary(bad))
}

func TestFamilyOfMetadata(t *testing.T) {
	t.Parallel()
	f := versioned.Family{Kind: "product.index", ID: "p-1"}
	base := func() *message.Message {
		msg, err := marshaler.NewMessageWithID(uuid.MustParse(lfE2), "product.updated", time.Now(), map[string]string{})
		require.NoError(t, err)
		return msg
	}

	// No family: not an error, not a member.
	_, _, ok, err := versioned.FamilyOf(base())
	require.NoError(t, err)
	require.False(t, ok)

	// Timestamps compare at full precision whatever their text.
	var positions []versioned.Position
	for _, text := range []string{"2024-07-01T10:00:02Z", "2024-07-01T10:00:02.000Z", "2024-07-01T12:00:02+02:00", "2024-07-01t10:00:02.000000000z"} {
		msg := base()
		msg.Metadata.Set(marshaler.MetadataOccurredAt, text)
		require.NoError(t, versioned.SetFamily(msg, f))
		got, pos, ok, err := versioned.FamilyOf(msg)
		require.NoError(t, err, text)
		require.True(t, ok)
		require.Equal(t, f, got)
		require.False(t, pos.HasSeq)
		positions = append(positions, pos)
	}
	for _, p := range positions[1:] {
		require.Zero(t, positions[0].Compare(p))
	}

	// A sequence number orders the family; SetFamily removes it again.
	msg := base()
	require.NoError(t, versioned.SetFamilySeq(msg, f, 42))
	require.Equal(t, "42", msg.Metadata.Get(versioned.MetadataFamilySeq))
	_, pos, ok, err := versioned.FamilyOf(msg)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, versioned.SeqPosition(42, uuid.MustParse(lfE2)), pos)
	require.NoError(t, versioned.SetFamily(msg, f))
	_, pos, _, _ = versioned.FamilyOf(msg)
	require.False(t, pos.HasSeq)

	// The event id in any accepted text form.
	msg = base()
	msg.UUID = "{" + strings.ToUpper(lfE2) + "}"
	require.NoError(t, versioned.SetFamilySeq(msg, f, 1))
	_, pos, _, err = versioned.FamilyOf(msg)
	require.NoError(t, err)
	require.Equal(t, uuid.MustParse(lfE2), pos.EventID)

	// Invalid: permanent errors.
	invalid := map[string]func(*message.Message){
		"kind only":       func(m *message.Message) { delete(m.Metadata, versioned.MetadataFamilyID) },
		"id only":         func(m *message.Message) { delete(m.Metadata, versioned.MetadataFamilyKind) },
		"empty id":        func(m *message.Message) { m.Metadata.Set(versioned.MetadataFamilyID, "") },
		"NUL in id":       func(m *message.Message) { m.Metadata.Set(versioned.MetadataFamilyID, "a\x00b") },
		"bad UTF-8":       func(m *message.Message) { m.Metadata.Set(versioned.MetadataFamilyKind, "\xff") },
		"long kind":       func(m *message.Message) { m.Metadata.Set(versioned.MetadataFamilyKind, strings.Repeat("k", 256)) },
		"negative seq":    func(m *message.Message) { m.Metadata.Set(versioned.MetadataFamilySeq, "-1") },
		"seq not decimal": func(m *message.Message) { m.Metadata.Set(versioned.MetadataFamilySeq, "0x10") },
		"seq overflow":    func(m *message.Message) { m.Metadata.Set(versioned.MetadataFamilySeq, "9223372036854775808") },
		"empty seq":       func(m *message.Message) { m.Metadata.Set(versioned.MetadataFamilySeq, "") },
		"bad event id":    func(m *message.Message) { m.UUID = "not-a-uuid" },
		"nil event id":    func(m *message.Message) { m.UUID = uuid.Nil.String() },
		"no seq, no time": func(m *message.Message) {
			delete(m.Metadata, versioned.MetadataFamilySeq)
			delete(m.Metadata, marshaler.MetadataOccurredAt)
		},
		"no seq, bad time": func(m *message.Message) {
			delete(m.Metadata, versioned.MetadataFamilySeq)
			m.Metadata.Set(marshaler.MetadataOccurredAt, "2024-07-01 10:00")
		},
	}
	for name, spoil := range invalid {
		msg := base()
		require.NoError(t, versioned.SetFamilySeq(msg, f, 1))
		spoil(msg)
		_, _, ok, err := versioned.FamilyOf(msg)
		require.ErrorIs(t, err, versioned.ErrFamilyInvalid, name)
		require.False(t, ok, name)
		require.True(t, inbox.IsPermanent(err), name)
	}

	// The setters refuse what FamilyOf would refuse, and change nothing.
	msg = base()
	require.ErrorIs(t, versioned.SetFamily(msg, versioned.Family{Kind: "k"}), versioned.ErrFamilyInvalid)
	require.ErrorIs(t, versioned.SetFamilySeq(msg, f, -1), versioned.ErrFamilyInvalid)
	_, _, ok, err = versioned.FamilyOf(msg)
	require.NoError(t, err)
	require.False(t, ok)
	require.Equal(t, "product.index/p-1", f.String())
}
