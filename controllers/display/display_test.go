package display

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestBytes(t *testing.T) {
	for n, want := range map[int64]string{0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 1536: "1.5 KiB", 256 << 20: "256.0 MiB", 1 << 30: "1.0 GiB", 3 << 40: "3.0 TiB"} {
		if got := Bytes(n); got != want {
			t.Errorf("Bytes(%d) = %q, want %q", n, got, want)
		}
	}
}

func TestEventTime(t *testing.T) {
	a, b, c := time.Unix(100, 0), time.Unix(200, 0), time.Unix(300, 0)
	ev := corev1.Event{ObjectMeta: metav1.ObjectMeta{CreationTimestamp: metav1.NewTime(c)}}
	if got := EventTime(ev); !got.Equal(c) {
		t.Fatalf("only created: %v", got)
	}
	ev.EventTime = metav1.NewMicroTime(b)
	if got := EventTime(ev); !got.Equal(b) {
		t.Fatalf("event time: %v", got)
	}
	ev.LastTimestamp = metav1.NewTime(a)
	if got := EventTime(ev); !got.Equal(a) {
		t.Fatalf("last timestamp: %v", got)
	}
}
