package tcp

import (
	"bytes"
	"io"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/source"
	"github.com/gpucr/gpucr-stream/streamer"
)

// An encrypted migration: the sender seals every chunk, the receiver opens
// them with the key, and the local copy migrate keeps (a tee sharing the
// session) reads back with the same key.
func TestTCPEncrypted(t *testing.T) {
	key, err := crypt.NewKey(bytes.Repeat([]byte{3}, crypt.KeySize))
	if err != nil {
		t.Fatal(err)
	}
	seal, err := crypt.NewSession(key)
	if err != nil {
		t.Fatal(err)
	}
	l, err := Listen(testCtx(t), "127.0.0.1:0", ListenOptions{Auth: tokenAuth(goodToken), Timeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	src := NewSource(testCtx(t), l, source.StreamSourceOptions{Options: pipeline.Options{MemoryLimit: 8 << 20, Key: key}, SpillDir: t.TempDir()})
	defer src.Close()
	out, err := Dial(testCtx(t), l.Addr().String(), SendOptions{Auth: tokenAuth(goodToken), Streams: 2, Timeout: 3 * time.Second, AutoCommit: true, Format: pipeline.Format{Seal: seal}})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	var local bytes.Buffer
	keep, err := streamer.NewStreamOutputAs([]io.Writer{&local}, out.Format())
	if err != nil {
		t.Fatal(err)
	}
	files := testFiles()
	if err := send(t, streamer.TeeOutput{Primary: out, Copy: keep}, files); err != nil {
		t.Fatal(err)
	}
	checkFiles(t, src, files)
	if bytes.Contains(local.Bytes(), files["core-1.img"][:64]) {
		t.Fatal("the local copy holds plain bytes")
	}
	copySrc := source.NewStreamSource(testCtx(t), []io.Reader{bytes.NewReader(local.Bytes())}, []string{"copy"},
		source.StreamSourceOptions{Options: pipeline.Options{Key: key}})
	defer copySrc.Close()
	checkFiles(t, copySrc, files)
}
