//go:build race

package attacktest

// raceBuild: the tests run with -race, so the EPP binary is built with it too.
const raceBuild = true
