package csi

import (
	"context"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
)

// logCalls logs each call with its request, secrets stripped, and its
// outcome, and puts the logger in the call's context.
func logCalls(log logr.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		l := log.WithValues("method", info.FullMethod)
		ctx = logr.NewContext(ctx, l)
		start := time.Now()
		if m, ok := req.(proto.Message); ok {
			l.V(1).Info("call", "request", stripSecrets(m))
		}
		resp, err := handler(ctx, req)
		if err != nil {
			l.Info("call failed", "request", stripSecrets(req.(proto.Message)), "code", status.Code(err).String(),
				"error", status.Convert(err).Message(), "took", time.Since(start).String())
		} else {
			l.V(1).Info("call done", "took", time.Since(start).String())
		}
		return resp, err
	}
}

// logFrom returns the call's logger.
func logFrom(ctx context.Context) logr.Logger {
	return logr.FromContextOrDiscard(ctx)
}

// stripSecrets returns m as text with every field the CSI spec marks
// csi_secret (StorageClass and VolumeSnapshotClass secrets) replaced by
// "***stripped***".
func stripSecrets(m proto.Message) string {
	c := proto.Clone(m)
	strip(c.ProtoReflect())
	return formatProto(c)
}

func strip(m protoreflect.Message) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if isSecret(fd) {
			switch {
			case fd.IsMap():
				mp := m.Mutable(fd).Map()
				mp.Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
					mp.Set(k, protoreflect.ValueOfString("***stripped***"))
					return true
				})
			case fd.Kind() == protoreflect.StringKind && !fd.IsList():
				m.Set(fd, protoreflect.ValueOfString("***stripped***"))
			default:
				m.Clear(fd)
			}
			return true
		}
		switch {
		case fd.IsMap():
			if fd.MapValue().Message() != nil {
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					strip(mv.Message())
					return true
				})
			}
		case fd.IsList():
			if fd.Message() != nil {
				for i := 0; i < v.List().Len(); i++ {
					strip(v.List().Get(i).Message())
				}
			}
		case fd.Message() != nil:
			strip(v.Message())
		}
		return true
	})
}

func isSecret(fd protoreflect.FieldDescriptor) bool {
	opts, ok := fd.Options().(*descriptorpb.FieldOptions)
	if !ok || opts == nil {
		return false
	}
	secret, _ := proto.GetExtension(opts, csipb.E_CsiSecret).(bool)
	return secret
}
