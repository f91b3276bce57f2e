//go:build e2e

package e2ekube

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/internal/fakeengine"
)

// model is the model name of every engine and of the EPP; blockSize the KV
// block size both use.
const (
	model     = "e2e-model"
	blockSize = 16
)

// lastIP numbers the loopback addresses handed to pods: 127.0.0.2, .3, ...
// Each address is used once per test binary run, so a test never meets a
// socket a previous test left in TIME_WAIT.
var lastIP atomic.Int32

func nextIP(t *testing.T) string {
	n := lastIP.Add(1) + 1
	require.LessOrEqual(t, n, int32(254), "out of loopback addresses")
	return fmt.Sprintf("127.0.0.%d", n)
}

// fleet is the set of fake engines behind one pool: engine i listens on
// ips[i], all on the same three ports (HTTP, the pool's target port; KV-event
// PUB; replay ROUTER), like pods of one Deployment.
type fleet struct {
	port, pubPort, replayPort int
	ips                       []string
	engines                   []*fakeengine.Engine
}

// endpoint is engine i's HTTP host:port, the worker endpoint of its pod.
func (f *fleet) endpoint(i int) string { return net.JoinHostPort(f.ips[i], strconv.Itoa(f.port)) }

// requests is how many completion requests engine i has served.
func (f *fleet) requests(i int) uint64 { return f.engines[i].HTTPStats().Requests }

// byEndpoint maps a host:port back to the engine index, -1 when unknown.
func (f *fleet) byEndpoint(ep string) int {
	for i := range f.ips {
		if f.endpoint(i) == ep {
			return i
		}
	}
	return -1
}

// startFleet starts n engines on n fresh loopback addresses sharing three port
// numbers. Ports are picked on 127.0.0.1 and may be taken on one of the new
// addresses meanwhile; the whole fleet is then retried on new ports.
func startFleet(t *testing.T, n int) *fleet {
	t.Helper()
	ips := make([]string, n)
	for i := range ips {
		ips[i] = nextIP(t)
	}
	var lastErr error
	for range 10 {
		ports, err := freePorts(3)
		require.NoError(t, err)
		f := &fleet{port: ports[0], pubPort: ports[1], replayPort: ports[2], ips: ips}
		if lastErr = f.start(); lastErr == nil {
			t.Cleanup(f.close)
			return f
		}
		f.close()
	}
	require.NoError(t, lastErr, "no port triple free on %v", ips)
	return nil
}

func (f *fleet) start() error {
	for _, ip := range f.ips {
		e, err := fakeengine.New(fakeengine.Options{
			BlockSize: blockSize, CapacityBlocks: 512, Model: model, OutputTokens: 4,
			EnableHTTP: true, HTTPAddr: net.JoinHostPort(ip, strconv.Itoa(f.port)),
			PubEndpoint:  "tcp://" + net.JoinHostPort(ip, strconv.Itoa(f.pubPort)),
			EnableReplay: true, ReplayEndpoint: "tcp://" + net.JoinHostPort(ip, strconv.Itoa(f.replayPort)),
		})
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = e.Start(ctx)
		cancel()
		if err != nil {
			return fmt.Errorf("engine on %s: %w", ip, err)
		}
		f.engines = append(f.engines, e)
	}
	return nil
}

func (f *fleet) close() {
	for _, e := range f.engines {
		_ = e.Close()
	}
}

// freePorts returns n distinct ports that were free on 127.0.0.1.
func freePorts(n int) ([]int, error) {
	ls := make([]net.Listener, 0, n)
	defer func() {
		for _, l := range ls {
			_ = l.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// startTokenizer starts the engine the EPP tokenizes with (its render
// endpoint). It is not a pod, so pods may come and go without breaking
// tokenization.
func startTokenizer(t *testing.T) string {
	t.Helper()
	e, err := fakeengine.New(fakeengine.Options{BlockSize: blockSize, Model: model, EnableHTTP: true})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() { _ = e.Close() })
	return "http://" + e.HTTPEndpoint()
}
