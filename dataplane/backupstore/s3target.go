package backupstore

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// S3Config says where an S3-compatible target is and how to reach it.
type S3Config struct {
	// Endpoint is the server's URL, "https://s3.example.com" or
	// "http://10.0.0.5:7070" (http only where the network is trusted).
	Endpoint string
	// Bucket holds the objects; it must exist.
	Bucket string
	// Prefix is put before every key ("cluster-a/"), so several stores
	// can share a bucket. Empty uses the bucket's root.
	Prefix string
	// Region is the bucket's region; empty lets the client ask the server.
	Region string
	// PathStyle addresses the bucket as https://endpoint/bucket (most
	// self-hosted servers) instead of https://bucket.endpoint.
	PathStyle bool
	// AccessKeyID, SecretAccessKey and SessionToken are the credentials
	// (SessionToken only for temporary ones).
	AccessKeyID     string
	SecretAccessKey string
	SessionToken    string
	// CACertPEM, if set, is the only set of CAs trusted for the endpoint's
	// certificate (a private CA); otherwise the system's roots are used.
	CACertPEM []byte
	// Checksum is what every put carries for the server to check the
	// body against (default S3ChecksumMD5).
	Checksum S3Checksum
}

// S3Checksum is the checksum a put carries so that the server refuses a
// body that did not arrive as sent.
type S3Checksum string

const (
	// S3ChecksumMD5 sends Content-MD5, which every S3-compatible server
	// checks. MD5 costs about 2 CPU-seconds per GiB here, and the server
	// pays as much again.
	S3ChecksumMD5 S3Checksum = "MD5"
	// S3ChecksumCRC32C sends x-amz-checksum-crc32c, which the CPU computes
	// in hardware (a few hundredths of MD5's cost). Only for servers that
	// check it (AWS S3, MinIO, versitygw): one that ignores the header
	// stores a body damaged on the way, found only when a restore checks
	// the block's SHA-256.
	S3ChecksumCRC32C S3Checksum = "CRC32C"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// S3Target is a Target in an S3-compatible bucket, through minio-go. The
// client's own retries are off: the Store retries, with its own bounds.
type S3Target struct {
	client   *minio.Client
	bucket   string
	prefix   string
	checksum S3Checksum
}

// NewS3Target returns a target for cfg. It does not contact the server.
func NewS3Target(cfg S3Config) (*S3Target, error) {
	u, err := url.Parse(cfg.Endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return nil, fmt.Errorf("S3 endpoint %q: give a URL such as https://s3.example.com", cfg.Endpoint)
	}
	if cfg.Bucket == "" {
		return nil, errors.New("S3 target: bucket is empty")
	}
	switch cfg.Checksum {
	case "":
		cfg.Checksum = S3ChecksumMD5
	case S3ChecksumMD5, S3ChecksumCRC32C:
	default:
		return nil, fmt.Errorf("S3 target: checksum %q: want %s or %s", cfg.Checksum, S3ChecksumMD5, S3ChecksumCRC32C)
	}
	transport, err := s3Transport(cfg.CACertPEM)
	if err != nil {
		return nil, err
	}
	lookup := minio.BucketLookupAuto
	if cfg.PathStyle {
		lookup = minio.BucketLookupPath
	}
	client, err := minio.New(u.Host, &minio.Options{
		Creds:        credentials.NewStaticV4(cfg.AccessKeyID, cfg.SecretAccessKey, cfg.SessionToken),
		Secure:       u.Scheme == "https",
		Transport:    transport,
		Region:       cfg.Region,
		BucketLookup: lookup,
		MaxRetries:   1,
		// minio-go sends an x-amz-checksum- header only from a client
		// that says its server supports checksums.
		TrailingHeaders: cfg.Checksum == S3ChecksumCRC32C,
	})
	if err != nil {
		return nil, fmt.Errorf("S3 target: %w", err)
	}
	prefix := strings.Trim(cfg.Prefix, "/")
	if prefix != "" {
		prefix += "/"
	}
	return &S3Target{client: client, bucket: cfg.Bucket, prefix: prefix, checksum: cfg.Checksum}, nil
}

func s3Transport(caPEM []byte) (*http.Transport, error) {
	tr, err := minio.DefaultTransport(true)
	if err != nil {
		return nil, err
	}
	// Bounded connection set-up: a black-holed endpoint fails the call's
	// dial within this, well inside the Store's per-call timeout.
	tr.DialContext = (&net.Dialer{Timeout: 15 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	tr.ResponseHeaderTimeout = time.Minute
	if len(caPEM) > 0 {
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(caPEM) {
			return nil, errors.New("S3 target: the custom CA holds no PEM certificate")
		}
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	return tr, nil
}

// Put implements Target. The server checks the body against its
// Content-MD5 or x-amz-checksum-crc32c (S3Config.Checksum; over HTTP and
// HTTPS alike, and what buckets with object lock ask for); the payload is
// not also signed chunk by chunk with SHA-256 (minio-go's streaming
// signature over plain HTTP), which would hash every byte twice more,
// here and on the server, for the same check.
func (t *S3Target) Put(ctx context.Context, key string, data []byte) error {
	opts := minio.PutObjectOptions{ContentType: "application/octet-stream", DisableMultipart: true, DisableContentSha256: true}
	if t.checksum == S3ChecksumCRC32C {
		var sum [4]byte
		binary.BigEndian.PutUint32(sum[:], crc32.Checksum(data, castagnoli))
		// An x-amz-checksum- header is sent as it is (and stops minio-go
		// adding a checksum of its own).
		opts.UserMetadata = map[string]string{"x-amz-checksum-crc32c": base64.StdEncoding.EncodeToString(sum[:])}
	} else {
		opts.SendContentMd5 = true
	}
	_, err := t.client.PutObject(ctx, t.bucket, t.prefix+key, bytes.NewReader(data), int64(len(data)), opts)
	return s3Error(err)
}

// Get implements Target.
func (t *S3Target) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	obj, err := t.client.GetObject(ctx, t.bucket, t.prefix+key, minio.GetObjectOptions{})
	if err != nil {
		return nil, s3Error(err)
	}
	// GetObject is lazy: Stat sends the request, so a missing key is
	// reported here rather than at the first Read.
	if _, err := obj.Stat(); err != nil {
		_ = obj.Close()
		return nil, s3Error(err)
	}
	return s3Reader{obj}, nil
}

type s3Reader struct{ obj *minio.Object }

func (r s3Reader) Read(p []byte) (int, error) {
	n, err := r.obj.Read(p)
	if err != nil && !errors.Is(err, io.EOF) {
		err = s3Error(err)
	}
	return n, err
}

func (r s3Reader) Close() error { return r.obj.Close() }

// Delete implements Target.
func (t *S3Target) Delete(ctx context.Context, key string) error {
	err := s3Error(t.client.RemoveObject(ctx, t.bucket, t.prefix+key, minio.RemoveObjectOptions{}))
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	return err
}

// List implements Target.
func (t *S3Target) List(ctx context.Context, prefix string, fn func(Object) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // stops the listing goroutine if fn fails
	for o := range t.client.ListObjects(ctx, t.bucket, minio.ListObjectsOptions{Prefix: t.prefix + prefix, Recursive: true}) {
		if o.Err != nil {
			return s3Error(o.Err)
		}
		if err := fn(Object{Key: strings.TrimPrefix(o.Key, t.prefix), Size: o.Size, ModTime: o.LastModified}); err != nil {
			return err
		}
	}
	return ctx.Err()
}

// s3Error maps a minio-go error to the Target conventions.
func s3Error(err error) error {
	if err == nil {
		return nil
	}
	resp := minio.ToErrorResponse(err)
	switch {
	case resp.Code == "NoSuchKey":
		return fmt.Errorf("%w: %w", ErrNotFound, err)
	case resp.StatusCode >= 500, resp.StatusCode == http.StatusTooManyRequests, resp.StatusCode == http.StatusRequestTimeout,
		resp.Code == "SlowDown", resp.Code == "RequestTimeout", resp.Code == "InternalError", resp.Code == "ServiceUnavailable":
		return Transient(err)
	case resp.Code != "":
		return err // the server answered: access denied, no such bucket, ...
	}
	var netErr net.Error
	if errors.As(err, &netErr) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) ||
		errors.Is(err, context.DeadlineExceeded) {
		return Transient(err)
	}
	return err
}
