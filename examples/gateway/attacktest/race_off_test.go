//go:build linux && !race

package attacktest

const raceBuild = false
