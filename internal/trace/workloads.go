package trace

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
)

// Workload names a generator of Generate.
type Workload string

// The workloads Generate knows, each modelling one shape of traffic.
const (
	// WorkloadSharedPrefix is SharedPrefix: groups of one-shot prompts that
	// share a system prompt (inference-perf's shared_prefix).
	WorkloadSharedPrefix Workload = "shared-prefix"
	// WorkloadMultiTurn is chat: conversations whose every turn re-sends the
	// whole history (system prompt, earlier questions and answers) plus a new
	// question, after a think time. The reusable prefix grows turn by turn
	// and belongs to one conversation.
	WorkloadMultiTurn Workload = "multi-turn"
	// WorkloadAgent is agent loops: a few long tool prompts shared by every
	// run of an agent kind, then many quick turns that each append a short
	// tool result and a short answer. Long shared prefix, fast growth, little
	// think time.
	WorkloadAgent Workload = "agent"
	// WorkloadRAG is retrieval: a system prompt, then one of many documents
	// (popularity Zipf-distributed, so a few are hot), then a question. The
	// reusable prefix is the document, shared across unrelated users.
	WorkloadRAG Workload = "rag"
	// WorkloadBursty is shared-prefix prompts arriving in on/off bursts: most
	// of the requests of a burst come within BurstOn, at BurstFactor times the
	// mean rate, then nothing for a while; BurstHot of each burst's requests
	// carry the burst's own system prompt (a campaign, a batch job), more
	// than one worker can prefill in the burst. It tests that a cached prefix
	// does not draw a whole burst to one worker.
	WorkloadBursty Workload = "bursty"
	// WorkloadMix interleaves multi-turn, agent and RAG traffic, a third of
	// the rate each, as one fleet serving several applications sees it.
	WorkloadMix Workload = "mix"
)

// Workloads returns every workload, in a stable order.
func Workloads() []Workload {
	return []Workload{WorkloadSharedPrefix, WorkloadMultiTurn, WorkloadAgent, WorkloadRAG, WorkloadBursty, WorkloadMix}
}

// ParseWorkload parses a workload name.
func ParseWorkload(s string) (Workload, error) {
	w := Workload(strings.ToLower(strings.TrimSpace(s)))
	if slices.Contains(Workloads(), w) {
		return w, nil
	}
	names := make([]string, 0, 6)
	for _, w := range Workloads() {
		names = append(names, string(w))
	}
	return "", fmt.Errorf("%w: unknown workload %q (want one of %s)", ErrInvalidOptions, s, strings.Join(names, ", "))
}

// WorkloadConfig sizes a generated workload. Zero fields take the defaults
// named; lengths are in blocks of BlockSize tokens.
type WorkloadConfig struct {
	// Requests is about how many requests to generate: the workload spans
	// Requests / Rate seconds (conversations in it are in steady state, some
	// begun before it, some not ended). 0 means 1,024.
	Requests int
	// Rate is the mean arrival rate of new requests, in requests per second.
	// 0 means 4.
	Rate float64
	// BlockSize is tokens per block. 0 means DefaultBlockSize.
	BlockSize int
	// OutputTokens is the mean output length. 0 means 200 (agent: 100).
	OutputTokens int
	// BurstOn and BurstFactor shape WorkloadBursty: bursts last BurstOn and
	// arrive at BurstFactor x Rate, with silences between that keep the mean
	// at Rate. 0 means 5 s and 8.
	BurstOn     time.Duration
	BurstFactor float64
	// BurstHot is the fraction of a WorkloadBursty burst's requests whose
	// system prompt is the burst's hot one, in [0, 1]. 0 means 0.5; a
	// negative value means none.
	BurstHot float64
	// Batch, when above 1, makes arrivals come in same-instant batches of
	// Batch requests (BatchArrivals): the bursts a gateway meets when
	// clients send together. 0 or 1: arrivals as generated.
	Batch int
	// Seed makes the workload reproducible: equal configurations give equal
	// traces.
	Seed uint64
}

func (c WorkloadConfig) withDefaults() (WorkloadConfig, error) {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOptions}, args...)...))
	}
	finite := func(name string, v float64) {
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			bad("%s %v, want a finite value >= 0", name, v)
		}
	}
	if c.Batch < 0 || c.Batch > 1<<16 {
		bad("Batch %d, want 0 to %d", c.Batch, 1<<16)
	}
	if c.Requests < 0 || c.Requests > 1<<22 {
		bad("Requests %d, want 0 to %d", c.Requests, 1<<22)
	}
	finite("Rate", c.Rate)
	finite("BurstFactor", c.BurstFactor)
	if math.IsNaN(c.BurstHot) || c.BurstHot > 1 {
		bad("BurstHot %v, want a value <= 1", c.BurstHot)
	}
	if c.BurstFactor != 0 && c.BurstFactor < 1 {
		bad("BurstFactor %v, want >= 1", c.BurstFactor)
	}
	if c.BlockSize < 0 || c.OutputTokens < 0 || c.BurstOn < 0 {
		bad("BlockSize %d, OutputTokens %d, BurstOn %v: none may be negative", c.BlockSize, c.OutputTokens, c.BurstOn)
	}
	if len(errs) > 0 {
		return c, errors.Join(errs...)
	}
	if c.Requests == 0 {
		c.Requests = 1024
	}
	if c.Rate == 0 {
		c.Rate = 4
	}
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.OutputTokens == 0 {
		c.OutputTokens = 200
	}
	if c.BurstOn == 0 {
		c.BurstOn = 5 * time.Second
	}
	if c.BurstFactor == 0 {
		c.BurstFactor = 8
	}
	switch {
	case c.BurstHot == 0:
		c.BurstHot = 0.5
	case c.BurstHot < 0:
		c.BurstHot = 0
	}
	return c, nil
}

// Generate returns workload w sized by cfg, sorted by arrival. Errors:
// ErrInvalidOptions.
func Generate(w Workload, cfg WorkloadConfig) ([]Request, error) {
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	g := &gen{c: c, rng: rand.New(rand.NewPCG(c.Seed, c.Seed^0x6a09e667f3bcc908))}
	var reqs []Request
	switch w {
	case WorkloadSharedPrefix:
		reqs, err = SharedPrefix(SharedPrefixConfig{Groups: max(1, c.Requests/16), PromptsPerGroup: 16, SystemBlocks: 16,
			QuestionBlocks: 2, OutputTokens: c.OutputTokens, BlockSize: c.BlockSize, Rate: c.Rate, Seed: c.Seed})
		if err != nil {
			return nil, err
		}
	case WorkloadMultiTurn:
		reqs = g.conversations(c.Requests, c.Rate, convShape{system: 4, firstUser: 2, user: 1, turns: 8, think: 20 * time.Second, out: c.OutputTokens})
	case WorkloadAgent:
		out := c.OutputTokens
		if cfg.OutputTokens == 0 {
			out = 100
		}
		reqs = g.conversations(c.Requests, c.Rate, convShape{system: 24, kinds: 4, firstUser: 1, user: 1, turns: 16, think: time.Second, out: out})
	case WorkloadRAG:
		reqs = g.rag(c.Requests, c.Rate)
	case WorkloadBursty:
		const system = 16
		reqs, err = SharedPrefix(SharedPrefixConfig{Groups: max(1, c.Requests/16), PromptsPerGroup: 16, SystemBlocks: system,
			QuestionBlocks: 2, OutputTokens: c.OutputTokens, BlockSize: c.BlockSize, Seed: c.Seed})
		if err != nil {
			return nil, err
		}
		for _, r := range reqs { // the hot prompts' ids come after every id SharedPrefix used
			g.next = max(g.next, slices.Max(r.Blocks)+1)
		}
		g.bursts(reqs, system)
	case WorkloadMix:
		third := max(1, c.Requests/3)
		reqs = g.conversations(third, c.Rate/3, convShape{system: 4, firstUser: 2, user: 1, turns: 8, think: 20 * time.Second, out: c.OutputTokens})
		reqs = append(reqs, g.conversations(third, c.Rate/3, convShape{system: 24, kinds: 4, firstUser: 1, user: 1, turns: 16, think: time.Second, out: c.OutputTokens / 2})...)
		reqs = append(reqs, g.rag(c.Requests-2*third, c.Rate/3)...)
	default:
		_, err := ParseWorkload(string(w))
		return nil, err
	}
	slices.SortStableFunc(reqs, func(a, b Request) int { return cmp.Compare(a.Arrival, b.Arrival) })
	BatchArrivals(reqs, c.Batch)
	return reqs, nil
}

// BatchArrivals gives reqs, sorted by arrival, same-instant batches of n:
// each request takes the arrival of the first of its batch (requests 0..n-1,
// n..2n-1, ...), so the mean rate is kept and arrivals stay sorted. n <= 1
// changes nothing.
func BatchArrivals(reqs []Request, n int) {
	if n <= 1 {
		return
	}
	for i := range reqs {
		reqs[i].Arrival = reqs[i-i%n].Arrival
	}
}

// gen holds a generator's state: its random stream and the next block id
// (ids are never reused, so different content never shares an id).
type gen struct {
	c    WorkloadConfig
	rng  *rand.Rand
	next uint64
}

func (g *gen) ids(n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = g.next
		g.next++
	}
	return out
}

// convShape is a conversation's shape: its system prompt (shared by every
// conversation of its kind when kinds > 0, else its own), the blocks of its
// first and later user messages, its turns, the mean think time between a
// turn's answer and the next question, and the mean answer length.
type convShape struct {
	system, kinds, firstUser, user, turns int
	think                                 time.Duration
	out                                   int
}

// conversations generates about n requests at about rate per second, over
// n/rate seconds: conversations start as a Poisson process (rate/turns per
// second, from a warm-up before time 0 so that the window is in steady state),
// and each turn re-sends the history. Turns outside the window are dropped.
func (g *gen) conversations(n int, rate float64, s convShape) []Request {
	var shared [][]uint64
	for range s.kinds {
		shared = append(shared, g.ids(s.system))
	}
	bs := g.c.BlockSize
	horizon := float64(n) / rate
	turnTime := float64(s.out)*0.02 + s.think.Seconds()
	start := -2 * float64(s.turns) * turnTime // conversations already running at 0
	convRate := rate / float64(s.turns)
	var reqs []Request
	for {
		start += g.rng.ExpFloat64() / convRate
		if start >= horizon {
			return reqs
		}
		var history []uint64
		if s.kinds > 0 {
			history = append(history, shared[g.rng.IntN(s.kinds)]...)
		} else {
			history = g.ids(s.system)
		}
		at := start
		turns := 1 + g.rng.IntN(2*s.turns-1) // mean s.turns
		for turn := 0; turn < turns && at < horizon; turn++ {
			user := s.user
			if turn == 0 {
				user = s.firstUser
			}
			history = append(history, g.ids(user)...)
			out := max(1, int(g.rng.ExpFloat64()*float64(s.out)))
			if at >= 0 {
				reqs = append(reqs, Request{
					Arrival: time.Duration(at * float64(time.Second)), InputTokens: len(history) * bs,
					OutputTokens: out, Blocks: slices.Clone(history),
				})
			}
			// The answer joins the history; the next question comes after the
			// answer is read and a think time.
			history = append(history, g.ids(BlocksFor(out, bs))...)
			at += float64(out)*0.02 + g.rng.ExpFloat64()*s.think.Seconds()
		}
	}
}

// rag generates n requests: a system prompt shared by all, one of 256
// documents of 4 to 12 blocks (Zipf popularity), a one-block question.
func (g *gen) rag(n int, rate float64) []Request {
	system := g.ids(2)
	docs := make([][]uint64, 256)
	for i := range docs {
		docs[i] = g.ids(4 + g.rng.IntN(9))
	}
	zipf := rand.NewZipf(g.rng, 1.1, 4, uint64(len(docs)-1))
	bs := g.c.BlockSize
	reqs := make([]Request, 0, n)
	t := 0.0
	for range n {
		t += g.rng.ExpFloat64() / rate
		blocks := slices.Concat(system, docs[zipf.Uint64()], g.ids(1))
		reqs = append(reqs, Request{
			Arrival: time.Duration(t * float64(time.Second)), InputTokens: len(blocks) * bs,
			OutputTokens: max(1, int(g.rng.ExpFloat64()*float64(g.c.OutputTokens))), Blocks: blocks,
		})
	}
	return reqs
}

// bursts gives reqs (shared-prefix prompts of system blocks each) on/off
// arrivals, bursts of BurstOn at BurstFactor x Rate separated by silences
// that keep the mean rate at Rate, and BurstHot of each burst's requests the
// burst's own system prompt, of fresh ids.
func (g *gen) bursts(reqs []Request, system int) {
	on := g.c.BurstOn.Seconds()
	period := on * g.c.BurstFactor // the burst's requests at Rate would take this long
	t, burstStart := 0.0, 0.0
	hot := g.ids(system)
	for i := range reqs {
		t += g.rng.ExpFloat64() / (g.c.Rate * g.c.BurstFactor)
		if t-burstStart > on {
			burstStart += period
			t = burstStart
			hot = g.ids(system)
		}
		reqs[i].Arrival = time.Duration(t * float64(time.Second))
		if g.rng.Float64() < g.c.BurstHot {
			reqs[i].Blocks = append(slices.Clone(hot), reqs[i].Blocks[system:]...)
		}
	}
}
