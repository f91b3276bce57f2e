//go:build !race

package imagebuild_test

const raceBuild = false
