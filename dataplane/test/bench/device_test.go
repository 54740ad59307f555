package main

import (
	"strings"
	"testing"
)

func TestParseDeviceLimit(t *testing.T) {
	for _, c := range []struct {
		in        string
		iops, bps int64
		err       string
	}{
		{"iops=3000,bps=125M", 3000, 125 << 20, ""},
		{"bps=1G,iops=15000", 15000, 1 << 30, ""},
		{"iops=100,bps=512K", 100, 512 << 10, ""},
		{"iops=3000", 0, 0, "give both"},
		{"iops=x,bps=1M", 0, 0, "give iops=N,bps=SIZE"},
		{"iops=-1,bps=1M", 0, 0, "give iops=N,bps=SIZE"},
		{"iops=10,bps=1M,lat=1ms", 0, 0, `unknown key "lat"`},
		{"", 0, 0, "unknown key"},
	} {
		iops, bps, err := parseDeviceLimit(c.in)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%q: %v, want an error with %q", c.in, err, c.err)
			}
			continue
		}
		if err != nil || iops != c.iops || bps != c.bps {
			t.Errorf("%q: %d, %d, %v; want %d, %d", c.in, iops, bps, err, c.iops, c.bps)
		}
	}
}
