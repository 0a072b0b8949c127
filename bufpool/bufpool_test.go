package bufpool

import "testing"

// A Pool hands back what it was given, keeps no more than its idle
// count, and ignores buffers that are not its own.
func TestPool(t *testing.T) {
	p := New(1000, 2)
	if _, ok := p.TryGet(); ok {
		t.Fatal("TryGet on an empty pool found a buffer")
	}
	a, b, c := p.Get(), p.Get(), p.Get()
	if len(a) != 1000 || cap(a) != 1000 {
		t.Fatalf("Get: len %d cap %d, want 1000", len(a), cap(a))
	}
	p.Put(a[:10]) // any slice of it
	p.Put(b)
	p.Put(c)                 // past the idle count: dropped
	p.Put(make([]byte, 999)) // not the pool's size
	p.Put(nil)               // the small first buffers callers keep
	got := map[*byte]bool{}
	for range 2 {
		x, ok := p.TryGet()
		if !ok || len(x) != 1000 {
			t.Fatalf("TryGet: %v, len %d", ok, len(x))
		}
		got[&x[0]] = true
	}
	if !got[&a[0]] || !got[&b[0]] {
		t.Error("the pool did not give back the buffers it was given")
	}
	if _, ok := p.TryGet(); ok {
		t.Error("the pool kept more than its idle count")
	}
}
