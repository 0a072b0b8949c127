//go:build race

package tcp

// slow scales the deadlines of tests that a sender must meet: the race
// detector makes TLS handshakes and copies several times slower.
const slow = 3
