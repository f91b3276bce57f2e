package fakeengine_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvselect/kvselect/internal/fakeengine"
)

// The cache model works without sockets: Serve reports hits and what it stored,
// HeldPrefix is the truth a consumer's index should converge to.
func ExampleEngine_Serve() {
	e, err := fakeengine.New(fakeengine.Options{BlockSize: 4, CapacityBlocks: 8})
	if err != nil {
		panic(err)
	}
	prompt := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10} // two complete blocks
	r, _ := e.Serve(fakeengine.Request{Tokens: prompt})
	fmt.Println("hits", r.CachedBlocks, "stored", r.StoredBlocks, "seq", r.Seq)

	longer := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23}
	r, _ = e.Serve(fakeengine.Request{Tokens: longer})
	fmt.Println("hits", r.CachedBlocks, "stored", r.StoredBlocks, "seq", r.Seq)
	fmt.Println("held", e.HeldPrefix(prompt, "", ""), e.HeldPrefix(longer, "", ""), "blocks", e.Blocks())
	// Output:
	// hits 0 stored 2 seq 0
	// hits 2 stored 1 seq 1
	// held 2 3 blocks 3
}

// A consumer subscribes to the engine's PUB socket; WaitSubscribed avoids losing
// the first batches to ZMQ's slow-joiner effect.
func ExampleEngine_Start() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	e, err := fakeengine.New(fakeengine.Options{})
	if err != nil {
		panic(err)
	}
	if err := e.Start(ctx); err != nil {
		panic(err)
	}
	defer e.Close()

	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.Dial(e.PubEndpoint()); err != nil {
		panic(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		panic(err)
	}
	if err := e.WaitSubscribed(ctx); err != nil {
		panic(err)
	}

	if _, err := e.Serve(fakeengine.Request{Tokens: make([]uint32, 40)}); err != nil {
		panic(err)
	}
	msg, err := sub.Recv()
	if err != nil {
		panic(err)
	}
	fmt.Printf("frames %d topic %s seq %d\n", len(msg.Frames), msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[1]))
	// Output:
	// frames 3 topic kv@127.0.0.1@fake-model seq 0
}

func ExampleAppendBatch() {
	b := fakeengine.Batch{
		Timestamp: 1.5,
		Events:    []fakeengine.Event{{Kind: fakeengine.AllBlocksCleared}},
		HasDPRank: true,
	}
	fmt.Printf("% x\n", fakeengine.AppendBatch(nil, b, fakeengine.Format{Events: fakeengine.EncodingArray}))
	fmt.Printf("% x\n", fakeengine.AppendBatch(nil, b, fakeengine.Format{}))
	// Output:
	// 93 cb 3f f8 00 00 00 00 00 00 91 91 b0 41 6c 6c 42 6c 6f 63 6b 73 43 6c 65 61 72 65 64 00
	// 93 cb 3f f8 00 00 00 00 00 00 91 81 a4 74 79 70 65 b0 41 6c 6c 42 6c 6f 63 6b 73 43 6c 65 61 72 65 64 00
}

// A dialect presets the wire options of one engine; the demo's
// --demo-engine-dialect flag goes through ParseDialect.
func ExampleDialect_Apply() {
	d, err := fakeengine.ParseDialect("external")
	if err != nil {
		panic(err)
	}
	o := d.Apply(fakeengine.Options{BlockSize: 4})
	fmt.Println(d, "-", d.Summary())
	fmt.Println("events", o.Encoding, "root parent", o.RootParent, "first seq", o.FirstSeq)

	e, err := fakeengine.New(o)
	if err != nil {
		panic(err)
	}
	r, _ := e.Serve(fakeengine.Request{Tokens: []uint32{1, 2, 3, 4}})
	fmt.Println("first batch seq", r.Seq)
	// Output:
	// external - external vLLM-compatible engine: positional events, root parent 0, seq from 1
	// events array root parent zero first seq 1
	// first batch seq 1
}
