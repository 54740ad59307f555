package certs

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// serviceMonitorTLS is what Prometheus is told about the manager's metrics
// port by config/monitoring: the namespace everything is installed in, the
// Service's name, and the ServiceMonitor endpoint's scheme and tlsConfig.
type serviceMonitorTLS struct {
	namespace, service string
	scheme             string
	insecure           bool
	caConfigMap, caKey string
	serverName         string
}

func readMonitoring(t *testing.T) serviceMonitorTLS {
	t.Helper()
	dir := filepath.Join("..", "..", "config", "monitoring")
	read := func(name string, into any) {
		raw, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		// Not strict: the structs below read only what the test needs.
		if err := yaml.Unmarshal(raw, into); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	var k struct {
		Namespace string `json:"namespace"`
	}
	read("kustomization.yaml", &k)
	var svc corev1.Service
	read("service.yaml", &svc)
	var sm struct {
		Spec struct {
			Endpoints []struct {
				Port      string `json:"port"`
				Scheme    string `json:"scheme"`
				TLSConfig struct {
					InsecureSkipVerify bool `json:"insecureSkipVerify"`
					CA                 struct {
						ConfigMap *corev1.ConfigMapKeySelector `json:"configMap"`
					} `json:"ca"`
					ServerName string `json:"serverName"`
				} `json:"tlsConfig"`
			} `json:"endpoints"`
		} `json:"spec"`
	}
	read("servicemonitor.yaml", &sm)
	if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].TLSConfig.CA.ConfigMap == nil {
		t.Fatalf("servicemonitor.yaml: want one endpoint whose tlsConfig.ca names a configMap, got %+v", sm.Spec.Endpoints)
	}
	ep := sm.Spec.Endpoints[0]
	return serviceMonitorTLS{namespace: k.Namespace, service: svc.Name, scheme: ep.Scheme,
		insecure: ep.TLSConfig.InsecureSkipVerify, caConfigMap: ep.TLSConfig.CA.ConfigMap.Name,
		caKey: ep.TLSConfig.CA.ConfigMap.Key, serverName: ep.TLSConfig.ServerName}
}

// serveMetrics serves HTTPS on loopback the way the manager's metrics port
// does (cmd/manager: the certificate from a.MetricsCertificate at each
// handshake) until t ends, and returns its address.
func serveMetrics(t *testing.T, a *Authority) string {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{GetCertificate: a.MetricsCertificate,
		NextProtos: []string{"http/1.1"}, MinVersion: tls.VersionTLS12})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "cairn_up 1\n")
	}), ReadHeaderTimeout: deadline.Scale(10 * time.Second), ErrorLog: log.New(io.Discard, "", 0)}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = srv.Serve(ln) }() // ErrServerClosed at Close
	t.Cleanup(func() { srv.Close(); wg.Wait() })
	return ln.Addr().String()
}

// scrape connects to addr as Prometheus does with the ServiceMonitor's
// tlsConfig (the CA bundle from the ConfigMap it names, its serverName) at
// the time now, fetches /metrics, and returns the certificate served.
func scrape(addr string, roots *x509.CertPool, serverName string, now time.Time) (*x509.Certificate, error) {
	ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(10*time.Second))
	defer cancel()
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: serverName,
		Time: func() time.Time { return now }, MinVersion: tls.VersionTLS12}}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if _, err := io.ReadAll(resp.Body); err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, errors.New(resp.Status)
	}
	return resp.TLS.PeerCertificates[0], nil
}

// TestMetricsCertificateForTheServiceMonitor: with config/monitoring as
// shipped (no insecureSkipVerify), Prometheus verifies the manager's
// metrics certificate: the manager publishes Cairn's CA bundle in the
// ConfigMap the ServiceMonitor's tlsConfig.ca names, and serves a
// certificate of that CA for the serverName it sets, which is the
// Service's DNS name in the namespace config/monitoring installs into. A
// client with another name or without the bundle is refused. Through a CA
// rotation the bundle is published before any certificate of the new CA
// is served, and the certificate in use keeps verifying at every step.
func TestMetricsCertificateForTheServiceMonitor(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	sm := readMonitoring(t)
	g.Expect(sm.insecure).To(BeFalse(), "the ServiceMonitor skips verification")
	g.Expect(sm.scheme).To(Equal("https"))
	g.Expect(sm.caConfigMap).To(Equal(DefaultBundleConfigMap))
	g.Expect(sm.caKey).To(Equal(KeyCACert))
	g.Expect(sm.service).To(Equal(DefaultMetricsService))
	g.Expect(sm.serverName).To(Equal(sm.service+"."+sm.namespace+".svc"), "the serverName is the Service's DNS name")

	// The manager runs in the namespace config/monitoring installs into.
	err := k8sClient.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: sm.namespace}})
	g.Expect(err == nil || apierrors.IsAlreadyExists(err)).To(BeTrue(), "%v", err)
	now := time.Now()
	clock := func() time.Time { return now }
	a := New(Options{Namespace: sm.namespace, Reader: k8sClient, Writer: k8sClient, Validity: 3 * time.Hour, Now: clock})
	addr := serveMetrics(t, a)
	_, err = scrape(addr, x509.NewCertPool(), sm.serverName, now)
	g.Expect(err).To(HaveOccurred(), "no certificate before the first sync")
	g.Expect(a.Sync(ctx)).To(Succeed())

	// Prometheus's view: the bundle from the ConfigMap the ServiceMonitor
	// names, in the ServiceMonitor's namespace.
	bundle := func() *x509.CertPool {
		cm := &corev1.ConfigMap{}
		g.Expect(k8sClient.Get(ctx, types.NamespacedName{Namespace: sm.namespace, Name: sm.caConfigMap}, cm)).To(Succeed())
		pool := x509.NewCertPool()
		g.Expect(pool.AppendCertsFromPEM([]byte(cm.Data[sm.caKey]))).To(BeTrue(), "the ConfigMap holds the bundle under %s", sm.caKey)
		return pool
	}
	caOf := func() (cur, prev *x509.Certificate) {
		s := secret(t, sm.namespace, DefaultCASecret)
		c, err := parseCA(s.Data[KeyCACert], s.Data[KeyCAKey])
		g.Expect(err).NotTo(HaveOccurred())
		if p, err := parseCA(s.Data[KeyPreviousCert], s.Data[KeyPreviousKey]); err == nil {
			return c.cert, p.cert
		}
		return c.cert, nil
	}
	ca1, _ := caOf()
	served, err := scrape(addr, bundle(), sm.serverName, now)
	g.Expect(err).NotTo(HaveOccurred(), "Prometheus verifies the metrics certificate")
	g.Expect(served.Issuer.CommonName).To(Equal(ca1.Subject.CommonName))
	_, err = served.Verify(x509.VerifyOptions{Roots: bundle(), DNSName: sm.serverName, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(served.DNSNames).To(ConsistOf(MetricsDNSNames(sm.service, sm.namespace)))
	g.Expect(served.ExtKeyUsage).To(Equal([]x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}), "a serving certificate only")

	// Refused: another name, and a client without Cairn's CA.
	_, err = scrape(addr, bundle(), sm.service+".elsewhere.svc", now)
	var badName x509.HostnameError
	g.Expect(errors.As(err, &badName)).To(BeTrue(), "another name: %v", err)
	_, err = scrape(addr, x509.NewCertPool(), sm.serverName, now)
	var unknownCA x509.UnknownAuthorityError
	g.Expect(errors.As(err, &unknownCA)).To(BeTrue(), "without the bundle: %v", err)

	// A second sync changes nothing: the same certificate, the same
	// ConfigMap.
	cm := &corev1.ConfigMap{}
	g.Expect(k8sClient.Get(ctx, types.NamespacedName{Namespace: sm.namespace, Name: sm.caConfigMap}, cm)).To(Succeed())
	g.Expect(a.Sync(ctx)).To(Succeed())
	again, err := scrape(addr, bundle(), sm.serverName, now)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(again.Equal(served)).To(BeTrue())
	rv := cm.ResourceVersion
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(cm), cm)).To(Succeed())
	g.Expect(cm.ResourceVersion).To(Equal(rv))

	// Rotation: the bundle trusts both CAs at once, and the certificate
	// in use (of the old CA) is still served and verified.
	caSecret := secret(t, sm.namespace, DefaultCASecret)
	patch := client.MergeFrom(caSecret.DeepCopy())
	caSecret.Annotations = map[string]string{AnnotationRotate: "metrics"}
	g.Expect(k8sClient.Patch(ctx, caSecret, patch)).To(Succeed())
	g.Expect(a.Sync(ctx)).To(Succeed())
	ca2, prev := caOf()
	g.Expect(prev.Equal(ca1)).To(BeTrue())
	served, err = scrape(addr, bundle(), sm.serverName, now)
	g.Expect(err).NotTo(HaveOccurred(), "the old CA's certificate verifies against the published bundle")
	g.Expect(served.Issuer.CommonName).To(Equal(ca1.Subject.CommonName))

	// When a third of its validity is left it is issued again, under the
	// new CA, which the bundle already holds.
	now = now.Add(2*time.Hour + 10*time.Minute)
	g.Expect(a.Sync(ctx)).To(Succeed())
	served, err = scrape(addr, bundle(), sm.serverName, now)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(served.Issuer.CommonName).To(Equal(ca2.Subject.CommonName))

	// The old CA leaves the bundle; the certificate served still verifies.
	caSecret = secret(t, sm.namespace, DefaultCASecret)
	patch = client.MergeFrom(caSecret.DeepCopy())
	caSecret.Annotations[annotationPreviousUntil] = now.Add(-time.Minute).UTC().Format(time.RFC3339)
	g.Expect(k8sClient.Patch(ctx, caSecret, patch)).To(Succeed())
	g.Expect(a.Sync(ctx)).To(Succeed())
	_, prev = caOf()
	g.Expect(prev).To(BeNil())
	onlyNew := bundle()
	g.Expect(onlyNew.Equal(func() *x509.CertPool { p := x509.NewCertPool(); p.AddCert(ca2); return p }())).To(BeTrue(), "the bundle is the new CA alone")
	_, err = scrape(addr, onlyNew, sm.serverName, now)
	g.Expect(err).NotTo(HaveOccurred())
}

// TestMetricsNeedsRenewal: the metrics certificate's renewal rule, as a
// table.
func TestMetricsNeedsRenewal(t *testing.T) {
	now := time.Now()
	cur, err := newCA(now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	other, err := newCA(now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	names := MetricsDNSNames("m", "ns")
	leaf := func(c *ca, names []string) *tls.Certificate {
		certPEM, keyPEM, err := c.issueServer(names, now, 3*time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		return &pair
	}
	roots := x509.NewCertPool()
	roots.AddCert(cur.cert)
	for _, tc := range []struct {
		name  string
		c     *tls.Certificate
		at    time.Time
		renew bool
	}{
		{"none", nil, now, true},
		{"fresh", leaf(cur, names), now, false},
		{"two thirds used", leaf(cur, names), now.Add(2*time.Hour + time.Minute), true},
		{"another CA's", leaf(other, names), now, true},
		{"missing a name", leaf(cur, names[:3]), now, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			why := metricsNeedsRenewal(tc.c, roots, names, tc.at, 3*time.Hour)
			if (why != "") != tc.renew {
				t.Fatalf("renew %v (%q), want %v", why != "", why, tc.renew)
			}
		})
	}
}
