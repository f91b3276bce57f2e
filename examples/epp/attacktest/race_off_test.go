//go:build !race

package attacktest

const raceBuild = false
