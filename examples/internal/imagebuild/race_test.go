//go:build race

package imagebuild_test

// raceBuild: the test binary runs under the race detector (CI's second pass
// over the examples); the first pass already built the images' binaries.
const raceBuild = true
