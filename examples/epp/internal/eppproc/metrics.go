package eppproc

import (
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// Sample is one Prometheus series value.
type Sample struct {
	Name   string
	Labels map[string]string
	Value  float64
}

// Scrape reads http://addr/metrics (the text format) with c.
func Scrape(c *http.Client, addr string) ([]Sample, error) {
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, fmt.Errorf("eppproc: %w", err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("eppproc: read /metrics: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("eppproc: /metrics: %s", resp.Status)
	}
	var out []Sample
	for line := range strings.SplitSeq(string(raw), "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		s, ok := parseSample(line)
		if !ok {
			return nil, fmt.Errorf("eppproc: metrics line %q", line)
		}
		out = append(out, s)
	}
	return out, nil
}

// parseSample reads `name{k="v",...} value`; the label values the EPP writes
// never hold quotes or commas.
func parseSample(line string) (Sample, bool) {
	sp := strings.LastIndexByte(line, ' ')
	if sp < 0 {
		return Sample{}, false
	}
	v, err := strconv.ParseFloat(line[sp+1:], 64)
	if err != nil {
		return Sample{}, false
	}
	s := Sample{Name: line[:sp], Labels: map[string]string{}, Value: v}
	if i := strings.IndexByte(s.Name, '{'); i >= 0 {
		body := strings.TrimSuffix(s.Name[i+1:], "}")
		s.Name = s.Name[:i]
		for kv := range strings.SplitSeq(body, ",") {
			if k, val, ok := strings.Cut(kv, "="); ok {
				s.Labels[k] = strings.Trim(val, `"`)
			}
		}
	}
	return s, true
}

// Sum adds up the series of name whose labels include want (nil: every
// series of name); false when none does.
func Sum(ss []Sample, name string, want map[string]string) (float64, bool) {
	sum, found := 0.0, false
	for _, s := range ss {
		if s.Name == name && hasLabels(s, want) {
			sum += s.Value
			found = true
		}
	}
	return sum, found
}

func hasLabels(s Sample, want map[string]string) bool {
	for k, v := range want {
		if s.Labels[k] != v {
			return false
		}
	}
	return true
}
