// Package tlsfiles gives the data plane's gRPC servers and clients mutual
// TLS from three PEM files: a certificate, its key, and the CA bundle the
// peer's certificate must chain to. In a cluster they are the files of the
// Secret the manager keeps (the instance manager mounts it and hands the
// paths to its engines and replicas); the manager renews the certificate
// and rotates the CA by updating the Secret, and kubelet replaces the
// files. Every handshake uses the files as they are then: a change is
// read on the first handshake after it, with no restart. A change that
// cannot be loaded (say, a half-written set) is logged and the previous
// set keeps serving.
package tlsfiles

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/go-logr/logr"
)

// ServerName is the DNS name in the certificate the instance managers and
// their processes serve with (the manager issues it; its client checks
// it too).
const ServerName = "cairn-instance-manager"

// Files are the three PEM files.
type Files struct {
	Cert, Key, CA string
}

// Set reports whether all three are given; Check says what is wrong when
// only some are.
func (f Files) Set() bool { return f.Cert != "" && f.Key != "" && f.CA != "" }

// Check returns an error when some but not all of the files are given.
func (f Files) Check() error {
	n := 0
	for _, s := range []string{f.Cert, f.Key, f.CA} {
		if s != "" {
			n++
		}
	}
	if n != 0 && n != 3 {
		return errors.New("mutual TLS needs all three of --tls-cert, --tls-key and --tls-client-ca")
	}
	return nil
}

// Args are the command-line flags that name the files, for a child
// process.
func (f Files) Args() []string {
	return []string{"--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-client-ca", f.CA}
}

// Source serves the current contents of the files.
type Source struct {
	files Files
	log   logr.Logger

	mu    sync.Mutex
	stamp [3]os.FileInfo
	cert  *tls.Certificate
	pool  *x509.CertPool
}

// New loads the files once; an error there is fatal (the flags name files
// that do not hold what they should).
func New(files Files, log logr.Logger) (*Source, error) {
	s := &Source{files: files, log: log}
	if _, _, err := s.current(); err != nil {
		return nil, err
	}
	return s, nil
}

func same(a, b os.FileInfo) bool {
	return a != nil && b != nil && os.SameFile(a, b) && a.ModTime().Equal(b.ModTime()) && a.Size() == b.Size()
}

func (s *Source) load() (*tls.Certificate, *x509.CertPool, error) {
	cert, err := tls.LoadX509KeyPair(s.files.Cert, s.files.Key)
	if err != nil {
		return nil, nil, fmt.Errorf("--tls-cert/--tls-key: %w", err)
	}
	pem, err := os.ReadFile(s.files.CA)
	if err != nil {
		return nil, nil, fmt.Errorf("--tls-client-ca: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, nil, fmt.Errorf("--tls-client-ca %s: no PEM certificate in it", s.files.CA)
	}
	return &cert, pool, nil
}

// current returns the certificate and CA bundle of the files as they are
// now, reading them again if any changed.
func (s *Source) current() (*tls.Certificate, *x509.CertPool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var now [3]os.FileInfo
	changed := s.cert == nil
	for i, f := range []string{s.files.Cert, s.files.Key, s.files.CA} {
		now[i], _ = os.Stat(f)
		if !same(s.stamp[i], now[i]) {
			changed = true
		}
	}
	if !changed {
		return s.cert, s.pool, nil
	}
	cert, pool, err := s.load()
	if err != nil {
		if s.cert == nil {
			return nil, nil, err
		}
		s.log.Error(err, "new TLS files not loaded; using the previous ones")
	} else {
		if s.cert != nil {
			s.log.Info("TLS certificate and CA bundle reloaded", "cert", s.files.Cert)
		}
		s.cert, s.pool = cert, pool
	}
	// Stamped even on failure, so a bad set is reported once, not on every
	// handshake; the next change of any file is tried again.
	s.stamp = now
	return s.cert, s.pool, nil
}

// Server is the configuration of a server that requires a client
// certificate of the CA bundle (TLS 1.3).
func (s *Source) Server() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			cert, pool, err := s.current()
			if err != nil {
				return nil, err
			}
			return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{*cert},
				ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert}, nil
		},
	}
}

// Client is the configuration of a client that presents the certificate
// and accepts only a server certificate of the CA bundle for ServerName.
func (s *Source) Client() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		ServerName: ServerName,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			cert, _, err := s.current()
			return cert, err
		},
		// The chain and name are checked in VerifyConnection against the
		// bundle as it is at the handshake (it changes on rotation).
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, pool, err := s.current()
			if err != nil {
				return err
			}
			if len(cs.PeerCertificates) == 0 {
				return errors.New("the server presented no certificate")
			}
			inter := x509.NewCertPool()
			for _, c := range cs.PeerCertificates[1:] {
				inter.AddCert(c)
			}
			if _, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, DNSName: ServerName,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
				return fmt.Errorf("the server's certificate is not one Cairn's CA issued for %s: %w", ServerName, err)
			}
			return nil
		},
	}
}
