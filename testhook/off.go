//go:build !gpucr_testhooks

package testhook

import "context"

// Enabled says whether this build has the hooks: not this one.
const Enabled = false

// Fault injects nothing in this build.
func Fault(string) error { return nil }

// Pause pauses nowhere in this build.
func Pause(context.Context, string) error { return nil }

// HoldWhilePausing holds nothing in this build.
func HoldWhilePausing() {}
