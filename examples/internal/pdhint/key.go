package pdhint

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"
)

// MaxKeyFileBytes bounds a key file: LoadKey reads at most this many bytes and
// refuses a larger file.
const MaxKeyFileBytes = 4096

// ErrKeyFile: LoadKey was given a key file it will not use: one that cannot
// be read, that is not a regular file (a device such as /dev/zero, a FIFO, a
// directory, a socket), or that is larger than MaxKeyFileBytes. The message
// names the path, never the key.
var ErrKeyFile = errors.New("pdhint: unusable key file")

// LoadKey reads a key setting the way the EPP (DYN_EPP_PD_HINT_KEY) and the
// sidecar (DYN_PD_HINT_KEY) both take it: "file:<path>", or an absolute path,
// names a file whose contents are the key, trailing line breaks trimmed;
// anything else is the key itself. A file is the better choice (a Kubernetes
// Secret volume, whose symbolic links are followed): other processes of the
// pod can read the environment. LoadKey does not check the key's length; Sign
// and NewVerifier refuse one shorter than MinKeyLen. It returns an error
// wrapping ErrKeyFile for a file it refuses; it never reads more than
// MaxKeyFileBytes+1 bytes, and never opens anything but a regular file.
func LoadKey(v string) ([]byte, error) {
	path, isFile := strings.CutPrefix(v, "file:")
	if !isFile && !strings.HasPrefix(v, "/") {
		return []byte(v), nil
	}
	if !isFile {
		path = v
	}
	b, err := readKeyFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w %q: %w", ErrKeyFile, path, err)
	}
	return []byte(strings.TrimRight(string(b), "\r\n")), nil
}

// readKeyFile reads a regular file of at most MaxKeyFileBytes.
func readKeyFile(path string) ([]byte, error) {
	// Judge the path before opening it: opening a FIFO blocks until a writer
	// comes, and a device may never end.
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, notRegular(fi.Mode())
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	// Judge what was opened too: the path may name something else by now.
	if fi, err = f.Stat(); err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, notRegular(fi.Mode())
	}
	b, err := io.ReadAll(io.LimitReader(f, MaxKeyFileBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > MaxKeyFileBytes {
		return nil, fmt.Errorf("larger than %d bytes", MaxKeyFileBytes)
	}
	return b, nil
}

// notRegular says what a refused file is.
func notRegular(m fs.FileMode) error {
	what := "not a regular file"
	switch {
	case m.IsDir():
		what = "a directory, not a regular file"
	case m&fs.ModeNamedPipe != 0:
		what = "a FIFO, not a regular file"
	case m&fs.ModeDevice != 0:
		what = "a device, not a regular file"
	case m&fs.ModeSocket != 0:
		what = "a socket, not a regular file"
	}
	return errors.New(what)
}
