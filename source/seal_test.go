package source

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/gpucr/gpucr-stream/codec"
	"github.com/gpucr/gpucr-stream/crypt"
	"github.com/gpucr/gpucr-stream/errdefs"
	"github.com/gpucr/gpucr-stream/manifest"
	"github.com/gpucr/gpucr-stream/pipeline"
	"github.com/gpucr/gpucr-stream/pipeline/pipelinetest"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/streamer"
)

// sealedStream captures the corpus into an encrypted stream of n shards.
func sealedStream(t testing.TB, k *crypt.Key, spec string, files map[string][]byte, n int) ([][]byte, *manifest.Manifest) {
	t.Helper()
	bufs := make([]*bytes.Buffer, n)
	ws := make([]io.Writer, n)
	for i := range bufs {
		bufs[i] = &bytes.Buffer{}
		ws[i] = bufs[i]
	}
	out, err := streamer.NewStreamOutputAs(ws, pipeline.Format{Seal: pipelinetest.Session(t, k)})
	if err != nil {
		t.Fatal(err)
	}
	m := captureFiles(t, context.Background(), out, pipeline.Options{ChunkSize: corpusChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, spec)}, files)
	out2 := make([][]byte, n)
	for i, b := range bufs {
		out2[i] = b.Bytes()
	}
	return out2, m
}

func readStream(ctx context.Context, shards [][]byte, so StreamSourceOptions) *StreamSource {
	rs := make([]io.Reader, len(shards))
	names := make([]string, len(shards))
	for i, b := range shards {
		rs[i], names[i] = bytes.NewReader(b), fmt.Sprintf("shard %d", i)
	}
	return NewStreamSource(ctx, rs, names, so)
}

func sealedArchive(t testing.TB, k *crypt.Key, spec string, files map[string][]byte) (*mem.Store, *manifest.Manifest) {
	t.Helper()
	st := mem.New("sealed")
	out, err := streamer.NewArchiveOutputAs(context.Background(), st, 150<<10, pipeline.Format{Seal: pipelinetest.Session(t, k)})
	if err != nil {
		t.Fatal(err)
	}
	return st, captureFiles(t, context.Background(), out, pipeline.Options{ChunkSize: corpusChunk, Workers: 2, Codec: pipelinetest.MustSpec(t, spec)}, files)
}

// noPlaintext fails when b holds a recognisable piece of the corpus or a
// plain content hash of one of its chunks.
func noPlaintext(t *testing.T, what string, b []byte, files map[string][]byte, m *manifest.Manifest) {
	t.Helper()
	for name, data := range files {
		if len(data) < 64 {
			continue
		}
		for _, off := range []int{0, len(data) / 2, len(data) - 64} {
			piece := data[off : off+64]
			if codec.IsZero(piece) {
				continue
			}
			if bytes.Contains(b, piece) {
				t.Fatalf("%s: holds 64 plain bytes of %s at offset %d", what, name, off)
			}
		}
		h := codec.ContentHash(data[:min(len(data), corpusChunk)])
		if bytes.Contains(b, h[:]) || bytes.Contains(b, []byte(manifest.Hash(h).String())) {
			t.Fatalf("%s: holds the plain BLAKE3 of %s's first chunk", what, name)
		}
	}
}

func TestSealedRoundTrip(t *testing.T) {
	ctx := context.Background()
	files := corpusFiles()
	k := pipelinetest.Key(t, 1)
	for _, spec := range []string{"none", "lz4", "zstd", "shuffle", "auto"} {
		t.Run(spec, func(t *testing.T) {
			for _, n := range []int{1, 3} {
				shards, m := sealedStream(t, k, spec, files, n)
				if m.Encryption == nil || m.Format != manifest.VersionEncrypted || m.Encryption.KeyID != manifest.KeyID(k.ID()) {
					t.Fatalf("manifest encryption %+v format %d", m.Encryption, m.Format)
				}
				for i, b := range shards {
					noPlaintext(t, fmt.Sprintf("shard %d of %d", i, n), b, files, m)
				}
				for _, verify := range []bool{false, true} {
					src := readStream(ctx, shards, StreamSourceOptions{Options: pipeline.Options{Workers: 2, Key: k, VerifyHashes: verify}})
					pipelinetest.CheckSource(t, ctx, fmt.Sprintf("%d shards, verify %v", n, verify), src, files)
					src.Close()
				}
			}
			st, m := sealedArchive(t, k, spec, files)
			for _, name := range st.Names() {
				noPlaintext(t, name, st.Object(name), files, m)
			}
			var zero int
			for _, f := range m.Files {
				for _, c := range f.Chunks {
					if c.Checksum != 0 {
						t.Fatalf("%s: manifest carries the raw CRC-32C %08x", f.Name, c.Checksum)
					}
					if codec.ID(c.Codec) == codec.Zero {
						zero++
						if c.Stored != crypt.Overhead {
							t.Fatalf("%s: sealed zero chunk stores %d bytes, want %d", f.Name, c.Stored, crypt.Overhead)
						}
					}
				}
			}
			if zero == 0 {
				t.Fatal("corpus has no zero chunk")
			}
			a, err := OpenArchive(ctx, st, pipeline.Options{Workers: 2, Key: k, VerifyHashes: true})
			if err != nil {
				t.Fatal(err)
			}
			pipelinetest.CheckSource(t, ctx, "archive", a, files)
			if _, err := VerifyArchive(ctx, a); err != nil {
				t.Fatal(err)
			}
			a.Close()
		})
	}
}

// Every reader refuses a wrong or missing key naming the key it needs, and
// a key given for a plain checkpoint.
func TestSealedKeyErrors(t *testing.T) {
	ctx := context.Background()
	files := corpusFiles()
	right, wrong := pipelinetest.Key(t, 1), pipelinetest.Key(t, 2)
	shards, _ := sealedStream(t, right, "lz4", files, 1)
	st, _ := sealedArchive(t, right, "lz4", files)
	var plain bytes.Buffer
	out, err := streamer.NewStreamOutput([]io.Writer{&plain})
	if err != nil {
		t.Fatal(err)
	}
	captureFiles(t, ctx, out, pipeline.Options{ChunkSize: corpusChunk, Workers: 2}, files)
	plainStore := mem.New("plain")
	aout, err := streamer.NewArchiveOutput(ctx, plainStore, 0)
	if err != nil {
		t.Fatal(err)
	}
	captureFiles(t, ctx, aout, pipeline.Options{ChunkSize: corpusChunk, Workers: 2}, files)

	for _, tc := range []struct {
		what  string
		key   *crypt.Key
		plain bool
		is    error
		want  []string
	}{
		{"wrong key", wrong, false, crypt.ErrWrongKey, []string{"encrypted with key " + right.ID().String(), "key given is " + wrong.ID().String()}},
		{"no key", nil, false, crypt.ErrNoKey, []string{"needs key " + right.ID().String(), "--key-file", "GPUCR_KEY"}},
		{"key for a plain checkpoint", right, true, crypt.ErrNotEncrypted, []string{"refusing an unauthenticated checkpoint"}},
	} {
		t.Run(tc.what, func(t *testing.T) {
			in := shards
			sst := st
			if tc.plain {
				in, sst = [][]byte{plain.Bytes()}, plainStore
			}
			src := readStream(ctx, in, StreamSourceOptions{Options: pipeline.Options{Workers: 2, Key: tc.key}})
			err := src.Wait(ctx)
			src.Close()
			checkIsContains(t, "stream", err, tc.is, tc.want)
			_, err = OpenArchive(ctx, sst, pipeline.Options{Key: tc.key})
			checkIsContains(t, "archive", err, tc.is, tc.want)
			_, err = CheckManifest(ctx, sst, tc.key)
			checkIsContains(t, "manifest", err, tc.is, tc.want)
		})
	}
	// Without a key the metadata stays readable (inspect, ls).
	for _, b := range [][]byte{shards[0]} {
		m, err := ScanStream(bytes.NewReader(b), "stream")
		if err != nil || m.Encryption == nil || m.Encryption.KeyID != manifest.KeyID(right.ID()) || len(m.Files) != len(files) {
			t.Fatalf("ScanStream of an encrypted stream: %+v, %v", m, err)
		}
	}
	if m, err := ReadManifest(ctx, st); err != nil || m.Encryption == nil || len(m.Files) != len(files) {
		t.Fatalf("ReadManifest of an encrypted archive: %v", err)
	}
}

func checkIsContains(t *testing.T, what string, err, is error, want []string) {
	t.Helper()
	if !errors.Is(err, is) {
		t.Fatalf("%s: error %v, want %v", what, err, is)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s: error %q does not contain %q", what, err, w)
		}
	}
}

// rewrite decodes a single-shard stream and writes it again, frame by
// frame, through edit: what an attacker who can write the stream but has
// no key can do. edit returns the frames to write in place of one.
func rewrite(t *testing.T, b []byte, edit func(i int, fr manifest.Frame) []manifest.Frame) []byte {
	t.Helper()
	rd, err := manifest.NewReader(bytes.NewReader(b), "in")
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	w, err := manifest.NewWriter(&out, rd.Header())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		fr, err := rd.Next(nil)
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range edit(i, fr) {
			if f.Type == manifest.FrameEnd {
				// The attacker copies the END tag it cannot make.
				endPos := w.Pos()
				if err := w.Finish(f.Payload); err != nil {
					t.Fatal(err)
				}
				b := out.Bytes()[endPos:]
				h, err := manifest.UnmarshalFrameHeader(b)
				if err != nil {
					t.Fatal(err)
				}
				h.Hash = f.Hash
				h.Marshal(b)
				continue
			}
			if _, err := w.WriteFrame(&f.FrameHeader, f.Payload); err != nil {
				t.Fatal(err)
			}
		}
	}
	return out.Bytes()
}

// frames lists a stream's frames with their payloads.
func frames(t *testing.T, b []byte) (map[uint32]string, []manifest.Frame) {
	t.Helper()
	rd, err := manifest.NewReader(bytes.NewReader(b), "in")
	if err != nil {
		t.Fatal(err)
	}
	names := map[uint32]string{}
	var out []manifest.Frame
	for {
		fr, err := rd.Next(nil)
		if err == io.EOF {
			return names, out
		}
		if err != nil {
			t.Fatal(err)
		}
		if fr.Type == manifest.FrameFile {
			names[fr.FileID] = string(fr.Payload)
		}
		out = append(out, fr)
	}
}

// A stream changed by someone without the key is refused, and nothing of
// it is served: chunks swapped or moved, chunks from another checkpoint
// with the same key, data turned into zeros, ciphertext and tags flipped,
// files renamed, truncated or given a recomputed digest.
func TestSealedStreamTamper(t *testing.T) {
	ctx := context.Background()
	files := corpusFiles()
	k := pipelinetest.Key(t, 1)
	shards, _ := sealedStream(t, k, "auto", files, 1)
	other, _ := sealedStream(t, k, "auto", files, 1)
	b := shards[0]
	names, frs := frames(t, b)
	id := map[string]uint32{}
	for i, n := range names {
		id[n] = i
	}
	// DATA frames by file and offset, in this stream and the other one.
	type key struct {
		name string
		off  uint64
	}
	data := map[key]manifest.Frame{}
	for _, f := range frs {
		if f.Type == manifest.FrameData {
			data[key{names[f.FileID], f.Offset}] = f
		}
	}
	onames, ofrs := frames(t, other[0])
	odata := map[key]manifest.Frame{}
	for _, f := range ofrs {
		if f.Type == manifest.FrameData {
			odata[key{onames[f.FileID], f.Offset}] = f
		}
	}
	pages := id["pages-1.img"]
	isData := func(fr manifest.Frame, name string, off uint64) bool {
		return fr.Type == manifest.FrameData && names[fr.FileID] == name && fr.Offset == off
	}
	flip := func(p []byte, i int) []byte {
		q := append([]byte(nil), p...)
		q[i] ^= 1
		return q
	}
	c0, c1 := data[key{"pages-1.img", 0}], data[key{"pages-1.img", corpusChunk}]
	zero := data[key{"pages-1.img", 2 * corpusChunk}]
	if codec.ID(zero.Codec) != codec.Zero {
		t.Fatalf("pages-1.img chunk 2 has codec %v, want zero", codec.ID(zero.Codec))
	}
	core := data[key{"core-1.img", 0}]
	for _, tc := range []struct {
		what string
		edit func(i int, fr manifest.Frame) []manifest.Frame
	}{
		{"two chunks of a file swapped", func(i int, fr manifest.Frame) []manifest.Frame {
			switch {
			case isData(fr, "pages-1.img", 0):
				m := c1
				m.Offset = 0
				return []manifest.Frame{m}
			case isData(fr, "pages-1.img", corpusChunk):
				m := c0
				m.Offset = corpusChunk
				return []manifest.Frame{m}
			}
			return []manifest.Frame{fr}
		}},
		{"a chunk moved to another file", func(i int, fr manifest.Frame) []manifest.Frame {
			if isData(fr, "core-1.img", 0) {
				m := c0
				m.FileID = fr.FileID
				return []manifest.Frame{m}
			}
			return []manifest.Frame{fr}
		}},
		{"a chunk from another checkpoint with the same key", func(i int, fr manifest.Frame) []manifest.Frame {
			if isData(fr, "pages-1.img", 0) {
				m := odata[key{"pages-1.img", 0}]
				m.FileID = fr.FileID
				return []manifest.Frame{m}
			}
			return []manifest.Frame{fr}
		}},
		{"data turned into zeros", func(i int, fr manifest.Frame) []manifest.Frame {
			if isData(fr, "pages-1.img", 0) {
				z := zero
				z.Offset, z.RawLen = 0, fr.RawLen
				return []manifest.Frame{z}
			}
			return []manifest.Frame{fr}
		}},
		{"zero chunk without its seal", func(i int, fr manifest.Frame) []manifest.Frame {
			if isData(fr, "pages-1.img", 2*corpusChunk) {
				fr.Payload = nil
			}
			return []manifest.Frame{fr}
		}},
		{"ciphertext flipped", func(i int, fr manifest.Frame) []manifest.Frame {
			if isData(fr, "core-1.img", 0) {
				fr.Payload = flip(fr.Payload, 3)
			}
			return []manifest.Frame{fr}
		}},
		{"tag flipped", func(i int, fr manifest.Frame) []manifest.Frame {
			if isData(fr, "core-1.img", 0) {
				fr.Payload = flip(fr.Payload, len(fr.Payload)-1)
			}
			return []manifest.Frame{fr}
		}},
		{"codec changed", func(i int, fr manifest.Frame) []manifest.Frame {
			if isData(fr, "core-1.img", 0) {
				fr.Codec = uint8(codec.None)
			}
			return []manifest.Frame{fr}
		}},
		{"raw length changed", func(i int, fr manifest.Frame) []manifest.Frame {
			if isData(fr, "core-1.img", 0) {
				fr.RawLen--
			}
			return []manifest.Frame{fr}
		}},
		{"file renamed", func(i int, fr manifest.Frame) []manifest.Frame {
			if fr.Type == manifest.FrameFile && fr.FileID == core.FileID {
				fr.Payload = []byte("core-2.img")
			}
			return []manifest.Frame{fr}
		}},
		{"file truncated, digest recomputed", func(i int, fr manifest.Frame) []manifest.Frame {
			last := uint64(4 * corpusChunk)
			switch {
			case isData(fr, "pages-1.img", last):
				return nil
			case fr.Type == manifest.FrameFileEnd && fr.FileID == pages:
				var hashes []byte
				for off := uint64(0); off < last; off += corpusChunk {
					h := data[key{"pages-1.img", off}].Hash
					hashes = append(hashes, h[:]...)
				}
				fr.Offset, fr.RawLen = last, fr.RawLen-1
				fr.Hash = pipeline.FileDigest(hashes, int64(last))
			}
			return []manifest.Frame{fr}
		}},
		{"a file dropped", func(i int, fr manifest.Frame) []manifest.Frame {
			if fr.Type != manifest.FrameEnd && fr.FileID == id["noise.img"] {
				return nil
			}
			return []manifest.Frame{fr}
		}},
		{"two files' ends swapped in order", func(i int, fr manifest.Frame) []manifest.Frame {
			return []manifest.Frame{fr} // replaced below
		}},
		{"salt changed", nil},
	} {
		t.Run(tc.what, func(t *testing.T) {
			var bad []byte
			if tc.edit == nil {
				bad = append([]byte(nil), b...)
				fr, err := manifest.UnmarshalFrameHeader(bad[manifest.HeaderSize:])
				if err != nil || fr.Type != manifest.FrameKey {
					t.Fatalf("no KEY frame after the header: %v", err)
				}
				fr.Hash[0] ^= 1 // the salt
				fr.Marshal(bad[manifest.HeaderSize:])
			} else {
				bad = rewrite(t, b, tc.edit)
			}
			if tc.what == "two files' ends swapped in order" {
				bad = swapFileEnds(t, b)
			}
			so := StreamSourceOptions{Options: pipeline.Options{Workers: 2, Key: k}, ServeEarly: true}
			if strings.Contains(tc.what, "file") {
				// Whole files are authenticated by the END frame: nothing
				// may be served before it (the default).
				so.ServeEarly = false
			}
			copies, err := serveDamaged(ctx, &streamCorpus{files: files}, bad, so)
			if !so.ServeEarly {
				for _, c := range copies {
					if c.err == nil {
						t.Fatalf("%s served from a stream whose END does not authenticate", c.name)
					}
				}
			}
			if err == nil {
				t.Fatal("damaged stream accepted")
			}
			if !errors.Is(err, errdefs.ErrCorrupt) {
				t.Errorf("error %q does not wrap errdefs.ErrCorrupt", err)
			}
			checkNothingWrong(t, tc.what, &streamCorpus{files: files}, copies)
		})
	}
	// The same rewrite with nothing changed is accepted: the checks above
	// fail for what they changed, not for the rewriting.
	same := rewrite(t, b, func(i int, fr manifest.Frame) []manifest.Frame { return []manifest.Frame{fr} })
	src := readStream(ctx, [][]byte{same}, StreamSourceOptions{Options: pipeline.Options{Workers: 2, Key: k}})
	pipelinetest.CheckSource(t, ctx, "rewritten", src, files)
	src.Close()
}

// An archive whose manifest or segments were changed without the key is
// refused: the manifest is authenticated as a whole, chunks one by one.
func TestSealedArchiveTamper(t *testing.T) {
	ctx := context.Background()
	files := corpusFiles()
	k := pipelinetest.Key(t, 1)
	st, m := sealedArchive(t, k, "auto", files)
	doc := st.Object(manifest.ManifestName)
	st2, _ := sealedArchive(t, k, "auto", files)
	reseal := func(edit func(m *manifest.Manifest)) []byte {
		m2, err := manifest.Parse(doc)
		if err != nil {
			t.Fatal(err)
		}
		edit(m2)
		// The attacker has no MAC key: keep the old MAC, fix the CRC.
		mac := m2.MAC
		b, err := m2.MarshalMAC(func([]byte) []byte { t, _ := hexDecode(mac); return t })
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	byName := map[string]int{}
	for i, f := range m.Files {
		byName[f.Name] = i
	}
	for _, tc := range []struct {
		what string
		doc  []byte
	}{
		{"a label added", reseal(func(m *manifest.Manifest) { m.Labels = map[string]string{"x": "y"} })},
		{"two chunks' positions swapped", reseal(func(m *manifest.Manifest) {
			cs := m.Files[byName["pages-1.img"]].Chunks
			cs[0].Pos, cs[1].Pos, cs[0].Segment, cs[1].Segment = cs[1].Pos, cs[0].Pos, cs[1].Segment, cs[0].Segment
		})},
		{"a file dropped", reseal(func(m *manifest.Manifest) { m.Files = m.Files[1:] })},
		{"manifest of another checkpoint", st2.Object(manifest.ManifestName)},
		{"mac flipped", bytes.Replace(doc, []byte(`"mac": "`), []byte(`"mac": "f`), 1)[:len(doc)]},
		{"encryption stripped", func() []byte {
			m2, _ := manifest.Parse(doc)
			m2.Encryption, m2.MAC = nil, ""
			b, _ := m2.Marshal()
			return b
		}()},
	} {
		t.Run(tc.what, func(t *testing.T) {
			bad := mem.New("bad")
			for _, n := range st.Names() {
				bad.Put(n, st.Object(n))
			}
			bad.Put(manifest.ManifestName, tc.doc)
			a, err := OpenArchive(ctx, bad, pipeline.Options{Workers: 2, Key: k})
			if err == nil && tc.what != "manifest of another checkpoint" {
				t.Fatal("tampered manifest opened")
			}
			if err == nil {
				// Authentic, but not of these segments: every chunk fails.
				errs := copyAll(t, ctx, a, files)
				if len(errs) != len(files)-1 {
					t.Fatalf("copy errors %v, want one for every file but the empty one", errs)
				}
				return
			}
			if !errors.Is(err, errdefs.ErrCorrupt) && !errors.Is(err, crypt.ErrNotEncrypted) {
				t.Fatalf("error %q does not wrap errdefs.ErrCorrupt", err)
			}
		})
	}
	// Segment damage: every chunk's payload and tag.
	a, err := OpenArchive(ctx, st, pipeline.Options{Workers: 2, Key: k})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range m.Files {
		for _, c := range f.Chunks {
			if codec.ID(c.Codec) == codec.Zero {
				continue
			}
			obj := st.Object(m.Segments[c.Segment].Name)
			for _, off := range []int64{c.Pos + manifest.FrameSize, c.Pos + manifest.FrameSize + int64(c.Stored) - 1} {
				obj[off] ^= 1
				errs := copyAll(t, ctx, a, files)
				obj[off] ^= 1
				if !errors.Is(errs[f.Name], crypt.ErrAuth) {
					t.Fatalf("%s at %d: %v, want an authentication failure", f.Name, off, errs[f.Name])
				}
			}
		}
	}
	// A segment of another checkpoint with the same key, in place of one.
	a2, err := OpenArchive(ctx, st2, pipeline.Options{Key: k})
	if err != nil {
		t.Fatal(err)
	}
	seg := m.Segments[0].Name
	saved := st.Object(seg)
	st.Put(seg, st2.Object(seg))
	errs := copyAll(t, ctx, a, files)
	st.Put(seg, saved)
	if len(errs) == 0 {
		t.Fatal("a segment of another checkpoint was accepted")
	}
	a2.Close()
	a.Close()
}

func hexDecode(s string) ([]byte, error) { return hex.DecodeString(s) }

// FuzzSealedStream feeds damaged encrypted streams to a reader with the
// right key: it must never panic, and whatever it serves must be what was
// captured. The key is new each run, so that streams sealed by earlier
// runs, which the fuzz cache keeps, are not authentic.
func FuzzSealedStream(f *testing.F) {
	kb := make([]byte, crypt.KeySize)
	if _, err := rand.Read(kb); err != nil {
		f.Fatal(err)
	}
	k, err := crypt.NewKey(kb)
	if err != nil {
		f.Fatal(err)
	}
	files := map[string][]byte{
		"a.img": pipelinetest.SmallData(3000, 1),
		"z.img": make([]byte, 9000),
		"r.img": pipelinetest.SmallData(5000, 2),
		// zeros between data: with the pages last, late data and zero
		// chunks ahead of its FILE-END
		"pages-1.img": append(append(pipelinetest.SmallData(5000, 3), make([]byte, 8192)...), pipelinetest.SmallData(4000, 4)...),
	}
	for _, late := range []bool{false, true} {
		var buf bytes.Buffer
		out, err := streamer.NewStreamOutputAs([]io.Writer{&buf}, pipeline.Format{Seal: pipelinetest.Session(f, k), LateData: late})
		if err != nil {
			f.Fatal(err)
		}
		captureFiles(f, context.Background(), out, pipeline.Options{ChunkSize: 4096, Workers: 2, Codec: pipelinetest.MustSpec(f, "auto"), LateData: late}, files)
		f.Add(buf.Bytes())
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		stop := time.AfterFunc(10*time.Second, func() { panic("hang\n" + pipelinetest.GoroutineDump()) })
		defer stop.Stop()
		ctx := context.Background()
		src := readStream(ctx, [][]byte{b}, StreamSourceOptions{Options: pipeline.Options{Workers: 2, Key: k, MemoryLimit: 1 << 20}, ServeEarly: true})
		defer src.Close()
		for name, want := range files {
			var got bytes.Buffer
			if _, err := src.Copy(ctx, name, &got); err == nil && !bytes.Equal(got.Bytes(), want) {
				t.Fatalf("%s served with wrong bytes", name)
			}
		}
		_ = src.Wait(ctx)
	})
}

// swapFileEnds exchanges the first two FILE-END frames of a stream, the
// order that decides which copy of a name written twice wins.
func swapFileEnds(t *testing.T, b []byte) []byte {
	var ends []int
	var saved []manifest.Frame
	_, frs := frames(t, b)
	for i, f := range frs {
		if f.Type == manifest.FrameFileEnd && len(ends) < 2 {
			ends = append(ends, i)
			saved = append(saved, f)
		}
	}
	if len(ends) < 2 {
		t.Fatal("fewer than two FILE-END frames")
	}
	return rewrite(t, b, func(i int, fr manifest.Frame) []manifest.Frame {
		switch i {
		case ends[0]:
			return []manifest.Frame{saved[1]}
		case ends[1]:
			return []manifest.Frame{saved[0]}
		}
		return []manifest.Frame{fr}
	})
}
