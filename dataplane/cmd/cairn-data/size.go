package main

import (
	"fmt"
	"strconv"
	"strings"
)

// parseSize reads a byte count: a plain integer, or one with a binary
// suffix Ki, Mi, Gi, Ti (also K, M, G, T, meaning the same powers of 1024).
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		shift  uint
	}{{"Ki", 10}, {"Mi", 20}, {"Gi", 30}, {"Ti", 40}, {"K", 10}, {"M", 20}, {"G", 30}, {"T", 40}} {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), int64(1)<<u.shift
			break
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%q is not a size: use bytes or a number with Ki, Mi, Gi or Ti (e.g. 10Gi)", s)
	}
	if n > (1<<63-1)/mult {
		return 0, fmt.Errorf("%q is too large", s)
	}
	return n * mult, nil
}
