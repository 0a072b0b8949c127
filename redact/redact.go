// Package redact strips secrets from what gpucr-stream prints: URLs with
// user info or credential query parameters, endpoints that were given
// with credentials in them.
package redact

import (
	"net/url"
	"strings"
)

// URL removes credentials from a URL before it is printed.
func URL(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.Scheme == "" {
		return s
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
