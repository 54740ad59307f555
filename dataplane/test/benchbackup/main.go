// Command benchbackup measures backups (issue #28) against a plain S3
// client, in one run, on one versitygw server on 127.0.0.1 over a directory
// of the same disk (as the backup tests run it):
//
//	backup       a real replica process holds --size bytes of random data
//	             in a snapshot; snapshotsource.Backup (the manager's and
//	             `cairn-data backup`'s code) reads it over the replica's
//	             data port (snapshotsource.DataPort) and uploads it through
//	             the backup store; and twice more: reading over the control
//	             API (SnapshotRead), the path without a DataPort, and with
//	             puts that carry a CRC32C instead of Content-MD5
//	             (backupstore.S3ChecksumCRC32C)
//	plain upload the same bytes, from a file, as objects of the store's
//	             block size (2 MiB) with minio-go PutObject, as many at once
//	             as the store (its default concurrency, 4)
//	restore      the store's restore into a new sparse file, then fsync
//	             (what `cairn-data restore --to FILE` does)
//	plain download  the plain upload's objects, GetObject the same number at
//	             once, written at their offsets into a new file, then fsync
//	incremental  after changing 1 % of the volume, once as one contiguous
//	             range and once as 4 KiB writes at random offsets
//
// Each round does every measurement (the pairs in alternating order); the
// table shows each figure's median over --rounds rounds, with the CPU time
// this process (the store), the replica and versitygw spent.
//
// Usage (make bench-backup does this): go run ./test/benchbackup --bin ../bin/cairn-data
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/minio/minio-go/v7"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/snapshotsource"
	"github.com/cairn-io/cairn/dataplane/testutil/procstat"
	"github.com/cairn-io/cairn/dataplane/testutil/versitygw"
)

var (
	bin        = flag.String("bin", "bin/cairn-data", "cairn-data binary")
	workDir    = flag.String("dir", "", "work directory on the disk to measure (default: a temporary directory)")
	sizeFlag   = flag.String("size", "1G", "volume size: a multiple of 2M, at least 16M (suffixes K, M, G, T; KiB, Mi, ... too)")
	rounds     = flag.Int("rounds", 3, "rounds; the table shows each figure's median")
	cpuprofile = flag.String("cpuprofile", "", "write CPU profiles of this process during the first round's full backup and restore to PREFIX.backup.pprof and PREFIX.restore.pprof")
)

const (
	blockSize = backupstore.DefaultBlockSize
	bucket    = "bench"
	epoch     = 1
)

func main() {
	flag.Parse()
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench-backup:", err)
		os.Exit(1)
	}
}

// run measures and prints the table; it stops the processes it started
// and removes its temporary directory whatever happens.
func run() error {
	size, err := parseSize(*sizeFlag)
	if err != nil {
		return err
	}
	if size%blockSize != 0 || size < 16<<20 {
		return fmt.Errorf("--size %s: want a multiple of %d bytes, at least 16M", *sizeFlag, blockSize)
	}
	if *rounds < 1 {
		return errors.New("--rounds must be at least 1")
	}
	work := *workDir
	if work == "" {
		if work, err = os.MkdirTemp("", "cairn-bench-backup-"); err != nil {
			return err
		}
		defer os.RemoveAll(work)
	}
	b, err := setUp(work, size)
	if err != nil {
		return err
	}
	defer b.stop()
	var all []roundResult
	for r := 1; r <= *rounds; r++ {
		res, err := b.round(r)
		if err != nil {
			return fmt.Errorf("round %d: %w", r, err)
		}
		all = append(all, res)
		fmt.Fprintf(os.Stderr, "round %d: %s\n", r, res.summary())
	}
	printTable(os.Stdout, size, all)
	return nil
}

// parseSize reads a byte count with an optional binary suffix: K, M, G, T
// (each also as Ki, KiB, KB, ...), all powers of 1024.
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	num := strings.TrimRightFunc(t, func(r rune) bool { return r < '0' || r > '9' })
	unit := strings.ToUpper(strings.TrimSuffix(strings.TrimSuffix(t[len(num):], "B"), "i"))
	shift := map[string]uint{"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
	sh, ok := shift[unit]
	n, err := strconv.ParseInt(num, 10, 64)
	if !ok || err != nil || n <= 0 {
		return 0, fmt.Errorf("size %q: want a positive number with an optional K, M, G or T suffix", s)
	}
	if n > (1<<62)>>sh {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return n << sh, nil
}

// bench holds what every round uses: the S3 server, the replica (and a
// mirror file holding the same bytes as its latest snapshot), the store.
type bench struct {
	work, s3root string
	size         int64
	srv          *versitygw.Server
	replica      *exec.Cmd
	ctl          replicav1.ReplicaServiceClient
	data         *dataconn.Client
	src          *snapshotsource.Client // reads over the data port
	srcControl   *snapshotsource.Client // reads over the control API
	store        *backupstore.Store     // puts carry Content-MD5 (the default)
	storeCRC     *backupstore.Store     // puts carry x-amz-checksum-crc32c
	mirror       *os.File
	snap         string // the replica's latest snapshot
	snaps        int
	rng          *rand.Rand
}

func setUp(work string, size int64) (*bench, error) {
	b := &bench{work: work, size: size, rng: rand.New(rand.NewPCG(1, 2))}
	srv, err := versitygw.Start(versitygw.Options{Dir: filepath.Join(work, "s3"), Bucket: bucket})
	if err != nil {
		return nil, err
	}
	b.srv, b.s3root = srv, filepath.Join(work, "s3", "root", bucket)
	if err := b.startReplica(); err != nil {
		b.stop()
		return nil, err
	}
	b.store, err = newStore(srv, backupstore.S3ChecksumMD5)
	if err == nil {
		b.storeCRC, err = newStore(srv, backupstore.S3ChecksumCRC32C)
	}
	if err == nil {
		err = b.fill()
	}
	if err != nil {
		b.stop()
		return nil, err
	}
	return b, nil
}

// newStore opens the store on the server with the checksum its puts carry.
func newStore(srv *versitygw.Server, sum backupstore.S3Checksum) (*backupstore.Store, error) {
	tg, err := backupstore.NewS3Target(backupstore.S3Config{Endpoint: srv.Endpoint, Bucket: bucket, Region: versitygw.Region,
		PathStyle: true, AccessKeyID: versitygw.AccessKey, SecretAccessKey: versitygw.SecretKey, Checksum: sum})
	if err != nil {
		return nil, err
	}
	return backupstore.New(tg, backupstore.Options{Log: logr.Discard()})
}

// startReplica runs a replica process and connects to its data and control
// ports, as the tests of cairn-data backup do.
func (b *bench) startReplica() error {
	b.replica = exec.Command(*bin, "replica", "--dir", filepath.Join(b.work, "replica"), "--size", strconv.FormatInt(b.size, 10),
		"--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	out, err := b.replica.StdoutPipe()
	if err != nil {
		return err
	}
	b.replica.Stderr = os.Stderr
	if err := b.replica.Start(); err != nil {
		return err
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		return fmt.Errorf("replica did not start: %w", err)
	}
	f := map[string]string{}
	for _, kv := range strings.Fields(line) {
		if k, v, ok := strings.Cut(kv, "="); ok {
			f[k] = v
		}
	}
	cc, err := grpc.NewClient(f["control"], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	b.ctl = replicav1.NewReplicaServiceClient(cc)
	if _, err := b.ctl.SetEpoch(context.Background(), &replicav1.SetEpochRequest{Epoch: epoch}); err != nil {
		return err
	}
	if b.data, err = dataconn.Dial(context.Background(), "tcp", f["data"], dataconn.ClientOptions{Conns: 2}); err != nil {
		return err
	}
	b.data.SetEpoch(epoch)
	if b.src, err = snapshotsource.Dial(f["control"], grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		return err
	}
	b.src.DataPort = &snapshotsource.DataPort{Address: f["data"], Logger: logr.Discard()}
	b.srcControl, err = snapshotsource.Dial(f["control"], grpc.WithTransportCredentials(insecure.NewCredentials()))
	return err
}

func (b *bench) stop() {
	if b.replica != nil && b.replica.Process != nil {
		stopProcess(b.replica)
	}
	if b.srv != nil {
		b.srv.Stop()
	}
	if b.mirror != nil {
		_ = b.mirror.Close()
	}
}

// stopProcess stops cmd with SIGTERM, so that a replica run with
// CAIRN_CPUPROFILE writes its profile, and kills it if it has not exited
// within 10 s.
func stopProcess(cmd *exec.Cmd) {
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait() // stopped by a signal: the error says so
		close(done)
	}()
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// fill writes random (incompressible) bytes over the whole volume, to the
// replica and to the mirror file, and snapshots the replica.
func (b *bench) fill() error {
	var err error
	if b.mirror, err = os.Create(filepath.Join(b.work, "mirror.img")); err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	for off := int64(0); off < b.size; off += int64(len(buf)) {
		b.random(buf)
		if err := b.write(buf, off); err != nil {
			return err
		}
	}
	return b.snapshot()
}

func (b *bench) random(p []byte) {
	for i := 0; i+8 <= len(p); i += 8 {
		v := b.rng.Uint64()
		for k := range 8 {
			p[i+k] = byte(v >> (8 * k))
		}
	}
}

// write writes p at off to the replica (in writes of at most 1 MiB, under
// the data port's limit) and the mirror.
func (b *bench) write(p []byte, off int64) error {
	for done := 0; done < len(p); done += 1 << 20 {
		chunk := p[done:min(len(p), done+1<<20)]
		if err := b.data.WriteAt(context.Background(), chunk, off+int64(done), false); err != nil {
			return err
		}
	}
	_, err := b.mirror.WriteAt(p, off)
	return err
}

func (b *bench) snapshot() error {
	ctx := context.Background()
	if err := b.data.Flush(ctx); err != nil {
		return err
	}
	b.snaps++
	name := fmt.Sprintf("s%d", b.snaps)
	if _, err := b.ctl.SnapshotCreate(ctx, &replicav1.SnapshotCreateRequest{Name: name, UserCreated: true, Epoch: epoch}); err != nil {
		return err
	}
	b.snap = name
	return nil
}

// cpu is CPU time spent by this process, the replica and versitygw.
type cpu struct{ self, replica, s3 time.Duration }

func (b *bench) cpuNow() cpu {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	self := time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	return cpu{self: self, replica: procCPU(b.replica.Process.Pid), s3: procCPU(versitygwPid(b.s3root))}
}

func (c cpu) sub(d cpu) cpu { return cpu{c.self - d.self, c.replica - d.replica, c.s3 - d.s3} }

// procCPU is a process's user and system time from /proc (0 if unknown).
func procCPU(pid int) time.Duration {
	if pid <= 0 {
		return 0
	}
	st, err := procstat.Read(pid)
	if err != nil {
		return 0
	}
	return st.CPU
}

var (
	s3PidOnce sync.Once
	s3Pid     int
)

// versitygwPid finds the versitygw serving root by its command line.
func versitygwPid(root string) int {
	s3PidOnce.Do(func() {
		dirs, _ := os.ReadDir("/proc")
		for _, d := range dirs {
			pid, err := strconv.Atoi(d.Name())
			if err != nil {
				continue
			}
			cmd, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
			if bytes.Contains(cmd, []byte("posix\x00"+filepath.Dir(root))) {
				s3Pid = pid
				return
			}
		}
	})
	return s3Pid
}

// measure is one timed operation.
type measure struct {
	d         time.Duration
	cpu       cpu
	read, put int64 // bytes read from the source, uploaded (incrementals)
}

func (b *bench) timed(fn func() (int64, int64, error)) (measure, error) {
	c0, t0 := b.cpuNow(), time.Now()
	read, put, err := fn()
	return measure{d: time.Since(t0), cpu: b.cpuNow().sub(c0), read: read, put: put}, err
}

// sortedMedian is the median of xs.
func sortedMedian(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// waitAll runs fn(i) for i in [0, n) with k at once; the first error wins.
func waitAll(n, k int, fn func(i int) error) error {
	jobs := make(chan int)
	errs := make(chan error, k)
	var wg sync.WaitGroup
	for range k {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var first error
			for i := range jobs {
				if first == nil {
					first = fn(i)
				}
			}
			errs <- first
		}()
	}
	for i := range n {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	close(errs)
	var err error
	for e := range errs {
		err = errors.Join(err, e)
	}
	return err
}

func (b *bench) plainKey(r, i int) string { return fmt.Sprintf("plain/%d/%06d", r, i) }

// plainUpload puts the mirror's bytes as objects of blockSize, as many at
// once as the store.
func (b *bench) plainUpload(r int) (int64, int64, error) {
	n := int(b.size / blockSize)
	bufs := make(chan []byte, 8)
	err := waitAll(n, 4, func(i int) error {
		var buf []byte
		select {
		case buf = <-bufs:
		default:
			buf = make([]byte, blockSize)
		}
		defer func() { bufs <- buf }()
		if _, err := b.mirror.ReadAt(buf, int64(i)*blockSize); err != nil {
			return err
		}
		_, err := b.srv.Client.PutObject(context.Background(), bucket, b.plainKey(r, i), bytes.NewReader(buf), blockSize,
			minio.PutObjectOptions{ContentType: "application/octet-stream"})
		return err
	})
	return b.size, b.size, err
}

// plainDownload gets the plain upload's objects into a new file at their
// offsets, then syncs it.
func (b *bench) plainDownload(r int, path string) (int64, int64, error) {
	f, err := newSparse(path, b.size)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	bufs := make(chan []byte, 8)
	err = waitAll(int(b.size/blockSize), 4, func(i int) error {
		var buf []byte
		select {
		case buf = <-bufs:
		default:
			buf = make([]byte, blockSize)
		}
		defer func() { bufs <- buf }()
		obj, err := b.srv.Client.GetObject(context.Background(), bucket, b.plainKey(r, i), minio.GetObjectOptions{})
		if err != nil {
			return err
		}
		defer obj.Close()
		if _, err := io.ReadFull(obj, buf); err != nil {
			return err
		}
		_, err = f.WriteAt(buf, int64(i)*blockSize)
		return err
	})
	if err == nil {
		err = f.Sync()
	}
	return b.size, b.size, err
}

func newSparse(path string, size int64) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// backup backs the latest snapshot up through snapshotsource, as the
// manager does, reading over src; with a base, incrementally.
func (b *bench) backup(store *backupstore.Store, src *snapshotsource.Client, vol, name, baseSnap, baseBackup string) (int64, int64, error) {
	res, err := snapshotsource.Backup(context.Background(), store, src, snapshotsource.BackupOptions{
		Volume: vol, Name: name, Snapshot: b.snap, BaseSnapshot: baseSnap, BaseBackup: baseBackup, BlockSize: blockSize,
	})
	if err != nil {
		return 0, 0, err
	}
	if src.DataPort != nil {
		if used, why := src.DataPortInUse(); !used {
			return 0, 0, fmt.Errorf("the backup did not read over the data port: %w", why)
		}
	}
	return res.ReadBytes, res.Info.NewBytes, nil
}

// restore restores a backup into a new sparse file and syncs it, as
// `cairn-data restore --to FILE` does.
func (b *bench) restore(vol, name, path string) (int64, int64, error) {
	f, err := newSparse(path, b.size)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	if _, err := b.store.Restore(context.Background(), backupstore.RestoreOptions{Volume: vol, Name: name, Dest: f}); err != nil {
		return 0, 0, err
	}
	return b.size, b.size, f.Sync()
}

// sameAsMirror checks that the file at path holds the mirror's bytes.
func (b *bench) sameAsMirror(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	x, y := make([]byte, 4<<20), make([]byte, 4<<20)
	for off := int64(0); off < b.size; off += int64(len(x)) {
		n := min(int64(len(x)), b.size-off)
		if _, err := f.ReadAt(x[:n], off); err != nil {
			return err
		}
		if _, err := b.mirror.ReadAt(y[:n], off); err != nil {
			return err
		}
		if !bytes.Equal(x[:n], y[:n]) {
			return fmt.Errorf("%s differs from the volume's bytes in [%d, %d)", path, off, off+n)
		}
	}
	return nil
}

// change writes 1 % of the volume: one contiguous range at a random
// 4 KiB-aligned offset, or as many random 4 KiB blocks, then snapshots.
func (b *bench) change(contiguous bool) error {
	n := b.size / 100 / 4096 * 4096
	if contiguous {
		p := make([]byte, n)
		b.random(p)
		if err := b.write(p, b.rng.Int64N((b.size-n)/4096+1)*4096); err != nil {
			return err
		}
		return b.snapshot()
	}
	p := make([]byte, 4096)
	for range n / 4096 {
		b.random(p)
		if err := b.write(p, b.rng.Int64N(b.size/4096)*4096); err != nil {
			return err
		}
	}
	return b.snapshot()
}
