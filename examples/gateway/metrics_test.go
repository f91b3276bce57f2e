package main

import (
	"bufio"
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// sample is one series of a /metrics page.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

// scrape GETs url (a /metrics page in Prometheus' text format) and returns
// its samples by metric name.
func scrape(t *testing.T, url string) map[string][]sample {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	out := map[string][]sample{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		s, ok := parseSample(line)
		require.True(t, ok, "not a sample line: %q", line)
		out[s.name] = append(out[s.name], s)
	}
	require.NoError(t, sc.Err())
	return out
}

// parseSample parses `name{k="v",...} value` (labels optional; values with
// escaped quotes and backslashes).
func parseSample(line string) (sample, bool) {
	s := sample{labels: map[string]string{}}
	i := strings.IndexAny(line, "{ ")
	if i <= 0 {
		return s, false
	}
	s.name, line = line[:i], line[i:]
	if line[0] == '{' {
		line = line[1:]
		for {
			if strings.HasPrefix(line, "}") {
				line = line[1:]
				break
			}
			k, rest, ok := strings.Cut(line, "=\"")
			if !ok {
				return s, false
			}
			var v strings.Builder
			j := 0
			for ; j < len(rest) && rest[j] != '"'; j++ {
				if rest[j] == '\\' && j+1 < len(rest) {
					j++
					if rest[j] == 'n' {
						v.WriteByte('\n')
						continue
					}
				}
				v.WriteByte(rest[j])
			}
			if j == len(rest) {
				return s, false
			}
			s.labels[strings.TrimPrefix(k, ",")] = v.String()
			line = strings.TrimPrefix(rest[j+1:], ",")
		}
	}
	f := strings.Fields(line)
	if len(f) == 0 {
		return s, false
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return s, false
	}
	s.value = v
	return s, true
}

// value returns the value of name's series whose labels include want, and
// whether there is one.
func value(all map[string][]sample, name string, want map[string]string) (float64, bool) {
next:
	for _, s := range all[name] {
		for k, v := range want {
			if s.labels[k] != v {
				continue next
			}
		}
		return s.value, true
	}
	return 0, false
}

// mustValue is value, failing the test when there is no such series.
func mustValue(t *testing.T, all map[string][]sample, name string, want map[string]string) float64 {
	t.Helper()
	v, ok := value(all, name, want)
	require.True(t, ok, "no series %s%v on /metrics", name, want)
	return v
}

func TestParseSample(t *testing.T) {
	for line, want := range map[string]sample{
		`go_goroutines 12`: {name: "go_goroutines", labels: map[string]string{}, value: 12},
		`kvselect_kv_feed_state{role="aggregated",worker="w",rank="0",state="never-heard"} 1`: {name: "kvselect_kv_feed_state",
			labels: map[string]string{"role": "aggregated", "worker": "w", "rank": "0", "state": "never-heard"}, value: 1},
		`x{a="q\"u,o=te",b="c\\d"} 2.5e-06`: {name: "x", labels: map[string]string{"a": `q"u,o=te`, "b": `c\d`}, value: 2.5e-06},
	} {
		got, ok := parseSample(line)
		require.True(t, ok, line)
		require.Equal(t, want, got, line)
	}
	for _, bad := range []string{"", "{a=\"b\"} 1", `x{a="b} 1`, "x", "x{} nan-ish"} {
		_, ok := parseSample(bad)
		require.False(t, ok, bad)
	}
}
