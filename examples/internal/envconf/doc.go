// Package envconf reads the settings of the example binaries (the reference
// EPP, the decode sidecar, the gateway): each setting is an environment
// variable, optionally with older names, and a flag that overrides it, with a
// default, and renders them as the Markdown table their docs carry.
//
// One job: Load defines every Var's flag, parses the arguments and hands each
// Var's value to its Set: the flag when given, else the first of its
// variable and aliases that is set, else its default; a value that is empty
// once trimmed is not set at all. It returns every Set error, each naming the
// variable and where its value came from, so one run reports every bad
// setting.
//
// Concurrency: Load and Table run on the caller's goroutine and start none;
// the Vars' Set functions are called in order, one at a time.
//
// Invariants: Table lists the Vars in the order given, one row each.
package envconf
