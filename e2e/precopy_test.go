package e2e

import (
	"bytes"
	"encoding/json"
	"testing"
)

// migratePrecopyJSON is the part of migrate --json that pre-copy adds.
type migratePrecopyJSON struct {
	migrateJSON
	Precopy struct {
		Method string `json:"method"`
		Why    string `json:"why"`
		Rounds []struct {
			Secs      float64 `json:"seconds"`
			RawBytes  int64   `json:"raw_bytes"`
			SentBytes int64   `json:"sent_bytes"`
		} `json:"rounds"`
		FinalWireBytes int64 `json:"final_wire_bytes"`
		FinalRefBytes  int64 `json:"final_ref_bytes"`
	} `json:"precopy"`
}

// TestMigratePrecopy migrates a running target with pre-copy between two
// network namespaces, real CRIU on both sides: the rounds send its memory
// while it runs, the final dump sends by reference what did not change
// (nearly all of it: the target only counts), the restored target proves
// its memory, counter and child, and the receiver freed its cache.
func TestMigratePrecopy(t *testing.T) {
	e := newMigrateEnv(t)
	tg, before := e.startTarget("target", 96)
	var rout, mout bytes.Buffer
	recv := e.startReceiver(&rout, "--restore", "--criu", e.criu, "--json")
	m := e.migrate(tg, &mout, "--streams", "2", "--json")
	if err := m.wait(e.ctx); err != nil {
		t.Fatalf("migrate: %v; receiver: %v", err, recv.wait(e.ctx))
	}
	if err := recv.wait(e.ctx); err != nil {
		t.Fatalf("receive: %v", err)
	}
	var res migratePrecopyJSON
	if err := json.Unmarshal(mout.Bytes(), &res); err != nil {
		t.Fatalf("migrate --json: %v: %s", err, mout.String())
	}
	var rres struct {
		PID          int   `json:"pid"`
		CachedChunks int   `json:"cached_chunks"`
		CachedBytes  int64 `json:"cached_bytes"`
	}
	if err := json.Unmarshal(rout.Bytes(), &rres); err != nil {
		t.Fatalf("receive --json: %v: %s", err, rout.String())
	}
	if res.RestoredPID != tg.PID() || rres.PID != tg.PID() {
		t.Fatalf("migrate says %+v, receive says %+v, target pid %d", res, rres, tg.PID())
	}
	p := res.Precopy
	if p.Method != "criu dump --leave-running" || p.Why == "" || len(p.Rounds) == 0 {
		t.Fatalf("pre-copy did not run: %s", mout.String())
	}
	if p.Rounds[0].SentBytes < 8<<20 || rres.CachedChunks == 0 || rres.CachedBytes < p.Rounds[0].SentBytes {
		t.Errorf("the first round sent %d bytes, the receiver cached %d chunks, %d bytes", p.Rounds[0].SentBytes, rres.CachedChunks, rres.CachedBytes)
	}
	// Little changed: the final dump sent much less than the first round,
	// and most of the image by reference.
	if p.FinalWireBytes > p.Rounds[0].SentBytes/5 || p.FinalRefBytes < p.Rounds[0].SentBytes/2 {
		t.Errorf("final dump: %d bytes on the wire, %d by reference; the first round sent %d", p.FinalWireBytes, p.FinalRefBytes, p.Rounds[0].SentBytes)
	}
	provenRestore(e.ctx, t, tg, before)
	t.Logf("downtime %.2fs; rounds %+v; final %d bytes on the wire, %d by reference; %s", res.DowntimeSecs, p.Rounds, p.FinalWireBytes, p.FinalRefBytes, p.Why)
}
