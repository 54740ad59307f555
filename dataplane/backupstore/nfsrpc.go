package backupstore

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"sync/atomic"
	"time"
)

// This file holds the ONC RPC (RFC 5531) client the NFS target speaks over
// TCP, with the XDR (RFC 4506) encoding it needs. Every length read from
// the network is checked against a bound before anything is allocated.

// rpcMaxRecord bounds one reply record: the largest reply the NFS target
// asks for is a READ of nfsMaxIO bytes, plus headers and attributes.
const rpcMaxRecord = nfsMaxIO + 64<<10

// errRPCMalformed is a reply that does not decode.
var errRPCMalformed = errors.New("malformed RPC reply")

// xdrEnc appends XDR items to a buffer.
type xdrEnc struct{ b []byte }

func (e *xdrEnc) u32(v uint32) { e.b = binary.BigEndian.AppendUint32(e.b, v) }
func (e *xdrEnc) u64(v uint64) { e.b = binary.BigEndian.AppendUint64(e.b, v) }

func (e *xdrEnc) boolean(v bool) {
	if v {
		e.u32(1)
	} else {
		e.u32(0)
	}
}

// opaque appends variable-length opaque data (a length, the bytes, padding).
func (e *xdrEnc) opaque(p []byte) {
	e.u32(uint32(len(p)))
	e.b = append(e.b, p...)
	e.b = append(e.b, make([]byte, pad4(len(p)))...)
}

func (e *xdrEnc) str(s string) { e.opaque([]byte(s)) }

func pad4(n int) int { return (4 - n%4) % 4 }

// xdrDec reads XDR items from a reply. The first short read sets err and
// every later read returns zero values, so a caller checks err once.
type xdrDec struct {
	b   []byte
	err error
}

func (d *xdrDec) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n < 0 || n > len(d.b) {
		d.err = errRPCMalformed
		return nil
	}
	p := d.b[:n]
	d.b = d.b[n:]
	return p
}

func (d *xdrDec) u32() uint32 {
	p := d.take(4)
	if p == nil {
		return 0
	}
	return binary.BigEndian.Uint32(p)
}

func (d *xdrDec) u64() uint64 {
	p := d.take(8)
	if p == nil {
		return 0
	}
	return binary.BigEndian.Uint64(p)
}

func (d *xdrDec) boolean() bool { return d.u32() != 0 }

// opaque reads variable-length opaque data of at most max bytes. The
// result aliases the reply buffer.
func (d *xdrDec) opaque(max int) []byte {
	n := d.u32()
	if d.err != nil {
		return nil
	}
	if n > uint32(max) {
		d.err = fmt.Errorf("%w: %d-byte item, at most %d allowed", errRPCMalformed, n, max)
		return nil
	}
	p := d.take(int(n))
	d.take(pad4(int(n)))
	return p
}

// rpcAuth is the credential sent with every call: AUTH_UNIX with the
// given ids, as NFS servers expect (AUTH_NULL maps to nobody).
type rpcAuth struct {
	machine  string
	uid, gid uint32
}

func (a rpcAuth) encode(e *xdrEnc) {
	var body xdrEnc
	body.u32(0) // stamp
	body.str(a.machine)
	body.u32(a.uid)
	body.u32(a.gid)
	body.u32(0) // no supplementary groups
	e.u32(1)    // AUTH_UNIX
	e.opaque(body.b)
}

// rpcXID numbers calls; a reply must carry the number of its call.
var rpcXID atomic.Uint32

func init() { rpcXID.Store(uint32(time.Now().UnixNano())) }

// rpcConn is one TCP connection to an RPC service. It runs one call at a
// time; a call that fails in any way other than a decoded reply leaves
// the connection unusable (broken), so a late reply can never be taken
// for the answer to a later call.
type rpcConn struct {
	conn   net.Conn
	auth   rpcAuth
	broken bool
}

// dialRPC connects to addr within ctx.
func dialRPC(ctx context.Context, addr string, auth rpcAuth) (*rpcConn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, Transient(fmt.Errorf("connect to %s: %w", addr, err))
	}
	return &rpcConn{conn: c, auth: auth}, nil
}

func (c *rpcConn) Close() error { return c.conn.Close() }

// call sends one call of procedure proc of program prog, version vers,
// with args already XDR-encoded, and returns a decoder positioned at the
// procedure's result. The connection's deadline follows ctx.
func (c *rpcConn) call(ctx context.Context, prog, vers, proc uint32, args []byte) (*xdrDec, error) {
	if c.broken {
		return nil, Transient(errors.New("RPC connection is broken"))
	}
	if err := ctx.Err(); err != nil {
		return nil, Transient(err)
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = c.conn.SetDeadline(dl)
	} else {
		_ = c.conn.SetDeadline(time.Time{})
	}
	// Registered after the deadline is set, so that a cancellation is
	// never overwritten by it. A callback that ran (or is running) has
	// set a past deadline on the connection: it is not used again.
	stop := context.AfterFunc(ctx, func() { _ = c.conn.SetDeadline(time.Unix(1, 0)) })
	defer func() {
		if !stop() {
			c.broken = true
		}
	}()
	xid := rpcXID.Add(1)
	var e xdrEnc
	e.u32(0) // record mark, filled below
	e.u32(xid)
	e.u32(0) // CALL
	e.u32(2) // RPC version
	e.u32(prog)
	e.u32(vers)
	e.u32(proc)
	c.auth.encode(&e)
	e.u32(0) // verifier: AUTH_NULL
	e.u32(0)
	e.b = append(e.b, args...)
	binary.BigEndian.PutUint32(e.b, 0x80000000|uint32(len(e.b)-4))
	rec, err := c.roundTrip(e.b)
	if err != nil {
		c.broken = true
		if errors.Is(err, errRPCMalformed) {
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, Transient(fmt.Errorf("%w: %w", ctx.Err(), err))
		}
		return nil, Transient(err)
	}
	d := &xdrDec{b: rec}
	if err := checkReply(d, xid); err != nil {
		c.broken = true
		return nil, err
	}
	return d, nil
}

func (c *rpcConn) roundTrip(req []byte) ([]byte, error) {
	if _, err := c.conn.Write(req); err != nil {
		return nil, err
	}
	return readRecord(c.conn, rpcMaxRecord)
}

// rpcMaxFragments bounds the fragments of one record: a server that
// sends empty fragments without end is cut off.
const rpcMaxFragments = 1024

// readRecord reads one record (RFC 5531 record marking: fragments, the
// last flagged in its header) of at most max bytes.
func readRecord(r io.Reader, max int) ([]byte, error) {
	var rec []byte
	for frag := 0; ; frag++ {
		if frag >= rpcMaxFragments {
			return nil, fmt.Errorf("%w: record of more than %d fragments", errRPCMalformed, rpcMaxFragments)
		}
		var hdr [4]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return nil, err
		}
		h := binary.BigEndian.Uint32(hdr[:])
		n := int(h & 0x7fffffff)
		if n > max-len(rec) {
			return nil, fmt.Errorf("%w: record longer than %d bytes", errRPCMalformed, max)
		}
		start := len(rec)
		rec = append(rec, make([]byte, n)...)
		if _, err := io.ReadFull(r, rec[start:]); err != nil {
			return nil, err
		}
		if h&0x80000000 != 0 {
			return rec, nil
		}
	}
}

// errRPCAuth is a call the server refused for its credentials (AUTH_ERROR),
// such as a Linux server refusing a client on an unprivileged port.
var errRPCAuth = fmt.Errorf("RPC credentials refused: %w", fs.ErrPermission)

// checkReply reads the reply header up to the procedure's result.
func checkReply(d *xdrDec, xid uint32) error {
	gotXID, mtype, stat := d.u32(), d.u32(), d.u32()
	if d.err != nil {
		return d.err
	}
	if gotXID != xid || mtype != 1 {
		return fmt.Errorf("%w: xid %d type %d for call %d", errRPCMalformed, gotXID, mtype, xid)
	}
	if stat > 1 {
		return fmt.Errorf("%w: reply_stat %d", errRPCMalformed, stat)
	}
	if stat == 1 { // MSG_DENIED
		if d.u32() == 1 {
			return fmt.Errorf("%w (auth_stat %d)", errRPCAuth, d.u32())
		}
		return errors.New("RPC version mismatch")
	}
	d.u32()       // verifier flavor
	d.opaque(400) // verifier body
	accept := d.u32()
	if d.err != nil {
		return d.err
	}
	switch accept {
	case 0:
		return nil
	case 1:
		return errors.New("RPC program unavailable on this port")
	case 2:
		return fmt.Errorf("RPC program version unavailable (server offers %d to %d)", d.u32(), d.u32())
	case 3:
		return errors.New("RPC procedure unavailable")
	case 4:
		return errors.New("RPC server could not decode the arguments")
	default:
		return Transient(fmt.Errorf("RPC server error (accept_stat %d)", accept))
	}
}

// Portmapper (RFC 1833, version 2) program numbers the NFS target needs.
const (
	pmapProg        = 100000
	pmapVers        = 2
	pmapProcGetport = 3
	pmapPort        = 111
	ipprotoTCP      = 6
)

// pmapGetport asks the portmapper at addr which TCP port of host serves
// prog/vers.
func pmapGetport(ctx context.Context, host, addr string, prog, vers uint32) (int, error) {
	c, err := dialRPC(ctx, addr, rpcAuth{})
	if err != nil {
		return 0, fmt.Errorf("portmapper: %w", err)
	}
	defer func() { _ = c.Close() }()
	var e xdrEnc
	e.u32(prog)
	e.u32(vers)
	e.u32(ipprotoTCP)
	e.u32(0)
	d, err := c.call(ctx, pmapProg, pmapVers, pmapProcGetport, e.b)
	if err != nil {
		return 0, fmt.Errorf("portmapper: %w", err)
	}
	port := d.u32()
	if d.err != nil {
		return 0, fmt.Errorf("portmapper: %w", d.err)
	}
	if port == 0 || port > 65535 {
		return 0, fmt.Errorf("portmapper on %s: program %d version %d is not registered for TCP", host, prog, vers)
	}
	return int(port), nil
}
