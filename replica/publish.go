package replica

import "time"

// publishLoop is the one goroutine that publishes: batches, heartbeats every
// HeartbeatInterval, a final batch at Close. Being the only publisher keeps
// batches and heartbeats in sequence order on the bus.
//
// Batching: an idle publisher is woken by the first op queued and publishes
// it at once if no batch went out for BatchInterval; after a batch it stays
// awake, publishing what gathered every BatchInterval, and goes idle when an
// interval gathered nothing. A full batch wakes it at any time. Under steady
// traffic that is one wake-up per BatchInterval, whatever the rate.
func (r *Replicator) publishLoop() {
	defer r.wg.Done()
	hb := time.NewTicker(r.o.HeartbeatInterval)
	defer hb.Stop()
	batch := time.NewTimer(time.Hour)
	batch.Stop()
	armed := false
	var last time.Time // when the last batch went
	arm := func(d time.Duration) {
		if !armed {
			batch.Reset(d)
			armed = true
		}
	}
	flush := func() {
		if r.flush() {
			last = time.Now()
			arm(r.o.BatchInterval)
		}
	}
	for {
		select {
		case <-r.stop:
			flush()
			return
		case done := <-r.flushReq:
			flush()
			close(done)
		case <-r.kick:
			if wait := r.o.BatchInterval - time.Since(last); wait <= 0 || r.batchReady() {
				flush()
			} else {
				arm(wait)
			}
		case <-batch.C:
			armed = false
			flush()
		case <-hb.C:
			flush()
			r.heartbeat()
		}
	}
}

// batchReady reports whether a batch should go now: it is full, ops were
// dropped, or a resync was asked for.
func (r *Replicator) batchReady() bool {
	r.mu.Lock()
	p := r.mu.pend
	ready := len(p.ops) >= r.o.BatchMax || p.bytes >= r.sendMax()-headerReserve || r.mu.overflowing
	r.mu.Unlock()
	return ready || r.resync.Load()
}

// flush publishes every pending op, in batches of at most BatchMax ops and
// MaxMessageBytes bytes, each with the next sequence number, and reports
// whether there was any. A resync asked for with nothing pending goes out as
// a heartbeat.
func (r *Replicator) flush() bool {
	r.mu.Lock()
	p := r.mu.pend
	r.mu.overflowing = false
	r.mu.idle = len(p.ops) == 0 // the next op queued wakes the publisher
	if len(p.ops) == 0 {
		r.recycleLocked(r.mu.retired) // nothing pending reads them
		clear(r.mu.retired)
		r.mu.retired = r.mu.retired[:0]
		r.mu.Unlock()
		if r.resync.Load() {
			r.heartbeat()
		}
		return false
	}
	r.mu.pend, r.out = r.out, p
	// The batches and their sequence numbers are fixed here, under the lock
	// a snapshot page reads its sequence number under (pageSeqLocked).
	r.ends = r.splitBatches(r.ends[:0], p.ops, r.mu.seals)
	r.mu.seals, r.outSeals = r.outSeals[:0], r.mu.seals
	r.mu.outEnd = r.seq.Load() + uint64(len(r.ends))
	r.mu.flushing = true
	retired := r.mu.retired
	r.mu.retired, r.retired = r.retired, nil
	r.mu.Unlock()

	start := 0
	for _, end := range r.ends {
		var flags byte
		if r.resync.Swap(false) {
			flags |= flagResync
		}
		buf := appendBatchHeader(r.enc[:0], flags, r.o.ID, r.epoch, r.seq.Add(1), end-start)
		for i := range p.ops[start:end] {
			buf = appendPending(buf, &p.ops[start+i])
		}
		r.enc = buf
		r.send(buf, end-start, flags)
		start = end
	}
	clear(p.ops)
	p.ops, p.bytes = p.ops[:0], 0
	r.mu.Lock()
	r.recycleLocked(retired) // the ops that could read them are published
	r.mu.flushing = false
	r.mu.Unlock()
	clear(retired)
	r.retired = retired[:0]
	return true
}

// splitBatches appends to dst where each batch of ops ends: a batch holds at
// most BatchMax ops and MaxMessageBytes bytes, and ends at every seal.
func (r *Replicator) splitBatches(dst []int, ops []pendingOp, seals []int) []int {
	for start := 0; start < len(ops); {
		for len(seals) > 0 && seals[0] <= start {
			seals = seals[1:]
		}
		lim := len(ops)
		if len(seals) > 0 {
			lim = min(lim, seals[0])
		}
		lim = min(lim, start+r.o.BatchMax)
		n, size, most := start, headerReserve, r.sendMax()
		for n < lim && size+int(ops[n].size) <= most {
			size += int(ops[n].size)
			n++
		}
		start = max(n, start+1) // one op always fits (Booked checks)
		dst = append(dst, start)
	}
	return dst
}

// pageSeqLocked returns the sequence number of the batch that will carry the
// last op queued so far, and seals the pending buffer there: the ops queued
// from now on go in later batches. So the live bookings read under the same
// lock are exactly those the batches up to that number leave (see
// serveSnapshot). r.mu is held.
func (r *Replicator) pageSeqLocked() uint64 {
	seq := r.seq.Load()
	if r.mu.flushing {
		seq = r.mu.outEnd // out's batches are numbered, or about to be
	}
	ops := r.mu.pend.ops
	if len(ops) == 0 {
		return seq
	}
	if k := len(r.mu.seals); k == 0 || r.mu.seals[k-1] < len(ops) {
		r.mu.seals = append(r.mu.seals, len(ops))
	}
	r.mu.ends = r.splitBatches(r.mu.ends[:0], ops, r.mu.seals)
	return seq + uint64(len(r.mu.ends))
}

func appendPending(dst []byte, op *pendingOp) []byte {
	if op.kind == opSettled {
		return appendSettled(dst, op.id, op.how)
	}
	b := booked{
		id: op.id, model: op.model, worker: op.worker, hashes: op.hashes,
		private: int(op.private), prefill: int(op.prefill), expected: int(op.expected),
		leaseMS: int64(op.leaseMS), remainingMS: int64(op.leaseMS), session: op.session,
	}
	return appendBooked(dst, &b)
}

// heartbeat publishes an empty batch carrying the last sequence number (and
// the resync flag when asked for).
func (r *Replicator) heartbeat() {
	var flags byte
	if r.resync.Swap(false) {
		flags |= flagResync
	}
	r.enc = appendBatchHeader(r.enc[:0], flags, r.o.ID, r.epoch, r.seq.Load(), 0)
	r.send(r.enc, 0, flags)
}

// send publishes one encoded batch of n ops. A lost batch needs nothing
// more (its sequence number is spent, so peers see the gap) but a lost resync
// request is asked for again.
func (r *Replicator) send(buf []byte, n int, flags byte) {
	if err := r.o.Bus.Publish(r.opsSubj, buf); err != nil {
		if flags&flagResync != 0 {
			r.resync.Store(true)
		}
		r.st.publishErrors.Add(1)
		r.warn("publish", "replica: publish failed; peers will see a gap", "err", err)
		return
	}
	if n == 0 {
		r.st.heartbeats.Add(1)
		return
	}
	r.st.batches.Add(1)
	r.st.ops.Add(uint64(n))
}
