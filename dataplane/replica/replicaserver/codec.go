package replicaserver

import (
	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/internal/rebuildcodec"
	"github.com/cairn-io/cairn/dataplane/replica"
)

// codec is the control API's codec (internal/rebuildcodec), the one the
// engine's client uses too, shared by every control server of the
// process and by its connections to the replicas it pulls rebuild data
// from (Sources): a SnapshotReadResponse's data is sent without being
// copied, and a LayerWriteRequest, or a SnapshotReadResponse a pull
// receives, is decoded into a recycled buffer with its data aligned for
// a replica's direct I/O (LayerPull gives the response back once
// written).
var codec = rebuildcodec.New(rebuildcodec.Options{DataAlignment: replica.BlockSize, RecycleSnapshotReads: true})

func newCodec() *rebuildcodec.Codec { return codec }

// releaseLayerWrite gives back the buffer a LayerWriteRequest's data was
// decoded into, once nothing uses the data any more.
func releaseLayerWrite(req *replicav1.LayerWriteRequest) { codec.ReleaseLayerWrite(req) }

// releaseSnapshotRead gives back the buffer a pulled SnapshotReadResponse
// was decoded into, once its data is written.
func releaseSnapshotRead(resp *replicav1.SnapshotReadResponse) { codec.ReleaseSnapshotRead(resp) }
