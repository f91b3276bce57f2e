package discovery

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/kvselect/kvselect/catalog"
)

// DefaultPoll is how often a Static source checks its file when
// StaticOptions.Poll is zero.
const DefaultPoll = 2 * time.Second

// MaxFileSize bounds a workers file; a larger file is rejected.
const MaxFileSize = 16 << 20

// DefaultMaxWorkers is Limits.MaxWorkers's default: the most workers one
// workers file may list.
const DefaultMaxWorkers = 65_536

// Limits bound a workers file as a whole: a file past one is refused whole
// (ErrTooManyWorkers, ErrTooManyRanks), before any of its workers is used,
// and on a reload the last good set stays in force. Each field's zero value
// means its default.
type Limits struct {
	// MaxWorkers bounds the file's worker entries. 0 means DefaultMaxWorkers.
	MaxWorkers int
	// MaxRanks bounds the data-parallel ranks of all the file's workers
	// together (the sum of their dp_size, see catalog.TotalRanks): every
	// worker may be within catalog.MaxDPSize and the whole still too many
	// (500 workers of 4,096 ranks fit in 32 KB). 0 means
	// catalog.DefaultMaxRanks, the selection service's own default bound
	// (selection.Config.MaxWorkerRanks), so a file the service would refuse
	// part of is refused whole instead.
	MaxRanks int
}

// bounds returns l with its defaults filled in.
func (l Limits) bounds() Limits {
	if l.MaxWorkers <= 0 {
		l.MaxWorkers = DefaultMaxWorkers
	}
	if l.MaxRanks <= 0 {
		l.MaxRanks = catalog.DefaultMaxRanks
	}
	return l
}

// racyWindow: a file modified this recently may change again without its
// modification time or size changing (coarse timestamps), so the next poll
// re-reads it and trusts the content hash instead.
const racyWindow = 2 * time.Second

// Defaults fill the fields a worker entry of a workers file leaves out (or
// sets to zero). They play the role of DYN_MODEL_NAME, DYN_KV_CACHE_BLOCK_SIZE,
// DYN_EPP_TOTAL_KV_BLOCKS and DYN_EPP_MAX_NUM_BATCHED_TOKENS.
type Defaults struct {
	Model                                         string
	BlockSize, TotalKVBlocks, MaxNumBatchedTokens int
}

// StaticOptions configures NewStatic.
type StaticOptions struct {
	// Path is the workers file (JSON or YAML; schema in the package
	// documentation). Required.
	Path string
	// Poll is how often Run checks the file. 0 means DefaultPoll; negative is
	// invalid. Ignored when Tick is set.
	Poll time.Duration
	// Tick, when non-nil, replaces the Poll ticker: Run checks the file once per
	// value received. Tests use it to drive polling step by step.
	Tick <-chan time.Time
	// Defaults fill fields the entries leave zero. Negative values are invalid.
	Defaults Defaults
	// Limits bound the file as a whole. The zero value means the defaults;
	// negative values are invalid.
	Limits Limits
	// RoleLabel groups the census log line by this label's value, as in
	// KubeOptions. Empty means no grouping.
	RoleLabel string
	// Logger receives the census line and rejected-file errors. Nil discards
	// them.
	Logger *slog.Logger
}

func (o StaticOptions) validate() error {
	var problems []string
	if o.Path == "" {
		problems = append(problems, "Path is empty")
	}
	if o.Poll < 0 {
		problems = append(problems, fmt.Sprintf("Poll %v is negative", o.Poll))
	}
	for _, f := range []struct {
		name string
		v    int
	}{
		{"Defaults.BlockSize", o.Defaults.BlockSize}, {"Defaults.TotalKVBlocks", o.Defaults.TotalKVBlocks},
		{"Defaults.MaxNumBatchedTokens", o.Defaults.MaxNumBatchedTokens},
		{"Limits.MaxWorkers", o.Limits.MaxWorkers}, {"Limits.MaxRanks", o.Limits.MaxRanks},
	} {
		if f.v < 0 {
			problems = append(problems, fmt.Sprintf("%s %d is negative", f.name, f.v))
		}
	}
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s", ErrInvalidOptions, strings.Join(problems, "; "))
}

// Static is a Source backed by a workers file that it polls for changes.
//
// The file is read and validated by NewStatic; Run emits that set at once and
// then, on every poll, re-reads the file when its modification time or size
// changed (or it was modified very recently), and emits a new Snapshot when
// the content hash and the parsed set changed. A file that has become
// unreadable or invalid, or passes its Limits, is logged at ERROR (once per
// distinct content or error, with the error naming why) and the last good
// Snapshot stays in force; nothing is emitted for it.
//
// Static is safe to share between goroutines; Run may be called once.
type Static struct {
	o    StaticOptions
	log  *slog.Logger
	once onceGuard
	now  func() time.Time

	// Owned by Run's goroutine after NewStatic returns.
	snap    Snapshot
	mod     time.Time
	size    int64
	racy    bool
	hash    [sha256.Size]byte
	lastErr string
	// rejected counts the reads of a changed file that were refused.
	rejected atomic.Uint64
}

// Rejections counts the times a changed workers file was refused on reload
// (unreadable, invalid, past Limits): the last good set was kept each time.
func (s *Static) Rejections() uint64 { return s.rejected.Load() }

var _ Source = (*Static)(nil)

// NewStatic validates o, then reads and parses the file. Errors: an error
// wrapping ErrInvalidOptions, the file's read error (test with errors.Is, for
// example fs.ErrNotExist), or an error wrapping ErrInvalidFile (and, for a
// file past o.Limits, ErrTooManyWorkers or ErrTooManyRanks).
func NewStatic(o StaticOptions) (*Static, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Static{o: o, log: log, now: time.Now}
	fi, err := os.Stat(o.Path)
	if err != nil {
		return nil, fmt.Errorf("discovery: workers file: %w", err)
	}
	data, err := readFile(o.Path)
	if err != nil {
		return nil, err
	}
	ws, err := ParseWorkersWithin(data, o.Defaults, o.Limits)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", o.Path, err)
	}
	s.remember(fi, data)
	s.snap = Snapshot{Workers: ws, Synced: true}
	return s, nil
}

// Run emits the file's workers, then polls the file until ctx is done and
// returns ctx.Err(). It starts no goroutine. Errors besides ctx.Err():
// ErrAlreadyRun on a second call, ErrInvalidOptions (wrapped) for a nil sink.
func (s *Static) Run(ctx context.Context, sink func(Snapshot)) error {
	if sink == nil {
		return fmt.Errorf("%w: sink is nil", ErrInvalidOptions)
	}
	if !s.once.start() {
		return ErrAlreadyRun
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	tick := s.o.Tick
	if tick == nil {
		poll := s.o.Poll
		if poll == 0 {
			poll = DefaultPoll
		}
		t := time.NewTicker(poll)
		defer t.Stop()
		tick = t.C
	}
	cen := census{log: s.log, roleLabel: s.o.RoleLabel, source: "file"}
	cen.observe(s.snap)
	sink(s.snap.clone())
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick:
		}
		if next, ok := s.poll(); ok && ctx.Err() == nil {
			s.snap = next
			cen.observe(next)
			sink(next.clone())
		}
	}
}

// remember records what was read, so the next poll can tell whether the file
// changed.
func (s *Static) remember(fi os.FileInfo, data []byte) {
	s.mod, s.size = fi.ModTime(), fi.Size()
	s.racy = s.now().Sub(fi.ModTime()) < racyWindow
	s.hash = sha256.Sum256(data)
}

// poll checks the file once and returns the new snapshot when the set changed.
func (s *Static) poll() (Snapshot, bool) {
	fi, err := os.Stat(s.o.Path)
	if err != nil {
		s.fileError(fmt.Errorf("discovery: workers file: %w", err))
		return Snapshot{}, false
	}
	if !s.racy && fi.ModTime().Equal(s.mod) && fi.Size() == s.size {
		return Snapshot{}, false
	}
	data, err := readFile(s.o.Path)
	if err != nil {
		s.fileError(err)
		return Snapshot{}, false
	}
	s.lastErr = "" // readable again: a later read error is news
	prev := s.hash
	s.remember(fi, data)
	if s.hash == prev {
		return Snapshot{}, false
	}
	ws, err := ParseWorkersWithin(data, s.o.Defaults, s.o.Limits)
	if err != nil {
		s.fileError(fmt.Errorf("%s: %w", s.o.Path, err))
		return Snapshot{}, false
	}
	next := Snapshot{Workers: ws, Synced: true}
	if next.Equal(s.snap) {
		return Snapshot{}, false
	}
	return next, true
}

// fileError logs err unless it repeats the last one logged. A missing file is
// one condition whichever call saw it first (the file can vanish between the
// stat and the open), so it is logged once.
func (s *Static) fileError(err error) {
	s.rejected.Add(1)
	if errors.Is(err, fs.ErrNotExist) {
		err = fmt.Errorf("discovery: workers file %s: %w", s.o.Path, fs.ErrNotExist)
	}
	if msg := err.Error(); msg != s.lastErr {
		s.lastErr = msg
		s.log.Error("workers file rejected; keeping the last good set",
			slog.String("path", s.o.Path), slog.Int("workers", len(s.snap.Workers)), slog.String("error", msg))
	}
}

func readFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("discovery: workers file: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("discovery: workers file: %w", err)
	}
	if len(data) > MaxFileSize {
		return nil, fmt.Errorf("%w: %s is larger than %d bytes", ErrInvalidFile, path, MaxFileSize)
	}
	return data, nil
}

// fileSchema is the workers file: one object with a "workers" list. The list
// is a pointer so that an empty or truncated file (no "workers" key) is an
// error rather than an empty set.
type fileSchema struct {
	Workers *[]fileWorker `json:"workers"`
}

type fileWorker struct {
	ID                  string            `json:"id"`
	Identity            string            `json:"identity"`
	Endpoint            string            `json:"endpoint"`
	Model               string            `json:"model"`
	KVEventsEndpoint    string            `json:"kv_events_endpoint"`
	KVEventsEndpoints   map[int]string    `json:"kv_events_endpoints"`
	ReplayEndpoint      string            `json:"replay_endpoint"`
	BlockSize           int               `json:"block_size"`
	TotalKVBlocks       int               `json:"total_kv_blocks"`
	MaxNumBatchedTokens int               `json:"max_num_batched_tokens"`
	Labels              map[string]string `json:"labels"`
	DPStart             int               `json:"dp_start"`
	DPSize              *int              `json:"dp_size"`
}

// ParseWorkers is ParseWorkersWithin with the default Limits.
func ParseWorkers(data []byte, d Defaults) ([]catalog.Worker, error) {
	return ParseWorkersWithin(data, d, Limits{})
}

// ParseWorkersWithin decodes a workers file (JSON or YAML; schema in the
// package documentation), fills zero fields from d, and validates the result.
// It returns the workers sorted by ID, or an error wrapping ErrInvalidFile
// that lists every problem found: a syntax error, an unknown or duplicate
// key, a missing "workers" key, a worker without id or endpoint, both
// kv_events_endpoint and kv_events_endpoints, a dp_size below 1, a worker that
// fails catalog.Worker.Validate, or an id used twice. A file past lim (values
// of 0 or below mean the defaults) is refused whole, before its workers are
// looked at, with an error wrapping ErrInvalidFile and ErrTooManyWorkers or
// ErrTooManyRanks. ParseWorkersWithin is a pure function, safe for concurrent
// use.
func ParseWorkersWithin(data []byte, d Defaults, lim Limits) ([]catalog.Worker, error) {
	lim = lim.bounds()
	var f fileSchema
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidFile, err)
	}
	if f.Workers == nil {
		return nil, fmt.Errorf("%w: no \"workers\" list", ErrInvalidFile)
	}
	if n := len(*f.Workers); n > lim.MaxWorkers {
		return nil, fmt.Errorf("%w: %w: %d workers, above the bound of %d", ErrInvalidFile, ErrTooManyWorkers, n, lim.MaxWorkers)
	}
	ranks := 0
	for _, fw := range *f.Workers {
		ranks += fw.rankCount()
	}
	if ranks > lim.MaxRanks {
		return nil, fmt.Errorf("%w: %w: %d workers have %d data-parallel ranks together (the sum of their dp_size), above the bound of %d",
			ErrInvalidFile, ErrTooManyRanks, len(*f.Workers), ranks, lim.MaxRanks)
	}
	var problems []string
	ws := make([]catalog.Worker, 0, len(*f.Workers))
	seen := make(map[string]int, len(*f.Workers))
	for i, fw := range *f.Workers {
		name := fmt.Sprintf("workers[%d]", i)
		if fw.ID != "" {
			name = fmt.Sprintf("workers[%d] (%q)", i, fw.ID)
		}
		w, errs := fw.worker(d)
		if err := w.Validate(); err != nil {
			errs = append(errs, err.Error())
		}
		if j, dup := seen[w.ID]; dup && w.ID != "" {
			errs = append(errs, fmt.Sprintf("id already used by workers[%d]", j))
		} else {
			seen[w.ID] = i
		}
		for _, e := range errs {
			problems = append(problems, name+": "+e)
		}
		ws = append(ws, w)
	}
	if len(problems) > 0 {
		return nil, fmt.Errorf("%w: %s", ErrInvalidFile, strings.Join(problems, "; "))
	}
	sortWorkers(ws)
	return ws, nil
}

// rankCount is the data-parallel ranks the entry asks for, as
// catalog.TotalRanks counts them: dp_size (1 when absent) clamped to
// [0, catalog.MaxDPSize].
func (fw fileWorker) rankCount() int {
	if fw.DPSize == nil {
		return 1
	}
	return max(min(*fw.DPSize, catalog.MaxDPSize), 0)
}

func (fw fileWorker) worker(d Defaults) (catalog.Worker, []string) {
	var problems []string
	if fw.Endpoint == "" {
		problems = append(problems, "endpoint is empty")
	}
	if fw.KVEventsEndpoint != "" && len(fw.KVEventsEndpoints) > 0 {
		problems = append(problems, "kv_events_endpoint and kv_events_endpoints are both set")
	}
	dpSize := 1
	if fw.DPSize != nil {
		dpSize = *fw.DPSize
		if dpSize < 1 {
			problems = append(problems, fmt.Sprintf("dp_size %d is below 1", dpSize))
		}
	}
	w := catalog.Worker{
		ID:                  fw.ID,
		Model:               orDefault(fw.Model, d.Model),
		Endpoint:            fw.Endpoint,
		DPStart:             fw.DPStart,
		DPSize:              dpSize,
		ReplayEndpoint:      fw.ReplayEndpoint,
		BlockSize:           orDefault(fw.BlockSize, d.BlockSize),
		TotalKVBlocks:       orDefault(fw.TotalKVBlocks, d.TotalKVBlocks),
		MaxNumBatchedTokens: orDefault(fw.MaxNumBatchedTokens, d.MaxNumBatchedTokens),
		Labels:              fw.Labels,
		Identity:            orDefault(fw.Identity, fw.ID),
	}
	switch {
	case fw.KVEventsEndpoint != "":
		w.KVEventEndpoints = map[int]string{fw.DPStart: fw.KVEventsEndpoint}
	case len(fw.KVEventsEndpoints) > 0:
		w.KVEventEndpoints = fw.KVEventsEndpoints
	}
	return w.Clone(), problems
}

func orDefault[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}
