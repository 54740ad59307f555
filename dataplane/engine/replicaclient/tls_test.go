package replicaclient_test

import (
	"context"
	"crypto/tls"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
	"github.com/cairn-io/cairn/dataplane/testutil/testpki"
)

// TestDialSaysWhichSideRefusedTLS: a replica whose control API and the
// client disagree about TLS fails the dial with an error that says
// which side refused what and what to check, not that nothing serves
// the control API; the matching pair connects.
func TestDialSaysWhichSideRefusedTLS(t *testing.T) {
	ca, other := testpki.New(t), testpki.New(t)
	srvTLS, cliTLS := ca.Pair(t, "engine")
	_, otherCli := other.Pair(t, "engine")
	foreignCert := cliTLS.Clone() // trusts the replica; its certificate is another CA's
	foreignCert.Certificates = otherCli.Certificates
	distrusting := cliTLS.Clone() // its certificate is good; it trusts another CA only
	distrusting.RootCAs = other.Pool

	cases := []struct {
		name       string
		srv, cli   *tls.Config
		is         error
		mentions   []string
		shouldWork bool
	}{
		{name: "matching", srv: srvTLS, cli: cliTLS, shouldWork: true},
		{name: "client certificate of another CA", srv: srvTLS, cli: foreignCert, is: replicaclient.ErrControlTLS,
			mentions: []string{"certificate", "--tls-client-ca"}}, // refused at the handshake or by closing under the first write
		{name: "server certificate not trusted", srv: srvTLS, cli: distrusting, is: replicaclient.ErrControlTLS,
			mentions: []string{"does not accept the certificate it presented"}},
		{name: "TLS client, plain control API", srv: nil, cli: cliTLS, is: replicaclient.ErrControlTLS,
			mentions: []string{"serves no TLS"}},
		{name: "plain client, TLS control API", srv: srvTLS, cli: nil, is: replicaclient.ErrNoControlAPI,
			mentions: []string{"requires TLS"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			data, ctl := listen(t), listen(t)
			run := replicaserver.Start(openReplica(t), replicaserver.Options{Data: data, Control: ctl, ControlTLS: c.srv})
			t.Cleanup(run.Kill)
			addr := data.Addr().String() + "," + ctl.Addr().String()
			cl, err := replicaclient.Dial(context.Background(), addr, replicaclient.Options{QuickTimeout: 10 * time.Second, ControlTLS: c.cli})
			if c.shouldWork {
				if err != nil {
					t.Fatalf("dial: %v", err)
				}
				cl.Close()
				return
			}
			if err == nil {
				cl.Close()
				t.Fatal("the dial succeeded")
			}
			if !errors.Is(err, c.is) {
				t.Errorf("dial: %v, want %v", err, c.is)
			}
			for _, want := range append(c.mentions, ctl.Addr().String()) {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("dial: %q does not mention %q", err, want)
				}
			}
			if strings.Contains(err.Error(), "nothing serves") {
				t.Errorf("dial: %q says nothing serves the control API, which answered", err)
			}
		})
	}
}
