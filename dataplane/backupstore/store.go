package backupstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"regexp"
	"time"

	"github.com/go-logr/logr"
)

// Errors a caller can test for with errors.Is.
var (
	// ErrBackupNotFound: the backup has no manifest on the target.
	ErrBackupNotFound = errors.New("backup not found")
	// ErrBackupExists: a backup of that name already has a manifest.
	ErrBackupExists = errors.New("backup already exists")
	// ErrCorrupt: an object read from the target failed its checksum or
	// does not decode within its bounds.
	ErrCorrupt = errors.New("corrupt object on the backup target")
	// ErrTooLarge: an object is larger than anything valid of its kind.
	ErrTooLarge = errors.New("object larger than its bound")
	// ErrTimeout: one call to the target did not finish within
	// Options.CallTimeout (a stuck transfer), on every attempt.
	ErrTimeout = errors.New("call to the backup target timed out")
	// ErrBusy: garbage collection found a live lease of a backup or
	// restore of the volume, and did not run.
	ErrBusy = errors.New("a backup or restore of the volume is in progress")
	// ErrLeaseLost: the operation could not renew its lease on the
	// target for longer than is safe, and stopped before relying on
	// blocks a garbage collection may have removed meanwhile.
	ErrLeaseLost = errors.New("lease on the backup target lost")
	// ErrInvalid: the request is malformed (bad name, size, range).
	ErrInvalid = errors.New("invalid backup request")
)

// ObjectError names the object a call to the target failed on.
type ObjectError struct {
	Op       string // "put", "get", "delete", "list"
	Key      string
	Attempts int
	Err      error
}

func (e *ObjectError) Error() string {
	return fmt.Sprintf("backup target: %s %s (%d attempts): %v", e.Op, e.Key, e.Attempts, e.Err)
}

func (e *ObjectError) Unwrap() error { return e.Err }

// Options tune a Store. Zero values pick the defaults.
type Options struct {
	// Log receives retries and lease events.
	Log logr.Logger
	// CallTimeout bounds each call to the target (one object put, get,
	// delete or listing); default 2 minutes. At most LeaseDuration/4.
	CallTimeout time.Duration
	// Retries is how many times a call that failed with a transient error
	// or timed out is retried; default 5.
	Retries int
	// RetryBackoff is the first wait between attempts, doubled each time
	// up to 30 s; default 1 s.
	RetryBackoff time.Duration
	// LeaseDuration is how long a lease on the target stays live without
	// renewal (renewed every quarter of it); default 10 minutes.
	LeaseDuration time.Duration
	// GCMinAge: CollectGarbage keeps unreferenced blocks written less than
	// this before it started. Default LeaseDuration; negative keeps none.
	GCMinAge time.Duration
	// Concurrency is how many blocks are in flight at once in a backup or
	// restore; default 4.
	Concurrency int
	// MaxVolumeSize bounds the volume size a manifest may claim, and so
	// the memory decoding one may take; default 64 TiB.
	MaxVolumeSize int64
}

// MaxVolumeSize is the default Options.MaxVolumeSize: Cairn's largest volume.
const MaxVolumeSize int64 = 64 << 40

func (o Options) withDefaults() Options {
	if o.CallTimeout <= 0 {
		o.CallTimeout = 2 * time.Minute
	}
	if o.Retries <= 0 {
		o.Retries = 5
	}
	if o.RetryBackoff <= 0 {
		o.RetryBackoff = time.Second
	}
	if o.LeaseDuration <= 0 {
		o.LeaseDuration = 10 * time.Minute
	}
	if o.GCMinAge == 0 {
		o.GCMinAge = o.LeaseDuration
	}
	if o.GCMinAge < 0 {
		o.GCMinAge = 0
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 4
	}
	if o.MaxVolumeSize <= 0 {
		o.MaxVolumeSize = MaxVolumeSize
	}
	return o
}

// Store reads and writes backups on one target. It is safe for concurrent
// use; backups of one volume must be taken one at a time (the caller's
// controller serialises them), restores and deletes may run beside them.
type Store struct {
	target Target
	opts   Options
	log    logr.Logger
}

// New returns a store on target.
func New(target Target, opts Options) (*Store, error) {
	opts = opts.withDefaults()
	if opts.CallTimeout > opts.LeaseDuration/4 {
		return nil, fmt.Errorf("%w: CallTimeout %v must be at most a quarter of LeaseDuration %v", ErrInvalid, opts.CallTimeout, opts.LeaseDuration)
	}
	return &Store{target: target, opts: opts, log: opts.Log}, nil
}

// nameRE is what volume and backup names may be: Kubernetes object names
// (DNS subdomains), so that they are safe as key elements.
var nameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$`)

func validName(kind, name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("%w: %s name %q: lower-case letters, digits, '-' and '.', at most 253", ErrInvalid, kind, name)
	}
	return nil
}

// Keys of the objects on the target (relative to the target's prefix).
func volumeKey(vol string) string          { return "volumes/" + vol + "/" }
func indexKey(vol string) string           { return volumeKey(vol) + "index.json" }
func manifestPrefix(vol string) string     { return volumeKey(vol) + "backups/" }
func manifestKey(vol, name string) string  { return manifestPrefix(vol) + name + manifestSuffix }
func blockPrefix(vol string) string        { return volumeKey(vol) + "blocks/" }
func leasePrefix(vol string) string        { return volumeKey(vol) + "leases/" }
func blockKey(vol string, h Hash) string   { s := h.String(); return blockPrefix(vol) + s[:2] + "/" + s }
func leaseKey(vol, kind, id string) string { return leasePrefix(vol) + kind + "-" + id }

const manifestSuffix = ".manifest"

// call runs one operation on the target under the per-call timeout,
// retrying transient failures and timeouts with back-off.
func (s *Store) call(ctx context.Context, op, key string, fn func(ctx context.Context) error) error {
	backoff := s.opts.RetryBackoff
	for attempt := 1; ; attempt++ {
		cctx, cancel := context.WithTimeout(ctx, s.opts.CallTimeout)
		err := fn(cctx)
		timedOut := errors.Is(cctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return &ObjectError{Op: op, Key: key, Attempts: attempt, Err: ctx.Err()}
		}
		if timedOut {
			err = fmt.Errorf("%w (%v): %w", ErrTimeout, s.opts.CallTimeout, err)
		} else if !errors.Is(err, ErrTransient) {
			return &ObjectError{Op: op, Key: key, Attempts: attempt, Err: err}
		}
		if attempt > s.opts.Retries {
			return &ObjectError{Op: op, Key: key, Attempts: attempt, Err: err}
		}
		s.log.Info("backup target call failed, retrying", "op", op, "key", key, "attempt", attempt, "backoff", backoff, "error", err.Error())
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
			return &ObjectError{Op: op, Key: key, Attempts: attempt, Err: ctx.Err()}
		}
		backoff = min(2*backoff, 30*time.Second)
	}
}

func (s *Store) put(ctx context.Context, key string, data []byte) error {
	return s.call(ctx, "put", key, func(ctx context.Context) error { return s.target.Put(ctx, key, data) })
}

func (s *Store) delete(ctx context.Context, key string) error {
	return s.call(ctx, "delete", key, func(ctx context.Context) error { return s.target.Delete(ctx, key) })
}

// list collects the objects under prefix. A listing that fails part way
// is retried from the start.
func (s *Store) list(ctx context.Context, prefix string) ([]Object, error) {
	var objs []Object
	err := s.call(ctx, "list", prefix, func(ctx context.Context) error {
		objs = objs[:0]
		return s.target.List(ctx, prefix, func(o Object) error { objs = append(objs, o); return nil })
	})
	return objs, err
}

// read opens key and hands it to decode, all under one call: a read that
// stalls part way times out and is retried from the start.
func (s *Store) read(ctx context.Context, key string, decode func(r io.Reader) error) error {
	return s.call(ctx, "get", key, func(ctx context.Context) error {
		rc, err := s.target.Get(ctx, key)
		if err != nil {
			return err
		}
		defer func() { _ = rc.Close() }()
		return decode(rc)
	})
}

// readAll reads a whole object of at most limit bytes.
func (s *Store) readAll(ctx context.Context, key string, limit int64) ([]byte, error) {
	var data []byte
	err := s.read(ctx, key, func(r io.Reader) error {
		var err error
		data, err = readLimited(r, limit)
		return err
	})
	return data, err
}

// readInto reads a whole object of at most len(buf)-1 bytes into buf,
// which a caller reading many objects of one bound (a restore's blocks)
// reuses, instead of growing a new slice per object.
func (s *Store) readInto(ctx context.Context, key string, buf []byte) ([]byte, error) {
	var n int
	err := s.read(ctx, key, func(r io.Reader) error {
		var err error
		n, err = readFullTo(r, buf)
		return err
	})
	return buf[:n], err
}

// readFullTo reads r to its end into buf, failing with ErrTooLarge if r
// fills buf.
func readFullTo(r io.Reader, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := r.Read(buf[n:])
		n += m
		if err == io.EOF { //nolint:errorlint // Read returns io.EOF itself at the end, as io.ReadAll tests it
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
	return n, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, len(buf)-1)
}

// readLimited reads r to its end, failing with ErrTooLarge past limit
// bytes; it never allocates more than limit+1 bytes.
func readLimited(r io.Reader, limit int64) ([]byte, error) {
	data, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, limit)
	}
	return data, nil
}
