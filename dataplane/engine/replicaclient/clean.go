package replicaclient

import (
	"context"

	"github.com/cairn-io/cairn/dataplane/engine"
)

var _ engine.CleanFlusher = (*Client)(nil)

// FlushClean sends a clean flush (engine.CleanFlusher). A replica older
// than clean flushes flushes plainly and keeps its write-intent bits.
func (c *Client) FlushClean(ctx context.Context) error { return c.data.FlushClean(ctx) }
