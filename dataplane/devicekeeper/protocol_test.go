package devicekeeper

import (
	"errors"
	"strings"
	"testing"
)

func goodSession() Session {
	return Session{Volume: "pvc-1", MountDir: "/run/cairn/fuse/pvc-1", FileName: "pvc-1", LoopPath: "/dev/loop7",
		FUSE: FUSEParams{Major: 7, Minor: 28, MaxWrite: 1 << 20, Resend: true}}
}

func TestDecodeRequest(t *testing.T) {
	good := `{"op":"deposit","session":{"volume":"pvc-1","mountDir":"/run/cairn/fuse/pvc-1","fileName":"pvc-1","loopPath":"/dev/loop7","fuse":{"major":7,"minor":28,"flags":0,"maxWrite":1048576,"resend":true}}}`
	for _, tc := range []struct {
		name string
		msg  string
		fds  int
		want error
	}{
		{"deposit", good, 3, nil},
		{"claim", `{"op":"claim","volume":"pvc-1"}`, 0, nil},
		{"release", `{"op":"release","volume":"pvc-1"}`, 0, nil},
		{"drop", `{"op":"drop","volume":"pvc-1"}`, 0, nil},
		{"not JSON", `claim pvc-1`, 0, ErrInvalid},
		{"empty", ``, 0, ErrInvalid},
		{"unknown op", `{"op":"list"}`, 0, ErrInvalid},
		{"unknown field", `{"op":"claim","volume":"pvc-1","force":true}`, 0, ErrInvalid},
		{"trailing data", `{"op":"claim","volume":"pvc-1"}}`, 0, ErrInvalid},
		{"two messages", `{"op":"claim","volume":"a"} {"op":"drop","volume":"a"}`, 0, ErrInvalid},
		{"claim without volume", `{"op":"claim"}`, 0, ErrInvalid},
		{"volume with slash", `{"op":"drop","volume":"../x"}`, 0, ErrInvalid},
		{"volume too long", `{"op":"drop","volume":"` + strings.Repeat("a", 254) + `"}`, 0, ErrInvalid},
		{"claim with descriptors", `{"op":"claim","volume":"pvc-1"}`, 1, ErrInvalid},
		{"claim with a session", `{"op":"claim","volume":"pvc-1","session":{}}`, 0, ErrInvalid},
		{"deposit without descriptors", good, 0, ErrInvalid},
		{"deposit with two descriptors", good, 2, ErrInvalid},
		{"deposit without session", `{"op":"deposit","volume":"pvc-1"}`, 3, ErrInvalid},
		{"deposit with a bad loop path", strings.Replace(good, "/dev/loop7", "/dev/sda", 1), 3, ErrInvalid},
		{"deposit with a relative mount dir", strings.Replace(good, `"/run/cairn/fuse/pvc-1"`, `"fuse/pvc-1"`, 1), 3, ErrInvalid},
		{"deposit with protocol 8", strings.Replace(good, `"major":7`, `"major":8`, 1), 3, ErrInvalid},
		{"deposit with max_write 0", strings.Replace(good, `"maxWrite":1048576`, `"maxWrite":0`, 1), 3, ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeRequest([]byte(tc.msg), tc.fds)
			if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
				t.Fatalf("decodeRequest: %v, want %v", err, tc.want)
			}
		})
	}
}

func TestSessionValidate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(*Session)
		ok     bool
	}{
		{"good", func(*Session) {}, true},
		{"empty volume", func(s *Session) { s.Volume = "" }, false},
		{"volume with a space", func(s *Session) { s.Volume = "a b" }, false},
		{"unclean mount dir", func(s *Session) { s.MountDir = "/run/../x" }, false},
		{"file name with slash", func(s *Session) { s.FileName = "a/b" }, false},
		{"file name ..", func(s *Session) { s.FileName = ".." }, false},
		{"loop path with suffix", func(s *Session) { s.LoopPath = "/dev/loop1p1" }, false},
		{"protocol 7.11", func(s *Session) { s.FUSE.Minor = 11 }, false},
	} {
		s := goodSession()
		tc.mutate(&s)
		if err := s.Validate(); (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInvalid)) {
			t.Errorf("%s: Validate() = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

// TestErrorsRoundTrip: each refusal reaches the client as its sentinel.
func TestErrorsRoundTrip(t *testing.T) {
	for _, sentinel := range []error{ErrNoSession, ErrBusy, ErrInvalid, ErrInternal} {
		r := errorResponse(errors.Join(errors.New("context"), sentinel))
		b, err := encode(r)
		if err != nil {
			t.Fatal(err)
		}
		var back response
		if err := decodeResponse(b, &back); err != nil {
			t.Fatal(err)
		}
		if got := back.err(); !errors.Is(got, sentinel) {
			t.Errorf("%v came back as %v", sentinel, got)
		}
	}
	unknown := response{Error: &wireError{Code: "from-the-future", Message: "x"}}
	if !errors.Is(unknown.err(), ErrInternal) {
		t.Error("an unknown code is not ErrInternal")
	}
	if _, err := encode(request{Op: OpClaim, Volume: strings.Repeat("a", MaxMessage)}); !errors.Is(err, ErrInvalid) {
		t.Errorf("an oversize message encoded: %v", err)
	}
}
