// Package logtest holds what tests use to read what a component logged: a
// buffer a logger writes to from its own goroutines while the test reads it.
// Standard library only; tests of every module use it.
//
// Concurrency: a Buffer is safe for concurrent writes and reads.
package logtest
