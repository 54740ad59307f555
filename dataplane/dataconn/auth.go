package dataconn

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// The authentication handshake runs once on every connection, before any
// frame, when the server has a key (ServerOptions.Key). Client and server
// prove to each other that they hold the same per-volume key without
// sending it: each proof is an HMAC-SHA256 over both sides' fresh random
// nonces, so a recorded handshake is worth nothing on another connection.
// All messages have a fixed size; nothing is allocated from what a peer
// sends.
//
//	hello      client -> server  40 bytes: magic "CRNA", version 1, 3 zero bytes, client nonce (32)
//	challenge  server -> client  72 bytes: magic, version, 3 zero bytes, server nonce (32),
//	                                       server proof (32) = HMAC(key, "cairn dataconn v1 server" | client nonce | server nonce)
//	proof      client -> server  32 bytes: HMAC(key, "cairn dataconn v1 client" | server nonce | client nonce)
//	result     server -> client   8 bytes: magic, version, result (0 accepted, 1 refused), 2 zero bytes
//
// A refused client is sent the result and disconnected; a peer that sends
// anything else, or too little within the handshake timeout, is
// disconnected without a result.

// AuthMagic starts every handshake message: "CRNA".
const AuthMagic uint32 = 0x43524e41

// AuthVersion is the handshake version.
const AuthVersion uint8 = 1

// KeySize is the size of a volume's key.
const KeySize = 32

// Handshake message sizes.
const (
	helloSize     = 8 + 32
	challengeSize = 8 + 32 + 32
	proofSize     = 32
	resultSize    = 8
)

// DefaultHandshakeTimeout bounds a handshake unless configured otherwise.
const DefaultHandshakeTimeout = 5 * time.Second

// Handshake errors.
var (
	// ErrAuthRefused: the server did not accept the client's proof (the
	// two hold different keys), or the server's proof was wrong.
	ErrAuthRefused = errors.New("dataconn: authentication refused")
	// ErrAuthMalformed: a handshake message is not one (bad magic,
	// version or reserved bytes).
	ErrAuthMalformed = errors.New("dataconn: malformed handshake")
)

var (
	serverLabel = []byte("cairn dataconn v1 server")
	clientLabel = []byte("cairn dataconn v1 client")
)

func mac(key, label, a, b []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write(label)
	m.Write(a)
	m.Write(b)
	return m.Sum(nil)
}

func putAuthHeader(b []byte) {
	binary.BigEndian.PutUint32(b[0:4], AuthMagic)
	b[4] = AuthVersion
	b[5], b[6], b[7] = 0, 0, 0
}

func checkAuthHeader(b []byte) error {
	if binary.BigEndian.Uint32(b[0:4]) != AuthMagic {
		return fmt.Errorf("%w: bad magic %#x (a peer without the handshake?)", ErrAuthMalformed, binary.BigEndian.Uint32(b[0:4]))
	}
	if b[4] != AuthVersion {
		return fmt.Errorf("%w: version %d, want %d", ErrAuthMalformed, b[4], AuthVersion)
	}
	return nil
}

// Hello is the client's first message.
type Hello struct{ Nonce [32]byte }

// EncodeHello returns hello's bytes.
func EncodeHello(h Hello) []byte {
	b := make([]byte, helloSize)
	putAuthHeader(b)
	copy(b[8:], h.Nonce[:])
	return b
}

// DecodeHello parses a hello from exactly helloSize bytes.
func DecodeHello(b []byte) (Hello, error) {
	var h Hello
	if len(b) != helloSize {
		return h, fmt.Errorf("%w: hello of %d bytes", ErrAuthMalformed, len(b))
	}
	if err := checkAuthHeader(b); err != nil {
		return h, err
	}
	if b[5]|b[6]|b[7] != 0 {
		return h, fmt.Errorf("%w: reserved bytes set in hello", ErrAuthMalformed)
	}
	copy(h.Nonce[:], b[8:])
	return h, nil
}

// Challenge is the server's answer to a hello.
type Challenge struct {
	Nonce [32]byte
	Proof [32]byte
}

// EncodeChallenge returns c's bytes.
func EncodeChallenge(c Challenge) []byte {
	b := make([]byte, challengeSize)
	putAuthHeader(b)
	copy(b[8:40], c.Nonce[:])
	copy(b[40:], c.Proof[:])
	return b
}

// DecodeChallenge parses a challenge from exactly challengeSize bytes.
func DecodeChallenge(b []byte) (Challenge, error) {
	var c Challenge
	if len(b) != challengeSize {
		return c, fmt.Errorf("%w: challenge of %d bytes", ErrAuthMalformed, len(b))
	}
	if err := checkAuthHeader(b); err != nil {
		return c, err
	}
	if b[5]|b[6]|b[7] != 0 {
		return c, fmt.Errorf("%w: reserved bytes set in challenge", ErrAuthMalformed)
	}
	copy(c.Nonce[:], b[8:40])
	copy(c.Proof[:], b[40:])
	return c, nil
}

// EncodeResult returns the result message.
func EncodeResult(accepted bool) []byte {
	b := make([]byte, resultSize)
	putAuthHeader(b)
	if !accepted {
		b[5] = 1
	}
	return b
}

// DecodeResult parses a result from exactly resultSize bytes.
func DecodeResult(b []byte) (accepted bool, err error) {
	if len(b) != resultSize {
		return false, fmt.Errorf("%w: result of %d bytes", ErrAuthMalformed, len(b))
	}
	if err := checkAuthHeader(b); err != nil {
		return false, err
	}
	if b[5] > 1 || b[6]|b[7] != 0 {
		return false, fmt.Errorf("%w: result %d", ErrAuthMalformed, b[5])
	}
	return b[5] == 0, nil
}

func readN(r io.Reader, n int) ([]byte, error) {
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	return b, nil
}

// ServerHandshake authenticates the client on nc with key, within
// timeout. On error the caller closes nc.
func ServerHandshake(nc net.Conn, key []byte, timeout time.Duration) error {
	if err := nc.SetDeadline(time.Now().Add(timeout)); err != nil {
		return err
	}
	b, err := readN(nc, helloSize)
	if err != nil {
		return fmt.Errorf("%w: reading hello: %w", ErrAuthMalformed, err)
	}
	hello, err := DecodeHello(b)
	if err != nil {
		return err
	}
	var ch Challenge
	if _, err := rand.Read(ch.Nonce[:]); err != nil {
		return err
	}
	copy(ch.Proof[:], mac(key, serverLabel, hello.Nonce[:], ch.Nonce[:]))
	if _, err := nc.Write(EncodeChallenge(ch)); err != nil {
		return err
	}
	proof, err := readN(nc, proofSize)
	if err != nil {
		return fmt.Errorf("%w: reading proof: %w", ErrAuthMalformed, err)
	}
	if !hmac.Equal(proof, mac(key, clientLabel, ch.Nonce[:], hello.Nonce[:])) {
		_, _ = nc.Write(EncodeResult(false)) // best effort: the connection is refused either way
		return fmt.Errorf("%w: the client's proof does not match this volume's key", ErrAuthRefused)
	}
	if _, err := nc.Write(EncodeResult(true)); err != nil {
		return err
	}
	return nc.SetDeadline(time.Time{})
}

// ClientHandshake authenticates nc's server with key, and itself to it,
// within timeout. On error the caller closes nc.
func ClientHandshake(nc net.Conn, key []byte, timeout time.Duration) error {
	if err := nc.SetDeadline(time.Now().Add(timeout)); err != nil {
		return err
	}
	var hello Hello
	if _, err := rand.Read(hello.Nonce[:]); err != nil {
		return err
	}
	if _, err := nc.Write(EncodeHello(hello)); err != nil {
		return err
	}
	b, err := readN(nc, challengeSize)
	if err != nil {
		return fmt.Errorf("%w: reading the challenge (a server without a key closes here): %w", ErrAuthMalformed, err)
	}
	ch, err := DecodeChallenge(b)
	if err != nil {
		return err
	}
	if !hmac.Equal(ch.Proof[:], mac(key, serverLabel, hello.Nonce[:], ch.Nonce[:])) {
		return fmt.Errorf("%w: the server's proof does not match this volume's key (not this volume's replica)", ErrAuthRefused)
	}
	if _, err := nc.Write(mac(key, clientLabel, ch.Nonce[:], hello.Nonce[:])); err != nil {
		return err
	}
	b, err = readN(nc, resultSize)
	if err != nil {
		return fmt.Errorf("%w: reading the result: %w", ErrAuthMalformed, err)
	}
	ok, err := DecodeResult(b)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("%w: the server refused this client's key", ErrAuthRefused)
	}
	return nc.SetDeadline(time.Time{})
}

// ValidKey checks a key's size.
func ValidKey(key []byte) error {
	if len(key) != KeySize {
		return fmt.Errorf("dataconn: a volume key is %d bytes, not %d", KeySize, len(key))
	}
	if bytes.Equal(key, make([]byte, KeySize)) {
		return errors.New("dataconn: a volume key of zeros")
	}
	return nil
}
