package store

import (
	"encoding/json"
	"os/exec"
	"testing"
)

// TestHolderGone: a lock's holder counts as gone only when it is a process
// of this host, boot and PID namespace that does not exist.
func TestHolderGone(t *testing.T) {
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	dead := cmd.Process.Pid // reaped: no such process (until the PID is reused)
	me := here()
	body := func(change func(h *holder)) []byte {
		h := me
		h.Kind, h.PID = "capture", dead
		change(&h)
		b, _ := json.Marshal(h)
		return b
	}
	tests := []struct {
		name string
		body []byte
		gone bool
	}{
		{"exited process", body(func(*holder) {}), true},
		{"this process", body(func(h *holder) { h.PID = me.PID }), false},
		{"another host", body(func(h *holder) { h.Host += "-other" }), false},
		{"another boot", body(func(h *holder) { h.Boot = "0" }), false},
		{"another PID namespace", body(func(h *holder) { h.PIDNS = "pid:[1]" }), false},
		{"an older lock (no boot)", body(func(h *holder) { h.Boot = "" }), false},
		{"not JSON", []byte("{"), false},
	}
	for _, tc := range tests {
		if got := HolderGone(tc.body); got != tc.gone {
			t.Errorf("%s: HolderGone = %v, want %v", tc.name, got, tc.gone)
		}
	}
}

// FuzzHolderGone: a lock object's body is anyone's who can write the
// location: any bytes are read without a panic, and none names a holder
// gone unless it is a process of this host that does not exist.
func FuzzHolderGone(f *testing.F) {
	b, _ := json.Marshal(here())
	f.Add(b)
	f.Add([]byte(`{"pid":-1,"boot":"x","pid_ns":"y"}`))
	f.Add([]byte(`{"pid":1e99}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		var h holder
		if HolderGone(body) && (json.Unmarshal(body, &h) != nil || h.PID <= 0 || h.Host != here().Host) {
			t.Fatalf("HolderGone(%q) with no holder of this host", body)
		}
	})
}
