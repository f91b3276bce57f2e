package eppproc

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseSample(t *testing.T) {
	for _, tc := range []struct {
		line string
		want Sample
		ok   bool
	}{
		{"go_goroutines 12", Sample{Name: "go_goroutines", Labels: map[string]string{}, Value: 12}, true},
		{`kvselect_workers{role="decode",lifecycle="ready"} 3`,
			Sample{Name: "kvselect_workers", Labels: map[string]string{"role": "decode", "lifecycle": "ready"}, Value: 3}, true},
		{"x 1e+06", Sample{Name: "x", Labels: map[string]string{}, Value: 1e6}, true},
		{"no_value", Sample{}, false},
		{"x NaNa", Sample{}, false},
	} {
		got, ok := parseSample(tc.line)
		require.Equal(t, tc.ok, ok, tc.line)
		require.Equal(t, tc.want, got, tc.line)
	}
}

func TestScrapeSum(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, strings.Join([]string{
			"# HELP c a counter", "# TYPE c counter",
			`c{role="a",worker="w1"} 2`, `c{role="a",worker="w2"} 3`, `c{role="b",worker="w1"} 5`, "g 7", "",
		}, "\n"))
	}))
	defer srv.Close()
	ss, err := Scrape(srv.Client(), strings.TrimPrefix(srv.URL, "http://"))
	require.NoError(t, err)
	require.Len(t, ss, 4)
	for _, tc := range []struct {
		name  string
		want  map[string]string
		sum   float64
		found bool
	}{
		{"c", nil, 10, true},
		{"c", map[string]string{"role": "a"}, 5, true},
		{"c", map[string]string{"role": "b", "worker": "w1"}, 5, true},
		{"c", map[string]string{"role": "c"}, 0, false},
		{"g", nil, 7, true},
		{"missing", nil, 0, false},
	} {
		sum, found := Sum(ss, tc.name, tc.want)
		require.Equal(t, tc.found, found, "%s %v", tc.name, tc.want)
		require.Equal(t, tc.sum, sum, "%s %v", tc.name, tc.want)
	}
}

func TestScrapeRefusesGarbage(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, "not a sample\n")
	}))
	defer srv.Close()
	_, err := Scrape(srv.Client(), strings.TrimPrefix(srv.URL, "http://"))
	require.ErrorContains(t, err, "metrics line")
}
