// Package knobs owns gpucr-stream's environment variables: the table of
// the GPUCR_* variables that are not flags (what each one tunes or
// measures), the rule that names each flag's variable (--chunk-size is
// GPUCR_CHUNK_SIZE), and the one accessor that reads them. Code reads an
// environment variable of its own only through a Knob of this table or
// FlagValue; `gpucr-stream env` prints them all.
//
// The test hooks' variables (package testhook, testhooks.go) are in the
// table only in a build with the gpucr_testhooks tag, and the measuring
// build's (bench.go) only with gpucr_bench: never in the shipped binary.
package knobs

import (
	"os"
	"strconv"
	"strings"
)

// Knob is one environment variable that is not a flag.
type Knob struct {
	Name    string
	Meaning string
	// Secret: its value is never printed, only whether it is set.
	Secret bool
	// Library: read by libgpucr-preload inside the program that
	// `gpucr-stream run` starts (it inherits the environment), not by
	// gpucr-stream itself.
	Library bool
}

// Prefix starts the name of every variable of gpucr-stream's.
const Prefix = "GPUCR_"

// The table, in the order `gpucr-stream env` prints it.
var (
	Key = add(Knob{Name: "GPUCR_KEY", Secret: true,
		Meaning: "the encryption key (64 hex digits or base64) where --key-file is not given: checkpoints written are encrypted with it, readers require it"})
	LibCUDA = add(Knob{Name: "GPUCR_LIBCUDA",
		Meaning: "the CUDA driver library to load (default libcuda.so.1 from the loader's path)"})
	PreloadDir = add(Knob{Name: "GPUCR_PRELOAD_DIR",
		Meaning: "where libgpucr-preload's control sockets are (default /run/gpucr-stream); gpucr-stream and the library must agree"})
	LazyCUDA = add(Knob{Name: "GPUCR_LAZY_CUDA",
		Meaning: "1: receive --restore --lazy-pages restores CUDA processes with lazy pages too (an experiment: it does not pay, docs/MIGRATION.md)"})
	CPUProfile = add(Knob{Name: "GPUCR_CPUPROFILE",
		Meaning: "FILE: write a CPU profile of the command to FILE (%c in it: the command's name); not for run"})
	ReadAhead = add(Knob{Name: "GPUCR_READAHEAD",
		Meaning: "N: read an archive this many chunks ahead (within --memory-limit) instead of one per worker (to measure other depths)"})
	NoSplice = add(Knob{Name: "GPUCR_NO_SPLICE",
		Meaning: "1: write restored chunks into CRIU's pipes with write(2), never splice(2) (to measure what splicing saves)"})
	NoSparse = add(Knob{Name: "GPUCR_NO_SPARSE",
		Meaning: "1: serve CRIU every page image as dumped, zero pages included (to measure what sparse pages save)"})
	Fill = add(Knob{Name: "GPUCR_FILL",
		Meaning: "1: a fast-path restore from an archive fills the device memory in a filler beside CRIU's restore, and the process adopts it (an experiment until measured faster on a GPU: docs/PRODUCERS.md, \"The fill\")"})
	PreloadStage = add(Knob{Name: "GPUCR_PRELOAD_STAGE", Library: true,
		Meaning: "0: allocate no copy buffers ahead of a checkpoint (to measure what staging saves)"})
	PreloadBufMiB = add(Knob{Name: "GPUCR_PRELOAD_BUF_MIB", Library: true,
		Meaning: "N: pinned copy buffers of N MiB (default 4)"})
	PreloadZeroBlockKiB = add(Knob{Name: "GPUCR_PRELOAD_ZERO_BLOCK_KIB", Library: true,
		Meaning: "N: the block of device memory found written or zero, in KiB, a power of two from 4 (default 64)"})
	PreloadIdleMS = add(Knob{Name: "GPUCR_PRELOAD_IDLE_MS", Library: true,
		Meaning: "N: how long a control connection that does not own the park may stay silent, in ms (default 60000)"})
	PreloadTrace = add(Knob{Name: "GPUCR_PRELOAD_TRACE", Library: true,
		Meaning: "set: log to stderr every reason the process cannot take the fast path and what it allocates"})
	SwrkVersion = add(Knob{Name: "GPUCR_SWRK_CRIU_VERSION",
		Meaning: "set by checkpoint and migrate --container for the runtime they run: criu's path and its version (JSON); the runtime's `gpucr-stream swrk` answers a VERSION request with it instead of starting that criu"})
)

var table []*Knob

func add(k Knob) *Knob {
	p := &k
	table = append(table, p)
	return p
}

// All is the table, in its order.
func All() []*Knob { return append([]*Knob(nil), table...) }

// Lookup is the variable's value and whether it is set.
func (k *Knob) Lookup() (string, bool) { return os.LookupEnv(k.Name) }

// Value is the variable's value, "" where it is unset.
func (k *Knob) Value() string { v, _ := k.Lookup(); return v }

// On says whether the variable is "1".
func (k *Knob) On() bool { return k.Value() == "1" }

// Int is the variable as a whole number, 0 where it is unset or not one.
func (k *Knob) Int() int {
	n, _ := strconv.Atoi(k.Value())
	return n
}

// FlagVar is the environment variable that sets flag's default:
// GPUCR_ and the flag's name in capitals, dashes as underscores.
func FlagVar(flag string) string {
	return Prefix + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// FlagValue is the value of flag's variable and whether it is set.
func FlagValue(flag string) (string, bool) { return os.LookupEnv(FlagVar(flag)) }
