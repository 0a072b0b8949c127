// Package location is the DEST and SRC arguments: Parse reads one (-, a
// path, file://, s3://, tcp://) and the Open functions turn it into what a
// command works on: a pipeline output, a source, a store of checkpoints
// (ls, rm, gc) or a manifest (inspect). The switch over the kind of a
// location is written once, in open.go.
package location

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/gpucr/gpucr-stream/redact"
)

// Kind says what shape a location has.
type Kind int

const (
	// Stdio is the process's standard input or output (or --shard-fds).
	Stdio Kind = iota
	// Archive is a local archive directory: segments plus a manifest.
	Archive
	// StreamFile is a plain file holding one stream (what capture > FILE wrote).
	StreamFile
	// S3 is an object-store prefix.
	S3
	// TCP is a peer.
	TCP
)

// Location is a parsed DEST or SRC argument.
type Location struct {
	Kind Kind
	// Path for Archive and StreamFile; bucket/prefix for S3; host:port for TCP.
	Path string
	Raw  string
}

// Parse understands "-", a path, file:///path, s3://bucket/prefix
// and tcp://host:port. A path naming an existing regular file is a stream
// file; anything else local is an archive directory.
func Parse(s string) (Location, error) {
	switch {
	case s == "" || s == "-":
		return Location{Kind: Stdio, Raw: "-"}, nil
	case strings.HasPrefix(s, "s3://"), strings.HasPrefix(s, "tcp://"):
		u, err := url.Parse(s)
		if err != nil {
			return Location{}, fmt.Errorf("location %s: %w", redact.URL(s), redact.Error(err))
		}
		if u.User != nil {
			// Silently dropped, they would leave the user thinking they
			// were used; S3 credentials come from the environment, a TCP
			// peer proves a token file.
			return Location{}, fmt.Errorf("location %s: credentials do not belong in a location; use AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (s3://) or --token-file (tcp://)", redact.URL(s))
		}
		if u.Host == "" {
			// No credentials got this far: s is shown as given.
			if u.Scheme == "s3" {
				return Location{}, fmt.Errorf("location %s: no bucket (want s3://BUCKET/PREFIX)", s)
			}
			return Location{}, fmt.Errorf("location %s: no host (want tcp://HOST:PORT)", s)
		}
		if u.Scheme == "s3" {
			return Location{Kind: S3, Path: u.Host + u.Path, Raw: s}, nil
		}
		return Location{Kind: TCP, Path: u.Host, Raw: s}, nil
	case strings.HasPrefix(s, "file://"):
		u, err := url.Parse(s)
		if err != nil || u.Path == "" {
			return Location{}, fmt.Errorf("location %s: want file:///absolute/path", redact.URL(s))
		}
		return local(u.Path, s), nil
	case strings.Contains(s, "://"):
		return Location{}, fmt.Errorf("location %s: unknown scheme (want -, a path, file://, s3:// or tcp://)", redact.URL(s))
	}
	return local(s, s), nil
}

func local(p, raw string) Location {
	if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
		return Location{Kind: StreamFile, Path: p, Raw: raw}
	}
	return Location{Kind: Archive, Path: p, Raw: raw}
}

func (l Location) String() string { return redact.URL(l.Raw) }

// Sibling is the checkpoint name beside l in the location that holds l
// (the directory of checkpoint directories, the S3 prefix above l's): a
// --dedup checkpoint's earlier ones. ok is false for other kinds, at a
// root, and for a name that is no checkpoint's (empty, a path, the chunk
// store's).
func (l Location) Sibling(name string) (Location, bool) {
	parent, ok := l.Parent()
	if !ok || name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") || name+"/" == "gpucr-chunks/" {
		return Location{}, false
	}
	switch parent.Kind {
	case Archive:
		p := filepath.Join(parent.Path, name)
		return Location{Kind: Archive, Path: p, Raw: p}, true
	case S3:
		p := parent.Path + "/" + name
		return Location{Kind: S3, Path: p, Raw: "s3://" + p}, true
	}
	return Location{}, false
}

// Parent is the location that holds the checkpoint l (an archive
// directory or an S3 prefix), absolute: ok is false for other kinds and
// at a root.
func (l Location) Parent() (Location, bool) {
	switch l.Kind {
	case Archive:
		abs, err := filepath.Abs(l.Path)
		if err != nil || filepath.Dir(abs) == abs {
			return Location{}, false
		}
		d := filepath.Dir(abs)
		return Location{Kind: Archive, Path: d, Raw: d}, true
	case S3:
		p := strings.TrimRight(l.Path, "/")
		i := strings.LastIndex(p, "/")
		if i <= 0 {
			return Location{}, false
		}
		return Location{Kind: S3, Path: p[:i], Raw: "s3://" + p[:i]}, true
	}
	return Location{}, false
}

// Name is the checkpoint l's name in the location that holds it (Parent).
func (l Location) Name() string {
	switch l.Kind {
	case Archive:
		if abs, err := filepath.Abs(l.Path); err == nil {
			return filepath.Base(abs)
		}
	case S3:
		p := strings.TrimRight(l.Path, "/")
		return p[strings.LastIndex(p, "/")+1:]
	}
	return ""
}
