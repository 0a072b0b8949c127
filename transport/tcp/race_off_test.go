//go:build !race

package tcp

// slow: see race_on_test.go.
const slow = 1
