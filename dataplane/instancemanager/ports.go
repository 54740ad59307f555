package instancemanager

import "fmt"

// portRange hands out contiguous blocks of ports from [min, max].
// Not safe for concurrent use: the Supervisor holds its lock.
type portRange struct {
	min, max int
	used     []bool
}

func newPortRange(min, max int) (*portRange, error) {
	if min <= 0 || max > 65535 || min > max {
		return nil, fmt.Errorf("port range %d-%d: want 1 <= A <= B <= 65535", min, max)
	}
	return &portRange{min: min, max: max, used: make([]bool, max-min+1)}, nil
}

// alloc returns n contiguous ports, or ok=false if no block is free.
func (r *portRange) alloc(n int) ([]int, bool) {
	if n == 0 {
		return nil, true
	}
	run := 0
	for i := range r.used {
		if r.used[i] {
			run = 0
			continue
		}
		if run++; run == n {
			start := i - n + 1
			out := make([]int, n)
			for k := range n {
				r.used[start+k] = true
				out[k] = r.min + start + k
			}
			return out, true
		}
	}
	return nil, false
}

func (r *portRange) release(ports []int) {
	for _, p := range ports {
		if p >= r.min && p <= r.max {
			r.used[p-r.min] = false
		}
	}
}
