package instancemanager

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// Spec is what to run: an EngineSpec or a ReplicaSpec. The instance
// manager turns it into a command line itself (ports, socket paths, mount
// directories are its business), so callers never build one.
type Spec interface {
	// Kind is the kind of process the spec runs.
	Kind() Kind
	validate(dataDirs []string) error
}

// Frontend is how an engine exposes its volume.
type Frontend string

// Frontends. FrontendFUSE is the default: it works on any node with FUSE
// and loop devices, and gives a block device there.
const (
	FrontendFUSE Frontend = "fuse"
	FrontendNBD  Frontend = "nbd"
)

// NBDKernel says whether an nbd frontend attaches a /dev/nbdN.
type NBDKernel string

// NBDKernel values; "" is NBDKernelAuto.
const (
	NBDKernelAuto NBDKernel = "auto"
	NBDKernelOn   NBDKernel = "on"
	NBDKernelOff  NBDKernel = "off"
)

// ReplicaAddress is where an engine reaches one replica.
type ReplicaAddress struct {
	// Data is HOST:PORT, or unix:PATH for a replica on the engine's node.
	Data string
	// Control is the replica's gRPC address HOST:PORT.
	Control string
}

// EngineSpec is an engine to run.
type EngineSpec struct {
	// VolumeName names the volume: a DNS label (at most 63 characters).
	VolumeName string
	// SizeBytes is the volume size; 0 takes the replicas' size.
	SizeBytes int64
	// Replicas to open: 1 to MaxReplicas.
	Replicas []ReplicaAddress
	// Wanted replicas make the volume healthy; 0 means len(Replicas).
	Wanted int
	// Frontend; "" is FrontendFUSE.
	Frontend Frontend
	// NBDKernel applies to FrontendNBD; "" is NBDKernelAuto.
	NBDKernel NBDKernel
	// ReplicaTimeout fails a replica that does not answer a request in
	// this time; 0 takes the engine's default.
	ReplicaTimeout time.Duration
	// AcceptLostMembers lets the engine serve without replicas recorded
	// at the newest epoch that are not among Replicas (engine
	// Options.AcceptLostMembers): the caller declares them lost.
	AcceptLostMembers bool
	// AuthKey is the volume's key (AuthKeySize bytes, or empty for none):
	// the engine authenticates every data connection to its replicas
	// with it. It reaches the child through a pipe, never its arguments.
	AuthKey string
	// EncryptionKey turns on encryption at rest (volcrypt.KeySize bytes,
	// or empty for none); it reaches the child through a pipe like AuthKey.
	EncryptionKey string
	// EncryptionKeyCheck is volcrypt.KeyCheck of the volume's key: the
	// engine refuses a key with another. Required with EncryptionKey.
	EncryptionKeyCheck string
}

// ReplicaSpec is a replica to run.
type ReplicaSpec struct {
	// DataDir is the replica's directory, strictly inside one of the
	// instance manager's data directories.
	DataDir string
	// SizeBytes is the volume size, a multiple of 4096.
	SizeBytes int64
	// DirectIO reads and writes the data files with O_DIRECT.
	DirectIO bool
	// UnixSocket serves data on a unix socket (for an engine on this
	// node) instead of a TCP port. Without it the replica serves its data
	// on a TCP port and on a unix socket (Process.LocalDataAddress).
	UnixSocket bool
	// AuthKey is the volume's key (AuthKeySize bytes, or empty for none):
	// the replica serves only data connections that prove they hold it.
	AuthKey string
}

// AuthKeySize is the size of a volume's key.
const AuthKeySize = 32

// authKeyOf is a spec's key, or "".
func authKeyOf(s Spec) string {
	switch s := s.(type) {
	case EngineSpec:
		return s.AuthKey
	case ReplicaSpec:
		return s.AuthKey
	}
	return ""
}

// encryptionKeyOf is an engine spec's encryption key, or "".
func encryptionKeyOf(s Spec) string {
	if e, ok := s.(EngineSpec); ok {
		return e.EncryptionKey
	}
	return ""
}

// redacted is s without its key, for messages and logs.
func redacted(s Spec) Spec {
	switch s := s.(type) {
	case EngineSpec:
		if s.AuthKey != "" {
			s.AuthKey = "(redacted)"
		}
		if s.EncryptionKey != "" {
			s.EncryptionKey = "(redacted)"
		}
		return s
	case ReplicaSpec:
		if s.AuthKey != "" {
			s.AuthKey = "(redacted)"
		}
		return s
	}
	return s
}

func validKey(k string) error {
	if k != "" && len(k) != AuthKeySize {
		return fmt.Errorf("%w: auth key of %d bytes: give %d, or none", ErrInvalid, len(k), AuthKeySize)
	}
	return nil
}

// Bounds on what a spec may ask for: every field comes from the network.
const (
	MaxReplicas       = 16
	maxAddressLen     = 256
	maxVolumeSize     = 64 << 40 // 64 TiB
	maxReplicaTimeout = 10 * time.Minute
)

var (
	labelRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)
	// A process name: a DNS subdomain, optionally after a namespace (a DNS
	// label) and '/', so that objects of the same name in two namespaces
	// do not collide.
	nameRE = regexp.MustCompile(`^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/)?[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$`)
)

// Kind implements Spec.
func (EngineSpec) Kind() Kind { return KindEngine }

// Kind implements Spec.
func (ReplicaSpec) Kind() Kind { return KindReplica }

func (e EngineSpec) validate([]string) error {
	if err := validKey(e.AuthKey); err != nil {
		return err
	}
	if e.EncryptionKey != "" && len(e.EncryptionKey) != volcrypt.KeySize {
		return fmt.Errorf("%w: encryption key of %d bytes: give %d, or none", ErrInvalid, len(e.EncryptionKey), volcrypt.KeySize)
	}
	if (e.EncryptionKey == "") != (e.EncryptionKeyCheck == "") || len(e.EncryptionKeyCheck) > 64 {
		return fmt.Errorf("%w: give an encryption key and its check together (the check at most 64 characters), or neither", ErrInvalid)
	}
	if !labelRE.MatchString(e.VolumeName) {
		return fmt.Errorf("%w: engine volume name %q: use a DNS label (lowercase letters, digits and '-', at most 63)", ErrInvalid, e.VolumeName)
	}
	if e.SizeBytes < 0 || e.SizeBytes > maxVolumeSize || e.SizeBytes%4096 != 0 {
		return fmt.Errorf("%w: engine size %d: use 0 (the replicas' size) or a multiple of 4096 up to 64 TiB", ErrInvalid, e.SizeBytes)
	}
	if len(e.Replicas) == 0 || len(e.Replicas) > MaxReplicas {
		return fmt.Errorf("%w: engine with %d replicas: give 1 to %d", ErrInvalid, len(e.Replicas), MaxReplicas)
	}
	for i, r := range e.Replicas {
		if r.Data == "" || r.Control == "" || len(r.Data) > maxAddressLen || len(r.Control) > maxAddressLen ||
			strings.ContainsAny(r.Data+r.Control, ", \t\n") {
			return fmt.Errorf("%w: replica %d: give a data address (HOST:PORT or unix:PATH) and a control address (HOST:PORT), without commas or spaces", ErrInvalid, i)
		}
	}
	if e.Wanted < 0 || e.Wanted > len(e.Replicas) {
		return fmt.Errorf("%w: engine wants %d replicas of %d: give 0 (all) to %d", ErrInvalid, e.Wanted, len(e.Replicas), len(e.Replicas))
	}
	switch e.Frontend {
	case "", FrontendFUSE, FrontendNBD:
	default:
		return fmt.Errorf("%w: frontend %q: use fuse or nbd", ErrInvalid, e.Frontend)
	}
	switch e.NBDKernel {
	case "", NBDKernelAuto, NBDKernelOn, NBDKernelOff:
	default:
		return fmt.Errorf("%w: nbd kernel %q: use auto, on or off", ErrInvalid, e.NBDKernel)
	}
	if e.ReplicaTimeout < 0 || e.ReplicaTimeout > maxReplicaTimeout {
		return fmt.Errorf("%w: replica timeout %s: use 0 (the default) up to %s", ErrInvalid, e.ReplicaTimeout, maxReplicaTimeout)
	}
	return nil
}

func (r ReplicaSpec) validate(dataDirs []string) error {
	if err := validKey(r.AuthKey); err != nil {
		return err
	}
	if r.SizeBytes <= 0 || r.SizeBytes > maxVolumeSize || r.SizeBytes%4096 != 0 {
		return fmt.Errorf("%w: replica size %d: give a multiple of 4096 up to 64 TiB", ErrInvalid, r.SizeBytes)
	}
	err := confine(dataDirs, r.DataDir)
	return err
}

// withDefaults fills the defaults in, so that a spec that spells a default
// out equals one that leaves it empty.
func withDefaults(s Spec) Spec {
	if e, ok := s.(EngineSpec); ok {
		if e.Frontend == "" {
			e.Frontend = FrontendFUSE
		}
		if e.NBDKernel == "" {
			e.NBDKernel = NBDKernelAuto
		}
		if e.Wanted == len(e.Replicas) {
			e.Wanted = 0
		}
		e.Replicas = append([]ReplicaAddress(nil), e.Replicas...)
		return e
	}
	return s
}

// sameSpec reports whether two specs (with defaults filled in) ask for
// the same process.
func sameSpec(a, b Spec) bool { return reflect.DeepEqual(a, b) }

// portsFor is how many ports a spec's process gets: an engine its control
// port; a replica its data and control ports, or only control when its
// data is on a unix socket.
func portsFor(s Spec) int {
	if r, ok := s.(ReplicaSpec); ok && !r.UnixSocket {
		return 2
	}
	return 1
}

// fileName is a process name as a file name ('/' is not allowed in one;
// '_' is in no process name, so the mapping is one to one).
func fileName(name string) string { return strings.ReplaceAll(name, "/", "_") }

// shortName is a short, fixed-length name derived from a process name, for
// unix socket paths (at most 108 bytes) and mount directories.
func shortName(name string) string {
	sum := sha256.Sum256([]byte(name))
	return hex.EncodeToString(sum[:8])
}

// shortNameLen is len(shortName(x)).
const shortNameLen = 16

// replicaSocket is the unix socket a replica named name serves its data
// on in runDir: its only data listener with UnixSocket, else the one
// beside its TCP port. A replica has one or the other, never both.
func replicaSocket(runDir, name string) string {
	return filepath.Join(runDir, "r-"+shortName(name)+".sock")
}

// engineSocket is the unix socket an engine named name with the NBD
// frontend serves its volume on, in runDir.
func engineSocket(runDir, name string) string {
	return filepath.Join(runDir, "e-"+shortName(name)+".sock")
}

// placement is where the instance manager puts a process's sockets.
type placement struct {
	host   string // the children listen on it and it is what is reported
	runDir string
	ports  []int
	name   string
	readyF int // the descriptor number of the ready pipe in the child
	keyF   int // the descriptor number of the key pipe in the child
	encF   int // the descriptor number of the encryption key pipe in the child
}

// args is the command line (after the subcommand) for a spec.
func args(s Spec, p placement) []string {
	addr := func(i int) string { return joinHostPort(p.host, p.ports[i]) }
	ready := []string{"--ready-fd", strconv.Itoa(p.readyF)}
	if authKeyOf(s) != "" {
		ready = append(ready, "--auth-key-fd", strconv.Itoa(p.keyF))
	}
	switch s := s.(type) {
	case ReplicaSpec:
		out := []string{"--dir", s.DataDir, "--size", strconv.FormatInt(s.SizeBytes, 10)}
		sock := "unix:" + replicaSocket(p.runDir, p.name)
		if s.UnixSocket {
			out = append(out, "--listen", sock, "--control-listen", addr(0))
		} else {
			// The socket beside the TCP port is for an engine of this
			// instance manager (shared memory); engines elsewhere,
			// rebuilds and backups use the port.
			out = append(out, "--listen", addr(0), "--listen-local", sock, "--control-listen", addr(1))
		}
		if s.DirectIO {
			out = append(out, "--direct-io")
		}
		return append(out, ready...)
	case EngineSpec:
		out := []string{"--name", s.VolumeName}
		if s.SizeBytes > 0 {
			out = append(out, "--size", strconv.FormatInt(s.SizeBytes, 10))
		}
		for _, r := range s.Replicas {
			out = append(out, "--replica", r.Data+","+r.Control)
		}
		if s.Wanted > 0 {
			out = append(out, "--wanted", strconv.Itoa(s.Wanted))
		}
		out = append(out, "--frontend", string(s.Frontend))
		switch s.Frontend {
		case FrontendNBD:
			out = append(out, "--nbd-socket", engineSocket(p.runDir, p.name), "--nbd-kernel", string(s.NBDKernel))
		case FrontendFUSE:
			out = append(out, "--fuse-dir", filepath.Join(p.runDir, "fuse", shortName(p.name)))
		}
		if s.ReplicaTimeout > 0 {
			out = append(out, "--replica-timeout", s.ReplicaTimeout.String())
		}
		if s.AcceptLostMembers {
			out = append(out, "--accept-lost-members")
		}
		if s.EncryptionKey != "" {
			out = append(out, "--encryption-key-fd", strconv.Itoa(p.encF), "--encryption-key-check", s.EncryptionKeyCheck)
		}
		out = append(out, "--listen", addr(0))
		return append(out, ready...)
	}
	return nil
}

func joinHostPort(host string, port int) string {
	if strings.Contains(host, ":") {
		return "[" + host + "]:" + strconv.Itoa(port)
	}
	return host + ":" + strconv.Itoa(port)
}

// dataDirOf is the data directory a process uses, or "".
func dataDirOf(s Spec) string {
	if r, ok := s.(ReplicaSpec); ok {
		return r.DataDir
	}
	return ""
}

// overlaps reports whether one of two clean paths contains the other.
func overlaps(a, b string) bool {
	return a == b || strings.HasPrefix(a, b+"/") || strings.HasPrefix(b, a+"/")
}

// confine checks that dir is a replica directory the node may use: an
// absolute, clean path strictly inside one of the data directories, with
// no symbolic link between the data directory and it (so it cannot lead
// out). Parts of it that do not exist yet are fine.
func confine(dataDirs []string, dir string) error {
	if dir == "" || !filepath.IsAbs(dir) || filepath.Clean(dir) != dir {
		return fmt.Errorf("%w: replica directory %q: give a clean absolute path (no '..', no trailing '/') inside a data directory", ErrInvalid, dir)
	}
	if len(dir) > 4096 {
		return fmt.Errorf("%w: replica directory of %d bytes is too long", ErrInvalid, len(dir))
	}
	for _, root := range dataDirs {
		root = filepath.Clean(root)
		rel, err := filepath.Rel(root, dir)
		if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
			continue
		}
		return noLinks(root, strings.Split(rel, "/"))
	}
	return fmt.Errorf("%w: replica directory %s is not inside a data directory of this node (%s); use one below those (see NodeInfo)",
		ErrInvalid, dir, strings.Join(dataDirs, ", "))
}

// noLinks checks the existing prefix of root/parts: each part a directory
// (the last may be anything but a link), none a symbolic link.
func noLinks(root string, parts []string) error {
	p := root
	for i, part := range parts {
		p = filepath.Join(p, part)
		fi, err := os.Lstat(p)
		if errors.Is(err, fs.ErrNotExist) {
			return nil // created later, below a checked path
		}
		if err != nil {
			return fmt.Errorf("%w: replica directory: %s: %w", ErrInvalid, p, err)
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			return fmt.Errorf("%w: replica directory: %s is a symbolic link; replica directories may not pass through links (they could lead out of the data directory)", ErrInvalid, p)
		}
		if !fi.IsDir() && i < len(parts)-1 {
			return fmt.Errorf("%w: replica directory: %s is not a directory", ErrInvalid, p)
		}
	}
	return nil
}
