package proc

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Exists says whether pid is present in /proc (a zombie still is).
func Exists(pid int) bool {
	_, err := os.Stat(filepath.Join(Root, strconv.Itoa(pid)))
	return err == nil
}

// WaitGone waits until every process of pids is dead: with reaped, gone
// from /proc (a zombie still holds its PID, and a restore into this PID
// space needs the PID free); without, dead or a zombie. It gives up after
// timeout or when ctx ends.
func WaitGone(ctx context.Context, pids []int, reaped bool, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var left []string
		for _, p := range pids {
			b, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(p), "stat"))
			if err != nil {
				continue
			}
			if !reaped && isDead(string(b)) {
				continue
			}
			left = append(left, strconv.Itoa(p))
		}
		if len(left) == 0 {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			what := "alive"
			if reaped {
				what = "present (not reaped by their parent yet)"
			}
			return fmt.Errorf("process(es) %s still %s after %v", strings.Join(left, ","), what, timeout)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// Dead are those of pids whose processes are dead but still present (not
// reaped by their parent yet).
func Dead(pids []int) []int {
	var dead []int
	for _, p := range pids {
		if b, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(p), "stat")); err == nil && isDead(string(b)) {
			dead = append(dead, p)
		}
	}
	return dead
}

// isDead reads the state field of /proc/PID/stat: zombie or dead.
func isDead(stat string) bool {
	st := stateOf(stat)
	return st == 'Z' || st == 'X'
}

// stateOf is the state field of a /proc/PID/stat line (0 if there is
// none). The command name before it may hold spaces and parentheses.
func stateOf(stat string) byte {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 || i+2 >= len(stat) {
		return 0
	}
	return stat[i+2]
}

// State is pid's state as /proc/PID/stat gives it: 'R' running, 'S' or
// 'D' sleeping, 'T' stopped, 't' stopped by a tracer, 'Z' a zombie; 0
// when pid is gone.
func State(pid int) byte {
	b, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0
	}
	return stateOf(string(b))
}

// StartTime is when pid started, in clock ticks after boot (field 22 of
// /proc/PID/stat: what runc records of a container's init to know it
// again), and its state (see State); 0, 0 when pid is gone.
func StartTime(pid int) (uint64, byte) {
	b, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, 0
	}
	stat := string(b)
	// Fields from the state on, after the command's closing parenthesis
	// (the command may hold spaces and parentheses of its own).
	f := strings.Fields(stat[strings.LastIndexByte(stat, ')')+1:])
	if len(f) < 20 {
		return 0, 0
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return 0, 0
	}
	return start, stateOf(stat)
}

// Space names this PID namespace on this boot: two processes that print
// the same string see the same PIDs.
func Space() string {
	boot, _ := os.ReadFile(filepath.Join(Root, "sys/kernel/random/boot_id"))
	ns, _ := os.Readlink(filepath.Join(Root, "self/ns/pid"))
	return strings.TrimSpace(string(boot)) + "/" + ns
}

// AvailableMemory is MemAvailable from /proc/meminfo, in bytes; 0 when it
// cannot be read.
func AvailableMemory() int64 {
	b, err := os.ReadFile(filepath.Join(Root, "meminfo"))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "MemAvailable:" {
			if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				return kb << 10
			}
		}
	}
	return 0
}

// Holder describes what holds pid (a process, or a thread of one), for a
// message: "process 12 \"sleep 100\" (S)", "thread 13 of process 12
// \"python train.py\" (R)", "process 12 \"sleep\" (a zombie its parent 1
// \"init\" has not reaped)". The command lines are quoted, so that control
// characters of a process's own choosing reach no terminal raw. "" when
// pid is free.
func Holder(pid int) string {
	b, err := os.ReadFile(filepath.Join(Root, strconv.Itoa(pid), "status"))
	if err != nil {
		return ""
	}
	tgid, ppid := pid, 0
	for _, l := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(l, ":")
		switch k {
		case "Tgid":
			tgid, _ = strconv.Atoi(strings.TrimSpace(v))
		case "PPid":
			ppid, _ = strconv.Atoi(strings.TrimSpace(v))
		}
	}
	who := fmt.Sprintf("process %d %s", tgid, commandOf(tgid))
	if tgid != pid {
		who = fmt.Sprintf("thread %d of %s", pid, who)
	}
	switch st := State(tgid); st {
	case 'Z', 'X':
		return fmt.Sprintf("%s (a zombie its parent %d %s has not reaped)", who, ppid, commandOf(ppid))
	case 0:
		return who
	default:
		return fmt.Sprintf("%s (%c)", who, st)
	}
}

// commandOf is pid's command line, quoted; its name where it has none (a
// zombie, a kernel thread).
func commandOf(pid int) string {
	if args, err := Cmdline(pid); err == nil && strings.Join(args, "") != "" {
		return strconv.Quote(strings.Join(args, " "))
	}
	b, _ := os.ReadFile(filepath.Join(Root, strconv.Itoa(pid), "comm"))
	return strconv.Quote(strings.TrimSpace(string(b)))
}
