package pdhint

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestLoadKey(t *testing.T) {
	path := filepath.Join(t.TempDir(), "key")
	require.NoError(t, os.WriteFile(path, []byte(strings.Repeat("s", 40)+"\r\n"), 0o600))
	link := filepath.Join(t.TempDir(), "link") // a Kubernetes Secret volume's file is a symbolic link
	require.NoError(t, os.Symlink(path, link))
	for _, v := range []string{"file:" + path, path, link} {
		key, err := LoadKey(v)
		require.NoError(t, err, v)
		require.Equal(t, strings.Repeat("s", 40), string(key), "%s: the trailing line break is trimmed", v)
	}
	key, err := LoadKey("not-a-path-" + strings.Repeat("v", 32))
	require.NoError(t, err)
	require.Equal(t, "not-a-path-"+strings.Repeat("v", 32), string(key), "anything else is the key itself")

	_, err = LoadKey("file:" + filepath.Join(t.TempDir(), "missing"))
	require.ErrorIs(t, err, ErrKeyFile)
	_, err = LoadKey("/nonexistent/key")
	require.ErrorIs(t, err, ErrKeyFile)
	require.ErrorIs(t, err, os.ErrNotExist)
}

// A key file that is not a regular file of at most MaxKeyFileBytes is refused
// by name, at once: /dev/zero would never end, a FIFO would block the open.
func TestLoadKeyRefusesEndlessAndOddFiles(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big")
	require.NoError(t, os.WriteFile(big, []byte(strings.Repeat("k", MaxKeyFileBytes+1)), 0o600))
	exact := filepath.Join(dir, "exact")
	require.NoError(t, os.WriteFile(exact, []byte(strings.Repeat("k", MaxKeyFileBytes)), 0o600))
	refused := map[string]string{
		"/dev/zero":      "a device",
		"file:/dev/zero": "a device",
		"/dev/urandom":   "a device",
		dir:              "a directory",
		big:              "larger than 4096 bytes",
	}
	if fifo := filepath.Join(dir, "fifo"); mkfifo(t, fifo) {
		refused[fifo] = "a FIFO"
	}
	for v, why := range refused {
		if _, err := os.Stat(strings.TrimPrefix(v, "file:")); err != nil {
			continue // no such device here
		}
		_, err := LoadKey(v)
		require.ErrorIs(t, err, ErrKeyFile, v)
		require.ErrorContains(t, err, why, v)
	}
	key, err := LoadKey(exact)
	require.NoError(t, err)
	require.Len(t, key, MaxKeyFileBytes)
}
