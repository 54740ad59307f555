package replicaserver

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/grpcalive"
	"github.com/cairn-io/cairn/dataplane/internal/rebuildcodec"
	"github.com/cairn-io/cairn/dataplane/replica"
)

// MaxControlMessage bounds gRPC control messages: rebuild data moves in
// chunks of up to 4 MiB, plus framing.
const MaxControlMessage = 16 << 20

// Options configure Start.
type Options struct {
	// Data is the listener for dataconn (required).
	Data net.Listener
	// Local is a second dataconn listener (optional), a unix socket for
	// an engine on the node: the same server (workers, key, replica)
	// serves it, without DataTLS (dataconn.ServerOptions.TLS applies to
	// TCP listeners only).
	Local net.Listener
	// Control is the listener for the gRPC control API (optional).
	Control net.Listener
	// Workers bounds concurrent I/O (see dataconn.ServerOptions).
	Workers int
	// Key, when set, is the volume's key: data connections must prove
	// they hold it (dataconn.ServerOptions.Key).
	Key []byte
	// ControlTLS, when set, serves the control API with it (mutual TLS).
	ControlTLS *tls.Config
	// SourceTLS, when set, is the mutual TLS this replica's pulls of
	// rebuild data (LayerPull) connect to other replicas' control APIs
	// with; without, they connect in plain text, as a control API
	// served without ControlTLS is reached.
	SourceTLS *tls.Config
	// DataTLS, when set, serves the data port with it
	// (dataconn.ServerOptions.TLS) when it is a TCP one: the volume's
	// traffic is encrypted.
	DataTLS *tls.Config
	Logger  logr.Logger
}

// Running is a replica being served.
type Running struct {
	// Replica is the replica served.
	Replica *replica.Replica
	data    *dataconn.Server
	gs      *grpc.Server
	sources *Sources
	log     logr.Logger
	// Done is closed when the control API's Close was called or a
	// listener failed: the owner should call Shutdown.
	Done     <-chan struct{}
	stopOnce sync.Once
}

// Start serves r on the listeners until Shutdown or Kill.
func Start(r *replica.Replica, opts Options) *Running {
	done := make(chan struct{})
	var once sync.Once
	stop := func() { once.Do(func() { close(done) }) }
	run := &Running{Replica: r, log: opts.Logger, Done: done,
		data: dataconn.NewServer(Backend{Replica: r}, dataconn.ServerOptions{Workers: opts.Workers, Key: opts.Key, TLS: opts.DataTLS, Logger: opts.Logger.WithName("dataconn")})}
	serve := func(l net.Listener, what string) {
		if err := run.data.Serve(l); err != nil && !errors.Is(err, dataconn.ErrServerClosed) {
			opts.Logger.Error(err, what+" failed")
			stop()
		}
	}
	go serve(opts.Data, "data listener")
	if opts.Local != nil {
		go serve(opts.Local, "local data listener")
	}
	if opts.Control != nil {
		sopts := append(rebuildcodec.ServerOptions(), grpc.MaxRecvMsgSize(MaxControlMessage), grpc.MaxSendMsgSize(MaxControlMessage), grpcalive.Serve(),
			grpc.ForceServerCodecV2(newCodec()))
		if opts.ControlTLS != nil {
			sopts = append(sopts, grpc.Creds(credentials.NewTLS(opts.ControlTLS)))
		}
		run.gs = grpc.NewServer(sopts...)
		run.sources = NewSources(opts.SourceTLS)
		replicav1.RegisterReplicaServiceServer(run.gs, &Control{Replica: r, DataAddress: opts.Data.Addr().String(), OnClose: stop, Sources: run.sources,
			recycleReads: true})
		go func() {
			if err := run.gs.Serve(opts.Control); err != nil {
				opts.Logger.Error(err, "control listener failed")
				stop()
			}
		}()
	}
	return run
}

// Shutdown lets requests already read finish (bounded by ctx), makes the
// data durable, closes the replica and stops the control API.
func (run *Running) Shutdown(ctx context.Context) {
	run.stopOnce.Do(func() {
		if err := run.data.Shutdown(ctx); err != nil {
			run.log.Error(err, "data connections did not drain in time; closed them")
		}
		if err := run.Replica.Flush(); err != nil && !errors.Is(err, replica.ErrClosed) {
			run.log.Error(err, "final flush failed")
		}
		if err := run.Replica.Close(); err != nil {
			run.log.Error(err, "close failed")
		}
		if run.gs != nil {
			done := make(chan struct{})
			go func() { run.gs.GracefulStop(); close(done) }()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				run.gs.Stop()
			}
			run.sources.Close() // after the pulls in flight, which use them
		}
	})
}

// Kill stops serving at once, as if the process died: connections are cut
// and nothing is flushed (the page cache keeps what was written, as after
// a SIGKILL). The replica is closed so its directory can be reopened.
func (run *Running) Kill() {
	run.stopOnce.Do(func() {
		if run.gs != nil {
			run.sources.Close()
			run.gs.Stop()
		}
		run.data.Close()
		run.Replica.Close()
	})
}
