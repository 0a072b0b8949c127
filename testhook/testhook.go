// Package testhook holds the faults and pauses that the end-to-end tests
// inject into gpucr-stream through GPUCR_TEST_FAULT and GPUCR_TEST_PAUSE.
// They exist only in a build with the gpucr_testhooks tag (make
// build-testhooks, the e2e harness's HooksBinary): in the shipped binary
// every function here does nothing, and neither variable is in it.
package testhook

// Tag is the build tag that turns the hooks on.
const Tag = "gpucr_testhooks"
