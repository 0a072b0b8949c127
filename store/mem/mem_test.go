package mem_test

import (
	"testing"

	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/mem"
	"github.com/gpucr/gpucr-stream/store/storetest"
)

func TestMemConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store { return mem.New(t.Name()) })
}
