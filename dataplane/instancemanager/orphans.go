package instancemanager

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/go-logr/logr"
)

// Each child is recorded in STATEDIR/NAME.pid as "PID STARTTIME", where
// STARTTIME is field 22 of /proc/PID/stat: together they identify the
// process even if the pid is later reused.

func procStartTime(pid int) (string, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "", false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')') // the command name may hold spaces
	if i < 0 {
		return "", false
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return "", false
	}
	return f[19], true // field 22 overall; field 3 is f[0]
}

func writePIDFile(dir, name string, pid int) {
	st, _ := procStartTime(pid)
	// Without the record a later instance manager cannot kill this child
	// if this one dies; nothing else depends on it, so the child runs on.
	_ = os.WriteFile(filepath.Join(dir, name+".pid"), []byte(fmt.Sprintf("%d %s\n", pid, st)), 0o640)
}

func removePIDFile(dir, name string) { os.Remove(filepath.Join(dir, name+".pid")) }

// killOrphans kills every recorded child that is still the same process
// (and its process group), and removes the records. It returns how many it
// killed. It kills and nothing else: the FUSE mount and loop device of an
// engine it kills stay, held by the device keeper (cairn-data
// device-keeper, outside this pod), and the engine started next for the
// volume takes them over, so the I/O on them waits instead of failing
// (TestFUSEInstanceManagerRestartIsAPause). Unmounting or detaching them
// here would fail that I/O; an engine detaches them itself when the
// volume is detached.
func killOrphans(dir string, log logr.Logger) int {
	files, _ := filepath.Glob(filepath.Join(dir, "*.pid"))
	n := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		os.Remove(f)
		if err != nil {
			continue
		}
		fields := strings.Fields(string(b))
		if len(fields) != 2 {
			continue
		}
		pid, err := strconv.Atoi(fields[0])
		if err != nil || pid <= 1 {
			continue
		}
		if st, ok := procStartTime(pid); ok && st == fields[1] {
			log.Info("killing a process left by a previous instance manager", "pid", pid, "record", filepath.Base(f))
			// Its group first (the engine's children), then itself; an
			// error means it is gone already.
			_ = syscall.Kill(-pid, syscall.SIGKILL)
			_ = syscall.Kill(pid, syscall.SIGKILL)
			n++
		}
	}
	return n
}
