package volume

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// writeLog records the writes a client sends: every create, update,
// patch and delete of an object, and every status write that changes
// something (the status patch Reconcile ends with is sent empty when
// nothing changed).
type writeLog struct {
	mu     sync.Mutex
	writes []string
}

func (w *writeLog) add(format string, args ...any) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.writes = append(w.writes, fmt.Sprintf(format, args...))
}

func (w *writeLog) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := w.writes
	w.writes = nil
	return out
}

func kindOf(o client.Object) string { return fmt.Sprintf("%T %s", o, o.GetName()) }

// countingClient is a client over its own cache of the test API server
// (with the Volume reconciler's field index), recording its writes in w.
func countingClient(t *testing.T, g *WithT, w *writeLog) client.Client {
	t.Helper()
	kc, err := testEnv.KubeConfig()
	g.Expect(err).NotTo(HaveOccurred())
	cfg, err := clientcmd.RESTConfigFromKubeConfig(kc)
	g.Expect(err).NotTo(HaveOccurred())
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	c, err := cache.New(cfg, cache.Options{Scheme: k8sClient.Scheme()})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c.IndexField(ctx, &v1.Volume{}, IndexDataSourceVolume, func(o client.Object) []string {
		if ds := o.(*v1.Volume).Spec.DataSource; ds != nil {
			return []string{ds.Volume}
		}
		return nil
	})).To(Succeed())
	go func() { _ = c.Start(ctx) }()
	g.Expect(c.WaitForCacheSync(ctx)).To(BeTrue())
	direct, err := client.NewWithWatch(cfg, client.Options{Scheme: k8sClient.Scheme(), Cache: &client.CacheOptions{Reader: c}})
	g.Expect(err).NotTo(HaveOccurred())
	return interceptor.NewClient(direct, interceptor.Funcs{
		Create: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.CreateOption) error {
			w.add("create %s", kindOf(o))
			return c.Create(ctx, o, opts...)
		},
		Update: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.UpdateOption) error {
			w.add("update %s", kindOf(o))
			return c.Update(ctx, o, opts...)
		},
		Patch: func(ctx context.Context, c client.WithWatch, o client.Object, p client.Patch, opts ...client.PatchOption) error {
			data, _ := p.Data(o)
			w.add("patch %s: %s", kindOf(o), data)
			return c.Patch(ctx, o, p, opts...)
		},
		Delete: func(ctx context.Context, c client.WithWatch, o client.Object, opts ...client.DeleteOption) error {
			w.add("delete %s", kindOf(o))
			return c.Delete(ctx, o, opts...)
		},
		SubResourceUpdate: func(ctx context.Context, c client.Client, sub string, o client.Object, opts ...client.SubResourceUpdateOption) error {
			w.add("update %s of %s", sub, kindOf(o))
			return c.SubResource(sub).Update(ctx, o, opts...)
		},
		SubResourcePatch: func(ctx context.Context, c client.Client, sub string, o client.Object, p client.Patch, opts ...client.SubResourcePatchOption) error {
			if data, err := p.Data(o); err != nil || string(data) != "{}" {
				w.add("patch %s of %s: %s", sub, kindOf(o), data)
			}
			return c.SubResource(sub).Patch(ctx, o, p, opts...)
		},
	})
}

// TestSettledVolumeIsNotWritten: once an encrypted volume is attached and
// healthy, a reconcile writes nothing: no patch of its Engine (whose
// spec holds the encryption by pointer), Replicas or Volume, and no
// status change.
func TestSettledVolumeIsNotWritten(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "nw-a", "nw-b")
	pass := []byte("correct horse battery staple")
	key, err := volcrypt.DeriveKey(pass)
	g.Expect(err).NotTo(HaveOccurred())
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "nw-key", Namespace: "default"}, Data: map[string][]byte{v1.EncryptionPassphraseKey: pass}}
	g.Expect(k8sClient.Create(ctx, secret)).To(Succeed())
	t.Cleanup(func() { _ = k8sClient.Delete(ctx, secret) })
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "settled", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, NodeName: "nw-a",
		Encryption: &v1.VolumeEncryption{KeySecret: secret.Name, KeyCheck: volcrypt.KeyCheck(key)}}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	cleanupVolume(t, vol)
	k := client.ObjectKeyFromObject(vol)
	waitAttached(t, g, k)
	g.Eventually(func() int { return rwReplicas(g, vol) }, timeout, 100*time.Millisecond).Should(Equal(2))
	g.Eventually(func() v1.VolumeRobustness { return getVolume(g, k).Status.Robustness }, timeout, 100*time.Millisecond).
		Should(Equal(v1.VolumeRobustnessHealthy))
	g.Expect(getEngine(g, vol).Spec.Encryption).NotTo(BeNil())

	w := &writeLog{}
	r := &Reconciler{Client: countingClient(t, g, w), ReplenishmentWait: replenishmentWait}
	reconcileOnce := func() []string {
		_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: k})
		g.Expect(err).NotTo(HaveOccurred())
		return w.take()
	}
	// Until this reconciler's cache has caught up with the running
	// manager's last writes, a reconcile may still have one to make;
	// then none, however often it runs.
	g.Eventually(reconcileOnce, timeout, 200*time.Millisecond).Should(BeEmpty(), "a settled volume is written on every reconcile")
	for range 3 {
		g.Expect(reconcileOnce()).To(BeEmpty())
	}
}

// TestEqualEngineSpec: engine specs are compared by value: copies of the
// same encryption and clone source, and quantities spelled differently,
// are equal; any changed field is not.
func TestEqualEngineSpec(t *testing.T) {
	g := NewWithT(t)
	base := &v1.Engine{Spec: v1.EngineSpec{VolumeName: "v", NodeName: "n1", DesiredState: v1.DesiredInstanceStateRunning,
		Size: resource.MustParse("16Mi"), Frontend: v1.FrontendNBD,
		ReplicaAddresses: map[string]v1.ReplicaAddress{"r1": {Data: "10.0.0.1:1", Control: "10.0.0.1:2"}},
		Maintenance:      true, CloneFrom: &v1.EngineCloneSource{Replica: "src-r1", Address: "10.0.0.2:2", Snapshot: "s1"},
		Encryption: &v1.VolumeEncryption{KeySecret: "k", KeyCheck: "0123456789abcdef0123456789abcdef"}}}
	g.Expect(equalEngineSpec(base, base.DeepCopy())).To(BeTrue(), "a deep copy: other pointers, same values")
	sameSize := base.DeepCopy()
	sameSize.Spec.Size = resource.MustParse("16777216")
	g.Expect(equalEngineSpec(base, sameSize)).To(BeTrue(), "16Mi and 16777216 are one size")
	for name, change := range map[string]func(*v1.EngineSpec){
		"node": func(s *v1.EngineSpec) { s.NodeName = "n2" },
		"size": func(s *v1.EngineSpec) { s.Size = resource.MustParse("32Mi") },
		"address": func(s *v1.EngineSpec) {
			s.ReplicaAddresses["r1"] = v1.ReplicaAddress{Data: "10.0.0.9:1", Control: "10.0.0.1:2"}
		},
		"no clone":      func(s *v1.EngineSpec) { s.CloneFrom = nil },
		"clone replica": func(s *v1.EngineSpec) { s.CloneFrom.Replica = "src-r2" },
		"key check":     func(s *v1.EngineSpec) { s.Encryption.KeyCheck = "ffffffffffffffffffffffffffffffff" },
		"desired state": func(s *v1.EngineSpec) { s.DesiredState = v1.DesiredInstanceStateStopped },
	} {
		other := base.DeepCopy()
		change(&other.Spec)
		g.Expect(equalEngineSpec(base, other)).To(BeFalse(), name)
	}
}
