package procstat

import (
	"os"
	"strings"
	"testing"
	"time"
)

func TestParseTakesTheLastParenthesis(t *testing.T) {
	// A command name with a space and a closing parenthesis of its own.
	line := "4242 (a b) c) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 75 0 0 20 0 9 0 100 0 0\n"
	s, err := Parse([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if s.Comm != "a b) c" || s.Flags != 4194560 || s.CPU != 3250*time.Millisecond {
		t.Fatalf("got %+v, want comm %q, flags 4194560, CPU 3.25s", s, "a b) c")
	}
}

func TestParseRejectsShortAndMalformedLines(t *testing.T) {
	for _, line := range []string{
		"",
		"4242 no-name S 1",
		"4242 (x) S 1 4242",
		"4242 (x) S 1 4242 4242 0 -1 flags 1000 0 0 0 250 75",
	} {
		if s, err := Parse([]byte(line)); err == nil {
			t.Errorf("%q: parsed as %+v, want an error", line, s)
		}
	}
}

func TestReadThisProcess(t *testing.T) {
	s, err := Read(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	exe, _ := os.Executable()
	base := exe[strings.LastIndexByte(exe, '/')+1:]
	if !strings.HasPrefix(base, s.Comm) || s.Flags&PFKthread != 0 {
		t.Fatalf("this process reads as %+v; its executable is %s", s, base)
	}
}
