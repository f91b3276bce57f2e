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
	for _, v := range []string{"file:" + path, path} {
		key, err := LoadKey(v)
		require.NoError(t, err, v)
		require.Equal(t, strings.Repeat("s", 40), string(key), "%s: the trailing line break is trimmed", v)
	}
	key, err := LoadKey("not-a-path-" + strings.Repeat("v", 32))
	require.NoError(t, err)
	require.Equal(t, "not-a-path-"+strings.Repeat("v", 32), string(key), "anything else is the key itself")

	_, err = LoadKey("file:" + filepath.Join(t.TempDir(), "missing"))
	require.ErrorContains(t, err, "pdhint: read the key file")
	_, err = LoadKey("/nonexistent/key")
	require.ErrorIs(t, err, os.ErrNotExist)
}
