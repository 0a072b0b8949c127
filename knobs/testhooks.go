//go:build gpucr_testhooks

package knobs

// The test hooks' variables (package testhook), in the table only in a
// build with the gpucr_testhooks tag.
var (
	TestFault = add(Knob{Name: "GPUCR_TEST_FAULT",
		Meaning: "STEP: fail that step on purpose: store, gpu-checkpoint or lazy-pages (package testhook)"})
	TestPause = add(Knob{Name: "GPUCR_TEST_PAUSE",
		Meaning: "STEP:FILE: at that step write FILE and wait to be killed: released, checkpointed, detached or post-dump (package testhook)"})
)
