package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
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

func TestRebuildLine(t *testing.T) {
	for _, tc := range []struct {
		r    *enginev1.Rebuild
		want string
	}{
		{&enginev1.Rebuild{Replica: "b", Source: "a", State: "in-progress", BytesDone: 1 << 20, BytesTotal: 4 << 20, BytesCopied: 1 << 20, Layers: []string{"s1", "rb"}},
			"b: in-progress  25% (1.0 MiB of 4.0 MiB, 1.0 MiB copied, full, 2 layers) from a"},
		{&enginev1.Rebuild{Replica: "b", Source: "a", State: "in-progress", BytesDone: 4 << 20, BytesTotal: 4 << 20, BytesCopied: 4 << 20, Layers: []string{"rb"}},
			"b: verifying 100% (4.0 MiB of 4.0 MiB, 4.0 MiB copied, full, 1 layer) from a"},
		{&enginev1.Rebuild{Replica: "b", Source: "a", State: "failed", DirtyOnly: true, BytesDone: 1 << 20, BytesTotal: 2 << 20, Error: "boom"},
			"b: failed  50% (1.0 MiB of 2.0 MiB, 0 B copied, dirty regions only) from a: boom"},
		{&enginev1.Rebuild{Replica: "b", Source: "a", State: "complete", BytesDone: 4 << 20, BytesTotal: 4 << 20, BytesCopied: 4 << 20, Layers: []string{"rb"}, FullReason: "history unknown: x"},
			"b: complete 100% (4.0 MiB of 4.0 MiB, 4.0 MiB copied, full, 1 layer) from a; full because history unknown: x"},
	} {
		if got := rebuildLine(tc.r); got != tc.want {
			t.Errorf("rebuildLine:\n got %q\nwant %q", got, tc.want)
		}
	}
}
