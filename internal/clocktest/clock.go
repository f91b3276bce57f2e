package clocktest

import (
	"sync"
	"time"
)

// Clock is a clock the test moves by hand. It satisfies the Clock interfaces of
// selection and reservation (a Now method).
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// New returns a clock reading start.
func New(start time.Time) *Clock { return &Clock{now: start} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward by d and returns the new time.
func (c *Clock) Advance(d time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	return c.now
}
