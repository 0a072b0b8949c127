package tcp

import (
	"context"
	"strings"
	"testing"
	"time"
)

// An authenticated sender that stays connected and silent is dropped
// after the timeout (it held the receiver 90 s with 5 s set).
func TestTCPSilentSender(t *testing.T) {
	r := startReceiver(t, tokenAuth(goodToken)) // 3 s timeout
	out, err := Dial(testCtx(t), r.addr(), SendOptions{Auth: tokenAuth(goodToken), Streams: 1, AutoCommit: true})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	ctx, cancel := context.WithTimeout(testCtx(t), 12*time.Second)
	defer cancel()
	start := time.Now()
	_, err = r.src.WaitCommitted(ctx)
	if err == nil || ctx.Err() != nil {
		t.Fatalf("silent sender: %v after %v, want the receiver to give up", err, time.Since(start).Round(time.Millisecond))
	}
	if !strings.Contains(err.Error(), "sent nothing") {
		t.Errorf("error %q does not say the sender fell silent", err)
	}
}
