// Package browser renders pages in headless Chromium for tests that check
// what a person sees (the manager's web page).
package browser

import (
	"context"
	"fmt"
	"os/exec"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// Options says how to render.
type Options struct {
	// Width and Height are the window's size in pixels.
	Width, Height int
	// Screenshot, if set, is a file to save a screenshot of the page to.
	Screenshot string
}

// Render loads url in headless Chromium and returns the DOM it built,
// after saving a screenshot if asked. The test is skipped where Chromium
// is not installed.
func Render(t *testing.T, url string, o Options) string {
	t.Helper()
	bin, err := exec.LookPath("chromium")
	if err != nil {
		t.Skip("chromium is not installed (make test-tools installs it)")
	}
	args := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--user-data-dir=" + t.TempDir(),
		fmt.Sprintf("--window-size=%d,%d", o.Width, o.Height)}
	ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(3*time.Minute))
	defer cancel()
	if o.Screenshot != "" {
		if out, err := exec.CommandContext(ctx, bin, append(args, "--screenshot="+o.Screenshot, url)...).CombinedOutput(); err != nil {
			t.Fatalf("chromium --screenshot: %v\n%s", err, out)
		}
	}
	out, err := exec.CommandContext(ctx, bin, append(args, "--dump-dom", url)...).Output()
	if err != nil {
		t.Fatalf("chromium --dump-dom: %v", err)
	}
	return string(out)
}
