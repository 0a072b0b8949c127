// Package redact strips from what gpucr-stream prints what must not be
// there: secrets (URLs with user info or credential query parameters,
// endpoints that were given with credentials in them) and a peer's
// control characters (Text).
package redact

import (
	"errors"
	"net/url"
	"strings"
)

// URL removes credentials from a URL before it is printed.
func URL(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.Scheme == "" || u.Opaque != "" {
		// Not a URL (user:secret@host:port parses as scheme "user", a bad
		// escape not at all): hide what could be user info or a query.
		return unparsed(s)
	}
	if u.User != nil {
		u.User = url.User("REDACTED")
	}
	q := u.Query()
	for k := range q {
		lk := strings.ToLower(k)
		if strings.Contains(lk, "secret") || strings.Contains(lk, "token") || strings.Contains(lk, "signature") || strings.Contains(lk, "credential") || strings.Contains(lk, "key") {
			q.Set(k, "REDACTED")
		}
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// unparsed hides, in a string that is not a well-formed URL, whatever
// precedes an @ in its authority and its query.
func unparsed(s string) string {
	prefix, rest := "", s
	if i := strings.Index(s, "://"); i >= 0 {
		prefix, rest = s[:i+3], s[i+3:]
	}
	end := strings.IndexAny(rest, "/?#")
	if end < 0 {
		end = len(rest)
	}
	if at := strings.LastIndex(rest[:end], "@"); at >= 0 {
		rest = "REDACTED@" + rest[at+1:]
	}
	if q := strings.IndexAny(rest, "?#"); q >= 0 {
		rest = rest[:q] + "?REDACTED"
	}
	return prefix + rest
}

// Error is what a URL parse error says without the URL itself (it quotes
// the whole input, credentials included).
func Error(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}
