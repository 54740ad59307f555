package recurringjob

import (
	"context"
	"fmt"
	"math"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// A filesystem-trim run makes no objects. For each selected volume that
// is attached it sets the job's FilesystemTrimRequestAnnotation on the
// Volume to the run's scheduled time; the CSI node plugin of the node the
// volume is attached to runs fstrim on its mounted filesystem and answers
// in the FilesystemTrimResultAnnotation. The manager cannot trim itself:
// only that node has the filesystem mounted.

// trimPhase is where one selected volume is in a filesystem-trim run.
type trimPhase int

const (
	// trimUnrequested: attached, not asked yet.
	trimUnrequested trimPhase = iota
	// trimPending: asked; its node plugin has not answered yet.
	trimPending
	// trimDetached: not attached to a node, so nothing to trim: skipped.
	trimDetached
	// trimAnswered: the node plugin answered (trimmed, skipped or
	// failed).
	trimAnswered
)

// trimState is one selected volume in a filesystem-trim run.
type trimState struct {
	volume string
	// node is the node the volume is attached to ("" when detached).
	node   string
	phase  trimPhase
	result v1.FilesystemTrimResult
}

// observeTrim says where v is in job's run runID. An answer for the run
// counts whatever the volume does since; a request not answered while
// the volume is detached is skipped: no node has its filesystem.
func observeTrim(v *v1.Volume, job, runID string) trimState {
	st := trimState{volume: v.Name, node: v.Status.CurrentNodeName}
	if raw, ok := v.Annotations[v1.FilesystemTrimResultAnnotation(job)]; ok {
		// A value that does not decode is no answer: the node plugin
		// answers the request again.
		if res, err := v1.DecodeFilesystemTrimResult(raw); err == nil && res.Run == runID {
			st.phase, st.result = trimAnswered, res
			return st
		}
	}
	switch {
	case v.Status.State != v1.VolumeStateAttached || v.Status.CurrentNodeName == "":
		st.phase = trimDetached
	case v.Annotations[v1.FilesystemTrimRequestAnnotation(job)] == runID:
		st.phase = trimPending
	default:
		st.phase = trimUnrequested
	}
	return st
}

// runID is a run's value in a trim request: its scheduled time.
func runID(run time.Time) string { return run.UTC().Format(time.RFC3339) }

// workTrim asks for the trims the current run still lacks (when create)
// and records the run's result from the Volumes' answers.
func (r *Reconciler) workTrim(ctx context.Context, job *v1.RecurringJob, create bool) error {
	if job.Status.LastRunTime == nil {
		return nil
	}
	vols, err := r.selectedVolumes(ctx, job)
	if err != nil {
		return err
	}
	run := job.Status.LastRunTime.UTC()
	id := runID(run)
	states := make([]trimState, len(vols))
	for i := range vols {
		states[i] = observeTrim(&vols[i], job.Name, id)
	}
	if create {
		err = r.requestTrims(ctx, job, vols, states, id)
	}
	job.Status.LastResult = trimRunResult(job, run, states)
	return err
}

// requestTrims asks the node plugins to trim the attached volumes not
// asked yet, keeping at most spec.concurrency requests unanswered. If we
// crash after a request is written but before the status, the next
// reconcile finds the request and waits for its answer rather than ask
// again.
func (r *Reconciler) requestTrims(ctx context.Context, job *v1.RecurringJob, vols []v1.Volume, states []trimState, id string) error {
	limit := int(job.Spec.Concurrency)
	if limit < 1 {
		limit = v1.DefaultRecurringJobConcurrency
	}
	pending := 0
	for _, st := range states {
		if st.phase == trimPending {
			pending++
		}
	}
	for i := range states {
		if pending >= limit {
			return nil
		}
		if states[i].phase != trimUnrequested {
			continue
		}
		v := &vols[i]
		before := v.DeepCopy()
		if v.Annotations == nil {
			v.Annotations = map[string]string{}
		}
		v.Annotations[v1.FilesystemTrimRequestAnnotation(job.Name)] = id
		// A merge patch of this one annotation: the Volume's other
		// writers are left alone.
		if err := r.Client.Patch(ctx, v, client.MergeFrom(before)); apierrors.IsNotFound(err) {
			continue // deleted since it was listed: nothing to trim
		} else if err != nil {
			return fmt.Errorf("request a trim of volume %s: %w", v.Name, err)
		}
		states[i].phase = trimPending
		pending++
	}
	return nil
}

// maxCauses is how many volumes' causes a run's message gives in full.
const maxCauses = 3

// trimRunResult counts the run's volumes by outcome and says in the
// message what is pending, what failed and why, and what was skipped
// and why.
func trimRunResult(job *v1.RecurringJob, run time.Time, states []trimState) *v1.RecurringJobRunResult {
	res := &v1.RecurringJobRunResult{ScheduledTime: metav1.NewTime(run), Volumes: int32(len(states))}
	var pending, waiting, detached []string
	var failed, skipped []string
	for _, st := range states {
		switch st.phase {
		case trimUnrequested:
			waiting = append(waiting, st.volume)
		case trimPending:
			pending = append(pending, fmt.Sprintf("%s on %s", st.volume, st.node))
		case trimDetached:
			res.Skipped++
			detached = append(detached, st.volume)
		case trimAnswered:
			switch st.result.Outcome {
			case v1.FilesystemTrimTrimmed:
				res.Succeeded++
				// Saturating: the byte counts come from annotations.
				res.TrimmedBytes += min(st.result.Bytes, math.MaxInt64-res.TrimmedBytes)
			case v1.FilesystemTrimSkipped:
				res.Skipped++
				skipped = append(skipped, cause(st))
			default:
				res.Failed++
				failed = append(failed, cause(st))
			}
		}
	}
	var parts []string
	if len(pending) > 0 {
		parts = append(parts, fmt.Sprintf("%d in progress, waiting for the CSI node plugin of their node (%s)", len(pending), short(pending)))
	}
	if len(waiting) > 0 {
		parts = append(parts, fmt.Sprintf("%d not started yet (at most %d at once)", len(waiting), max(job.Spec.Concurrency, 1)))
	}
	if len(failed) > 0 {
		parts = append(parts, fmt.Sprintf("%d failed (%s)", len(failed), causes(failed)))
	}
	if len(parts) == 0 {
		parts = append(parts, fmt.Sprintf("%d of %d volumes trimmed, %d bytes discarded", res.Succeeded, res.Volumes, res.TrimmedBytes))
	}
	if len(detached) > 0 {
		parts = append(parts, fmt.Sprintf("%d skipped: detached, no node has their filesystem mounted (%s)", len(detached), short(detached)))
	}
	if len(skipped) > 0 {
		parts = append(parts, fmt.Sprintf("%d skipped (%s)", len(skipped), causes(skipped)))
	}
	res.Message = v1.TruncateMessage(strings.Join(parts, "; "), maxMessage)
	return res
}

// cause is a volume's answer as the message names it.
func cause(st trimState) string {
	return fmt.Sprintf("%s on %s: %s", st.volume, st.result.Node, v1.TruncateMessage(st.result.Message, 160))
}

// causes lists the first maxCauses causes in full and counts the rest.
func causes(cs []string) string {
	if len(cs) > maxCauses {
		return strings.Join(cs[:maxCauses], "; ") + fmt.Sprintf("; and %d more", len(cs)-maxCauses)
	}
	return strings.Join(cs, "; ")
}

// maxMessage is RecurringJobRunResult.Message's bound in the CRD.
const maxMessage = 1024
