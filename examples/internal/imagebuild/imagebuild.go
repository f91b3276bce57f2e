package imagebuild

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// BuildStage is the name the recipes give their build stage (FROM ... AS
// build).
const BuildStage = "build"

// ErrRecipe wraps every problem Read finds in a Dockerfile.
var ErrRecipe = errors.New("imagebuild: unusable Dockerfile")

// Stage is one FROM of a Dockerfile and what follows it.
type Stage struct {
	Name  string // the AS name; "" for none
	Image string // the FROM image, global ARG defaults substituted
	// Copies are the stage's COPY instructions, each its words (flags such
	// as --from=build included), in order.
	Copies [][]string
	// Runs are the stage's RUN commands, continuations joined.
	Runs []string
	// User and Entrypoint are the last USER and ENTRYPOINT (exec form, as
	// written) of the stage.
	User       string
	Entrypoint string
}

// Recipe is a Dockerfile read by Read.
type Recipe struct {
	Path string
	// Args are the global ARGs (before the first FROM) and their defaults.
	Args   map[string]string
	Stages []Stage
	// Env and GoArgs are the build stage's `go build` command: the
	// variables it sets and go's arguments ("build", flags, package).
	Env    []string
	GoArgs []string
}

// Read parses the Dockerfile at path and its build stage's go build command.
func Read(path string) (*Recipe, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrRecipe, err)
	}
	r := &Recipe{Path: path, Args: map[string]string{}}
	for _, line := range logicalLines(raw) {
		instr, rest, _ := strings.Cut(line, " ")
		rest = strings.TrimSpace(rest)
		switch strings.ToUpper(instr) {
		case "ARG":
			if len(r.Stages) == 0 {
				name, def, _ := strings.Cut(rest, "=")
				r.Args[name] = def
			}
		case "FROM":
			words := strings.Fields(rest)
			if len(words) != 1 && (len(words) != 3 || !strings.EqualFold(words[1], "AS")) {
				return nil, fmt.Errorf("%w: %s: FROM %q", ErrRecipe, path, rest)
			}
			st := Stage{Image: r.expand(words[0])}
			if len(words) == 3 {
				st.Name = words[2]
			}
			r.Stages = append(r.Stages, st)
		case "COPY", "RUN", "USER", "ENTRYPOINT", "WORKDIR":
			if len(r.Stages) == 0 {
				return nil, fmt.Errorf("%w: %s: %s before FROM", ErrRecipe, path, instr)
			}
			st := &r.Stages[len(r.Stages)-1]
			switch strings.ToUpper(instr) {
			case "COPY":
				st.Copies = append(st.Copies, strings.Fields(rest))
			case "RUN":
				st.Runs = append(st.Runs, rest)
			case "USER":
				st.User = rest
			case "ENTRYPOINT":
				st.Entrypoint = rest
			}
		default:
			return nil, fmt.Errorf("%w: %s: instruction %s is not one imagebuild reads", ErrRecipe, path, instr)
		}
	}
	build := r.Stage(BuildStage)
	if build == nil {
		return nil, fmt.Errorf("%w: %s: no stage named %q", ErrRecipe, path, BuildStage)
	}
	for _, run := range build.Runs {
		if !strings.Contains(run, "go build") {
			continue
		}
		if r.GoArgs != nil {
			return nil, fmt.Errorf("%w: %s: two go build commands", ErrRecipe, path)
		}
		if r.Env, r.GoArgs, err = goCommand(run); err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrRecipe, path, err)
		}
	}
	if r.GoArgs == nil {
		return nil, fmt.Errorf("%w: %s: the build stage runs no go build", ErrRecipe, path)
	}
	return r, nil
}

// Stage returns the stage named name, nil when there is none.
func (r *Recipe) Stage(name string) *Stage {
	for i := range r.Stages {
		if r.Stages[i].Name == name {
			return &r.Stages[i]
		}
	}
	return nil
}

// Final is the last stage: the image.
func (r *Recipe) Final() *Stage { return &r.Stages[len(r.Stages)-1] }

// Output is the go build command's -o path.
func (r *Recipe) Output() string {
	for i, a := range r.GoArgs {
		if a == "-o" && i+1 < len(r.GoArgs) {
			return r.GoArgs[i+1]
		}
	}
	return ""
}

// Package is the go build command's last argument: the package built.
func (r *Recipe) Package() string { return r.GoArgs[len(r.GoArgs)-1] }

// Build runs the recipe's go build from root (the repository root, Docker's
// build context) with the recipe's environment over the caller's, its -o
// redirected into outDir, and returns the binary's path. The output of go
// build is in the error when it fails.
func (r *Recipe) Build(ctx context.Context, root, outDir string) (string, error) {
	if r.Output() == "" {
		return "", fmt.Errorf("%w: %s: go build has no -o", ErrRecipe, r.Path)
	}
	bin := filepath.Join(outDir, filepath.Base(r.Output()))
	args := append([]string(nil), r.GoArgs...)
	for i := range args {
		if args[i] == "-o" {
			args[i+1] = bin
		}
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), r.Env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("imagebuild: %s: go %s: %w\n%s", r.Path, strings.Join(args, " "), err, out)
	}
	return bin, nil
}

// expand substitutes ${NAME} and $NAME of the global ARGs in s.
func (r *Recipe) expand(s string) string {
	return os.Expand(s, func(name string) string { return r.Args[name] })
}

// logicalLines returns the Dockerfile's instructions: comments and blank
// lines dropped, continuation lines (ending in a backslash) joined.
func logicalLines(raw []byte) []string {
	var out []string
	var cur strings.Builder
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "#") || (line == "" && cur.Len() == 0) {
			continue
		}
		if more, ok := strings.CutSuffix(line, `\`); ok {
			cur.WriteString(more)
			cur.WriteByte(' ')
			continue
		}
		cur.WriteString(line)
		out = append(out, strings.Join(strings.Fields(cur.String()), " "))
		cur.Reset()
	}
	if cur.Len() > 0 {
		out = append(out, strings.TrimSpace(cur.String()))
	}
	return out
}

// goCommand splits a RUN command of the form `VAR=value... go build ...`
// into its variables and go's arguments. Anything a shell would do beyond
// quoting (several commands, pipes, substitutions) is refused.
func goCommand(run string) (env, args []string, err error) {
	if strings.ContainsAny(run, ";|&$`<>") {
		return nil, nil, fmt.Errorf("RUN %q: the go build command must be one plain command", run)
	}
	words, err := shellWords(run)
	if err != nil {
		return nil, nil, err
	}
	i := 0
	for ; i < len(words) && strings.Contains(words[i], "=") && !strings.HasPrefix(words[i], "-"); i++ {
		env = append(env, words[i])
	}
	if i+1 >= len(words) || words[i] != "go" || words[i+1] != "build" {
		return nil, nil, fmt.Errorf("RUN %q: want [VAR=value...] go build ...", run)
	}
	return env, words[i+1:], nil
}

// shellWords splits s as a POSIX shell would split plain words: whitespace
// separates, single and double quotes group (double quotes honour a
// backslash before " and \).
func shellWords(s string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == ' ' || c == '\t':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		case c == '\'':
			j := strings.IndexByte(s[i+1:], '\'')
			if j < 0 {
				return nil, fmt.Errorf("unterminated ' in %q", s)
			}
			w.WriteString(s[i+1 : i+1+j])
			i += j + 1
			inWord = true
		case c == '"':
			i++
			for ; i < len(s) && s[i] != '"'; i++ {
				if s[i] == '\\' && i+1 < len(s) && (s[i+1] == '"' || s[i+1] == '\\') {
					i++
				}
				w.WriteByte(s[i])
			}
			if i >= len(s) {
				return nil, fmt.Errorf("unterminated \" in %q", s)
			}
			inWord = true
		default:
			w.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, w.String())
	}
	return words, nil
}
