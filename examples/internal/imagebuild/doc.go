// Package imagebuild reads the build stage of the shipped binaries'
// Dockerfiles (examples/epp, examples/gateway, examples/pdsidecar) and runs
// it without Docker: the stage's single `go build` command, with its
// environment and flags, from the repository root, its output redirected to
// a directory of the caller's. Its tests keep every Dockerfile true to the
// code (the package path, the workspace's module files, static flags, a
// non-root final stage, no registry host); the Kubernetes end-to-end tests
// run the EPP built this way, so what they prove is the image's binary.
//
// Read accepts the Dockerfile subset these recipes use (ARG, FROM ... AS,
// WORKDIR, COPY, RUN, USER, ENTRYPOINT, comments, line continuations) and
// refuses a build stage whose `go build` is not one plain command, so a
// recipe cannot drift into something Build would not run as Docker does.
//
// Concurrency: Read and Recipe's methods hold no state between calls; Build
// runs one `go build` process and waits for it.
package imagebuild
