package extproc

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// Defaults of Options.
const (
	DefaultMaxBodyBytes = 8 << 20
	DefaultChunkSize    = 62000
	DefaultMaxInflight  = 1024
	// MaxChunkSize is the largest allowed Options.ChunkSize.
	MaxChunkSize = 1 << 20
)

// Health service names registered by RegisterHealth.
const (
	HealthLiveness  = "liveness"
	HealthReadiness = "readiness"
	// HealthExtProc is the ext_proc gRPC service name; it follows readiness.
	HealthExtProc = "envoy.service.ext_proc.v3.ExternalProcessor"
	// HealthInferenceExtension is the service name GAIE's manifests and
	// conformance suite probe; it follows readiness.
	HealthInferenceExtension = "inference-extension"
)

// Options configures a Server. The zero value of every field but Picker
// means its documented default.
type Options struct {
	// Picker chooses destinations. Required.
	Picker Picker
	// Status maps a Picker error to an HTTP status for the ImmediateResponse;
	// results outside 400-599 become 500. Default: every error is 500.
	Status func(error) int
	// Reason, when set, names a Picker error's cause in the
	// ImmediateResponse's body, after its fixed phrase ("no endpoint
	// available (unknown_model)"): a short token of lower-case letters,
	// digits and _:- (selection.RefusalReason's), anything else left out,
	// and "" for none. The details stay in the log.
	Reason func(error) string
	// MaxBodyBytes caps the buffered request body; a larger body is answered
	// with 413. Default DefaultMaxBodyBytes (8 MiB); must not be negative.
	MaxBodyBytes int
	// ChunkSize is the largest body chunk re-sent in full-duplex mode.
	// Default DefaultChunkSize (62000); 1..MaxChunkSize.
	ChunkSize int
	// MaxInflight caps the requests in their request phase (headers received,
	// no decision yet), which bounds buffered-body memory to about
	// MaxInflight*MaxBodyBytes; excess requests get 503. Default
	// DefaultMaxInflight (1024); must not be negative.
	MaxInflight int
	// Logger receives one line per failed request (with the cause) and
	// protocol problems. Default: discard.
	Logger *slog.Logger
	// Metrics receives outcomes, pick latency, served-endpoint mismatches and
	// the in-flight count. Default NopRecorder.
	Metrics Recorder
	// Now reads the clock for pick latency. Default time.Now.
	Now func() time.Time
	// ConformanceTestHooks turns on the two test hooks of GAIE's
	// conformance suite: a request's test-epp-endpoint-selection header
	// (ip or ip:port, comma-separated) becomes its subset hint, over the
	// gateway's; and the served endpoint the gateway reports is echoed to
	// the client as x-conformance-test-served-endpoint. Off by default: any
	// client could steer its own requests with the header.
	ConformanceTestHooks bool
}

// Server is the ext_proc server. Create it with NewServer; it is safe for
// concurrent use and starts no goroutines of its own.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	picker    Picker
	status    func(error) int
	reason    func(error) string
	maxBody   int
	chunk     int
	maxFlight int64
	log       *slog.Logger
	rec       Recorder
	now       func() time.Time
	health    *health.Server
	testHooks bool
	inflight  atomic.Int64
	ready     atomic.Bool
}

var _ extprocv3.ExternalProcessorServer = (*Server)(nil)

// NewServer validates opts and returns a Server. The health status starts
// NOT_SERVING for readiness and the ext_proc service until SetReady(true);
// liveness is SERVING. Errors wrap ErrInvalidOptions.
func NewServer(opts Options) (*Server, error) {
	var problems []error
	bad := func(format string, a ...any) {
		problems = append(problems, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOptions}, a...)...))
	}
	if opts.Picker == nil {
		bad("Picker is required")
	}
	if opts.MaxBodyBytes < 0 {
		bad("MaxBodyBytes %d is negative", opts.MaxBodyBytes)
	}
	if opts.ChunkSize < 0 || opts.ChunkSize > MaxChunkSize {
		bad("ChunkSize %d is outside 0..%d", opts.ChunkSize, MaxChunkSize)
	}
	if opts.MaxInflight < 0 {
		bad("MaxInflight %d is negative", opts.MaxInflight)
	}
	if len(problems) > 0 {
		return nil, errors.Join(problems...)
	}
	s := &Server{
		picker:    opts.Picker,
		status:    opts.Status,
		reason:    opts.Reason,
		maxBody:   opts.MaxBodyBytes,
		chunk:     opts.ChunkSize,
		maxFlight: int64(opts.MaxInflight),
		log:       opts.Logger,
		rec:       opts.Metrics,
		now:       opts.Now,
		testHooks: opts.ConformanceTestHooks,
		health:    health.NewServer(),
	}
	if s.status == nil {
		s.status = func(error) int { return http.StatusInternalServerError }
	}
	if s.maxBody == 0 {
		s.maxBody = DefaultMaxBodyBytes
	}
	if s.chunk == 0 {
		s.chunk = DefaultChunkSize
	}
	if s.maxFlight == 0 {
		s.maxFlight = DefaultMaxInflight
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.rec == nil {
		s.rec = NopRecorder{}
	}
	if s.now == nil {
		s.now = time.Now
	}
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	s.health.SetServingStatus(HealthLiveness, healthpb.HealthCheckResponse_SERVING)
	s.SetReady(false)
	return s, nil
}

// Register registers the ext_proc service on g.
func (s *Server) Register(g *grpc.Server) {
	extprocv3.RegisterExternalProcessorServer(g, s)
}

// RegisterHealth registers the gRPC health service (liveness, readiness,
// the ext_proc service name and GAIE's inference-extension) on g, which may be the ext_proc server or a
// separate health server.
func (s *Server) RegisterHealth(g *grpc.Server) {
	healthpb.RegisterHealthServer(g, s.health)
}

// GRPCServerOptions returns the server options the ext_proc grpc.Server needs:
// a receive limit large enough for a whole buffered body.
func (s *Server) GRPCServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.MaxRecvMsgSize(s.maxBody + 1<<20)}
}

// SetReady switches the readiness and ext_proc health services between
// SERVING and NOT_SERVING. Requests are served either way; readiness only
// tells the gateway whether to send them.
func (s *Server) SetReady(ready bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ready {
		st = healthpb.HealthCheckResponse_SERVING
	}
	s.ready.Store(ready)
	s.health.SetServingStatus(HealthReadiness, st)
	s.health.SetServingStatus(HealthExtProc, st)
	s.health.SetServingStatus(HealthInferenceExtension, st)
}

// Ready reports the last value given to SetReady.
func (s *Server) Ready() bool { return s.ready.Load() }

// Inflight returns the number of requests in their request phase.
func (s *Server) Inflight() int { return int(s.inflight.Load()) }

// Process serves one ext_proc stream (one HTTP request). It returns nil when
// the stream ends normally, including after an ImmediateResponse.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	x := &exchange{s: s, stream: stream, ctx: stream.Context(),
		reqMode:  extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		respMode: extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
	}
	defer x.finish()
	for first := true; ; first = false {
		req, err := stream.Recv()
		if err != nil {
			return x.recvError(err)
		}
		if first {
			if err := x.configure(req); err != nil {
				return err
			}
		}
		if err := x.handle(req); err != nil {
			if errors.Is(err, errFinished) {
				return nil
			}
			return err
		}
	}
}

// errFinished ends Process without an error (after an ImmediateResponse).
var errFinished = errors.New("extproc: finished")

func (x *exchange) recvError(err error) error {
	if errors.Is(err, io.EOF) {
		if x.phase != phaseDone && x.phase != phaseHeaders {
			x.s.log.Debug("ext_proc stream closed early", "request_id", x.hdr.requestID, "phase", x.phase)
		}
		return nil
	}
	if x.ctx.Err() != nil {
		x.s.log.Debug("ext_proc stream cancelled", "request_id", x.hdr.requestID, "phase", x.phase)
	}
	return err
}
