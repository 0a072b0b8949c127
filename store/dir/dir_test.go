package dir_test

import (
	"testing"

	"github.com/gpucr/gpucr-stream/store"
	"github.com/gpucr/gpucr-stream/store/dir"
	"github.com/gpucr/gpucr-stream/store/storetest"
)

func TestDirConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store { return dir.New(t.TempDir()) })
}
