package swrk

// CRIU's action scripts as RPC notifications. Over RPC, CRIU sends the
// client a criu_resp of type NOTIFY for each action and waits for its
// criu_req answer (cr-service.c, send_criu_rpc_script); on the command
// line it runs --action-script with the action in CRTOOLS_SCRIPT_ACTION
// and the root task's PID in CRTOOLS_INIT_PID, and fails the step when
// the script exits non-zero. The script here hands each action to this
// process through a FIFO pair and exits as the runtime answered.

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// relayScript asks this process to notify the runtime and waits for its
// answer. CRIU runs one script at a time.
const relayScript = `#!/bin/sh
printf '%%s %%s\n' "$CRTOOLS_SCRIPT_ACTION" "${CRTOOLS_INIT_PID:-0}" > "%[1]s/notify.req" || exit 1
IFS= read -r answer < "%[1]s/notify.res" || exit 1
[ "$answer" = ok ] && exit 0
echo "gpucr-stream swrk: $CRTOOLS_SCRIPT_ACTION: $answer" >&2
exit 1
`

// relay owns the script and its FIFOs, in a private directory.
type relay struct {
	dir      string
	req, res *os.File
}

func newRelay() (*relay, error) {
	dir, err := os.MkdirTemp("", "gpucr-swrk-")
	if err != nil {
		return nil, fmt.Errorf("notification relay: %w", err)
	}
	r := &relay{dir: dir}
	for _, n := range []string{"notify.req", "notify.res"} {
		if err := syscall.Mkfifo(filepath.Join(dir, n), 0o600); err != nil {
			r.close()
			return nil, fmt.Errorf("notification relay: %w", err)
		}
	}
	// O_RDWR never blocks on open and keeps each FIFO alive whoever comes
	// first; Go polls FIFOs, so close wakes a blocked read.
	if r.req, err = os.OpenFile(filepath.Join(dir, "notify.req"), os.O_RDWR, 0); err == nil {
		r.res, err = os.OpenFile(filepath.Join(dir, "notify.res"), os.O_RDWR, 0)
	}
	if err == nil {
		err = os.WriteFile(r.script(), []byte(fmt.Sprintf(relayScript, dir)), 0o700)
	}
	if err != nil {
		r.close()
		return nil, fmt.Errorf("notification relay: %w", err)
	}
	return r, nil
}

func (r *relay) script() string { return filepath.Join(r.dir, "notify.sh") }

// close ends serve and removes the directory.
func (r *relay) close() {
	if r.req != nil {
		r.req.Close()
	}
	if r.res != nil {
		r.res.Close()
	}
	os.RemoveAll(r.dir)
}

// serve answers the script's requests with notify's error (nil: "ok")
// until the relay is closed or ctx ends.
func (r *relay) serve(ctx context.Context, notify func(ctx context.Context, action string, pid int) error) {
	stop := context.AfterFunc(ctx, func() { r.req.Close() })
	defer stop()
	rd := bufio.NewReader(r.req)
	for {
		line, err := rd.ReadString('\n')
		if err != nil {
			return
		}
		action, pidText, _ := strings.Cut(strings.TrimSpace(line), " ")
		pid, _ := strconv.Atoi(pidText)
		answer := "ok"
		if err := notify(ctx, action, pid); err != nil {
			answer = strings.ReplaceAll(err.Error(), "\n", " ")
		}
		if _, err := fmt.Fprintln(r.res, answer); err != nil {
			return
		}
	}
}
