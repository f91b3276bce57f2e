//go:build linux && race

package attacktest

// raceBuild: the tests run with -race, so the gateway is built with it too.
const raceBuild = true
