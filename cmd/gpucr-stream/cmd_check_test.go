package main

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpucr/gpucr-stream/catalog"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
)

// TestCheckCommand: check of a whole location exits 0 and says so, in
// lines and in JSON; with a segment gone, it exits 3 naming the
// checkpoint, and the JSON says the same.
func TestCheckCommand(t *testing.T) {
	root := t.TempDir()
	st := dir.New(root)
	writeArchive(t, store.Sub(st, "job1"), "node1", 100_000)
	writeArchive(t, store.Sub(st, "job2"), "node2", 100_000)
	out, errOut, code := runCmd(t, "check", "--read-data", root)
	if code != exitOK || !strings.Contains(out, "2 checkpoint(s)") || !strings.Contains(out, "read-data: 2 checkpoint(s) decoded whole") ||
		!strings.Contains(out, "no damage found") {
		t.Fatalf("check of a whole location: exit %d\n%s\nstderr: %s", code, out, errOut)
	}

	m, err := source.ReadManifest(context.Background(), store.Sub(st, "job2"))
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Delete(context.Background(), filepath.Join("job2", m.Segments[0].Name)); err != nil {
		t.Fatal(err)
	}
	out, errOut, code = runCmd(t, "check", root)
	if code != exitCorrupt || !strings.Contains(out, "damaged checkpoint "+root+"/job2: ") || strings.Contains(out, "job1") ||
		!strings.Contains(errOut, "1 damaged checkpoint(s)") {
		t.Fatalf("check with a segment gone: exit %d\n%s\nstderr: %s", code, out, errOut)
	}
	out, _, code = runCmd(t, "check", "--json", root)
	var rep catalog.CheckReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil || code != exitCorrupt || rep.OK || len(rep.Damaged) != 1 || rep.Damaged[0].Name != root+"/job2" {
		t.Fatalf("check --json: exit %d, %v\n%s", code, err, out)
	}
}
