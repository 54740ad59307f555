package volcrypt

import (
	"bytes"
	"encoding/hex"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
)

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func random(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// IEEE P1619/D16 (IEEE Std 1619-2007), Annex B, XTS-AES-256 Vector 10: a
// 512-byte data unit, data unit sequence number 0xff, the plaintext bytes
// 00 01 ... ff twice.
const (
	kat10Key    = "2718281828459045235360287471352662497757247093699959574966967627" + "3141592653589793238462643383279502884197169399375105820974944592"
	kat10Sector = 0xff
	kat10Cipher = "1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b5d31e276f8fe4a8d66b317f9ac683f44680a86ac35adfc3345befecb4bb188fd" +
		"5776926c49a3095eb108fd1098baec70aaa66999a72a82f27d848b21d4a741b0c5cd4d5fff9dac89aeba122961d03a757123e9870f8acf1000020887891429ca" +
		"2a3e7a7d7df7b10355165c8b9a6d0a7de8b062c4500dc4cd120c0f7418dae3d0b5781c34803fa75421c790dfe1de1834f280d7667b327f6c8cd7557e12ac3a0f" +
		"93ec05c52e0493ef31a12d3d9260f79a289d6a379bc70c50841473d1a8cc81ec583e9645e07b8d9670655ba5bbcfecc6dc3966380ad8fecb17b6ba02469a020a" +
		"84e18e8f84252070c13e9f1f289be54fbc481457778f616015e1327a02b140f1505eb309326d68378f8374595c849d84f4c333ec4423885143cb47bd71c5edae" +
		"9be69a2ffeceb1bec9de244fbe15992b11b77c040f12bd8f6a975a44a0f90c29a9abc3d4d893927284c58754cce294529f8614dcd2aba991925fedc4ae74ffac" +
		"6e333b93eb4aff0479da9a410e4450e0dd7ae4c6e2910900575da401fc07059f645e8b7e9bfdef33943054ff84011493c27b3429eaedb4ed5376441a77ed4385" +
		"1ad77f16f541dfd269d50d6a5f14fb0aab1cbb4c1550be97f7ab4066193c4caa773dad38014bd2092fa755c824bb5e54c4f36ffda9fcea70b9c6e693e148c151"
)

// TestKnownAnswer: the sector at volume byte 0xff*512 encrypts as the
// standard's vector says, and decrypts back.
func TestKnownAnswer(t *testing.T) {
	c, err := New(unhex(t, kat10Key))
	if err != nil {
		t.Fatal(err)
	}
	plain := make([]byte, SectorSize)
	for i := range plain {
		plain[i] = byte(i)
	}
	want := unhex(t, kat10Cipher)
	got := make([]byte, SectorSize)
	if err := c.Encrypt(got, plain, kat10Sector*SectorSize); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("ciphertext\n got %x\nwant %x", got, want)
	}
	if err := c.Decrypt(got, kat10Sector*SectorSize); err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("decrypted: %v, plaintext %v", err, bytes.Equal(got, plain))
	}
	// The same sector elsewhere on the volume (sector 0x100, and as the
	// second sector of a two-sector write) encrypts differently.
	two := make([]byte, 2*SectorSize)
	copy(two[SectorSize:], plain)
	if err := c.Encrypt(two, two, (kat10Sector-1)*SectorSize); err != nil || !bytes.Equal(two[SectorSize:], want) {
		t.Fatalf("as the second sector of a write: %v", err)
	}
	if err := c.Encrypt(got, plain, (kat10Sector+1)*SectorSize); err != nil || bytes.Equal(got, want) {
		t.Fatalf("another sector number gave the same ciphertext (%v)", err)
	}
}

// TestRoundTrip: random data of many sectors at many offsets decrypts back
// to itself, in place and into another buffer, and never equals its
// plaintext; each sector's ciphertext depends on its own number only.
func TestRoundTrip(t *testing.T) {
	c, err := New(random(1, KeySize))
	if err != nil {
		t.Fatal(err)
	}
	for i, n := range []int{1, 2, 8, 64, 2048} {
		plain := random(uint64(10+i), n*SectorSize)
		off := int64(i) * 7 * SectorSize
		ct := make([]byte, len(plain))
		if err := c.Encrypt(ct, plain, off); err != nil {
			t.Fatal(err)
		}
		if bytes.Equal(ct, plain) {
			t.Fatalf("%d sectors: ciphertext equals plaintext", n)
		}
		inPlace := bytes.Clone(plain)
		if err := c.Encrypt(inPlace, inPlace, off); err != nil || !bytes.Equal(inPlace, ct) {
			t.Fatalf("%d sectors: in place differs from into another buffer (%v)", n, err)
		}
		if n > 1 { // the second sector alone, at its own offset
			one := make([]byte, SectorSize)
			if err := c.Encrypt(one, plain[SectorSize:2*SectorSize], off+SectorSize); err != nil || !bytes.Equal(one, ct[SectorSize:2*SectorSize]) {
				t.Fatalf("%d sectors: a sector's ciphertext depends on more than its number (%v)", n, err)
			}
		}
		if err := c.Decrypt(ct, off); err != nil || !bytes.Equal(ct, plain) {
			t.Fatalf("%d sectors: round trip: %v", n, err)
		}
	}
	other, _ := New(random(2, KeySize))
	ct := make([]byte, SectorSize)
	if err := c.Encrypt(ct, random(3, SectorSize), 0); err != nil {
		t.Fatal(err)
	}
	if err := other.Decrypt(ct, 0); err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(ct, random(3, SectorSize)) {
		t.Fatal("another key decrypted the data")
	}
}

// TestZeroSectors: an all-zero ciphertext sector (never written, or
// discarded) decrypts as zeros, next to real ones that decrypt normally;
// a written sector of zeros is encrypted like any data.
func TestZeroSectors(t *testing.T) {
	c, _ := New(random(4, KeySize))
	plain := random(5, 3*SectorSize)
	buf := make([]byte, 3*SectorSize)
	if err := c.Encrypt(buf, plain, 40*SectorSize); err != nil {
		t.Fatal(err)
	}
	clear(buf[SectorSize : 2*SectorSize]) // the middle sector discarded
	if err := c.Decrypt(buf, 40*SectorSize); err != nil {
		t.Fatal(err)
	}
	copy(plain[SectorSize:], make([]byte, SectorSize))
	if !bytes.Equal(buf, plain) {
		t.Fatal("a zero sector between two others does not read as zeros, or its neighbours changed")
	}
	zeros := make([]byte, SectorSize)
	ct := make([]byte, SectorSize)
	if err := c.Encrypt(ct, zeros, 0); err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(ct, zeros) {
		t.Fatal("a sector of zeros is stored as zeros")
	}
}

// TestAlignment: offsets and lengths that are not whole sectors are
// refused with ErrAlignment, and nothing is written.
func TestAlignment(t *testing.T) {
	c, _ := New(random(6, KeySize))
	for _, tc := range []struct {
		off int64
		n   int
	}{{1, SectorSize}, {0, SectorSize - 1}, {SectorSize, SectorSize + 1}, {4095, 4096}} {
		dst := make([]byte, tc.n)
		if err := c.Encrypt(dst, make([]byte, tc.n), tc.off); !errors.Is(err, ErrAlignment) {
			t.Errorf("Encrypt %d bytes at %d: %v, want ErrAlignment", tc.n, tc.off, err)
		}
		if !bytes.Equal(dst, make([]byte, tc.n)) {
			t.Errorf("Encrypt %d bytes at %d wrote before refusing", tc.n, tc.off)
		}
		buf := random(7, tc.n)
		if err := c.Decrypt(buf, tc.off); !errors.Is(err, ErrAlignment) || !bytes.Equal(buf, random(7, tc.n)) {
			t.Errorf("Decrypt %d bytes at %d: %v, want ErrAlignment and the buffer untouched", tc.n, tc.off, err)
		}
	}
	if err := c.Encrypt(nil, nil, 0); err != nil {
		t.Errorf("nothing: %v", err)
	}
	for _, n := range []int{0, 32, 63, 65} {
		if _, err := New(make([]byte, n)); err == nil {
			t.Errorf("a %d-byte key was taken", n)
		}
	}
}

// TestDeriveKey: a passphrase out of bounds is refused; one in bounds
// gives a KeySize key that depends on every byte of it, the same every
// time; KeyCheck tells keys apart and reveals neither.
func TestDeriveKey(t *testing.T) {
	for _, n := range []int{0, MinPassphrase - 1, MaxPassphrase + 1} {
		if _, err := DeriveKey(make([]byte, n)); !errors.Is(err, ErrPassphrase) {
			t.Errorf("a %d-byte passphrase: %v, want ErrPassphrase", n, err)
		}
	}
	p := []byte(strings.Repeat("correct horse ", 2))
	k, err := DeriveKey(p)
	if err != nil || len(k) != KeySize {
		t.Fatalf("key of %d bytes, %v", len(k), err)
	}
	again, _ := DeriveKey(bytes.Clone(p))
	if !bytes.Equal(k, again) {
		t.Fatal("the same passphrase gave two keys")
	}
	p[len(p)-1] ^= 1
	other, _ := DeriveKey(p)
	if bytes.Equal(k, other) {
		t.Fatal("a passphrase one bit apart gave the same key")
	}
	for _, n := range []int{MinPassphrase, MaxPassphrase} {
		if _, err := DeriveKey(make([]byte, n)); err != nil {
			t.Errorf("a %d-byte passphrase: %v", n, err)
		}
	}
	check := KeyCheck(k)
	if len(check) != 32 || check == KeyCheck(other) || check != KeyCheck(again) {
		t.Fatalf("key checks %s, %s, %s", check, KeyCheck(other), KeyCheck(again))
	}
	if strings.Contains(check, hex.EncodeToString(k[:4])) {
		t.Fatal("the key check shows the key")
	}
}

func BenchmarkEncrypt4K(b *testing.B) {
	c, _ := New(random(8, KeySize))
	p, d := random(9, 4096), make([]byte, 4096)
	b.SetBytes(4096)
	b.ReportAllocs()
	for i := range b.N {
		if err := c.Encrypt(d, p, int64(i%1024)*4096); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecrypt4K(b *testing.B) {
	c, _ := New(random(8, KeySize))
	ct := make([]byte, 4096)
	if err := c.Encrypt(ct, random(9, 4096), 0); err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, 4096)
	b.SetBytes(4096)
	b.ReportAllocs()
	for range b.N {
		copy(buf, ct)
		if err := c.Decrypt(buf, 0); err != nil {
			b.Fatal(err)
		}
	}
}
