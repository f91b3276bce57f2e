package envconf

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func newFlags() *flag.FlagSet {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs
}

// A flag wins over the variable, the variable over its alias, the alias over
// the default; blank values are unset; every bad value is reported with its
// source.
func TestLoad(t *testing.T) {
	got := map[string]string{}
	set := func(name string) func(string) error {
		return func(v string) error {
			if v == "bad" {
				return errors.New("refused")
			}
			got[name] = v
			return nil
		}
	}
	vars := []Var{
		{Env: "A", Flag: "a", Default: "da", Set: set("a")},
		{Env: "B", Aliases: []string{"OLD_B"}, Flag: "b", Default: "db", Set: set("b")},
		{Env: "C", Aliases: []string{"OLD_C"}, Flag: "c", Default: "dc", Set: set("c")},
		{Env: "D", Flag: "d", Set: set("d")},
		{Env: "E", Flag: "e", Default: "de", Set: set("e")},
	}
	env := map[string]string{"A": "env-a", "OLD_B": " alias-b ", "C": "env-c", "OLD_C": "alias-c", "D": "   ", "E": "bad"}
	err := Load(newFlags(), []string{"--a", "flag-a"}, func(k string) string { return env[k] }, vars)
	require.Equal(t, map[string]string{"a": "flag-a", "b": "alias-b", "c": "env-c"}, got, "D blank: unset, no default")
	require.EqualError(t, err, "E (from E): refused")

	got = map[string]string{}
	err = Load(newFlags(), []string{"--e", "bad", "--d", "bad"}, func(string) string { return "" }, vars)
	require.ErrorContains(t, err, "D (from --d): refused")
	require.ErrorContains(t, err, "E (from --e): refused")
	require.Equal(t, map[string]string{"a": "da", "b": "db", "c": "dc"}, got)

	require.ErrorIs(t, Load(newFlags(), []string{"-h"}, func(string) string { return "" }, vars), flag.ErrHelp)
}

func ExampleTable() {
	var port int
	vars := []Var{
		{Env: "APP_PORT", Aliases: []string{"PORT"}, Flag: "port", Default: "8080", Help: "listen port",
			Set: func(v string) (err error) { port, err = strconv.Atoi(v); return err }},
		{Env: "APP_TOKEN", Flag: "token", Required: "always", Help: "API token", Set: func(string) error { return nil }},
	}
	if err := Load(flag.NewFlagSet("app", flag.ContinueOnError), nil, func(k string) string { return map[string]string{"PORT": "9000"}[k] }, vars); err != nil {
		fmt.Println(err)
	}
	fmt.Println(port)
	fmt.Print(Table(vars))
	// Output:
	// 9000
	// | Variable | Flag | Default | Meaning |
	// |---|---|---|---|
	// | `APP_PORT` (alias `PORT`) | `--port` | 8080 | listen port |
	// | `APP_TOKEN` | `--token` | (unset), required always | API token |
}

// An override wins over the variable and its aliases, converted first; a
// value it cannot convert is reported with its name and sets nothing; a flag
// still wins over all.
func TestLoadOverrides(t *testing.T) {
	var addr string
	port := func(v string) (string, error) {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 65535 {
			return "", errors.New("not a port")
		}
		return "0.0.0.0:" + v, nil
	}
	vars := []Var{{Env: "ADDR", Aliases: []string{"OLD_ADDR"}, Flag: "addr", Default: "0.0.0.0:80",
		Overrides: []Override{{Env: "PORT", Form: "a port", Convert: port}},
		Set:       func(v string) error { addr = v; return nil }}}
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
		want string
		err  string
	}{
		{"default", nil, nil, "0.0.0.0:80", ""},
		{"variable", map[string]string{"ADDR": "127.0.0.1:81"}, nil, "127.0.0.1:81", ""},
		{"override converted", map[string]string{"PORT": " 82 "}, nil, "0.0.0.0:82", ""},
		{"override wins", map[string]string{"PORT": "83", "ADDR": "127.0.0.1:81", "OLD_ADDR": "x"}, nil, "0.0.0.0:83", ""},
		{"flag wins", map[string]string{"PORT": "83"}, []string{"--addr", "127.0.0.1:84"}, "127.0.0.1:84", ""},
		{"bad override", map[string]string{"PORT": "http", "ADDR": "127.0.0.1:81"}, nil, "", "ADDR (from PORT): not a port"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr = ""
			err := Load(newFlags(), tc.args, func(k string) string { return tc.env[k] }, vars)
			if tc.err != "" {
				require.EqualError(t, err, tc.err)
			} else {
				require.NoError(t, err)
			}
			require.Equal(t, tc.want, addr)
		})
	}
}

// Conflicts names the variables set besides the one used, to another value
// in the setting's form, and says nothing when the values agree or a flag
// decided.
func TestConflicts(t *testing.T) {
	port := func(v string) (string, error) { return "0.0.0.0:" + v, nil }
	noop := func(string) error { return nil }
	vars := []Var{
		{Env: "ADDR", Aliases: []string{"OLD_ADDR"}, Flag: "addr", Overrides: []Override{{Env: "PORT", Convert: port}}, Set: noop},
		{Env: "TIMEOUT_MS", Flag: "timeout-ms", Overrides: []Override{{Env: "DYN_TIMEOUT_MS"}}, Set: noop},
		{Env: "KEY", Flag: "key", Set: noop},
	}
	conflicts := func(env map[string]string, args ...string) []Conflict {
		fs := newFlags()
		require.NoError(t, Load(fs, args, func(k string) string { return env[k] }, vars))
		return Conflicts(fs, func(k string) string { return env[k] }, vars)
	}
	require.Empty(t, conflicts(map[string]string{"PORT": "80", "ADDR": "0.0.0.0:80", "TIMEOUT_MS": "5", "DYN_TIMEOUT_MS": " 5"}),
		"the same value in both forms")
	require.Equal(t, []Conflict{
		{Env: "ADDR", Used: "PORT", Ignored: "ADDR"},
		{Env: "ADDR", Used: "PORT", Ignored: "OLD_ADDR"},
		{Env: "TIMEOUT_MS", Used: "DYN_TIMEOUT_MS", Ignored: "TIMEOUT_MS"},
	}, conflicts(map[string]string{"PORT": "80", "ADDR": "127.0.0.1:80", "OLD_ADDR": "0.0.0.0:81", "TIMEOUT_MS": "5", "DYN_TIMEOUT_MS": "6", "KEY": "k"}))
	require.Empty(t, conflicts(map[string]string{"PORT": "80", "ADDR": "127.0.0.1:80"}, "--addr", "127.0.0.1:82"), "the flag decided")
}

func ExampleConflicts() {
	var addr string
	vars := []Var{{Env: "APP_ADDR", Flag: "addr", Default: "0.0.0.0:8080", Help: "listen address",
		Overrides: []Override{{Env: "PORT", Form: "a port, on 0.0.0.0", Convert: func(v string) (string, error) { return "0.0.0.0:" + v, nil }}},
		Set:       func(v string) error { addr = v; return nil }}}
	env := map[string]string{"PORT": "9000", "APP_ADDR": "127.0.0.1:9000"}
	fs := flag.NewFlagSet("app", flag.ContinueOnError)
	if err := Load(fs, nil, func(k string) string { return env[k] }, vars); err != nil {
		fmt.Println(err)
	}
	fmt.Println(addr)
	for _, c := range Conflicts(fs, func(k string) string { return env[k] }, vars) {
		fmt.Printf("%s: %s used, %s ignored\n", c.Env, c.Used, c.Ignored)
	}
	fmt.Print(Table(vars))
	// Output:
	// 0.0.0.0:9000
	// APP_ADDR: PORT used, APP_ADDR ignored
	// | Variable | Flag | Default | Meaning |
	// |---|---|---|---|
	// | `PORT` (a port, on 0.0.0.0), else `APP_ADDR` | `--addr` | 0.0.0.0:8080 | listen address |
}

// --help names a flag's argument "string", never a value of its help text:
// flag's usage would take a backquoted value (`dynamo`) for the argument's
// name, as if it were the default.
func TestUsageNamesNoValue(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var out strings.Builder
	fs.SetOutput(&out)
	vars := []Var{{Env: "COST", Flag: "cost", Default: "auto", Help: "`dynamo` (in blocks) or `auto`", Set: func(string) error { return nil }}}
	require.NoError(t, Load(fs, nil, func(string) string { return "" }, vars))
	fs.PrintDefaults()
	require.Contains(t, out.String(), "-cost string")
	require.NotContains(t, out.String(), "-cost dynamo")
	require.Contains(t, out.String(), "dynamo (in blocks) or auto (env COST, default auto)")
}
