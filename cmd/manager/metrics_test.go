package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/cairn-io/cairn/controllers/certs"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestManagerMetricsCertificate runs the cairn-manager binary against a
// real API server (envtest) with its defaults for the metrics port (HTTPS,
// the CA on) and scrapes it as the ServiceMonitor in config/monitoring
// does: the CA bundle from the ConfigMap the manager publishes, the
// Service's DNS name as the server name. The handshake verifies, and the
// port still refuses a scrape without a token.
func TestManagerMetricsCertificate(t *testing.T) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Fatal("KUBEBUILDER_ASSETS is not set, so envtest cannot find kube-apiserver and etcd: run `make test`, or export KUBEBUILDER_ASSETS=$(hack/envtest.sh)")
	}
	g := NewWithT(t)
	env := &envtest.Environment{CRDDirectoryPaths: []string{filepath.Join("..", "..", "config", "crd", "bases")}, ErrorIfCRDPathMissing: true}
	cfg, err := env.Start()
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = env.Stop() })
	admin, err := env.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}}, nil)
	g.Expect(err).NotTo(HaveOccurred())
	kubeconfig, err := admin.KubeConfig()
	g.Expect(err).NotTo(HaveOccurred())
	dir := t.TempDir()
	kcPath := filepath.Join(dir, "kubeconfig")
	g.Expect(os.WriteFile(kcPath, kubeconfig, 0o600)).To(Succeed())
	c, err := client.New(cfg, client.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	ctx := context.Background()
	const ns = "cairn-metrics"
	g.Expect(c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})).To(Succeed())

	bin := filepath.Join(dir, "cairn-manager")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "build cairn-manager: %s", out)
	addr := freeAddr(t)
	logs, err := os.Create(filepath.Join(dir, "manager.log"))
	g.Expect(err).NotTo(HaveOccurred())
	cmd := exec.Command(bin, "--kubeconfig", kcPath, "--namespace", ns, "--discover-instance-managers=false",
		"--metrics-bind-address", addr, "--health-probe-bind-address", "0", "--ui-bind-address", "0")
	cmd.Stdout, cmd.Stderr = logs, logs
	g.Expect(cmd.Start()).To(Succeed())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait() // killed: it exits with the signal
		if t.Failed() {
			if b, err := os.ReadFile(logs.Name()); err == nil {
				t.Logf("manager log:\n%s", b)
			}
		}
	})

	// The bundle, as the Prometheus Operator reads it.
	cm := &corev1.ConfigMap{}
	g.Eventually(func() error {
		return c.Get(ctx, types.NamespacedName{Namespace: ns, Name: certs.DefaultBundleConfigMap}, cm)
	}, deadline.Scale(60*time.Second), 100*time.Millisecond).Should(Succeed(), "the manager publishes the CA bundle")
	roots := x509.NewCertPool()
	g.Expect(roots.AppendCertsFromPEM([]byte(cm.Data[certs.KeyCACert]))).To(BeTrue())
	serverName := certs.DefaultMetricsService + "." + ns + ".svc"
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: serverName, MinVersion: tls.VersionTLS12}}
	t.Cleanup(tr.CloseIdleConnections)
	scrape := func() (int, error) {
		rctx, cancel := context.WithTimeout(ctx, deadline.Scale(10*time.Second))
		defer cancel()
		req, err := http.NewRequestWithContext(rctx, http.MethodGet, "https://"+addr+"/metrics", nil)
		if err != nil {
			return 0, err
		}
		resp, err := (&http.Client{Transport: tr}).Do(req)
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, nil
	}
	g.Eventually(scrape, deadline.Scale(60*time.Second), 200*time.Millisecond).Should(Equal(http.StatusUnauthorized),
		"the certificate verifies for %s, and a scrape without a token is refused", serverName)

	// Another server name is refused by the client: the certificate is
	// only for the Service's names.
	other := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: "cairn-manager-metrics.elsewhere.svc", MinVersion: tls.VersionTLS12}}
	defer other.CloseIdleConnections()
	_, err = (&http.Client{Transport: other}).Get("https://" + addr + "/metrics")
	var badName x509.HostnameError
	g.Expect(errors.As(err, &badName)).To(BeTrue(), "%v", err)
}

// freeAddr is a loopback address with a port free at the time of the
// call.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
