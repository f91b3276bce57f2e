// Package envconf reads the settings of the example binaries (the reference
// EPP, the decode sidecar, the gateway): each setting is an environment
// variable, optionally with older names and with another contract's names
// for it, and a flag that overrides it, with a default, and renders them as
// the Markdown table their docs carry.
//
// One job: Load defines every Var's flag, parses the arguments and hands each
// Var's value to its Set: the flag when given, else the first of its
// overrides, variable and aliases that is set (an override's value converted
// into the setting's form first), else its default; a value that is empty
// once trimmed is not set at all. It returns every Set error, each naming the
// variable and where its value came from, so one run reports every bad
// setting. Conflicts then names the settings two variables gave different
// values, for the binary to warn about.
//
// Overrides exist for Dynamo's names: the decode sidecar reads Dynamo's
// DYN_SIDECAR_PORT (a port) before its own DYN_PD_LISTEN_ADDR (an address),
// so Dynamo's deployments configure it unchanged and Dynamo's name wins when
// both are set.
//
// Concurrency: Load, Conflicts and Table run on the caller's goroutine and
// start none; the Vars' Set functions are called in order, one at a time.
//
// Invariants: Table lists the Vars in the order given, one row each; Load and
// Conflicts agree on which variable a setting was read from.
package envconf
