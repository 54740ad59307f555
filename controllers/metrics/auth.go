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
// do the request's method on its path as a non-resource URL (a
// SubjectAccessReview; the ClusterRole cairn-metrics-reader grants get on
// /metrics). Others get 401 (no or bad token) or 403 (not allowed). So the
// manager's metrics port is no open door on the pod network: Prometheus
// scrapes it with its service account's token.
//
// Answers are kept for a while per token, method and path (allowed: a
// minute; refused: ten seconds), allowed and refused ones apart, so a
// flood of bad tokens cannot push Prometheus's out. Reviews not answered
// from there are limited to reviewRate a second (burst reviewBurst),
// beyond which callers get 429: a stranger sending made-up tokens costs
// the API server, where the manager's own reconciles queue too, a few
// calls a second at most.
func Authenticated(cfg *rest.Config, httpClient *http.Client) (metricsserver.Filter, error) {
	cs, err := kubernetes.NewForConfigAndClient(cfg, httpClient)
	if err != nil {
		return nil, err
	}
	a := &authorizer{cs: cs, allowed: map[[32]byte]verdict{}, refused: map[[32]byte]verdict{}, tokens: reviewBurst}
	return func(log logr.Logger, next http.Handler) (http.Handler, error) {
		a.log = log
		return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			code, why := a.check(req)
			if code != http.StatusOK {
				log.V(1).Info("metrics request refused", "path", req.URL.Path, "code", code, "reason", why)
				if code == http.StatusUnauthorized {
					w.Header().Set("WWW-Authenticate", `Bearer realm="cairn-metrics"`)
				}
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
	maxVerdicts = 1024 // each cache is emptied when it reaches this
	reviewLimit = 10 * time.Second
	reviewRate  = 5 // reviews a second, beyond the burst
	reviewBurst = 20
)

type verdict struct {
	code    int
	why     string
	expires time.Time
}

type authorizer struct {
	cs  kubernetes.Interface
	log logr.Logger

	mu               sync.Mutex
	allowed, refused map[[32]byte]verdict // by hash of method, path and token
	tokens           float64              // reviews that may start now
	filled           time.Time            // when tokens was last topped up
}

func (a *authorizer) check(req *http.Request) (int, string) {
	token, ok := strings.CutPrefix(req.Header.Get("Authorization"), "Bearer ")
	if !ok || token == "" {
		return http.StatusUnauthorized, "a bearer token is required (a service account's, allowed to get " + req.URL.Path + ")"
	}
	verb := strings.ToLower(req.Method)
	key := sha256.Sum256([]byte(verb + "\x00" + req.URL.Path + "\x00" + token))
	now := time.Now()
	a.mu.Lock()
	v, hit := a.allowed[key]
	if !hit || !now.Before(v.expires) {
		v, hit = a.refused[key]
	}
	if hit && now.Before(v.expires) {
		a.mu.Unlock()
		return v.code, v.why
	}
	// A token bucket for the reviews that reach the API server.
	a.tokens = min(reviewBurst, a.tokens+now.Sub(a.filled).Seconds()*reviewRate)
	a.filled = now
	if a.tokens < 1 {
		a.mu.Unlock()
		return http.StatusTooManyRequests, "too many requests with tokens not seen lately; try again in a second"
	}
	a.tokens--
	a.mu.Unlock()

	v = a.review(req.Context(), token, req.URL.Path, verb)
	if v.code == http.StatusInternalServerError { // an API server that did not answer decides nothing
		return v.code, v.why
	}
	cache, ttl := a.refused, refusedTTL
	if v.code == http.StatusOK {
		cache, ttl = a.allowed, allowedTTL
	}
	v.expires = now.Add(ttl)
	a.mu.Lock()
	if len(cache) >= maxVerdicts {
		clear(cache)
	}
	cache[key] = v
	a.mu.Unlock()
	return v.code, v.why
}

// review asks the API server who the token is and whether they may do
// verb on path.
func (a *authorizer) review(ctx context.Context, token, path, verb string) verdict {
	ctx, cancel := context.WithTimeout(ctx, reviewLimit)
	defer cancel()
	tr, err := a.cs.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
	if err != nil {
		a.log.Error(err, "TokenReview failed; metrics request refused")
		return verdict{code: http.StatusInternalServerError, why: "the token could not be reviewed; try again"}
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
		a.log.Error(err, "SubjectAccessReview failed; metrics request refused")
		return verdict{code: http.StatusInternalServerError, why: "the access could not be reviewed; try again"}
	}
	if !sar.Status.Allowed {
		return verdict{code: http.StatusForbidden, why: u.Username + " may not " + verb + " " + path + " (bind it to the ClusterRole cairn-metrics-reader)"}
	}
	return verdict{code: http.StatusOK}
}
