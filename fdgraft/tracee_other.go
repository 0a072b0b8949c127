//go:build !amd64

package fdgraft

import (
	"context"
	"errors"
)

// supported: the injection is written for amd64 only; elsewhere Stop
// refuses with ErrUnsupported.
const supported = false

func readsSocket(int) bool { return false }

type tracee struct {
	tid  int
	late func() error
}

func (t *tracee) runToPipe(context.Context) (int, error) { return 0, errors.ErrUnsupported }
func (t *tracee) replace(int, int) error                 { return errors.ErrUnsupported }
func (t *tracee) detach() error                          { return detach(t.tid, nil) }
