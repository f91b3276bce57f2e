package kvevents_test

import (
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/kvindex/kvevents"
)

// payloadA is a vLLM batch in the positional encoding used before vLLM 0.26:
// [1760000000.5, [["BlockStored", [hash], nil, [1, 2, 3, 4], 4, nil, "GPU", nil]], 0].
const payloadA = `
93 cb 41 da 39 de 00 20 00 00 91
98 ab 426c6f636b53746f726564 91 cf dab89baa7b5857c0 c0 94 01 02 03 04 04 c0 a3 475055 c0
00`

func mustHex(s string) []byte {
	b, err := hex.DecodeString(strings.Join(strings.Fields(s), ""))
	if err != nil {
		panic(err)
	}
	return b
}

func ExampleDecoder() {
	// Bound what one payload from the network may make the decoder hold (zero
	// fields keep the defaults).
	d, err := kvevents.NewDecoder(kvevents.DecoderOptions{
		MaxEvents: 1024, MaxBlocksPerEvent: 4096, MaxTokensPerEvent: 1 << 20, MaxInternedStrings: 64,
	})
	if err != nil {
		panic(err)
	}
	batch, err := d.Decode(mustHex(payloadA))
	if err != nil {
		panic(err)
	}
	fmt.Printf("ts=%.1f dp_rank=%d (present: %v) skipped=%d\n",
		batch.Timestamp, batch.DPRank, batch.HasDPRank, batch.SkippedTotal())
	for _, ev := range batch.Events {
		fmt.Printf("%s on %s: hashes=%#x parent=%v tokens=%v block_size=%d\n",
			ev.Kind, ev.Tier, ev.BlockHashes, ev.HasParent, ev.Tokens, ev.BlockSize)
	}
	// Output:
	// ts=1760000000.5 dp_rank=0 (present: true) skipped=0
	// BlockStored on device: hashes=[0xdab89baa7b5857c0] parent=false tokens=[1 2 3 4] block_size=4
}

func ExampleIndexHandler() {
	ix, err := kvindex.New(kvindex.Options{BlockSize: 4})
	if err != nil {
		panic(err)
	}
	h, err := kvevents.NewIndexHandler(ix, kvevents.HandlerOptions{
		BlockSize: ix.BlockSize(),
		Decoder:   kvevents.DecoderOptions{MaxEvents: 1024}, // each source's decoder
	})
	if err != nil {
		panic(err)
	}
	// A transport calls HandleBatch for each payload of a source, in sequence order.
	src := catalog.WorkerRank{WorkerID: "10.0.0.5:8000"}
	h.HandleBatch(src, 0, mustHex(payloadA))

	st := h.Stats(src)
	fmt.Printf("batches=%d applied=%d skipped=%d\n", st.Batches, st.EventsApplied, st.SkippedTotal())

	// The index now knows that the worker holds the block of tokens 1..4.
	hasher, err := kvindex.NewHasher(4, kvindex.HashOptions{})
	if err != nil {
		panic(err)
	}
	for _, m := range ix.FindMatches(hasher.SeqHashes([]uint32{1, 2, 3, 4, 5, 6, 7, 8}), kvindex.MatchOptions{}) {
		fmt.Printf("%s holds %d leading block(s)\n", m.Worker, m.Device)
	}
	// Output:
	// batches=1 applied=1 skipped=0
	// 10.0.0.5:8000/0 holds 1 leading block(s)
}

// TopicWorker attributes a message on a bind listener by its topic, when the
// engine names itself the way llm-d's guides set it up; a custom
// BindConfig.Attribute can fall back to it.
func ExampleTopicWorker() {
	for _, topic := range []string{"kv@10.0.0.7:8000@meta-llama/Llama-3.1-8B", "kv@@llama", "kv-events"} {
		wr, ok := kvevents.TopicWorker(topic)
		fmt.Printf("%q -> %v %v\n", topic, wr, ok)
	}
	// Output:
	// "kv@10.0.0.7:8000@meta-llama/Llama-3.1-8B" -> 10.0.0.7:8000/0 true
	// "kv@@llama" -> /0 false
	// "kv-events" -> /0 false
}
