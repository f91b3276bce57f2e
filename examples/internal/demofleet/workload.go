package demofleet

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
)

// Model is the model the demo's fake engines serve and its requests name.
const Model = "demo-model"

// WorkloadOptions shape a shared-prefix chat workload.
type WorkloadOptions struct {
	// Requests is the number of requests (>= 0).
	Requests int
	// Groups is the number of shared system prompts (> 0).
	Groups int
	// MaxTokens is each request's max_tokens; 0 means 8.
	MaxTokens int
	// ShortEvery > 0 makes every ShortEvery-th request a short question of
	// its own, without a system prompt; 0: none.
	ShortEvery int
	// Model is the model every request names; "" means Model.
	Model string
	// Seed seeds the prompts' words and the groups' order.
	Seed uint64
}

// Request is one request of a workload: a streamed chat completion's body.
type Request struct {
	Body  []byte
	Short bool // a short question without a system prompt (WorkloadOptions.ShortEvery)
}

// Workload builds the chat requests of run number run: each of o.Groups
// system prompts (a few hundred tokens, e.g. an agent's instructions) is
// shared by many users asking short questions; requests of all groups arrive
// interleaved. Every run gets the same requests, except that the system
// prompts start with the run's number, so that no run finds the previous
// run's prompts in the engines' caches (engines the user runs are not
// restarted between runs). With o.ShortEvery, every ShortEvery-th request is
// a short question of its own instead, without a system prompt (a chat's
// first turn, a quick lookup). Requests stream their answers, as chat clients
// do, with the usage block, so that a driver can time the first byte and read
// the cached tokens.
func Workload(o WorkloadOptions, run int) ([]Request, error) {
	if o.Requests < 0 || o.Groups <= 0 || o.MaxTokens < 0 || o.ShortEvery < 0 {
		return nil, errors.New("demofleet: a workload needs Requests >= 0, Groups > 0, MaxTokens >= 0 and ShortEvery >= 0")
	}
	if o.MaxTokens == 0 {
		o.MaxTokens = 8
	}
	if o.Model == "" {
		o.Model = Model
	}
	r := rand.New(rand.NewPCG(o.Seed, 1))
	words := strings.Fields("the router sends each request to the engine whose cache already holds the longest prefix of its prompt while keeping load balanced across every worker of the pool so that time to first token stays low")
	sentence := func(n int) string {
		var b strings.Builder
		for i := range n {
			if i > 0 {
				b.WriteByte(' ')
			}
			b.WriteString(words[r.IntN(len(words))])
		}
		return b.String()
	}
	systems := make([]string, o.Groups)
	for g := range systems {
		systems[g] = fmt.Sprintf("Session %d. You are assistant number %d. ", run, g) + sentence(380)
	}
	reqs := make([]Request, o.Requests)
	for i := range reqs {
		short := o.ShortEvery > 0 && i%o.ShortEvery == o.ShortEvery-1
		var messages []map[string]string
		if !short {
			messages = append(messages, map[string]string{"role": "system", "content": systems[r.IntN(o.Groups)]})
		}
		messages = append(messages, map[string]string{"role": "user", "content": fmt.Sprintf("Question %d: ", i) + sentence(12+r.IntN(20))})
		body, err := json.Marshal(map[string]any{
			"model":          o.Model,
			"messages":       messages,
			"max_tokens":     o.MaxTokens,
			"stream":         true,
			"stream_options": map[string]bool{"include_usage": true},
		})
		if err != nil {
			return nil, err
		}
		reqs[i] = Request{Body: body, Short: short}
	}
	return reqs, nil
}
