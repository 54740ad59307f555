package snapshotsource

import (
	"errors"
	"slices"
	"testing"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
)

func TestAppendBlockRange(t *testing.T) {
	const bs, size = 100, 1000
	type r = backupstore.Range
	rr := func(o, n int64) r { return r{Offset: o, Length: n} }
	for _, tc := range []struct {
		in   [][2]int64
		want []r
	}{
		{nil, []r{}},
		{[][2]int64{{0, 1}}, []r{rr(0, 100)}},
		{[][2]int64{{150, 10}, {170, 10}}, []r{rr(100, 100)}},
		{[][2]int64{{150, 10}, {200, 10}}, []r{rr(100, 200)}},
		{[][2]int64{{50, 300}, {500, 1}}, []r{rr(0, 400), rr(500, 100)}},
		{[][2]int64{{950, 50}}, []r{rr(900, 100)}},
		{[][2]int64{{990, 10}}, []r{rr(900, 100)}},
	} {
		got := []r{}
		for _, x := range tc.in {
			got = appendBlockRange(got, x[0], x[1], bs, size)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%v: got %v, want %v", tc.in, got, tc.want)
		}
	}
}

func TestCheckChangesPage(t *testing.T) {
	br := func(o, n int64) *replicav1.ByteRange { return &replicav1.ByteRange{Offset: o, Length: n} }
	for _, tc := range []struct {
		what   string
		ranges []*replicav1.ByteRange
		next   int64
		ok     bool
	}{
		{"empty, done", nil, 1000, true},
		{"sorted", []*replicav1.ByteRange{br(100, 10), br(200, 10)}, 1000, true},
		{"no progress", nil, 100, false},
		{"past the end", nil, 2000, false},
		{"before off", []*replicav1.ByteRange{br(0, 10)}, 1000, false},
		{"past next", []*replicav1.ByteRange{br(500, 600)}, 1000, false},
		{"overlapping", []*replicav1.ByteRange{br(100, 100), br(150, 10)}, 1000, false},
		{"empty range", []*replicav1.ByteRange{br(100, 0)}, 1000, false},
		{"overflowing", []*replicav1.ByteRange{br(200, 1<<62+(1<<62-1))}, 1000, false},
	} {
		next, err := checkChangesPage(&replicav1.SnapshotChangesResponse{Ranges: tc.ranges, NextOffset: tc.next}, 100, 1000)
		if (err == nil) != tc.ok || (tc.ok && next != tc.next) || (!tc.ok && !errors.Is(err, ErrReply)) {
			t.Errorf("%s: next %d, err %v; want ok=%v", tc.what, next, err, tc.ok)
		}
	}
}
