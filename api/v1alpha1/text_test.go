package v1alpha1

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// TestTruncateMessage: a text that fits is kept (invalid bytes replaced);
// a longer one ends with "..." within n bytes, valid UTF-8, never split
// inside a character.
func TestTruncateMessage(t *testing.T) {
	for _, c := range []struct {
		in   string
		n    int
		want string
	}{
		{"short", 10, "short"},
		{"exactly10!", 10, "exactly10!"},
		{"eleven byte", 10, "eleven ..."},
		{"bad \xff byte", 20, "bad ? byte"},
		{"ééééé", 8, "éé..."}, // 2 bytes each: a cut at 5 would split the third
		{strings.Repeat("x", 300), 256, strings.Repeat("x", 253) + "..."},
	} {
		got := TruncateMessage(c.in, c.n)
		if got != c.want || len(got) > c.n || !utf8.ValidString(got) {
			t.Errorf("TruncateMessage(%q, %d) = %q, want %q", c.in, c.n, got, c.want)
		}
	}
}
