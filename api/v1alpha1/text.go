package v1alpha1

import (
	"strings"
	"unicode/utf8"
)

// TruncateMessage makes s fit a status field of at most n bytes (n ≥ 3):
// invalid UTF-8 becomes "?", and a longer text is cut at a character
// boundary and ends with "..." to show the cut. The API server rejects an
// update whose string exceeds its CRD bound, so text from outside (a
// process's error, a node's report) goes through this before it is stored.
func TruncateMessage(s string, n int) string {
	s = strings.ToValidUTF8(s, "?")
	if len(s) <= n {
		return s
	}
	cut := n - len("...")
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}
