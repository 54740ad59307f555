// Package display holds what Cairn's human-facing views share: the
// volume's status messages, the web page and kubectl cairn.
package display

import (
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// Bytes prints n in binary units: "512 B", "1.5 MiB", "2.0 GiB".
func Bytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// EventTime is when an event last happened: its last timestamp, else its
// event time (events.k8s.io events), else when it was created.
func EventTime(ev corev1.Event) time.Time {
	for _, t := range []time.Time{ev.LastTimestamp.Time, ev.EventTime.Time, ev.CreationTimestamp.Time} {
		if !t.IsZero() {
			return t
		}
	}
	return time.Time{}
}
