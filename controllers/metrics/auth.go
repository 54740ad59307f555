package metrics

import (
	"context"
	"crypto/sha256"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
)

// Authenticated returns a metrics-server filter that serves a request
// only to a caller the API server vouches for: its bearer token is
// authenticated with a TokenReview, and the identity must be allowed to
// get the request's path as a non-resource URL (a SubjectAccessReview;
// the ClusterRole cairn-metrics-reader grants it for /metrics). Others get
// 401 (no or bad token) or 403 (not allowed). So the manager's metrics
// port is no open door on the pod network: Prometheus scrapes it with its
// service account's token. Answers are kept for a while per token and
// path (allowed: a minute; refused: ten seconds), so scrapes and bad
// callers do not each cost two API calls.
func Authenticated(cfg *rest.Config, httpClient *http.Client) (metricsserver.Filter, error) {
	cs, err := kubernetes.NewForConfigAndClient(cfg, httpClient)
	if err != nil {
		return nil, err
	}
	a := &authorizer{cs: cs, cache: map[[32]byte]verdict{}}
	return func(log logr.Logger, next http.Handler) (http.Handler, error) {
		return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			code, why := a.check(req)
			if code != http.StatusOK {
				log.V(1).Info("metrics request refused", "path", req.URL.Path, "code", code, "reason", why)
				http.Error(w, why, code)
				return
			}
			next.ServeHTTP(w, req)
		}), nil
	}, nil
}

const (
	allowedTTL  = time.Minute
	refusedTTL  = 10 * time.Second
	maxVerdicts = 1024 // the cache is emptied when it reaches this
	reviewLimit = 10 * time.Second
)

type verdict struct {
	code    int
	why     string
	expires time.Time
}

type authorizer struct {
	cs    kubernetes.Interface
	mu    sync.Mutex
	cache map[[32]byte]verdict // by hash of token and path
}

func (a *authorizer) check(req *http.Request) (int, string) {
	token, ok := strings.CutPrefix(req.Header.Get("Authorization"), "Bearer ")
	if !ok || token == "" {
		return http.StatusUnauthorized, "a bearer token is required (a service account's, allowed to get " + req.URL.Path + ")"
	}
	key := sha256.Sum256([]byte(req.URL.Path + "\x00" + token))
	now := time.Now()
	a.mu.Lock()
	v, hit := a.cache[key]
	a.mu.Unlock()
	if hit && now.Before(v.expires) {
		return v.code, v.why
	}
	v = a.review(req.Context(), token, req.URL.Path, strings.ToLower(req.Method))
	ttl := refusedTTL
	if v.code == http.StatusOK {
		ttl = allowedTTL
	}
	v.expires = now.Add(ttl)
	if v.code != http.StatusInternalServerError { // an API server that did not answer decides nothing
		a.mu.Lock()
		if len(a.cache) >= maxVerdicts {
			clear(a.cache)
		}
		a.cache[key] = v
		a.mu.Unlock()
	}
	return v.code, v.why
}

// review asks the API server who the token is and whether they may do
// verb on path.
func (a *authorizer) review(ctx context.Context, token, path, verb string) verdict {
	ctx, cancel := context.WithTimeout(ctx, reviewLimit)
	defer cancel()
	tr, err := a.cs.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
	if err != nil {
		return verdict{code: http.StatusInternalServerError, why: "the API server did not review the token: " + err.Error()}
	}
	if !tr.Status.Authenticated {
		return verdict{code: http.StatusUnauthorized, why: "the token is not valid for this cluster"}
	}
	u := tr.Status.User
	extra := map[string]authzv1.ExtraValue{}
	for k, v := range u.Extra {
		extra[k] = authzv1.ExtraValue(v)
	}
	sar, err := a.cs.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
		User: u.Username, UID: u.UID, Groups: u.Groups, Extra: extra,
		NonResourceAttributes: &authzv1.NonResourceAttributes{Path: path, Verb: verb},
	}}, metav1.CreateOptions{})
	if err != nil {
		return verdict{code: http.StatusInternalServerError, why: "the API server did not review the access: " + err.Error()}
	}
	if !sar.Status.Allowed {
		return verdict{code: http.StatusForbidden, why: u.Username + " may not " + verb + " " + path + " (bind it to the ClusterRole cairn-metrics-reader)"}
	}
	return verdict{code: http.StatusOK}
}
