package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/internal/tlsfiles"
	"github.com/cairn-io/cairn/dataplane/snapshotsource"
)

const backupUsage = `usage: cairn-data backup --replica HOST:PORT --volume VOLUME --snapshot SNAPSHOT
         [--base-snapshot SNAPSHOT --base-backup NAME] [--name NAME] [--block-size SIZE]
         [--tls-cert F --tls-key F --tls-client-ca F] TARGET

Backs a snapshot of a replica up to a backup target, reading it through the
replica's control API (--replica is its --control-listen address). With a
base (the snapshot an earlier backup of the same volume on the same target
was taken from, and that backup's name), it reads and uploads only what the
replica's layers say changed since the base snapshot; the base backup's
manifest supplies the rest. It prints progress lines and, at the end, the
backup's name and what it uploaded.

TARGET is --target-dir DIR (a directory, e.g. a mounted NFS export) or
--s3-endpoint URL --s3-bucket BUCKET [--s3-prefix P] [--s3-region R]
[--s3-path-style] [--s3-ca-file F] [--s3-credentials-file F]. S3 credentials
come from the file (lines AWS_ACCESS_KEY_ID=..., AWS_SECRET_ACCESS_KEY=...,
optionally AWS_SESSION_TOKEN=...) or else from those environment variables,
never from the command line.

flags:
`

const restoreUsage = `usage: cairn-data restore --volume VOLUME --backup NAME --to PATH TARGET
       cairn-data restore --volume VOLUME --list TARGET

Writes a backup to PATH: a new file (created sparse; it must not exist) or a
block device at least the backup's size (opened exclusively, so not one in
use). Every block is checked against the manifest's SHA-256. A failed restore
removes the file it created; a device it wrote to must not be used. TARGET
as for 'cairn-data backup'. --list prints the volume's backups, oldest
first, from the index on the target, and restores nothing.

flags:
`

// Bounds on files read from outside.
const (
	maxCredentialsFile = 64 << 10
	maxCAFile          = 1 << 20
)

// targetFlags say where the backups are.
type targetFlags struct {
	dir                              string
	endpoint, bucket, prefix, region string
	pathStyle                        bool
	caFile, credentialsFile          string
	callTimeout                      time.Duration
}

func (f *targetFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.dir, "target-dir", "", "a directory target (e.g. a mounted NFS export)")
	fs.StringVar(&f.endpoint, "s3-endpoint", "", "an S3 target's URL (https://..., or http://... on a trusted network)")
	fs.StringVar(&f.bucket, "s3-bucket", "", "the S3 bucket (it must exist)")
	fs.StringVar(&f.prefix, "s3-prefix", "", "key prefix inside the bucket")
	fs.StringVar(&f.region, "s3-region", "", "the bucket's region (empty: ask the server)")
	fs.BoolVar(&f.pathStyle, "s3-path-style", false, "address the bucket as ENDPOINT/BUCKET (most self-hosted servers)")
	fs.StringVar(&f.caFile, "s3-ca-file", "", "CA bundle (PEM) for the endpoint's certificate (default: the system's)")
	fs.StringVar(&f.credentialsFile, "s3-credentials-file", "", "file with AWS_ACCESS_KEY_ID=, AWS_SECRET_ACCESS_KEY= (and AWS_SESSION_TOKEN=) lines; default: those environment variables")
	fs.DurationVar(&f.callTimeout, "call-timeout", 2*time.Minute, "bound on each call to the target and to the replica")
}

// store opens the target the flags name.
func (f *targetFlags) store(log logr.Logger) (*backupstore.Store, error) {
	if f.callTimeout <= 0 {
		return nil, errors.New("--call-timeout must be positive")
	}
	var tg backupstore.Target
	switch {
	case f.dir != "" && f.endpoint != "":
		return nil, errors.New("give --target-dir or --s3-endpoint, not both")
	case f.dir != "":
		t, err := backupstore.NewDirTarget(f.dir)
		if err != nil {
			return nil, err
		}
		tg = t
	case f.endpoint != "":
		cfg, err := f.s3Config()
		if err != nil {
			return nil, err
		}
		t, err := backupstore.NewS3Target(cfg)
		if err != nil {
			return nil, err
		}
		tg = t
	default:
		return nil, errors.New("no target: give --target-dir or --s3-endpoint and --s3-bucket")
	}
	return backupstore.New(tg, backupstore.Options{Log: log, CallTimeout: f.callTimeout, LeaseDuration: max(10*time.Minute, 4*f.callTimeout)})
}

func (f *targetFlags) s3Config() (backupstore.S3Config, error) {
	cfg := backupstore.S3Config{Endpoint: f.endpoint, Bucket: f.bucket, Prefix: f.prefix, Region: f.region, PathStyle: f.pathStyle}
	if f.caFile != "" {
		pem, err := readBounded(f.caFile, maxCAFile)
		if err != nil {
			return cfg, fmt.Errorf("--s3-ca-file: %w", err)
		}
		cfg.CACertPEM = pem
	}
	creds, err := s3Credentials(f.credentialsFile, os.Getenv)
	if err != nil {
		return cfg, err
	}
	cfg.AccessKeyID, cfg.SecretAccessKey, cfg.SessionToken = creds["AWS_ACCESS_KEY_ID"], creds["AWS_SECRET_ACCESS_KEY"], creds["AWS_SESSION_TOKEN"]
	if cfg.AccessKeyID == "" || cfg.SecretAccessKey == "" {
		return cfg, errors.New("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give --s3-credentials-file")
	}
	return cfg, nil
}

// s3Credentials reads the credentials from file (KEY=VALUE lines; blank
// lines and # comments skipped) or, without a file, from the environment.
func s3Credentials(file string, getenv func(string) string) (map[string]string, error) {
	keys := []string{"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
	out := map[string]string{}
	if file == "" {
		for _, k := range keys {
			out[k] = getenv(k)
		}
		return out, nil
	}
	data, err := readBounded(file, maxCredentialsFile)
	if err != nil {
		return nil, fmt.Errorf("--s3-credentials-file: %w", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		k = strings.TrimSpace(strings.TrimPrefix(k, "export "))
		if !ok || !contains(keys, k) {
			// The line may hold a secret: name the line, not its text.
			return nil, fmt.Errorf("--s3-credentials-file: line %d is not one of %s=VALUE", n, strings.Join(keys, "=, "))
		}
		out[k] = strings.Trim(strings.TrimSpace(v), `"'`)
	}
	return out, sc.Err()
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// readBounded reads a whole file of at most limit bytes.
func readBounded(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, limit)
	}
	return data, nil
}

// backupFlags are the backup command's settings.
type backupFlags struct {
	target                targetFlags
	tls                   tlsfiles.Files
	replica, volume, snap string
	baseSnap, baseBackup  string
	name                  string
	blockSize             string
}

func parseBackupFlags(args []string, stderr io.Writer) (*backupFlags, error) {
	f := &backupFlags{}
	fs := flag.NewFlagSet("cairn-data backup", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, backupUsage); fs.PrintDefaults() }
	fs.StringVar(&f.replica, "replica", "", "the replica's control address (its --control-listen)")
	fs.StringVar(&f.volume, "volume", "", "the volume's name (the backups' folder on the target)")
	fs.StringVar(&f.snap, "snapshot", "", "the replica snapshot to back up")
	fs.StringVar(&f.baseSnap, "base-snapshot", "", "the snapshot the base backup was taken from (an older snapshot of the same replica chain)")
	fs.StringVar(&f.baseBackup, "base-backup", "", "the backup of --base-snapshot on this target")
	fs.StringVar(&f.name, "name", "", "the new backup's name (default: SNAPSHOT-YYYYMMDD-HHMMSS, UTC)")
	fs.StringVar(&f.blockSize, "block-size", "2Mi", "block size of a full backup, a power of two from 64Ki to 16Mi (an incremental one uses its base's)")
	fs.StringVar(&f.tls.Cert, "tls-cert", "", "client certificate (PEM) of Cairn's CA, for a replica serving mutual TLS")
	fs.StringVar(&f.tls.Key, "tls-key", "", "its private key (PEM)")
	fs.StringVar(&f.tls.CA, "tls-client-ca", "", "CA bundle (PEM) the replica's certificate must chain to")
	f.target.register(fs)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 || f.replica == "" || f.volume == "" || f.snap == "" {
		fs.Usage()
		return nil, flag.ErrHelp
	}
	if (f.baseSnap == "") != (f.baseBackup == "") {
		return nil, errors.New("--base-snapshot and --base-backup go together")
	}
	if f.name == "" {
		f.name = strings.ToLower(f.snap) + "-" + time.Now().UTC().Format("20060102-150405")
	}
	return f, f.tls.Check()
}

func runBackup(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	f, err := parseBackupFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 2
	}
	if err != nil {
		fmt.Fprintln(stderr, "cairn-data backup:", err)
		return 2
	}
	if err := backup(ctx, f, stdout, newLogger(stderr, "backup")); err != nil {
		fmt.Fprintln(stderr, "cairn-data backup:", err)
		return 1
	}
	return 0
}

// backup runs one backup: the replica's size, the change map, then the
// store's upload (snapshotsource.Backup).
func backup(ctx context.Context, f *backupFlags, out io.Writer, log logr.Logger) error {
	store, err := f.target.store(log)
	if err != nil {
		return err
	}
	rc, err := dialReplicaControl(f.replica, f.tls, log)
	if err != nil {
		return err
	}
	defer rc.Close()
	rc.Timeout = f.target.callTimeout
	opts := snapshotsource.BackupOptions{
		Volume: f.volume, Name: f.name, Snapshot: f.snap, BaseSnapshot: f.baseSnap, BaseBackup: f.baseBackup,
		Progress: progressPrinter(out),
	}
	if f.baseBackup == "" {
		if opts.BlockSize, err = parseSize(f.blockSize); err != nil {
			return err
		}
	}
	res, err := snapshotsource.Backup(ctx, store, rc, opts)
	if err != nil {
		return err
	}
	in := res.Info
	fmt.Fprintf(out, "backup %s/%s snapshot=%s parent=%s size=%d block-size=%d blocks=%d read-bytes=%d uploaded-blocks=%d uploaded-bytes=%d\n",
		f.volume, in.Name, f.snap, in.Parent, in.Size, in.BlockSize, in.Blocks, res.ReadBytes, in.NewBlocks, in.NewBytes)
	return nil
}

// progressPrinter prints "progress DONE/TOTAL bytes (P%)" at most once a
// second, and when done reaches total.
func progressPrinter(out io.Writer) func(done, total int64) {
	var last time.Time
	return func(done, total int64) {
		if done < total && time.Since(last) < time.Second {
			return
		}
		last = time.Now()
		pct := int64(100)
		if total > 0 {
			pct = done * 100 / total
		}
		fmt.Fprintf(out, "progress %d/%d bytes (%d%%)\n", done, total, pct)
	}
}

// dialReplicaControl connects to a replica's control API, with mutual TLS
// when the files are given.
func dialReplicaControl(addr string, files tlsfiles.Files, log logr.Logger) (*snapshotsource.Client, error) {
	creds := insecure.NewCredentials()
	if files.Set() {
		src, err := tlsfiles.New(files, log)
		if err != nil {
			return nil, err
		}
		creds = credentials.NewTLS(src.Client())
	}
	return snapshotsource.Dial(addr, grpc.WithTransportCredentials(creds))
}

// restoreFlags are the restore command's settings.
type restoreFlags struct {
	target             targetFlags
	volume, backupName string
	to                 string
	list               bool
}

func parseRestoreFlags(args []string, stderr io.Writer) (*restoreFlags, error) {
	f := &restoreFlags{}
	fs := flag.NewFlagSet("cairn-data restore", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, restoreUsage); fs.PrintDefaults() }
	fs.StringVar(&f.volume, "volume", "", "the volume whose backup to restore")
	fs.StringVar(&f.backupName, "backup", "", "the backup's name")
	fs.StringVar(&f.to, "to", "", "a new file, or a block device at least the backup's size")
	fs.BoolVar(&f.list, "list", false, "list the volume's backups instead of restoring one")
	f.target.register(fs)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	// Either --list, or both --backup and --to.
	restoring := f.backupName != "" || f.to != ""
	if fs.NArg() > 0 || f.volume == "" || f.list == restoring || (restoring && (f.backupName == "" || f.to == "")) {
		fs.Usage()
		return nil, flag.ErrHelp
	}
	return f, nil
}

func runRestore(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	f, err := parseRestoreFlags(args, stderr)
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stderr, "cairn-data restore:", err)
		}
		return 2
	}
	run := restore
	if f.list {
		run = listBackups
	}
	if err := run(ctx, f, stdout, newLogger(stderr, "restore")); err != nil {
		fmt.Fprintln(stderr, "cairn-data restore:", err)
		return 1
	}
	return 0
}

// restore checks the backup and the destination before writing anything:
// the manifest is read first, and the destination must be a new file or a
// block device large enough.
func restore(ctx context.Context, f *restoreFlags, out io.Writer, log logr.Logger) (err error) {
	store, err := f.target.store(log)
	if err != nil {
		return err
	}
	m, err := store.Manifest(ctx, f.volume, f.backupName)
	if err != nil {
		return err
	}
	dst, created, err := openRestoreDest(f.to, m.Size)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := dst.Close(); err == nil {
			err = cerr
		}
		if err != nil && created {
			// A partial restore must not be taken for a whole one.
			_ = os.Remove(f.to)
		}
	}()
	_, err = store.Restore(ctx, backupstore.RestoreOptions{
		Volume: f.volume, Name: f.backupName, Dest: dst,
		WriteZeros: !created, // a device holds old bytes; a new file reads as zeros
		Progress:   progressPrinter(out),
	})
	if err != nil {
		return err
	}
	if err := dst.Sync(); err != nil {
		return err
	}
	fmt.Fprintf(out, "restored %s/%s size=%d blocks=%d to %s\n", f.volume, f.backupName, m.Size, len(m.Blocks), f.to)
	return nil
}

// openRestoreDest opens path for a restore of size bytes: a block device
// (exclusively, so not one mounted or in use) of at least size, or a new
// regular file, created sparse at size (created is then true). An existing
// file is refused: a restore never overwrites a file by mistake.
func openRestoreDest(path string, size int64) (f *os.File, created bool, err error) {
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return nil, false, err
		}
		if err := f.Truncate(size); err != nil {
			f.Close()
			os.Remove(path)
			return nil, false, err
		}
		return f, true, nil
	case err != nil:
		return nil, false, err
	case fi.Mode()&os.ModeDevice == 0 || fi.Mode()&os.ModeCharDevice != 0:
		return nil, false, fmt.Errorf("%s exists and is not a block device: give a new file's path or a block device", path)
	}
	f, err = os.OpenFile(path, os.O_WRONLY|os.O_EXCL, 0)
	if err != nil {
		return nil, false, fmt.Errorf("open %s exclusively (is it in use?): %w", path, err)
	}
	devSize, err := f.Seek(0, io.SeekEnd)
	if err == nil && devSize < size {
		err = fmt.Errorf("%s holds %d bytes, the backup %d", path, devSize, size)
	}
	if err != nil {
		f.Close()
		return nil, false, err
	}
	return f, false, nil
}

// listBackups prints the volume's backups, one line each, oldest first.
func listBackups(ctx context.Context, f *restoreFlags, out io.Writer, log logr.Logger) error {
	store, err := f.target.store(log)
	if err != nil {
		return err
	}
	list, err := store.List(ctx, f.volume)
	if err != nil {
		return err
	}
	slices.SortFunc(list, func(a, b backupstore.BackupInfo) int { return a.Created.Compare(b.Created) })
	for _, b := range list {
		fmt.Fprintf(out, "%s created=%s snapshot=%s parent=%s size=%d blocks=%d\n",
			b.Name, b.Created.Format(time.RFC3339), b.Labels[snapshotsource.SnapshotLabel], b.Parent, b.Size, b.Blocks)
	}
	return nil
}
