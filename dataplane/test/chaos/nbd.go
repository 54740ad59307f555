package chaos

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// nbdClient is a minimal NBD client (fixed newstyle, one request at a
// time) for the workload: each chaos client owns one connection.
type nbdClient struct {
	c      net.Conn
	size   int64
	handle uint64
}

// Command codes from the NBD protocol.
const (
	nbdRead  = 0
	nbdWrite = 1
	nbdDisc  = 2
	nbdFlush = 3
	nbdTrim  = 4
)

// errUnknown means the request may or may not have taken effect.
var errUnknown = errors.New("outcome unknown")

func dialNBD(sock, export string, timeout time.Duration) (*nbdClient, error) {
	c, err := net.DialTimeout("unix", sock, timeout)
	if err != nil {
		return nil, err
	}
	if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
		c.Close()
		return nil, err
	}
	hello := make([]byte, 18)
	if _, err := io.ReadFull(c, hello); err != nil {
		c.Close()
		return nil, err
	}
	b := binary.BigEndian.AppendUint32(nil, 3) // fixed newstyle, no zeroes
	b = binary.BigEndian.AppendUint64(b, 0x49484156454f5054)
	b = binary.BigEndian.AppendUint32(b, 1) // EXPORT_NAME
	b = binary.BigEndian.AppendUint32(b, uint32(len(export)))
	b = append(b, export...)
	if _, err := c.Write(b); err != nil {
		c.Close()
		return nil, err
	}
	info := make([]byte, 10)
	if _, err := io.ReadFull(c, info); err != nil {
		c.Close()
		return nil, err
	}
	return &nbdClient{c: c, size: int64(binary.BigEndian.Uint64(info))}, nil
}

// do sends one request and waits for its reply. A transport failure after
// the request may have been sent returns an error wrapping errUnknown.
func (n *nbdClient) do(typ uint16, off int64, length int, payload []byte, timeout time.Duration) ([]byte, error) {
	n.handle++
	if err := n.c.SetDeadline(time.Now().Add(timeout)); err != nil {
		return nil, err // nothing sent
	}
	h := binary.BigEndian.AppendUint32(nil, 0x25609513)
	h = binary.BigEndian.AppendUint16(h, 0)
	h = binary.BigEndian.AppendUint16(h, typ)
	h = binary.BigEndian.AppendUint64(h, n.handle)
	h = binary.BigEndian.AppendUint64(h, uint64(off))
	h = binary.BigEndian.AppendUint32(h, uint32(length))
	bufs := net.Buffers{h}
	if payload != nil {
		bufs = append(bufs, payload)
	}
	if _, err := bufs.WriteTo(n.c); err != nil {
		return nil, fmt.Errorf("%w: send: %w", errUnknown, err)
	}
	r := make([]byte, 16)
	if _, err := io.ReadFull(n.c, r); err != nil {
		return nil, fmt.Errorf("%w: reply: %w", errUnknown, err)
	}
	if binary.BigEndian.Uint64(r[8:]) != n.handle {
		return nil, fmt.Errorf("%w: reply to another request", errUnknown)
	}
	if e := binary.BigEndian.Uint32(r[4:]); e != 0 {
		// The server answered with an error: for a write, it may have
		// reached some replica, so its outcome is still unknown.
		return nil, fmt.Errorf("%w: server error %d", errUnknown, e)
	}
	if typ != nbdRead {
		return nil, nil
	}
	data := make([]byte, length)
	if _, err := io.ReadFull(n.c, data); err != nil {
		return nil, fmt.Errorf("%w: read data: %w", errUnknown, err)
	}
	return data, nil
}

func (n *nbdClient) close() {
	_, _ = n.do(nbdDisc, 0, 0, nil, time.Second) // DISC has no reply: this ends in an error by design
	n.c.Close()
}
