package vram

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// A kept file lends its bytes in the pieces asked for, from any offset
// (the populate rounds down to the page), ends with io.EOF, and a
// cancelled store ends its next lend with the cause.
func TestKeptMapLends(t *testing.T) {
	data := bytes.Repeat([]byte("0123456789abcdef"), 3000) // 48000 bytes: not whole pages
	p := filepath.Join(t.TempDir(), "vram-1-00.bin")
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{512, 4096, 5000, 1 << 20} {
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		m := mapKept(context.Background(), f)
		if m == nil {
			t.Fatal("mapKept: nil for a file of 48000 bytes")
		}
		var got []byte
		for {
			b, err := m.Lend(n)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil || len(b) == 0 || len(b) > n {
				t.Fatalf("Lend(%d) at %d = %d bytes, %v", n, len(got), len(b), err)
			}
			got = append(got, b...)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("lent in pieces of %d: %d bytes differ from the file's %d", n, len(got), len(data))
		}
		m.unmap()
		f.Close()
	}

	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithCancelCause(context.Background())
	m := mapKept(ctx, f)
	defer m.unmap()
	stop := errors.New("undone")
	cancel(stop)
	if _, err := m.Lend(4096); !errors.Is(err, stop) {
		t.Fatalf("Lend after the store was cancelled = %v, want %v", err, stop)
	}

	empty := filepath.Join(t.TempDir(), "empty")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	e, err := os.Open(empty)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if mapKept(context.Background(), e) != nil {
		t.Fatal("an empty file mapped: it is read")
	}
}
