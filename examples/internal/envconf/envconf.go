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
	// Overrides are another contract's variables for the same setting (the
	// names Dynamo's binaries read, say), read before Env and Aliases: the
	// first one set wins over Env. Each may hold the value in a form of its
	// own, converted before Set.
	Overrides []Override
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

// Override is a variable that gives a Var's setting in its own form: a port
// where the Var takes a listen address, say.
type Override struct {
	Env string
	// Form says, for Table, what the variable holds and what it becomes
	// ("a port, served on 0.0.0.0"); "" when it holds the Var's own form.
	Form string
	// Convert turns the variable's value (trimmed) into the Var's form; nil
	// passes it unchanged. Its error is reported like a Set error.
	Convert func(v string) (string, error)
}

// source is one variable a Var can be read from, in precedence order.
type source struct {
	env     string
	convert func(string) (string, error)
}

// sources lists v's variables in the order Load reads them: its overrides,
// Env, its aliases.
func (v Var) sources() []source {
	out := make([]source, 0, len(v.Overrides)+1+len(v.Aliases))
	for _, o := range v.Overrides {
		out = append(out, source{env: o.Env, convert: o.Convert})
	}
	out = append(out, source{env: v.Env})
	for _, a := range v.Aliases {
		out = append(out, source{env: a})
	}
	return out
}

// read returns the value src gives (converted), whether it is set, and the
// conversion's error.
func (src source) read(getenv func(string) string) (string, bool, error) {
	raw := strings.TrimSpace(getenv(src.env))
	if raw == "" {
		return "", false, nil
	}
	if src.convert == nil {
		return raw, true, nil
	}
	val, err := src.convert(raw)
	return strings.TrimSpace(val), true, err
}

// Load defines vars' flags on fs, parses args, and sets each Var (see the
// package documentation). It returns fs.Parse's error as it is (flag.ErrHelp
// among them) and otherwise every Set or Convert error joined, each wrapped
// as "ENV (from SOURCE): error", SOURCE being the variable, override, alias,
// --flag or default the value came from; nil when every value was accepted.
func Load(fs *flag.FlagSet, args []string, getenv func(string) string, vars []Var) error {
	fromFlag := make(map[string]*string, len(vars))
	for _, v := range vars {
		// Without backquotes: flag's usage would take the first backquoted
		// word of the help (a value such as `dynamo`) for the argument's
		// name, as if it were the default.
		help := strings.ReplaceAll(v.Help, "`", "") + " (env "
		for _, o := range v.Overrides {
			help += o.Env + ", else "
		}
		help += v.Env
		if v.Default != "" {
			help += ", default " + v.Default
		}
		fromFlag[v.Flag] = fs.String(v.Flag, "", help+")")
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	given := flagsGiven(fs)
	var errs []error
	for _, v := range vars {
		val, src := v.Default, "default"
		if given[v.Flag] {
			val, src = *fromFlag[v.Flag], "--"+v.Flag
		} else {
			for _, s := range v.sources() {
				got, set, err := s.read(getenv)
				if !set {
					continue
				}
				if err != nil {
					errs = append(errs, fmt.Errorf("%s (from %s): %w", v.Env, s.env, err))
					val = ""
				} else {
					val = got
				}
				src = s.env
				break
			}
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

// flagsGiven is the set of flags given on the command line fs parsed.
func flagsGiven(fs *flag.FlagSet) map[string]bool {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	return given
}

// Conflict is a setting that two of its variables give different values:
// Load used Used and ignored Ignored. Values are left out (a setting may be a
// key).
type Conflict struct {
	Env     string // the setting's variable (Var.Env)
	Used    string // the variable whose value Load used
	Ignored string // a variable also set, to another value
}

// Conflicts lists, for each Var whose flag was not given on fs (parsed by
// Load), the variables set besides the one Load used whose value differs
// from it, compared in the setting's form (after Convert; a value that does
// not convert differs). The caller logs them: a deployment that sets both a
// Dynamo name and kvselect's with different values should hear which won.
func Conflicts(fs *flag.FlagSet, getenv func(string) string, vars []Var) []Conflict {
	given := flagsGiven(fs)
	var out []Conflict
	for _, v := range vars {
		if given[v.Flag] {
			continue
		}
		used, usedVal := "", ""
		for _, s := range v.sources() {
			val, set, err := s.read(getenv)
			switch {
			case !set:
			case used == "":
				used, usedVal = s.env, val
				if err != nil {
					usedVal = "\x00" // matches nothing
				}
			case err != nil || val != usedVal:
				out = append(out, Conflict{Env: v.Env, Used: used, Ignored: s.env})
			}
		}
	}
	return out
}

// Table renders vars as a Markdown table: variable (its overrides first, then
// its aliases), flag, default (and when required), meaning.
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
		name := ""
		for _, o := range v.Overrides {
			name += "`" + o.Env + "`"
			if o.Form != "" {
				name += " (" + o.Form + ")"
			}
			name += ", else "
		}
		name += "`" + v.Env + "`"
		for _, a := range v.Aliases {
			name += " (alias `" + a + "`)"
		}
		fmt.Fprintf(&b, "| %s | `--%s` | %s | %s |\n", name, v.Flag, def, v.Help)
	}
	return b.String()
}
