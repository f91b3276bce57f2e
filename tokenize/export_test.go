package tokenize

import "time"

// Test hooks into unexported state.

// SetJoinedHook installs a function run after a missing caller has joined or
// started the upstream call for its key. Set it before the first Tokenize.
func (c *Cache) SetJoinedHook(f func()) { c.joined = f }

// FixKey makes k (not 0) every request's key, so all requests collide.
func (c *Cache) FixKey(k uint64) { c.fixedKey = k }

// Wait blocks until the cache has applied every store made so far.
func (c *Cache) Wait() { c.store.Wait() }

// Poison stores, under req's key, an entry for another body, as an xxhash
// collision would.
func (c *Cache) Poison(req Request, tokens []uint32) {
	k := c.key(&req)
	other := append([]byte("x"), req.Body...)
	c.store.Set(k, &entry{model: req.Model, path: req.Path, body: other, res: Result{Tokens: tokens}}, 1)
	c.store.Wait()
}

// KeyProtocol returns the protocol the cache's keys include.
func (c *Cache) KeyProtocol() string { return c.protocol }

// Limits returns the client's effective timeout and size limits.
func (c *Client) Limits() (time.Duration, int64, int64) { return c.timeout, c.maxResp, c.maxReq }

// MaxPromptTokens returns the client's effective prompt token bound.
func (c *Client) MaxPromptTokens() int { return c.maxToks }

var (
	ParseResponse = func(protocol string, data []byte) (Result, error) {
		return parseResponse(protocol, data, DefaultMaxPromptTokens)
	}
	ParseResponseLimit = parseResponse
	ParseTokenIDs      = func(raw []byte) ([]uint32, error) { return parseTokenIDs(raw, DefaultMaxPromptTokens) }
	ParseTokenIDsLimit = parseTokenIDs
	BuildRequest       = func(protocol string, req Request) (path string, body []byte, direct *Result, err error) {
		chat, err := isChat(req.Path)
		if err != nil {
			return "", nil, nil, err
		}
		out, err := buildRequest(protocol, chat, req, DefaultMaxPromptTokens)
		return out.path, out.body, out.direct, err
	}
)
