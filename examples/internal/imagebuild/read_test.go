package imagebuild_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/internal/imagebuild"
)

// Read takes the instructions, ARG defaults, continuations and quoting the
// recipes use, and refuses what Build could not run as Docker would.
func TestRead(t *testing.T) {
	write := func(s string) string {
		p := filepath.Join(t.TempDir(), "Dockerfile")
		require.NoError(t, os.WriteFile(p, []byte(s), 0o600))
		return p
	}
	r, err := imagebuild.Read(write(`# a comment
ARG GO_IMAGE=golang:1.26
FROM ${GO_IMAGE} AS build
RUN go mod download
RUN CGO_ENABLED=0 GOARCH=amd64 \
    go build -trimpath '-tags=a b' -ldflags="-s -w -X \"main.v=1\"" \
    -o /out/x ./cmd/x
FROM scratch
COPY --from=build /out/x /x
USER 65532:65532
ENTRYPOINT ["/x"]
`))
	require.NoError(t, err)
	require.Equal(t, "golang:1.26", r.Stage("build").Image)
	require.Equal(t, []string{"CGO_ENABLED=0", "GOARCH=amd64"}, r.Env)
	require.Equal(t, []string{"build", "-trimpath", "-tags=a b", `-ldflags=-s -w -X "main.v=1"`, "-o", "/out/x", "./cmd/x"}, r.GoArgs)
	require.Equal(t, "/out/x", r.Output())
	require.Equal(t, "./cmd/x", r.Package())
	require.Equal(t, "scratch", r.Final().Image)
	require.Equal(t, "65532:65532", r.Final().User)

	for name, bad := range map[string]string{
		"no build stage":      "FROM golang:1.26\nRUN go build -o /x .\n",
		"no go build":         "FROM golang:1.26 AS build\nRUN go vet ./...\n",
		"two commands":        "FROM golang:1.26 AS build\nRUN go generate ./... && go build -o /x .\n",
		"a substitution":      "FROM golang:1.26 AS build\nRUN go build -ldflags=\"-X main.v=$(git describe)\" -o /x .\n",
		"unterminated quote":  "FROM golang:1.26 AS build\nRUN go build -ldflags=\"-s -o /x .\n",
		"unknown instruction": "FROM golang:1.26 AS build\nHEALTHCHECK NONE\nRUN go build -o /x .\n",
		"odd FROM":            "FROM --platform=linux/amd64 golang:1.26 AS build\nRUN go build -o /x .\n",
	} {
		_, err := imagebuild.Read(write(bad))
		require.ErrorIs(t, err, imagebuild.ErrRecipe, name)
	}
}
