package backup

import (
	"context"
	"fmt"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/snapshot"
)

// TestManagerRunsBackups runs the Backup and Snapshot reconcilers in a
// manager, as cairn-manager does (SetupWithManager: the upload runner,
// the field indexes, the watches and the wake-up when an upload ends):
// a Backup created completes with nothing else driving it, and deleting
// it removes it from the target.
func TestManagerRunsBackups(t *testing.T) {
	r := newRig(t, "vol-managed")
	managed = func(mgr ctrl.Manager) error {
		if err := (&snapshot.Reconciler{Client: mgr.GetClient()}).SetupWithManager(mgr); err != nil {
			return err
		}
		return (&Reconciler{ProgressInterval: 100 * time.Millisecond, RetryBackoff: time.Second}).SetupWithManager(mgr)
	}
	restart := func() {
		env.StopManager()
		r.g.Expect(env.StartManager()).To(Succeed())
	}
	restart()
	t.Cleanup(func() { managed = nil; restart() })

	r.write(0, 2*mib)
	r.backup("mb", r.target)
	r.g.Eventually(func() v1.BackupState { return r.get("mb").Status.State }, timeout, 50*time.Millisecond).
		Should(Equal(v1.BackupStateCompleted), func() string {
			s := &v1.Snapshot{}
			_ = k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "mb"}, s)
			return fmt.Sprintf("%s; snapshot: %+v %+v", r.get("mb").Status.Message, s.Finalizers, s.Status)
		})
	r.g.Expect(r.get("mb").Status.BytesTotal).To(Equal(int64(2 * mib)))
	r.g.Expect(r.listed()).To(Equal([]string{"mb"}))

	r.g.Expect(k8sClient.Delete(context.Background(), r.get("mb"))).To(Succeed())
	r.g.Eventually(func() bool {
		return apierrors.IsNotFound(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "mb"}, &v1.Backup{}))
	}, timeout, 50*time.Millisecond).Should(BeTrue())
	r.g.Expect(r.listed()).To(BeEmpty())
}
