package main

import (
	"context"
	"fmt"
	"sort"
	"text/tabwriter"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/display"
)

// backupView is one Backup as `backups` shows it.
type backupView struct {
	Name       string         `json:"name"`
	Volume     string         `json:"volume"`
	Target     string         `json:"target"`
	State      v1.BackupState `json:"state,omitempty"`
	Progress   int32          `json:"progress"`
	BytesDone  int64          `json:"bytesDone"`
	BytesTotal int64          `json:"bytesTotal"`
	Uploaded   int64          `json:"uploadedBytes"`
	Parent     string         `json:"parent,omitempty"`
	Completed  string         `json:"completed,omitempty"`
	Reason     string         `json:"reason,omitempty"`
	Message    string         `json:"message,omitempty"`
}

// backups lists the Backups (of volume vol, or all), oldest first per
// volume, with progress and, for one not completed, why.
func (o *options) backups(ctx context.Context, vol string) error {
	var bl v1.BackupList
	if err := o.c.List(ctx, &bl, client.InNamespace(o.namespace)); err != nil {
		return fmt.Errorf("list backups in %s: %w", o.namespace, err)
	}
	sort.Slice(bl.Items, func(i, j int) bool {
		a, b := bl.Items[i], bl.Items[j]
		if a.Spec.Volume != b.Spec.Volume {
			return a.Spec.Volume < b.Spec.Volume
		}
		return a.CreationTimestamp.Before(&b.CreationTimestamp) || (a.CreationTimestamp.Equal(&b.CreationTimestamp) && a.Name < b.Name)
	})
	var views []backupView
	for _, b := range bl.Items {
		if vol != "" && b.Spec.Volume != vol {
			continue
		}
		views = append(views, viewBackup(&b))
	}
	if done, err := o.emit(views); done {
		return err
	}
	if len(views) == 0 {
		fmt.Fprintf(o.out, "No backups in %s.\n", o.namespace)
		return nil
	}
	tw := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tVOLUME\tTARGET\tSTATE\tPROGRESS\tUPLOADED\tPARENT\tCOMPLETED\tMESSAGE")
	for _, b := range views {
		progress := fmt.Sprintf("%d%% (%s / %s)", b.Progress, display.Bytes(b.BytesDone), display.Bytes(b.BytesTotal))
		uploaded := "-"
		if b.State == v1.BackupStateCompleted {
			uploaded = display.Bytes(b.Uploaded)
		}
		msg := ""
		if b.Reason != "" {
			msg = b.Reason + ": " + b.Message
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", b.Name, b.Volume, b.Target, orDash(string(b.State)), progress, uploaded,
			orDash(b.Parent), orDash(b.Completed), msg)
	}
	return tw.Flush()
}

func viewBackup(b *v1.Backup) backupView {
	v := backupView{Name: b.Name, Volume: b.Spec.Volume, Target: b.Spec.Target, State: b.Status.State, Progress: b.Status.Progress,
		BytesDone: b.Status.BytesDone, BytesTotal: b.Status.BytesTotal, Uploaded: b.Status.UploadedBytes, Parent: b.Status.Parent}
	if b.Status.CompletionTime != nil {
		v.Completed = b.Status.CompletionTime.UTC().Format(time.RFC3339)
	}
	if c := meta.FindStatusCondition(b.Status.Conditions, v1.BackupConditionCompleted); c != nil && c.Status != metav1.ConditionTrue {
		v.Reason, v.Message = c.Reason, c.Message
	}
	return v
}
