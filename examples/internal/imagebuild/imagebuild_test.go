package imagebuild_test

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvselect/kvselect/examples/internal/imagebuild"
)

// root is the repository root: the images' build context.
const root = "../../.."

// binaries are the shipped binaries, each with examples/<name>/Dockerfile.
var binaries = []string{"epp", "gateway", "pdsidecar"}

func recipe(t *testing.T, name string) *imagebuild.Recipe {
	t.Helper()
	r, err := imagebuild.Read(filepath.Join(root, "examples", name, "Dockerfile"))
	require.NoError(t, err)
	return r
}

// Every Dockerfile builds its own package statically (CGO off, -trimpath,
// stripped), from a build image whose Go is the workspace's, into a final
// stage that runs the binary as a non-root user; image references carry no
// registry host (a deployment chooses its own), and the base defaults to
// scratch.
func TestRecipes(t *testing.T) {
	goVersion := goDirective(t)
	hostful := regexp.MustCompile(`^[^/]*[.:][^/]*/|^localhost/`)
	for _, name := range binaries {
		t.Run(name, func(t *testing.T) {
			r := recipe(t, name)
			require.Equal(t, "./examples/"+name, r.Package())
			require.Equal(t, "/out/"+name, r.Output())
			require.Contains(t, r.Env, "CGO_ENABLED=0")
			require.Contains(t, r.GoArgs, "-trimpath")
			require.Contains(t, r.GoArgs, "-ldflags=-s -w")

			require.Equal(t, "scratch", r.Args["BASE_IMAGE"])
			for arg, def := range r.Args {
				require.NotRegexp(t, hostful, def, "ARG %s names a registry host", arg)
			}
			for _, st := range r.Stages {
				require.NotRegexp(t, hostful, st.Image)
			}
			build := r.Stage(imagebuild.BuildStage)
			image, tag, _ := strings.Cut(build.Image, ":")
			require.Equal(t, "golang", image)
			require.True(t, tag == goVersion || strings.HasPrefix(tag, goVersion+"."), "build image %s, go.mod says go %s", build.Image, goVersion)

			final := r.Final()
			require.Equal(t, "65532:65532", final.User, "non-root, distroless's nonroot IDs")
			require.Equal(t, `["/`+name+`"]`, final.Entrypoint)
			require.Contains(t, final.Copies, []string{"--from=build", r.Output(), "/" + name})
		})
	}
}

// The build stage copies every module file of the workspace before its
// `go mod download` (the cached layer), so a module added to go.work is not
// forgotten; then the whole context.
func TestRecipesCopyTheWorkspace(t *testing.T) {
	want := []string{"go.work", "go.work.sum"}
	for _, dir := range workspaceModules(t) {
		want = append(want, filepath.Join(dir, "go.mod"), filepath.Join(dir, "go.sum"))
	}
	for _, name := range binaries {
		build := recipe(t, name).Stage(imagebuild.BuildStage)
		require.Equal(t, []string{"go mod download"}, build.Runs[:1], name)
		var copied []string
		for _, c := range build.Copies {
			if len(c) == 2 && c[0] == "." {
				break // the whole context
			}
			for _, src := range c[:len(c)-1] {
				copied = append(copied, filepath.Clean(src))
			}
		}
		require.ElementsMatch(t, want, copied, name)
		require.Contains(t, build.Copies, []string{".", "."}, name)
	}
}

// Each Dockerfile's go build, run as written but for its output directory,
// builds a binary that starts (--help). CI runs it once: under the race
// detector and -short it is skipped (the three builds share a cache of
// their own flags, about 100 s of compiling on 2 cores when cold).
func TestRecipesBuild(t *testing.T) {
	if raceBuild || testing.Short() {
		t.Skip("the builds run in the plain, long pass")
	}
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(t.Context(), 8*time.Minute)
	defer cancel()
	for _, name := range binaries {
		bin, err := recipe(t, name).Build(ctx, root, out)
		require.NoError(t, err)
		help := exec.CommandContext(ctx, bin, "--help")
		outp, err := help.CombinedOutput()
		require.NoError(t, err, "%s --help: %s", name, outp)
	}
}

// goDirective is go.mod's go version, major.minor.
func goDirective(t *testing.T) string {
	t.Helper()
	f, err := os.Open(filepath.Join(root, "go.mod"))
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "go "); ok {
			parts := strings.SplitN(strings.TrimSpace(v), ".", 3)
			require.GreaterOrEqual(t, len(parts), 2, v)
			return parts[0] + "." + parts[1]
		}
	}
	require.FailNow(t, "go.mod has no go directive")
	return ""
}

// workspaceModules lists go.work's use directories, cleaned.
func workspaceModules(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(root, "go.work"))
	require.NoError(t, err)
	var dirs []string
	inUse := false
	for line := range strings.Lines(string(raw)) {
		line = strings.TrimSpace(line)
		switch {
		case line == "use (":
			inUse = true
		case inUse && line == ")":
			inUse = false
		case inUse && line != "":
			dirs = append(dirs, filepath.Clean(line))
		case strings.HasPrefix(line, "use "):
			dirs = append(dirs, filepath.Clean(strings.TrimPrefix(line, "use ")))
		}
	}
	require.NotEmpty(t, dirs)
	return dirs
}
