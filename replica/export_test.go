package replica

import (
	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/selection"
)

// Forgery for the attack tests of package replica_test: messages as a
// hostile peer on the bus would write them.

// ForgedBooking is one booking a forged batch or page carries.
type ForgedBooking struct {
	ID, Model string
	Worker    catalog.WorkerRank
	Hashes    []uint64
	Private   int
	LeaseMS   int64
}

func (f ForgedBooking) booked() booked {
	return booked{id: f.ID, model: f.Model, worker: f.Worker, hashes: f.Hashes, private: f.Private,
		leaseMS: f.LeaseMS, remainingMS: f.LeaseMS}
}

// ForgeBatch encodes a batch of origin's epoch numbered seq (a heartbeat
// when bs is empty).
func ForgeBatch(origin string, epoch, seq uint64, bs ...ForgedBooking) []byte {
	out := appendBatchHeader(nil, 0, origin, epoch, seq, len(bs))
	for _, f := range bs {
		b := f.booked()
		out = appendBooked(out, &b)
	}
	return out
}

// ForgePage encodes a snapshot page of origin's epoch as of batch seq.
func ForgePage(origin string, epoch, seq uint64, more bool, bs ...ForgedBooking) []byte {
	out := appendPageHeader(nil, more, origin, epoch, seq, len(bs))
	for _, f := range bs {
		b := f.booked()
		out = appendBooked(out, &b)
	}
	return out
}

// ForgeSettle encodes a batch of one settling call on id.
func ForgeSettle(origin string, epoch, seq uint64, id string, how selection.Settlement) []byte {
	return appendSettled(appendBatchHeader(nil, 0, origin, epoch, seq, 1), id, how)
}
