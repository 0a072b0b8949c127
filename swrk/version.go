package swrk

// A runtime's VERSION request, answered here. runc asks its criu for the
// version in a swrk of its own before every checkpoint and restore
// (go-criu's GetCriuVersion); passed through, that starts the real criu
// once more, beside the one that dumps or restores. A checkpoint through
// the runtime has asked criu already, for its manifest
// (criusock.VersionQuery), and says the answer in the environment the
// runtime hands its criu (knobs.SwrkVersion); the answer given here is
// that one, word for word, where it is from the criu that a
// passed-through request would reach.

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/gpucr/gpucr-stream/criusock"
	"github.com/gpucr/gpucr-stream/knobs"
)

// knownVersion is knobs.SwrkVersion's value: criu's answer, and which
// criu gave it.
type knownVersion struct {
	CRIU    string          `json:"criu"`
	Version json.RawMessage `json:"version"` // rpc.CriuVersion, protojson
}

// VersionEnv is the environment entry that tells the swrk a runtime
// starts criu's version, as q asked it; "" if it is not known.
func VersionEnv(q *criusock.VersionQuery) string {
	if q == nil {
		return ""
	}
	v, err := q.Wait()
	if err != nil {
		return ""
	}
	b, err := protojson.Marshal(v)
	if err != nil {
		return ""
	}
	b, err = json.Marshal(knownVersion{CRIU: q.CRIU(), Version: b})
	if err != nil {
		return ""
	}
	return knobs.SwrkVersion.Name + "=" + string(b)
}

// versionAnswer is the answer to a VERSION request, where the
// environment holds the version of the criu that request would
// otherwise reach; nil where it does not.
func versionAnswer() *rpc.CriuResp {
	s, ok := knobs.SwrkVersion.Lookup()
	if !ok {
		return nil
	}
	var kv knownVersion
	if json.Unmarshal([]byte(s), &kv) != nil {
		return nil
	}
	criu, err := criusock.FindCRIU("")
	if err != nil || criu != kv.CRIU {
		return nil
	}
	v := &rpc.CriuVersion{}
	if protojson.Unmarshal(kv.Version, v) != nil || v.MajorNumber == nil || v.MinorNumber == nil {
		return nil
	}
	return &rpc.CriuResp{Type: rpc.CriuReqType_VERSION.Enum(), Success: proto.Bool(true), Version: v}
}

// nextRequest is the first request of the session on fd that is not a
// VERSION request versionAnswer knows the answer to, left on the socket;
// those before it are answered. nil: the runtime closed the session
// after such requests (go-criu closes it after its answer).
func nextRequest(fd int) (*rpc.CriuReq, error) {
	var resp *rpc.CriuResp
	for {
		req, err := peekRequest(fd)
		switch {
		case errors.Is(err, errClosed) && resp != nil:
			return nil, nil
		case err != nil:
			return nil, err
		case req.GetType() != rpc.CriuReqType_VERSION:
			return req, nil
		}
		if resp == nil {
			if resp = versionAnswer(); resp == nil {
				return req, nil
			}
		}
		if err := dropRequest(fd); err != nil {
			return nil, err
		}
		b, err := proto.Marshal(resp)
		if err != nil {
			return nil, err
		}
		if _, err := unix.Write(fd, b); err != nil {
			return nil, fmt.Errorf("answer the version request on descriptor %d: %w", fd, err)
		}
	}
}
