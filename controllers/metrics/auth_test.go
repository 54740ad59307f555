package metrics

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestAuthenticated runs the metrics filter against a real API server
// (envtest): no token and a made-up token get 401; a real service
// account's token without the reader role gets 403 and changes nothing
// behind the filter; the same account bound to the ClusterRole in
// config/rbac/metrics_reader_role.yaml gets the metrics, and for another
// path it has no grant for, 403 again.
func TestAuthenticated(t *testing.T) {
	env := &envtest.Environment{}
	cfg, err := env.Start()
	if err != nil {
		t.Fatalf("envtest (KUBEBUILDER_ASSETS; make test sets it): %v", err)
	}
	// Best effort: a control plane slow to stop fails no assertion here.
	t.Cleanup(func() { _ = env.Stop() })
	cs := kubernetes.NewForConfigOrDie(cfg)
	ctx := context.Background()

	httpClient, err := rest.HTTPClientFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	filter, err := Authenticated(cfg, httpClient)
	if err != nil {
		t.Fatal(err)
	}
	var served atomic.Int32
	h, err := filter(logr.Discard(), http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		served.Add(1)
		if _, err := io.WriteString(w, "cairn_volume_size_bytes 1\n"); err != nil {
			t.Errorf("writing the metrics: %v", err)
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	var lastAuthenticate string
	get := func(path, token string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		lastAuthenticate = resp.Header.Get("WWW-Authenticate")
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "prometheus", Namespace: "default"}}
	if _, err := cs.CoreV1().ServiceAccounts("default").Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tr, err := cs.CoreV1().ServiceAccounts("default").CreateToken(ctx, "prometheus", &authv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	token := tr.Status.Token

	for _, tc := range []struct {
		name, path, token string
		code              int
		says              string
	}{
		{"no token", "/metrics", "", http.StatusUnauthorized, "bearer token is required"},
		{"a made-up token", "/metrics", "not-a-token", http.StatusUnauthorized, "not valid"},
		{"a service account without the role", "/metrics", token, http.StatusForbidden, "cairn-metrics-reader"},
	} {
		code, body := get(tc.path, tc.token)
		if code != tc.code || !strings.Contains(body, tc.says) {
			t.Errorf("%s: %d %q, want %d saying %q", tc.name, code, body, tc.code, tc.says)
		}
		if code == http.StatusUnauthorized && lastAuthenticate != `Bearer realm="cairn-metrics"` {
			t.Errorf("%s: a 401 without WWW-Authenticate: Bearer (%q)", tc.name, lastAuthenticate)
		}
	}
	if served.Load() != 0 {
		t.Fatalf("the metrics were served %d times to refused callers", served.Load())
	}

	// The role as deployed, bound to the account.
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "rbac", "metrics_reader_role.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	role := &rbacv1.ClusterRole{}
	if err := yaml.Unmarshal(raw, role); err != nil {
		t.Fatal(err)
	}
	role.Name = "cairn-metrics-reader" // the kustomization's prefix
	if _, err := cs.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "prometheus-metrics"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role.Name},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "prometheus", Namespace: "default"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The refusal is kept for refusedTTL; then the grant is seen.
	until := time.Now().Add(refusedTTL + deadline.Scale(20*time.Second))
	for {
		code, body := get("/metrics", token)
		if code == http.StatusOK && strings.Contains(body, "cairn_volume_size_bytes") {
			break
		}
		if time.Now().After(until) {
			t.Fatalf("the bound account still gets %d %q", code, body)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if served.Load() == 0 {
		t.Fatal("an allowed caller was not served")
	}
	if code, _ := get("/debug/pprof/", token); code != http.StatusForbidden {
		t.Fatalf("a path the role does not grant: %d, want 403", code)
	}

	// A flood of made-up tokens: beyond the burst the caller gets 429
	// without a review, and the allowed verdict stays.
	limited := 0
	for i := range 2 * reviewBurst {
		if code, _ := get("/metrics", fmt.Sprintf("made-up-%d", i)); code == http.StatusTooManyRequests {
			limited++
		}
	}
	if limited == 0 {
		t.Fatalf("%d made-up tokens in a burst were each reviewed", 2*reviewBurst)
	}
	if code, _ := get("/metrics", token); code != http.StatusOK {
		t.Fatalf("the allowed account after a flood of bad tokens: %d", code)
	}
}
