package checkpoint

import (
	"fmt"
	"slices"
	"strings"

	"github.com/gpucr/gpucr-stream/proc"
)

// criuGhostLimit is CRIU's default --ghost-limit: a deleted file larger
// than this, still open or mapped, fails the dump ("Can't dump ghost file
// ... increase limit").
const criuGhostLimit = 1 << 20

// dumpGhostLimit returns the criu arguments of a dump of tree with
// --ghost-limit raised to the largest deleted file the tree still holds,
// where that is over CRIU's default and the caller set no limit. NCCL
// keeps a 32 MiB shared memory segment it unlinked at once
// (/dev/shm/nccl-*) in every rank: without this an NCCL job's dump fails.
// The file's bytes go into the checkpoint, as CRIU stores every ghost
// file.
func dumpGhostLimit(args []string, tree []int, log func(string)) []string {
	if slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "--ghost-limit") }) {
		return args
	}
	size, path := proc.LargestDeletedFile(tree)
	if size <= criuGhostLimit {
		return args
	}
	limit := (size + 1<<20 - 1) &^ (1<<20 - 1)
	log(fmt.Sprintf("criu --ghost-limit %dM: the tree holds %s (%d bytes), unlinked; its bytes go into the checkpoint", limit>>20, path, size))
	return append(slices.Clip(args), "--ghost-limit", fmt.Sprintf("%dM", limit>>20))
}
