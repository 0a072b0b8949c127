package s3

import (
	"errors"
	"fmt"
	"strings"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/encrypt"

	"github.com/gpucr/gpucr-stream/crypt"
)

// SSEMode selects server-side encryption: the server encrypts what it
// stores. It protects against whoever gets the server's disks, not against
// whoever gets the credentials (the server decrypts for them) nor against
// the server itself; client-side encryption (package crypt) protects
// against all three. The two can be combined.
type SSEMode int

const (
	// SSENone sends no encryption headers: the bucket's default applies.
	SSENone SSEMode = iota
	// SSES3 is SSE-S3: keys the server manages (x-amz-server-side-encryption: AES256).
	SSES3
	// SSEKMS is SSE-KMS: a key of the server's KMS, by id (aws:kms).
	SSEKMS
	// SSEC is SSE-C: a 256-bit key the client sends with every request,
	// which the server uses and forgets. Servers accept it over TLS only.
	SSEC
)

// SSE configures server-side encryption of every object written and, for
// SSE-C, the key every read must present.
type SSE struct {
	Mode SSEMode
	// KMSKeyID names the KMS key for SSEKMS; empty: the server's default.
	KMSKeyID string
	// CustomerKey is the 32-byte SSE-C key. Never logged or stored.
	CustomerKey []byte
}

// ParseSSE reads the --s3-sse value: "" or "none", "s3", "kms",
// "kms:KEY-ID", "c" (the SSE-C key comes from elsewhere, never the flag).
func ParseSSE(s string) (SSE, error) {
	mode, arg, _ := strings.Cut(strings.TrimSpace(s), ":")
	switch strings.ToLower(mode) {
	case "", "none":
		return SSE{}, nil
	case "s3", "aes256", "sse-s3":
		return SSE{Mode: SSES3}, nil
	case "kms", "aws:kms", "sse-kms":
		return SSE{Mode: SSEKMS, KMSKeyID: arg}, nil
	case "c", "sse-c":
		return SSE{Mode: SSEC}, nil
	}
	return SSE{}, fmt.Errorf("server-side encryption %q: want none, s3, kms[:KEY-ID] or c", s)
}

// LoadSSE is ParseSSE of spec with, for SSE-C, the key read from keyFile
// (crypt.ReadKeyFile: 32 bytes, hex or base64, mode 0600). The key file
// goes with SSE-C and with nothing else.
func LoadSSE(spec, keyFile string) (SSE, error) {
	sse, err := ParseSSE(spec)
	if err != nil {
		return SSE{}, err
	}
	if (sse.Mode == SSEC) != (keyFile != "") {
		return SSE{}, errors.New("SSE-C (c) and its key file go together")
	}
	if sse.Mode == SSEC {
		if sse.CustomerKey, err = crypt.ReadKeyFile(keyFile); err != nil {
			return SSE{}, fmt.Errorf("SSE-C %w", err)
		}
	}
	return sse, nil
}

func (m SSEMode) String() string {
	switch m {
	case SSES3:
		return "SSE-S3"
	case SSEKMS:
		return "SSE-KMS"
	case SSEC:
		return "SSE-C"
	}
	return "none"
}

// serverSide builds minio-go's encryption for cfg (nil for SSENone).
func (cfg SSE) serverSide(secure bool) (encrypt.ServerSide, error) {
	switch cfg.Mode {
	case SSENone:
		return nil, nil
	case SSES3:
		return encrypt.NewSSE(), nil
	case SSEKMS:
		return encrypt.NewSSEKMS(cfg.KMSKeyID, nil)
	case SSEC:
		if !secure {
			// The key would travel in clear, and servers refuse it anyway.
			return nil, errors.New("SSE-C sends its key with every request: it needs an https:// endpoint")
		}
		if len(cfg.CustomerKey) != 32 {
			return nil, fmt.Errorf("SSE-C key of %d bytes, want 32", len(cfg.CustomerKey))
		}
		return encrypt.NewSSEC(cfg.CustomerKey)
	}
	return nil, fmt.Errorf("server-side encryption mode %d unknown", cfg.Mode)
}

// partSSE is what an upload part carries: only SSE-C is repeated there
// (S3 refuses the other modes' headers on parts).
func partSSE(sse encrypt.ServerSide) encrypt.ServerSide {
	if sse != nil && sse.Type() == encrypt.SSEC {
		return sse
	}
	return nil
}

// readSSE is what a GET or HEAD carries: the SSE-C key, nothing else.
func readSSE(sse encrypt.ServerSide) encrypt.ServerSide { return partSSE(sse) }

func statOptions(sse encrypt.ServerSide) minio.StatObjectOptions {
	return minio.StatObjectOptions{ServerSideEncryption: readSSE(sse)}
}
