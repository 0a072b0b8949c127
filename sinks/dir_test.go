package sinks_test

import (
	"testing"

	"github.com/gpucr/gpucr-stream/sinks"
	"github.com/gpucr/gpucr-stream/sinks/storetest"
	"github.com/gpucr/gpucr-stream/streamer"
)

func TestDirConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) streamer.Store {
		return sinks.NewDir(t.TempDir())
	})
}
