package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"math/big"
	"os"
	"path/filepath"
	"time"
)

// The data-port table: one replica over loopback TCP as the engine reaches
// it in a cluster, plain (cairn-1-tcp), with the volume's key
// authenticating every data connection (cairn-1-key, the default in a
// cluster), and with TLS on the data port as well (cairn-1-tls, the
// --data-tls option), measured in the same rounds, with their ratios.

var dataPortTable = flag.Bool("data-port", true, "also a table of one TCP replica without authentication (cairn-1-tcp), with the volume's key (cairn-1-key) and with the key and TLS on the data port (cairn-1-tls), buffered I/O")

// secured is cairn-1-tcp with the volume's key given to the engine and
// the replica through pipes, and with tls also --data-tls and the
// certificate files of a CA made for the run.
func secured(work, name string, tls bool) target {
	key := make([]byte, 32)
	rand.Read(key)
	var tlsArgs []string
	if tls {
		tlsArgs = append(writePKI(filepath.Join(work, name+"-pki")), "--data-tls")
	}
	pass := func() ([]string, []*os.File) {
		return append([]string{"--auth-key-fd", "3"}, tlsArgs...), []*os.File{keyPipe(key)}
	}
	return cairnWith(work, name, 1, 0, pass, pass)
}

// dataPort measures the three on every workload with buffered I/O.
func dataPort(work string, targets map[string]func(string) target) {
	saved := direct
	defer func() { direct = saved }()
	direct = false
	table(work, "data port: authentication and TLS, buffered", []string{"cairn-1-tcp", "cairn-1-key", "cairn-1-tls"}, targets)
}

// writePKI writes a CA and a certificate of it for the name the data
// plane's TLS checks (cairn-instance-manager), usable as server and
// client, and returns the --tls-* flags naming them.
func writePKI(dir string) []string {
	must(os.MkdirAll(dir, 0o700))
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(err)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "bench CA"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	must(err)
	ca, err := x509.ParseCertificate(caDER)
	must(err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "cairn-instance-manager"}, DNSNames: []string{"cairn-instance-manager"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	must(err)
	keyDER, err := x509.MarshalECPrivateKey(key)
	must(err)
	files := map[string]*pem.Block{"ca.crt": {Type: "CERTIFICATE", Bytes: caDER}, "tls.crt": {Type: "CERTIFICATE", Bytes: der},
		"tls.key": {Type: "EC PRIVATE KEY", Bytes: keyDER}}
	for name, b := range files {
		must(os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(b), 0o600))
	}
	return []string{"--tls-cert", filepath.Join(dir, "tls.crt"), "--tls-key", filepath.Join(dir, "tls.key"), "--tls-client-ca", filepath.Join(dir, "ca.crt")}
}
