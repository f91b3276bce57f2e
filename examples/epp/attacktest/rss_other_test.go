//go:build !linux

package attacktest

import "errors"

// rssBytes is only implemented on Linux (/proc); tests that need it skip.
func rssBytes(int) (int64, error) { return 0, errors.New("RSS is read from /proc, Linux only") }
