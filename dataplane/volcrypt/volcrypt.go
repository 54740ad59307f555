// Package volcrypt is a volume's encryption at rest: AES-256-XTS over
// 512-byte sectors, the sector's number on the volume as the tweak. The
// engine encrypts every write before it fans out and decrypts every read,
// so replicas, rebuild streams and snapshots hold ciphertext only.
//
// A sector whose ciphertext is all zeros reads as zeros: that is what a
// replica returns for a range never written or discarded, and a real
// ciphertext sector is all zeros with probability 2^-4096. So an encrypted
// volume reads as zeros where nothing was written, as a plain one does,
// and discard and write-zeroes pass through unencrypted.
package volcrypt

import (
	"crypto/aes"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"golang.org/x/crypto/xts"
)

const (
	// SectorSize is the unit of encryption: I/O must be aligned to it.
	SectorSize = 512
	// KeySize is the size of a volume's AES-256-XTS key (two AES-256 keys).
	KeySize = 64
	// MinPassphrase and MaxPassphrase bound the secret a user gives.
	MinPassphrase = 16
	MaxPassphrase = 4096
)

// ErrPassphrase is a passphrase outside [MinPassphrase, MaxPassphrase].
var ErrPassphrase = fmt.Errorf("an encryption passphrase must be %d to %d bytes", MinPassphrase, MaxPassphrase)

// DeriveKey turns a user's passphrase (the Secret's value) into the
// volume's XTS key. It depends on the passphrase alone, so a clone, which
// copies the source's ciphertext, reads it with the same passphrase.
func DeriveKey(passphrase []byte) ([]byte, error) {
	if len(passphrase) < MinPassphrase || len(passphrase) > MaxPassphrase {
		return nil, ErrPassphrase
	}
	return hkdf.Key(sha256.New, passphrase, []byte("cairn volume encryption"), "aes-256-xts", KeySize)
}

// KeyCheck is a public value that identifies a key without revealing it:
// the Volume records it when it is created, and an engine given a key
// whose check differs refuses to start (the wrong key would turn every
// read into noise and every write into data nobody can read).
func KeyCheck(key []byte) string {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("cairn volume key check"))
	return hex.EncodeToString(m.Sum(nil)[:16])
}

// Cipher encrypts and decrypts a volume's sectors.
type Cipher struct{ c *xts.Cipher }

// New returns the cipher for a KeySize-byte key.
func New(key []byte) (*Cipher, error) {
	if len(key) != KeySize {
		return nil, fmt.Errorf("volume encryption key of %d bytes, want %d", len(key), KeySize)
	}
	c, err := xts.NewCipher(aes.NewCipher, key)
	if err != nil {
		return nil, err
	}
	return &Cipher{c: c}, nil
}

// ErrAlignment is I/O not aligned to SectorSize.
var ErrAlignment = errors.New("encrypted volume: I/O must be aligned to 512-byte sectors")

// Encrypt writes the ciphertext of plain, which starts at byte off of the
// volume, into dst (len(dst) >= len(plain); they may be the same slice).
func (c *Cipher) Encrypt(dst, plain []byte, off int64) error {
	if off%SectorSize != 0 || len(plain)%SectorSize != 0 {
		return ErrAlignment
	}
	sector := uint64(off / SectorSize)
	for i := 0; i < len(plain); i += SectorSize {
		c.c.Encrypt(dst[i:i+SectorSize], plain[i:i+SectorSize], sector)
		sector++
	}
	return nil
}

// Decrypt decrypts buf, which starts at byte off of the volume, in place;
// all-zero sectors stay zero.
func (c *Cipher) Decrypt(buf []byte, off int64) error {
	if off%SectorSize != 0 || len(buf)%SectorSize != 0 {
		return ErrAlignment
	}
	sector := uint64(off / SectorSize)
	for i := 0; i < len(buf); i += SectorSize {
		s := buf[i : i+SectorSize]
		if !zero(s) {
			c.c.Decrypt(s, s, sector)
		}
		sector++
	}
	return nil
}

// zero reports whether s is all zeros.
func zero(s []byte) bool {
	for len(s) >= 8 {
		if s[0]|s[1]|s[2]|s[3]|s[4]|s[5]|s[6]|s[7] != 0 {
			return false
		}
		s = s[8:]
	}
	for _, b := range s {
		if b != 0 {
			return false
		}
	}
	return true
}
