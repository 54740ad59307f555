package instancemanager

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"sync"
)

// processLog is a process's log file, rotated when it grows past max bytes
// (the previous file is kept as PATH.1), with the last lines kept in
// memory for error reports and followers notified of new lines.
type processLog struct {
	path string
	max  int64
	// open opens the log file for writing (os.OpenFile; tests replace it).
	open func(path string) (*os.File, error)

	mu        sync.Mutex
	f         *os.File // nil after a failed reopen: Write tries again
	size      int64
	partial   []byte
	tail      []string
	followers map[chan string]struct{}
	closed    bool
}

const tailLines = 20

func createLogFile(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o640)
}

func openLog(path string, max int64) (*processLog, error) {
	f, err := createLogFile(path)
	if err != nil {
		return nil, err
	}
	return &processLog{path: path, max: max, open: createLogFile, f: f, followers: map[chan string]struct{}{}}, nil
}

// Write appends output from the process.
func (l *processLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return len(p), nil
	}
	if l.size+int64(len(p)) > l.max && l.f != nil {
		l.rotate()
	}
	if l.f == nil {
		// The last reopen failed (a full or read-only disk): try again,
		// and meanwhile keep the lines for the tail and the followers.
		if f, err := l.open(l.path); err == nil {
			l.f, l.size = f, 0
		}
	}
	n := len(p)
	if l.f != nil {
		// A write error is not returned: a process must not die of its
		// log, and the tail still has what the disk did not take.
		written, _ := l.f.Write(p)
		l.size += int64(written)
	}
	// Split into lines for the tail and the followers.
	data := append(l.partial, p[:n]...)
	for {
		i := bytes.IndexByte(data, '\n')
		if i < 0 {
			break
		}
		line := string(data[:i])
		data = data[i+1:]
		l.tail = append(l.tail, line)
		if len(l.tail) > tailLines {
			l.tail = l.tail[len(l.tail)-tailLines:]
		}
		for ch := range l.followers {
			select {
			case ch <- line:
			default: // a follower that cannot keep up misses lines
			}
		}
	}
	l.partial = append(l.partial[:0], data...)
	return n, nil
}

// rotate moves the log to PATH.1 and starts a new one. If the new file
// cannot be opened, l.f is nil and Write tries again (never a closed file).
func (l *processLog) rotate() {
	l.f.Close()
	l.f = nil
	// A failed rename only means the new file appends to the old one.
	_ = os.Rename(l.path, l.path+".1")
	if f, err := l.open(l.path); err == nil {
		l.f = f
	}
	l.size = 0
}

// Tail returns the last lines written.
func (l *processLog) Tail() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := append([]string(nil), l.tail...)
	if len(l.partial) > 0 {
		out = append(out, string(l.partial))
	}
	return out
}

// Lines returns what the log files hold now, oldest first, and (if follow)
// a channel of later lines, closed when the log closes; stop unsubscribes.
// The files are read without the lock, so a process writing its log never
// waits for a reader: under the lock it only opens them and notes their
// sizes, and reads up to those sizes after (a rotation meanwhile does not
// disturb open files; what is written after goes to the followers).
func (l *processLog) Lines(follow bool) (lines []string, later <-chan string, stop func()) {
	type part struct {
		f    *os.File
		size int64
	}
	var parts []part
	l.mu.Lock()
	for _, p := range []string{l.path + ".1", l.path} {
		f, err := os.Open(p)
		if err != nil {
			continue
		}
		fi, err := f.Stat()
		if err != nil {
			f.Close()
			continue
		}
		parts = append(parts, part{f, fi.Size()})
	}
	var ch chan string
	if follow && !l.closed {
		ch = make(chan string, 256)
		l.followers[ch] = struct{}{}
	}
	l.mu.Unlock()
	for _, p := range parts {
		sc := bufio.NewScanner(io.LimitReader(p.f, p.size))
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			lines = append(lines, sc.Text())
		}
		p.f.Close()
	}
	if ch == nil {
		done := make(chan string)
		close(done)
		return lines, done, func() {}
	}
	return lines, ch, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if _, ok := l.followers[ch]; ok {
			delete(l.followers, ch)
			close(ch)
		}
	}
}

// Close stops writing and ends every follower.
func (l *processLog) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	for ch := range l.followers {
		close(ch)
	}
	l.followers = nil
	if l.f == nil {
		return nil
	}
	return l.f.Close()
}
