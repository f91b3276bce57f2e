package envconf

import (
	"errors"
	"flag"
	"fmt"
	"strings"
)

// Var is one setting.
type Var struct {
	// Env is the environment variable; Aliases are older names, read in
	// order when Env is unset.
	Env     string
	Aliases []string
	// Flag is the flag's name, without dashes.
	Flag string
	// Default is the value when neither the flag nor a variable is set;
	// "" sets nothing.
	Default string
	// Required says when the setting is required ("" never), for Table;
	// the binary checks it.
	Required string
	// Help says what the setting means.
	Help string
	// Set receives the value, trimmed; its error is the setting's problem.
	Set func(v string) error
}

// Load defines vars' flags on fs, parses args, and sets each Var (see the
// package documentation). It returns fs.Parse's error as it is (flag.ErrHelp
// among them) and otherwise every Set error joined, each wrapped as
// "ENV (from SOURCE): error", SOURCE being the variable, alias, --flag or
// default the value came from; nil when every value was accepted.
func Load(fs *flag.FlagSet, args []string, getenv func(string) string, vars []Var) error {
	fromFlag := make(map[string]*string, len(vars))
	for _, v := range vars {
		help := v.Help + " (env " + v.Env
		if v.Default != "" {
			help += ", default " + v.Default
		}
		fromFlag[v.Flag] = fs.String(v.Flag, "", help+")")
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	for _, v := range vars {
		val, src := v.Default, "default"
		for _, name := range append([]string{v.Env}, v.Aliases...) {
			if e := strings.TrimSpace(getenv(name)); e != "" {
				val, src = e, name
				break
			}
		}
		if given[v.Flag] {
			val, src = *fromFlag[v.Flag], "--"+v.Flag
		}
		if val = strings.TrimSpace(val); val == "" {
			continue
		}
		if err := v.Set(val); err != nil {
			errs = append(errs, fmt.Errorf("%s (from %s): %w", v.Env, src, err))
		}
	}
	return errors.Join(errs...)
}

// Table renders vars as a Markdown table: variable (and aliases), flag,
// default (and when required), meaning.
func Table(vars []Var) string {
	var b strings.Builder
	b.WriteString("| Variable | Flag | Default | Meaning |\n|---|---|---|---|\n")
	for _, v := range vars {
		def := v.Default
		if def == "" {
			def = "(unset)"
		}
		if v.Required != "" {
			def += ", required " + v.Required
		}
		name := "`" + v.Env + "`"
		for _, a := range v.Aliases {
			name += " (alias `" + a + "`)"
		}
		fmt.Fprintf(&b, "| %s | `--%s` | %s | %s |\n", name, v.Flag, def, v.Help)
	}
	return b.String()
}
