package certs

import (
	"crypto/hmac"
	"crypto/sha256"
	"errors"
	"fmt"
)

// KeyVolumeMaster is the key of the CA Secret holding the master secret
// every volume's data-port key is derived from.
const KeyVolumeMaster = "volume-master.key"

// masterKeySize is the master secret's size.
const masterKeySize = 32

// VolumeKeys gives the key of a volume's data connections (between its
// engine and its replicas); the Engine and Replica reconcilers send it to
// the instance manager with each process's spec. Authority implements it
// in a cluster, MasterKey in tests.
type VolumeKeys interface {
	VolumeKey(namespace, name string) ([]byte, error)
}

// MasterKey derives each volume's key for the data connections between
// its engine and its replicas (dataconn's handshake): an HMAC-SHA256 of
// the volume's namespace and name. Deriving, rather than storing a key per
// volume, needs no object per volume and gives the same key to every
// manager replica and after a restart; a process of one volume cannot
// prove itself to another volume's processes.
type MasterKey []byte

// VolumeKey returns the key of the volume namespace/name.
func (m MasterKey) VolumeKey(namespace, name string) ([]byte, error) {
	if len(m) < masterKeySize {
		return nil, errors.New("no master key for volume keys")
	}
	h := hmac.New(sha256.New, m)
	fmt.Fprintf(h, "cairn volume key v1\x00%s\x00%s", namespace, name)
	return h.Sum(nil), nil
}

// VolumeKey returns the key of the volume namespace/name, derived from the
// master secret in the CA Secret; an error until the first Sync.
func (a *Authority) VolumeKey(namespace, name string) ([]byte, error) {
	a.mu.Lock()
	m := a.master
	a.mu.Unlock()
	if m == nil {
		// lastErr is why the last Sync failed, shown for context: it is not
		// this error's cause, and may be nil.
		return nil, fmt.Errorf("volume keys are not available yet: the CA Secret %s/%s has not been read (%v)", a.opts.Namespace, a.opts.CASecret, a.lastErr) //nolint:errorlint // see above
	}
	return m.VolumeKey(namespace, name)
}
