package swrk

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/knobs"
)

// criuOnPath puts an executable criu into a new directory first on PATH
// and returns its path (which FindCRIU then finds).
func criuOnPath(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	criu := filepath.Join(dir, "criu")
	if err := os.WriteFile(criu, []byte("#!/bin/sh\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
	return criu
}

// TestVersionAnswer: the VERSION answer comes from the environment only
// where it names the criu a passed-through request would reach, and
// holds a version.
func TestVersionAnswer(t *testing.T) {
	criu := criuOnPath(t)
	v := `{"majorNumber":4,"minorNumber":2,"sublevel":1}`
	for _, c := range []struct {
		name, env string
		set, ok   bool
	}{
		{"unset", "", false, false},
		{"this criu", `{"criu":"` + criu + `","version":` + v + `}`, true, true},
		{"another criu", `{"criu":"/usr/sbin/criu","version":` + v + `}`, true, false},
		{"no major", `{"criu":"` + criu + `","version":{"minorNumber":2}}`, true, false},
		{"not json", `4.2.1`, true, false},
		{"not a version", `{"criu":"` + criu + `","version":{"majorNumber":"four"}}`, true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(knobs.SwrkVersion.Name, c.env)
			if !c.set {
				os.Unsetenv(knobs.SwrkVersion.Name)
			}
			resp := versionAnswer()
			if !c.ok {
				if resp != nil {
					t.Fatalf("answered %v", resp)
				}
				return
			}
			want := &rpc.CriuResp{Type: rpc.CriuReqType_VERSION.Enum(), Success: proto.Bool(true),
				Version: &rpc.CriuVersion{MajorNumber: proto.Int32(4), MinorNumber: proto.Int32(2), Sublevel: proto.Int32(1)}}
			if !proto.Equal(resp, want) {
				t.Fatalf("answered %v, want %v", resp, want)
			}
		})
	}
}

// TestServeVersion: runc's version check (go-criu asks VERSION, then
// closes the session) is answered here, Serve returning without starting
// criu; a second request after it is answered as well.
func TestServeVersion(t *testing.T) {
	criu := criuOnPath(t)
	b, _ := json.Marshal(map[string]any{"criu": criu, "version": map[string]int{"majorNumber": 4, "minorNumber": 2, "sublevel": 1}})
	t.Setenv(knobs.SwrkVersion.Name, string(b))
	r := startSwrk(t, &rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()})
	for i := 0; i < 2; i++ {
		resp := r.read()
		if resp.GetType() != rpc.CriuReqType_VERSION || !resp.GetSuccess() || resp.GetVersion().GetMajorNumber() != 4 || resp.GetVersion().GetSublevel() != 1 {
			t.Fatalf("answer %d: %v", i, resp)
		}
		if i == 0 {
			b, _ := proto.Marshal(&rpc.CriuReq{Type: rpc.CriuReqType_VERSION.Enum()})
			if _, err := r.conn.Write(b); err != nil {
				t.Fatal(err)
			}
		}
	}
	r.conn.Close()
	if err := <-r.served; err != nil {
		t.Fatalf("Serve: %v", err)
	}
}
