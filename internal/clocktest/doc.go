// Package clocktest provides the hand-moved clock the tests of several packages
// inject instead of the wall clock, so no test sleeps to let time pass.
//
// A Clock is safe for concurrent use; it never moves by itself.
package clocktest
