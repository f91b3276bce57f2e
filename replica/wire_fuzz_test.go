package replica

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// reencode writes a decoded message back in the canonical encoding.
func reencodeBatch(b *wireBatch) []byte {
	out := appendBatchHeader(nil, b.flags, b.origin, b.epoch, b.seq, len(b.ops))
	for i := range b.ops {
		o := &b.ops[i]
		if o.kind == opSettled {
			out = appendSettled(out, o.id, o.how)
			continue
		}
		out = appendBooked(out, o.booked())
	}
	return out
}

func (o *wireOp) booked() *booked {
	return &booked{
		id: o.id, model: o.model, worker: o.worker, hashes: o.hashes, private: o.private, prefill: o.prefill,
		expected: o.expected, leaseMS: o.leaseMS, remainingMS: o.remainingMS, session: o.session,
	}
}

func reencodePage(p *snapPage) []byte {
	out := appendPageHeader(nil, p.more, p.origin, p.epoch, p.seq, len(p.entries))
	for i := range p.entries {
		out = appendBooked(out, p.entries[i].booked())
	}
	return out
}

// FuzzDecodeMessage feeds arbitrary bytes to every decoder: each either fails
// with one of the decode sentinels or succeeds with values within their
// bounds, whose canonical encoding decodes to the same message.
func FuzzDecodeMessage(f *testing.F) {
	b := sampleBooked()
	f.Add(sampleBatch(flagResync))
	f.Add(appendBatchHeader(nil, 0, "a", 1, 2, 0))
	f.Add(appendRequest(nil, "b", "req-1"))
	f.Add(appendBooked(appendPageHeader(nil, true, "a", 5, 11, 1), &b))
	f.Add([]byte("KVSR\x01\x01"))
	const limit = 1 << 16
	f.Fuzz(func(t *testing.T, data []byte) {
		var batch wireBatch
		if err := decodeBatch(data, limit, &batch); err != nil {
			require.True(t, isDecodeError(err), "batch: %v", err)
		} else {
			for i := range batch.ops {
				if o := &batch.ops[i]; o.kind == opBooked {
					require.True(t, o.booked().sendable(), "decoded op within bounds")
				}
			}
			enc := reencodeBatch(&batch)
			var again wireBatch
			require.NoError(t, decodeBatch(enc, limit, &again))
			require.True(t, bytes.Equal(enc, reencodeBatch(&again)))
			require.Len(t, again.ops, len(batch.ops))
		}
		if q, err := decodeRequest(data, limit); err != nil {
			require.True(t, isDecodeError(err), "request: %v", err)
		} else {
			enc := appendRequest(nil, q.requester, q.after)
			q2, err := decodeRequest(enc, limit)
			require.NoError(t, err)
			require.Equal(t, q, q2)
		}
		var page snapPage
		if err := decodePage(data, limit, &page); err != nil {
			require.True(t, isDecodeError(err), "page: %v", err)
		} else {
			enc := reencodePage(&page)
			var again snapPage
			require.NoError(t, decodePage(enc, limit, &again))
			require.True(t, bytes.Equal(enc, reencodePage(&again)))
		}
	})
}
