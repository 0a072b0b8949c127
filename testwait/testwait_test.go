package testwait

import (
	"testing"
	"time"
)

// TestScale: GPUCR_TEST_SLOW sets the factor; without it (or with a value
// that is no positive number) the factor is the load per CPU, at least 1.
func TestScale(t *testing.T) {
	for _, tc := range []struct {
		env  string
		want func(f float64) bool
	}{
		{"4", func(f float64) bool { return f == 4 }},
		{"0.5", func(f float64) bool { return f == 0.5 }},
		{"", func(f float64) bool { return f >= 1 }},
		{"slow", func(f float64) bool { return f >= 1 }},
		{"-2", func(f float64) bool { return f >= 1 }},
	} {
		t.Run(tc.env, func(t *testing.T) {
			t.Setenv(Env, tc.env)
			if f := factor(); !tc.want(f) {
				t.Errorf("%s=%q: factor %v", Env, tc.env, f)
			}
		})
	}
	if got := Scale(time.Second); got != time.Duration(float64(time.Second)*Factor()) || got < time.Second {
		t.Errorf("Scale(1s) = %v with factor %v", got, Factor())
	}
}
