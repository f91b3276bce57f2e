// Command gateway is a plain-HTTP OpenAI gateway that embeds kvselect: every
// chat or completions request is tokenized with the engines' own tokenizer,
// booked by a roles.PairBooker over the selection services, and proxied by
// selection/httproute, which settles the booking as the answer streams.
// Workers come from a static file (the reference EPP's format, watched for
// changes); KV events keep the index true, or approximate mode routes on the
// gateway's own decisions.
//
//	go run ./examples/gateway --workers-file workers.json --tokenizer-url http://10.0.0.5:8000
//
// With --topology=aggregated (the default) every worker serves whole
// requests: one selection service books one worker per request. With
// --topology=disaggregated the workers file's role label (--role-label,
// values prefill and decode) splits the pool into a prefill service, fed by
// the prefill engines' KV events, and a decode service; each request is
// booked on a prefill worker and a decode worker at once and sent to the
// decode worker, whose endpoint is its decode sidecar (examples/pdsidecar),
// with the prefill worker's host:port in x-prefiller-host-port (unsigned:
// the sidecars must not require signed hints). The sidecar runs the prefill
// leg there; the first byte of the answer frees the prefill booking, its end
// the decode one. A worker without the label, or with another value, is left
// out and logged; in the aggregated topology a worker labelled prefill or
// decode is served as an aggregated worker, with a WARN that names the flag.
//
// It serves POST /v1/chat/completions, POST /v1/completions and GET /health
// (200 once the workers file is applied and a request can be booked: a
// schedulable worker, of each role when disaggregated) on --addr, and GET
// /metrics (Prometheus: the selection services', by role, the KV-event
// feeds', the tokenizer cache's and pool's and the Router's series, the
// reference EPP's names) on --metrics-addr, a listener of its own as the
// EPP's. The tokenizers are the workers file's workers (every vLLM and
// SGLang engine serves render/tokenize; discovery.Tokenizers), or
// --tokenizer-url's URLs, comma-separated: one tokenize.Pool over them,
// failing over from one to the next; when none answers, requests are routed on load alone (--tokenizer-no-degrade=true
// refuses them instead). Every flag also reads an environment variable, the
// reference EPP's where it has the setting; --help lists them.
//
// Concurrency: run's goroutines (the two HTTP servers, the workers-file
// watcher, the shutdown waiter) are started by serve and waited for before
// it returns; the selection services' goroutines and the pair booker's plan
// sweeper are started by newGateway and stopped by close. The workers file's
// snapshots are applied one at a time, on the watcher's goroutine.
//
// Invariants: every request booked is settled exactly once (the Router's
// invariant), so once none is in flight no booking or plan is left; a
// request is only ever sent to a worker of the destination role (aggregated,
// or decode), never to a prefill worker.
package main
