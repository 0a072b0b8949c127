package store

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"

	"github.com/gpucr/gpucr-stream/errdefs"
)

// missingParallel is how many objects Missing looks up at once.
const missingParallel = 16

// Missing checks that st holds every object of want at its size (a size
// below 0: any): the check a commit makes of what its manifest names, at
// that moment. Where every name starts with listPrefix (not ""), one
// listing of it answers; else each object is looked up, missingParallel at
// once. It returns, sorted, what is missing or of another size, described.
func Missing(ctx context.Context, st Store, want []ObjectInfo, listPrefix string) ([]string, error) {
	var mu sync.Mutex
	var out []string
	check := func(w ObjectInfo, got ObjectInfo, found bool) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case !found:
			out = append(out, w.Name+" is gone")
		case w.Size >= 0 && got.Size != w.Size:
			out = append(out, fmt.Sprintf("%s holds %d bytes, not %d", w.Name, got.Size, w.Size))
		}
	}
	if listPrefix != "" {
		objs, err := st.List(ctx, listPrefix)
		if err != nil {
			return nil, err
		}
		have := make(map[string]ObjectInfo, len(objs))
		for _, o := range objs {
			have[o.Name] = o
		}
		for _, w := range want {
			if !strings.HasPrefix(w.Name, listPrefix) {
				return nil, fmt.Errorf("check %s: %s is not under %s", st, w.Name, listPrefix)
			}
			o, ok := have[w.Name]
			check(w, o, ok)
		}
	} else {
		var wg sync.WaitGroup
		var first error
		sem := make(chan struct{}, missingParallel)
		for _, w := range want {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				o, err := st.Stat(ctx, w.Name)
				if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
				check(w, o, err == nil)
			})
		}
		wg.Wait()
		if first != nil {
			return nil, first
		}
	}
	sort.Strings(out)
	return out, nil
}
