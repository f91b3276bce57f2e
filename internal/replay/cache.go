package replay

// lruCache is one simulated engine's prefix cache: capacity blocks, least
// recently used evicted first. Every store touches the request's blocks from the
// last to the first, so a block is always more recent than any cached
// descendant: the least recently used block is always a leaf, and eviction takes
// the tails of sequences before their prefixes (as vLLM's free-block queue does).
// The cached blocks of any sequence therefore always form a leading run.
//
// Not safe for concurrent use.
type lruCache struct {
	capacity int
	nodes    map[uint64]*lruNode
	root     lruNode // sentinel: root.next is the most recent, root.prev the least
	free     *lruNode
}

type lruNode struct {
	key        uint64
	prev, next *lruNode
	pinned     bool
}

func newLRUCache(capacity int) *lruCache {
	c := &lruCache{capacity: capacity, nodes: make(map[uint64]*lruNode, capacity)}
	c.root.prev, c.root.next = &c.root, &c.root
	return c
}

// Len returns the number of cached blocks.
func (c *lruCache) Len() int { return len(c.nodes) }

// Contains reports whether key is cached (without touching it).
func (c *lruCache) Contains(key uint64) bool { _, ok := c.nodes[key]; return ok }

// Prefix returns how many leading keys are cached (without touching them).
func (c *lruCache) Prefix(keys []uint64) int {
	for i, k := range keys {
		if _, ok := c.nodes[k]; !ok {
			return i
		}
	}
	return len(keys)
}

// Touch makes the leading n keys (which must be cached) the most recent, the
// first key last so that it ends up most recent of all.
func (c *lruCache) Touch(keys []uint64) {
	for i := len(keys) - 1; i >= 0; i-- {
		if n, ok := c.nodes[keys[i]]; ok {
			c.unlink(n)
			c.pushFront(n)
		}
	}
}

// Store caches keys (a request's whole prompt, at most capacity of its leading
// blocks are kept). It returns how many leading keys were already cached (the
// new run starts after keys[cached-1]), how many new blocks were added (keys
// [cached, cached+added)), and appends the evicted keys to evicted, least
// recent first.
func (c *lruCache) Store(keys []uint64, evicted []uint64) (cached, added int, _ []uint64) {
	if len(keys) > c.capacity {
		keys = keys[:c.capacity]
	}
	cached = c.Prefix(keys)
	for _, k := range keys[:cached] {
		c.nodes[k].pinned = true
	}
	need := len(c.nodes) + len(keys) - cached - c.capacity
	for n := c.root.prev; need > 0 && n != &c.root; {
		prev := n.prev
		if !n.pinned {
			evicted = append(evicted, n.key)
			c.unlink(n)
			delete(c.nodes, n.key)
			n.next, c.free = c.free, n
			need--
		}
		n = prev
	}
	for i := len(keys) - 1; i >= 0; i-- {
		if i < cached {
			n := c.nodes[keys[i]]
			n.pinned = false
			c.unlink(n)
			c.pushFront(n)
			continue
		}
		n := c.free
		if n != nil {
			c.free = n.next
			*n = lruNode{}
		} else {
			n = new(lruNode)
		}
		n.key = keys[i]
		c.nodes[n.key] = n
		c.pushFront(n)
	}
	return cached, len(keys) - cached, evicted
}

// Keys returns the cached keys, most recent first (tests).
func (c *lruCache) Keys() []uint64 {
	out := make([]uint64, 0, len(c.nodes))
	for n := c.root.next; n != &c.root; n = n.next {
		out = append(out, n.key)
	}
	return out
}

func (c *lruCache) unlink(n *lruNode) {
	n.prev.next, n.next.prev = n.next, n.prev
	n.prev, n.next = nil, nil
}

func (c *lruCache) pushFront(n *lruNode) {
	n.prev, n.next = &c.root, c.root.next
	c.root.next.prev = n
	c.root.next = n
}

// Reserve takes n blocks of the cache's capacity for data that is not
// cached prefix (a running request's generated tokens), or gives them back
// when n is negative, and appends what it had to evict, least recent first.
// The capacity never goes below zero.
func (c *lruCache) Reserve(n int, evicted []uint64) []uint64 {
	c.capacity = max(0, c.capacity-n)
	for len(c.nodes) > c.capacity {
		old := c.root.prev
		evicted = append(evicted, old.key)
		c.unlink(old)
		delete(c.nodes, old.key)
		old.next, c.free = c.free, old
	}
	return evicted
}
