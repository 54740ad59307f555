package devicekeeper

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Files are a session's descriptors, as plain descriptor numbers (never
// wrapped in an *os.File by the keeper: Go would add /dev/fuse to its
// poller, and os.File.Fd makes a descriptor blocking for every holder).
type Files struct {
	// FUSE is the connection's /dev/fuse.
	FUSE int
	// Loop is the loop device, open read-write.
	Loop int
	// File is the volume file in the FUSE mount, opened O_PATH: it keeps
	// the FUSE filesystem alive wherever the mount went, lets a successor
	// stat it (for a resize), and costs the server no request on close.
	File int
}

func (f Files) list() []int { return []int{f.FUSE, f.Loop, f.File} }

// Close closes the descriptors, /dev/fuse first: if this is the
// connection's last holder the kernel aborts it, so closing the loop
// device after (which may wait for its requests) does not wait for a
// server that is gone.
func (f Files) Close() {
	for _, fd := range f.list() {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

// filesFrom orders received descriptors as FUSE, Loop, File.
func filesFrom(fds []int) Files { return Files{FUSE: fds[0], Loop: fds[1], File: fds[2]} }

const (
	fuseMajor, fuseMinor = 10, 229    // /dev/fuse
	loopMajor            = 7          // /dev/loopN
	fuseSuperMagic       = 0x65735546 // FUSE_SUPER_MAGIC
)

// Check makes sure the descriptors are what s says they are: /dev/fuse, the
// loop device s.LoopPath names, attached to the file, which is in a FUSE
// filesystem. It asks the FUSE server nothing (the cached attributes
// suffice), so it does not wait for a server that is gone.
func Check(s Session, f Files) error {
	var st unix.Stat_t
	if err := unix.Fstat(f.FUSE, &st); err != nil {
		return fmt.Errorf("%w: the FUSE descriptor: %w", ErrInvalid, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(st.Rdev) != fuseMajor || unix.Minor(st.Rdev) != fuseMinor {
		return fmt.Errorf("%w: the FUSE descriptor is not /dev/fuse", ErrInvalid)
	}
	if err := unix.Fstat(f.Loop, &st); err != nil {
		return fmt.Errorf("%w: the loop descriptor: %w", ErrInvalid, err)
	}
	n, _ := strconv.Atoi(strings.TrimPrefix(s.LoopPath, "/dev/loop"))
	if st.Mode&unix.S_IFMT != unix.S_IFBLK || unix.Major(st.Rdev) != loopMajor || unix.Minor(st.Rdev) != uint32(n) {
		return fmt.Errorf("%w: the loop descriptor is not %s", ErrInvalid, s.LoopPath)
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(f.File, &sfs); err != nil {
		return fmt.Errorf("%w: the file descriptor: %w", ErrInvalid, err)
	}
	if sfs.Type != fuseSuperMagic {
		return fmt.Errorf("%w: the file descriptor is not in a FUSE filesystem", ErrInvalid)
	}
	var sx unix.Statx_t
	if err := unix.Statx(f.File, "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE|unix.STATX_INO, &sx); err != nil {
		return fmt.Errorf("%w: the file descriptor: %w", ErrInvalid, err)
	}
	if sx.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("%w: the file descriptor is not a regular file", ErrInvalid)
	}
	info, err := unix.IoctlLoopGetStatus64(f.Loop)
	if err != nil {
		return fmt.Errorf("%w: %s is not attached to a file: %w", ErrInvalid, s.LoopPath, err)
	}
	if info.Inode != sx.Ino || info.Device != unix.Mkdev(sx.Dev_major, sx.Dev_minor) {
		return fmt.Errorf("%w: %s is attached to another file than the one given", ErrInvalid, s.LoopPath)
	}
	return nil
}

// oobSpace is room for the ancillary data of one message: three
// descriptors. More are cut off by the kernel (MSG_CTRUNC), which closes
// them.
var oobSpace = unix.CmsgSpace(3 * 4)

// readMessage reads one datagram of at most MaxMessage bytes and the
// descriptors that came with it. A message cut short (too big, or with too
// many descriptors) is ErrInvalid; its descriptors are closed. Other
// errors are the connection's.
func readMessage(c *net.UnixConn, buf, oob []byte) ([]byte, []int, error) {
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, nil, err
	}
	fds, perr := parseRights(oob[:oobn])
	switch {
	case perr != nil:
		closeAll(fds)
		return nil, nil, fmt.Errorf("%w: ancillary data: %w", ErrInvalid, perr)
	case flags&unix.MSG_TRUNC != 0:
		closeAll(fds)
		return nil, nil, fmt.Errorf("%w: a message longer than %d bytes", ErrInvalid, MaxMessage)
	case flags&unix.MSG_CTRUNC != 0:
		closeAll(fds)
		return nil, nil, fmt.Errorf("%w: more than 3 descriptors", ErrInvalid)
	case n == 0 && oobn == 0:
		return nil, nil, errEOF // a SOCK_SEQPACKET peer that closed
	}
	return buf[:n], fds, nil
}

var errEOF = errors.New("connection closed")

// parseRights returns every descriptor passed in oob (SCM_RIGHTS).
func parseRights(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	var bad error
	for _, m := range msgs {
		if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS {
			bad = errors.New("ancillary data other than SCM_RIGHTS")
			continue
		}
		got, err := unix.ParseUnixRights(&m)
		if err != nil {
			bad = err
			continue
		}
		fds = append(fds, got...)
	}
	return fds, bad
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// writeMessage sends one message with descriptors (none if fds is empty).
func writeMessage(c *net.UnixConn, b []byte, fds []int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err := c.WriteMsgUnix(b, oob, nil)
	return err
}
