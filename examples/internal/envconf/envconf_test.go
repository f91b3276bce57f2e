package envconf

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
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
