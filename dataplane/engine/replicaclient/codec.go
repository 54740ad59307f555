package replicaclient

import (
	"google.golang.org/grpc/encoding"

	"github.com/cairn-io/cairn/dataplane/internal/rebuildcodec"
)

// newCodec is the control connection's codec (internal/rebuildcodec), the
// one the replica's server uses too: the data of a LayerWriteRequest is
// sent without being copied, and a SnapshotReadResponse is decoded in
// place. The connection never receives a LayerWriteRequest, so nothing it
// decodes needs releasing.
func newCodec() encoding.CodecV2 { return rebuildcodec.New(rebuildcodec.Options{}) }
