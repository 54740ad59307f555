package certs

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// The manager's metrics port serves a certificate of Cairn's CA, so that
// Prometheus verifies it instead of skipping verification: the
// certificate names the metrics Service's DNS names, and the trust bundle
// (the same one the instance managers' Secret carries) is published in a
// ConfigMap that a ServiceMonitor's tlsConfig.ca references
// (config/monitoring). The bundle holds no key, hence a ConfigMap: the
// Prometheus Operator needs no access to Cairn's Secrets.
const (
	// DefaultMetricsService is the Service in front of the manager's
	// metrics port (config/monitoring/service.yaml).
	DefaultMetricsService = "cairn-manager-metrics"
	// DefaultBundleConfigMap holds the trust bundle under KeyCACert.
	DefaultBundleConfigMap = "cairn-ca-bundle"
)

// MetricsDNSNames are the names the metrics certificate is issued for: the
// Service's DNS names in namespace, short to fully qualified.
// "<service>.<namespace>.svc" is the one the shipped ServiceMonitor
// checks (its tlsConfig.serverName).
func MetricsDNSNames(service, namespace string) []string {
	return []string{
		service,
		service + "." + namespace,
		service + "." + namespace + ".svc",
		service + "." + namespace + ".svc.cluster.local",
	}
}

// MetricsCertificate is the metrics port's serving certificate, for a
// tls.Config's GetCertificate: each handshake gets the certificate
// current then, so a renewal needs no restart.
func (a *Authority) MetricsCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.metrics == nil {
		// lastErr is why the last Sync failed, shown for context: it is not
		// this error's cause, and may be nil.
		return nil, fmt.Errorf("the manager has no metrics certificate yet (CA Secret %s/%s): %v", a.opts.Namespace, a.opts.CASecret, a.lastErr) //nolint:errorlint // see above
	}
	return a.metrics, nil
}

// syncMetrics keeps the metrics certificate and publishes the trust
// bundle. The certificate is issued again, under the current CA, only
// when it no longer verifies against the bundle for its names or a third
// of its validity is left; so after a CA rotation the one in use (of the
// previous CA, still in the bundle) is served until it is due, by which
// time Prometheus has long had the new bundle.
func (a *Authority) syncMetrics(ctx context.Context, cur *ca, roots *x509.CertPool, bundle []byte, now time.Time) error {
	names := MetricsDNSNames(a.opts.MetricsService, a.opts.Namespace)
	a.mu.Lock()
	have := a.metrics
	a.mu.Unlock()
	if why := metricsNeedsRenewal(have, roots, names, now, a.opts.Validity); why != "" {
		certPEM, keyPEM, err := cur.issueServer(names, now, a.opts.Validity)
		if err != nil {
			return fmt.Errorf("issue the metrics certificate: %w", err)
		}
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return err
		}
		a.mu.Lock()
		a.metrics = &pair
		a.mu.Unlock()
		a.opts.Logger.Info("metrics certificate issued", "names", names, "notAfter", pair.Leaf.NotAfter, "reason", why)
	}
	return a.ensureBundle(ctx, bundle)
}

// metricsNeedsRenewal says why c must be issued again, "" when it need
// not be.
func metricsNeedsRenewal(c *tls.Certificate, roots *x509.CertPool, names []string, now time.Time, validity time.Duration) string {
	if c == nil {
		return "missing"
	}
	for _, n := range names {
		if _, err := c.Leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: n, CurrentTime: now,
			KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			return "not trusted for " + n + ": " + err.Error()
		}
	}
	if left := c.Leaf.NotAfter.Sub(now); left < validity/3 {
		return fmt.Sprintf("expires in %s", left.Round(time.Second))
	}
	return ""
}

// ensureBundle writes the trust bundle into the bundle ConfigMap when it
// differs. Two managers writing at once: the loser's Create or Update
// fails this sync and the next one finds the bundle in place.
func (a *Authority) ensureBundle(ctx context.Context, bundle []byte) error {
	key := types.NamespacedName{Namespace: a.opts.Namespace, Name: a.opts.BundleConfigMap}
	cm := &corev1.ConfigMap{}
	err := a.opts.Reader.Get(ctx, key, cm)
	if apierrors.IsNotFound(err) {
		cm = &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: key.Name, Namespace: key.Namespace,
				Labels: map[string]string{"app.kubernetes.io/name": "cairn", "app.kubernetes.io/component": "ca"}},
			Data: map[string]string{KeyCACert: string(bundle)},
		}
		if err := a.opts.Writer.Create(ctx, cm); err != nil {
			return fmt.Errorf("create ConfigMap %s: %w", key, err)
		}
		a.opts.Logger.Info("trust bundle published", "configMap", key)
		return nil
	}
	if err != nil {
		return fmt.Errorf("get ConfigMap %s: %w", key, err)
	}
	if cm.Data[KeyCACert] == string(bundle) {
		return nil
	}
	if cm.Data == nil {
		cm.Data = map[string]string{}
	}
	cm.Data[KeyCACert] = string(bundle)
	if err := a.opts.Writer.Update(ctx, cm); err != nil {
		return fmt.Errorf("update ConfigMap %s: %w", key, err)
	}
	a.opts.Logger.Info("trust bundle published", "configMap", key)
	return nil
}
