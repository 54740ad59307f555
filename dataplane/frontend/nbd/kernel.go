//go:build linux

package nbd

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The kernel's nbd driver is configured over generic netlink (family "nbd",
// linux/nbd-netlink.h). The driver does no handshake: it is handed
// connected sockets and speaks the transmission phase on them. We hand it
// one end of socket pairs whose other ends our Server serves.
const (
	nbdFamily  = "nbd"
	nbdVersion = 1

	nbdCmdConnect     = 1
	nbdCmdDisconnect  = 2
	nbdCmdReconfigure = 3

	nbdAttrIndex           = 1 // u32
	nbdAttrSizeBytes       = 2 // u64
	nbdAttrBlockSizeBytes  = 3 // u64
	nbdAttrTimeout         = 4 // u64, seconds
	nbdAttrServerFlags     = 5 // u64
	nbdAttrSockets         = 7 // nested NBD_SOCK_ITEMs
	nbdAttrDeadConnTimeout = 8 // u64, seconds
	nbdAttrBackend         = 10

	nbdSockItem = 1 // nested
	nbdSockFD   = 1 // u32

	nlaNested = 0x8000 // NLA_F_NESTED
)

// ErrNoKernelNBD means the kernel has no nbd driver: the module is not
// built or cannot be loaded. The NBD socket remains usable by userspace
// clients.
var ErrNoKernelNBD = errors.New("the kernel has no nbd driver (load it with `modprobe nbd`, or use the NBD socket or --frontend fuse)")

// KernelDriver reports whether the kernel has the nbd driver: nil, an
// error wrapping ErrNoKernelNBD, or why netlink could not tell.
func KernelDriver() error {
	nl, _, err := dialNBD()
	if err == nil {
		nl.close()
	}
	return err
}

// dialNBD opens generic netlink and looks up the nbd family.
func dialNBD() (*genl, uint16, error) {
	nl, err := dialGenl()
	if err != nil {
		return nil, 0, fmt.Errorf("netlink: %w", err)
	}
	family, err := nl.familyID(nbdFamily)
	if err != nil {
		nl.close()
		if errors.Is(err, unix.ENOENT) {
			return nil, 0, ErrNoKernelNBD
		}
		return nil, 0, fmt.Errorf("netlink: looking up the nbd family: %w", err)
	}
	return nl, family, nil
}

// KernelOptions configure ConnectKernel.
type KernelOptions struct {
	// Conns is how many sockets the kernel gets (it spreads requests over
	// them). Default 4.
	Conns int
	// TimeoutSeconds is the kernel's per-request timeout; 0 keeps its
	// default (30 s).
	TimeoutSeconds uint64
	// Backend names the device's backend in sysfs (the volume name);
	// FindKernelDevice finds the device by it.
	Backend string
	// DeadConnTimeoutSeconds is how long the kernel holds I/O once every
	// connection is gone (the engine died), waiting for a new engine to
	// reattach the device with ReattachKernel; 0 fails that I/O at once.
	DeadConnTimeoutSeconds uint64
}

// KernelDevice is a /dev/nbdN connected to a Server.
type KernelDevice struct {
	Index   int
	backend string // KernelOptions.Backend: the kernel wants it in every reconfigure
	nl      *genl
	family  uint16
	conns   []net.Conn
	once    sync.Once
	err     error
	done    sync.WaitGroup
}

// Path is the device node, /dev/nbdN.
func (d *KernelDevice) Path() string { return fmt.Sprintf("/dev/nbd%d", d.Index) }

// ConnectKernel attaches the server's device to a free /dev/nbdN through
// the kernel's nbd driver. It returns an error wrapping ErrNoKernelNBD when
// the driver is missing, and the kernel's error (EPERM without
// CAP_SYS_ADMIN, ...) otherwise.
func ConnectKernel(s *Server, opts KernelOptions) (*KernelDevice, error) {
	return attach(s, -1, opts)
}

// ReattachKernel gives /dev/nbd<index>, still configured but with every
// connection dead (its engine was killed), new connections served by s:
// the I/O the kernel held while waiting (see
// KernelOptions.DeadConnTimeoutSeconds) and the requests the dead engine
// never answered go to s, and whatever has the device open or mounted
// carries on. s must serve the same volume: the kernel keeps the flags
// it had, and takes s's size (a volume expanded after the device's
// engine last set it, e.g. one that died before it could, is not left
// smaller on the device).
func ReattachKernel(s *Server, index int, opts KernelOptions) (*KernelDevice, error) {
	return attach(s, index, opts)
}

// attach connects (index < 0) or reconfigures /dev/nbd<index>.
func attach(s *Server, index int, opts KernelOptions) (*KernelDevice, error) {
	if opts.Conns <= 0 {
		opts.Conns = 4
	}
	nl, family, err := dialNBD()
	if err != nil {
		return nil, err
	}
	d := &KernelDevice{backend: opts.Backend, nl: nl, family: family}
	var kernelEnds []int
	connected := false
	defer func() {
		for _, fd := range kernelEnds {
			unix.Close(fd) // the kernel holds its own reference once connected
		}
		if !connected {
			d.closeConns()
			nl.close()
		}
	}()
	for range opts.Conns {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("socketpair: %w", err)
		}
		kernelEnds = append(kernelEnds, fds[0])
		f := os.NewFile(uintptr(fds[1]), "nbd-kernel")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("socketpair: %w", err)
		}
		d.conns = append(d.conns, c)
	}
	what := "connecting /dev/nbdN"
	if index >= 0 {
		what = fmt.Sprintf("reattaching /dev/nbd%d", index)
		msg := reconfigureMessage(uint32(index), uint64(s.dev.Size()), opts, kernelEnds)
		if _, err := nl.request(family, nbdCmdReconfigure, msg); err != nil {
			return nil, kernelError(what, err)
		}
	} else {
		msg := connectMessage(uint64(s.dev.Size()), uint64(s.TransmissionFlags()), opts, kernelEnds)
		reply, err := nl.request(family, nbdCmdConnect, msg)
		if err != nil {
			return nil, kernelError(what, err)
		}
		i, ok := findU32(reply, nbdAttrIndex)
		if !ok {
			return nil, errors.New("connecting /dev/nbdN: the kernel's reply carries no device index")
		}
		index = int(i)
	}
	connected = true
	d.Index = index
	for _, c := range d.conns {
		d.done.Add(1)
		go func() { defer d.done.Done(); s.ServeTransmission(c) }()
	}
	return d, nil
}

func kernelError(what string, err error) error {
	if errors.Is(err, unix.EPERM) {
		return fmt.Errorf("%s: %w (it needs root or CAP_SYS_ADMIN)", what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// FindKernelDevice returns the index of the configured /dev/nbdN whose
// backend (KernelOptions.Backend) is name, from sysfs.
func FindKernelDevice(name string) (index int, found bool) {
	matches, _ := filepath.Glob("/sys/block/nbd*/backend")
	for _, m := range matches {
		b, err := os.ReadFile(m)
		if err != nil || strings.TrimSpace(string(b)) != name {
			continue
		}
		dir := filepath.Dir(m)
		if _, err := os.Stat(filepath.Join(dir, "pid")); err != nil {
			continue // not connected
		}
		if i, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(dir), "nbd")); err == nil {
			return i, true
		}
	}
	return 0, false
}

// Resize tells the kernel the device's new size (NBD_CMD_RECONFIGURE
// with the size), after the volume behind it grew: the kernel sets the
// disk's capacity and announces the change (a uevent), so a filesystem on
// it can then be grown online. The kernel does nothing when the size is
// the one it has.
func (d *KernelDevice) Resize(size int64) error {
	if size <= 0 || size%4096 != 0 {
		return fmt.Errorf("resizing %s to %d bytes: give a positive multiple of the 4096-byte block size", d.Path(), size)
	}
	msg := reconfigureMessage(uint32(d.Index), uint64(size), KernelOptions{Backend: d.backend}, nil)
	if _, err := d.nl.request(d.family, nbdCmdReconfigure, msg); err != nil {
		return kernelError(fmt.Sprintf("resizing %s to %d bytes", d.Path(), size), err)
	}
	return nil
}

// Disconnect detaches /dev/nbdN: the kernel fails new I/O, closes its
// sockets, and our side of them ends.
func (d *KernelDevice) Disconnect() error {
	d.once.Do(func() {
		var b attrs
		b.u32(nbdAttrIndex, uint32(d.Index))
		_, err := d.nl.request(d.family, nbdCmdDisconnect, b)
		d.closeConns()
		d.done.Wait()
		d.nl.close()
		if err != nil {
			d.err = fmt.Errorf("disconnecting %s: %w", d.Path(), err)
		}
	})
	return d.err
}

// Leave stops serving /dev/nbdN and leaves it attached, as an engine that
// died would, for the next engine of the volume to reattach
// (ReattachKernel): it stops reading requests, answers every request it
// has read, and only then closes its ends of the sockets. The kernel then
// finds every connection dead and holds the device's I/O for
// DeadConnTimeoutSeconds; the requests it had sent that were never read
// (still in a socket, or read in part) are sent again, to the next
// engine, when the kernel's request timeout fires for them.
func (d *KernelDevice) Leave() {
	d.once.Do(func() {
		d.stopReading()
		d.done.Wait()
		d.closeConns()
		d.nl.close()
	})
}

// stopReading ends each connection's request loop at its next read from
// the socket; the loop serves and answers the requests it already read
// before it returns (see Server.transmit).
func (d *KernelDevice) stopReading() {
	for _, c := range d.conns {
		_ = c.SetReadDeadline(time.Now())
	}
}

func (d *KernelDevice) closeConns() {
	for _, c := range d.conns {
		c.Close()
	}
}

// connectMessage is NBD_CMD_CONNECT's attributes.
func connectMessage(size, serverFlags uint64, opts KernelOptions, fds []int) attrs {
	var b attrs
	b.u64(nbdAttrSizeBytes, size)
	b.u64(nbdAttrBlockSizeBytes, 4096)
	b.u64(nbdAttrServerFlags, serverFlags)
	if opts.TimeoutSeconds > 0 {
		b.u64(nbdAttrTimeout, opts.TimeoutSeconds)
	}
	if opts.DeadConnTimeoutSeconds > 0 {
		b.u64(nbdAttrDeadConnTimeout, opts.DeadConnTimeoutSeconds)
	}
	if opts.Backend != "" {
		b.str(nbdAttrBackend, opts.Backend)
	}
	putSockets(&b, fds)
	return b
}

// reconfigureMessage is NBD_CMD_RECONFIGURE's attributes: the device, its
// backend (the kernel refuses a reconfigure without the one the device
// was connected with), its size (the kernel changes the capacity only if
// it differs), the timeouts given, and sockets to replace its dead ones
// (none for a resize).
func reconfigureMessage(index uint32, size uint64, opts KernelOptions, fds []int) attrs {
	var b attrs
	b.u32(nbdAttrIndex, index)
	if opts.Backend != "" {
		b.str(nbdAttrBackend, opts.Backend)
	}
	b.u64(nbdAttrSizeBytes, size)
	if opts.TimeoutSeconds > 0 {
		b.u64(nbdAttrTimeout, opts.TimeoutSeconds)
	}
	if opts.DeadConnTimeoutSeconds > 0 {
		b.u64(nbdAttrDeadConnTimeout, opts.DeadConnTimeoutSeconds)
	}
	if len(fds) > 0 {
		putSockets(&b, fds)
	}
	return b
}

func putSockets(b *attrs, fds []int) {
	socks := b.nest(nbdAttrSockets)
	for _, fd := range fds {
		item := b.nest(nbdSockItem)
		b.u32(nbdSockFD, uint32(fd))
		b.end(item)
	}
	b.end(socks)
}

// attrs builds netlink attributes: {len u16, type u16, value, pad to 4},
// integers in host byte order.
type attrs []byte

func (b *attrs) put(typ uint16, v []byte) {
	var h [4]byte
	binary.NativeEndian.PutUint16(h[0:], uint16(4+len(v)))
	binary.NativeEndian.PutUint16(h[2:], typ)
	*b = append(*b, h[:]...)
	*b = append(*b, v...)
	for len(*b)%4 != 0 {
		*b = append(*b, 0)
	}
}

//nolint:unparam // typ: a netlink attribute writer; the two u32 attributes sent today (NBD_ATTR_INDEX, NBD_SOCK_FD) both have type 1
func (b *attrs) u32(typ uint16, v uint32) { b.put(typ, binary.NativeEndian.AppendUint32(nil, v)) }
func (b *attrs) u64(typ uint16, v uint64) { b.put(typ, binary.NativeEndian.AppendUint64(nil, v)) }
func (b *attrs) str(typ uint16, v string) { b.put(typ, append([]byte(v), 0)) }

// nest starts a nested attribute and returns its position for end.
func (b *attrs) nest(typ uint16) int {
	at := len(*b)
	b.put(typ|nlaNested, nil)
	return at
}

func (b *attrs) end(at int) {
	binary.NativeEndian.PutUint16((*b)[at:], uint16(len(*b)-at))
}

// parseAttrs walks a flat attribute list; it stops at the first malformed
// attribute.
func parseAttrs(b []byte, fn func(typ uint16, v []byte)) {
	for len(b) >= 4 {
		n := int(binary.NativeEndian.Uint16(b[0:]))
		typ := binary.NativeEndian.Uint16(b[2:]) &^ (nlaNested | 0x4000)
		if n < 4 || n > len(b) {
			return
		}
		fn(typ, b[4:n])
		n = (n + 3) &^ 3
		if n > len(b) {
			return
		}
		b = b[n:]
	}
}

func findU32(b []byte, want uint16) (uint32, bool) {
	var v uint32
	var ok bool
	parseAttrs(b, func(typ uint16, val []byte) {
		if typ == want && len(val) >= 4 {
			v, ok = binary.NativeEndian.Uint32(val), true
		}
	})
	return v, ok
}

// genl is a generic netlink socket doing one request at a time.
type genl struct {
	mu  sync.Mutex
	fd  int
	seq uint32
}

func dialGenl() (*genl, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_GENERIC)
	if err != nil {
		return nil, err
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &genl{fd: fd}, nil
}

func (g *genl) close() { unix.Close(g.fd) }

// familyID resolves a generic netlink family name (asking for it lets the
// kernel load the module that provides it).
func (g *genl) familyID(name string) (uint16, error) {
	var b attrs
	b.str(unix.CTRL_ATTR_FAMILY_NAME, name)
	reply, err := g.request(unix.GENL_ID_CTRL, unix.CTRL_CMD_GETFAMILY, b)
	if err != nil {
		return 0, err
	}
	var id uint16
	parseAttrs(reply, func(typ uint16, v []byte) {
		if typ == unix.CTRL_ATTR_FAMILY_ID && len(v) >= 2 {
			id = binary.NativeEndian.Uint16(v)
		}
	})
	if id == 0 {
		return 0, fmt.Errorf("family %q: no id in the reply", name)
	}
	return id, nil
}

// request sends one generic netlink command with an ack requested and
// returns the attributes of the kernel's reply message (nil if it sent only
// the ack), or the kernel's error.
func (g *genl) request(family uint16, cmd uint8, body attrs) ([]byte, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.seq++
	msg := encodeGenl(family, cmd, g.seq, body)
	if err := unix.Sendto(g.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, err
	}
	var reply []byte
	buf := make([]byte, 64<<10)
	for {
		n, _, err := unix.Recvfrom(g.fd, buf, 0)
		if err != nil {
			return nil, err
		}
		done, attrs, err := decodeGenl(buf[:n], g.seq)
		if attrs != nil {
			reply = attrs
		}
		if err != nil || done {
			return reply, err
		}
	}
}

// encodeGenl frames a request: nlmsghdr (16 bytes), genlmsghdr (4 bytes),
// attributes.
func encodeGenl(family uint16, cmd uint8, seq uint32, body attrs) []byte {
	msg := make([]byte, 20, 20+len(body))
	binary.NativeEndian.PutUint32(msg[0:], uint32(20+len(body)))
	binary.NativeEndian.PutUint16(msg[4:], family)
	binary.NativeEndian.PutUint16(msg[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK)
	binary.NativeEndian.PutUint32(msg[8:], seq)
	msg[16] = cmd
	msg[17] = nbdVersion
	return append(msg, body...)
}

// decodeGenl reads the netlink messages in one datagram. It returns the
// attributes of a reply to seq, done once the ack (or an error) arrived,
// and the kernel's error as an errno.
func decodeGenl(b []byte, seq uint32) (done bool, reply []byte, err error) {
	for len(b) >= unix.NLMSG_HDRLEN {
		n := int(binary.NativeEndian.Uint32(b[0:]))
		typ := binary.NativeEndian.Uint16(b[4:])
		mseq := binary.NativeEndian.Uint32(b[8:])
		if n < unix.NLMSG_HDRLEN || n > len(b) {
			return true, reply, errors.New("malformed netlink reply")
		}
		body := b[unix.NLMSG_HDRLEN:n]
		if mseq == seq {
			switch typ {
			case unix.NLMSG_ERROR:
				if len(body) < 4 {
					return true, reply, errors.New("malformed netlink error")
				}
				if code := int32(binary.NativeEndian.Uint32(body)); code != 0 {
					return true, reply, unix.Errno(-code)
				}
				return true, reply, nil
			case unix.NLMSG_DONE:
				return true, reply, nil
			default:
				if len(body) >= 4 { // genlmsghdr, then attributes
					reply = append([]byte(nil), body[4:]...)
				}
			}
		}
		if n = (n + 3) &^ 3; n > len(b) {
			break
		}
		b = b[n:]
	}
	return false, reply, nil
}
