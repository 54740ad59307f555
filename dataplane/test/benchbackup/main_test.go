package main

import "testing"

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"1G": 1 << 30, "256M": 256 << 20, "256Mi": 256 << 20, "64KiB": 64 << 10, "4096": 4096, "2T": 2 << 40} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "G", "0", "-1G", "1X", "1.5G", "99999999999T"} {
		if got, err := parseSize(bad); err == nil {
			t.Errorf("parseSize(%q) = %d, want an error", bad, got)
		}
	}
}
