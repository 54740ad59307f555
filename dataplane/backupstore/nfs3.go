package backupstore

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"sync/atomic"
	"time"
)

// This file holds the NFSv3 (RFC 1813) and MOUNT v3 procedures the NFS
// target uses, over rpcConn.

const (
	nfsProg   = 100003
	nfsVers   = 3
	mountProg = 100005
	mountVers = 3

	mountProcMnt = 1

	nfsProcLookup      = 3
	nfsProcRead        = 6
	nfsProcWrite       = 7
	nfsProcCreate      = 8
	nfsProcMkdir       = 9
	nfsProcRemove      = 12
	nfsProcRename      = 14
	nfsProcReaddirplus = 17
	nfsProcFSInfo      = 19

	// nfsMaxIO bounds one READ or WRITE, whatever the server offers.
	nfsMaxIO = 1 << 20
	// nfsMaxFH is the longest NFSv3 file handle.
	nfsMaxFH = 64
	// nfsMaxName is the longest file name the target reads or writes.
	nfsMaxName = 255
	// nfsDirReply bounds one READDIRPLUS reply.
	nfsDirReply = 64 << 10

	nfsTypeReg = 1
	nfsTypeDir = 2
)

// nfsStatus is an NFSv3 or MOUNT v3 status other than OK.
type nfsStatus struct {
	proc   string
	status uint32
}

// NFS status codes with a meaning for the Target conventions.
const (
	nfsErrPerm        = 1
	nfsErrNoEnt       = 2
	nfsErrIO          = 5
	nfsErrAcces       = 13
	nfsErrExist       = 17
	nfsErrStale       = 70
	nfsErrServerFault = 10006
	nfsErrJukebox     = 10008
)

func (e *nfsStatus) Error() string { return fmt.Sprintf("NFS %s: status %d", e.proc, e.status) }

// Is makes a missing file ErrNotFound (and fs.ErrNotExist), a refusal
// fs.ErrPermission and an existing name fs.ErrExist.
func (e *nfsStatus) Is(target error) bool {
	switch e.status {
	case nfsErrNoEnt:
		return target == ErrNotFound || target == fs.ErrNotExist
	case nfsErrPerm, nfsErrAcces:
		return target == fs.ErrPermission
	case nfsErrExist:
		return target == fs.ErrExist
	}
	return false
}

// nfsError makes a non-OK status an error, marking those a retry may cure
// (a stale handle after a server restart, a busy or failing server).
func nfsError(proc string, status uint32) error {
	err := &nfsStatus{proc: proc, status: status}
	switch status {
	case nfsErrIO, nfsErrStale, nfsErrServerFault, nfsErrJukebox:
		return Transient(err)
	}
	return err
}

// nfsAttr is what the target uses of an fattr3.
type nfsAttr struct {
	typ   uint32
	size  uint64
	mtime time.Time
}

func (d *xdrDec) fattr() nfsAttr {
	var a nfsAttr
	a.typ = d.u32()
	d.take(4 * 4) // mode, nlink, uid, gid
	a.size = d.u64()
	d.take(8 + 8 + 8 + 8 + 8) // used, rdev, fsid, fileid, atime
	sec, nsec := d.u32(), d.u32()
	a.mtime = time.Unix(int64(sec), int64(nsec%1e9))
	d.take(8) // ctime
	return a
}

// postOpAttr reads a post_op_attr; ok says whether attributes followed.
func (d *xdrDec) postOpAttr() (a nfsAttr, ok bool) {
	if d.boolean() {
		return d.fattr(), true
	}
	return a, false
}

// wcc skips a wcc_data.
func (d *xdrDec) wcc() {
	if d.boolean() {
		d.take(8 + 8 + 8) // size, mtime, ctime
	}
	d.postOpAttr()
}

// fh reads an nfs_fh3.
func (d *xdrDec) fh() []byte {
	p := d.opaque(nfsMaxFH)
	if d.err != nil {
		return nil
	}
	if len(p) == 0 {
		d.err = fmt.Errorf("%w: empty file handle", errRPCMalformed)
		return nil
	}
	return append([]byte(nil), p...)
}

// name reads a filename3.
func (d *xdrDec) name() string { return string(d.opaque(nfsMaxName)) }

// status reads an NFS status; a non-OK one becomes an error.
func (d *xdrDec) status(proc string) error {
	st := d.u32()
	if d.err != nil {
		return d.err
	}
	if st != 0 {
		return nfsError(proc, st)
	}
	return nil
}

// nfsConnPool holds idle connections to the NFS service, so concurrent
// calls run on connections of their own and a broken connection is
// dropped, not reused.
type nfsConnPool struct {
	addr string
	auth rpcAuth
	idle chan *rpcConn
	// closed: connections of calls that end after close are closed, not
	// kept.
	closed atomic.Bool
}

func newNFSConnPool(addr string, auth rpcAuth, size int) *nfsConnPool {
	return &nfsConnPool{addr: addr, auth: auth, idle: make(chan *rpcConn, size)}
}

// call runs one NFSv3 procedure. The decoder is positioned after the
// status, which call has checked.
func (p *nfsConnPool) call(ctx context.Context, proc uint32, name string, args []byte) (*xdrDec, error) {
	var c *rpcConn
	select {
	case c = <-p.idle:
	default:
		var err error
		if c, err = dialRPC(ctx, p.addr, p.auth); err != nil {
			return nil, err
		}
	}
	d, err := c.call(ctx, nfsProg, nfsVers, proc, args)
	p.putBack(c)
	if err != nil {
		return nil, fmt.Errorf("NFS %s: %w", name, err)
	}
	if err := d.status(name); err != nil {
		return d, err
	}
	return d, nil
}

// putBack keeps c for the next call, or closes it: broken, the pool
// full, or the pool closed. A close that drained the pool just before c
// went in is seen after the put, and c is drained then.
func (p *nfsConnPool) putBack(c *rpcConn) {
	if c.broken || p.closed.Load() {
		_ = c.Close()
		return
	}
	select {
	case p.idle <- c:
		if p.closed.Load() {
			p.drain()
		}
	default:
		_ = c.Close()
	}
}

// close closes the idle connections, and those of calls still running
// when they end.
func (p *nfsConnPool) close() {
	p.closed.Store(true)
	p.drain()
}

func (p *nfsConnPool) drain() {
	for {
		select {
		case c := <-p.idle:
			_ = c.Close()
		default:
			return
		}
	}
}

func encDirop(dir []byte, name string) []byte {
	var e xdrEnc
	e.opaque(dir)
	e.str(name)
	return e.b
}

func (p *nfsConnPool) lookup(ctx context.Context, dir []byte, name string) ([]byte, nfsAttr, error) {
	d, err := p.call(ctx, nfsProcLookup, "LOOKUP", encDirop(dir, name))
	if err != nil {
		return nil, nfsAttr{}, err
	}
	fh := d.fh()
	attr, ok := d.postOpAttr()
	if d.err == nil && !ok {
		d.err = fmt.Errorf("%w: LOOKUP without attributes", errRPCMalformed)
	}
	return fh, attr, d.err
}

// sattrMode encodes a sattr3 that sets only the mode.
func sattrMode(e *xdrEnc, mode uint32) {
	e.boolean(true)
	e.u32(mode)
	e.boolean(false) // uid
	e.boolean(false) // gid
	e.boolean(false) // size
	e.u32(0)         // atime: don't change
	e.u32(0)         // mtime: don't change
}

// create makes a new file name in dir (GUARDED: fails if it exists).
func (p *nfsConnPool) create(ctx context.Context, dir []byte, name string) ([]byte, error) {
	e := xdrEnc{b: encDirop(dir, name)}
	e.u32(1) // GUARDED
	sattrMode(&e, 0o644)
	return p.newObject(ctx, dir, name, nfsProcCreate, "CREATE", e.b)
}

// mkdir makes directory name in dir.
func (p *nfsConnPool) mkdir(ctx context.Context, dir []byte, name string) ([]byte, error) {
	e := xdrEnc{b: encDirop(dir, name)}
	sattrMode(&e, 0o755)
	return p.newObject(ctx, dir, name, nfsProcMkdir, "MKDIR", e.b)
}

// newObject runs CREATE or MKDIR and returns the new object's handle,
// looking it up if the server did not return it.
func (p *nfsConnPool) newObject(ctx context.Context, dir []byte, name string, proc uint32, pname string, args []byte) ([]byte, error) {
	d, err := p.call(ctx, proc, pname, args)
	if err != nil {
		return nil, err
	}
	var fh []byte
	if d.boolean() {
		fh = d.fh()
	}
	if d.err != nil {
		return nil, fmt.Errorf("NFS %s: %w", pname, d.err)
	}
	if fh == nil {
		fh, _, err = p.lookup(ctx, dir, name)
	}
	return fh, err
}

// write writes data at off with FILE_SYNC (on stable storage when it
// returns) and returns how many bytes the server took.
func (p *nfsConnPool) write(ctx context.Context, fh []byte, off uint64, data []byte) (int, error) {
	var e xdrEnc
	e.opaque(fh)
	e.u64(off)
	e.u32(uint32(len(data)))
	e.u32(2) // FILE_SYNC
	e.opaque(data)
	d, err := p.call(ctx, nfsProcWrite, "WRITE", e.b)
	if err != nil {
		return 0, err
	}
	d.wcc()
	n, committed := d.u32(), d.u32()
	if d.err != nil {
		return 0, fmt.Errorf("NFS WRITE: %w", d.err)
	}
	if n > uint32(len(data)) || n == 0 {
		return 0, fmt.Errorf("NFS WRITE: %w: server took %d of %d bytes", errRPCMalformed, n, len(data))
	}
	if committed != 2 {
		return 0, fmt.Errorf("NFS WRITE: server committed at level %d, not FILE_SYNC", committed)
	}
	return int(n), nil
}

// read reads up to count bytes at off.
func (p *nfsConnPool) read(ctx context.Context, fh []byte, off uint64, count int) ([]byte, bool, error) {
	var e xdrEnc
	e.opaque(fh)
	e.u64(off)
	e.u32(uint32(count))
	d, err := p.call(ctx, nfsProcRead, "READ", e.b)
	if err != nil {
		return nil, false, err
	}
	d.postOpAttr()
	d.u32() // count, repeated by the data's length
	eof := d.boolean()
	data := d.opaque(count)
	if d.err != nil {
		return nil, false, fmt.Errorf("NFS READ: %w", d.err)
	}
	return data, eof, nil
}

func (p *nfsConnPool) remove(ctx context.Context, dir []byte, name string) error {
	_, err := p.call(ctx, nfsProcRemove, "REMOVE", encDirop(dir, name))
	return err
}

func (p *nfsConnPool) rename(ctx context.Context, dir []byte, from, to string) error {
	args := append(encDirop(dir, from), encDirop(dir, to)...)
	_, err := p.call(ctx, nfsProcRename, "RENAME", args)
	return err
}

// nfsEntry is one directory entry READDIRPLUS returned.
type nfsEntry struct {
	name    string
	attr    nfsAttr
	hasAttr bool
	fh      []byte
}

// readdirplus reads the entries of dir after cookie; it returns the
// entries, the cookie and verifier to continue with, and whether the
// directory is done.
func (p *nfsConnPool) readdirplus(ctx context.Context, dir []byte, cookie uint64, verf [8]byte) (ents []nfsEntry, next uint64, nextVerf [8]byte, eof bool, err error) {
	var e xdrEnc
	e.opaque(dir)
	e.u64(cookie)
	e.b = append(e.b, verf[:]...)
	e.u32(nfsDirReply / 2) // dircount
	e.u32(nfsDirReply)     // maxcount
	d, err := p.call(ctx, nfsProcReaddirplus, "READDIRPLUS", e.b)
	if err != nil {
		return nil, 0, verf, false, err
	}
	d.postOpAttr()
	copy(nextVerf[:], d.take(8))
	next = cookie
	for d.err == nil && d.boolean() {
		d.u64() // fileid
		ent := nfsEntry{name: d.name()}
		next = d.u64()
		ent.attr, ent.hasAttr = d.postOpAttr()
		if d.boolean() {
			ent.fh = d.fh()
		}
		ents = append(ents, ent)
	}
	eof = d.boolean()
	if d.err != nil {
		return nil, 0, verf, false, fmt.Errorf("NFS READDIRPLUS: %w", d.err)
	}
	if !eof && len(ents) == 0 {
		return nil, 0, verf, false, fmt.Errorf("NFS READDIRPLUS: %w: no entries and not at the end", errRPCMalformed)
	}
	return ents, next, nextVerf, eof, nil
}

// fsinfo returns the server's largest READ and WRITE sizes.
func (p *nfsConnPool) fsinfo(ctx context.Context, root []byte) (rtmax, wtmax uint32, err error) {
	var e xdrEnc
	e.opaque(root)
	d, err := p.call(ctx, nfsProcFSInfo, "FSINFO", e.b)
	if err != nil {
		return 0, 0, err
	}
	d.postOpAttr()
	rtmax = d.u32()
	d.take(8) // rtpref, rtmult
	wtmax = d.u32()
	return rtmax, wtmax, d.err
}

// ErrExportNotFound is returned (wrapped) when the NFS server's MOUNT
// service has no such export (MNT3ERR_NOENT).
var ErrExportNotFound = errors.New("NFS export not found")

// mount asks the MOUNT service at addr for the root handle of export.
func mount(ctx context.Context, addr string, auth rpcAuth, export string) ([]byte, error) {
	c, err := dialRPC(ctx, addr, auth)
	if err != nil {
		return nil, fmt.Errorf("NFS mount service: %w", err)
	}
	defer func() { _ = c.Close() }()
	var e xdrEnc
	e.str(export)
	d, err := c.call(ctx, mountProg, mountVers, mountProcMnt, e.b)
	if err != nil {
		return nil, fmt.Errorf("NFS mount service: %w", err)
	}
	switch st := d.u32(); {
	case d.err != nil:
		return nil, fmt.Errorf("NFS MNT: %w", d.err)
	case st == nfsErrNoEnt:
		return nil, fmt.Errorf("NFS MNT %s: %w", export, ErrExportNotFound)
	case st == nfsErrPerm || st == nfsErrAcces:
		return nil, fmt.Errorf("NFS MNT %s: server refused this client: %w", export, fs.ErrPermission)
	case st != 0:
		return nil, nfsError("MNT", st)
	}
	fh := d.fh()
	if d.err != nil {
		return nil, fmt.Errorf("NFS MNT: %w", d.err)
	}
	return fh, nil
}
