package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

func TestRun(t *testing.T) {
	for _, tc := range []struct {
		args     []string
		code     int
		inStdout string
		inStderr string
	}{
		{args: nil, code: 2, inStderr: "usage: cairn-data"},
		{args: []string{"version"}, code: 0, inStdout: "dev"},
		{args: []string{"help"}, code: 0, inStdout: "commands:"},
		{args: []string{"bogus"}, code: 2, inStderr: `unknown command "bogus"`},
	} {
		var out, errb bytes.Buffer
		if code := run(context.Background(), tc.args, &out, &errb); code != tc.code {
			t.Errorf("run(%q) = %d, want %d", tc.args, code, tc.code)
		}
		if !strings.Contains(out.String(), tc.inStdout) {
			t.Errorf("run(%q) stdout %q, want it to contain %q", tc.args, out.String(), tc.inStdout)
		}
		if !strings.Contains(errb.String(), tc.inStderr) {
			t.Errorf("run(%q) stderr %q, want it to contain %q", tc.args, errb.String(), tc.inStderr)
		}
	}
}
