package gpuckpt

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// TestUndoStack: the steps run in order until one fails; then the undos
// of every step begun, the failed one's included, run the last first,
// every one even after one failed; a second unwind does nothing. The
// fast path's undos' errors are told apart, and steps time themselves.
func TestUndoStack(t *testing.T) {
	for _, tc := range []struct {
		name      string
		failDo    string // the step that fails
		failUndo  string // the undo that fails
		calls     string
		err, fast bool
	}{
		{"all done", "", "", "do a, do b, do c, do d", false, false},
		{"first fails", "a", "", "do a, undo a", false, false},
		{"third fails", "c", "", "do a, do b, do c, undo c, undo a", false, false},
		{"last fails, an undo too", "d", "c", "do a, do b, do c, do d, undo c, undo a", true, false},
		{"a fast undo fails", "d", "a", "do a, do b, do c, do d, undo c, undo a", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var calls []string
			var took time.Duration
			mk := func(name string, undo, fast bool) step {
				s := step{name: name, took: &took, fast: fast, do: func(context.Context) error {
					calls = append(calls, "do "+name)
					time.Sleep(time.Millisecond)
					if name == tc.failDo {
						return errors.New("do " + name)
					}
					return nil
				}}
				if undo {
					s.undo = func(context.Context) error {
						calls = append(calls, "undo "+name)
						if name == tc.failUndo {
							return errors.New("undo " + name)
						}
						return nil
					}
				}
				return s
			}
			var u undoStack
			err := u.run(context.Background(), []step{mk("a", true, true), mk("b", false, false), mk("c", true, false), mk("d", false, false)})
			if (err != nil) != (tc.failDo != "") {
				t.Fatalf("run: %v", err)
			}
			if took < time.Duration(len(calls))*time.Millisecond {
				t.Fatalf("the steps took %v in all, less than they slept", took)
			}
			if err != nil {
				res := u.unwind(context.Background())
				if (res.err != nil) != tc.err || (res.fast != nil) != tc.fast {
					t.Fatalf("unwind: %v, fast %v", res.err, res.fast)
				}
				if u2 := u.unwind(context.Background()); u2.err != nil || !u.empty() {
					t.Fatalf("second unwind: %v", u2.err)
				}
			}
			if got := strings.Join(calls, ", "); got != tc.calls {
				t.Fatalf("calls %q\nwant  %q", got, tc.calls)
			}
		})
	}
}
