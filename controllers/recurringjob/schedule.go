package recurringjob

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// parser reads standard 5-field cron expressions and the @hourly-style
// descriptors, always in UTC.
var parser = cron.NewParser(cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// errTimeZone: a schedule naming its own time zone (TZ=, CRON_TZ=);
// schedules are in UTC so that a run's name does not depend on where the
// manager runs.
var errTimeZone = errors.New("a schedule is in UTC and cannot name a time zone (TZ= or CRON_TZ=)")

// maxSteps bounds the walk from the last run to now (an every-minute
// schedule missed for two years); past it the walk restarts near now.
const maxSteps = 1 << 20

// parseSchedule parses spec.schedule.
func parseSchedule(s string) (cron.Schedule, error) {
	if t := strings.TrimSpace(s); strings.HasPrefix(t, "TZ=") || strings.HasPrefix(t, "CRON_TZ=") {
		return nil, errTimeZone
	}
	sch, err := parser.Parse(s)
	if err != nil {
		return nil, err
	}
	// The parser reads the fields in the process's local time zone; a
	// schedule is in UTC wherever the manager runs.
	if spec, ok := sch.(*cron.SpecSchedule); ok {
		spec.Location = time.UTC
	}
	return sch, nil
}

// plan is what the schedule says to do now.
type plan struct {
	// due is the scheduled time to run now; zero when no run is due.
	due time.Time
	// next is the first scheduled time after now.
	next time.Time
}

// planRun decides whether a run is due at now, given the scheduled time
// of the last run (zero: none yet) and the job's creation. Only the
// latest scheduled time at or before now runs: runs missed while the
// manager was down are not made up one by one, and the latest is by
// definition less than one schedule period late (the time after it is
// still ahead).
func planRun(sch cron.Schedule, last, created, now time.Time) plan {
	base := last
	if base.IsZero() || base.Before(created) {
		base = created
	}
	first := sch.Next(base)
	if first.IsZero() { // a schedule that never fires again
		return plan{}
	}
	if first.After(now) {
		return plan{next: first}
	}
	latest := first
	for i := 0; ; i++ {
		n := sch.Next(latest)
		if n.IsZero() || n.After(now) {
			return plan{due: latest, next: n}
		}
		latest = n
		if i == maxSteps {
			// Far behind: start again from a day before now; an
			// hourly or finer schedule finds its latest time within it.
			latest, i = sch.Next(now.Add(-24*time.Hour)), 0
			if latest.After(now) {
				return plan{next: latest}
			}
		}
	}
}

// stampLayout is the time stamp in the names of a run's objects:
// sortable, lower case, minutes (a cron schedule's finest unit).
const stampLayout = "20060102-1504"

// objectName names the Snapshot or Backup job makes of volume for the
// run at scheduled: the same name every time, so a run repeated after a
// restart finds what it created instead of creating it again. The volume
// is a hash, so the name fits in 63 characters for any volume name.
func objectName(job, volume string, scheduled time.Time) string {
	h := sha256.Sum256([]byte(volume))
	return fmt.Sprintf("%s-%s-%s", job, scheduled.UTC().Format(stampLayout), hex.EncodeToString(h[:4]))
}
