package dataconn

import (
	"bytes"
	"encoding/hex"
	"errors"
	"io"
	"strings"
	"testing"
)

// golden frames: any change to the byte layout shows up here and must come
// with a protocol version bump (docs/dataconn.md, "Versioning").
var goldenFrames = []struct {
	name    string
	h       Header
	payload []byte
	hex     string
}{
	{"read", Header{Op: OpRead, Seq: 1, Offset: 4096, Epoch: 7, Length: 4096}, nil,
		"43524e4401010000000000000000000100000000000010000000000000000007000010000000000000000000eb22767c"},
	{"write-fua", Header{Op: OpWrite, Flags: FlagFUA, Seq: 2, Offset: 8192, Epoch: 7, Length: 4}, []byte("data"),
		"43524e44010201000000000000000002000000000000200000000000000000070000000400000004aed87dd1fa117c7864617461"},
	{"flush", Header{Op: OpFlush, Seq: 3, Epoch: 7}, nil,
		"43524e44010300000000000000000003000000000000000000000000000000070000000000000000000000001e330452"},
	{"unmap", Header{Op: OpUnmap, Seq: 4, Offset: 1 << 20, Epoch: 7, Length: 1 << 20}, nil,
		"43524e44010400000000000000000004000000000010000000000000000000070010000000000000000000002938600f"},
	{"ping", Header{Op: OpPing, Seq: 5}, nil,
		"43524e44010500000000000000000005000000000000000000000000000000000000000000000000000000007509fd51"},
	{"attach", Header{Op: OpAttach, Length: 64 << 20}, nil,
		"43524e4401060000000000000000000000000000000000000000000000000000040000000000000000000000f74cd2b1"},
	{"write-shared", Header{Op: OpWrite, Flags: FlagShared, Seq: 6, Offset: 8192, Epoch: 7, Length: 131072}, []byte{0, 0, 0, 0, 0, 2, 0, 0},
		"43524e44010202000000000000000006000000000000200000000000000000070002000000000008c347e087d7022a0a0000000000020000"},
	{"snapshot-read", Header{Op: OpSnapshotRead, Seq: 7, Offset: 2 << 20, Length: 2 << 20}, []byte("snap-1"),
		"43524e44010700000000000000000007000000000020000000000000000000000020000000000006dbe98bb8a2725453736e61702d31"},
	{"snapshot-read-reply", Header{Op: OpSnapshotRead.Reply(), Seq: 7, Offset: 2 << 20, Length: 2}, []byte{0x12, 0x34},
		"43524e440187000000000000000000070000000000200000000000000000000000000002000000021e986813ed996a111234"},
	{"read-reply", Header{Op: OpRead.Reply(), Seq: 1, Offset: 4096, Epoch: 7, Length: 2}, []byte{0xab, 0xcd},
		"43524e44018100000000000000000001000000000000100000000000000000070000000200000002a07f6f1f6cec20a6abcd"},
	{"write-reply", Header{Op: OpWrite.Reply(), Seq: 2, Offset: 8192, Epoch: 7, Length: 4}, nil,
		"43524e440182000000000000000000020000000000002000000000000000000700000004000000000000000095f42631"},
	{"error-reply", Header{Op: OpWrite.Reply(), Code: CodeStaleEpoch, Seq: 9, Epoch: 6}, []byte("stale"),
		"43524e44018200040000000000000009000000000000000000000000000000060000000000000005c40a5ae60325d8587374616c65"},
}

func TestGoldenFrames(t *testing.T) {
	for _, g := range goldenFrames {
		t.Run(g.name, func(t *testing.T) {
			got := hex.EncodeToString(AppendFrame(nil, g.h, g.payload))
			if got != g.hex {
				t.Fatalf("encoding changed:\n got %s\nwant %s", got, g.hex)
			}
			raw, _ := hex.DecodeString(g.hex)
			f, err := Decode(bytes.NewReader(raw), DefaultMaxPayload)
			if err != nil {
				t.Fatalf("decode golden bytes: %v", err)
			}
			want := g.h
			want.PayloadLen = uint32(len(g.payload))
			want.PayloadCRC = Checksum(g.payload)
			if f.Header != want || !bytes.Equal(f.Payload, g.payload) {
				t.Fatalf("decoded %+v %q, want %+v %q", f.Header, f.Payload, want, g.payload)
			}
		})
	}
}

// TestChecksumIsCRC32C pins the checksum to the standard CRC-32C check value.
func TestChecksumIsCRC32C(t *testing.T) {
	if got := Checksum([]byte("123456789")); got != 0xe3069283 {
		t.Fatalf("Checksum(\"123456789\") = 0x%08x, want 0xe3069283 (CRC-32C)", got)
	}
}

func TestRoundTripManyFrames(t *testing.T) {
	var stream bytes.Buffer
	for _, g := range goldenFrames {
		if err := Encode(&stream, g.h, g.payload); err != nil {
			t.Fatal(err)
		}
	}
	for _, g := range goldenFrames {
		f, err := Decode(&stream, DefaultMaxPayload)
		if err != nil {
			t.Fatalf("%s: %v", g.name, err)
		}
		if f.Op != g.h.Op || f.Seq != g.h.Seq || !bytes.Equal(f.Payload, g.payload) {
			t.Fatalf("%s: got %+v", g.name, f.Header)
		}
	}
	if _, err := Decode(&stream, DefaultMaxPayload); !errors.Is(err, io.EOF) {
		t.Fatalf("after the last frame: %v, want io.EOF", err)
	}
}

// frame encodes h and payload, then lets mutate alter the bytes. mutate may
// recompute the header checksum with fixCRC so a later check is reached.
func frame(h Header, payload []byte, mutate func(b []byte)) []byte {
	b := AppendFrame(nil, h, payload)
	if mutate != nil {
		mutate(b)
	}
	return b
}

func fixCRC(b []byte) {
	h := Checksum(b[:44])
	b[44], b[45], b[46], b[47] = byte(h>>24), byte(h>>16), byte(h>>8), byte(h)
}

func TestDecodeRejects(t *testing.T) {
	w := Header{Op: OpWrite, Seq: 1, Length: 4}
	cases := []struct {
		name string
		b    []byte
		max  uint32
		want error
	}{
		{"bad magic", frame(w, []byte("abcd"), func(b []byte) { b[0] = 'X' }), 1 << 20, ErrBadMagic},
		{"bad version", frame(w, []byte("abcd"), func(b []byte) { b[4] = 2; fixCRC(b) }), 1 << 20, ErrBadVersion},
		{"header bit flip", frame(w, []byte("abcd"), func(b []byte) { b[20] ^= 1 }), 1 << 20, ErrHeaderChecksum},
		{"unknown op", frame(w, []byte("abcd"), func(b []byte) { b[5] = 0x42; fixCRC(b) }), 1 << 20, ErrUnknownOp},
		{"unknown reply op", frame(w, []byte("abcd"), func(b []byte) { b[5] = 0x88; fixCRC(b) }), 1 << 20, ErrUnknownOp},
		{"unknown flag", frame(w, []byte("abcd"), func(b []byte) { b[6] = 0x80; fixCRC(b) }), 1 << 20, ErrUnknownFlags},
		{"unknown code", frame(Header{Op: OpWrite.Reply()}, nil, func(b []byte) { b[7] = 200; fixCRC(b) }), 1 << 20, ErrUnknownCode},
		{"oversize payload", frame(Header{Op: OpWrite, Length: 64}, make([]byte, 64), nil), 32, ErrPayloadTooLarge},
		{"huge payload length, no allocation", frame(Header{Op: OpWrite, Length: 4}, []byte("abcd"), func(b []byte) {
			b[36], b[37], b[38], b[39] = 0xff, 0xff, 0xff, 0xff
			fixCRC(b)
		}), DefaultMaxPayload, ErrPayloadTooLarge},
		{"payload bit flip", frame(w, []byte("abcd"), func(b []byte) { b[HeaderSize] ^= 1 }), 1 << 20, ErrPayloadChecksum},
		{"write length differs from payload", frame(Header{Op: OpWrite, Length: 8}, []byte("abcd"), nil), 1 << 20, ErrMalformed},
		{"read with payload", frame(Header{Op: OpRead, Length: 4}, []byte("abcd"), nil), 1 << 20, ErrMalformed},
		{"flush with length", frame(Header{Op: OpFlush, Length: 4}, nil, nil), 1 << 20, ErrMalformed},
		{"shared flag on a read", frame(Header{Op: OpRead, Flags: FlagShared, Length: 4}, nil, nil), 1 << 20, ErrMalformed},
		{"shared write with a 4-byte reference", frame(Header{Op: OpWrite, Flags: FlagShared, Length: 4096}, []byte("abcd"), nil), 1 << 20, ErrMalformed},
		{"shared write of no bytes", frame(Header{Op: OpWrite, Flags: FlagShared}, make([]byte, 8), nil), 1 << 20, ErrMalformed},
		{"attach with payload", frame(Header{Op: OpAttach, Length: 4}, []byte("abcd"), nil), 1 << 20, ErrMalformed},
		{"attach of no bytes", frame(Header{Op: OpAttach}, nil, nil), 1 << 20, ErrMalformed},
		{"FUA on a read", frame(Header{Op: OpRead, Flags: FlagFUA, Length: 4}, nil, nil), 1 << 20, ErrMalformed},
		{"request with error code", frame(Header{Op: OpPing, Code: CodeIO}, nil, nil), 1 << 20, ErrMalformed},
		{"read reply short", frame(Header{Op: OpRead.Reply(), Length: 8}, []byte("abcd"), nil), 1 << 20, ErrMalformed},
		{"snapshot read without a name", frame(Header{Op: OpSnapshotRead, Length: 4096}, nil, nil), 1 << 20, ErrMalformed},
		{"snapshot read of no bytes", frame(Header{Op: OpSnapshotRead}, []byte("s1"), nil), 1 << 20, ErrMalformed},
		{"snapshot read with a name too long", frame(Header{Op: OpSnapshotRead, Length: 4096}, make([]byte, MaxSnapshotNameLen+1), nil), 1 << 20, ErrMalformed},
		{"FUA on a snapshot read", frame(Header{Op: OpSnapshotRead, Flags: FlagFUA, Length: 4096}, []byte("s1"), nil), 1 << 20, ErrMalformed},
		{"snapshot read reply short", frame(Header{Op: OpSnapshotRead.Reply(), Length: 8}, []byte("abcd"), nil), 1 << 20, ErrMalformed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode(bytes.NewReader(tc.b), tc.max)
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
		})
	}
	t.Run("truncated header", func(t *testing.T) {
		b := frame(w, []byte("abcd"), nil)
		if _, err := Decode(bytes.NewReader(b[:20]), 1<<20); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("truncated payload", func(t *testing.T) {
		b := frame(w, []byte("abcd"), nil)
		if _, err := Decode(bytes.NewReader(b[:HeaderSize+2]), 1<<20); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("got %v", err)
		}
	})
}

func TestErrorsAreTyped(t *testing.T) {
	err := error(&RemoteError{Code: CodeStaleEpoch, Message: "replica epoch 8, request epoch 7"})
	if !errors.Is(err, CodeStaleEpoch) || errors.Is(err, CodeIO) {
		t.Fatalf("errors.Is does not follow the code: %v", err)
	}
	if !strings.Contains(err.Error(), "stale epoch: replica epoch 8") {
		t.Fatalf("message: %v", err)
	}
	for op := Op(0); op < 0xff; op++ {
		if op.Valid() != (strings.HasPrefix(op.String(), "op(") == false) {
			t.Fatalf("op 0x%02x: Valid %v but String %q", uint8(op), op.Valid(), op)
		}
	}
}

// FuzzDecode feeds arbitrary bytes to the decoder: it must never panic,
// never allocate beyond the bound, and every frame it accepts must encode
// back to the same bytes.
func FuzzDecode(f *testing.F) {
	for _, g := range goldenFrames {
		raw, _ := hex.DecodeString(g.hex)
		f.Add(raw)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		const max = 1 << 16
		r := bytes.NewReader(data)
		for {
			start := len(data) - r.Len()
			fr, err := Decode(r, max)
			if err != nil {
				return
			}
			if fr.PayloadLen > max || len(fr.Payload) != int(fr.PayloadLen) {
				t.Fatalf("accepted payload of %d bytes (header says %d)", len(fr.Payload), fr.PayloadLen)
			}
			end := len(data) - r.Len()
			again := AppendFrame(nil, fr.Header, fr.Payload)
			if !bytes.Equal(again, data[start:end]) {
				t.Fatalf("re-encoding differs:\n in  %x\n out %x", data[start:end], again)
			}
		}
	})
}
