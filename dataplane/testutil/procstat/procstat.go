// Package procstat reads what the benchmarks count of a process from its
// line of /proc/PID/stat: its command name, its flags and the CPU time it
// has used.
package procstat

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Stat is a process's command name, flags and CPU time.
type Stat struct {
	Comm  string        // the command name (at most 15 bytes, may hold spaces and parentheses)
	Flags uint64        // the kernel's PF_* bits (field 9)
	CPU   time.Duration // user and system time of all its threads (fields 14 and 15)
}

// PFKthread is the flag of a kernel thread.
const PFKthread = 0x00200000

// clockTick is 1/USER_HZ, the unit of the CPU fields: USER_HZ is 100 on
// every Linux architecture Go runs on.
const clockTick = 10 * time.Millisecond

// Read reads /proc/PID/stat.
func Read(pid int) (Stat, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return Stat{}, err
	}
	return Parse(b)
}

// Parse parses a /proc/PID/stat line.
func Parse(b []byte) (Stat, error) {
	// The command name is in parentheses and may hold any byte but NUL,
	// so it ends at the last closing one; the fields after it are
	// numbered from 3 (the state).
	open, end := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if open < 0 || end < open {
		return Stat{}, fmt.Errorf("procstat: no command name in %.80q", b)
	}
	f := strings.Fields(string(b[end+1:]))
	if len(f) < 13 {
		return Stat{}, fmt.Errorf("procstat: %d fields after the command name, want at least 13", len(f))
	}
	var n [3]uint64
	for i, field := range []int{9, 14, 15} {
		v, err := strconv.ParseUint(f[field-3], 10, 64)
		if err != nil {
			return Stat{}, fmt.Errorf("procstat: field %d: %w", field, err)
		}
		n[i] = v
	}
	return Stat{Comm: string(b[open+1 : end]), Flags: n[0], CPU: time.Duration(n[1]+n[2]) * clockTick}, nil
}
