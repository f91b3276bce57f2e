package fakeengine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Disaggregated (prefill/decode) serving. A completion request can be one leg of
// a P/D exchange in the wire form of one of three engines:
//
//   - vLLM (NIXL connector, pull mode): kv_transfer_params.do_remote_decode marks
//     the prefill leg, whose answer carries kv_transfer_params naming this engine
//     and the blocks; do_remote_prefill with those parameters marks the decode
//     leg, which pulls the blocks from the named engine.
//   - SGLang: bootstrap_host, bootstrap_port and bootstrap_room on both legs,
//     sent at once; the PDRole says which leg this engine serves. The decode asks
//     the prefill engine's bootstrap server (BootstrapHandler) for the room and
//     waits until the prefill has reached it.
//   - TensorRT-LLM: disaggregated_params.request_type "context_only" marks the
//     prefill leg, whose first choice carries disaggregated_params (with an opaque
//     state naming this engine); "generation_only" with those parameters marks
//     the decode leg.
//
// The KV itself moves over HTTP: a decode engine POSTs to the prefill engine's
// PullPath (vLLM, TensorRT-LLM) or GETs its bootstrap room, and gets the number
// of prompt tokens the prefill computed and a fingerprint of them, which must
// match its own prompt. The transferred tokens are not computed again: they are
// left out of the decode's TTFT, which adds TransferPerBlock per pulled block.

// PullPath is where a prefill engine's Handler answers KV pulls:
// POST {"engine_id": ..., "request_id": ...} returns {"tokens": n, "fingerprint":
// hex}, once per held request (404 afterwards, or after KVHoldTimeout).
const PullPath = "/fake/kv/pull"

// BootstrapRoomPath prefixes the SGLang bootstrap endpoint of BootstrapHandler:
// GET BootstrapRoomPath + "<room>" waits until a prefill leg with that
// bootstrap_room is computed and returns it like a pull.
const BootstrapRoomPath = "/fake/bootstrap/rooms/"

// maxHeld bounds the held transfers and the open bootstrap rooms of an engine;
// past it a prefill leg is answered 503.
const maxHeld = 4096

// maxPullAnswer bounds the answer of a pull or a bootstrap room.
const maxPullAnswer = 64 << 10

// PDRole is an engine's part in disaggregated serving.
type PDRole uint8

const (
	// PDRoleAny serves vLLM and TensorRT-LLM legs of either kind (vLLM's
	// kv_both) and refuses SGLang bootstrap requests, which need a mode. Default.
	PDRoleAny PDRole = iota
	// PDRolePrefill serves prefill legs only (SGLang's --disaggregation-mode
	// prefill); BootstrapHandler answers for its rooms.
	PDRolePrefill
	// PDRoleDecode serves decode legs only (SGLang's --disaggregation-mode decode).
	PDRoleDecode
)

// String returns "any", "prefill" or "decode".
func (r PDRole) String() string {
	switch r {
	case PDRoleAny:
		return "any"
	case PDRolePrefill:
		return "prefill"
	case PDRoleDecode:
		return "decode"
	default:
		return fmt.Sprintf("PDRole(%d)", uint8(r))
	}
}

// pdDefaults applies the defaults of the P/D fields and appends their problems.
func (o *Options) pdDefaults(problems []string) []string {
	if o.PDRole > PDRoleDecode {
		problems = append(problems, fmt.Sprintf("unknown PDRole %d", o.PDRole))
	}
	if o.EngineID == "" {
		o.EngineID = DefaultEngineID
	}
	if o.AdvertiseAddr != "" {
		if _, _, err := net.SplitHostPort(o.AdvertiseAddr); err != nil {
			problems = append(problems, fmt.Sprintf("AdvertiseAddr %q is not host:port", o.AdvertiseAddr))
		}
	}
	if o.TransferPerBlock < 0 {
		problems = append(problems, fmt.Sprintf("TransferPerBlock %v < 0", o.TransferPerBlock))
	}
	if o.KVHoldTimeout == 0 {
		o.KVHoldTimeout = DefaultKVHoldTimeout
	} else if o.KVHoldTimeout < 0 {
		problems = append(problems, fmt.Sprintf("KVHoldTimeout %v < 0", o.KVHoldTimeout))
	}
	if o.KVWaitTimeout == 0 {
		o.KVWaitTimeout = DefaultKVWaitTimeout
	} else if o.KVWaitTimeout < 0 {
		problems = append(problems, fmt.Sprintf("KVWaitTimeout %v < 0", o.KVWaitTimeout))
	}
	return problems
}

// pdFields are the raw P/D fields of a request other than kv_transfer_params.
type pdFields struct {
	disaggregated json.RawMessage // TensorRT-LLM
	host          json.RawMessage // SGLang bootstrap_*
	port          json.RawMessage
	room          json.RawMessage
}

type legKind uint8

const (
	legNone          legKind = iota
	legVLLMPrefill           // kv_transfer_params.do_remote_decode
	legVLLMDecode            // kv_transfer_params.do_remote_prefill
	legSGLangPrefill         // bootstrap fields on a PDRolePrefill engine
	legSGLangDecode          // bootstrap fields on a PDRoleDecode engine
	legTRTContext            // disaggregated_params.request_type context_only
	legTRTGeneration         // generation_only
)

// leg is what a completion request asks of the engine in P/D serving.
type leg struct {
	kind legKind
	// Decode legs: where the KV is (the pull endpoint's or the bootstrap
	// server's host:port) and which transfer.
	addr      string
	engineID  string
	requestID string
	room      uint64
	salt      string
}

func (l leg) prefill() bool {
	return l.kind == legVLLMPrefill || l.kind == legSGLangPrefill || l.kind == legTRTContext
}

func (l leg) decode() bool {
	return l.kind == legVLLMDecode || l.kind == legSGLangDecode || l.kind == legTRTGeneration
}

// legResult is what a leg adds to the request: the tokens a decode leg took over
// and the fields a prefill leg's answer carries.
type legResult struct {
	transferred         int // prompt tokens taken from the prefill engine
	pulledBlocks        int // blocks they fill (TransferPerBlock each)
	kvTransferParams    json.RawMessage
	disaggregatedParams json.RawMessage
	promptTokenIDs      []uint32
}

// vllmParams is the part of vLLM's kv_transfer_params the engine reads.
type vllmParams struct {
	DoRemoteDecode  *bool           `json:"do_remote_decode"`
	DoRemotePrefill *bool           `json:"do_remote_prefill"`
	RemoteEngineID  *string         `json:"remote_engine_id"`
	RemoteRequestID *string         `json:"remote_request_id"`
	RemoteHost      *string         `json:"remote_host"`
	RemotePort      *int            `json:"remote_port"`
	RemoteBlockIDs  json.RawMessage `json:"remote_block_ids"`
}

// trtParams is the part of TensorRT-LLM's disaggregated_params the engine reads.
type trtParams struct {
	RequestType        string  `json:"request_type"`
	EncodedOpaqueState *string `json:"encoded_opaque_state"`
}

// opaqueState is what the fake context engine encodes in encoded_opaque_state.
type opaqueState struct {
	Addr      string `json:"addr"`
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
}

// parseLeg reads the P/D fields of a validated request. A request may carry the
// fields of one protocol only; a P/D leg has one prompt, and a vLLM or
// TensorRT-LLM prefill leg does not stream.
func (e *Engine) parseLeg(p *prepared) (leg, *apiError) {
	var found []leg
	if p.kvTransferParams != nil {
		l, aerr := parseVLLM(p.kvTransferParams)
		if aerr != nil {
			return leg{}, aerr
		}
		if l.kind != legNone {
			found = append(found, l)
		}
	}
	if !isNull(p.pd.disaggregated) {
		l, aerr := parseTRT(p.pd.disaggregated)
		if aerr != nil {
			return leg{}, aerr
		}
		if l.kind != legNone {
			found = append(found, l)
		}
	}
	if !isNull(p.pd.host) || !isNull(p.pd.port) || !isNull(p.pd.room) {
		l, aerr := e.parseSGLang(p.pd)
		if aerr != nil {
			return leg{}, aerr
		}
		found = append(found, l)
	}
	switch {
	case len(found) == 0:
		return leg{}, nil
	case len(found) > 1:
		return leg{}, badRequest("the request carries the P/D fields of more than one protocol")
	}
	l := found[0]
	l.salt = p.cacheSalt
	switch {
	case len(p.prompts) != 1:
		return leg{}, badRequest("a P/D leg carries one prompt, got %d", len(p.prompts))
	case l.prefill() && p.stream && l.kind != legSGLangPrefill:
		// (SGLang's prefill gets the client's body, stream flag included.)
		return leg{}, badRequest("a prefill leg must not stream")
	case l.prefill() && e.opts.PDRole == PDRoleDecode:
		return leg{}, badRequest("this engine serves decode legs only")
	case l.decode() && e.opts.PDRole == PDRolePrefill:
		return leg{}, badRequest("this engine serves prefill legs only")
	}
	return l, nil
}

func parseVLLM(raw json.RawMessage) (leg, *apiError) {
	var v vllmParams
	if err := json.Unmarshal(raw, &v); err != nil {
		return leg{}, badRequest("kv_transfer_params: %v", err)
	}
	remoteDecode := v.DoRemoteDecode != nil && *v.DoRemoteDecode
	remotePrefill := v.DoRemotePrefill != nil && *v.DoRemotePrefill
	switch {
	case remoteDecode && remotePrefill:
		return leg{}, badRequest("kv_transfer_params: do_remote_decode and do_remote_prefill are both true")
	case remoteDecode:
		return leg{kind: legVLLMPrefill}, nil
	case !remotePrefill:
		return leg{}, nil
	}
	switch {
	case v.RemoteEngineID == nil || *v.RemoteEngineID == "":
		return leg{}, badRequest("kv_transfer_params: do_remote_prefill needs remote_engine_id")
	case v.RemoteRequestID == nil || *v.RemoteRequestID == "":
		return leg{}, badRequest("kv_transfer_params: do_remote_prefill needs remote_request_id")
	case v.RemoteHost == nil || *v.RemoteHost == "":
		return leg{}, badRequest("kv_transfer_params: do_remote_prefill needs remote_host")
	case v.RemotePort == nil || *v.RemotePort < 1 || *v.RemotePort > 65535:
		return leg{}, badRequest("kv_transfer_params: do_remote_prefill needs remote_port in [1, 65535]")
	case isNull(v.RemoteBlockIDs):
		return leg{}, badRequest("kv_transfer_params: do_remote_prefill needs remote_block_ids")
	}
	return leg{
		kind:      legVLLMDecode,
		addr:      net.JoinHostPort(*v.RemoteHost, strconv.Itoa(*v.RemotePort)),
		engineID:  *v.RemoteEngineID,
		requestID: *v.RemoteRequestID,
	}, nil
}

func parseTRT(raw json.RawMessage) (leg, *apiError) {
	var t trtParams
	if err := json.Unmarshal(raw, &t); err != nil {
		return leg{}, badRequest("disaggregated_params: %v", err)
	}
	switch t.RequestType {
	case "", "context_and_generation":
		return leg{}, nil
	case "context_only":
		return leg{kind: legTRTContext}, nil
	case "generation_only":
	default:
		return leg{}, badRequest("disaggregated_params: unknown request_type %q", t.RequestType)
	}
	if t.EncodedOpaqueState == nil {
		return leg{}, badRequest("disaggregated_params: generation_only needs encoded_opaque_state")
	}
	b, err := base64.StdEncoding.DecodeString(*t.EncodedOpaqueState)
	var st opaqueState
	if err == nil {
		err = json.Unmarshal(b, &st)
	}
	if err != nil || st.Addr == "" || st.RequestID == "" {
		return leg{}, badRequest("disaggregated_params: encoded_opaque_state is not this engine family's")
	}
	return leg{kind: legTRTGeneration, addr: st.Addr, engineID: st.EngineID, requestID: st.RequestID}, nil
}

func (e *Engine) parseSGLang(f pdFields) (leg, *apiError) {
	var host string
	var port int
	var room uint64
	if err := json.Unmarshal(f.host, &host); err != nil || host == "" {
		return leg{}, badRequest("bootstrap_host must be a non-empty string")
	}
	if err := json.Unmarshal(f.port, &port); err != nil || port < 1 || port > 65535 {
		return leg{}, badRequest("bootstrap_port must be an integer in [1, 65535]")
	}
	if err := json.Unmarshal(f.room, &room); err != nil {
		return leg{}, badRequest("bootstrap_room must be a non-negative integer")
	}
	// SGLang's mini_lb writes an IPv6 bootstrap_host in brackets.
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	l := leg{addr: net.JoinHostPort(host, strconv.Itoa(port)), room: room}
	switch e.opts.PDRole {
	case PDRolePrefill:
		l.kind = legSGLangPrefill
	case PDRoleDecode:
		l.kind = legSGLangDecode
	default:
		return leg{}, badRequest("bootstrap fields need an engine in prefill or decode mode")
	}
	return l, nil
}

// fingerprint identifies a prompt's tokens in a transfer.
func fingerprint(tokens []uint32) string {
	h := sha256.New()
	var b [4]byte
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:], t)
		h.Write(b[:])
	}
	return hex.EncodeToString(h.Sum(nil))
}

// transferJSON is the answer of a pull or a bootstrap room.
type transferJSON struct {
	Tokens      int    `json:"tokens"`
	Fingerprint string `json:"fingerprint"`
}

type pullJSON struct {
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
}

// takeOver gets a decode leg's KV from its prefill engine: a pull (vLLM,
// TensorRT-LLM) or the bootstrap room (SGLang), bounded by KVWaitTimeout. The
// tokens this engine had cached already are not transferred.
func (e *Engine) takeOver(ctx context.Context, l leg, prompt []uint32, cached int) (legResult, *apiError) {
	wctx, cancel := context.WithTimeout(ctx, e.opts.KVWaitTimeout)
	defer cancel()
	var req *http.Request
	var err error
	if l.kind == legSGLangDecode {
		req, err = http.NewRequestWithContext(wctx, http.MethodGet,
			"http://"+l.addr+BootstrapRoomPath+strconv.FormatUint(l.room, 10), nil)
	} else {
		body, _ := json.Marshal(pullJSON{EngineID: l.engineID, RequestID: l.requestID})
		req, err = http.NewRequestWithContext(wctx, http.MethodPost, "http://"+l.addr+PullPath, bytes.NewReader(body))
		if err == nil {
			req.Header.Set("Content-Type", "application/json")
		}
	}
	if err != nil {
		return legResult{}, &apiError{status: http.StatusBadGateway, msg: fmt.Sprintf("KV transfer from %s: %v", l.addr, err)}
	}
	resp, err := e.web.pd.httpClient().Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return legResult{}, errCanceled()
		}
		return legResult{}, &apiError{status: http.StatusBadGateway, msg: fmt.Sprintf("KV transfer from %s failed: %v", l.addr, err)}
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxPullAnswer))
	if err != nil {
		if ctx.Err() != nil {
			return legResult{}, errCanceled()
		}
		return legResult{}, &apiError{status: http.StatusBadGateway, msg: fmt.Sprintf("KV transfer from %s failed: %v", l.addr, err)}
	}
	if resp.StatusCode != http.StatusOK {
		return legResult{}, &apiError{status: http.StatusBadGateway, msg: fmt.Sprintf("KV transfer from %s: %s: %s", l.addr, resp.Status, bytes.TrimSpace(data))}
	}
	var got transferJSON
	if err := json.Unmarshal(data, &got); err != nil {
		return legResult{}, &apiError{status: http.StatusBadGateway, msg: fmt.Sprintf("KV transfer from %s: bad answer: %v", l.addr, err)}
	}
	if got.Fingerprint != fingerprint(prompt) || got.Tokens < 0 || got.Tokens > len(prompt) {
		return legResult{}, badRequest("the KV transferred from %s is another prompt's", l.addr)
	}
	transferred := max(got.Tokens-cached, 0)
	bs := e.opts.BlockSize
	return legResult{transferred: transferred, pulledBlocks: (transferred + bs - 1) / bs}, nil
}

// handOver makes a computed prefill leg's KV available to its decode: vLLM and
// TensorRT-LLM hold it for one pull and return the parameters that name it;
// SGLang opens the bootstrap room and waits, at most KVHoldTimeout, for the
// decode to take it.
func (e *Engine) handOver(r *http.Request, l leg, prompt []uint32, id string) (legResult, *apiError) {
	fp := fingerprint(prompt)
	switch l.kind {
	case legSGLangPrefill:
		return legResult{}, e.awaitDecode(r.Context(), l.room, len(prompt), fp)
	case legTRTContext:
		ctxID := e.web.pd.nextCtxID()
		key := strconv.FormatInt(ctxID, 10)
		if aerr := e.hold(key, len(prompt), fp); aerr != nil {
			return legResult{}, aerr
		}
		st, _ := json.Marshal(opaqueState{Addr: e.advertise(r), EngineID: e.opts.EngineID, RequestID: key})
		params, _ := json.Marshal(map[string]any{
			"request_type":         "context_only",
			"first_gen_tokens":     []uint32{FirstWordToken},
			"ctx_request_id":       ctxID,
			"encoded_opaque_state": base64.StdEncoding.EncodeToString(st),
			"draft_tokens":         nil,
		})
		return legResult{disaggregatedParams: params, promptTokenIDs: prompt}, nil
	default: // legVLLMPrefill
		if aerr := e.hold(id, len(prompt), fp); aerr != nil {
			return legResult{}, aerr
		}
		host, port, _ := net.SplitHostPort(e.advertise(r))
		portNum, _ := strconv.Atoi(port)
		params, _ := json.Marshal(map[string]any{
			"do_remote_prefill": true,
			"do_remote_decode":  false,
			"remote_block_ids":  [][]uint64{e.BlockHashes(prompt, "", l.salt)},
			"remote_engine_id":  e.opts.EngineID,
			"remote_request_id": id,
			"remote_host":       host,
			"remote_port":       portNum,
			"tp_size":           1,
			"remote_num_tokens": len(prompt),
		})
		return legResult{kvTransferParams: params}, nil
	}
}

// advertise is the host:port decode engines pull from.
func (e *Engine) advertise(r *http.Request) string {
	if e.opts.AdvertiseAddr != "" {
		return e.opts.AdvertiseAddr
	}
	if ep := e.HTTPEndpoint(); ep != "" {
		return ep
	}
	return r.Host
}

// heldKV is a prefill leg's KV waiting for its pull.
type heldKV struct {
	tokens      int
	fingerprint string
	expires     time.Time
}

// room is an SGLang bootstrap room: the prefill leg fills it, the decode leg
// takes it. Its fields are guarded by pdState.mu.
type room struct {
	ready     chan struct{} // closed when the prefill reached the room
	taken     chan struct{} // closed when the decode took it
	prefilled bool
	claimed   bool // a decode is waiting on it
	tokens    int
	fp        string
}

// pdState is an engine's P/D bookkeeping: KV held for pulls and the open
// bootstrap rooms, both bounded by maxHeld.
type pdState struct {
	mu     sync.Mutex
	holds  map[string]heldKV
	rooms  map[uint64]*room
	ctxIDs int64

	clientOnce sync.Once
	client     *http.Client
}

// httpClient is the client decode legs pull with. It keeps no idle connection,
// so it leaves no goroutine behind.
func (s *pdState) httpClient() *http.Client {
	s.clientOnce.Do(func() {
		s.client = &http.Client{
			Transport:     &http.Transport{Proxy: nil, DisableKeepAlives: true},
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		}
	})
	return s.client
}

func (s *pdState) nextCtxID() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ctxIDs++
	return s.ctxIDs
}

// sweepLocked drops the holds that expired by now and returns how many.
func (s *pdState) sweepLocked(now time.Time) int {
	n := 0
	for k, h := range s.holds {
		if !now.Before(h.expires) {
			delete(s.holds, k)
			n++
		}
	}
	return n
}

// hold keeps a prefill leg's KV for one pull, until KVHoldTimeout.
func (e *Engine) hold(key string, tokens int, fp string) *apiError {
	now := e.now()
	s := &e.web.pd
	s.mu.Lock()
	expired := s.sweepLocked(now)
	full := len(s.holds) >= maxHeld
	if !full {
		if s.holds == nil {
			s.holds = map[string]heldKV{}
		}
		s.holds[key] = heldKV{tokens: tokens, fingerprint: fp, expires: now.Add(e.opts.KVHoldTimeout)}
	}
	s.mu.Unlock()
	e.web.update(func(st *HTTPStats) { st.HoldsExpired += uint64(expired) })
	if full {
		return &apiError{status: http.StatusServiceUnavailable, msg: fmt.Sprintf("%d transfers are held already", maxHeld)}
	}
	return nil
}

// handlePull answers a decode engine's pull of held KV, once.
func (e *Engine) handlePull(w http.ResponseWriter, r *http.Request) {
	body, aerr := readBody(w, r)
	var req pullJSON
	if aerr == nil {
		aerr = decodeBody(body, &req)
	}
	if aerr == nil && e.closed() {
		aerr = &apiError{status: http.StatusServiceUnavailable, msg: "the engine is shutting down"}
	}
	if aerr != nil {
		e.fail(w, aerr)
		return
	}
	now := e.now()
	s := &e.web.pd
	s.mu.Lock()
	expired := s.sweepLocked(now)
	h, ok := s.holds[req.RequestID]
	ok = ok && req.EngineID == e.opts.EngineID
	if ok {
		delete(s.holds, req.RequestID)
	}
	s.mu.Unlock()
	e.web.update(func(st *HTTPStats) {
		st.HoldsExpired += uint64(expired)
		if ok {
			st.Pulls++
		}
	})
	if !ok {
		e.fail(w, &apiError{status: http.StatusNotFound, msg: fmt.Sprintf("engine %q holds no KV for request %q", req.EngineID, req.RequestID)})
		return
	}
	writeJSON(w, http.StatusOK, transferJSON{Tokens: h.tokens, Fingerprint: h.fingerprint})
}

// roomLocked returns the room id, creating it; nil when maxHeld rooms are open.
func (s *pdState) roomLocked(id uint64) *room {
	if rm, ok := s.rooms[id]; ok {
		return rm
	}
	if len(s.rooms) >= maxHeld {
		return nil
	}
	if s.rooms == nil {
		s.rooms = map[uint64]*room{}
	}
	rm := &room{ready: make(chan struct{}), taken: make(chan struct{})}
	s.rooms[id] = rm
	return rm
}

// dropLocked closes room id if it is still rm.
func (s *pdState) dropLocked(id uint64, rm *room) {
	if s.rooms[id] == rm {
		delete(s.rooms, id)
	}
}

// enterRoom takes one side of bootstrap room id, opening it when needed: a
// prefill (tokens, fp) fills it and wakes the decode, a decode claims it. It
// refuses when maxHeld rooms are open or that side is taken.
func (s *pdState) enterRoom(id uint64, prefill bool, tokens int, fp string) (*room, *apiError) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rm := s.roomLocked(id)
	switch {
	case rm == nil:
		return nil, &apiError{status: http.StatusServiceUnavailable, msg: fmt.Sprintf("%d bootstrap rooms are open already", maxHeld)}
	case prefill && rm.prefilled:
		return nil, &apiError{status: http.StatusConflict, msg: fmt.Sprintf("bootstrap room %d has a prefill already", id)}
	case !prefill && rm.claimed:
		return nil, &apiError{status: http.StatusConflict, msg: fmt.Sprintf("bootstrap room %d has a decode already", id)}
	}
	if prefill {
		rm.prefilled, rm.tokens, rm.fp = true, tokens, fp
		close(rm.ready)
	} else {
		rm.claimed = true
	}
	return rm, nil
}

// awaitDecode opens bootstrap room id with a computed prefill and waits for the
// decode to take it: ctx's end is an abort, KVHoldTimeout an expired hold.
func (e *Engine) awaitDecode(ctx context.Context, id uint64, tokens int, fp string) *apiError {
	s := &e.web.pd
	rm, aerr := s.enterRoom(id, true, tokens, fp)
	if aerr != nil {
		return aerr
	}
	t := time.NewTimer(e.opts.KVHoldTimeout)
	defer t.Stop()
	select {
	case <-rm.taken:
		e.web.update(func(st *HTTPStats) { st.Pulls++ })
		return nil
	case <-ctx.Done():
		s.mu.Lock()
		s.dropLocked(id, rm)
		s.mu.Unlock()
		return errCanceled()
	case <-t.C:
		s.mu.Lock()
		s.dropLocked(id, rm)
		s.mu.Unlock()
		e.web.update(func(st *HTTPStats) { st.HoldsExpired++ })
		return &apiError{status: http.StatusGatewayTimeout, msg: fmt.Sprintf("no decode took bootstrap room %d in time", id)}
	}
}

// BootstrapHandler is the fake SGLang bootstrap server of a PDRolePrefill
// engine (SGLang serves it on --disaggregation-bootstrap-port, 8998 by default):
// GET BootstrapRoomPath + "<room>" waits, at most KVWaitTimeout, until a prefill
// leg with that bootstrap_room is computed, takes it and answers like a pull.
// The caller mounts it on a server of its own and owns that server's lifetime.
// Other roles answer 404. It is safe for concurrent use.
func (e *Engine) BootstrapHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+BootstrapRoomPath+"{room}", e.handleRoom)
	return mux
}

func (e *Engine) handleRoom(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseUint(r.PathValue("room"), 10, 64)
	switch {
	case e.opts.PDRole != PDRolePrefill:
		writeJSONError(w, http.StatusNotFound, "this engine is not in prefill mode")
		return
	case err != nil:
		writeJSONError(w, http.StatusBadRequest, "the room must be a non-negative integer")
		return
	}
	s := &e.web.pd
	rm, aerr := s.enterRoom(id, false, 0, "")
	if aerr != nil {
		writeJSONError(w, aerr.status, aerr.msg)
		return
	}

	t := time.NewTimer(e.opts.KVWaitTimeout)
	defer t.Stop()
	select {
	case <-rm.ready:
		s.mu.Lock()
		ans := transferJSON{Tokens: rm.tokens, Fingerprint: rm.fp}
		close(rm.taken)
		s.dropLocked(id, rm)
		s.mu.Unlock()
		writeJSON(w, http.StatusOK, ans)
	case <-r.Context().Done():
		e.unclaim(id, rm)
	case <-t.C:
		e.unclaim(id, rm)
		writeJSONError(w, http.StatusGatewayTimeout, fmt.Sprintf("no prefill reached bootstrap room %d in time", id))
	}
}

// unclaim lets another decode wait on room id, and closes it when no prefill
// is in it.
func (e *Engine) unclaim(id uint64, rm *room) {
	s := &e.web.pd
	s.mu.Lock()
	defer s.mu.Unlock()
	rm.claimed = false
	if !rm.prefilled {
		s.dropLocked(id, rm)
	}
}
