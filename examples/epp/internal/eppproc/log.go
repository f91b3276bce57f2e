package eppproc

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sync"
)

// Record is one line of the EPP's output; M is nil when the line is not JSON.
type Record struct {
	Raw string
	M   map[string]any
}

// Msg is the record's message.
func (r Record) Msg() string { return r.Str("msg") }

// Str reads a string attribute ("" when absent or not a string).
func (r Record) Str(key string) string { s, _ := r.M[key].(string); return s }

// Num reads a numeric attribute, following path through nested objects (JSON
// numbers decode as float64); -1 when absent.
func (r Record) Num(path ...string) float64 {
	var cur any = r.M
	for _, k := range path {
		m, ok := cur.(map[string]any)
		if !ok {
			return -1
		}
		cur = m[k]
	}
	f, ok := cur.(float64)
	if !ok {
		return -1
	}
	return f
}

// Sink collects output written to it, one Record a line. It is safe for
// concurrent use: exec copies a process's stdout and stderr into it from
// goroutines of its own while the test reads it.
type Sink struct {
	mu      sync.Mutex
	partial []byte
	recs    []Record
}

// Write implements io.Writer; a line is recorded once its newline arrives.
func (l *Sink) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.partial = append(l.partial, b...)
	for {
		i := bytes.IndexByte(l.partial, '\n')
		if i < 0 {
			break
		}
		line := string(l.partial[:i])
		l.partial = l.partial[i+1:]
		rec := Record{Raw: line}
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil {
			rec.M = m
		}
		l.recs = append(l.recs, rec)
	}
	return len(b), nil
}

// Find returns the JSON records that match, in order.
func (l *Sink) Find(match func(Record) bool) []Record {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []Record
	for _, r := range l.recs {
		if r.M != nil && match(r) {
			out = append(out, r)
		}
	}
	return out
}

// Lines returns every line so far, JSON or not.
func (l *Sink) Lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]string, len(l.recs))
	for i, r := range l.recs {
		out[i] = r.Raw
	}
	return out
}

// MsgIs matches records by message and, optionally, attribute values given as
// name, value pairs.
func MsgIs(msg string, attrs ...string) func(Record) bool {
	return func(r Record) bool {
		if r.Msg() != msg {
			return false
		}
		for i := 0; i+1 < len(attrs); i += 2 {
			if fmt.Sprint(r.M[attrs[i]]) != attrs[i+1] {
				return false
			}
		}
		return true
	}
}
