package csi

import (
	"context"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/scheduler"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestCreateVolumeSizeBoundaries: a claim above the largest volume is
// refused by the driver itself (OutOfRange), with nothing created; a claim
// of exactly the largest volume, more than any disk here holds, passes the
// driver and the Volume's schema (the size the driver writes, 64Ti, is
// judged by its value) and is refused only by the replica scheduler, the
// real cause (ResourceExhausted, "not enough space", with the manager's
// default over-provisioning of 100%).
func TestCreateVolumeSizeBoundaries(t *testing.T) {
	g := NewWithT(t)
	addNodes(t, "size-a")
	d := serveDriver(t, Options{Mode: ModeController})
	ctx := callCtx(t)
	create := func(name string, bytes int64) error {
		_, err := d.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: name,
			CapacityRange:      &csipb.CapacityRange{RequiredBytes: bytes},
			VolumeCapabilities: []*csipb.VolumeCapability{volCap("ext4", false)},
			Parameters:         map[string]string{ParamNumberOfReplicas: "1"}})
		t.Cleanup(func() {
			dctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(2*time.Minute))
			defer cancel()
			if _, err := d.controller.DeleteVolume(dctx, &csipb.DeleteVolumeRequest{VolumeId: name}); err != nil {
				t.Errorf("DeleteVolume %s: %v", name, err)
			}
		})
		return err
	}

	err := create("size-100ti", 100<<40)
	g.Expect(status.Code(err)).To(Equal(codes.OutOfRange), "%v", err)
	g.Expect(apierrors.IsNotFound(cluster.Client.Get(ctx, client.ObjectKey{Namespace: testNamespace, Name: "size-100ti"}, &v1.Volume{}))).
		To(BeTrue(), "a refused claim left a Volume")

	err = create("size-largest", v1.MaxVolumeSize)
	g.Expect(status.Code(err)).To(Equal(codes.ResourceExhausted), "%v", err)
	g.Expect(status.Convert(err).Message()).To(ContainSubstring(string(scheduler.RejectNoSpace)))
	vol := &v1.Volume{}
	g.Expect(cluster.Client.Get(ctx, client.ObjectKey{Namespace: testNamespace, Name: "size-largest"}, vol)).To(Succeed())
	g.Expect(vol.Spec.Size.Value()).To(Equal(int64(v1.MaxVolumeSize)))
	c := meta.FindStatusCondition(vol.Status.Conditions, v1.VolumeConditionScheduled)
	g.Expect(c).NotTo(BeNil())
	g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
	g.Expect(c.Reason).To(Equal(v1.VolumeReasonReplicaSchedulingFailed))
}
