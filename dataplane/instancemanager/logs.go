package instancemanager

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"sync"
)

// processLog is a process's log file, rotated when it grows past max bytes
// (the previous file is kept as PATH.1), with the last lines kept in
// memory for error reports and followers notified of new lines.
type processLog struct {
	path string
	max  int64

	mu        sync.Mutex
	f         *os.File
	size      int64
	partial   []byte
	tail      []string
	followers map[chan string]struct{}
	closed    bool
}

const tailLines = 20

func openLog(path string, max int64) (*processLog, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o640)
	if err != nil {
		return nil, err
	}
	return &processLog{path: path, max: max, f: f, followers: map[chan string]struct{}{}}, nil
}

// Write appends output from the process.
func (l *processLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return len(p), nil
	}
	if l.size+int64(len(p)) > l.max {
		l.rotate()
	}
	n, err := l.f.Write(p)
	l.size += int64(n)
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
	return n, err
}

func (l *processLog) rotate() {
	l.f.Close()
	os.Rename(l.path, l.path+".1")
	if f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o640); err == nil {
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
func (l *processLog) Lines(follow bool) (lines []string, later <-chan string, stop func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, p := range []string{l.path + ".1", l.path} {
		f, err := os.Open(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			lines = append(lines, sc.Text())
		}
		f.Close()
	}
	if !follow || l.closed {
		ch := make(chan string)
		close(ch)
		return lines, ch, func() {}
	}
	ch := make(chan string, 256)
	l.followers[ch] = struct{}{}
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
	return l.f.Close()
}
