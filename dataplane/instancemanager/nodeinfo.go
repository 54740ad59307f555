package instancemanager

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// DataDir describes one data directory's filesystem.
type DataDir struct {
	Path       string
	Total      int64
	Available  int64
	Filesystem string
}

// StatDataDir reports a data directory's capacity and filesystem type.
func StatDataDir(path string) (DataDir, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return DataDir{}, err
	}
	return DataDir{Path: path, Total: int64(st.Blocks) * st.Bsize, Available: int64(st.Bavail) * st.Bsize, Filesystem: fsType(path)}, nil
}

// fsType finds the filesystem type of the mount holding path.
func fsType(path string) string {
	abs, err := filepath.EvalSymlinks(path)
	if err != nil {
		return ""
	}
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		return ""
	}
	defer f.Close()
	best, typ := "", ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 3 {
			continue
		}
		mp := fields[1]
		if (abs == mp || strings.HasPrefix(abs, strings.TrimSuffix(mp, "/")+"/")) && len(mp) >= len(best) {
			best, typ = mp, fields[2]
		}
	}
	return typ
}
