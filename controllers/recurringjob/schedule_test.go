package recurringjob

import (
	"errors"
	"testing"
	"time"

	. "github.com/onsi/gomega"
)

func at(s string) time.Time {
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		panic(err)
	}
	return t
}

// TestPlanRun: a run is due at the latest scheduled time at or before
// now, once; runs missed while the manager was down are not made up one
// by one; nothing is due before the first scheduled time after creation.
func TestPlanRun(t *testing.T) {
	g := NewWithT(t)
	hourly, err := parseSchedule("0 * * * *")
	g.Expect(err).NotTo(HaveOccurred())
	created := at("2026-11-27T10:20:00Z")
	for _, tc := range []struct {
		name      string
		last, now string
		due, next string
	}{
		{name: "before the first time", now: "2026-11-27T10:59:59Z", next: "2026-11-27T11:00:00Z"},
		{name: "the first time", now: "2026-11-27T11:00:00Z", due: "2026-11-27T11:00:00Z", next: "2026-11-27T12:00:00Z"},
		{name: "ran already", last: "2026-11-27T11:00:00Z", now: "2026-11-27T11:30:00Z", next: "2026-11-27T12:00:00Z"},
		{name: "next time", last: "2026-11-27T11:00:00Z", now: "2026-11-27T12:00:05Z", due: "2026-11-27T12:00:00Z", next: "2026-11-27T13:00:00Z"},
		{name: "three missed: only the latest", last: "2026-11-27T11:00:00Z", now: "2026-11-27T15:10:00Z", due: "2026-11-27T15:00:00Z", next: "2026-11-27T16:00:00Z"},
		{name: "never ran, down for a day", now: "2026-11-28T10:59:00Z", due: "2026-11-28T10:00:00Z", next: "2026-11-28T11:00:00Z"},
	} {
		var last time.Time
		if tc.last != "" {
			last = at(tc.last)
		}
		p := planRun(hourly, last, created, at(tc.now))
		if tc.due == "" {
			g.Expect(p.due.IsZero()).To(BeTrue(), tc.name)
		} else {
			g.Expect(p.due).To(Equal(at(tc.due)), tc.name)
		}
		g.Expect(p.next).To(Equal(at(tc.next)), tc.name)
	}
	// An every-minute schedule missed for two years still finds the
	// latest minute.
	minutely, err := parseSchedule("* * * * *")
	g.Expect(err).NotTo(HaveOccurred())
	p := planRun(minutely, at("2024-11-27T10:00:00Z"), created, at("2026-11-27T10:30:30Z"))
	g.Expect(p.due).To(Equal(at("2026-11-27T10:30:00Z")))
	g.Expect(p.next).To(Equal(at("2026-11-27T10:31:00Z")))
}

func TestParseSchedule(t *testing.T) {
	g := NewWithT(t)
	for _, ok := range []string{"0 3 * * *", "*/15 * * * 1-5", "@daily", "@hourly"} {
		_, err := parseSchedule(ok)
		g.Expect(err).NotTo(HaveOccurred(), ok)
	}
	for _, bad := range []string{"0 3 * *", "61 * * * *", "0 0 3 * * *", "every day", ""} {
		_, err := parseSchedule(bad)
		g.Expect(err).To(HaveOccurred(), bad)
	}
	_, err := parseSchedule("CRON_TZ=Europe/Paris 0 3 * * *")
	g.Expect(errors.Is(err, errTimeZone)).To(BeTrue())

	// In UTC whatever the time zone of the time it is given.
	sch, err := parseSchedule("0 3 * * *")
	g.Expect(err).NotTo(HaveOccurred())
	plus5 := time.FixedZone("UTC+5", 5*3600)
	g.Expect(sch.Next(at("2026-11-27T00:00:00Z").In(plus5))).To(BeTemporally("==", at("2026-11-27T03:00:00Z")))
}

// TestObjectName: fixed by job, volume and time; different volumes get
// different names; the longest job name still gives a DNS label.
func TestObjectName(t *testing.T) {
	g := NewWithT(t)
	ts := at("2026-11-27T11:00:00Z")
	g.Expect(objectName("daily", "vol-a", ts)).To(Equal(objectName("daily", "vol-a", ts)))
	g.Expect(objectName("daily", "vol-a", ts)).NotTo(Equal(objectName("daily", "vol-b", ts)))
	g.Expect(objectName("daily", "vol-a", ts)).To(HavePrefix("daily-20261127-1100-"))
	long := objectName("a234567890123456789012345678901234567890", "a-volume-name-of-sixty-three-characters-xxxxxxxxxxxxxxxxxxxxxxx", ts)
	g.Expect(len(long)).To(BeNumerically("<=", 63))
}

// TestToPrune: per volume, the completed items beyond the newest retain
// go; unfinished, failing and deleting ones neither count nor go.
func TestToPrune(t *testing.T) {
	g := NewWithT(t)
	mk := func(vol string, hour int, done, failed, deleting bool) item {
		ts := at("2026-11-27T00:00:00Z").Add(time.Duration(hour) * time.Hour)
		return item{obj: newSnapshotObj(objectName("j", vol, ts)), volume: vol, scheduled: ts, done: done, failed: failed, deleting: deleting}
	}
	items := []item{
		mk("a", 1, true, false, false), mk("a", 2, true, false, false), mk("a", 3, true, false, false),
		mk("a", 4, false, false, false), mk("a", 5, false, true, false), mk("a", 0, true, false, true),
		mk("b", 1, true, false, false), mk("b", 2, true, false, false),
	}
	got := toPrune(items, 2)
	g.Expect(got).To(HaveLen(1))
	g.Expect(got[0].obj.GetName()).To(Equal(objectName("j", "a", at("2026-11-27T01:00:00Z"))))
	g.Expect(toPrune(items, 1)).To(HaveLen(3))
}
