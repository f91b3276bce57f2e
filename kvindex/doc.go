// Package kvindex knows which worker holds which prefix of tokens in its KV cache.
//
// Engines (vLLM, SGLang, TensorRT-LLM) publish what they store and evict; the
// kvevents subpackage turns those messages into Events, and an Index applies them.
// For a new request the router hashes its tokens with a Hasher and asks
// FindMatches how many leading blocks each worker rank already holds: that overlap
// is the prefix the worker will not have to recompute. Approx answers the same
// question for engines that publish no events, from the router's own past
// decisions and a TTL.
//
// # Hashing
//
// Tokens are grouped into blocks of a fixed size; only complete blocks count. A
// block's local hash is XXH64 over its token ids (4 bytes little-endian each),
// seeded with 1337 mixed with the LoRA adapter name, and for the first block of a
// sequence also with the cache salt, so adapters and tenants never share blocks
// (the chain carries the salt on, which is how vLLM treats it too). Sequence hashes chain the local hashes:
// seq[0] = local[0], seq[i] = XXH64(1337, le64(seq[i-1]) || le64(local[i])).
// seq[i] names the whole prefix up to block i. Hasher documents the exact layout;
// golden vectors in the tests pin it.
//
// The router hashes both sides itself: the tokens of stored blocks that events
// carry, and the tokens of requests. Engine block hashes are opaque identifiers
// kept per worker rank only to find a stored run's parent and to remove blocks
// later; they are never compared across workers, so engines may use any hash
// function, and two models that emit equal engine hashes never collide.
//
// # Structure
//
// The Index is a radix tree whose nodes are blocks keyed by sequence hash. Each
// node holds, per storage tier (device, host, disk), the set of worker ranks that
// have the block, as a sparse bitset over small dense slot numbers, so walking a
// request intersects a few machine words per block however many workers match.
// Most blocks have their parent's holders (a prompt's blocks are stored and
// evicted together), and a node that is its parent's only child and has them
// on every tier carries a mark: the walk then compares its key and nothing
// else, whatever the number of workers.
// Each worker rank has a map from its engine block hashes to nodes, which makes
// removing a block, clearing a worker rank and removing a worker cost only the
// blocks that worker holds, never a scan of the tree.
//
// Memory: a node is 32 bytes and holds no pointer. Nodes live in an arena of
// 128 KiB chunks and name each other (parent, only child) by 32-bit ids, so
// the garbage collector never scans them, however many there are; the few
// nodes with more (a table of children, holder sets wider than a word, lower
// tiers) name an extension, kept in chunks the same way. A worker rank's block map is an
// open-addressing table of 12-byte slots (the hash and the node's id) kept
// between 1/2 and 3/4 full (it grows by half, not by doubling), so 16 to 24
// bytes per engine block. On the benchmarks' shared-prefix fleet
// (docs/BENCHMARKS.md) that is about 44 bytes per (block, worker rank) entry
// at 8M entries and 1,024 worker ranks, 46 at 1M and 128: the nodes of the
// unshared conversation tails take about 25, the block maps 17. The arena
// reuses the ids of detached nodes (a chunk's lowest first, so that a run
// stored at once lands close together), so a worker's steady store-and-evict
// allocates nothing, and it keeps the most nodes the tree ever held: its
// footprint is the index's high-water mark. An index holds at most MaxNodes
// nodes.
//
// FindMatches walks the request's sequence hashes from the root, narrowing the
// candidate set at each block, and stops as soon as no candidate remains (or, on
// request, when one remains). A worker rank's device count is the number of
// consecutive leading blocks it holds on the device tier; lower tiers extend that
// match: Host counts the further blocks held on device or host, Disk the further
// blocks held on any tier.
//
// Events whose parent block is unknown (lost or reordered) are dropped and counted,
// never attached at the root, since that would claim prefixes the worker does not
// hold. Engine block sizes that are whole multiples of the index block size are
// split into index blocks; other sizes are rejected with ErrBlockSize. A removal
// of blocks a worker rank does not hold removes the ones it holds and reports
// ErrUnknownBlock. No worker rank holds more than its limit of engine blocks per
// tier (Options.MaxBlocksPerRank, or SetRankLimit for its worker): a store
// beyond it is refused with ErrRankFull, so a broken or hostile feed cannot grow
// the index without bound; so is a store that could take the index past
// MaxNodes nodes, with ErrIndexFull.
//
// # Concurrency
//
// Index and Approx are safe for concurrent use. Lookups share the tree's read
// lock and run in parallel. Apply takes three locks, in order: the worker-rank
// registry's for reading, the worker rank's own, and the tree's for writing,
// the last only while it changes nodes: it hashes an event's tokens before
// taking any, and probes and updates the worker rank's block map outside the
// tree's lock, so events of different worker ranks (two engines' feeds) apply
// in parallel but for their tree work. Apply and lookups wait for the tree's
// lock by trying it for about 25 microseconds before they block: a tree part
// is shorter than the time a blocked goroutine takes to be woken and run
// again. A lookup sees the index either before
// or after any event, never half of one: it may undercount while a store is
// being applied, and it never overcounts. ClearRank and RemoveWorker, and an
// Apply that adds or empties a worker rank, take the registry's lock for
// writing and so run alone. Hasher is an immutable value. Snapshot copies the
// index under the registry's write lock and the tree's read lock, and orders
// and encodes the copy after releasing them, so a snapshot is a cut between two
// events: an event applied meanwhile waits for the copy (tens of milliseconds
// per million blocks) and lands after the cut, while lookups go on. Nothing in
// this package starts a goroutine.
//
// # Snapshots
//
// A new router replica can start warm from a serving one. WriteSnapshot (or
// Snapshot, then Encode) writes every worker rank's blocks per tier, with their
// engine hashes, prefix chains and repeated stores, the block limits, and the
// last sequence number applied from each event source; ReadSnapshot builds an
// equal index from it, and the joining replica replays each engine's feed from
// the next number (LoadRanks moves a loaded index's ranks into a live one, one
// source at a time). The index does not know the feed's batches: for the numbers
// to match the cut, the caller reads them and calls Snapshot while no batch is
// half applied.
//
// The format (version 1) is a header (magic, version, payload length,
// and their CRC-32C), the payload, and the payload's CRC-32C; it is canonical,
// so equal indexes encode to equal bytes. ReadSnapshot reads another version as
// ErrSnapshotVersion and a truncated or damaged snapshot as ErrSnapshotCorrupt,
// never as a panic. It bounds the payload, worker ranks, nodes, blocks and
// name lengths (ReadOptions; by default 1 GiB, 65536, 16M, 16M and 1 KiB),
// refusing a larger snapshot with ErrSnapshotLimit, grows its buffers only as
// bytes arrive, and returns the index it builds only when it is complete.
//
// # Invariants
//
//   - A node exists only while some worker rank holds it or one of its
//     descendants: a node that loses its last holder and has no children is
//     detached at once, and the next stored block reuses its place, so memory
//     follows the cached blocks' high-water mark under any churn (block maps
//     shrink by half when less than 1/4 full).
//   - A worker rank's engine-hash map points only at nodes where that worker rank
//     is a member on the same tier, and every membership is justified by a mapped
//     block (a block stored twice needs two removes). Within a stored run, under
//     the worker rank's lock, its new hashes map to a pending id until the
//     tree's part is done.
//   - A node's set never claims a worker rank for a block it does not hold, so
//     FindMatches never overcounts.
//   - A node is marked as having its parent's holders only when it is its
//     parent's only child and has the same holders on every tier. Each store
//     or removal of a block recomputes the marks next to the nodes it
//     changes; removing a worker rank keeps the marks as they are (each stays
//     true), so nodes it leaves equal to their parents are walked unmarked
//     until their holders next change.
package kvindex
