// Package certs is Cairn's certificate authority for the instance
// managers' gRPC port. The manager keeps a CA in a Secret (made on first
// start), issues the instance managers' serving certificate into a second
// Secret that their DaemonSet mounts, and issues its own client
// certificate in memory; it renews each before a third of its validity is
// left. The instance manager accepts only client certificates of this CA
// (it rereads the mounted files when kubelet updates them, so nothing
// restarts); the manager accepts only serving certificates of this CA for
// the name ServerName.
//
// Rotating the CA: annotate the CA Secret with AnnotationRotate set to a
// new value. The manager makes a new CA and keeps the old one beside it for
// one leaf validity: the bundle trusts both, the serving certificate is
// issued again under the new CA, and the manager holds a client
// certificate of each, presenting whichever the instance manager names as
// acceptable, so that one which has not yet seen the new files keeps
// working. Then the old CA is dropped.
//
// The same CA issues the manager's metrics certificate and publishes its
// trust bundle for Prometheus (metrics.go).
package certs

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

const (
	// ServerName is the DNS name in the instance managers' serving
	// certificate; the manager checks it on every connection.
	ServerName = "cairn-instance-manager"
	// ClientName is the CommonName of the manager's client certificate.
	ClientName = "cairn-manager"

	// Keys of the CA Secret.
	KeyCACert       = "ca.crt"
	KeyCAKey        = "ca.key"
	KeyPreviousCert = "previous-ca.crt"
	KeyPreviousKey  = "previous-ca.key"
	// Keys of the serving Secret: ca.crt (the trust bundle: the current
	// CA and, during a rotation, the previous one), tls.crt and tls.key.
	KeyTLSCert = corev1.TLSCertKey
	KeyTLSKey  = corev1.TLSPrivateKeyKey

	// AnnotationRotate on the CA Secret asks for a new CA whenever its
	// value changes (any value, e.g. a date).
	AnnotationRotate = "storage.cairn.io/rotate-ca"
	// annotationRotated records the AnnotationRotate value last acted on.
	annotationRotated = "storage.cairn.io/rotated-ca"
	// annotationPreviousUntil is when the previous CA leaves the bundle.
	annotationPreviousUntil = "storage.cairn.io/previous-ca-until"

	DefaultCASecret      = "cairn-ca"
	DefaultServingSecret = "cairn-instance-manager-tls"
	DefaultValidity      = 7 * 24 * time.Hour
	DefaultCAValidity    = 10 * 365 * 24 * time.Hour
)

// Options configure an Authority.
type Options struct {
	// Namespace holds both Secrets.
	Namespace string
	// CASecret and ServingSecret name them (defaults DefaultCASecret and
	// DefaultServingSecret).
	CASecret, ServingSecret string
	// Validity of the leaf certificates (default DefaultValidity) and of
	// a new CA (default DefaultCAValidity).
	Validity, CAValidity time.Duration
	// Interval between checks (default Validity/24, at most an hour).
	Interval time.Duration
	// Reader reads the Secrets directly from the API server (the
	// manager's APIReader: no cache, so no watch on every Secret of the
	// cluster); Writer creates and updates them.
	Reader client.Reader
	Writer client.Writer
	Logger logr.Logger
	// Now is the clock (tests); default time.Now.
	Now func() time.Time
	// MetricsService names the Service the metrics certificate is for
	// (default DefaultMetricsService); BundleConfigMap the ConfigMap the
	// trust bundle is published in (default DefaultBundleConfigMap).
	MetricsService, BundleConfigMap string
}

// Authority keeps the Secrets current and holds the manager's client
// credentials. It runs in every manager replica (a standby needs its
// client certificate as soon as it leads); concurrent writers are ordered
// by the API server's resourceVersion and AlreadyExists checks.
type Authority struct {
	opts Options

	mu    sync.Mutex
	roots *x509.CertPool // the trust bundle, for the servers' certificates
	// clients are the manager's client certificates, one per trusted CA,
	// the current CA's first: during a rotation an instance manager that
	// has not yet seen the new bundle still gets one it accepts.
	clients []*tls.Certificate
	master  MasterKey        // volume keys are derived from it
	metrics *tls.Certificate // the metrics port's (metrics.go)
	synced  chan struct{}    // closed after the first successful Sync
	lastErr error
}

// New returns an Authority; Start (or Sync) fills it.
func New(opts Options) *Authority {
	if opts.CASecret == "" {
		opts.CASecret = DefaultCASecret
	}
	if opts.ServingSecret == "" {
		opts.ServingSecret = DefaultServingSecret
	}
	if opts.Validity <= 0 {
		opts.Validity = DefaultValidity
	}
	if opts.CAValidity <= 0 {
		opts.CAValidity = DefaultCAValidity
	}
	if opts.Interval <= 0 {
		opts.Interval = min(opts.Validity/24, time.Hour)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.MetricsService == "" {
		opts.MetricsService = DefaultMetricsService
	}
	if opts.BundleConfigMap == "" {
		opts.BundleConfigMap = DefaultBundleConfigMap
	}
	return &Authority{opts: opts, synced: make(chan struct{})}
}

// NeedLeaderElection: every replica keeps its own client certificate.
func (a *Authority) NeedLeaderElection() bool { return false }

// Start syncs at once, then every Interval, and after an error every few
// seconds, until ctx ends.
func (a *Authority) Start(ctx context.Context) error {
	for {
		wait := a.opts.Interval
		if err := a.Sync(ctx); err != nil {
			a.opts.Logger.Error(err, "certificates not synced; retrying", "namespace", a.opts.Namespace)
			wait = 5 * time.Second
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// Ready reports whether the manager has its client credentials (a
// healthz checker: the manager is not ready before it can talk to
// instance managers).
func (a *Authority) Ready(*http.Request) error {
	select {
	case <-a.synced:
		return nil
	default:
		a.mu.Lock()
		defer a.mu.Unlock()
		if a.lastErr != nil {
			return fmt.Errorf("no client certificate yet: %w", a.lastErr)
		}
		return errors.New("no client certificate yet")
	}
}

// Sync makes the CA if there is none, rotates it when asked, renews the
// serving Secret and the client certificate when due.
func (a *Authority) Sync(ctx context.Context) error {
	err := a.sync(ctx)
	a.mu.Lock()
	a.lastErr = err
	a.mu.Unlock()
	return err
}

func (a *Authority) sync(ctx context.Context) error {
	now := a.opts.Now()
	caSecret, err := a.ensureCA(ctx, now)
	if err != nil {
		return err
	}
	cur, err := a.parseCA(caSecret)
	if err != nil {
		return err
	}
	cas := []*ca{cur}
	if prev, err := parseCA(caSecret.Data[KeyPreviousCert], caSecret.Data[KeyPreviousKey]); err == nil {
		cas = append(cas, prev)
	}
	bundle := bytes.Clone(cur.certPEM)
	for _, c := range cas[1:] {
		bundle = append(bundle, c.certPEM...)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(bundle) {
		return fmt.Errorf("the Secret %s/%s: no certificate in the trust bundle", a.opts.Namespace, a.opts.CASecret)
	}

	if err := a.ensureServing(ctx, cur, bundle, now); err != nil {
		return err
	}
	// The metrics port's certificate and bundle serve Prometheus only:
	// their failure is logged, and never holds up the certificates the
	// instance managers need.
	if err := a.syncMetrics(ctx, cur, roots, bundle, now); err != nil {
		a.opts.Logger.Error(err, "metrics certificate or trust bundle not synced; retrying at the next sync")
	}

	// The client certificates live only in memory: one per trusted CA,
	// kept until a third of its validity is left.
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roots = roots
	a.master = MasterKey(bytes.Clone(caSecret.Data[KeyVolumeMaster]))
	var clients []*tls.Certificate
	for _, c := range cas {
		var have *tls.Certificate
		for _, cl := range a.clients {
			if cl.Leaf.CheckSignatureFrom(c.cert) == nil && cl.Leaf.NotAfter.Sub(now) >= a.opts.Validity/3 {
				have = cl
			}
		}
		if have == nil {
			certPEM, keyPEM, err := c.issue(ClientName, clientAuth, now, a.opts.Validity)
			if err != nil {
				return fmt.Errorf("issue the manager's client certificate: %w", err)
			}
			pair, err := tls.X509KeyPair(certPEM, keyPEM)
			if err != nil {
				return err
			}
			have = &pair
			a.opts.Logger.Info("client certificate issued", "ca", c.cert.Subject.CommonName, "notAfter", pair.Leaf.NotAfter)
		}
		clients = append(clients, have)
	}
	a.clients = clients
	select {
	case <-a.synced:
	default:
		close(a.synced)
	}
	return nil
}

func (a *Authority) parseCA(s *corev1.Secret) (*ca, error) {
	c, err := parseCA(s.Data[KeyCACert], s.Data[KeyCAKey])
	if err != nil {
		return nil, fmt.Errorf("the Secret %s/%s: %s and %s do not hold a usable CA (%w); "+
			"delete the Secret to have the manager make a new CA", a.opts.Namespace, a.opts.CASecret, KeyCACert, KeyCAKey, err)
	}
	return c, nil
}

func newMaster() []byte {
	b := make([]byte, masterKeySize)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return b
}

// ensureCA returns the CA Secret, creating it, rotating its CA or
// dropping an expired previous CA as needed.
func (a *Authority) ensureCA(ctx context.Context, now time.Time) (*corev1.Secret, error) {
	key := types.NamespacedName{Namespace: a.opts.Namespace, Name: a.opts.CASecret}
	s := &corev1.Secret{}
	err := a.opts.Reader.Get(ctx, key, s)
	if apierrors.IsNotFound(err) {
		c, err := newCA(now, a.opts.CAValidity)
		if err != nil {
			return nil, err
		}
		s = &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: key.Name, Namespace: key.Namespace,
				Labels: map[string]string{"app.kubernetes.io/name": "cairn", "app.kubernetes.io/component": "ca"}},
			Type: corev1.SecretTypeOpaque,
			Data: map[string][]byte{KeyCACert: c.certPEM, KeyCAKey: c.keyPEM, KeyVolumeMaster: newMaster()},
		}
		// Two managers starting at once: one Create wins, the other
		// reads the winner's CA.
		if err := a.opts.Writer.Create(ctx, s); err != nil {
			if apierrors.IsAlreadyExists(err) {
				return nil, fmt.Errorf("the Secret %s was created by another manager meanwhile; reading it next", key)
			}
			return nil, fmt.Errorf("create Secret %s: %w", key, err)
		}
		a.opts.Logger.Info("CA created", "secret", key, "notAfter", c.cert.NotAfter)
		return s, nil
	}
	if err != nil {
		return nil, fmt.Errorf("get Secret %s: %w", key, err)
	}

	// An unusable CA is the operator's to fix: nothing is written to it.
	if _, err := a.parseCA(s); err != nil {
		return nil, err
	}
	changed := false
	if len(s.Data[KeyVolumeMaster]) < masterKeySize {
		// A CA Secret from before volume keys, or one an operator made.
		if s.Data == nil {
			s.Data = map[string][]byte{}
		}
		s.Data[KeyVolumeMaster] = newMaster()
		changed = true
	}
	ann := s.Annotations
	if want := ann[AnnotationRotate]; want != "" && want != ann[annotationRotated] {
		c, err := newCA(now, a.opts.CAValidity)
		if err != nil {
			return nil, err
		}
		if s.Data == nil {
			s.Data = map[string][]byte{}
		}
		// The old CA stays trusted until every peer has the new files:
		// one leaf validity is far more than kubelet's update delay.
		s.Data[KeyPreviousCert], s.Data[KeyPreviousKey] = s.Data[KeyCACert], s.Data[KeyCAKey]
		s.Data[KeyCACert], s.Data[KeyCAKey] = c.certPEM, c.keyPEM
		s.Annotations[annotationRotated] = want
		s.Annotations[annotationPreviousUntil] = now.Add(a.opts.Validity).UTC().Format(time.RFC3339)
		changed = true
		a.opts.Logger.Info("CA rotated", "secret", key, "previousTrustedUntil", s.Annotations[annotationPreviousUntil])
	} else if until, ok := ann[annotationPreviousUntil]; ok {
		t, err := time.Parse(time.RFC3339, until)
		if err != nil || now.After(t) {
			delete(s.Data, KeyPreviousCert)
			delete(s.Data, KeyPreviousKey)
			delete(s.Annotations, annotationPreviousUntil)
			changed = true
			a.opts.Logger.Info("previous CA dropped from the trust bundle", "secret", key)
		}
	}
	if changed {
		// A conflict (another manager wrote first) fails this sync; the
		// next one starts from what that manager wrote.
		if err := a.opts.Writer.Update(ctx, s); err != nil {
			return nil, fmt.Errorf("update Secret %s: %w", key, err)
		}
	}
	return s, nil
}

// ensureServing keeps the instance managers' Secret: a serving
// certificate of the current CA with time left, and the trust bundle.
func (a *Authority) ensureServing(ctx context.Context, cur *ca, bundle []byte, now time.Time) error {
	key := types.NamespacedName{Namespace: a.opts.Namespace, Name: a.opts.ServingSecret}
	s := &corev1.Secret{}
	err := a.opts.Reader.Get(ctx, key, s)
	missing := apierrors.IsNotFound(err)
	if err != nil && !missing {
		return fmt.Errorf("get Secret %s: %w", key, err)
	}
	renew, why := true, "missing"
	if !missing {
		renew, why = leafNeedsRenewal(s.Data[KeyTLSCert], s.Data[KeyTLSKey], cur, now, a.opts.Validity)
	}
	if !renew && bytes.Equal(s.Data[KeyCACert], bundle) {
		return nil
	}
	data := map[string][]byte{KeyCACert: bundle, KeyTLSCert: s.Data[KeyTLSCert], KeyTLSKey: s.Data[KeyTLSKey]}
	if renew {
		certPEM, keyPEM, err := cur.issue(ServerName, serverAuth, now, a.opts.Validity)
		if err != nil {
			return fmt.Errorf("issue the instance managers' certificate: %w", err)
		}
		data[KeyTLSCert], data[KeyTLSKey] = certPEM, keyPEM
		a.opts.Logger.Info("instance managers' certificate issued", "secret", key, "reason", why)
	}
	if missing {
		s = &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: key.Name, Namespace: key.Namespace,
				Labels: map[string]string{"app.kubernetes.io/name": "cairn", "app.kubernetes.io/component": "instance-manager"}},
			Type: corev1.SecretTypeTLS,
			Data: data,
		}
		if err := a.opts.Writer.Create(ctx, s); err != nil {
			return fmt.Errorf("create Secret %s: %w", key, err)
		}
		return nil
	}
	s.Data = data
	if err := a.opts.Writer.Update(ctx, s); err != nil {
		return fmt.Errorf("update Secret %s: %w", key, err)
	}
	return nil
}

// ClientTLS is the manager's TLS configuration for instance managers: its
// current client certificate, and the server's certificate checked
// against the current trust bundle and ServerName on every handshake
// (both change on renewal and rotation, so they are looked up then, not
// fixed in the config).
func (a *Authority) ClientTLS() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		ServerName: ServerName,
		// The chain and name are checked in VerifyConnection, against the
		// bundle as it is at the time of the handshake.
		InsecureSkipVerify:   true,
		VerifyConnection:     a.verifyServer,
		GetClientCertificate: a.clientCertificate,
	}
}

// clientCertificate picks the client certificate of a CA the instance
// manager names as acceptable (a TLS 1.3 server lists its client CAs), the
// current CA's if it names several or none.
func (a *Authority) clientCertificate(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.clients) == 0 {
		// lastErr is why the last Sync failed, shown for context: it is not
		// this error's cause, and may be nil.
		return nil, fmt.Errorf("the manager has no client certificate yet (CA Secret %s/%s): %v",
			a.opts.Namespace, a.opts.CASecret, a.lastErr) //nolint:errorlint // see above
	}
	for _, c := range a.clients {
		if cri.SupportsCertificate(c) == nil {
			return c, nil
		}
	}
	return a.clients[0], nil
}

func (a *Authority) verifyServer(cs tls.ConnectionState) error {
	a.mu.Lock()
	roots := a.roots
	a.mu.Unlock()
	if roots == nil {
		return errors.New("no trust bundle yet: the CA Secret has not been read")
	}
	if len(cs.PeerCertificates) == 0 {
		return errors.New("the instance manager presented no certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter,
		DNSName: ServerName, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, CurrentTime: a.opts.Now()})
	if err != nil {
		return fmt.Errorf("the instance manager's certificate is not one Cairn's CA issued for %s: %w", ServerName, err)
	}
	return nil
}
