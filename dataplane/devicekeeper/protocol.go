// Package devicekeeper keeps the kernel side of a FUSE-frontend volume
// alive while the engine that serves it is restarted.
//
// The kernel aborts a FUSE connection when the last descriptor of its
// /dev/fuse goes; the loop device over the volume file then fails every
// request, and a filesystem on it goes read-only. The keeper is a small
// process outside the instance manager's pod that holds a duplicate of
// each attached volume's descriptors (the /dev/fuse connection, the loop
// device, the volume file), deposited by the engine over a unix socket
// (SCM_RIGHTS). While either holds them the connection lives and the
// application's requests wait in the kernel's queue; an engine started
// next for the volume claims the descriptors, has the kernel resend the
// requests the dead engine had read (FUSE_NOTIFY_RESEND), and serves the
// same loop device. The application sees a pause.
//
// The protocol is one JSON message per SOCK_SEQPACKET datagram, at most
// MaxMessage bytes, with the descriptors as ancillary data (exactly three
// with a deposit and a claim's answer, none otherwise). The keeper
// answers every request once, in order; it never sends anything else.
package devicekeeper

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
)

// MaxMessage is the largest message either side sends or accepts.
const MaxMessage = 8 << 10

// Op is what a request asks the keeper to do.
type Op string

// The requests.
const (
	// OpDeposit hands the keeper a session (its three descriptors with the
	// request) and makes the sender its attendant. A held session of the
	// same volume is replaced (its descriptors closed), unless another
	// live connection attends it (ErrBusy).
	OpDeposit Op = "deposit"
	// OpClaim asks for the session held for a volume: the answer carries
	// it and duplicates of its descriptors, and the sender becomes its
	// attendant. The keeper goes on holding it.
	OpClaim Op = "claim"
	// OpRelease ends the sender's attendance; the keeper goes on holding
	// the session (as when the sender's connection closes).
	OpRelease Op = "release"
	// OpDrop closes the keeper's descriptors of a session and forgets it.
	// Refused (ErrBusy) while another live connection attends it.
	OpDrop Op = "drop"
)

func (o Op) valid() bool {
	switch o {
	case OpDeposit, OpClaim, OpRelease, OpDrop:
		return true
	}
	return false
}

// Code classifies a refusal on the wire.
type Code string

// The refusals.
const (
	CodeNoSession Code = "no-session"
	CodeBusy      Code = "busy"
	CodeInvalid   Code = "invalid"
	CodeInternal  Code = "internal"
)

// Errors a request can end with (errors.Is).
var (
	// ErrNoSession: the keeper holds no session for the volume.
	ErrNoSession = errors.New("the device keeper holds no session for this volume")
	// ErrBusy: another live connection (a running engine) attends the
	// session.
	ErrBusy = errors.New("another engine attends this volume's session at the device keeper")
	// ErrInvalid: the request was malformed, too big, or its descriptors
	// are not what a session holds; nothing changed.
	ErrInvalid = errors.New("invalid device keeper request")
	// ErrInternal: the keeper failed doing what was asked.
	ErrInternal = errors.New("device keeper error")
	// ErrUnavailable: no keeper answers on the socket.
	ErrUnavailable = errors.New("no device keeper reachable")
)

var codeErrors = map[Code]error{CodeNoSession: ErrNoSession, CodeBusy: ErrBusy, CodeInvalid: ErrInvalid, CodeInternal: ErrInternal}

// Session is what an engine taking over a volume's device needs besides
// the descriptors.
type Session struct {
	// Volume is the volume's name, the key of the keeper's table.
	Volume string `json:"volume"`
	// MountDir is where the FUSE filesystem was mounted (in the mount
	// namespace of the engine that mounted it).
	MountDir string `json:"mountDir"`
	// FileName is the volume file's name in the mount.
	FileName string `json:"fileName"`
	// LoopPath is the loop device attached to the file, e.g. /dev/loop3.
	LoopPath string `json:"loopPath"`
	// FUSE is what the kernel and the first engine agreed at FUSE_INIT.
	FUSE FUSEParams `json:"fuse"`
}

// FUSEParams are a connection's FUSE_INIT outcome, which holds for its
// whole life: a server taking the connection over must speak it.
type FUSEParams struct {
	// Major and Minor are the protocol version agreed.
	Major uint32 `json:"major"`
	Minor uint32 `json:"minor"`
	// Flags are the capabilities agreed (FUSE_INIT flags).
	Flags uint64 `json:"flags"`
	// MaxWrite is the largest WRITE or READ the kernel sends.
	MaxWrite uint32 `json:"maxWrite"`
	// Resend says the kernel can resend the requests a dead server had
	// read and not answered (FUSE_NOTIFY_RESEND, protocol 7.40, Linux
	// 6.9). Without it a successor could not complete those requests, so
	// such sessions are not deposited.
	Resend bool `json:"resend"`
}

var (
	// volumeName is a Kubernetes object name or anything like it: no
	// slash, no control characters, no spaces.
	volumeName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$`)
	loopPath   = regexp.MustCompile(`^/dev/loop[0-9]{1,6}$`)
)

// validVolume checks a volume name.
func validVolume(v string) error {
	if !volumeName.MatchString(v) {
		return fmt.Errorf("%w: volume name %q: want 1-253 letters, digits, '.', '_' or '-'", ErrInvalid, v)
	}
	return nil
}

// Validate checks a session's fields (not its descriptors).
func (s *Session) Validate() error {
	if err := validVolume(s.Volume); err != nil {
		return err
	}
	switch {
	case !filepath.IsAbs(s.MountDir) || len(s.MountDir) > 4096 || filepath.Clean(s.MountDir) != s.MountDir || strings.ContainsRune(s.MountDir, 0):
		return fmt.Errorf("%w: mount directory %q: want a clean absolute path", ErrInvalid, s.MountDir)
	case s.FileName == "" || len(s.FileName) > 255 || strings.ContainsAny(s.FileName, "/\x00") || s.FileName == "." || s.FileName == "..":
		return fmt.Errorf("%w: file name %q", ErrInvalid, s.FileName)
	case !loopPath.MatchString(s.LoopPath):
		return fmt.Errorf("%w: loop device %q: want /dev/loopN", ErrInvalid, s.LoopPath)
	case s.FUSE.Major != 7 || s.FUSE.Minor < 12:
		return fmt.Errorf("%w: FUSE protocol %d.%d", ErrInvalid, s.FUSE.Major, s.FUSE.Minor)
	case s.FUSE.MaxWrite == 0:
		return fmt.Errorf("%w: FUSE max_write 0", ErrInvalid)
	}
	return nil
}

// request is one message to the keeper.
type request struct {
	Op      Op       `json:"op"`
	Volume  string   `json:"volume,omitempty"`  // claim, release, drop
	Session *Session `json:"session,omitempty"` // deposit
}

// response is the keeper's answer to one request.
type response struct {
	Error   *wireError `json:"error,omitempty"`
	Session *Session   `json:"session,omitempty"` // claim
}

type wireError struct {
	Code    Code   `json:"code"`
	Message string `json:"message"`
}

// err is the response's refusal as an error wrapping its sentinel.
func (r *response) err() error {
	if r.Error == nil {
		return nil
	}
	sentinel, ok := codeErrors[r.Error.Code]
	if !ok {
		sentinel = ErrInternal
	}
	return fmt.Errorf("%w: %s", sentinel, r.Error.Message)
}

// errorResponse turns an error into the answer that carries it.
func errorResponse(err error) response {
	code := CodeInternal
	for c, sentinel := range codeErrors {
		if errors.Is(err, sentinel) {
			code = c
			break
		}
	}
	return response{Error: &wireError{Code: code, Message: err.Error()}}
}

// decodeRequest parses and checks one request. It needs exactly three
// descriptors with a deposit, none otherwise (nfds is how many came).
func decodeRequest(b []byte, nfds int) (request, error) {
	var r request
	if err := unmarshalStrict(b, &r); err != nil {
		return request{}, err
	}
	if !r.Op.valid() {
		return request{}, fmt.Errorf("%w: unknown op %q", ErrInvalid, r.Op)
	}
	wantFDs := 0
	if r.Op == OpDeposit {
		wantFDs = 3
		if r.Session == nil || r.Volume != "" {
			return request{}, fmt.Errorf("%w: a deposit carries a session and no volume field", ErrInvalid)
		}
		if err := r.Session.Validate(); err != nil {
			return request{}, err
		}
	} else {
		if r.Session != nil {
			return request{}, fmt.Errorf("%w: %s carries no session", ErrInvalid, r.Op)
		}
		if err := validVolume(r.Volume); err != nil {
			return request{}, err
		}
	}
	if nfds != wantFDs {
		return request{}, fmt.Errorf("%w: %s with %d descriptors, want %d", ErrInvalid, r.Op, nfds, wantFDs)
	}
	return r, nil
}

// unmarshalStrict decodes one JSON value that has only known fields and
// nothing after it.
func unmarshalStrict(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if len(bytes.TrimSpace(b[d.InputOffset():])) != 0 {
		return fmt.Errorf("%w: data after the message", ErrInvalid)
	}
	return nil
}

// encode marshals a message and checks it fits.
func encode(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("%w: message of %d bytes, more than %d", ErrInvalid, len(b), MaxMessage)
	}
	return b, nil
}
