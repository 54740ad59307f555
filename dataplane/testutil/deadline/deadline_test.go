package deadline

import "testing"

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want float64
		ok   bool
	}{
		{"", 1, true}, {"1", 1, true}, {"2.5", 2.5, true}, {"50", 50, true},
		{"0.5", 0, false}, {"0", 0, false}, {"-2", 0, false}, {"51", 0, false}, {"three", 0, false}, {"NaN", 0, false},
	} {
		got, err := parse(tc.in)
		if (err == nil) != tc.ok || (tc.ok && got != tc.want) {
			t.Errorf("parse(%q) = %v, %v; want %v (ok %v)", tc.in, got, err, tc.want, tc.ok)
		}
	}
}
