package instancemanager

import (
	"fmt"
	"net"
	"strconv"
)

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

// alloc returns n contiguous ports, or ok=false if no block is free. A
// port for which free (if given) says false is skipped this time: some
// other program holds it (often an outgoing connection given it as its
// local port, when the range overlaps the kernel's ephemeral ports), and
// a child told to listen there would fail at once, again on every retry.
func (r *portRange) alloc(n int, free func(port int) bool) ([]int, bool) {
	if n == 0 {
		return nil, true
	}
	run := 0
	for i := range r.used {
		if r.used[i] || (free != nil && !free(r.min+i)) {
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

// bindable reports whether a TCP listener can be opened on host:port now.
func bindable(host string, port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return false
	}
	l.Close()
	return true
}
