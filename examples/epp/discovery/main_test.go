package discovery_test

import (
	"bytes"
	"encoding/json"
	"strings"
	"sync"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// No ignore options: every informer goroutine a Kubernetes source starts
	// must be gone when its Run returns, and client-go starts nothing else
	// here (klog's flush daemon only runs when a program asks for it).
	goleak.VerifyTestMain(m)
}

// logBuf collects JSON log lines written by slog from any goroutine.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// records returns the decoded log records whose msg is msg.
func (l *logBuf) records(t *testing.T, msg string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for line := range strings.Lines(l.b.String()) {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if rec["msg"] == msg {
			out = append(out, rec)
		}
	}
	return out
}
