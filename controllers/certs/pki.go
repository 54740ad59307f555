package certs

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"time"
)

// ca is a certificate authority: its certificate and signing key.
type ca struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// certPEM and keyPEM are the encoded forms kept in the CA Secret.
	certPEM, keyPEM []byte
}

// backdate is how far before "now" a certificate's validity starts, so
// that a peer whose clock is a little behind accepts it.
const backdate = 5 * time.Minute

func serial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}

// newCA makes a self-signed ECDSA P-256 CA valid from now for validity.
func newCA(now time.Time, validity time.Duration) (*ca, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: fmt.Sprintf("cairn-ca-%s-%s", now.UTC().Format("20060102T150405Z"), sn.Text(36)[:6]), Organization: []string{"cairn"}},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	return &ca{cert: cert, key: key,
		certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		keyPEM:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})}, nil
}

// parseCA reads a CA from its PEM certificate and key, and checks that
// they belong together and that the certificate may sign.
func parseCA(certPEM, keyPEM []byte) (*ca, error) {
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil, err
	}
	if !cert.IsCA {
		return nil, errors.New("the certificate is not a CA certificate")
	}
	key, ok := pair.PrivateKey.(*ecdsa.PrivateKey)
	if !ok {
		return nil, fmt.Errorf("the key is a %T, not an ECDSA key", pair.PrivateKey)
	}
	return &ca{cert: cert, key: key, certPEM: certPEM, keyPEM: keyPEM}, nil
}

// usage says what a leaf certificate is for.
type usage int

const (
	serverAuth usage = iota
	clientAuth
)

// issue signs a leaf certificate for name (its CommonName and, for a
// server, its one DNS name) valid from now for validity, and returns it
// and its key in PEM.
func (c *ca) issue(name string, u usage, now time.Time, validity time.Duration) (certPEM, keyPEM []byte, err error) {
	tmpl := &x509.Certificate{Subject: pkix.Name{CommonName: name, Organization: []string{"cairn"}}}
	switch u {
	case serverAuth:
		// Client use too: an engine presents its node's certificate to
		// the replicas' control ports.
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
		tmpl.DNSNames = []string{name}
	case clientAuth:
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	}
	return c.sign(tmpl, now, validity)
}

// issueServer signs a serving-only certificate for names (the first is
// its CommonName) valid from now for validity, and returns it and its key
// in PEM.
func (c *ca) issueServer(names []string, now time.Time, validity time.Duration) (certPEM, keyPEM []byte, err error) {
	return c.sign(&x509.Certificate{
		Subject:     pkix.Name{CommonName: names[0], Organization: []string{"cairn"}},
		DNSNames:    names,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, now, validity)
}

// sign fills tmpl's serial number, validity (from now, never past the
// CA's) and key usage, signs it with a new key, and returns the
// certificate and the key in PEM.
func (c *ca) sign(tmpl *x509.Certificate, now time.Time, validity time.Duration) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, nil, err
	}
	tmpl.SerialNumber = sn
	tmpl.NotBefore, tmpl.NotAfter = now.Add(-backdate), now.Add(validity)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	if tmpl.NotAfter.After(c.cert.NotAfter) {
		// A leaf never outlives its CA; it is renewed under the next one.
		tmpl.NotAfter = c.cert.NotAfter
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, &key.PublicKey, c.key)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), nil
}

// leafNeedsRenewal says whether a leaf certificate must be issued again:
// it cannot be read, its key does not match, the current CA did not sign
// it, or less than a third of validity is left.
func leafNeedsRenewal(certPEM, keyPEM []byte, c *ca, now time.Time, validity time.Duration) (bool, string) {
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return true, "unreadable: " + err.Error()
	}
	cert, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return true, "unreadable: " + err.Error()
	}
	if err := cert.CheckSignatureFrom(c.cert); err != nil {
		return true, "not signed by the current CA"
	}
	if !slices.Contains(cert.ExtKeyUsage, x509.ExtKeyUsageClientAuth) {
		return true, "not usable by a client (an engine to its replicas)"
	}
	if left := cert.NotAfter.Sub(now); left < validity/3 {
		return true, fmt.Sprintf("expires in %s", left.Round(time.Second))
	}
	return false, ""
}
