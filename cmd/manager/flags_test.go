package main

import (
	"strings"
	"testing"
	"time"

	"github.com/cairn-io/cairn/controllers/volume"
)

// TestCheckFlags: flag values the manager cannot run with are refused
// with the flag named; the defaults pass.
func TestCheckFlags(t *testing.T) {
	good := func() (*volume.Reconciler, pkiFlags) {
		return &volume.Reconciler{ReplenishmentWait: time.Minute, ConcurrentRebuildLimit: 1, OverProvisioningPercent: 100},
			pkiFlags{enabled: true, validity: 24 * time.Hour}
	}
	vr, pki := good()
	if err := checkFlags(vr, pki); err != nil {
		t.Fatalf("good flags refused: %v", err)
	}
	pki.dataTLS = true
	if err := checkFlags(vr, pki); err != nil {
		t.Fatalf("--data-tls with --instance-manager-tls refused: %v", err)
	}
	for name, tc := range map[string]struct {
		change func(*volume.Reconciler, *pkiFlags)
		flag   string
	}{
		"no rebuilds":           {func(vr *volume.Reconciler, _ *pkiFlags) { vr.ConcurrentRebuildLimit = 0 }, "--concurrent-rebuild-limit"},
		"short validity":        {func(_ *volume.Reconciler, p *pkiFlags) { p.validity = time.Hour }, "--certificate-validity"},
		"data TLS without a CA": {func(_ *volume.Reconciler, p *pkiFlags) { p.dataTLS, p.enabled = true, false }, "--data-tls needs --instance-manager-tls"},
		"no over-provisioning":  {func(vr *volume.Reconciler, _ *pkiFlags) { vr.OverProvisioningPercent = 0 }, "--over-provisioning-percent"},
	} {
		vr, pki := good()
		tc.change(vr, &pki)
		err := checkFlags(vr, pki)
		if err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("%s: %v, want an error naming %s", name, err, tc.flag)
		}
	}
}
